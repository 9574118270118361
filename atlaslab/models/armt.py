"""The ARMT block: segment-local attention plus an associative memory read by every token, written per segment.

Rodkin et al. 2024, "Associative Recurrent Memory Transformer" (arXiv 2407.04841); docs/concepts/memory.md#armt.
The sequence is cut into segments S of ``segment`` tokens; N = ``memory_tokens`` learnable tokens M are appended to
each complete segment. With u the block's (normalised) input, per segment:

    h = [S ‖ M],   r = read_{A,z}(h),   y = CausalAttn(h + r)          (RoPE positions 0..C+N−1 in the segment)
    output (segment tokens) = r + y,    memory tokens m = h + r + y  →  write (A, z) ← write_{A,z}(m)

with the associative read / write of :mod:`atlaslab.memory.associative` (q, k, β from linear maps of h and m,
φ a registered non-negative feature map, DPFP ν = 3 by default, features ℓ2-normalised). Attention never crosses a
segment: the memory is the only path between segments, and ``use_memory: false`` leaves segment-local causal
attention. Segment tokens never see the memory tokens (they come last), so the block stays causal.

The paper's: memory tokens appended to every segment; A, z per layer written by the memory tokens' hidden states
after the layer; the read added to every token's hidden state (memory tokens too) before attention; W_q, W_k, W_v,
W_β learned (W_v zero at init, β per memory head, no output projection: the value width is d_model); DPFP ν = 3;
unit features, γ clipped to [0, 1] and held constant, ε = 1e-5 (the authors' code). ``read_floor: 1`` bounds the
read (A φ / max(zᵀφ + ε, 1), see :mod:`atlaslab.memory.associative`), a labelled departure from the authors.
Ours: the block sits in our small Llama-style LM in place of a mixer, so it reads from the pre-normed input, its
memory tokens are per layer (learnable, not threaded through the whole stack) and are written from the block's
residual (no MLP), and a partial segment is kept in the state (``pending``) so chained calls equal one call at any
boundary.

``memory_flow: through_stack`` is the authors' arrangement instead: one set of memory tokens joins each complete
segment at the embedding and runs up the whole stack (every layer's attention and MLP), and each layer writes its
A, z from the memory tokens' hidden state after the layer, its MLP included. So above the first layer a memory token
has already read the segment. The loop is segment-major (every layer on segment 1, then segment 2, …), so it runs
in the language model (:class:`ARMTStack`), not block by block; every layer of such a model must be an ``armt``
block with ``through_stack`` and the same ``segment`` and ``memory_tokens``.

Shapes: ``forward(x: [B, T, d_model]) -> [B, T, d_model]``; memory tensors ``[B, T, H_m, F]`` (F = φ's width).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.memory.associative import associative_read, associative_write
from atlaslab.models.attention import Attention, AttentionConfig
from atlaslab.registry import (ConfigError, PartConfig, check_choice, check_range, get_registry, register,
                               resolve_part)

#: where the memory tokens come from and what writes: ``per_layer`` (a learned constant per layer, written from the
#: block's residual), ``through_stack`` (one set from the embedding up, written from each layer's output; the authors')
MEMORY_FLOWS = ("per_layer", "through_stack")


@dataclass
class ARMTConfig(AttentionConfig):
    """The attention fields (heads, head dim, RoPE) plus the segment recurrence and the associative memory."""

    segment: int = 64                  # C, tokens per segment (attention never crosses a segment)
    memory_tokens: int = 16            # N, learnable tokens appended to every complete segment; they write A, z
    use_memory: bool = True            # false: no memory tokens, reads or writes (segment-local attention)
    memory_heads: int = 1              # H_m heads of A, z; each reads d_model / H_m channels
    key_dim: Optional[int] = None      # d_k per memory head before φ (default d_model / H_m)
    feature_map: Any = "dpfp"          # a non-negative registered φ (a name or a node; DPFP's default ν is 3)
    correction: bool = True            # γ on the normaliser z (false: z ← z + Σ φ_i)
    memory_flow: str = "per_layer"     # per_layer | through_stack (the authors'; see the module doc)
    read_floor: float = 0.0            # reads A φ / max(zᵀφ + ε, read_floor); 0: the authors' rule, 1: bounded

    def check(self) -> None:
        super().check()
        check_choice("memory_flow", self.memory_flow, MEMORY_FLOWS)
        if self.memory_flow == "through_stack" and not self.use_memory:
            raise ConfigError("memory_flow", "through_stack carries memory tokens up the stack, and use_memory: false "
                                             "has none; use memory_flow: per_layer for segment-local attention.",
                              value=self.memory_flow, choices=["per_layer"])
        check_range("segment", self.segment, 1, None)
        check_range("memory_tokens", self.memory_tokens, 1, None)
        check_range("memory_heads", self.memory_heads, 1, None)
        check_range("read_floor", self.read_floor, 0.0, None)
        if self.key_dim is not None:
            check_range("key_dim", self.key_dim, 1, None)
        self.feature_map_config()

    def feature_map_config(self) -> PartConfig:
        """The resolved φ; a ConfigError at ``feature_map.…`` if it is unknown, ill-typed or can be negative."""
        cfg = resolve_part("feature_map", self.feature_map, "feature_map")
        registry = get_registry("feature_map")
        if not getattr(registry.get(cfg.name).cls, "nonnegative", False):
            raise ConfigError("feature_map.name", f"ARMT divides its read by zᵀφ(q), so φ must be non-negative; "
                                                  f"'{cfg.name}' is not.", value=cfg.name,
                              choices=[e.name for e in registry if getattr(e.cls, "nonnegative", False)])
        return cfg


@dataclass
class ARMTState:
    """What an ARMT block carries between calls: A ``[B, H_m, D_v, F]`` and z ``[B, H_m, F]`` (None with the memory
    off) and ``pending`` ``[B, P, d_model]``, the inputs of the unfinished segment (P < C)."""

    A: Optional[torch.Tensor]
    z: Optional[torch.Tensor]
    pending: torch.Tensor

    def detach(self) -> "ARMTState":
        return ARMTState(*(t.detach() if t is not None else None for t in (self.A, self.z, self.pending)))


@register("block", "armt")
class ARMTBlock(Attention):
    """ARMT: segment-local attention with an associative memory written by memory tokens (Rodkin et al. 2024)."""

    Config = ARMTConfig
    #: the segment recurrence does not take packed batches (``cu_seqlens``)
    takes_packed = False

    def __init__(self, cfg: ARMTConfig, d_model: int):
        super().__init__(cfg, d_model)           # the attention's q, k, v, o projections and head layout
        self.feature_map = None
        if not cfg.use_memory:
            return
        Hm = cfg.memory_heads
        if d_model % Hm:
            raise ConfigError("memory_heads", f"d_model {d_model} is not divisible by memory_heads {Hm} (each "
                                              f"memory head reads d_model / memory_heads channels).", value=Hm)
        self.memory_heads, self.key_dim, self.value_dim = Hm, cfg.key_dim or d_model // Hm, d_model // Hm
        fm_cfg = cfg.feature_map_config()
        try:
            self.feature_map = get_registry("feature_map").get(fm_cfg.name).cls(fm_cfg, self.key_dim)
        except ConfigError as exc:
            raise exc.prefixed("feature_map") from None
        self.mem_q = nn.Linear(d_model, Hm * self.key_dim, bias=False)
        self.mem_k = nn.Linear(d_model, Hm * self.key_dim, bias=False)
        self.mem_v = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.mem_v.weight)        # the authors' init: the memory starts silent
        self.mem_beta = nn.Linear(d_model, Hm)
        if cfg.memory_flow == "per_layer":       # through_stack: the language model's ARMTStack holds them
            self.memory_tokens = nn.Parameter(torch.randn(cfg.memory_tokens, d_model))

    # -- the associative memory -------------------------------------------------------------------------
    @property
    def num_features(self) -> int:
        return self.feature_map.out_dim

    def features(self, h: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        """Unit features φ̂ = φ(W h) / ‖φ(W h)‖ per memory head, ``h: [B, n, d_model]`` → ``[B, n, H_m, F]``."""
        x = proj(h).view(*h.shape[:2], self.memory_heads, self.key_dim)
        return F.normalize(self.feature_map(x), dim=-1)

    def read(self, h: torch.Tensor, A: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A φ̂(q) / (zᵀφ̂(q) + ε) (``read_floor``: / max(·, floor)) for every token of ``h: [B, n, d_model]`` →
        ``[B, n, d_model]``."""
        return associative_read(A, z, self.features(h, self.mem_q), floor=self.cfg.read_floor).reshape(h.shape)

    def write(self, m: torch.Tensor, A: torch.Tensor, z: torch.Tensor):
        """The memory tokens' hidden states ``m: [B, N, d_model]`` write A, z → the new (A, z)."""
        B, N, _ = m.shape
        v = self.mem_v(m).view(B, N, self.memory_heads, self.value_dim)
        beta = torch.sigmoid(self.mem_beta(m))
        return associative_write(A, z, self.features(m, self.mem_k), v, beta, self.cfg.correction,
                                 floor=self.cfg.read_floor)

    def initial_state(self, batch: int, dtype=None, device=None) -> ARMTState:
        p = self.q_proj.weight
        dtype, device = dtype or p.dtype, device or p.device
        pending = torch.zeros(batch, 0, self.d_model, dtype=dtype, device=device)
        if not self.cfg.use_memory:
            return ARMTState(None, None, pending)
        Hm, Fd = self.memory_heads, self.num_features
        return ARMTState(torch.zeros(batch, Hm, self.value_dim, Fd, dtype=dtype, device=device),
                         torch.zeros(batch, Hm, Fd, dtype=dtype, device=device), pending)

    # -- the segment recurrence ---------------------------------------------------------------------------
    def mix(self, h: torch.Tensor, A: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Read, then attend, over one segment's tokens ``h: [B, n, d_model]`` (memory tokens last, if any):
        r = read(h), y = CausalAttn(h + r) → ``r + y`` for every token."""
        r = self.read(h, A, z)
        return r + super().forward(h + r)

    def segment_step(self, s: torch.Tensor, A: Optional[torch.Tensor], z: Optional[torch.Tensor], write: bool):
        """One segment ``s: [B, L, d_model]`` (L ≤ C) → (its outputs ``[B, L, d_model]``, A, z after it).

        ``write``: the segment is complete, so the memory tokens are appended and write the memory."""
        L = s.shape[1]
        if not self.cfg.use_memory:
            return super().forward(s), A, z      # segment-local causal attention
        h = torch.cat([s, self.memory_tokens.to(s.dtype).expand(s.shape[0], -1, -1)], 1) if write else s
        out = self.mix(h, A, z)                  # causal attention within [S ‖ M], positions 0..L+N−1
        if write:
            A, z = self.write(h[:, L:] + out[:, L:], A, z)
        return out[:, :L], A, z

    def decode(self, x: torch.Tensor, state: Optional[ARMTState] = None):
        """Token-by-token decoding (:mod:`atlaslab.models.decoding`): the chained forward, exact at any split. The
        unfinished segment is recomputed on every call (O(C²) per token for segments of C); no KV cache yet."""
        return self.forward(x, state, return_state=True)

    def forward(self, x: torch.Tensor, state: Optional[ARMTState] = None, return_state: bool = False):
        """``x: [B, T, d_model]`` → ``[B, T, d_model]`` (and the new :class:`ARMTState` if asked).

        ``state`` continues a previous call: A, z and the unfinished segment's inputs, whose outputs were already
        returned and are recomputed here (they see the same A, z); chained calls equal one call at any split.
        """
        if self.cfg.memory_flow == "through_stack":
            raise RuntimeError("an armt block with memory_flow: through_stack runs inside its language model "
                               "(ARMTStack: every layer per segment), not on its own")
        B, T, _ = x.shape
        state = state if state is not None else self.initial_state(B, x.dtype, x.device)
        P, C = state.pending.shape[1], self.cfg.segment
        xs = torch.cat([state.pending, x], 1) if P else x
        A, z, outs = state.A, state.z, []
        for start in range(0, xs.shape[1], C):
            s = xs[:, start:start + C]
            y, A, z = self.segment_step(s, A, z, write=s.shape[1] == C)
            outs.append(y)
        y = torch.cat(outs, 1)[:, P:]
        if not return_state:
            return y
        return y, ARMTState(A, z, xs[:, (xs.shape[1] // C) * C:])

    # -- accounting ---------------------------------------------------------------------------------------
    def state_size_per_token(self) -> int:
        return 0

    def state_size(self, context: Optional[int] = None) -> int:
        """A and z (H_m·F·(D_v + 1)) + the KV cache of one segment (C · 2·H·D_h); memory tokens are parameters."""
        kv = self.cfg.segment * 2 * self.num_heads * self.head_dim
        if not self.cfg.use_memory:
            return kv
        return self.memory_heads * self.num_features * (self.value_dim + 1) + kv


class ARMTStack(nn.Module):
    """The authors' ARMT arrangement over a language model's layers (``memory_flow: through_stack``).

    Per complete segment S of C tokens: h = [embed(S) ‖ M] with one set of N learned memory tokens M, then for
    each layer ℓ, with its A_ℓ, z_ℓ from the previous segments,

        h ← h + mix_ℓ(RMSNorm(h)),   h ← h + MLP_ℓ(RMSNorm(h)),   A_ℓ, z_ℓ ← write_ℓ(h on the memory tokens)

    (``mix`` = read, then segment-local attention; see :meth:`ARMTBlock.mix`). The segment's outputs are h on its
    tokens. A last, partial segment takes no memory tokens and writes nothing. The state is one
    :class:`ARMTState` per layer; all of them hold the same ``pending`` inputs (embeddings) of the unfinished
    segment, recomputed with the next call, so chained calls equal one call at any split.
    """

    def __init__(self, memory_tokens: int, segment: int, d_model: int):
        super().__init__()
        self.segment = segment
        self.memory_tokens = nn.Parameter(torch.randn(memory_tokens, d_model))

    def forward(self, layers, x: torch.Tensor, states=None):
        """``layers``: the LM's layers (``mixer_norm``, ``mixer`` an :class:`ARMTBlock`, ``_mlp``); ``x: [B, T,
        d_model]`` the embeddings → (the last layer's outputs ``[B, T, d_model]``, one ARMTState per layer)."""
        B, C = x.shape[0], self.segment
        states = states or [layer.mixer.initial_state(B, x.dtype, x.device) for layer in layers]
        P = states[0].pending.shape[1]
        xs = torch.cat([states[0].pending, x], 1) if P else x
        A, z, outs = [s.A for s in states], [s.z for s in states], []
        for start in range(0, xs.shape[1], C):
            s = xs[:, start:start + C]
            L = s.shape[1]
            write = L == C
            h = torch.cat([s, self.memory_tokens.to(s.dtype).expand(B, -1, -1)], 1) if write else s
            for i, layer in enumerate(layers):
                h = layer._mlp(h + layer.mixer.mix(layer.mixer_norm(h), A[i], z[i]))
                if write:
                    A[i], z[i] = layer.mixer.write(h[:, L:], A[i], z[i])
            outs.append(h[:, :L])
        rest = xs[:, (xs.shape[1] // C) * C:]
        return torch.cat(outs, 1)[:, P:], [ARMTState(a, b, rest) for a, b in zip(A, z)]


def stack_config(layer_keys, mixers, path: str = "") -> Optional[ARMTConfig]:
    """The shared config of a model whose layers use ``memory_flow: through_stack`` (None when none does).

    ``layer_keys``: the mixer key of every layer; ``mixers``: key → (kind, resolved config). A ConfigError at
    ``mixers.<key>.…`` unless every layer is such an ``armt`` block with one ``segment`` and ``memory_tokens``."""
    keys = list(dict.fromkeys(layer_keys))
    stacked = [k for k in keys if isinstance(mixers[k][1], ARMTConfig) and mixers[k][1].memory_flow == "through_stack"]
    if not stacked:
        return None
    first = mixers[stacked[0]][1]
    for key in keys:
        cfg = mixers[key][1]
        where = f"{path + '.' if path else ''}mixers.{key}"
        if key not in stacked:
            raise ConfigError(f"{where}.memory_flow" if isinstance(cfg, ARMTConfig) else f"{where}.name",
                              f"mixers.{stacked[0]} carries its memory tokens through the stack "
                              f"(memory_flow: through_stack), so every layer must be an armt block that does.",
                              value=getattr(cfg, "memory_flow", cfg.name), choices=["through_stack"])
        for f in ("segment", "memory_tokens"):
            if getattr(cfg, f) != getattr(first, f):
                raise ConfigError(f"{where}.{f}", f"the layers share one segment recurrence and one set of memory "
                                                  f"tokens; mixers.{stacked[0]}.{f} is {getattr(first, f)}.",
                                  value=getattr(cfg, f))
    return first


__all__ = ["ARMTBlock", "ARMTConfig", "ARMTStack", "ARMTState", "MEMORY_FLOWS", "stack_config"]
