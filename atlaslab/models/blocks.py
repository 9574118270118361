"""Memory blocks of Titans §4 (docs/concepts/memory.md#blocks): LMM, MAG, MAL and MAC.

A block takes the place of a mixer in a language-model layer (``x + block(norm(x))``) and maps
``[B, T, d_model] → [B, T, d_model]``. Its config *extends* the memory layer's (same ``memory``, backbone and
``gates`` fields, so ``<block>.memory.chunk_size=4`` works as for a plain memory mixer) with:

- ``persistent_tokens`` N_p: learnable, input-independent tokens P prepended to the sequence, x̃ = P ‖ x
  (Titans Eq.19); the block's outputs at those positions are dropped. For MAC they are prepended to every
  segment's attention context instead.
- ``attention``: the attention branch (heads, head dim, SWA window, RoPE).

Blocks (x̃ = P ‖ x):

- ``lmm`` (Titans LMM): o = M(x̃).
- ``mag`` (Eq.26-28): y = SWA*(x̃) (the prefix P always visible), m = M(x̃);
  o = RMSNorm_y(y) ⊙ σ(RMSNorm_m(m)) — both normalised with learnable vector weights, then the sigmoid
  non-linearity (Titans §4.2's description; the exact σ is unstated in the paper). ``gate: none`` drops the
  memory branch (o = y, exactly the SWA mixer) for ablations.
- ``mal`` (Eq.29-31): o = SWA*(RMSNorm(M(x̃))). For Samba-style stacking with a residual and an MLP around each
  of the two, use a layer pattern such as ``[memory, swa]`` instead.
- ``mac`` (Eq.21-25): the sequence is cut into segments S of ``segment`` tokens. For each segment,
  h = M*_{prev}(q(S)) reads the memory left by the previous segments (no write); y = Attn([P ‖ h ‖ S]) is full
  causal attention within the segment window; the memory is then written with y (M ← M(y)) and read,
  o = RMSNorm_y(y) ⊙ σ(RMSNorm_m(M*(y))). Causality: h_i is built from token i's query, so segment token j
  sees P, h_{≤j} and S_{≤j} only (the papers leave the mask unstated; a full mask over h would leak the
  segment's future). ``read_tokens: false`` drops h, ``gate: none`` gives o = y.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from atlaslab.registry import check_choice, check_range, register
from atlaslab.models.attention import Attention, AttentionConfig, SlidingWindowAttention, SWAConfig, attention_mask
from atlaslab.models.layers import MemoryLayer, MemoryLayerConfig, RMSNorm

BLOCK_GATES = ("sigmoid", "none")
MAC_WRITES = ("output", "input")


@dataclass
class BlockAttention:
    """The attention branch of a block."""

    num_heads: Optional[int] = None   # default: the memory's num_heads
    head_dim: Optional[int] = None    # default: d_model // num_heads
    window: int = 64                  # SWA window (mag, mal); unused by mac (full attention in a segment)
    rope: bool = True
    rope_base: float = 10000.0


@dataclass
class BlockConfig(MemoryLayerConfig):
    persistent_tokens: int = 0        # N_p
    attention: BlockAttention = field(default_factory=BlockAttention)

    def check(self) -> None:
        super().check()
        check_range("persistent_tokens", self.persistent_tokens, 0, None)
        check_range("attention.window", self.attention.window, 1, None)


class _Block(nn.Module):
    Config = BlockConfig

    def __init__(self, cfg: BlockConfig, d_model: int):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        self.memory = MemoryLayer(cfg, d_model)
        n_p = cfg.persistent_tokens
        self.persistent = nn.Parameter(torch.randn(n_p, d_model)) if n_p else None

    def _attention(self, cls, **extra) -> Attention:
        a = self.cfg.attention
        acfg_cls = SWAConfig if cls is SlidingWindowAttention else AttentionConfig
        acfg = acfg_cls(name="swa" if cls is SlidingWindowAttention else "attention",
                        num_heads=a.num_heads or self.cfg.num_heads, head_dim=a.head_dim, rope=a.rope,
                        rope_base=a.rope_base, **extra)
        return cls(acfg, self.d_model)

    @property
    def num_persistent(self) -> int:
        return self.cfg.persistent_tokens

    def _prepend(self, x: torch.Tensor) -> torch.Tensor:
        if self.persistent is None:
            return x
        return torch.cat([self.persistent.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)

    def state_size_per_token(self) -> int:
        return self.memory.state_size_per_token()

    def state_size(self, context: Optional[int] = None) -> int:
        """Recurrent-state scalars per sequence: the memory layer's plus the block's KV cache.

        Persistent tokens are parameters, not state.
        """
        return self.memory.state_size(context)


@register("block", "lmm")
class LMMBlock(_Block):
    """Titans LMM: the memory layer alone on P ‖ x (Titans §3; persistent tokens optional)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.memory(self._prepend(x))[:, self.num_persistent:]


@dataclass
class MAGConfig(BlockConfig):
    gate: str = "sigmoid"     # sigmoid | none (memory branch off: o = SWA output)
    normalize: bool = True    # RMSNorm both branches (learnable vector weights) before gating

    def check(self) -> None:
        super().check()
        check_choice("gate", self.gate, BLOCK_GATES)


