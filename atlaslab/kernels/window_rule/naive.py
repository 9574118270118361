"""Plain-torch references of the Omega-window rule (c ≥ 1 window slots per token) the window kernels compute.

The Omega rule (ATLAS Eq.9 with γ gates, online b = 1) is a rank-c generalised delta rule: every step takes the
last c tokens' errors at the pre-step memory. The kernels work on *slots* (token t owns c of them, one per window
token) that :func:`window_slots` gathers in torch, so gradients reach k, v, η, γ and the window history through a
differentiable gather; :func:`window_rule_recurrent` is the token loop, :func:`window_rule_chunk` the exact chunk form
of the kernels (docs/kernels.md#window-rule gives the equations).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.delta_rule.naive import causal_exp, causal_exp3, check_args, decayed_dot
from atlaslab.kernels.utils import BEFORE_STEP, log_decay, per_sequence, solve_unit_lower

#: The largest Omega window c the Triton window kernels take (a chunk's BT·c slot rows live in one program).
MAX_WINDOW = 8


# The Omega rule (ATLAS Eq.9 with γ gates, online b = 1): at token t the step uses the last c tokens
# (x_j, v_j, γ_j), j ∈ (t − c, t], all evaluated at the pre-step memory, each with coefficient η_t γ_j:
#
#     S_t = S_{t−1} Diag(a_t) + Σ_{j ∈ win(t)} w_{t,j} x_jᵀ,
#     w_{t,j} = −η_t γ_j (S_{t−1} Diag(B_t) x_j − v_j)     (ℓ2; B_t = a_t before_step, 1 after_step)
#     w_{t,j} =  η_t γ_j v_j                                 (dot product)
#
# (a rank-c generalised delta rule). The kernels work on the window's *slots*: token t owns c slots
# (t, j), j = 0..c−1, holding the key / value of token t − c + 1 + j (earlier tokens of the call come from the
# state's history; slots before everything have coefficient 0). :func:`window_slots` builds them; every window
# function takes ``xs [B, T, c, H, K]``, ``vs [B, T, c, H, V]`` and ``coef [B, T, c, H]`` (η_t γ_j, 0 on empty
# slots), so gradients reach k, v, η, γ and the history through the (differentiable) gather.
#
# Chunk form (:func:`window_rule_chunk`, what the Triton window kernels compute): the c = 1 chunk form with the
# L·c slots of a chunk as the rows of the UT system, decays and causal masks taken at the slots' *tokens* τ(r):
#     A[r, r'] = coef_r e^{G_τ(r) − g_τ(r')} x_r·x_r'  for τ(r') < τ(r)   (slots of one token do not see each other)
#     w = (I + A)⁻¹ (coef ⊙ v) − (I + A)⁻¹ (coef e^{G_τ} ⊙ x) S_0ᵀ
#     o_t = e^{gq_t} S_0 q_t + Σ_{r: τ(r) ≤ t (< t for read chunk)} e^{gq_t − g_τ(r)} (q_t·x_r) w_r
#     S_L = e^{g_L} S_0 + Σ_r e^{g_L − g_τ(r)} w_r x_rᵀ.
# Channel-wise decay (g, G per key channel; S ← S Diag(α_t)): every decay moves inside the key dot products,
#     A[r, r'] = coef_r Σ_c x_rc x_r'c e^{G_τ(r)c − g_τ(r')c},   w = (I + A)⁻¹ coef ⊙ (v − (x ⊙ e^{G_τ}) S_0ᵀ),
#     o_t = (q_t ⊙ e^{gq_t}) S_0ᵀ + Σ_r [Σ_c q_tc x_rc e^{gq_tc − g_τ(r)c}] w_r,
#     S_L = S_0 Diag(e^{g_L}) + Σ_r w_r (x_r ⊙ e^{g_L − g_τ(r)})ᵀ   (every exponent ≤ 0 on the causal part).


def window_slots(k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, c: int,
                 hist_k: Optional[torch.Tensor] = None, hist_v: Optional[torch.Tensor] = None,
                 hist_gamma: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """The window slots of every token: ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``gamma [B, T, H]`` and the
    history (the ``h ≤ c − 1`` tokens before the call, ``[B, h, H, ·]``, or None) →
    ``xs [B, T, c, H, K]``, ``vs [B, T, c, H, V]``, ``gs [B, T, c, H]``: slot (t, j) holds token t − c + 1 + j
    (history tokens for negative indices; γ = 0 on slots before the history). Differentiable (a gather).
    With ``cu_seqlens`` (packed sequences, B = 1, no history) a slot never reaches across its token's sequence
    start: slots before the sequence's first token get γ = 0."""
    if cu_seqlens is not None:
        if hist_k is not None and hist_k.shape[1] > 0:
            raise ValueError("window_slots: a history with cu_seqlens is not supported")
        T = k.shape[1]
        cu = cu_seqlens.to(device=k.device, dtype=torch.long)
        t = torch.arange(T, device=k.device)
        bos = cu[torch.searchsorted(cu, t, right=True) - 1]                       # each token's sequence start
        idx = t.unsqueeze(1) - c + 1 + torch.arange(c, device=k.device)
        valid = (idx >= bos.unsqueeze(1)).to(gamma.dtype)[None, :, :, None]
        idx = idx.clamp_min(0)
        return k[:, idx], v[:, idx], gamma[:, idx] * valid
    if hist_k is not None and hist_k.shape[1] > 0:
        k, v, gamma = torch.cat([hist_k, k], 1), torch.cat([hist_v, v], 1), torch.cat([hist_gamma, gamma], 1)
        h = hist_k.shape[1]
    else:
        h = 0
    T = k.shape[1] - h
    idx = torch.arange(T, device=k.device).unsqueeze(1) + (h - c + 1) + torch.arange(c, device=k.device)
    valid = (idx >= 0).to(gamma.dtype)[None, :, :, None]
    idx = idx.clamp_min(0)
    return k[:, idx], v[:, idx], gamma[:, idx] * valid


