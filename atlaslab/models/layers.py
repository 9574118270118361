"""The memory layer: the backbone of docs/concepts/memory.md#layer-backbone wrapped around ``memorize``.

    x ─┬─ W_Q ─ conv4 ─ SiLU ─ ℓ2 ─┐
       ├─ W_K ─ conv4 ─ SiLU ─ ℓ2 ─┤
       ├─ W_V ─ conv4 ─ SiLU ──────┼─ memorize(q, k, v, gates) ─ RMSNorm/head ─ ⊙ σ(W_G x) ─ W_O ─ y
       └─ gate networks (η, α, θ, γ, δ) ─┘

Every piece is a config switch (``conv``, ``silu``, ``qk_norm``, ``output_norm``, ``output_gate``, and per gate
``learned`` / ``input_dependent``) so each can be ablated. The feature map φ is applied inside ``memorize``.
Shapes: ``forward(x: [B, T, d_model]) -> [B, T, d_model]``.

Gates (docs/concepts/memory.md#gates), built only for the gates the memory spec uses, from the layer input x_t:

- η_t = ``inner_optimizer.lr`` · sigmoid(w_η·x_t + b_η)       (``lr``; η_max is the inner optimizer's ``lr``)
- α_t = sigmoid(w_α·x_t + b_α), b_α = +4 so α ≈ 0.98 at init     (``retention``; [B,T,H,D_k] when channel-wise)
- θ_t = sigmoid(w_θ·x_t + b_θ), b_θ = logit(``inner_optimizer.momentum``)   (``momentum``)
- γ_i = sigmoid(w_γ·x_i + b_γ), b_γ = +4                        (``window``, only when the window c ≠ 1)
- δ_t = softplus(w_δ·x_t + b_δ), softplus(b_δ) = ``attentional_bias.delta``   (``delta``, Huber only)

``form: log_decay`` (retention only) is fla's / Mamba2's parameterisation instead of the sigmoid:
α_t = exp(−A_h · softplus(w_α·x_t + b_h)), A_h ~ U(a_range) per head and b_h = softplus⁻¹(dt_h) with
dt_h ~ logU(dt_range), so the heads start spread between fast and slow forgetting (α ∈ (0.2, 1) at the
default ranges) where the sigmoid starts every head at α ≈ 0.98 with dα/dz ≈ 0.02.

The weights w start N(0, 1/d_model) (``weight_init: normal``, the default) or as ``nn.Linear``'s default,
U(±d_model^-1/2) (``weight_init: uniform``, std (3·d_model)^-1/2); ``use_bias: false`` drops b (the pre-activation is
w·x alone). fla's DeltaNet / Gated DeltaNet β is ``weight_init: uniform, use_bias: false`` (its ``b_proj`` is a
bias-free ``nn.Linear``).

The output norm is RMSNorm(o) = o / sqrt(mean(o²) + ε) per head (``output_norm_eps``, ε = 10⁻⁶ by default). ε
sets how a weak read (a small o, e.g. a query whose key was never written) comes out: far above ε it is scaled to
unit RMS like a strong one, near ε it stays small. fla's DeltaNet / Gated DeltaNet read S·(D_k^-1/2 q) and
normalise with ε = 10⁻⁵, which is ε = 10⁻⁵ · D_k on our unscaled read (1.6·10⁻⁴ at D_k = 16).

``learned: false`` makes a gate constant: its ``value`` if given, else the memory config's constant
(η = inner_optimizer.lr, θ = inner_optimizer.momentum, γ = 1, δ = attentional_bias.delta, α = 1 i.e. no decay).
``input_dependent: false`` (with ``learned: true``) gives one learnable scalar per head, σ(b_h)
(RetNet's learnable, data-independent decay).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.engines import GATE_NAMES, MODES, memorize, read_memory
from atlaslab.engines import initial_state as fresh_memory_state
from atlaslab.engines.packed import check_cu_seqlens, sequence_positions, stack_states
from atlaslab.memory.spec import MemoryParts, MemorySpec, resolve_memory_spec
from atlaslab.models.attention import head_layout
from atlaslab.registry import ConfigError, PartConfig, check_range, register
from atlaslab.registry.weight_decay import exempt_from_weight_decay

#: the gates a layer makes for its memory (the engines' gate names, defined once in :mod:`atlaslab.memory.state`)
GATES = GATE_NAMES
GATE_FORMS = {"retention": ("sigmoid", "log_decay"), "other": ("sigmoid",)}
OUTPUT_GATE_ACTS = ("sigmoid", "swish")
GATE_WEIGHT_INITS = ("normal", "uniform")


def gated_head_output(o: torch.Tensor, x: torch.Tensor, out_norm: Optional[nn.Module], g_proj: Optional[nn.Module],
                      o_proj: nn.Module, gate_act: str) -> torch.Tensor:
    """A mixer's output head: per-head norm (``out_norm``, optional), output gate ``o ⊙ act(g_proj(x))`` (optional;
    ``gate_act`` one of :data:`OUTPUT_GATE_ACTS`) and projection. ``o: [B, T, H, D_v]``, ``x: [B, T, d_model]`` (the
    layer input) → ``[B, T, d_model]``."""
    if out_norm is not None:
        o = out_norm(o)
    o = o.reshape(*o.shape[:2], -1)
    if g_proj is not None:
        g = g_proj(x)
        o = o * (F.silu(g) if gate_act == "swish" else torch.sigmoid(g))
    return o_proj(o)


# --------------------------------------------------------------------------------------------------
# small shared modules
# --------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """y = x / rms(x) · w over the last dim (Llama's RMSNorm). ``weight`` may be ``[..., d]`` (e.g. per head)."""

    def __init__(self, shape, eps: float = 1e-6):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))
        exempt_from_weight_decay(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight.to(x.dtype)


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time (kernel K, no bias), with an optional cache.

    ``forward(x: [B, T, C], cache: [B, K-1, C] | None) -> (y: [B, T, C], new_cache: [B, K-1, C])``; the
    cache holds the last K − 1 inputs, so chained calls equal one call.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, cache: Optional[torch.Tensor] = None, cu_seqlens=None):
        """With ``cu_seqlens`` (packed sequences: ``x: [1, ΣT_i, C]``, offsets ``[N + 1]``, see
        :meth:`forward_packed`) the convolution restarts at every sequence; ``cache`` is then ``[N, K-1, C]``."""
        if cu_seqlens is not None:
            return self.forward_packed(x, cu_seqlens, cache)
        return causal_conv(x, self._taps(x), cache)

    def _taps(self, x: torch.Tensor) -> torch.Tensor:
        """The filter ``[C, K]`` (Conv1d layout, cross-correlation: tap K−1 multiplies the current token)."""
        return self.conv.weight[:, 0, :].to(x.dtype)

    def forward_packed(self, x: torch.Tensor, cu_seqlens, cache: Optional[torch.Tensor] = None):
        """Packed sequences ``x: [1, ΣT_i, C]`` → ``(y: [1, ΣT_i, C], caches: [N, K-1, C])``, equal to running each
        sequence alone from its own cache (``cache[i]``, zeros when None): a token s steps into its sequence takes
        the ``K − 1 − s`` oldest taps from that cache, never from the sequence before it."""
        return causal_conv_packed(x, self._taps(x), cu_seqlens, cache)


