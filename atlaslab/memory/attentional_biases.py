"""Attentional biases: the inner loss ℓ(M; k, v) the memory minimises while it reads.

See docs/concepts/memory.md#attentional-bias.

Each bias gives the per-token loss at a prediction ``pred = M(φ(k))`` and its gradient with respect to
the prediction, ``output_grad`` (the "error signal" e). The engine turns e into the fast-weight gradient
∇_θ ℓ = J_θ(M)ᵀ e by a vector–Jacobian product through the memory, so a new bias only needs these two.

Scaling (docs/concepts/memory.md#loss-scaling): ℓ2 = ½‖M(k) − v‖², dot = −⟨M(k), v⟩, ℓp = (1/p)‖M(k) − v‖_p^p,
so GD with step η is exactly the delta rule (β = η) on ℓ2 and exactly linear attention on the dot product.

Smooth surrogates (Miras Remark 5): Sign(x) ≈ tanh(αx), |x| ≈ √(x² + ε), used by ``output_grad``
when ``smooth: true`` (default for the non-smooth losses); ``loss`` is always the exact loss.

Shapes: ``pred, target: [..., d_v]``; ``delta`` (Huber δ_t): ``[...]``; ``loss`` → ``[...]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from atlaslab.memory.part import Part
from atlaslab.registry import PartConfig, check_choice, check_range, register


class AttentionalBias(Part):
    """Base class for inner losses."""

    #: False when ∇ℓ does not depend on the memory (the Hebbian / dot-product bias).
    depends_on_memory: bool = True
    #: True when the bias reads the input-dependent ``delta`` gate (Huber's δ_t).
    uses_delta: bool = False

    def loss(self, pred: torch.Tensor, target: torch.Tensor, delta: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def output_grad(self, pred: torch.Tensor, target: torch.Tensor, delta: Optional[torch.Tensor] = None):
        raise NotImplementedError


def smooth_sign(x: torch.Tensor, sharpness: float) -> torch.Tensor:
    """tanh(αx) ≈ Sign(x) (Miras Remark 5)."""
    return torch.tanh(sharpness * x)


def smooth_abs(x: torch.Tensor, eps: float) -> torch.Tensor:
    """√(x² + ε) ≈ |x| (Miras Remark 5)."""
    return torch.sqrt(x * x + eps)


@dataclass
class SmoothConfig(PartConfig):
    smooth: bool = True       # use tanh / sqrt surrogates in the gradient
    sharpness: float = 10.0   # α in tanh(αx)
    eps: float = 1e-6         # ε in √(x² + ε)

    def check(self) -> None:
        check_range("sharpness", self.sharpness, 1e-9, None, "must be positive, in")
        check_range("eps", self.eps, 0.0, None)


class _Smooth(AttentionalBias):
    def _sign(self, x):
        return smooth_sign(x, self.cfg.sharpness) if self.cfg.smooth else torch.sign(x)

    def _abs(self, x):
        return smooth_abs(x, self.cfg.eps) if self.cfg.smooth else x.abs()

    def _norm(self, e):
        sq = (e * e).sum(-1, keepdim=True)
        # the clamp keeps r/‖r‖ finite at r = 0 (torch.where back-propagates NaNs from the unused branch)
        return torch.sqrt(sq + self.cfg.eps) if self.cfg.smooth else torch.sqrt(sq).clamp_min(1e-12)


@register("attentional_bias", "dot")
class DotProduct(AttentionalBias):
    """Hebbian bias ℓ = −⟨M(k), v⟩; its gradient step writes +η v kᵀ (ATLAS Eq.45-46, Miras Eq.8)."""

    depends_on_memory = False

    @dataclass
    class Config(PartConfig):
        pass

    def loss(self, pred, target, delta=None):
        return -(pred * target).sum(-1)

    def output_grad(self, pred, target, delta=None):
        return -target.expand_as(pred) if target.shape != pred.shape else -target


@register("attentional_bias", "l2")
class L2(AttentionalBias):
    """ℓ2 regression ℓ = ½‖M(k) − v‖² (delta rule; Titans Eq.12, ATLAS Eq.47)."""

    @dataclass
    class Config(PartConfig):
        pass

    def loss(self, pred, target, delta=None):
        return 0.5 * ((pred - target) ** 2).sum(-1)

    def output_grad(self, pred, target, delta=None):
        return pred - target


@register("attentional_bias", "lp")
class Lp(_Smooth):
    """ℓp bias ℓ = (1/p)‖M(k) − v‖_p^p (Miras Eq.10-12, Moneta): e = Sign(r) ⊙ |r|^{p−1}, r = M(k) − v."""

    @dataclass
    class Config(SmoothConfig):
        p: float = 3.0

        def check(self) -> None:
            super().check()
            check_range("p", self.p, 1.0, None)

    def loss(self, pred, target, delta=None):
        p = self.cfg.p
        return (pred - target).abs().pow(p).sum(-1) / p

    def output_grad(self, pred, target, delta=None):
        r = pred - target
        return self._sign(r) * self._abs(r).pow(self.cfg.p - 1.0)


@register("attentional_bias", "l1")
class L1(_Smooth):
    """ℓ1 bias ℓ = ‖M(k) − v‖₁ (HGRN2 row of Miras Tab.1; the p = 1 "value-less" memory): e = Sign(r)."""

    @dataclass
    class Config(SmoothConfig):
        pass

    def loss(self, pred, target, delta=None):
        return (pred - target).abs().sum(-1)

    def output_grad(self, pred, target, delta=None):
        return self._sign(pred - target)


@register("attentional_bias", "huber")
class Huber(_Smooth):
    """Huber bias with threshold δ_t (Miras Eq.13-16; Yaad Eq.26 uses ``variant: mixture``).

    With r = M(k) − v:
    - ``mixture`` (Yaad): e = r if ‖r‖₂ ≤ δ_t else δ_t · Sign(r)   (ℓ2 inside, δ·ℓ1 outside);
    - ``norm``: Huber of ‖r‖₂: e = r if ‖r‖₂ ≤ δ_t else δ_t · r/‖r‖₂;
    - ``coordinate``: per coordinate, e_j = r_j if |r_j| ≤ δ_t else δ_t · Sign(r_j).
    δ_t is the input-dependent ``delta`` gate ([B, T, H]) when the layer provides one, else ``delta``.
    """

    uses_delta = True

    @dataclass
    class Config(SmoothConfig):
        variant: str = "mixture"   # mixture | norm | coordinate
        delta: float = 1.0         # δ when no input-dependent delta gate is given

        def check(self) -> None:
            super().check()
            check_choice("variant", self.variant, ("mixture", "norm", "coordinate"))
            check_range("delta", self.delta, 0.0, None)

    def _delta(self, pred, delta):
        if delta is None:
            return torch.full(pred.shape[:-1], self.cfg.delta, dtype=pred.dtype, device=pred.device)
        return delta

    def loss(self, pred, target, delta=None):
        r = pred - target
        d = self._delta(pred, delta)
        if self.cfg.variant == "coordinate":
            a, dd = r.abs(), d.unsqueeze(-1)
            return torch.where(a <= dd, 0.5 * r * r, dd * (a - 0.5 * dd)).sum(-1)
        n = r.norm(dim=-1)
        inside = 0.5 * n * n
        if self.cfg.variant == "norm":
            return torch.where(n <= d, inside, d * (n - 0.5 * d))
        return torch.where(n <= d, inside, d * r.abs().sum(-1))

    def output_grad(self, pred, target, delta=None):
        r = pred - target
        d = self._delta(pred, delta).unsqueeze(-1)
        if self.cfg.variant == "coordinate":
            return torch.where(r.abs() <= d, r, d * self._sign(r))
        n = r.norm(dim=-1, keepdim=True)
        outside = d * (r / self._norm(r) if self.cfg.variant == "norm" else self._sign(r))
        return torch.where(n <= d, r, outside)


@register("attentional_bias", "value_shift")
class ValueShiftRobust(_Smooth):
    """Robust to value shifts: max_{‖δv‖≤Δ} ½‖M(k) − (v + δv)‖² = ½‖r‖² + Δ‖r‖ + ½Δ² (Miras Eq.17).

    e = r + Δ · r/‖r‖ (‖r‖ smoothed as √(‖r‖² + ε) when ``smooth: true``).
    """

    @dataclass
    class Config(SmoothConfig):
        shift: float = 0.1   # Δ, the radius of the adversarial value shift

        def check(self) -> None:
            super().check()
            check_range("shift", self.shift, 0.0, None)

    def loss(self, pred, target, delta=None):
        n = (pred - target).norm(dim=-1)
        s = self.cfg.shift
        return 0.5 * n * n + s * n + 0.5 * s * s

    def output_grad(self, pred, target, delta=None):
        r = pred - target
        return r + self.cfg.shift * r / self._norm(r)
