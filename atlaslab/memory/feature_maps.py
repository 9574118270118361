"""Feature maps φ applied to keys and queries before the memory (docs/concepts/memory.md#feature-map).

The same map is applied to k (write side) and q (read side). Shapes: ``x: [..., d]`` → ``[..., out_dim(d)]``.
Learnable pieces (the polynomial coefficients a_i) are outer-loop parameters of the module.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from atlaslab.memory.part import Part
from atlaslab.registry import ConfigError, PartConfig, check_choice, check_range, register


class FeatureMap(Part):
    """Base class: ``forward(x)`` maps ``[..., d]`` to ``[..., out_dim]``."""

    #: True when the map is only defined through its kernel k(q, k') = φ(q)ᵀφ(k') (φ* on a linear memory).
    kernel_trick: bool = False
    #: True when every feature is ≥ 0, so every kernel value φ(q)ᵀφ(k') ≥ 0 (what a normalised read needs).
    nonnegative: bool = False

    def __init__(self, cfg: PartConfig, in_dim: int):
        super().__init__(cfg)
        self.in_dim = in_dim

    @property
    def out_dim(self) -> int:
        return self.in_dim


@register("feature_map", "identity")
class Identity(FeatureMap):
    """φ(x) = x (all baselines; q and k are ℓ2-normalised by the layer)."""

    @dataclass
    class Config(PartConfig):
        pass

    def forward(self, x):
        return x


@register("feature_map", "elu_plus_one")
class EluPlusOne(FeatureMap):
    """φ(x) = elu(x) + 1, the positive map of Katharopoulos et al. (linear transformers)."""

    nonnegative = True

    @dataclass
    class Config(PartConfig):
        pass

    def forward(self, x):
        return F.elu(x) + 1.0


@register("feature_map", "dpfp")
class DPFP(FeatureMap):
    """Deterministic parameter-free projection of degree ν (DPFP; Schlag et al., ICML 2021, arXiv 2102.11174).

    r(x) = [relu(x), relu(−x)] ∈ R^{2d};  φ(x)_{2d(j−1)+i} = r_i(x) · r_{(i+j) mod 2d}(x),  i ≤ 2d, j ≤ ν.
    Output dim 2dν, every feature ≥ 0; no parameters. ν ≤ 2d − 1 (beyond, products repeat); default 3, ARMT's.
    See docs/concepts/memory.md#dpfp-feature-map.
    """

    nonnegative = True

    @dataclass
    class Config(PartConfig):
        nu: int = 3

        def check(self) -> None:
            check_range("nu", self.nu, 1, 16)

    def __init__(self, cfg, in_dim: int):
        super().__init__(cfg, in_dim)
        if cfg.nu > 2 * in_dim - 1:
            raise ConfigError("nu", f"bad value {cfg.nu}: DPFP on {in_dim}-dim keys takes ν ≤ 2d − 1 = "
                                    f"{2 * in_dim - 1}.", value=cfg.nu)

    @property
    def out_dim(self) -> int:
        return 2 * self.in_dim * self.cfg.nu

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)                            # [..., 2d]
        shifted = torch.cat([r.roll(-j, dims=-1) for j in range(1, self.cfg.nu + 1)], dim=-1)  # r_{i+j}
        return r.repeat(*([1] * (r.dim() - 1)), self.cfg.nu) * shifted


@functools.lru_cache(maxsize=32)
def _monomials(dim: int, degree: int):
    """Multi-indices of total degree ``degree`` as index tuples and their √(|β|!/β!) scalings (cached: every layer
    of a model asks for the same ones)."""
    combos = tuple(itertools.combinations_with_replacement(range(dim), degree))
    scales = []
    for combo in combos:
        counts = [combo.count(j) for j in set(combo)]
        scales.append(math.sqrt(math.factorial(degree) / math.prod(math.factorial(c) for c in counts)))
    return combos, tuple(scales)


def polynomial_dim(dim: int, degree: int) -> int:
    """Number of monomials of degree ≤ p in d variables: C(d + p, p) (ATLAS App.C)."""
    return math.comb(dim + degree, degree)


class _DegreeTwo(torch.autograd.Function):
    """The degree-2 polynomial features of ``x: [..., d]`` → ``[..., F]`` as one autograd node.

    With e = [1, x] (``[n, d + 1]``) and the factor indices ``pick = l ‖ r`` (``[2F]``: feature f is e_{l_f} e_{r_f},
    i.e. 1 · 1, 1 · x_i or x_i · x_j): u ‖ v = e[:, pick], p = u ⊙ v, φ = p ⊙ s.
    Backward: s̄ = Σ_n ḡ ⊙ p, ē = scatter-add over pick of [(ḡ ⊙ s) ⊙ v ‖ (ḡ ⊙ s) ⊙ u], x̄ = ē[:, 1:] (first order
    only)."""

    @staticmethod
    def forward(ctx, x, scale, pick):
        F = scale.shape[0]
        e = torch.cat([x.new_ones(*x.shape[:-1], 1), x], -1).reshape(-1, x.shape[-1] + 1)
        uv = e.index_select(1, pick)                                          # [n, 2F]
        p = uv[:, :F] * uv[:, F:]
        ctx.save_for_backward(uv, p, scale, pick)
        ctx.x_shape = x.shape
        return (p * scale).reshape(*x.shape[:-1], F)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        uv, p, scale, pick = ctx.saved_tensors
        F = scale.shape[0]
        g = g.reshape(-1, F)
        g_scale = (g * p).sum(0) if ctx.needs_input_grad[1] else None
        g_x = None
        if ctx.needs_input_grad[0]:
            gs = g * scale
            g_uv = torch.cat([gs * uv[:, F:], gs * uv[:, :F]], -1)
            g_e = g.new_zeros(g.shape[0], ctx.x_shape[-1] + 1).index_add_(1, pick, g_uv)
            g_x = g_e[:, 1:].reshape(ctx.x_shape)
        return g_x, g_scale, None


class _PolynomialFeatures(FeatureMap):
    """φ(x)_β = √(a_{|β|} · |β|!/β!) · x^β for all |β| ≤ p, so φ(q)ᵀφ(k) = Σ_i a_i (qᵀk)^i.

    See docs/concepts/memory.md#polynomial-feature-map.
    """

    def __init__(self, cfg, in_dim: int, degree: int):
        super().__init__(cfg, in_dim)
        self.degree = degree
        for i in range(1, degree + 1):
            combos, scales = _monomials(in_dim, i)
            self.register_buffer(f"_idx{i}", torch.tensor(combos, dtype=torch.long), persistent=False)
            # float64 so that float64 runs are exact; cast to the input dtype at use
            self.register_buffer(f"_scale{i}", torch.tensor(scales, dtype=torch.float64), persistent=False)
        if degree == 2:
            # positions of φ's features in z = [1, x, vec(x xᵀ)] (1 + d + d² entries): one index_select builds them
            pairs = [i * in_dim + j for i, j in _monomials(in_dim, 2)[0]]
            gather = [0] + [1 + i for i in range(in_dim)] + [1 + in_dim + p for p in pairs]
            self.register_buffer("_gather", torch.tensor(gather, dtype=torch.long), persistent=False)
            # each feature's degree (which a_i scales it) and its √(|β|!/β!)
            self.register_buffer("_degree", torch.tensor([0] + [1] * in_dim + [2] * len(pairs)), persistent=False)
            self.register_buffer("_scale_all", torch.cat([torch.ones(1, dtype=torch.float64), self._scale1,
                                                          self._scale2]), persistent=False)
            # feature f = e_{l_f} · e_{r_f} of e = [1, x] (1 · 1, 1 · x_i, x_i · x_j): the indices l ‖ r
            left = [0] + [0] * in_dim + [1 + i for i, _ in _monomials(in_dim, 2)[0]]
            right = [0] + [1 + i for i in range(in_dim)] + [1 + j for _, j in _monomials(in_dim, 2)[0]]
            self.register_buffer("_pick", torch.tensor(left + right, dtype=torch.long), persistent=False)

    def coefficients(self) -> torch.Tensor:  # [p + 1]
        raise NotImplementedError

    @property
    def out_dim(self) -> int:
        return polynomial_dim(self.in_dim, self.degree)

    def forward(self, x):
        a = self.coefficients().to(x.dtype)
        if self.degree == 2:
            return self._degree_two(x, a)
        parts: List[torch.Tensor] = [a[0].sqrt().expand(*x.shape[:-1], 1)]
        for i in range(1, self.degree + 1):
            idx = getattr(self, f"_idx{i}")
            mono = x[..., idx].prod(dim=-1)  # [..., n_i]
            parts.append(mono * (getattr(self, f"_scale{i}").to(x.dtype) * a[i].sqrt()))
        return torch.cat(parts, dim=-1)

    def _degree_two(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The p = 2 map as one autograd node (:class:`_DegreeTwo`): φ = (e_l ⊙ e_r) ⊙ (scale · √a_{|β|}) with
        e = [1, x]; the same values as the general loop (x_i x_j and each feature's scale are the same products).
        :meth:`_degree_two_reference` is the same map in plain autograd ops."""
        scale = self._scale_all.to(x.dtype) * a.sqrt().index_select(0, self._degree)
        return _DegreeTwo.apply(x, scale, self._pick)

    def _degree_two_reference(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """z = [1, x, vec(x xᵀ)], φ = z[gather] ⊙ (scale · √a_{|β|}) in autograd ops."""
        z = torch.cat([x.new_ones(*x.shape[:-1], 1), x, (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)], -1)
        scale = self._scale_all.to(x.dtype) * a.sqrt().index_select(0, self._degree)
        return z.index_select(-1, self._gather) * scale


@register("feature_map", "polynomial")
class Polynomial(_PolynomialFeatures):
    """ATLAS polynomial map of degree p with learnable coefficients a_i (ATLAS Eq.5, §3.1).

    φ(q)ᵀφ(k) = a_0 + a_1 qᵀk + … + a_p (qᵀk)^p. Output dim C(d + p, p). a_i is initialised to 1/i!
    (the Taylor series of exp) and kept positive as a_i = softplus(ρ_i); ``learnable: false`` freezes it.
    """

    @dataclass
    class Config(PartConfig):
        degree: int = 2
        learnable: bool = True

        def check(self) -> None:
            check_range("degree", self.degree, 1, 6)

    def __init__(self, cfg, in_dim):
        super().__init__(cfg, in_dim, cfg.degree)
        init = torch.tensor([1.0 / math.factorial(i) for i in range(cfg.degree + 1)], dtype=torch.float64)
        if cfg.learnable:
            self.rho = nn.Parameter((init + torch.log(-torch.expm1(-init))).float())  # softplus⁻¹(a)
        else:
            self.register_buffer("a", init)

    def coefficients(self):
        return F.softplus(self.rho) if self.cfg.learnable else self.a


@register("feature_map", "exp")
class Exponential(_PolynomialFeatures):
    """Exponential map φ*(x) = (1, x, x^{⊗2}/√2!, …) with φ*(q)ᵀφ*(k) = exp(qᵀk) (ATLAS Eq.22-23).

    See docs/concepts/memory.md#exponential-feature-map.

    On a linear memory it is computed exactly by the kernel trick (``mode: auto`` or ``kernel``): the
    memory becomes a bank of (key, coefficient) slots read as Σ_j u_j exp(k_jᵀq), i.e. unnormalised causal
    softmax attention; ``normalize: true`` divides by the same read of the token masses, giving softmax
    attention (the Transformer as a special case, docs/concepts/memory.md#blocks). On a deep memory (``mode: auto`` or
    ``taylor``) it is the Taylor truncation of degree ``degree`` (the polynomial map with a_i = 1/i! fixed).
    """

    @dataclass
    class Config(PartConfig):
        mode: str = "auto"       # auto | kernel | taylor
        degree: int = 2          # Taylor degree when not using the kernel trick
        normalize: bool = False  # kernel trick only: softmax normaliser

        def check(self) -> None:
            check_choice("mode", self.mode, ("auto", "kernel", "taylor"))
            check_range("degree", self.degree, 1, 6)

    def __init__(self, cfg, in_dim, kernel_trick: bool = False):
        super().__init__(cfg, in_dim, cfg.degree)
        self.kernel_trick = kernel_trick
        self.register_buffer("_a", torch.tensor([1.0 / math.factorial(i) for i in range(cfg.degree + 1)],
                                               dtype=torch.float64), persistent=False)

    def coefficients(self):
        return self._a

    @property
    def out_dim(self) -> int:
        return self.in_dim if self.kernel_trick else polynomial_dim(self.in_dim, self.degree)

    def forward(self, x):
        if self.kernel_trick:
            return x  # the kernel exp(qᵀk) is evaluated by the engine on the raw vectors
        return super().forward(x)
