"""Inner optimizers: how the memory steps on its attentional bias (docs/concepts/memory.md#inner-optimizer).

Every optimizer returns the update U_t that the engine adds after retention, M_t = α_t M_{t−1} + U_t,
given a :class:`WindowProblem` (the window's keys/values/γ and a ``grad(W)`` for its weighted gradient
g = Σ_i γ_i ∇ℓ(W; φ(k_i), v_i)) and the anchor W_a at which gradients are taken (the chunk-start state,
decayed for ``before_step`` retention). η_t (``lr``) and θ_t (``theta``) arrive as ``[B, H]`` tensors.

- GD:              U_t = −η_t g(W_a)
- momentum GD:     S_t = θ_t S_{t−1} − η_t g(W_a);  U_t = S_t                         (Titans Eq.13-14)
- Muon:            S_t = θ_t S_{t−1} + g(W_a);      U_t = −η_t · NS_k(S_t)            (ATLAS Eq.32-33)
- multi-step GD:   u⁰ = 0, u^{j+1} = u^j − η_t g(W_a + u^j), U_t = u^n            (DeltaProduct, Miras Tab.1)
- implicit GD:     U_t = argmin_W ½‖W − W_a‖²/η_t + Σ_i γ_i ½‖W φ(k_i) − v_i‖² − W_a  (Longhorn Eq.5-7, closed form
                   W* = (W_a + η Σ γ v kᵀ)(I + η Σ γ k kᵀ)⁻¹; linear memory with the ℓ2 bias only)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from atlaslab.kernels.newton_schulz import LACT_COEFFICIENTS, MUON_COEFFICIENTS, newton_schulz, select_newton_schulz
from atlaslab.memory.part import Part
from atlaslab.memory.state import WindowProblem
from atlaslab.registry import PartConfig, check_choice, check_range, register

Weights = Dict[str, torch.Tensor]


#: Newton–Schulz coefficients by name: one quintic for every step, or a per-step schedule.
NS_COEFFICIENTS = {"muon": MUON_COEFFICIENTS, "lact": LACT_COEFFICIENTS}


def _bcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` → broadcastable against ``like: [B, H, ...]``."""
    return x.reshape(x.shape + (1,) * (like.dim() - x.dim()))


class InnerOptimizer(Part):
    """Base class."""

    #: True when the optimizer keeps a momentum buffer S (same structure as the fast weights).
    has_momentum: bool = False
    #: True when the optimizer needs matrix-valued fast weights (Muon).
    needs_matrices: bool = False

    @property
    def default_lr(self) -> float:
        return self.cfg.lr

    def update(self, problem: WindowProblem, anchor: Weights, momentum: Optional[Weights],
               lr: torch.Tensor, theta: Optional[torch.Tensor]) -> Tuple[Weights, Optional[Weights]]:
        raise NotImplementedError


@dataclass
class GDConfig(PartConfig):
    lr: float = 1.0   # constant inner step; multiplies the η gate (η = lr when no gate is given)


@register("inner_optimizer", "gd")
class GD(InnerOptimizer):
    """Gradient descent U_t = −η_t g(W_a) (LA … GDN, TTT, Miras, OmegaNet, DLA)."""

    Config = GDConfig

    def update(self, problem, anchor, momentum, lr, theta):
        g = problem.grad(anchor)
        return {n: -_bcast(lr, gi) * gi for n, gi in g.items()}, None


@dataclass
class MomentumConfig(GDConfig):
    momentum: float = 0.9   # θ when no momentum gate is given

    def check(self) -> None:
        check_range("momentum", self.momentum, 0.0, 1.0)


@register("inner_optimizer", "momentum")
class MomentumGD(InnerOptimizer):
    """GD with momentum: S_t = θ_t S_{t−1} − η_t g; M_t = α_t M_{t−1} + S_t (Titans Eq.13-14)."""

    Config = MomentumConfig
    has_momentum = True

    def update(self, problem, anchor, momentum, lr, theta):
        g = problem.grad(anchor)
        s = {n: _bcast(theta, gi) * momentum[n] - _bcast(lr, gi) * gi for n, gi in g.items()}
        return s, s


