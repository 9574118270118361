"""Fused Newton–Schulz for batches of small matrices (Muon; ATLAS Eq.32-33, spec §4 and §15.5).

One Triton program per matrix: the whole (transposed-if-tall) matrix X ``[R, C]`` (R ≤ C) lives in
registers / shared memory for all ``steps`` iterations, so the batch costs one launch and one read + one
write of each matrix, instead of 3 × ``steps`` batched-matmul launches with their intermediates in HBM.

    X_0 = S / (‖S‖_F + ε)   (transposed when rows > cols)
    k times:  A = X Xᵀ;  X ← aX + (bA + cA²) X        (a, b, c) = Muon's quintic (3.4445, −4.7750, 2.0315)
    Y = σ X_k  (transposed back; σ = √max(1, rows/cols) with ``shape_factor``, else 1)

Backward (``_ns_bwd_kernel``, one program per matrix, as the forward). When the input needs a gradient the
forward kernel also writes the iterates X_0 … X_{k−1} (fp32, padded ``[BR, BC]`` tiles: k · R · C floats per
matrix) and n = ‖S‖_F; the backward kernel walks the steps in reverse. Derivation, with ⟨U, V⟩ = tr(UᵀV), Ḡ
the incoming gradient of X_{i+1} = aX + B X, A = X Xᵀ, B = bA + cA² (A, B symmetric):

    dX_{i+1} = a dX + B dX + (b dA + c(dA A + A dA)) X,      dA = dX Xᵀ + X dXᵀ
    ⟨Ḡ, B dX⟩ = ⟨B Ḡ, dX⟩
    ⟨Ḡ, (b dA + c dA A + c A dA) X⟩ = ⟨M_A, dA⟩ with M_A = bM + c(MA + AM), M = Ḡ Xᵀ   (A = Aᵀ)
    ⟨M_A, dX Xᵀ + X dXᵀ⟩ = ⟨(M_A + M_Aᵀ) X, dX⟩,  M_A + M_Aᵀ = bP + c(PA + AP),  P = M + Mᵀ
    ⇒  Ḡ_i = aḠ + B Ḡ + (bP + c(PA + AP)) X_i

starting from Ḡ_k = σ · dY (in the wide view: the tall case only reads / writes through transposed strides,
which is the reference's ``mT``). The normalisation X_0 = S / (n + ε), n = ‖S‖_F, with dn = ⟨S, dS⟩ / n:

    dX_0 = dS / (n + ε) − S ⟨S, dS⟩ / (n (n + ε)²)   ⇒   dS̄ = Ḡ_0 / (n + ε) − X_0 ⟨X_0, Ḡ_0⟩ / n

(the second term dropped when n = 0, as torch's norm backward does). Padding stays zero through every
product (the padded rows / columns of X, Ḡ, A, B, P are zero). The backward multiplies fp32 operands whatever the
input dtype (TF32 or IEEE as :func:`.precision.dot_precision` chooses: TF32 for fp16 / bf16 inputs), as the torch fallback (autograd of the reference on ``S.float()``)
does. ``BACKWARD = "torch"`` (or ``ATLASLAB_NS_BACKWARD=torch`` at import) switches the backward to that
fallback: the reference recomputed under ``enable_grad`` and differentiated with ``torch.autograd.grad``.

Limits: padded R × C ≤ 128 × 128 (``supports``); larger matrices stay on the torch path. fp32 inputs use
IEEE-fp32 dots unless torch's float32 matmul precision (or ``allow_tf32=True``) allows TF32; fp16/bf16
inputs are multiplied in their own precision with fp32 accumulation in the forward, as Muon usually runs.
Status: forward and backward tested under ``TRITON_INTERPRET=1`` only (``tests/test_triton.py``,
``tests/test_triton_ns.py``); never run on a GPU, so the backward's register pressure at 128 × 128 (it holds
X, Ḡ, A, B, P at once) and its speed are unmeasured.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..newton_schulz import MUON_COEFFICIENTS
from ..newton_schulz import newton_schulz as newton_schulz_torch
from .fallback import with_torch_fallback
from .precision import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package imports without triton; callers check available()
    triton = None

#: Largest padded tile (rows × cols after transposing to wide) kept in one program.
MAX_TILE = 128 * 128
MAX_SIDE = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: "triton" (default): the backward kernel; "torch": autograd through the recomputed torch reference.
BACKWARD = os.environ.get("ATLASLAB_NS_BACKWARD", "triton").strip().lower()
#: Launches of the backward kernel (tests read it to check the kernel path really ran).
BACKWARD_LAUNCHES = 0


def _pad(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())   # tl.dot needs every side ≥ 16


def supports(s: torch.Tensor) -> bool:
    """True when ``s: [..., rows, cols]`` fits the kernel (dtype, tile size)."""
    if s.dim() < 2 or s.dtype not in DTYPES or s.numel() == 0:
        return False
    r, c = sorted(s.shape[-2:])
    return _pad(r) * _pad(c) <= MAX_TILE and _pad(c) <= MAX_SIDE


if triton is not None:

    @triton.jit
    def _ns_kernel(X_ptr, Y_ptr, Xs_ptr, N_ptr, R, C, stride_b, stride_r, stride_c, eps, ca, cb, cc, scale,
                   STEPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LOW: tl.constexpr,
                   PRECISION: tl.constexpr, SAVE: tl.constexpr):
        """One matrix per program. ``stride_r``/``stride_c`` address the (already transposed) wide view.
        With ``SAVE``: X_i → ``Xs[pid, i]`` (padded fp32 tiles, i < max(STEPS, 1)) and ‖S‖_F → ``N[pid]``."""
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = pid * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
        tile = rows[:, None] * BC + cols[None, :]
        x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # zero padding stays zero
        norm = tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0))
        x = x / (norm + eps)
        if SAVE:
            tl.store(N_ptr + pid, norm)
            if STEPS == 0:
                tl.store(Xs_ptr + pid * BR * BC + tile, x)
        for i in range(STEPS):
            if SAVE:
                tl.store(Xs_ptr + (pid * STEPS + i) * BR * BC + tile, x)
            if LOW:
                xl = x.to(X_ptr.dtype.element_ty)
                a = tl.dot(xl, tl.trans(xl))
                al = a.to(X_ptr.dtype.element_ty)
                bmat = cb * a + cc * tl.dot(al, al)
                x = ca * x + tl.dot(bmat.to(X_ptr.dtype.element_ty), xl)
            else:
                a = tl.dot(x, tl.trans(x), input_precision=PRECISION)
                bmat = cb * a + cc * tl.dot(a, a, input_precision=PRECISION)
                x = ca * x + tl.dot(bmat, x, input_precision=PRECISION)
        x = x * scale
        tl.store(Y_ptr + offs, x.to(Y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ns_bwd_kernel(DY_ptr, DS_ptr, Xs_ptr, N_ptr, R, C, stride_b, stride_r, stride_c, eps, ca, cb, cc, scale,
                       STEPS: tl.constexpr, NSAVE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                       PRECISION: tl.constexpr):
        """One matrix per program: Ḡ = σ dY, the steps' adjoints in reverse, then the normalisation's
        (module docstring). ``DY``/``DS`` share the wide-view strides; ``Xs``: ``[n, NSAVE, BR, BC]`` fp32."""
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = pid * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
        tile = rows[:, None] * BC + cols[None, :]
        g = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        for j in range(STEPS):
            x = tl.load(Xs_ptr + (pid * NSAVE + (STEPS - 1 - j)) * BR * BC + tile)
            a = tl.dot(x, tl.trans(x), input_precision=PRECISION)
            bmat = cb * a + cc * tl.dot(a, a, input_precision=PRECISION)
            m = tl.dot(g, tl.trans(x), input_precision=PRECISION)
            p = m + tl.trans(m)
            q = cb * p + cc * (tl.dot(p, a, input_precision=PRECISION) + tl.dot(a, p, input_precision=PRECISION))
            g = ca * g + tl.dot(bmat, g, input_precision=PRECISION) + tl.dot(q, x, input_precision=PRECISION)
        x0 = tl.load(Xs_ptr + pid * NSAVE * BR * BC + tile)
        norm = tl.load(N_ptr + pid)
        inner = tl.sum(tl.sum(x0 * g, axis=1), axis=0)
        inv = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
        ds = g / (norm + eps) - x0 * (inner * inv)
        tl.store(DS_ptr + offs, ds.to(DS_ptr.dtype.element_ty), mask=mask)


def _geometry(rows: int, cols: int, x: torch.Tensor):
    """(R, C, stride_r, stride_c) of the wide view of contiguous ``x: [n, rows, cols]``."""
    if rows > cols:
        return cols, rows, x.stride(2), x.stride(1)
    return rows, cols, x.stride(1), x.stride(2)


def _launch_forward(s, steps, eps, coefficients, shape_factor, allow_tf32, save):
    if not supports(s):
        raise ValueError(f"newton_schulz (triton): unsupported input {tuple(s.shape)} {s.dtype}")
    rows, cols = s.shape[-2:]
    x = s.reshape(-1, rows, cols).contiguous()
    y = torch.empty_like(x)
    n = x.shape[0]
    R, C, sr, sc = _geometry(rows, cols, x)
    a, b, c = (float(z) for z in coefficients)
    scale = math.sqrt(max(1.0, rows / cols)) if shape_factor else 1.0
    BR, BC = _pad(R), _pad(C)
    nsave = max(int(steps), 1)
    if save:
        xs = torch.empty(n, nsave, BR, BC, device=s.device, dtype=torch.float32)
        norms = torch.empty(n, device=s.device, dtype=torch.float32)
    else:
        xs = norms = y   # never touched (SAVE=False)
    if n:
        _ns_kernel[(n,)](x, y, xs, norms, R, C, x.stride(0), sr, sc, float(eps), a, b, c, scale,
                         STEPS=int(steps), BR=BR, BC=BC, LOW=s.dtype != torch.float32,
                         PRECISION=dot_precision(s.dtype, allow_tf32), SAVE=bool(save),
                         num_warps=4 if BR * BC <= 64 * 64 else 8)
    return y.reshape(s.shape), (xs, norms) if save else None


def newton_schulz_forward(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=MUON_COEFFICIENTS,
                          shape_factor: bool = False, allow_tf32: Optional[bool] = None) -> torch.Tensor:
    """The kernel alone (no autograd): ``s: [..., rows, cols]`` → same shape and dtype."""
    return _launch_forward(s, steps, eps, coefficients, shape_factor, allow_tf32, save=False)[0]


def newton_schulz_backward(grad_out: torch.Tensor, saved, s_shape, s_dtype, steps: int, eps: float,
                           coefficients, shape_factor: bool, allow_tf32: Optional[bool] = None) -> torch.Tensor:
    """The backward kernel alone: dS from dY and the forward's saved ``(iterates, norms)``."""
    global BACKWARD_LAUNCHES
    xs, norms = saved
    rows, cols = s_shape[-2:]
    dy = grad_out.reshape(-1, rows, cols).contiguous()
    ds = torch.empty(dy.shape, device=dy.device, dtype=s_dtype)
    n = dy.shape[0]
    R, C, sr, sc = _geometry(rows, cols, dy)
    a, b, c = (float(z) for z in coefficients)
    scale = math.sqrt(max(1.0, rows / cols)) if shape_factor else 1.0
    BR, BC = _pad(R), _pad(C)
    if n:
        _ns_bwd_kernel[(n,)](dy, ds, xs, norms, R, C, dy.stride(0), sr, sc, float(eps), a, b, c, scale,
                             STEPS=int(steps), NSAVE=xs.shape[1], BR=BR, BC=BC,
                             PRECISION=dot_precision(s_dtype, allow_tf32),
                             num_warps=4 if BR * BC <= 64 * 64 else 8)
        BACKWARD_LAUNCHES += 1
    return ds.reshape(s_shape)


