"""Memory architectures M(x; θ_M): what the fast weights are and how the memory is read.

See docs/concepts/memory.md#memory-architecture (architectures) and docs/concepts/memory.md#initial-state
(the initial weights are learned).

A memory is *functional*: its fast weights are a dict of tensors, one entry per weight matrix, each
with leading dims ``[B, H]`` (one memory per sequence and head; batch elements never mix). The module
itself holds only outer-loop parameters: the learned initial fast weights (``[H, ...]``, expanded over
the batch; ``[1, ...]`` with ``init: shared``, one value for every head) and, for the LayerNorm forms, the norm's
affine parameters.

Shapes: ``forward(weights, x)`` takes ``x: [B, H, N, d_in]`` and returns ``[B, H, N, d_out]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.memory.fast_weights import apply_linear
from atlaslab.memory.part import Part
from atlaslab.registry import ConfigError, PartConfig, check_choice, check_range, register
from atlaslab.registry.weight_decay import exempt_from_weight_decay

Weights = Dict[str, torch.Tensor]

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}
#: learned: one learned initial value per head (titans-pytorch's default, ``per_head_learned_parameters=True``);
#: shared: one learned value for all heads of the layer (its ``per_head_learned_parameters=False``), H× fewer
#: parameters: at 760M width an MLP memory's per-head initial weights would double the model; zeros: fixed zero.
INITS = ("learned", "shared", "zeros")


class Memory(Part):
    """Base class. Subclasses define ``shapes`` (fast-weight name → per-head shape) and ``forward``."""

    #: False for memories whose fast weights include vectors (Muon needs matrices).
    matrix_valued: bool = True
    #: True when ``forward`` is ``W @ x`` with a single matrix ``W: [B, H, d_out, d_in]``.
    is_linear: bool = False
    #: True when every fast weight is a matrix applied through :meth:`linear` (the engine may then pass
    #: per-position or dual-form weights, and read per-token gradients as rank-1 factors off a tape).
    supports_tape: bool = False
    #: True when the initial fast weights start at zero (learned or not).
    zero_init: bool = False

    def __init__(self, cfg: PartConfig, in_dim: int, out_dim: int, num_heads: int):
        super().__init__(cfg)
        self.in_dim, self.out_dim, self.num_heads = in_dim, out_dim, num_heads
        self.init_mode = getattr(cfg, "init", "learned")

    # -- fast weights ----------------------------------------------------------------------------
    def shapes(self) -> Dict[str, tuple]:
        raise NotImplementedError

    def _register_initial(self, name: str, value: torch.Tensor) -> None:
        """Initial fast weight of one matrix from ``value: [H, ...]``: a parameter ``[H, ...]`` (``init: learned``),
        a parameter ``[1, ...]`` holding head 0's value (``shared``), or a zero buffer (``zeros``)."""
        if self.init_mode == "learned":
            self.register_parameter(f"init_{name}", nn.Parameter(value))
        elif self.init_mode == "shared":
            self.register_parameter(f"init_{name}", nn.Parameter(value[:1].clone()))
        else:
            self.register_buffer(f"init_{name}", torch.zeros_like(value))

    def initial_weights(self, batch: int) -> Weights:
        """The memory every sequence starts from: ``{name: [B, H, ...]}``, the learned initial value expanded
        over the batch (and over the heads with ``init: shared``)."""
        out = {}
        for n in self.shapes():
            w0 = getattr(self, f"init_{n}")
            out[n] = w0.unsqueeze(0).expand(batch, self.num_heads, *w0.shape[1:])
        return out

    def state_size(self) -> int:
        """Scalars of fast weights per sequence (all heads): zoology's recurrent-state contract."""
        return self.num_heads * sum(math.prod(s) for s in self.shapes().values())

    def forward(self, weights: Weights, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def linear(weights: Weights, name: str, h: torch.Tensor) -> torch.Tensor:
        """z = W_name h, ``h: [B, H, N, in]`` → ``[B, H, N, out]`` (W shared, per position or in dual form)."""
        return apply_linear(name, weights[name], h)


def _normal_init(num_heads: int, rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
    """Xavier-normal initial matrices ``[H, rows, cols]`` (titans-pytorch's MemoryMLP init)."""
    std = gain * math.sqrt(2.0 / (rows + cols))
    return torch.randn(num_heads, rows, cols) * std


@register("memory", "linear")
class LinearMemory(Memory):
    """Matrix memory M(x) = W x, W: [B, H, d_v, d_k] (LA, DeltaNet, GDN, TTT-Linear).

    The state layout is ``weights["W"]: [B, H, D_v, D_k]`` (column convention, docs/concepts/memory.md#notation).
    Initial W: zeros (learnable when ``init: learned``), the standard start of linear-attention models.
    """

    is_linear = True
    supports_tape = True
    zero_init = True

    @dataclass
    class Config(PartConfig):
        init: str = "learned"  # learned (per head) | shared (one for all heads) | zeros (fixed zero initial memory)

        def check(self) -> None:
            check_choice("init", self.init, INITS)

    def __init__(self, cfg, in_dim, out_dim, num_heads):
        super().__init__(cfg, in_dim, out_dim, num_heads)
        self._register_initial("W", torch.zeros(num_heads, out_dim, in_dim))

    def shapes(self):
        return {"W": (self.out_dim, self.in_dim)}

    def forward(self, weights, x):
        return self.linear(weights, "W", x)


@register("memory", "diagonal")
class DiagonalMemory(Memory):
    """Vector-valued memory M(x) = w ⊙ x, w: [B, H, d] (Miras Tab.1 RetNet row).

    Needs d_in == d_out. Its fast weights are vectors, so Muon (matrix orthogonalisation) does not apply.
    """

    matrix_valued = False
    zero_init = True

    @dataclass
    class Config(PartConfig):
        init: str = "learned"

        def check(self) -> None:
            check_choice("init", self.init, INITS)

    def __init__(self, cfg, in_dim, out_dim, num_heads):
        super().__init__(cfg, in_dim, out_dim, num_heads)
        if in_dim != out_dim:
            raise ConfigError("name", f"the diagonal memory needs key dim == value dim, got "
                                             f"{in_dim} (after the feature map) and {out_dim}.")
        self._register_initial("w", torch.zeros(num_heads, out_dim))

    def shapes(self):
        return {"w": (self.out_dim,)}

    def forward(self, weights, x):
        return x * weights["w"].unsqueeze(-2)


@dataclass
class MLPConfig(PartConfig):
    depth: int = 2             # number of fast-weight matrices in the chain (L_M in Titans)
    expansion: float = 4.0     # hidden width = expansion × (d_in or d_out, see hidden_from)
    hidden_from: str = "input"  # input | output: the width the expansion multiplies (ATLAS Eq.42: the head's)
    activation: str = "gelu"   # gelu | silu | relu | tanh
    residual: bool = True      # M(x) = x + f(x); needs d_in == d_out
    layer_norm: bool = False   # M(x) = x + LN(f(x)) (Miras / TTT form)
    init: str = "learned"

    def check(self) -> None:
        check_range("depth", self.depth, 1, None)
        check_range("expansion", self.expansion, 1e-6, None, "must be positive, in")
        check_choice("activation", self.activation, tuple(ACTIVATIONS))
        check_choice("init", self.init, INITS)
        check_choice("hidden_from", self.hidden_from, ("input", "output"))


class _MLPBase(Memory):
    """Shared pieces of the MLP memories: residual, optional LayerNorm (outer-loop affine)."""

    supports_tape = True

    def __init__(self, cfg: MLPConfig, in_dim, out_dim, num_heads):
        super().__init__(cfg, in_dim, out_dim, num_heads)
        if cfg.residual and in_dim != out_dim:
            raise ConfigError(
                "residual",
                f"a residual memory needs key dim == value dim, but the feature map gives {in_dim} and the "
                f"values have {out_dim}; set memory.residual: false (or use a dimension-preserving feature map).",
                value=True)
        # ``hidden_from: output`` keeps ATLAS Eq.42's 4 × d hidden layer when a feature map widens the input
        # (φ_2 of a 16-dim head gives 153 features; 4 × 153 would make the memory 10× the paper's size)
        base = out_dim if cfg.hidden_from == "output" else in_dim
        self.hidden = max(1, int(round(cfg.expansion * base)))
        self.act = ACTIVATIONS[cfg.activation]
        if cfg.layer_norm:
            self.ln_weight = nn.Parameter(torch.ones(num_heads, out_dim))
            self.ln_bias = nn.Parameter(torch.zeros(num_heads, out_dim))
            exempt_from_weight_decay(self.ln_weight, self.ln_bias)

    def _finish(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        if self.cfg.layer_norm:
            branch = F.layer_norm(branch, (self.out_dim,))
            branch = branch * self.ln_weight[:, None, :] + self.ln_bias[:, None, :]
        return x + branch if self.cfg.residual else branch


@register("memory", "mlp")
class MLPMemory(_MLPBase):
    """Deep memory M(x) = x + W_L σ(… σ(W_1 x)) (ATLAS Eq.42 residual MLP; Titans L_M-layer MLP).

    With ``layer_norm: true`` it is the Miras / TTT form M(x) = x + LN(f(x)) (Miras §5.3, TTT §2.7).
    ``depth: 1`` is a single matrix (TTT-Linear's f_res). No biases (ATLAS Eq.42). Weights are named
    ``W1 … WL`` in the order they are applied; ``W1: [B, H, hidden, d_in]``.
    """

    Config = MLPConfig

    def __init__(self, cfg, in_dim, out_dim, num_heads):
        super().__init__(cfg, in_dim, out_dim, num_heads)
        dims = [in_dim] + [self.hidden] * (cfg.depth - 1) + [out_dim]
        self._shapes = {}
        for i in range(cfg.depth):
            name = f"W{i + 1}"
            self._shapes[name] = (dims[i + 1], dims[i])
            self._register_initial(name, _normal_init(num_heads, dims[i + 1], dims[i]))

    def shapes(self):
        return dict(self._shapes)

    def forward(self, weights, x):
        h = x
        for i in range(self.cfg.depth):
            if i > 0:
                h = self.act(h)
            h = self.linear(weights, f"W{i + 1}", h)
        return self._finish(x, h)


@register("memory", "gated_mlp")
class GatedMLPMemory(_MLPBase):
    """Atlas++ memory M(x) = x + W_1(σ(W_2 x) ⊙ W_3 x), all three matrices fast weights (ATLAS Eq.43).

    Shapes: ``W2, W3: [B, H, hidden, d_in]``, ``W1: [B, H, d_out, hidden]``. ``depth`` is ignored (always 3).
    """

    Config = MLPConfig

    def __init__(self, cfg, in_dim, out_dim, num_heads):
        super().__init__(cfg, in_dim, out_dim, num_heads)
        self._shapes = {"W1": (out_dim, self.hidden), "W2": (self.hidden, in_dim), "W3": (self.hidden, in_dim)}
        for name, (r, c) in self._shapes.items():
            self._register_initial(name, _normal_init(num_heads, r, c))

    def shapes(self):
        return dict(self._shapes)

    def forward(self, weights, x):
        gate = self.act(self.linear(weights, "W2", x))
        lin = self.linear(weights, "W3", x)
        return self._finish(x, self.linear(weights, "W1", gate * lin))


@dataclass
class MLPLNConfig(MLPConfig):
    layer_norm: bool = True


@register("memory", "mlp_ln")
class MLPLNMemory(MLPMemory):
    """Miras / TTT memory M(x) = x + LN(W_2 σ(W_1 x)) (Miras §5.3, TTT §2.7): ``mlp`` with LayerNorm on.

    The LayerNorm's affine weights are outer-loop parameters (per head), not fast weights.
    """

    Config = MLPLNConfig