def causal_conv(x: torch.Tensor, w: torch.Tensor, cache: Optional[torch.Tensor] = None):
    """:meth:`ShortConv.forward` with the filter given: ``x: [B, T, C]``, ``w: [C, K]`` (tap K−1 multiplies the
    current token), ``cache: [B, K-1, C]`` or None (zeros) → ``(y: [B, T, C], new_cache: [B, K-1, C])``.
    Channel-wise, so convolutions side by side along C equal one call on their concatenated channels."""
    B, T, C = x.shape
    K = w.shape[1]
    if cache is None:
        cache = x.new_zeros(B, K - 1, C)
    full = torch.cat([cache, x], dim=1)                           # [B, K-1+T, C]
    # K shifted products instead of conv1d: same result, and far faster for tiny / float64 inputs on CPU
    y = full[:, 0:T] * w[:, 0]
    for j in range(1, K):
        y = y + full[:, j:j + T] * w[:, j]                         # [B, T, C]
    return y, full[:, full.shape[1] - (K - 1):]


def causal_conv_packed(x: torch.Tensor, w: torch.Tensor, cu_seqlens, cache: Optional[torch.Tensor] = None):
    """:meth:`ShortConv.forward_packed` with the filter ``w: [C, K]`` given (see :func:`causal_conv`)."""
    B, T, C = x.shape
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N, K = len(offsets) - 1, w.shape[1]
    if cache is None:
        cache = x.new_zeros(N, K - 1, C)
    seq, pos = sequence_positions(offsets, x.device)
    xs, t = x[0], torch.arange(T, device=x.device)
    y = xs * w[:, K - 1]
    for s in range(1, K):                                    # the token s steps back, or the cache slot
        earlier = xs[(t - s).clamp_min(0)]
        cached = cache[seq, (K - 1 - s + pos).clamp(0, K - 2)]
        y = y + torch.where((pos >= s)[:, None], earlier, cached) * w[:, K - 1 - s]
    ends = torch.tensor(offsets[1:], device=x.device)[:, None]            # [N, 1]
    starts = torch.tensor(offsets[:-1], device=x.device)[:, None]
    u = ends - (K - 1) + torch.arange(K - 1, device=x.device)             # token each new slot holds [N, K-1]
    from_cache = cache[torch.arange(N, device=x.device)[:, None], (K - 1 + u - starts).clamp(0, K - 2)]
    new_cache = torch.where((u >= starts)[..., None], xs[u.clamp_min(0)], from_cache)
    return y.unsqueeze(0), new_cache


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _softplus_inv(y):
    """softplus⁻¹(y) = y + log(1 − e^{−y}), of a float (clamped at 1e-6) or elementwise of a tensor."""
    if isinstance(y, torch.Tensor):
        return y + torch.log(-torch.expm1(-y))
    y = max(y, 1e-6)
    return y + math.log(-math.expm1(-y))


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------
@dataclass
class GateConfig:
    """One gate (docs/concepts/memory.md#gates)."""

    learned: bool = True            # false → constant (``value``, else the memory config's constant)
    input_dependent: bool = True    # false → one learnable scalar per head, σ(b_h) (RetNet's α)
    bias: Optional[float] = None    # initial pre-activation bias b (default: per gate, see module doc)
    value: Optional[float] = None   # the constant when ``learned: false`` (η: multiplies inner_optimizer.lr)
    form: str = "sigmoid"           # sigmoid | log_decay (retention only: fla / Mamba2 α, see module doc)
    a_range: List[float] = field(default_factory=lambda: [0.0, 16.0])    # log_decay: A_h ~ U(a_range)
    dt_range: List[float] = field(default_factory=lambda: [1e-3, 0.1])   # log_decay: dt_h ~ logU(dt_range)
    weight_init: str = "normal"     # sigmoid / softplus form: normal (N(0, 1/d)) | uniform (nn.Linear's default)
    use_bias: bool = True           # false: no b (w·x alone; fla's β); needs input_dependent

    def check(self, name: str) -> None:
        """Validate against the gate it configures (``name`` ∈ GATES); errors name ``gates.<name>.<field>``."""
        forms = GATE_FORMS["retention" if name == "retention" else "other"]
        if self.form not in forms:
            raise ConfigError(f"gates.{name}.form", f"unknown form {self.form!r} for the {name} gate.",
                              value=self.form, choices=list(forms))
        if self.weight_init not in GATE_WEIGHT_INITS:
            raise ConfigError(f"gates.{name}.weight_init", f"unknown weight init {self.weight_init!r}.",
                              value=self.weight_init, choices=list(GATE_WEIGHT_INITS))
        if not self.use_bias and not (self.learned and self.input_dependent):
            raise ConfigError(f"gates.{name}.use_bias", "use_bias: false needs a learned, input-dependent gate (a "
                              "gate without inputs is its bias).", value=self.use_bias)
        if self.form == "log_decay":
            for f, lo in (("a_range", 0.0), ("dt_range", 1e-12)):
                r = getattr(self, f)
                if len(r) != 2 or not (lo <= r[0] <= r[1]):
                    raise ConfigError(f"gates.{name}.{f}", f"must be [low, high] with {lo} ≤ low ≤ high.", value=r)


