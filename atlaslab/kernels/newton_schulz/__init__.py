"""Newton–Schulz orthogonalisation of batches of small matrices (Muon's quintic): the torch reference
(:mod:`.naive`, the CPU path), the fused Triton kernel (:mod:`.fused`) and the choice between them.

Muon (:mod:`atlaslab.memory.inner_optimizers`) calls :func:`orthogonalise` through :func:`select_newton_schulz`:
the kernel on CUDA (or the interpreter) for the dtypes and tile sizes it takes, the torch reference otherwise.
The dispatch lives with the op because it looks only at the tensor (docs/kernels.md#newton-schulz).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from atlaslab.kernels.newton_schulz.naive import LACT_COEFFICIENTS, MUON_COEFFICIENTS, is_schedule, newton_schulz
from atlaslab.kernels.utils import available, device_ok, forced_torch


def select_newton_schulz(s: torch.Tensor) -> Optional[Callable]:
    """The fused Newton–Schulz kernel (``newton_schulz``-compatible) for ``s: [..., rows, cols]``, or None."""
    if forced_torch() or not available() or device_ok(s) is not None:
        return None
    from atlaslab.kernels.newton_schulz.fused import newton_schulz as kernel, supports
    return kernel if supports(s) else None


def orthogonalise(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=None,
                  shape_factor: bool = False) -> torch.Tensor:
    """Newton–Schulz on the fused kernel when :func:`select_newton_schulz` finds it, else the torch reference
    (always for a per-step schedule of coefficients: the kernel takes one (a, b, c))."""
    coefficients = MUON_COEFFICIENTS if coefficients is None else coefficients
    fn = newton_schulz if is_schedule(coefficients) else (select_newton_schulz(s) or newton_schulz)
    return fn(s, steps, eps, coefficients, shape_factor)


__all__ = ["LACT_COEFFICIENTS", "MUON_COEFFICIENTS", "is_schedule", "newton_schulz", "orthogonalise",
           "select_newton_schulz"]
