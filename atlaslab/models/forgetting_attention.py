"""Forgetting Attention, the mixer of the Forgetting Transformer (FoX; Lin et al., ICLR 2025).

Softmax attention whose scores are biased by a data-dependent forget gate f_t = σ(w_fᵀx_t + b_f) per head:

    o_i = Σ_{j≤i} exp(q_iᵀk_j / √D + D_ij) v_j / Σ_{j≤i} exp(q_iᵀk_j / √D + D_ij),   D_ij = Σ_{l=j+1..i} log f_l.

In the family's terms (docs/concepts/memory.md#exponential-feature-map) it is the φ* slot memory with
per-head decay retention α_t = f_t and the softmax normaliser: M_t = f_t M_{t−1} + v_t φ*(k_t)ᵀ, read with the
token masses. Both forms are here and tested equal: ``form: attention`` (the default, fast) runs
``scaled_dot_product_attention`` with the additive bias D (−∞ above the diagonal); ``form: memory`` runs the
memory through :func:`atlaslab.engines.memorize` (``mode: chunked`` or ``recurrent``).

The "Pro" block options of the paper: ``output_gate`` (o ⊙ act(W_g x)), ``qk_norm`` (per-head RMSNorm with
learned scales), ``output_norm`` (per-head RMSNorm of o) and ``k_shift`` / ``v_shift`` (data-dependent token
shift, k̃_t = a_t k_{t−1} + (1 − a_t) k_t with a_t = σ(w_aᵀx_t) per head). FoX uses no positional encoding
(``rope: false``): the forget gate supplies position.

Shapes: ``forward(x: [B, T, d_model]) -> [B, T, d_model]``; inner tensors ``[B, T, H, D]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.engines import memorize
from atlaslab.engines.packed import check_cu_seqlens, sequence_positions
from atlaslab.memory.retention import AFTER_STEP
from atlaslab.memory.spec import build_memory
from atlaslab.models.attention import Attention, AttentionConfig, apply_rope, attention_mask, rope_angles
from atlaslab.models.layers import OUTPUT_GATE_ACTS, RMSNorm, gated_head_output
from atlaslab.registry import ConfigError, check_choice, check_range, register

FORMS = ("attention", "memory")

#: The memory form of Forgetting Attention: a linear φ* slot memory written by one GD step of the dot-product
#: bias (η = 1, so the write is v_t φ*(k_t)ᵀ), decayed by f_t after the step, read with the softmax normaliser.
FOX_MEMORY_SPEC = {
    "memory": {"name": "linear", "init": "zeros"},
    "attentional_bias": {"name": "dot"},
    "retention": {"name": "decay", "placement": AFTER_STEP},
    "feature_map": {"name": "exp", "mode": "kernel", "normalize": True},
    "inner_optimizer": {"name": "gd", "lr": 1.0},
    "window": {"name": "omega", "size": 1},
}


@dataclass
class ForgettingAttentionConfig(AttentionConfig):
    rope: bool = False                 # FoX is NoPE: the forget gate encodes position
    form: str = "attention"            # attention (SDPA + decay bias) | memory (the φ* slot memory with decay)
    mode: str = "chunked"              # engine of the memory form: chunked | recurrent
    chunk_size: int = 64               # the memory form's compute chunk (the result does not depend on it)
    forget_bias_init: float = 0.0      # b_f at initialisation (FoX: 0, i.e. f ≈ 0.5 at the start)
    output_gate: bool = False          # Pro: o ⊙ act(W_g x)
    output_gate_act: str = "sigmoid"   # sigmoid | swish
    output_norm: bool = False          # Pro: per-head RMSNorm of the attention output
    k_shift: bool = False              # Pro: data-dependent token shift of the keys
    v_shift: bool = False              # Pro: data-dependent token shift of the values

    def check(self) -> None:
        super().check()
        check_choice("form", self.form, FORMS)
        check_choice("mode", self.mode, ("chunked", "recurrent"))
        check_choice("output_gate_act", self.output_gate_act, OUTPUT_GATE_ACTS)
        check_range("chunk_size", self.chunk_size, 1, None)


class TokenShift(nn.Module):
    """x̃_t = a_t x_{t−1} + (1 − a_t) x_t per head, a_t = σ(w_aᵀ u_t) from the layer input u (FoX Pro's shift).

    ``sequence: [T]`` (packed batches) stops the shift at a sequence's first token, as at t = 0; ``prev: [B, 1, H, D]``
    is x_{−1}, the last token before this call (decoding; default zeros)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads, bias=False)

    def forward(self, x: torch.Tensor, u: torch.Tensor, sequence: Optional[torch.Tensor] = None,
                prev: Optional[torch.Tensor] = None) -> torch.Tensor:
        a = torch.sigmoid(self.proj(u)).unsqueeze(-1)                       # [B, T, H, 1]
        first = prev if prev is not None else torch.zeros_like(x[:, :1])
        prev = torch.cat([first, x[:, :-1]], 1)                              # x_{t−1}, zeros (or prev) at t = 0
        if sequence is not None:
            first = torch.ones_like(sequence, dtype=torch.bool)
            first[1:] = sequence[1:] != sequence[:-1]
            prev = prev.masked_fill(first[None, :, None, None], 0.0)
        return a * prev + (1.0 - a) * x


