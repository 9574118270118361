"""Fused Newton–Schulz for batches of small matrices (Muon; ATLAS Eq.32-33, spec §4 and §15.5).

One Triton program per matrix: the whole (transposed-if-tall) matrix X ``[R, C]`` (R ≤ C) lives in
registers / shared memory for all ``steps`` iterations, so the batch costs one launch and one read + one
write of each matrix, instead of 3 × ``steps`` batched-matmul launches with their intermediates in HBM.

    X_0 = S / (‖S‖_F + ε)   (transposed when rows > cols)
    k times:  A = X Xᵀ;  X ← aX + (bA + cA²) X        (a, b, c) = Muon's quintic (3.4445, −4.7750, 2.0315)

The backward is the torch reference's (``atlaslab.kernels.newton_schulz``): recomputed under
``enable_grad`` and differentiated with ``torch.autograd.grad`` (no backward kernel yet).

Limits: padded R × C ≤ 128 × 128 (``supports``); larger matrices stay on the torch path. fp32 inputs use
IEEE-fp32 dots (``allow_tf32=False``; pass True on Ampere+ for speed at ~1e-3 relative error); fp16/bf16
inputs are multiplied in their own precision with fp32 accumulation, as Muon usually runs.
"""
from __future__ import annotations

import math

import torch

from ..newton_schulz import MUON_COEFFICIENTS, newton_schulz as newton_schulz_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package imports without triton; callers check available()
    triton = None

#: Largest padded tile (rows × cols after transposing to wide) kept in one program.
MAX_TILE = 128 * 128
MAX_SIDE = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    def _ns_kernel(X_ptr, Y_ptr, R, C, stride_b, stride_r, stride_c, eps, ca, cb, cc, scale,
                   STEPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LOW: tl.constexpr,
                   PRECISION: tl.constexpr):
        """One matrix per program. ``stride_r``/``stride_c`` address the (already transposed) wide view."""
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = pid * stride_b + rows[:, None] * stride_r + cols[None, :] * stride_c
        x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # zero padding stays zero
        norm = tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0))
        x = x / (norm + eps)
        for _ in range(STEPS):
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


def newton_schulz_forward(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=MUON_COEFFICIENTS,
                          shape_factor: bool = False, allow_tf32: bool = False) -> torch.Tensor:
    """The kernel alone (no autograd): ``s: [..., rows, cols]`` → same shape and dtype."""
    if not supports(s):
        raise ValueError(f"newton_schulz (triton): unsupported input {tuple(s.shape)} {s.dtype}")
    rows, cols = s.shape[-2:]
    x = s.reshape(-1, rows, cols).contiguous()
    y = torch.empty_like(x)
    n = x.shape[0]
    tall = rows > cols
    R, C = (cols, rows) if tall else (rows, cols)
    sr, sc = (x.stride(2), x.stride(1)) if tall else (x.stride(1), x.stride(2))
    a, b, c = (float(z) for z in coefficients)
    scale = math.sqrt(max(1.0, rows / cols)) if shape_factor else 1.0
    BR, BC = _pad(R), _pad(C)
    if n:
        _ns_kernel[(n,)](x, y, R, C, x.stride(0), sr, sc, float(eps), a, b, c, scale,
                         STEPS=int(steps), BR=BR, BC=BC, LOW=s.dtype != torch.float32,
                         PRECISION="tf32" if allow_tf32 else "ieee", num_warps=4 if BR * BC <= 64 * 64 else 8)
    return y.reshape(s.shape)


class _NewtonSchulz(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, steps, eps, coefficients, shape_factor, allow_tf32):
        ctx.save_for_backward(s)
        ctx.args = (steps, eps, coefficients, shape_factor)
        return newton_schulz_forward(s, steps, eps, coefficients, shape_factor, allow_tf32)

    @staticmethod
    def backward(ctx, grad_out):
        (s,) = ctx.saved_tensors
        with torch.enable_grad():
            s_ = (s.float() if s.dtype in (torch.float16, torch.bfloat16) else s).detach().requires_grad_(True)
            y = newton_schulz_torch(s_, *ctx.args)
            (grad_s,) = torch.autograd.grad(y, s_, grad_out.to(y.dtype))
        return grad_s.to(s.dtype), None, None, None, None, None


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=MUON_COEFFICIENTS,
                  shape_factor: bool = False, allow_tf32: bool = False) -> torch.Tensor:
    """Drop-in for :func:`atlaslab.kernels.newton_schulz.newton_schulz` on a fused Triton kernel.

    Args:
        s: ``[..., rows, cols]`` matrices (fp32 / fp16 / bf16; padded min(rows, cols) × max ≤ 128 × 128).
        steps: k, the number of quintic iterations (5 in ATLAS / Muon).
        eps: ε of the Frobenius normalisation.
        coefficients: (a, b, c) of the quintic.
        shape_factor: multiply by √max(1, rows/cols) (Muon's option; off in ATLAS).
        allow_tf32: let fp32 dots use TF32 tensor cores (faster, ~1e-3 relative error).

    Returns:
        ``[..., rows, cols]``, the approximate polar factor of each matrix. Differentiable: the backward
        recomputes the torch reference (no backward kernel).
    """
    return _NewtonSchulz.apply(s, int(steps), float(eps), tuple(coefficients), bool(shape_factor), bool(allow_tf32))
