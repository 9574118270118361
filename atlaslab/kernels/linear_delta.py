"""Exact chunk-parallel form of the online (b = 1) linear-memory rules: the (gated, windowed) delta rule.

Linear memory, ℓ2 or dot-product bias, plain GD, decay α (per head or per key channel, either placement),
Omega window c with γ gates. The online recurrence (spec §3, §15.4)

    M_t = M_{t−1} Diag(a_t) + Σ_{j ∈ win(t)} w_{t,j} x_jᵀ,
    w_{t,j} = −η_t γ_j (M_{t−1} Diag(B_t) x_j − v_j)      (ℓ2; B_t = a_t before_step, 1 after_step)
    w_{t,j} =  η_t γ_j v_j                                  (dot product)

is computed for a block of L tokens at once (Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", generalised to rank-c steps and to both decay placements). With
P_t = Π_{τ≤t} a_τ (block-local) and G_t = P_t (before_step) or P_{t−1} (after_step), the pseudo-values w
solve the unit lower-triangular system

    w_{t,j} + η_t γ_j Σ_{s<t} Σ_i [(G_t ⊙ x_j)·(x_i / P_s)] w_{s,i} = −η_t γ_j (M_0 (G_t ⊙ x_j) − v_j),

then y_t = M_0 (P_t ⊙ q_t) + Σ_{s≤t} Σ_i [(P_t/P_s ⊙ x_i)·q_t] w_{s,i} and M_L follows the same way. The L·c
unknowns of a block are found with one triangular solve; nothing of size T × d_v × d_k is formed.

Scalar decay ratios are formed as exp(log P_t − log P_s), never by division; channel-wise decay uses the
factorised x ⊙ P and x / P inside a block (keep blocks short, e.g. ≤ 32, when channels forget fast).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .recurrent import _bh, _keep_last
from .state import Gates, MemoryState, split_time

if TYPE_CHECKING:
    from ..components.memory_spec import MemoryParts


def supports(parts: "MemoryParts", chunk_size: int) -> bool:
    """True when this path computes ``parts`` exactly (the online linear rules)."""
    s = parts.spec
    return (chunk_size == 1 and s.memory.name == "linear" and not parts.kernel_trick
            and s.attentional_bias.name in ("l2", "dot") and s.inner_optimizer.name == "gd"
            and s.retention.name in ("none", "decay") and parts.window.size is not None)


def _slots(x_ext: torch.Tensor, h: int, L: int, c: int) -> tuple:
    """Gather window slots: ext index of (t, j) = h + t − c + 1 + j. ``x_ext: [B, H, h+L, ...]``.

    Returns the gathered tensor ``[B, H, L, c, ...]`` and a validity mask ``[L, c]`` (ext index ≥ 0).
    """
    idx = torch.arange(L, device=x_ext.device).unsqueeze(1) + h - c + 1 + torch.arange(c, device=x_ext.device)
    valid = idx >= 0
    gathered = x_ext[:, :, idx.clamp_min(0)]
    return gathered, valid


def _masked_exp(log_ratio: torch.Tensor, diagonal: int) -> torch.Tensor:
    """exp of ``[..., t, s]`` log-ratios on the causal part (s ≤ t + diagonal); 0 elsewhere, never inf."""
    L = log_ratio.shape[-1]
    keep = torch.ones(L, L, dtype=torch.bool, device=log_ratio.device).tril(diagonal)
    return log_ratio.masked_fill(~keep, float("-inf")).exp()


def _block(parts, M0, x_ext, v_ext, g_ext, q_blk, lr, log_a, h, L, c, is_l2, before, read_token, channel):
    """One block. Shapes: ``M0 [B,H,V,K]``, ``x_ext [B,H,h+L,K]``, ``q_blk [B,H,L,K]``, ``lr [B,H,L]``,
    ``log_a [B,H,L]`` or ``[B,H,L,K]`` (channel-wise) or None. Returns (y ``[B,H,L,V]``, M_L)."""
    B, H = M0.shape[:2]
    x, valid = _slots(x_ext, h, L, c)                       # [B,H,L,c,K]
    v, _ = _slots(v_ext, h, L, c)                           # [B,H,L,c,V]
    gam, _ = _slots(g_ext, h, L, c)                         # [B,H,L,c]
    coef = lr.unsqueeze(-1) * gam * valid.to(gam.dtype)     # η_t γ_j, zero on slots before the sequence
    N = L * c
    if log_a is None:
        logP = torch.zeros(B, H, L, dtype=M0.dtype, device=M0.device)
    else:
        logP = log_a.cumsum(2)                              # [B,H,L] or [B,H,L,K]
    logP_prev = torch.cat([torch.zeros_like(logP[:, :, :1]), logP[:, :, :-1]], 2)
    logG = logP if before else logP_prev

    if channel:
        xg = x * logG.unsqueeze(3).exp()                     # G_t ⊙ x_{t,j}
        xp = x * (-logP).unsqueeze(3).exp()                  # x_{s,i} / P_s
        qp = q_blk * logP.exp()                              # P_t ⊙ q_t   (read token)
        qp_prev = q_blk * logP_prev.exp()
        M0_on_g = torch.einsum("bhvk,bhtjk->bhtjv", M0, xg)
    else:
        M0_on_g = torch.einsum("bhvk,bhtjk->bhtjv", M0, x) * logG.exp()[..., None, None]

    if is_l2:
        rhs = -coef.unsqueeze(-1) * (M0_on_g - v)    # [B,H,L,c,V]
        if channel:
            scores = torch.einsum("bhtjk,bhsik->bhtjsi", xg, xp)
        else:
            ratio = _masked_exp(logG.unsqueeze(-1) - logP.unsqueeze(-2), -1)  # [B,H,t,s] = G_t / P_s, s < t
            scores = torch.einsum("bhtjk,bhsik->bhtjsi", x, x) * ratio[:, :, :, None, :, None]
        strict = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)
        A = scores * coef[..., None, None] * strict[None, None, :, None, :, None]
        A = A.reshape(B, H, N, N) + torch.eye(N, dtype=A.dtype, device=A.device)
        w = torch.linalg.solve_triangular(A, rhs.reshape(B, H, N, -1), upper=False, unitriangular=True)
        w = w.reshape(B, H, L, c, -1)
    else:
        w = coef.unsqueeze(-1) * v

    # reads: y_t = M_t q_t (token) or M_{t−1} q_t (chunk = the state before the token when b = 1)
    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(0 if read_token else -1)
    if channel:
        qq = qp if read_token else qp_prev
        y = torch.einsum("bhvk,bhtk->bhtv", M0, qq)
        kq = torch.einsum("bhtk,bhsik->bhtsi", qq, xp)
    else:
        lp = logP if read_token else logP_prev
        y = torch.einsum("bhvk,bhtk->bhtv", M0, q_blk) * lp.exp().unsqueeze(-1)
        ratio = _masked_exp(lp.unsqueeze(-1) - logP.unsqueeze(-2), 0 if read_token else -1)
        kq = torch.einsum("bhtk,bhsik->bhtsi", q_blk, x) * ratio[..., None]
    y = y + torch.einsum("bhtsi,bhsiv->bhtv", kq * mask[None, None, :, :, None], w)

    # final state M_L = M_0 ⊙ P_L + Σ w_{s,i} (x_i ⊙ P_L/P_s)ᵀ
    if channel:
        last = logP[:, :, -1]                                                 # [B,H,K]
        M_L = M0 * last.exp().unsqueeze(-2) + torch.einsum("bhsiv,bhsik->bhvk", w, xp * last.exp()[:, :, None, None])
    else:
        decay_to_end = (logP[:, :, -1:] - logP).exp()                         # [B,H,L]
        M_L = M0 * logP[:, :, -1].exp()[..., None, None] + torch.einsum(
            "bhsiv,bhsik->bhvk", w * decay_to_end[..., None, None], x)
    return y, M_L


def memorize_linear_delta(q, k, v, parts: "MemoryParts", gates: Gates, state: MemoryState, block_size: int):
    """Online linear rules over ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` in blocks of ``block_size``."""
    state = dataclasses.replace(state)
    spec = parts.spec
    is_l2 = spec.attentional_bias.name == "l2"
    ret = parts.retention
    channel = ret.channel_wise
    before = ret.placement == "before_step" and gates.retention is not None
    c = parts.window.size
    fm = parts.feature_map
    T = q.shape[1]
    M = state.weights["W"]
    outputs = []
    sizes = [min(block_size, T - t0) for t0 in range(0, T, block_size)]
    for q_b, k_b, v_b, g_b in split_time(sizes, q, k, v, gates):
        L = q_b.shape[1]
        h = state.hist_k.shape[1]
        k_ext = torch.cat([state.hist_k, k_b], 1)
        v_ext = torch.cat([state.hist_v, v_b], 1)
        g_ext = torch.cat([state.hist_gamma, g_b.window], 1)
        log_a = None
        if g_b.retention is not None and ret.uses_alpha:
            a = g_b.retention.transpose(1, 2)
            log_a = a.clamp_min(torch.finfo(a.dtype).tiny).log()
        y, M = _block(parts, M, _bh(fm(k_ext)), _bh(v_ext), _bh(g_ext), _bh(fm(q_b)),
                      _bh(g_b.lr), log_a, h, L, c, is_l2, before, parts.read == "token", channel)
        outputs.append(y.transpose(1, 2))
        keep = parts.window.history()
        state.hist_k, state.hist_v, state.hist_gamma = (_keep_last(z, keep) for z in (k_ext, v_ext, g_ext))
        if g_b.retention is not None:
            state.chunk_alpha = g_b.retention[:, -1]
        state.position += L
    state.weights = {"W": M}
    state.anchor = state.weights   # with b = 1 the anchor is refreshed at every token
    return torch.cat(outputs, 1), state
