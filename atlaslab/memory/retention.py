"""Retention: what the memory keeps of its past (docs/concepts/memory.md#retention; Miras §3.3, §5.2).

Two families:

- **Decay** (ℓ2 local + global retention): M_t = α_t M_{t−1} + U_t, with α_t ∈ [0, 1] the kept fraction,
  per head (``[B, T, H]``) or per key channel (``[B, T, H, d_k]``, GLA's M Diag(α_t); linear memory only).
  ``placement`` (docs/concepts/memory.md#retention-placement): ``after_step`` (Titans, Miras, ATLAS) takes the
  gradient at M_{t−1}; ``before_step`` (Gated DeltaNet, Mamba2) takes it at the decayed state α_t M_{t−1}.

- **Mirror maps** (non-linear retention): the state keeps a dual accumulator A updated linearly,
  A_t = α_t A_{t−1} + U_t, and the memory is W = Ψ(A):
  ℓq (Moneta, Miras Eq.24-25): Ψ(A) = A / ‖A‖_q^{q−2};  KL (Memora, Miras Eq.21/27): Ψ(A) = c·Softmax(A) per row;
  elastic net (FTRL form, Miras Eq.22-23): Ψ(A) = S_γ(A) soft-threshold;  sigmoid/Bregman (Miras §5.2 V5): Ψ(A) = σ(A).
  With training chunk size b, Ψ is applied at chunk ends (Miras §5.4): inside a chunk W moves by the same
  linear update as A, and after each chunk's last token W is reset to Ψ(A). b = 1 is the exact rule.

- **Projections** (``projects``): no dual; after each chunk's last token the memory itself is projected,
  W ← Π(W; W_{t'}) given the chunk-start state W_{t'} — LaCT's weight norm (Zhang et al. 2025, §3), which
  rescales every row of every fast-weight matrix back to the norm it had (docs/concepts/memory.md#weight-norm).
  A mirror map projects the running sum A (lazily); a projection restarts every chunk from the projected W.

The gradient for the update U_t is always taken at the memory W (the primal weights).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from atlaslab.kernels.utils import AFTER_STEP, BEFORE_STEP, PLACEMENTS
from atlaslab.memory.part import Part
from atlaslab.registry import PartConfig, check_choice, check_range, register

Weights = Dict[str, torch.Tensor]


def scale_weights(weights: Weights, alpha: Optional[torch.Tensor], channel_wise: bool) -> Weights:
    """α ⊙ W for every fast-weight tensor.

    ``alpha``: ``[B, H]`` (scalar per head) or ``[B, H, d_k]`` (channel-wise, scales the last = key axis).
    """
    if alpha is None:
        return weights
    out = {}
    for name, w in weights.items():
        if channel_wise:
            a = alpha.reshape(alpha.shape[:2] + (1,) * (w.dim() - 3) + alpha.shape[-1:])
        else:
            a = alpha.reshape(alpha.shape[:2] + (1,) * (w.dim() - 2))
        out[name] = a * w
    return out


class Retention(Part):
    """Base: multiplicative decay by α (no decay when α is absent)."""

    #: True for the non-linear retentions that keep a dual accumulator and map it with Ψ.
    mirror: bool = False
    placement: str = AFTER_STEP
    channel_wise: bool = False
    #: False when the retention gate α is meaningless for this rule.
    uses_alpha: bool = True
    #: True for the retentions that project the memory itself at every chunk end (:meth:`project_chunk`).
    projects: bool = False

    def decay(self, weights: Weights, alpha: Optional[torch.Tensor]) -> Weights:
        return scale_weights(weights, alpha, self.channel_wise)

    def psi(self, dual: Weights) -> Weights:
        """Ψ: dual accumulator → memory weights (identity for the linear retentions)."""
        return dual

    def project_chunk(self, weights: Weights, start: Weights) -> Weights:
        """Π(W; W_{t'}): the memory after a chunk's last token, given the chunk-start state (identity here)."""
        return weights

    @property
    def before_step(self) -> bool:
        """True when the gradient is taken at the decayed state α_t M_{t−1} (Gated DeltaNet, Mamba2)."""
        return self.placement == BEFORE_STEP


@register("retention", "none")
class NoRetention(Retention):
    """No forgetting: M_t = M_{t−1} + U_t (LA, DeltaNet, TTT, Longhorn). Ignores the α gate."""

    uses_alpha = False

    @dataclass
    class Config(PartConfig):
        pass

    def decay(self, weights, alpha):
        return weights


@register("retention", "decay")
class Decay(Retention):
    """Multiplicative decay M_t = α_t M_{t−1} + U_t (Titans forget gate, GDN, Mamba2, GLA).

    See docs/concepts/memory.md#decay.

    ``channel_wise: true`` takes α: ``[B, T, H, d_k]`` and decays key channels (GLA: M Diag(α_t)).
    """

    @dataclass
    class Config(PartConfig):
        placement: str = AFTER_STEP   # one of PLACEMENTS
        channel_wise: bool = False

        def check(self) -> None:
            check_choice("placement", self.placement, PLACEMENTS)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.placement = cfg.placement
        self.channel_wise = cfg.channel_wise


@dataclass
class MirrorConfig(PartConfig):
    channel_wise: bool = False


class _Mirror(Retention):
    mirror = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.channel_wise = cfg.channel_wise

    def psi(self, dual: Weights) -> Weights:
        return {n: self.map(a) for n, a in dual.items()}

    def map(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@register("retention", "lq")
class LqNormalisation(_Mirror):
    """ℓq retention of Moneta: A_t = α_t A_{t−1} + U_t, W = A / ‖A‖_q^{q−2} (Miras Eq.24-25, §5.2 V4).

    The ℓq norm is entry-wise over each fast-weight tensor of one (sequence, head); ``eps`` guards ‖A‖ = 0.
    """

    @dataclass
    class Config(MirrorConfig):
        q: float = 4.0
        eps: float = 1e-6

        def check(self) -> None:
            check_range("q", self.q, 1.0, None)

    def map(self, a):
        q = self.cfg.q
        dims = tuple(range(2, a.dim()))
        norm = (a.abs().pow(q).sum(dims, keepdim=True) + self.cfg.eps).pow(1.0 / q)
        return a / norm.pow(q - 2.0)


@register("retention", "kl")
class KLSoftmax(_Mirror):
    """KL retention of Memora: W_t = c · Softmax(α_t log W_{t−1} − η_t ∇ℓ) per row (Miras Eq.21, Eq.27).

    The dual A is the logits; since Softmax ignores per-row constants, α_t log W_{t−1} and α_t A_{t−1} give
    the same W, so A_t = α_t A_{t−1} + U_t with W = c·Softmax(A) is the rule exactly. Rows = the last axis
    of each fast-weight tensor ("applied per slice for networks").
    """

    @dataclass
    class Config(MirrorConfig):
        scale: float = 1.0   # c, the mass of each row

        def check(self) -> None:
            check_range("scale", self.scale, 1e-12, None, "must be positive, in")

    def map(self, a):
        return self.cfg.scale * torch.softmax(a, dim=-1)


@register("retention", "elastic_net")
class ElasticNet(_Mirror):
    """Elastic-net retention, FTRL form: A_t = α_t A_{t−1} + U_t, W = S_γ(A) (Miras Eq.22-23).

    S_γ(z) = sign(z)·max(0, |z| − γ); ``smooth: true`` uses |z|·arctan(z/γ)/(π/2) (Miras Eq.22).
    """

    @dataclass
    class Config(MirrorConfig):
        threshold: float = 1e-3   # γ
        smooth: bool = False

        def check(self) -> None:
            check_range("threshold", self.threshold, 0.0, None)

    def map(self, a):
        g = self.cfg.threshold
        if self.cfg.smooth:
            return a.abs() * torch.atan(a / max(g, 1e-12)) / (math.pi / 2)
        return torch.sign(a) * F.relu(a.abs() - g)


@register("retention", "sigmoid")
class SigmoidBregman(_Mirror):
    """Bregman retention with the binary-entropy potential: W_t = σ(ln(W/(1−W)) − η∇ℓ) (Miras §5.2 V5).

    The dual is the logit A = ln(W/(1−W)), so W stays in (0, 1).
    """

    @dataclass
    class Config(MirrorConfig):
        pass

    def map(self, a):
        return torch.sigmoid(a)


@register("retention", "weight_norm")
class WeightNorm(Retention):
    """LaCT's weight norm: each chunk's update, then every row rescaled to its chunk-start norm (LaCT §3).

    See docs/concepts/memory.md#weight-norm. At every chunk end, for each fast-weight matrix W: [B, H, out, in]
    and each row r (one output unit; ``axis: column`` normalises columns instead),

        W_r ← W_r · ‖W_{t', r}‖ / max(‖W_r‖, eps)

    with W_{t'} the chunk-start state. Every chunk starts at the norms of the learned initial memory, so this is
    LaCT's "normalise, then restore the initial norm" (its reference code; the paper writes L2-Normalize), exact in
    the norm because eps clamps instead of being added. A vector fast weight is normalised as a whole.
    ``decay: true`` also decays before the projection, W ← Π(α W + U) (α ignored otherwise).
    """

    projects = True

    @dataclass
    class Config(PartConfig):
        axis: str = "row"        # row (over the input axis, LaCT) | column (over the output axis)
        eps: float = 1e-6
        decay: bool = False      # also multiply by the α gate before the projection

        def check(self) -> None:
            check_choice("axis", self.axis, ("row", "column"))
            check_range("eps", self.eps, 1e-30, None, "must be positive, in")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.uses_alpha = cfg.decay

    def decay(self, weights, alpha):
        return scale_weights(weights, alpha, False) if self.uses_alpha else weights

    def project_chunk(self, weights: Weights, start: Weights) -> Weights:
        out = {}
        for name, w in weights.items():
            dim = -1 if (self.cfg.axis == "row" or w.dim() < 4) else -2
            target = torch.linalg.vector_norm(start[name], dim=dim, keepdim=True)
            norm = torch.linalg.vector_norm(w, dim=dim, keepdim=True).clamp_min(self.cfg.eps)
            out[name] = w * (target / norm)
        return out