@dataclass
class LayerGates:
    lr: GateConfig = field(default_factory=GateConfig)
    retention: GateConfig = field(default_factory=GateConfig)
    momentum: GateConfig = field(default_factory=GateConfig)
    window: GateConfig = field(default_factory=GateConfig)
    delta: GateConfig = field(default_factory=GateConfig)


@dataclass
class MemoryLayerConfig(PartConfig):
    """Structured config of the memory layer (and, extended, of the memory blocks)."""

    memory: Any = field(default_factory=dict)   # the memory node; after check(): its MemorySpec (typed, immutable)
    num_heads: int = 4
    head_dim: Optional[int] = None     # key/query dim per head; default d_model // num_heads
    value_dim: Optional[int] = None    # value dim per head; default d_model // num_heads (the heads tile d_model)
    conv: bool = True                  # depthwise causal conv on q, k, v
    conv_size: int = 4
    silu: bool = True                  # SiLU on q, k, v (after the conv)
    qk_norm: bool = True               # ℓ2-normalise q and k per head
    output_norm: bool = True           # per-head RMSNorm of the memory read
    output_norm_eps: float = 1e-6      # its ε: how far a weak read is damped rather than scaled up (module doc)
    output_gate: bool = True           # ⊙ act(W_G x)
    output_gate_act: str = "sigmoid"   # sigmoid | swish (fla's Gated DeltaNet: RMSNorm(o) ⊙ swish(W_G x))
    gates: LayerGates = field(default_factory=LayerGates)
    mode: str = "chunked"              # memorize engine (kernels.MODES): chunked (fast) or recurrent (reference)
    checkpoint: bool = False           # chunked engine: recompute chunks in backward (long sequences)
    compile: bool = False              # chunked engine: torch.compile its per-chunk work (docs/engines.md#compiled)

    def check(self) -> None:
        check_range("num_heads", self.num_heads, 1, None)
        if self.head_dim is not None:
            check_range("head_dim", self.head_dim, 1, None)
        if self.value_dim is not None:
            check_range("value_dim", self.value_dim, 1, None)
        check_range("conv_size", self.conv_size, 1, None)
        if not self.output_norm_eps > 0:
            raise ConfigError("output_norm_eps", f"bad value {self.output_norm_eps!r}: must be > 0 (a zero read would "
                                                 "divide 0 by 0).", value=self.output_norm_eps)
        if self.output_gate_act not in OUTPUT_GATE_ACTS:
            raise ConfigError("output_gate_act", f"unknown activation {self.output_gate_act!r}.",
                              value=self.output_gate_act, choices=list(OUTPUT_GATE_ACTS))
        for name in GATES:
            getattr(self.gates, name).check(name)
        if self.mode not in MODES:
            raise ConfigError("mode", f"unknown engine '{self.mode}'.", value=self.mode, choices=list(MODES))
        if self.compile and self.mode != "chunked":
            raise ConfigError("compile", f"compiles the chunked engine's per-chunk work; mode is '{self.mode}'.",
                              value=self.compile, choices=["false"])
        if self.compile and self.checkpoint:
            raise ConfigError("compile", "is not combined with checkpoint: true (recomputing compiled chunks in the "
                                         "backward pass is untested).", value=self.compile, choices=["false"])
        self.memory = self.memory_spec()   # resolved once, here; errors carry the path "memory.…"

    def memory_spec(self) -> MemorySpec:
        """The memory's typed spec (resolved by :meth:`check`, the one validation; a spec is returned as it is)."""
        return resolve_memory_spec(self.memory, path="memory")


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------
@dataclass
class MemoryLayerState:
    """What a memory layer carries between calls: the memory's state and the conv caches of q, k, v."""

    memory: Any                                   # kernels.MemoryState
    conv: Dict[str, torch.Tensor] = field(default_factory=dict)

    def detach(self) -> "MemoryLayerState":
        return MemoryLayerState(self.memory.detach(), {k: v.detach() for k, v in self.conv.items()})


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------
class _Gate(nn.Module):
    """g = act(w·x + b) per head (``[B, T, H]``) or per head channel (``[B, T, H, C]``)."""

    def __init__(self, d_model: int, heads: int, channels: Optional[int], act: str, bias: float,
                 input_dependent: bool, weight_init: str = "normal", use_bias: bool = True):
        super().__init__()
        self.heads, self.channels, self.act = heads, channels, act
        width = heads * (channels or 1)
        if input_dependent:
            self.proj = nn.Linear(d_model, width, bias=use_bias)   # weight_init "uniform": nn.Linear's own init
            if weight_init == "normal":
                nn.init.normal_(self.proj.weight, std=d_model ** -0.5)
            if use_bias:
                nn.init.constant_(self.proj.bias, bias)
        else:
            self.proj = None
            self.bias = nn.Parameter(torch.full((width,), float(bias)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        z = self.proj(x) if self.proj is not None else self.bias.to(x.dtype).expand(B, T, -1)
        z = torch.sigmoid(z) if self.act == "sigmoid" else F.softplus(z)
        return z.reshape(B, T, self.heads, self.channels) if self.channels else z


class _LogDecayGate(nn.Module):
    """fla / Mamba2 decay α = exp(−A · softplus(w·x + b)) per head (``[B, T, H]``) or channel (``[B, T, H, C]``).

    A ~ U(a_range) (stored as log A), b = softplus⁻¹(dt) with dt ~ logU(dt_range), one per gate unit; with
    ``input_dependent: false`` w is dropped (α constant in time, learnable)."""

    def __init__(self, d_model: int, heads: int, channels: Optional[int], cfg: "GateConfig"):
        super().__init__()
        self.heads, self.channels = heads, channels
        width = heads * (channels or 1)
        a = torch.empty(width).uniform_(*cfg.a_range).clamp_min(1e-4)
        lo, hi = (math.log(r) for r in cfg.dt_range)
        dt = torch.exp(torch.empty(width).uniform_(lo, hi))
        self.a_log = nn.Parameter(a.log())
        self.dt_bias = nn.Parameter(_softplus_inv(dt))
        self.proj = nn.Linear(d_model, width, bias=False) if cfg.input_dependent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        z = self.dt_bias.to(x.dtype)
        z = self.proj(x) + z if self.proj is not None else z.expand(B, T, -1)
        alpha = torch.exp(-self.a_log.exp().to(x.dtype) * F.softplus(z))
        return alpha.reshape(B, T, self.heads, self.channels) if self.channels else alpha


@register("mixer", "memory")
class MemoryLayer(nn.Module):
    """Test-time-memory layer: q/k/v + short conv + SiLU + ℓ2 norm → memorize → norm, gate, proj.

    See docs/concepts/memory.md#layer-backbone.
    """

    Config = MemoryLayerConfig

    def __init__(self, cfg: MemoryLayerConfig, d_model: int):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        H = cfg.num_heads
        Dk = head_layout(d_model, H, cfg.head_dim)
        Dv = head_layout(d_model, H, cfg.value_dim)
        self.num_heads, self.head_dim, self.value_dim = H, Dk, Dv
        spec = cfg.memory_spec()
        self.parts = MemoryParts(spec, H, Dk, Dv, path="memory")
        self.spec = spec

        self.q_proj = nn.Linear(d_model, H * Dk, bias=False)
        self.k_proj = nn.Linear(d_model, H * Dk, bias=False)
        self.v_proj = nn.Linear(d_model, H * Dv, bias=False)
        if cfg.conv:
            self.q_conv = ShortConv(H * Dk, cfg.conv_size)
            self.k_conv = ShortConv(H * Dk, cfg.conv_size)
            self.v_conv = ShortConv(H * Dv, cfg.conv_size)
        self.out_norm = RMSNorm((H, Dv), eps=cfg.output_norm_eps) if cfg.output_norm else None
        self.g_proj = nn.Linear(d_model, H * Dv, bias=False) if cfg.output_gate else None
        self.o_proj = nn.Linear(H * Dv, d_model, bias=False)

        self.gate_nets = nn.ModuleDict()
        self.gate_consts: Dict[str, float] = {}
        for name in self.used_gates():
            gcfg: GateConfig = getattr(cfg.gates, name)
            if gcfg.learned:
                channels = Dk if (name == "retention" and self.parts.retention.channel_wise) else None
                if gcfg.form == "log_decay":
                    self.gate_nets[name] = _LogDecayGate(d_model, H, channels, gcfg)
                    continue
                act = "softplus" if name == "delta" else "sigmoid"
                bias = gcfg.bias if gcfg.bias is not None else self._default_bias(name)
                self.gate_nets[name] = _Gate(d_model, H, channels, act, bias, gcfg.input_dependent, gcfg.weight_init,
                                             gcfg.use_bias)
            elif gcfg.value is not None:
                self.gate_consts[name] = float(gcfg.value)

    # -- gates --------------------------------------------------------------------------------------
    def used_gates(self) -> Tuple[str, ...]:
        """The gates this memory spec reads: η always; α, θ, γ, δ only when used."""
        p = self.parts
        used = ["lr"]
        if p.retention.uses_alpha:
            used.append("retention")
        if p.inner_optimizer.has_momentum:
            used.append("momentum")
        if p.window.size != 1:
            used.append("window")
        if p.attentional_bias.uses_delta:
            used.append("delta")
        return tuple(used)

    def _default_bias(self, name: str) -> float:
        if name == "retention":
            return 4.0
        if name == "window":
            return 4.0
        if name == "momentum":
            return _logit(getattr(self.spec.inner_optimizer, "momentum", 0.9))
        if name == "delta":
            return _softplus_inv(getattr(self.spec.attentional_bias, "delta", 1.0))
        return 0.0

    def gates(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The gate tensors for ``memorize`` from the layer input ``x: [B, T, d_model]``.

        The input-dependent sigmoid / softplus gates (:class:`_Gate` with a projection) are computed side by side:
        one projection with their stacked weights and biases, one sigmoid over the sigmoid gates' columns, one
        softplus over the rest (each gate's parameters stay its own; ``net(x)`` of each is the reference)."""
        B, T = x.shape[:2]
        H = self.num_heads
        fused = [n for n, net in self.gate_nets.items() if isinstance(net, _Gate) and net.proj is not None]
        computed = self._fused_gates(x, fused) if len(fused) > 1 else {}
        out = {name: computed[name] if name in computed else net(x) for name, net in self.gate_nets.items()}
        for name, value in self.gate_consts.items():
            shape = (B, T, H, self.head_dim) if (name == "retention" and self.parts.retention.channel_wise) \
                else (B, T, H)
            out[name] = x.new_full(shape, value)
        return out

    def _fused_gates(self, x: torch.Tensor, names) -> Dict[str, torch.Tensor]:
        """``{name: net(x)}`` for the :class:`_Gate` nets ``names`` (each with a projection) in one projection."""
        names = sorted(names, key=lambda n: self.gate_nets[n].act != "sigmoid")       # sigmoid gates first
        nets = [self.gate_nets[n] for n in names]
        projs = [net.proj for net in nets]
        bias = None
        if any(p.bias is not None for p in projs):
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projs])
        z = F.linear(x, torch.cat([p.weight for p in projs]), bias)
        n_sig = sum(p.out_features for net, p in zip(nets, projs) if net.act == "sigmoid")
        groups = [g for g in (torch.sigmoid(z[..., :n_sig]) if n_sig else None,
                              F.softplus(z[..., n_sig:]) if n_sig < z.shape[-1] else None) if g is not None]
        g = torch.cat(groups, -1) if len(groups) > 1 else groups[0]
        B, T = x.shape[:2]
        return {n: (gi.reshape(B, T, net.heads, net.channels) if net.channels else gi)
                for n, net, gi in zip(names, nets, g.split([p.out_features for p in projs], -1))}

    # -- backbone -----------------------------------------------------------------------------------
    def _branch(self, x, which: str, cache: Optional[torch.Tensor], cu_seqlens=None):
        """Projection → conv → SiLU (→ ℓ2) of q, k or v. Returns ``([B, T, H, D], new_cache)`` (packed: the conv
        restarts at every sequence of ``cu_seqlens``, and the caches are ``[N, K-1, C]``)."""
        proj = getattr(self, f"{which}_proj")
        h = proj(x)
        new_cache = None
        if self.cfg.conv:
            h, new_cache = getattr(self, f"{which}_conv")(h, cache, cu_seqlens=cu_seqlens)
        if self.cfg.silu:
            h = F.silu(h)
        h = h.reshape(*x.shape[:2], self.num_heads, -1)
        if self.cfg.qk_norm and which in ("q", "k"):
            h = F.normalize(h, dim=-1, eps=1e-6)
        return h, new_cache

    def _branches(self, x, caches: Dict[str, torch.Tensor], cu_seqlens=None):
        """q, k and v at once: :meth:`_branch` of the three, computed side by side on their concatenated channels
        (one projection with the stacked weights W_Q ‖ W_K ‖ W_V, one conv with their stacked filters, one SiLU, one
        ℓ2 norm of q and k); the parameters stay the three projections and convs. Returns ``(q, k, v)``
        (``[B, T, H, D]``) and the new conv caches ``{"q", "k", "v"}`` (empty without conv)."""
        widths = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        h = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        new_caches = {}
        if self.cfg.conv:
            convs = (self.q_conv, self.k_conv, self.v_conv)
            taps = torch.cat([c._taps(x) for c in convs])
            cache = None
            if any(caches.get(n) is not None for n in "qkv"):
                rows = len(cu_seqlens) - 1 if cu_seqlens is not None else x.shape[0]
                cache = torch.cat([caches[n] if caches.get(n) is not None
                                   else x.new_zeros(rows, c.kernel_size - 1, w)
                                   for n, c, w in zip("qkv", convs, widths)], -1)
            if cu_seqlens is not None:
                h, cache = causal_conv_packed(h, taps, cu_seqlens, cache)
            else:
                h, cache = causal_conv(h, taps, cache)
            new_caches = dict(zip("qkv", cache.split(widths, -1)))
        if self.cfg.silu:
            h = F.silu(h)
        B, T, H = *x.shape[:2], self.num_heads
        qk, v = h.split([widths[0] + widths[1], widths[2]], -1)
        qk = qk.reshape(B, T, 2 * H, -1)
        if self.cfg.qk_norm:
            qk = F.normalize(qk, dim=-1, eps=1e-6)
        q, k = qk.split(H, 2)
        return q, k, v.reshape(B, T, H, -1), new_caches

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head norm, output gate and projection: ``o: [B, T, H, D_v]`` → ``[B, T, d_model]``."""
        return gated_head_output(o, x, self.out_norm, self.g_proj, self.o_proj, self.cfg.output_gate_act)

    def initial_state(self, batch: int, dtype=None, device=None) -> MemoryLayerState:
        p = next(self.parameters())
        return MemoryLayerState(fresh_memory_state(self.parts, batch, dtype or p.dtype, device or p.device), {})

    #: takes packed variable-length batches (``cu_seqlens``)
    takes_packed = True

    def forward(self, x: torch.Tensor, state: Optional[MemoryLayerState] = None, return_state: bool = False,
                cu_seqlens=None):
        """``x: [B, T, d_model]`` → ``[B, T, d_model]`` (and the new :class:`MemoryLayerState` if asked).

        ``state`` continues a previous call (memory, conv caches): chained calls equal one call.
        ``cu_seqlens``: packed sequences (``x: [1, ΣT_i, d_model]``, offsets ``[N + 1]``; see
        :meth:`forward_packed`).
        """
        if cu_seqlens is not None:
            return self.forward_packed(x, cu_seqlens, state, return_state)

        q, k, v, caches = self._branches(x, state.conv if state is not None else {})
        o, mem_state = memorize(q, k, v, self.parts, self.gates(x), mode=self.cfg.mode,
                                checkpoint=self.cfg.checkpoint, compile=self.cfg.compile,
                                initial_state=state.memory if state is not None else None)
        y = self._output(o, x)
        if not return_state:
            return y
        return y, MemoryLayerState(mem_state, caches)

    def forward_packed(self, x: torch.Tensor, cu_seqlens, states=None, return_state: bool = False):
        """N packed sequences ``x: [1, ΣT_i, d_model]`` (offsets ``cu_seqlens: [N + 1]``), each exactly as if it ran
        alone: the convs restart at every sequence and ``memorize(..., cu_seqlens=...)`` gives each its own memory
        (``mode="triton"`` runs them natively on the kernels). ``states``: None or the N batch-1
        :class:`MemoryLayerState` a previous call returned; with ``return_state``, returns those of this call."""
        offsets = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
        N = len(offsets) - 1
        if states is not None and (isinstance(states, MemoryLayerState) or len(states) != N):
            raise ValueError(f"MemoryLayer: with cu_seqlens, state must be None or {N} MemoryLayerStates (one per "
                             f"sequence, what a packed call returns)")

        caches = {}
        for which in "qkv":
            if states is not None and all(which in s.conv for s in states):
                caches[which] = torch.cat([s.conv[which] for s in states], 0)
        q, k, v, new_caches = self._branches(x, caches, offsets)
        o, mem_states = memorize(q, k, v, self.parts, self.gates(x), mode=self.cfg.mode,
                                 checkpoint=self.cfg.checkpoint, compile=self.cfg.compile, cu_seqlens=offsets,
                                 initial_state=[s.memory for s in states] if states is not None else None)
        y = self._output(o, x)
        if not return_state:
            return y
        return y, [MemoryLayerState(m, {n: c[i:i + 1] for n, c in new_caches.items()}) for i, m in enumerate(mem_states)]

    def stack_states(self, states) -> MemoryLayerState:
        """The per-sequence states of a packed call → one batch-N :class:`MemoryLayerState` (then decode the N
        sequences as a batch); exact where :func:`atlaslab.engines.packed.stack_states` allows it (positions equal
        modulo the training chunk b, equal window histories), else a ValueError saying what differs."""
        states = list(states)
        conv = {n: torch.cat([s.conv[n] for s in states], 0) for n in states[0].conv}
        return MemoryLayerState(stack_states([s.memory for s in states], self.parts.chunk_size), conv)

    def read(self, x: torch.Tensor, state: Optional[MemoryLayerState] = None,
             q_cache: Optional[torch.Tensor] = None):
        """Read the memory with queries from ``x`` and write nothing (Titans MAC's h_t = M*_{t−1}(q_t)).

        ``x: [B, T, d_model]``; every query reads the memory as it stands in ``state`` (the initial memory
        when None). The query path (projection, conv, SiLU, norm) and the output path are the layer's own;
        ``q_cache`` is the conv cache of this query stream. Returns ``([B, T, d_model], new_q_cache)``.
        """
        q, new_cache = self._branch(x, "q", q_cache)
        mem_state = state.memory if state is not None else self.initial_state(x.shape[0], x.dtype, x.device).memory
        o = read_memory(self.parts, mem_state, q)
        return self._output(o, x), new_cache

    # -- accounting ---------------------------------------------------------------------------------
    def conv_state_size(self) -> int:
        """Scalars of the q/k/v conv caches per sequence: (K − 1)·H·(2·D_k + D_v)."""
        if not self.cfg.conv:
            return 0
        return (self.cfg.conv_size - 1) * self.num_heads * (2 * self.head_dim + self.value_dim)

    def state_size_per_token(self) -> int:
        """Scalars added per context token (the exp kernel trick's slots, a global window's history)."""
        return self.parts.state_size_per_token()

    def state_size(self, context: Optional[int] = None) -> int:
        """Recurrent-state scalars per sequence after ``context`` tokens (zoology's ``state_size``).

        = memory state (fast weights × (1 + momentum + mirror dual) + the Omega window's last c − 1
        (k, v, γ)) + the conv caches + ``state_size_per_token() · context`` (``context=None`` counts 0 tokens).
        """
        return self.parts.state_size() + self.conv_state_size() + self.state_size_per_token() * (context or 0)


__all__ = ["GATES", "GateConfig", "LayerGates", "MemoryLayer", "MemoryLayerConfig", "MemoryLayerState", "RMSNorm",
           "ShortConv"]
