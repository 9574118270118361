"""Newton–Schulz orthogonalisation of batches of matrices (Muon; ATLAS Eq.32-33).

See docs/concepts/memory.md#newton-schulz.

X_0 = S / (‖S‖_F + ε), transposed when rows > cols; k times: A = X Xᵀ, X ← aX + (bA + cA²)X with Muon's
quintic coefficients (a, b, c) = (3.4445, −4.7750, 2.0315); transposed back. As k grows the result tends
to the semi-orthogonal polar factor of S. Optionally scaled by √max(1, rows/cols) (Muon's shape factor).
"""
from __future__ import annotations

import math

import torch

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  coefficients=MUON_COEFFICIENTS, shape_factor: bool = False) -> torch.Tensor:
    """Approximate polar factor of each matrix in ``s: [..., rows, cols]`` (same shape out)."""
    if s.dim() < 2:
        raise ValueError(f"Newton–Schulz needs matrices, got a tensor of shape {tuple(s.shape)}")
    a, b, c = coefficients
    rows, cols = s.shape[-2:]
    x = s.mT if rows > cols else s
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.mT if rows > cols else x
    if shape_factor:
        x = x * math.sqrt(max(1.0, rows / cols))
    return x
