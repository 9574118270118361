"""Softmax attention mixers: causal attention ("attention") and sliding-window attention ("swa").

Attention is the non-parametric memory of the family (docs/concepts/memory.md#blocks): the Transformer keeps every
(k, v) and solves a Nadaraya–Watson regression at read time; SWA keeps the last ``window`` tokens.
Both use ``torch.nn.functional.scaled_dot_product_attention`` with rotary position embeddings (RoPE).

State accounting (zoology's ``state_size``): ``state_size(context)`` counts the KV-cache scalars per sequence
after ``context`` tokens. Causal attention grows: ``state_size_per_token() = 2·H·D_h`` and no fixed part
(``state_size()`` with no context is 0). SWA is fixed: ``window · 2 · H · D_h`` whatever the context.

Shapes: ``forward(x: [B, T, d_model]) -> [B, T, d_model]``; inner tensors ``[B, T, H, D_h]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.engines.packed import check_cu_seqlens, sequence_positions
from atlaslab.registry import ConfigError, PartConfig, check_range, register


# --------------------------------------------------------------------------------------------------
# rotary embeddings and masks
# --------------------------------------------------------------------------------------------------
def rope_angles(positions: torch.Tensor, dim: int, base: float = 10000.0, dtype=torch.float32):
    """cos, sin of RoPE angles for ``positions: [T]`` → two ``[T, dim // 2]`` tensors."""
    inv = base ** (-torch.arange(0, dim // 2, device=positions.device, dtype=torch.float64) * 2.0 / dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of ``x: [B, T, H, D]`` (GPT-NeoX / Llama half-split layout)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def attention_mask(T: int, window: Optional[int] = None, prefix: int = 0, device=None,
                   sequence: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean ``[T, T]`` mask (True = may attend): causal, limited to the last ``window`` tokens
    (the query itself included), with the first ``prefix`` positions (persistent tokens) always visible.
    ``sequence: [T]``, each token's sequence in a packed batch: a query sees only its own sequence's tokens."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & ((i - j < window) | (j < prefix))
    if sequence is not None:
        allowed = allowed & (sequence[:, None] == sequence[None, :])
    return allowed


def head_layout(d_model: int, num_heads: int, head_dim: Optional[int]) -> int:
    """The head dimension: ``head_dim``, else ``d_model // num_heads`` (a ConfigError if that does not divide)."""
    if head_dim is None and d_model % num_heads:
        raise ConfigError("num_heads", f"d_model {d_model} is not divisible by num_heads {num_heads}; set head_dim.",
                          value=num_heads)
    return head_dim or d_model // num_heads


# --------------------------------------------------------------------------------------------------
# mixers
# --------------------------------------------------------------------------------------------------
@dataclass
class AttentionConfig(PartConfig):
    num_heads: int = 4
    head_dim: Optional[int] = None   # default d_model // num_heads
    rope: bool = True
    rope_base: float = 10000.0
    qk_norm: bool = False            # RMS-normalise q and k per head before RoPE
    bias: bool = False               # biases on the projections

    def check(self) -> None:
        check_range("num_heads", self.num_heads, 1, None)
        if self.head_dim is not None:
            check_range("head_dim", self.head_dim, 1, None)
        check_range("rope_base", self.rope_base, 1e-9, None, "must be positive, in")


@register("mixer", "attention")
class Attention(nn.Module):
    """Causal multi-head softmax attention with RoPE (Transformer++; ATLAS Eq.17)."""

    Config = AttentionConfig
    window: Optional[int] = None

    def __init__(self, cfg: AttentionConfig, d_model: int):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        H = cfg.num_heads
        self.num_heads, self.head_dim = H, head_layout(d_model, H, cfg.head_dim)
        D = self.head_dim
        self.q_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.k_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.v_proj = nn.Linear(d_model, H * D, bias=cfg.bias)
        self.o_proj = nn.Linear(H * D, d_model, bias=cfg.bias)

    #: takes packed variable-length batches (``cu_seqlens``)
    takes_packed = True

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, prefix: int = 0,
                positions: Optional[torch.Tensor] = None, cu_seqlens=None) -> torch.Tensor:
        """``x: [B, T, d_model]`` → ``[B, T, d_model]``.

        ``mask``: an explicit boolean ``[T, T]`` mask (True = attend); default: causal (within ``window`` for
        SWA) with the first ``prefix`` positions always visible. ``positions: [T]`` for RoPE (default 0..T−1).
        ``cu_seqlens``: packed sequences (``x: [1, ΣT_i, d_model]``, offsets ``[N + 1]``): every query attends
        within its own sequence only, and RoPE counts positions from each sequence's first token.
        """
        B, T, _ = x.shape
        if cu_seqlens is not None:
            if mask is not None or positions is not None or prefix:
                raise ValueError("attention: cu_seqlens sets the mask and positions; do not pass them as well")
            sequence, positions = sequence_positions(check_cu_seqlens(cu_seqlens, B, T), x.device)
            mask = attention_mask(T, self.window, 0, x.device, sequence=sequence)
        H, D = self.num_heads, self.head_dim
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, positions))   # [B, H, T, D]
        if mask is None and self.window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if mask is None:
                mask = attention_mask(T, self.window, prefix, x.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))

    def qkv(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None):
        """q, k, v ``[B, T, H, D_h]`` of ``x: [B, T, d_model]``: projected, RMS-normalised (``qk_norm``) and rotated
        at ``positions: [T]`` (default 0..T−1); a KV cache stores k and v as returned here."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, H, D)
        v = self.v_proj(x).view(B, T, H, D)
        if self.cfg.qk_norm:
            q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))
        if self.cfg.rope:
            pos = positions if positions is not None else torch.arange(T, device=x.device)
            cos, sin = rope_angles(pos, D, self.cfg.rope_base, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def state_size_per_token(self) -> int:
        """KV-cache scalars per context token: 2·H·D_h (grows without bound for causal attention)."""
        return 0 if self.window is not None else 2 * self.num_heads * self.head_dim

    def state_size(self, context: Optional[int] = None) -> int:
        """KV-cache scalars per sequence after ``context`` tokens (``None`` counts 0 tokens)."""
        return self.state_size_per_token() * (context or 0)


@dataclass
class SWAConfig(AttentionConfig):
    window: int = 64   # each query sees the last ``window`` tokens, itself included

    def check(self) -> None:
        super().check()
        check_range("window", self.window, 1, None)


@register("mixer", "swa")
class SlidingWindowAttention(Attention):
    """Sliding-window causal attention with RoPE (SWA; ATLAS Eq.18): a KV cache of the last c tokens."""

    Config = SWAConfig

    def __init__(self, cfg: SWAConfig, d_model: int):
        super().__init__(cfg, d_model)
        self.window = cfg.window

    def state_size(self, context: Optional[int] = None) -> int:
        """Fixed KV cache: window · 2 · H · D_h (independent of the context length)."""
        return self.window * 2 * self.num_heads * self.head_dim


__all__ = ["Attention", "AttentionConfig", "SWAConfig", "SlidingWindowAttention", "apply_rope", "attention_mask",
           "head_layout", "rope_angles"]