@register("inner_optimizer", "muon")
class Muon(InnerOptimizer):
    """Muon: S_t = θ_t S_{t−1} + g; M_t = α_t M_{t−1} − η_t · NS_k(S_t) (ATLAS Eq.32-33).

    See docs/concepts/memory.md#muon.

    NS is applied per fast-weight matrix; the step η_t stays outside NS (NS is scale-invariant;
    docs/concepts/memory.md#newton-schulz).
    ``ns_granularity: chunk`` (docs/concepts/memory.md#ns-granularity) takes one step per training chunk instead,
    M_{next chunk} = (Π α) M_{t'} − η̄ NS_k(S_end); it is causal only with ``read: chunk``.
    ``ns_coefficients``: ``muon`` (one quintic for every step) or ``lact`` (the 5-step schedule of LaCT's code).
    """

    has_momentum = True
    needs_matrices = True

    @dataclass
    class Config(MomentumConfig):
        ns_steps: int = 5
        ns_eps: float = 1e-7
        shape_factor: bool = False        # multiply by √max(1, rows/cols) (Muon's; off in ATLAS)
        ns_granularity: str = "token"     # token | chunk
        ns_coefficients: str = "muon"     # muon (3.4445, −4.7750, 2.0315) at every step | lact (a 5-step schedule)

        def check(self) -> None:
            super().check()
            check_range("ns_steps", self.ns_steps, 0, None)
            check_choice("ns_granularity", self.ns_granularity, ("token", "chunk"))
            check_choice("ns_coefficients", self.ns_coefficients, tuple(NS_COEFFICIENTS))
            n = len(NS_COEFFICIENTS[self.ns_coefficients])
            if self.ns_coefficients != "muon" and self.ns_steps != n:
                check_range("ns_steps", self.ns_steps, n, n,
                            f"the '{self.ns_coefficients}' coefficients are a {n}-step schedule; must be in")

    def accumulate(self, g: Weights, momentum: Weights, theta: torch.Tensor) -> Weights:
        """S_t = θ_t S_{t−1} + g_t."""
        return {n: _bcast(theta, gi) * momentum[n] + gi for n, gi in g.items()}

    def orthogonalise(self, s: torch.Tensor) -> torch.Tensor:
        """NS_k per matrix: the fused Triton kernel on CUDA when it applies, else the torch reference (always for
        a per-step schedule, which the kernel does not take)."""
        coefficients = NS_COEFFICIENTS[self.cfg.ns_coefficients]
        fn = newton_schulz
        if s.is_cuda and self.cfg.ns_coefficients == "muon":   # (on CPU the kernel would only run in Triton's
            fn = select_newton_schulz(s) or newton_schulz      # interpreter: far slower than torch)
        return fn(s, self.cfg.ns_steps, self.cfg.ns_eps, coefficients, shape_factor=self.cfg.shape_factor)

    def update(self, problem, anchor, momentum, lr, theta):
        s = self.accumulate(problem.grad(anchor), momentum, theta)
        return {n: -_bcast(lr, si) * self.orthogonalise(si) for n, si in s.items()}, s


@register("inner_optimizer", "multi_step_gd")
class MultiStepGD(InnerOptimizer):
    """n GD steps per token, each at the current iterate: u^{j+1} = u^j − η g(W_a + u^j) (DeltaProduct)."""

    @dataclass
    class Config(GDConfig):
        steps: int = 2

        def check(self) -> None:
            check_range("steps", self.steps, 1, None)

    def update(self, problem, anchor, momentum, lr, theta):
        u = {n: torch.zeros_like(w) for n, w in anchor.items()}
        for _ in range(self.cfg.steps):
            g = problem.grad({n: anchor[n] + u[n] for n in anchor})
            u = {n: u[n] - _bcast(lr, g[n]) * g[n] for n in u}
        return u, None


@register("inner_optimizer", "implicit_gd")
class ImplicitGD(InnerOptimizer):
    """Implicit (proximal) GD, Longhorn's closed form (Longhorn Eq.5-7).

    W* = argmin_W ½‖W − W_a‖²/η + Σ_i γ_i ½‖W x_i − v_i‖² = (W_a + η Σ γ v xᵀ)(I + η Σ γ x xᵀ)⁻¹.
    For one token this is the delta rule with step ε = η/(1 + η xᵀx). Linear memory and ℓ2 bias only.
    """

    Config = GDConfig

    def update(self, problem, anchor, momentum, lr, theta):
        w_a = anchor["W"]                                       # [B, H, d_v, d_k]
        x, v, gam = problem.x, problem.v, problem.gamma         # [B,H,n,d_k], [B,H,n,d_v], [B,H,n]
        eta = lr[..., None, None]
        d_k = x.shape[-1]
        eye = torch.eye(d_k, dtype=x.dtype, device=x.device)
        gram = torch.einsum("bhn,bhni,bhnj->bhij", gam, x, x)   # Σ γ x xᵀ
        rhs = w_a + eta * torch.einsum("bhn,bhnv,bhnk->bhvk", gam, v, x)
        # W* A = rhs with A symmetric  ⇔  A W*ᵀ = rhsᵀ
        w_star = torch.linalg.solve(eye + eta * gram, rhs.mT).mT
        return {"W": w_star - w_a}, None