@register("block", "mag")
class MAGBlock(_Block):
    """Memory as a gate: o = norm(SWA*(P‖x)) ⊙ σ(norm(M(P‖x))) (Titans Eq.26-28)."""

    Config = MAGConfig

    def __init__(self, cfg: MAGConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.swa = self._attention(SlidingWindowAttention, window=cfg.attention.window)
        if cfg.gate != "none" and cfg.normalize:
            self.norm_y, self.norm_m = RMSNorm(d_model), RMSNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = self._prepend(x)
        y = self.swa(xt, prefix=self.num_persistent)
        if self.cfg.gate != "none":
            m = self.memory(xt)
            if self.cfg.normalize:
                y, m = self.norm_y(y), self.norm_m(m)
            y = y * torch.sigmoid(m)
        return y[:, self.num_persistent:]

    def state_size(self, context: Optional[int] = None) -> int:
        mem = self.memory.state_size(context) if self.cfg.gate != "none" else 0
        return mem + self.swa.state_size(context)


@register("block", "mal")
class MALBlock(_Block):
    """Memory as a layer: o = SWA*(RMSNorm(M(P‖x))) (Titans Eq.29-31; H3-like)."""

    def __init__(self, cfg: BlockConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.norm = RMSNorm(d_model)
        self.swa = self._attention(SlidingWindowAttention, window=cfg.attention.window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.memory(self._prepend(x))
        return self.swa(self.norm(y), prefix=self.num_persistent)[:, self.num_persistent:]

    def state_size(self, context: Optional[int] = None) -> int:
        return self.memory.state_size(context) + self.swa.state_size(context)


@dataclass
class MACConfig(BlockConfig):
    segment: int = 16          # C, tokens per segment
    read_tokens: bool = True   # prepend the memory read h = M*_{prev}(q(S)) to the attention context
    gate: str = "sigmoid"      # sigmoid | none (o = y: the attention output alone)
    write: str = "output"      # output: M ← M(y), Titans Eq.24 | input: M ← M(S), the segment's tokens (titans-pytorch)

    def check(self) -> None:
        super().check()
        check_range("segment", self.segment, 1, None)
        check_choice("gate", self.gate, BLOCK_GATES)
        check_choice("write", self.write, MAC_WRITES)


@register("block", "mac")
class MACBlock(_Block):
    """Memory as context: per segment, attention over [P ‖ M*(q(S)) ‖ S], then M ← M(y) (Titans Eq.21-25).

    ``write="input"`` writes the segment's own tokens instead, M ← M(S), and gates y with M*(S): the choice of
    titans-pytorch's MemoryAsContextTransformer, whose memory stores the layer input. A labelled variant, not the paper.
    """

    Config = MACConfig

    def __init__(self, cfg: MACConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.attn = self._attention(Attention)
        if cfg.gate != "none":
            self.norm_y, self.norm_m = RMSNorm(d_model), RMSNorm(d_model)

    @property
    def uses_memory(self) -> bool:
        return self.cfg.read_tokens or self.cfg.gate != "none"

    def segment_mask(self, length: int, device=None) -> torch.Tensor:
        """Boolean mask over [P (N_p) ‖ h (L) ‖ S (L)] (or [P ‖ S] without reads); True = attend."""
        n_p, L = self.num_persistent, length
        if not self.cfg.read_tokens:
            return attention_mask(n_p + L, device=device)
        n = n_p + 2 * L
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        # the within-segment index of a row/col in the h or S part (-1 for persistent positions)
        idx = torch.where(torch.arange(n, device=device) < n_p, -1,
                          (torch.arange(n, device=device) - n_p) % L)
        ii, jj = idx[:, None], idx[None, :]
        persistent_col = j < n_p
        causal_p = (i < n_p) & (j <= i)                       # P rows: causal among P
        h_col, s_col = (j >= n_p) & (j < n_p + L), j >= n_p + L
        h_row, s_row = (i >= n_p) & (i < n_p + L), i >= n_p + L
        return causal_p | ((i >= n_p) & persistent_col) | (h_row & h_col & (jj <= ii)) | \
            (s_row & (h_col | s_col) & (jj <= ii))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        C, n_p = self.cfg.segment, self.num_persistent
        state, q_cache = None, None
        outs = []
        for start in range(0, T, C):
            s = x[:, start:start + C]
            L = s.shape[1]
            ctx = [self.persistent.to(x.dtype).expand(B, -1, -1)] if self.persistent is not None else []
            pos = list(range(n_p))
            if self.cfg.read_tokens:
                h, q_cache = self.memory.read(s, state, q_cache)
                ctx.append(h)
                pos += list(range(n_p, n_p + L))
            ctx.append(s)
            pos += list(range(n_p + C, n_p + C + L)) if self.cfg.read_tokens else list(range(n_p, n_p + L))
            seq = torch.cat(ctx, dim=1)
            positions = torch.tensor(pos, device=x.device)
            y = self.attn(seq, mask=self.segment_mask(L, x.device), positions=positions)[:, -L:]
            if self.uses_memory:
                m, state = self.memory(s if self.cfg.write == "input" else y, state=state, return_state=True)
                if self.cfg.gate != "none":
                    y = self.norm_y(y) * torch.sigmoid(self.norm_m(m))
            outs.append(y)
        return torch.cat(outs, dim=1)

    def state_size(self, context: Optional[int] = None) -> int:
        """Memory layer state (+ the read path's q-conv cache) + the KV cache of one segment window
        (C tokens, 2C with memory reads), 2·H·D_h per token. The persistent tokens are parameters."""
        seg_tokens = self.cfg.segment * (2 if self.cfg.read_tokens else 1)
        kv = seg_tokens * 2 * self.attn.num_heads * self.attn.head_dim
        if not self.uses_memory:
            return kv
        mem = self.memory.state_size(context)
        if self.cfg.read_tokens and self.memory.cfg.conv:
            mem += (self.memory.cfg.conv_size - 1) * self.memory.num_heads * self.memory.head_dim
        return mem + kv


__all__ = ["BlockAttention", "BlockConfig", "LMMBlock", "MAC_WRITES", "MACBlock", "MACConfig", "MAGBlock", "MAGConfig", "MALBlock"]