class _NewtonSchulz(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, steps, eps, coefficients, shape_factor, allow_tf32):
        ctx.args = (steps, eps, coefficients, shape_factor)
        ctx.allow_tf32 = allow_tf32
        ctx.kernel_bwd = BACKWARD != "torch"
        save = ctx.kernel_bwd and ctx.needs_input_grad[0]
        y, saved = _launch_forward(s, steps, eps, coefficients, shape_factor, allow_tf32, save)
        ctx.s_meta = (s.shape, s.dtype)
        if save:
            ctx.save_for_backward(s, *saved)   # s too: the torch backward if the kernel cannot launch here
        elif ctx.needs_input_grad[0]:
            ctx.save_for_backward(s)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        s, *saved = ctx.saved_tensors

        def torch_path():
            with torch.enable_grad():
                s_ = (s.float() if s.dtype in (torch.float16, torch.bfloat16) else s).detach().requires_grad_(True)
                y = newton_schulz_torch(s_, *ctx.args)
                (grad_s,) = torch.autograd.grad(y, s_, grad_out.to(y.dtype))
            return grad_s.to(s.dtype)

        def kernel():
            return newton_schulz_backward(grad_out, saved, *ctx.s_meta, *ctx.args, allow_tf32=ctx.allow_tf32)
        grad_s = with_torch_fallback(kernel, torch_path, "newton_schulz backward") if ctx.kernel_bwd else torch_path()
        return grad_s, None, None, None, None, None


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=MUON_COEFFICIENTS,
                  shape_factor: bool = False, allow_tf32: Optional[bool] = None) -> torch.Tensor:
    """Drop-in for :func:`atlaslab.kernels.newton_schulz.newton_schulz` on a fused Triton kernel.

    Args:
        s: ``[..., rows, cols]`` matrices (fp32 / fp16 / bf16; padded min(rows, cols) × max ≤ 128 × 128).
        steps: k, the number of quintic iterations (5 in ATLAS / Muon).
        eps: ε of the Frobenius normalisation.
        coefficients: (a, b, c) of the quintic.
        shape_factor: multiply by √max(1, rows/cols) (Muon's option; off in ATLAS).
        allow_tf32: let fp32 dots use TF32 tensor cores (faster, ~1e-3 relative error).

    Returns:
        ``[..., rows, cols]``, the approximate polar factor of each matrix. Differentiable: the backward kernel
        walks the forward's saved iterates in reverse (``BACKWARD = "torch"``: autograd of the torch reference).
    """
    args = (int(steps), float(eps), tuple(coefficients), bool(shape_factor))
    return with_torch_fallback(lambda: _NewtonSchulz.apply(s, *args, allow_tf32),
                               lambda: newton_schulz_torch(s, *args), "newton_schulz")