def check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens=None) -> int:
    """Validate the slot tensors of a window call; returns c."""
    if q.dim() != 4 or xs.dim() != 5 or vs.dim() != 5 or coef.dim() != 4:
        raise ValueError(f"expected q [B, T, H, K], xs [B, T, c, H, K], vs [B, T, c, H, V], coef [B, T, c, H]; got "
                         f"{list(q.shape)}, {list(xs.shape)}, {list(vs.shape)}, {list(coef.shape)}")
    B, T, H, K = q.shape
    c = xs.shape[2]
    if xs.shape != (B, T, c, H, K) or vs.shape[:4] != (B, T, c, H) or coef.shape != (B, T, c, H):
        raise ValueError(f"window slots: q {list(q.shape)}, xs {list(xs.shape)}, vs {list(vs.shape)}, "
                         f"coef {list(coef.shape)} do not agree")
    check_args(q, q, vs[:, :, 0], coef[:, :, 0], alpha, initial_state, cu_seqlens)
    return c


def window_rule_recurrent(q: torch.Tensor, xs: torch.Tensor, vs: torch.Tensor, coef: torch.Tensor,
                          alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                          bias: str, placement: str, read: str,
                          cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token loop of the Omega rule over window slots (see the section comment). ``alpha`` ``[B, T, H]`` or
    ``[B, T, H, K]`` (channel-wise); returns ``o [B, T, H, V]`` and the final state ``[B, H, V, K]`` (``[N, H, V,
    K]`` with ``cu_seqlens``: each packed sequence run alone, slots as :func:`window_slots` with ``cu_seqlens``)."""
    check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        return per_sequence(window_rule_recurrent, q, xs, vs, coef, alpha, initial_state, cu_seqlens,
                             bias=bias, placement=placement, read=read)
    B, T, H, K = q.shape
    S = initial_state if initial_state is not None else q.new_zeros(B, H, vs.shape[-1], K)
    outs = []
    for t in range(T):
        q_t = q[:, t]
        a_t = None
        if alpha is not None:
            a_t = alpha[:, t, :, None, None] if alpha.dim() == 3 else alpha[:, t, :, None, :]
        if read == "chunk":
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q_t))
        x, vv, cf = xs[:, t], vs[:, t], coef[:, t]                      # [B, c, H, ·]
        if bias == "l2":
            anchor = S * a_t if (a_t is not None and placement == BEFORE_STEP) else S
            err = torch.einsum("bhvk,bjhk->bjhv", anchor, x) - vv
            w = -cf.unsqueeze(-1) * err
        else:
            w = cf.unsqueeze(-1) * vv
        S = (S * a_t if a_t is not None else S) + torch.einsum("bjhv,bjhk->bhvk", w, x)
        if read == "token":
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q_t))
    return torch.stack(outs, 1), S


def window_rule_chunk(q: torch.Tensor, xs: torch.Tensor, vs: torch.Tensor, coef: torch.Tensor,
                      alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                      bias: str, placement: str, read: str, chunk_size: int = 16,
                      cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact chunk form of :func:`window_rule_recurrent` (the math of the Triton window kernels; the section
    comment gives the equations), per-head or channel-wise decay. Also the torch recompute of their backward.
    ``cu_seqlens``: each packed sequence alone (its chunks restart at its first token)."""
    c = check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        return per_sequence(window_rule_chunk, q, xs, vs, coef, alpha, initial_state, cu_seqlens,
                             bias=bias, placement=placement, read=read, chunk_size=chunk_size)
    B, T, H, K = q.shape
    V = vs.shape[-1]
    tr = lambda x: x.transpose(1, 2)   # noqa: E731  [B, T, H, ...] → [B, H, T, ...]
    qh, lah = tr(q), tr(log_decay(alpha, q))
    xh = xs.permute(0, 3, 1, 2, 4)                                     # [B, H, T, c, K]
    vh = vs.permute(0, 3, 1, 2, 4)
    ch = coef.permute(0, 3, 1, 2)                                      # [B, H, T, c]
    channel = alpha is not None and alpha.dim() == 4
    S = initial_state if initial_state is not None else q.new_zeros(B, H, V, K)
    outs = []
    for t0 in range(0, T, chunk_size):
        sl = slice(t0, min(T, t0 + chunk_size))
        qc, la = qh[:, :, sl], lah[:, :, sl]
        L = qc.shape[2]
        n = L * c
        xc, vc, cc = (z[:, :, sl].flatten(2, 3) for z in (xh, vh, ch))   # slots: [B, H, L·c, ·]
        tau = torch.arange(L, device=q.device).repeat_interleave(c)      # the token of every slot
        g = la.cumsum(2)
        G = g if placement == BEFORE_STEP else g - la
        gq, diag = (g, 0) if read == "token" else (g - la, -1)
        if channel:
            P = decayed_dot(qc, xc, causal_exp3(gq, g, diag)[:, :, :, tau])          # [B, H, L, n]
        else:
            P = (qc @ xc.mT) * causal_exp(gq.unsqueeze(-1) - g.unsqueeze(-2), diag)[..., tau]
        if bias == "l2":
            if channel:
                E3 = causal_exp3(G, g, -1)[:, :, tau][:, :, :, tau]                      # [B, H, n, n, K]
                A = cc.unsqueeze(-1) * decayed_dot(xc, xc, E3)
                xG = xc * G.exp()[:, :, tau]
            else:
                E = causal_exp(G.unsqueeze(-1) - g.unsqueeze(-2), -1)[..., tau, :][..., tau]
                A = cc.unsqueeze(-1) * (xc @ xc.mT) * E
                xG = G.exp()[:, :, tau].unsqueeze(-1) * xc
            A = A + torch.eye(n, dtype=A.dtype, device=A.device)
            rhs = torch.cat([cc.unsqueeze(-1) * vc, cc.unsqueeze(-1) * xG], -1)
            sol = solve_unit_lower(A, rhs)
            w = sol[..., :V] - sol[..., V:] @ S.mT
        else:
            w = cc.unsqueeze(-1) * vc
        if channel:
            outs.append((qc * gq.exp()) @ S.mT + P @ w)
            gl = g[:, :, -1:]
            S = S * gl.exp() + w.mT @ (xc * (gl - g).exp()[:, :, tau])
        else:
            outs.append(gq.exp().unsqueeze(-1) * (qc @ S.mT) + P @ w)
            gl = g[:, :, -1:]
            S = S * gl.exp().unsqueeze(-1) + ((gl - g).exp()[:, :, tau].unsqueeze(-1) * w).mT @ xc
    return torch.cat(outs, 2).transpose(1, 2), S
