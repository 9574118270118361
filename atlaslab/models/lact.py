"""LaCT, large-chunk test-time training with sliding-window attention in the same layer (Zhang et al. 2025,
"Test-Time Training Done Right", arXiv 2505.23884; docs/concepts/memory.md#lact).

    x ─ W_QKV ─ (RMSNorm q, k) ─┬─ RoPE ─ SWA(q, k, v; window) ─────────────────────────────────────┐
                                └─ q, k ⊙ s + o ─ SiLU ─ ℓ2/head ─ RoPE ─ memorize ─ RMSNorm ─ ⊙ silu(W_s x) ─ + ─ W_O
    gates from x: γ_t = softplus(w_γ·x_t + b_γ) (the per-token step), θ_t = σ(w_θ·x_t + b_θ) (momentum)

Both branches read the same q, k, v projections. The test-time-training branch is a memory of registered parts
(:data:`LACT_MEMORY_SPEC`), so every engine computes it and any part can be swapped for an ablation. For chunk n
of b tokens C_n, with W⁽ⁿ⁾ the fast weights after chunk n − 1 (W⁽⁰⁾ the learned initial weights):

    o_t    = f(W⁽ⁿ⁾; q_t),   t ∈ C_n,   f(W; x) = W_1 (silu(W_2 x) ⊙ W_3 x)      apply, then update
    G_n    = Σ_{i∈C_n} γ_i ∇_W ℓ(W⁽ⁿ⁾; k_i, v_i),   ℓ(W; k, v) = −⟨f(W; k), v⟩      summed chunk gradient
    S_n    = θ̄_n S_{n−1} + G_n,   θ̄_n = mean_{i∈C_n} θ_i                          momentum
    W⁽ⁿ⁺¹⁾ = WeightNorm(W⁽ⁿ⁾ − η · NS_5(S_n))                                      Muon; rows back to their norms

In the parts' terms: ``gated_mlp`` (no residual, SiLU) + ``dot`` + ``muon`` (``ns_granularity: chunk``, η = 1)
+ ``weight_norm`` + ``read: chunk``, with the per-token step carried by the window gate γ (window c = 1) and θ̄
by the momentum gate (:func:`chunk_mean_momentum`).

LaCT's (paper and reference code): all of the above, with q/k RMSNorm optional, per-channel scale and offset of the
fast q, k, RoPE on them in the attention's head layout, and the branches summed before W_O. Ours: one γ per head
shared by the three matrices (LaCT learns one per matrix; under Muon only their ratios across tokens matter), the
chunk-start norm as the weight norm's target (equal to LaCT's initial norm, eps a clamp), Xavier-normal initial
fast weights (LaCT's 1/√fan_in at hidden = d), RMSNorm weights per head, no bf16 (docs/concepts/memory.md#lact has
the table). ``forward`` takes no state; a sequence continues through the decoder (atlaslab/models/decoding.py), which
holds each open chunk until it is whole, since its mean θ needs all of it.

Shapes: ``forward(x: [B, T, d_model]) -> [B, T, d_model]``; attention heads ``[B, T, num_heads, d_model /
num_heads]``, fast-weight heads ``[B, T, ttt_heads, d_model / ttt_heads]``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.engines import MODES, memorize
from atlaslab.memory.spec import MemoryParts, MemorySpec, resolve_memory_spec
from atlaslab.models.attention import apply_rope, attention_mask, head_layout, rope_angles
from atlaslab.models.layers import RMSNorm, _logit, _softplus_inv
from atlaslab.registry import ConfigError, PartConfig, check_choice, check_range, register, to_container
from atlaslab.registry.weight_decay import exempt_from_weight_decay

#: LaCT's fast-weight memory: SwiGLU fast weights, negative dot-product loss, one Muon step per chunk with LaCT's
#: Newton–Schulz schedule (η = 1: the step size is the per-token γ inside the sum), weight norm, apply-then-update.
LACT_MEMORY_SPEC = {
    "memory": {"name": "gated_mlp", "expansion": 1.0, "activation": "silu", "residual": False},
    "attentional_bias": {"name": "dot"},
    "retention": {"name": "weight_norm", "axis": "row"},
    "feature_map": {"name": "identity"},
    "inner_optimizer": {"name": "muon", "lr": 1.0, "momentum": 0.5, "ns_steps": 5, "ns_granularity": "chunk",
                        "ns_coefficients": "lact"},
    "window": {"name": "omega", "size": 1},
    "chunk_size": 2048,
    "read": "chunk",
}


def chunk_mean_momentum(theta: torch.Tensor, b: int) -> torch.Tensor:
    """The momentum gate that turns Muon's per-token scan into LaCT's per-chunk momentum.

    Chunk-granular Muon ends a chunk C with S = (Π_{i∈C} θ_i) S_prev + Σ_{i∈C} (Π_{j∈C, j>i} θ_j) γ_i g_i. With θ
    equal to the chunk's mean θ̄ at its first token and 1 at the others, S = θ̄ S_prev + Σ γ_i g_i, LaCT's rule.
    That first-token θ uses later tokens of its chunk; it is still causal, because S is used only at the chunk's end.

    ``theta: [B, T, H]`` (chunks counted from the call's first token; a last partial chunk averages its own tokens)
    → ``[B, T, H]``.
    """
    B, T, H = theta.shape
    n = -(-T // b)
    pad = n * b - T
    padded = F.pad(theta, (0, 0, 0, pad)).reshape(B, n, b, H)
    counts = torch.full((n, 1), float(b), dtype=theta.dtype, device=theta.device)
    counts[-1] = b - pad
    mean = padded.sum(2) / counts                                                  # [B, n, H]
    rest = theta.new_ones(B, n, b - 1, H)
    return torch.cat([mean.unsqueeze(2), rest], 2).reshape(B, n * b, H)[:, :T]


@dataclass
class LaCTConfig(PartConfig):
    """The LaCT layer: SWA and a chunk-wise test-time-trained memory on shared q, k, v projections."""

    memory: Any = field(default_factory=dict)   # the fast-weight memory spec, over LACT_MEMORY_SPEC (see memory_spec)
    num_heads: int = 4            # attention heads (head dim d_model / num_heads)
    ttt_heads: int = 2            # fast-weight heads (head dim d_model / ttt_heads): few and wide, as in LaCT
    window: int = 2048            # SWA window (the query itself included); LaCT pairs it with the chunk size
    rope: bool = True             # RoPE on the attention's q, k
    rope_base: float = 10000.0
    ttt_rope: bool = True         # the same RoPE (attention head layout) on the fast q, k (LaCT; false: NoPE)
    qk_norm: bool = False         # RMSNorm (learned, over d_model) of q and k before both branches
    qk_affine: bool = True        # learned per-channel scale and offset of the fast q, k
    silu: bool = True             # SiLU on the fast q, k, v
    base_lr: float = 1e-3         # γ at init: softplus(b_γ) = base_lr
    momentum_gate: bool = True    # learned θ_t (bias logit(inner_optimizer.momentum)); false: that constant
                                  # (0: no momentum, S_n = G_n)
    output_scale: bool = True     # the TTT read ⊙ silu(W_s x), one scale per fast-weight head
    mode: str = "chunked"         # memorize engine of the TTT branch (recurrent | chunked | triton)
    checkpoint: bool = False      # chunked engine: recompute chunks in the backward pass

    def check(self) -> None:
        check_range("num_heads", self.num_heads, 1, None)
        check_range("ttt_heads", self.ttt_heads, 1, None)
        check_range("window", self.window, 1, None)
        check_range("rope_base", self.rope_base, 1e-9, None, "must be positive, in")
        check_range("base_lr", self.base_lr, 1e-12, None, "must be positive, in")
        check_choice("mode", self.mode, tuple(MODES))
        self.memory = self.memory_spec()   # resolved once, here; errors carry the path "memory.…"

    def memory_spec(self) -> MemorySpec:
        """The memory node over :data:`LACT_MEMORY_SPEC`: a part node of the same name (or none) adds its fields to
        LaCT's, one with another name replaces it, as do ``chunk_size`` and ``read``. Once :meth:`check` has
        resolved it, the typed spec is returned as it is."""
        if isinstance(self.memory, MemorySpec):
            return self.memory
        node = copy.deepcopy(LACT_MEMORY_SPEC)
        for key, value in (to_container(self.memory) or {}).items():
            base = node.get(key)
            same_part = isinstance(value, Mapping) and isinstance(base, Mapping) and \
                value.get("name", base["name"]) == base["name"]
            if same_part:
                value = {**base, **value}
            node[key] = value
        return resolve_memory_spec(node, path="memory")


@register("mixer", "lact")
class LaCTLayer(nn.Module):
    """LaCT layer: sliding-window attention plus large-chunk test-time training on shared q, k, v (LaCT §3)."""

    Config = LaCTConfig

    def __init__(self, cfg: LaCTConfig, d_model: int):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        self.num_heads = cfg.num_heads
        self.head_dim = head_layout(d_model, cfg.num_heads, None)
        if d_model % cfg.ttt_heads:
            raise ConfigError("ttt_heads", f"d_model {d_model} is not divisible by ttt_heads {cfg.ttt_heads}.",
                              value=cfg.ttt_heads)
        if cfg.ttt_rope and cfg.num_heads % cfg.ttt_heads:
            raise ConfigError("ttt_heads", f"with ttt_rope the fast q, k are rotated in the attention's head layout, "
                              f"so each of the {cfg.ttt_heads} fast-weight heads must hold whole attention heads "
                              f"(num_heads {cfg.num_heads} is not a multiple).", value=cfg.ttt_heads)
        H, D = cfg.ttt_heads, d_model // cfg.ttt_heads
        self.ttt_heads, self.ttt_dim = H, D
        self.spec = cfg.memory_spec()
        self.parts = MemoryParts(self.spec, H, D, D, path="memory")

        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.q_norm = RMSNorm(d_model) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d_model) if cfg.qk_norm else None
        if cfg.qk_affine:
            self.qk_scale = nn.Parameter(torch.ones(2, d_model))
            self.qk_offset = nn.Parameter(torch.zeros(2, d_model))
            exempt_from_weight_decay(self.qk_scale, self.qk_offset)
        self.lr_proj = nn.Linear(d_model, H)
        nn.init.normal_(self.lr_proj.weight, std=d_model ** -0.5)
        nn.init.constant_(self.lr_proj.bias, _softplus_inv(cfg.base_lr))
        self.momentum_proj = None
        if cfg.momentum_gate and self.parts.inner_optimizer.has_momentum:
            self.momentum_proj = nn.Linear(d_model, H)
            nn.init.normal_(self.momentum_proj.weight, std=d_model ** -0.5)
            nn.init.constant_(self.momentum_proj.bias, _logit(self.spec.inner_optimizer.momentum))
        self.out_norm = RMSNorm((H, D))
        self.scale_proj = nn.Linear(d_model, H) if cfg.output_scale else None
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE in the attention head layout of ``x: [B, T, d_model]`` → ``[B, T, num_heads, head_dim]``."""
        cos, sin = rope_angles(positions, self.head_dim, self.cfg.rope_base, x.dtype)
        return apply_rope(x.view(*x.shape[:2], self.num_heads, self.head_dim), cos, sin)

    def project(self, x: torch.Tensor):
        """The shared projections ``x: [B, T, d_model]`` → q, k, v ``[B, T, d_model]`` (q, k RMSNormed with qk_norm)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attention_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """The SWA's q, k, v ``[B, T, d_model]`` → ``[B, T, num_heads, head_dim]``, q and k rotated at ``positions: [T]``."""
        shape = (*q.shape[:2], self.num_heads, self.head_dim)
        if self.cfg.rope:
            return self._rope(q, positions), self._rope(k, positions), v.reshape(shape)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sliding-window softmax attention, ``[B, T, d_model]`` each → ``[B, T, d_model]``."""
        B, T, _ = q.shape
        q, k, v = (t.transpose(1, 2) for t in self.attention_heads(q, k, v, torch.arange(T, device=q.device)))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(T, self.cfg.window, 0, q.device))
        return o.transpose(1, 2).reshape(B, T, -1)

    @property
    def chunk_momentum(self) -> bool:
        """Whether θ enters as each chunk's mean (:func:`chunk_mean_momentum`, under chunk-granular Muon): then the
        momentum gate of a chunk's first token needs the whole chunk, which a decoder must wait for."""
        return self.parts.inner_optimizer.has_momentum and \
            getattr(self.spec.inner_optimizer, "ns_granularity", "token") == "chunk"

    def token_gates(self, x: torch.Tensor) -> dict:
        """Each token's own γ (``window``) and, with momentum, θ_t (``momentum``), ``[B, T, ttt_heads]``."""
        gates = {"window": F.softplus(self.lr_proj(x))}
        if self.parts.inner_optimizer.has_momentum:
            if self.momentum_proj is not None:
                gates["momentum"] = torch.sigmoid(self.momentum_proj(x))
            else:
                gates["momentum"] = gates["window"].new_full(gates["window"].shape, self.spec.inner_optimizer.momentum)
        return gates

    def chunk_gates(self, gates: dict) -> dict:
        """The memorize gates of whole chunks counted from the first token: θ becomes each chunk's mean
        (:func:`chunk_mean_momentum`) where :attr:`chunk_momentum`, else the tokens' own gates."""
        if not self.chunk_momentum:
            return gates
        return {**gates, "momentum": chunk_mean_momentum(gates["momentum"], self.spec.chunk_size)}

    def gates(self, x: torch.Tensor) -> dict:
        """γ (``window``: the per-token step) and θ (``momentum``, LaCT's chunk mean), ``[B, T, ttt_heads]``."""
        return self.chunk_gates(self.token_gates(x))

    def fast_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None):
        """The TTT branch's inputs from the shared projections: ``[B, T, d_model]`` → ``[B, T, ttt_heads, ttt_dim]``
        (RoPE at ``positions: [T]``, default 0 … T − 1)."""
        B, T, _ = q.shape
        if self.cfg.qk_affine:
            q = q * self.qk_scale[0] + self.qk_offset[0]
            k = k * self.qk_scale[1] + self.qk_offset[1]
        if self.cfg.silu:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        shape = (B, T, self.ttt_heads, self.ttt_dim)
        q, k = (F.normalize(t.reshape(shape), dim=-1, eps=1e-6) for t in (q, k))
        if self.cfg.ttt_rope:   # a rotation inside each attention head: the fast-weight heads keep unit norm
            pos = torch.arange(T, device=q.device) if positions is None else positions
            q, k = (self._rope(t.reshape(B, T, -1), pos).reshape(shape) for t in (q, k))
        return q, k, v.reshape(shape)

    def output(self, o_attn: torch.Tensor, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """W_O(SWA + RMSNorm(TTT read) ⊙ silu(W_s x)): ``o_attn: [B, T, d_model]``, ``o: [B, T, ttt_heads, ttt_dim]``."""
        o = self.out_norm(o)
        if self.scale_proj is not None:
            o = o * F.silu(self.scale_proj(x)).unsqueeze(-1)
        return self.o_proj(o_attn + o.reshape(*x.shape[:2], -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, d_model]`` → ``[B, T, d_model]`` (chunks and RoPE positions count from x's first token; to
        continue a sequence token by token use :func:`atlaslab.models.decoding.decode_mixer`)."""
        q, k, v = self.project(x)
        o_attn = self.attention(q, k, v)
        fq, fk, fv = self.fast_qkv(q, k, v)
        o, _ = memorize(fq, fk, fv, self.parts, self.gates(x), mode=self.cfg.mode, checkpoint=self.cfg.checkpoint)
        return self.output(o_attn, o, x)

    # -- accounting ---------------------------------------------------------------------------------
    def state_size_per_token(self) -> int:
        """Scalars added per context token (0: the fast weights and the SWA cache are fixed in size)."""
        return self.parts.state_size_per_token()

    def state_size(self, context: Optional[int] = None) -> int:
        """Recurrent-state scalars per sequence: fast weights (and momentum) + the SWA cache, window · 2 · d_model."""
        return (self.parts.state_size() + self.cfg.window * 2 * self.d_model
                + self.state_size_per_token() * (context or 0))


__all__ = ["LACT_MEMORY_SPEC", "LaCTConfig", "LaCTLayer", "chunk_mean_momentum"]
