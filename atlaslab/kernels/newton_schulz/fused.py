"""Fused Newton–Schulz for batches of small matrices (Muon's quintic), forward and backward in Triton.

One program per matrix: the whole (transposed-if-tall) matrix lives in registers / shared memory for all steps, so
the batch costs one launch and one read and write of each matrix instead of 3 × ``steps`` batched matmuls. When the
input needs a gradient the forward also saves the iterates, and ``_ns_bwd_kernel`` walks them in reverse; above
``STAGED_TILE`` (padded 128 × 128, 64 × 256) one program would need more shared memory than an sm_90 block has, so
``_ns_bwd_staged_kernel`` keeps row blocks in registers and streams the products through a global workspace
(docs/kernels.md#newton-schulz gives the adjoint equations). Limits: padded R × C ≤ 128 × 128 (:func:`supports`).
``BACKWARD = "torch"`` (``ATLASLAB_NS_BACKWARD=torch``) runs autograd through :func:`.naive.newton_schulz` instead.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.newton_schulz.naive import MUON_COEFFICIENTS
from atlaslab.kernels.newton_schulz.naive import newton_schulz as newton_schulz_torch
from atlaslab.kernels.utils import dot_precision, pow2, reference_backward, with_torch_fallback

#: Largest padded tile (rows × cols after transposing to wide) kept in one program.
MAX_TILE = 128 * 128
MAX_SIDE = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: "triton" (default): the backward kernel; "torch": autograd through the recomputed torch reference.
BACKWARD = os.environ.get("ATLASLAB_NS_BACKWARD", "triton").strip().lower()
#: Launches of the backward kernels (tests read them to check the kernel path really ran), and of the staged one.
BACKWARD_LAUNCHES = 0
STAGED_LAUNCHES = 0


#: Padded tiles (R × C after transposing to wide) above this size take the staged backward (module docstring):
#: the one-program backward asks for more shared memory than an sm_90 block has at 128 × 128 and 64 × 256.
STAGED_TILE = 64 * 128
#: Rows per block of the staged backward (at most; ``staged_rows``).
STAGED_ROWS = 32
#: Programs of the staged backward (each loops over matrices with its own workspace); None: the GPU's SM count.
STAGED_PROGRAMS: Optional[int] = None


def staged(rows: int, cols: int) -> bool:
    """True when the backward of ``[rows, cols]`` matrices takes the staged kernel (padded tile > ``STAGED_TILE``)."""
    return pow2(min(rows, cols)) * pow2(max(rows, cols)) > STAGED_TILE


def staged_rows(br: int) -> int:
    """Row block of the staged backward for ``br`` padded rows: ``br / 2`` up to ``STAGED_ROWS``, at least 16."""
    return max(16, min(STAGED_ROWS, br // 2))


def staged_programs(n: int, device: torch.device) -> int:
    """Programs of the staged backward for ``n`` matrices: one per SM (``STAGED_PROGRAMS`` overrides), ≤ n."""
    cap = STAGED_PROGRAMS
    if cap is None:
        cap = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else n
    return max(1, min(n, int(cap)))


def supports(s: torch.Tensor) -> bool:
    """True when ``s: [..., rows, cols]`` fits the kernel (dtype, tile size)."""
    if s.dim() < 2 or s.dtype not in DTYPES or s.numel() == 0:
        return False
    r, c = sorted(s.shape[-2:])
    return pow2(r) * pow2(c) <= MAX_TILE and pow2(c) <= MAX_SIDE


if triton is not None:

    @triton.jit
    def _matrix_tile(R, C, stride_b, stride_r, stride_c, BR: tl.constexpr, BC: tl.constexpr):
        """Program pid's matrix (one per program): (pid, the ``[BR, BC]`` mask of its R × C entries, their offsets
        in the strided wide view, their offsets in a padded fp32 ``[BR, BC]`` tile)."""
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = pid * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
        tile = rows[:, None] * BC + cols[None, :]
        return pid, mask, offs, tile

    @triton.jit
    def _ns_kernel(X_ptr, Y_ptr, Xs_ptr, N_ptr, R, C, stride_b, stride_r, stride_c, eps, ca, cb, cc, scale,
                   STEPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LOW: tl.constexpr,
                   PRECISION: tl.constexpr, SAVE: tl.constexpr):
        """One matrix per program. ``stride_r``/``stride_c`` address the (already transposed) wide view.
        With ``SAVE``: X_i → ``Xs[pid, i]`` (padded fp32 tiles, i < max(STEPS, 1)) and ‖S‖_F → ``N[pid]``."""
        pid, mask, offs, tile = _matrix_tile(R, C, stride_b, stride_r, stride_c, BR, BC)
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
        pid, mask, offs, tile = _matrix_tile(R, C, stride_b, stride_r, stride_c, BR, BC)
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

    @triton.jit
    def _ns_bwd_staged_kernel(DY_ptr, DS_ptr, Xs_ptr, N_ptr, W_ptr, n_mat, R, C, stride_b, stride_r, stride_c,
                              eps, ca, cb, cc, scale, STEPS: tl.constexpr, NSAVE: tl.constexpr, BR: tl.constexpr,
                              BC: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr):
        """The backward of :func:`_ns_bwd_kernel` in row blocks of ``BM`` rows (module docstring, "Staged backward").

        Each program loops over matrices ``pid, pid + nprog, …`` with its own fp32 workspace
        ``W[pid] = (Ḡ⁰ [BR, BC], Ḡ¹ [BR, BC], A [BR, BR], P [BR, BR])`` (M = Ḡ Xᵀ shares the Ḡ buffer that the
        step writes last). ``DY``/``DS`` share the wide-view strides; ``Xs``: ``[n, NSAVE, BR, BC]`` fp32,
        ``N``: ``[n]``. A barrier separates the stages (another thread reads what one wrote)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        rm = tl.arange(0, BM)
        rr = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        GSIZE: tl.constexpr = BR * BC
        ASIZE: tl.constexpr = BR * BR
        w_g = W_ptr + pid.to(tl.int64) * (2 * GSIZE + 2 * ASIZE)   # Ḡ buffers 0 and 1
        w_a = w_g + 2 * GSIZE                                       # A = X Xᵀ
        w_p = w_a + ASIZE                                           # P = M + Mᵀ
        full_g = rr[:, None] * BC + cols[None, :]                   # a whole [BR, BC] tile
        full_a = rr[:, None] * BR + rr[None, :]                     # a whole [BR, BR] tile
        for it in range(0, tl.cdiv(n_mat - pid, nprog)):
            m64 = pid.to(tl.int64) + it * nprog                     # matrices pid, pid + nprog, …
            x_base = Xs_ptr + m64 * NSAVE * GSIZE
            # Ḡ_k = σ dY (zero in the padding) → buffer 0
            for r0 in tl.static_range(0, BR, BM):
                rows = r0 + rm
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                offs = m64 * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
                g = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
                tl.store(w_g + rows[:, None] * BC + cols[None, :], g)
            tl.debug_barrier()
            for j in range(STEPS):
                x_i = x_base + (STEPS - 1 - j) * GSIZE              # X_i, i = k − 1 − j
                g_cur = w_g + (j % 2) * GSIZE
                g_new = w_g + ((j + 1) % 2) * GSIZE                 # also holds M until stage 3 writes Ḡ_i
                # stage 1: A[r] = X[r] Xᵀ, M[r] = Ḡ[r] Xᵀ
                for r0 in tl.static_range(0, BR, BM):
                    rows = r0 + rm
                    x_r = tl.load(x_i + rows[:, None] * BC + cols[None, :])
                    g_r = tl.load(g_cur + rows[:, None] * BC + cols[None, :])
                    xt = tl.trans(tl.load(x_i + full_g))
                    a_r = tl.dot(x_r, xt, input_precision=PRECISION)
                    m_r = tl.dot(g_r, xt, input_precision=PRECISION)
                    tl.store(w_a + rows[:, None] * BR + rr[None, :], a_r)
                    tl.store(g_new + rows[:, None] * BR + rr[None, :], m_r)
                tl.debug_barrier()
                # stage 2: P[r] = M[r] + (Mᵀ)[r]
                for r0 in tl.static_range(0, BR, BM):
                    rows = r0 + rm
                    p_r = (tl.load(g_new + rows[:, None] * BR + rr[None, :])
                           + tl.load(g_new + rr[None, :] * BR + rows[:, None]))
                    tl.store(w_p + rows[:, None] * BR + rr[None, :], p_r)
                tl.debug_barrier()
                # stage 3: Ḡ_i[r] = aḠ[r] + B[r] Ḡ + Q[r] X,  B[r] = bA[r] + cA[r]A,  Q[r] = bP[r] + c(P[r]A + A[r]P)
                for r0 in tl.static_range(0, BR, BM):
                    rows = r0 + rm
                    a_r = tl.load(w_a + rows[:, None] * BR + rr[None, :])
                    p_r = tl.load(w_p + rows[:, None] * BR + rr[None, :])
                    a_f = tl.load(w_a + full_a)
                    b_r = cb * a_r + cc * tl.dot(a_r, a_f, input_precision=PRECISION)
                    q_r = cb * p_r + cc * tl.dot(p_r, a_f, input_precision=PRECISION)
                    q_r += cc * tl.dot(a_r, tl.load(w_p + full_a), input_precision=PRECISION)
                    upd = ca * tl.load(g_cur + rows[:, None] * BC + cols[None, :])
                    upd += tl.dot(b_r, tl.load(g_cur + full_g), input_precision=PRECISION)
                    upd += tl.dot(q_r, tl.load(x_i + full_g), input_precision=PRECISION)
                    tl.store(g_new + rows[:, None] * BC + cols[None, :], upd)
                tl.debug_barrier()
            # the normalisation: dS = Ḡ_0 / (n + ε) − X_0 ⟨X_0, Ḡ_0⟩ / n, the inner product over all row blocks
            g_fin = w_g + (STEPS % 2) * GSIZE
            inner = 0.0
            for r0 in tl.static_range(0, BR, BM):
                tile = (r0 + rm)[:, None] * BC + cols[None, :]
                inner += tl.sum(tl.sum(tl.load(x_base + tile) * tl.load(g_fin + tile), axis=1), axis=0)
            norm = tl.load(N_ptr + m64)
            inv = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
            for r0 in tl.static_range(0, BR, BM):
                rows = r0 + rm
                tile = rows[:, None] * BC + cols[None, :]
                ds = tl.load(g_fin + tile) / (norm + eps) - tl.load(x_base + tile) * (inner * inv)
                mask = (rows[:, None] < R) & (cols[None, :] < C)
                offs = m64 * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
                tl.store(DS_ptr + offs, ds.to(DS_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()                                      # before the next matrix overwrites Ḡ⁰


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
    BR, BC = pow2(R), pow2(C)
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
    global BACKWARD_LAUNCHES, STAGED_LAUNCHES
    xs, norms = saved
    rows, cols = s_shape[-2:]
    dy = grad_out.reshape(-1, rows, cols).contiguous()
    ds = torch.empty(dy.shape, device=dy.device, dtype=s_dtype)
    n = dy.shape[0]
    R, C, sr, sc = _geometry(rows, cols, dy)
    a, b, c = (float(z) for z in coefficients)
    scale = math.sqrt(max(1.0, rows / cols)) if shape_factor else 1.0
    BR, BC = pow2(R), pow2(C)
    precision = dot_precision(s_dtype, allow_tf32)
    if n and staged(rows, cols):
        nprog = staged_programs(n, dy.device)
        work = torch.empty(nprog, 2 * BR * BC + 2 * BR * BR, device=dy.device, dtype=torch.float32)
        _ns_bwd_staged_kernel[(nprog,)](dy, ds, xs, norms, work, n, R, C, dy.stride(0), sr, sc, float(eps), a, b, c,
                                        scale, STEPS=int(steps), NSAVE=xs.shape[1], BR=BR, BC=BC,
                                        BM=staged_rows(BR), PRECISION=precision, num_warps=8)
        BACKWARD_LAUNCHES += 1
        STAGED_LAUNCHES += 1
    elif n:
        _ns_bwd_kernel[(n,)](dy, ds, xs, norms, R, C, dy.stride(0), sr, sc, float(eps), a, b, c, scale,
                             STEPS=int(steps), NSAVE=xs.shape[1], BR=BR, BC=BC, PRECISION=precision,
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
            return reference_backward(lambda x: (newton_schulz_torch(x, *ctx.args),), (s,), (True,), (grad_out,))[0]

        def kernel():
            return newton_schulz_backward(grad_out, saved, *ctx.s_meta, *ctx.args, allow_tf32=ctx.allow_tf32)
        grad_s = with_torch_fallback(kernel, torch_path, "newton_schulz backward") if ctx.kernel_bwd else torch_path()
        return grad_s, None, None, None, None, None


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=MUON_COEFFICIENTS,
                  shape_factor: bool = False, allow_tf32: Optional[bool] = None) -> torch.Tensor:
    """Drop-in for :func:`.naive.newton_schulz` on a fused Triton kernel.

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
