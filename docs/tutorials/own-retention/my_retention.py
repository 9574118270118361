"""A retention part of my own, registered from outside atlaslab: the memory lives in a Frobenius ball.

    A_t = α_t A_{t−1} + U_t                        the dual accumulator, updated linearly (α: the retention gate)
    W_t = Π_R(A_t) = A_t · min(1, R / ‖A_t‖_F)     the memory read and differentiated: A projected onto ‖W‖_F ≤ R

This is follow-the-regularised-leader with the ℓ2 regulariser restricted to the ball of radius R (a "lazy
projection"): the hard-constraint counterpart of Moneta's ℓq normalisation. Inside the ball the rule is plain
decay; a write that would leave the ball is rescaled back onto its surface, so ‖W‖_F never exceeds R at a chunk
end. ‖A‖_F is taken per sequence, per head and per fast-weight tensor.
"""
from dataclasses import dataclass

import torch

from atlaslab.memory.retention import Retention
from atlaslab.registry import PartConfig, check_range, register


@register("retention", "norm_ball")
class NormBall(Retention):
    """Norm-ball retention: W = A · min(1, R/‖A‖_F), A_t = α_t A_{t−1} + U_t (FTRL with an ℓ2-ball constraint)."""

    mirror = True     # keep the dual accumulator A in the state and read the memory as W = psi(A)

    @dataclass
    class Config(PartConfig):
        radius: float = 1.0     # R
        eps: float = 1e-12      # inside the square root: a finite gradient at A = 0 (a zero initial memory)

        def check(self) -> None:
            check_range("radius", self.radius, 1e-6, None, "must be positive, in")

    def psi(self, dual):
        return {name: self.project(a) for name, a in dual.items()}

    def project(self, a: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, a.dim()))           # a: [B, H, ...]: one norm per (sequence, head)
        norm = (a.pow(2).sum(dims, keepdim=True) + self.cfg.eps).sqrt()
        return a * torch.clamp(self.cfg.radius / norm, max=1.0)
