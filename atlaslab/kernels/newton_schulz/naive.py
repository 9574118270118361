"""Newton–Schulz orthogonalisation of batches of matrices (Muon; ATLAS Eq.32-33).

See docs/concepts/memory.md#newton-schulz.

X_0 = S / (‖S‖_F + ε), transposed when rows > cols; k times: A = X Xᵀ, X ← aX + (bA + cA²)X with Muon's
quintic coefficients (a, b, c) = (3.4445, −4.7750, 2.0315); transposed back. As k grows the result tends
to the semi-orthogonal polar factor of S. Optionally scaled by √max(1, rows/cols) (Muon's shape factor).
``coefficients`` may also be a schedule, one (a, b, c) per step: :data:`LACT_COEFFICIENTS` is the 5-step one
LaCT's reference code uses (from modded-nanogpt; docs/concepts/memory.md#newton-schulz).
"""
from __future__ import annotations

import math

import torch

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: A per-step schedule: step i uses ``LACT_COEFFICIENTS[i]`` (5 steps).
LACT_COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                     (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def is_schedule(coefficients) -> bool:
    """True for a per-step schedule ``((a, b, c), …)``, False for one ``(a, b, c)`` used at every step."""
    return len(coefficients) > 0 and isinstance(coefficients[0], (tuple, list))


def step_coefficients(coefficients, steps: int):
    """The ``steps`` triples Newton–Schulz uses: a schedule (exactly ``steps`` long) or one triple repeated."""
    if not is_schedule(coefficients):
        return [tuple(coefficients)] * steps
    if len(coefficients) != steps:
        raise ValueError(f"Newton–Schulz: a schedule of {len(coefficients)} coefficient triples for {steps} steps")
    return [tuple(c) for c in coefficients]


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  coefficients=MUON_COEFFICIENTS, shape_factor: bool = False) -> torch.Tensor:
    """Approximate polar factor of each matrix in ``s: [..., rows, cols]`` (same shape out).

    ``coefficients``: one (a, b, c) for every step, or a schedule of ``steps`` triples.
    """
    if s.dim() < 2:
        raise ValueError(f"Newton–Schulz needs matrices, got a tensor of shape {tuple(s.shape)}")
    rows, cols = s.shape[-2:]
    x = s.mT if rows > cols else s
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])            # [N, r, c] (r ≤ c): each step is three batched GEMMs
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for a, b, c in step_coefficients(coefficients, steps):
        gram = torch.bmm(x, x.mT)                                   # A = X Xᵀ
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)     # bA + cA² in one GEMM
        x = torch.baddbmm(x, poly, x, beta=a)                       # aX + (bA + cA²) X in one GEMM
    x = x.reshape(*lead, *x.shape[-2:])
    x = x.mT if rows > cols else x
    if shape_factor:
        x = x * math.sqrt(max(1.0, rows / cols))
    return x


def newton_schulz_plain(s: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                        coefficients=MUON_COEFFICIENTS, shape_factor: bool = False) -> torch.Tensor:
    """:func:`newton_schulz` written as the equations read (A = X Xᵀ; X ← aX + (bA + cA²)X), the reference its
    fused GEMMs (``baddbmm``: 15–25 % less time forward + backward on a CPU) are tested against."""
    rows, cols = s.shape[-2:]
    x = s.mT if rows > cols else s
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for a, b, c in step_coefficients(coefficients, steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.mT if rows > cols else x
    if shape_factor:
        x = x * math.sqrt(max(1.0, rows / cols))
    return x