def forget_bias(log_f: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """The additive score bias D ``[B, H, T, T]`` from ``log_f: [B, T, H]``: D_ij = Σ_{l=j+1..i} log f_l where
    ``allowed[i, j]`` (default: causal), −∞ elsewhere."""
    c = log_f.to(torch.promote_types(log_f.dtype, torch.float32)).cumsum(1).transpose(1, 2)   # [B, H, T], ≥ fp32
    T = log_f.shape[1]
    if allowed is None:
        allowed = attention_mask(T, device=log_f.device)
    return cumulative_bias(c, c, allowed)


def cumulative_bias(c_q: torch.Tensor, c_k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """D_ij = c_i − c_j from the running sums c = Σ_{l≤t} log f_l of the queries (``c_q: [B, H, T]``) and the keys
    (``c_k: [B, H, n]``), −∞ where ``allowed: [T, n]`` is False → ``[B, H, T, n]``."""
    return (c_q.unsqueeze(-1) - c_k.unsqueeze(-2)).masked_fill(~allowed, float("-inf"))


@register("mixer", "forgetting_attention")
class ForgettingAttention(Attention):
    """Forgetting Attention (FoX): softmax attention with a data-dependent forget gate per head."""

    Config = ForgettingAttentionConfig

    def __init__(self, cfg: ForgettingAttentionConfig, d_model: int):
        super().__init__(cfg, d_model)          # the q, k, v, o projections and the head layout
        H, D = self.num_heads, self.head_dim
        self.f_proj = nn.Linear(d_model, H, bias=True)
        with torch.no_grad():
            self.f_proj.bias.fill_(cfg.forget_bias_init)
        self.q_norm = RMSNorm((H, D)) if cfg.qk_norm else None
        self.k_norm = RMSNorm((H, D)) if cfg.qk_norm else None
        self.k_shift = TokenShift(d_model, H) if cfg.k_shift else None
        self.v_shift = TokenShift(d_model, H) if cfg.v_shift else None
        self.out_norm = RMSNorm((H, D)) if cfg.output_norm else None
        self.g_proj = nn.Linear(d_model, H * D, bias=False) if cfg.output_gate else None
        self.parts = build_memory(dict(FOX_MEMORY_SPEC, chunk_size=cfg.chunk_size), H, D, D) \
            if cfg.form == "memory" else None

    def project(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                sequence: Optional[torch.Tensor] = None, shift_prev=None):
        """q, k, v ``[B, T, H, D]`` (shifted, normalised, rotated as configured) and log f ``[B, T, H]``.

        ``shift_prev``: ``(k, v)``, the raw projections ``[B, 1, H, D]`` of the token before ``x`` (decoding), which
        the token shifts mix into the first token (default zeros)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, H, D)
        v = self.v_proj(x).view(B, T, H, D)
        k_prev, v_prev = shift_prev if shift_prev is not None else (None, None)
        if self.k_shift is not None:
            k = self.k_shift(k, x, sequence, k_prev)
        if self.v_shift is not None:
            v = self.v_shift(v, x, sequence, v_prev)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.rope:
            pos = positions if positions is not None else torch.arange(T, device=x.device)
            cos, sin = rope_angles(pos, D, self.cfg.rope_base, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, F.logsigmoid(self.f_proj(x))

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """``x: [B, T, d_model]`` → ``[B, T, d_model]``; ``cu_seqlens``: packed sequences, each attends (and
        forgets, and shifts) within itself only."""
        B, T, _ = x.shape
        sequence = positions = allowed = None
        if cu_seqlens is not None:
            sequence, positions = sequence_positions(check_cu_seqlens(cu_seqlens, B, T), x.device)
            allowed = attention_mask(T, device=x.device, sequence=sequence)
        q, k, v, log_f = self.project(x, positions, sequence)
        if self.cfg.form == "attention":
            bias = forget_bias(log_f, allowed).to(q.dtype)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=bias).transpose(1, 2)
        else:
            o, _ = memorize(q / math.sqrt(self.head_dim), k, v, self.parts, {"retention": log_f.exp()},
                            mode=self.cfg.mode, cu_seqlens=cu_seqlens)
        return self.output(o, x)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output norm, gate and projection: ``o: [B, T, H, D]`` (with the layer input ``x``) → ``[B, T, d_model]``."""
        return gated_head_output(o, x, self.out_norm, self.g_proj, self.o_proj, self.cfg.output_gate_act)

    def state_size_per_token(self) -> int:
        """KV cache plus the forget gate's log per context token: 2·H·D + H (grows like attention's)."""
        return 2 * self.num_heads * self.head_dim + self.num_heads

    def state_size(self, context: Optional[int] = None) -> int:
        """Cache scalars per sequence after ``context`` tokens (the token shifts add H·D each for k and v)."""
        shifts = sum(s is not None for s in (self.k_shift, self.v_shift)) * self.num_heads * self.head_dim
        return self.state_size_per_token() * (context or 0) + shifts


__all__ = ["FOX_MEMORY_SPEC", "ForgettingAttention", "ForgettingAttentionConfig", "TokenShift",
           "cumulative_bias", "forget_bias"]
