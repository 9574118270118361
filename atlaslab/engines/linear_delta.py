"""Exact chunk-parallel form of the online (b = 1) linear-memory rules: the (gated, windowed) delta rule.

Linear memory, ℓ2 or dot-product bias, plain GD, decay α (per head or per key channel, either placement),
Omega window c with γ gates. The online recurrence (docs/concepts/memory.md#window)

    M_t = M_{t−1} Diag(a_t) + Σ_{j ∈ win(t)} w_{t,j} x_jᵀ,
    w_{t,j} = −η_t γ_j (M_{t−1} Diag(B_t) x_j − v_j)      (ℓ2; B_t = a_t before_step, 1 after_step)
    w_{t,j} =  η_t γ_j v_j                                  (dot product)

is computed in blocks of L tokens (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", generalised to rank-c steps and to both decay placements). With P_t = Π_{τ≤t} a_τ
(block-local) and G_t = P_t (before_step) or P_{t−1} (after_step), the pseudo-values w of a block solve the
unit lower-triangular system (L·c unknowns)

    w_{t,j} + η_t γ_j Σ_{s<t} Σ_i [(G_t ⊙ x_j)·(x_i / P_s)] w_{s,i} = −η_t γ_j (M_0 (G_t ⊙ x_j) − v_j).

The right side is affine in the block-start memory M_0, so (UT transform) w = U − X M_0ᵀ with U, X solved
once from M_0-free right sides. Everything then splits into

1. block-local work for ALL blocks at once (batched over blocks, no dependence on M_0): the system's inverse,
   U and X (two products with it), K_q (the causal decayed q·x matrix) and X_d = x ⊙ P_L/P_s;
2. the only sequential part, over the T/L blocks: W_n = U_n − X_n M_nᵀ and M_{n+1} = M_n Diag(P_L) + W_nᵀ X_d
   (two matmuls each; the same as M_n Φ_n + Δ_n with Φ = Diag(P_L) − Xᵀ X_d, Δ = Uᵀ X_d, in fewer operations);
3. all reads in two batched products: y = (P ⊙ q) M_nᵀ + K_q W_n.

Nothing of size T × d_v × d_k is formed (the block-start states are T/L × d_v × d_k). Scalar decay ratios are
exp(log P_t − log P_s), never divisions; channel-wise decay uses the factorised x ⊙ P and x / P inside a
block, so its blocks are capped at ``CHANNEL_BLOCK`` = 16 tokens (fla's GLA sub-chunk length).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from atlaslab.engines.compiled import maybe_compiled
from atlaslab.engines.recurrent import _bh
from atlaslab.kernels.utils import unit_lower_inverse
from atlaslab.memory.state import Gates, MemoryState, keep_history, with_history

if TYPE_CHECKING:
    from atlaslab.memory.spec import MemoryParts


#: the default block (tokens solved in parallel) is the key dimension, kept within [BLOCK_MIN, BLOCK_MAX]: chosen
#: from ``bench/block_size.py`` (memory calls at D_k 32-128, preset training steps at D_k 16; the results file gives
#: each shape's fastest block and the default's time over it)
BLOCK_MIN, BLOCK_MAX = 16, 32


def default_block(key_dim: int) -> int:
    """The block :func:`memorize_linear_delta` uses when none is given: ``key_dim`` clamped to [16, 32]."""
    return min(BLOCK_MAX, max(BLOCK_MIN, key_dim))


#: longest block for channel-wise decay: 1 / Π α over 16 steps stays inside float32 range for α ≥ 0.005
CHANNEL_BLOCK = 16


def supports(parts: "MemoryParts", chunk_size: int) -> bool:
    """True when this path computes ``parts`` exactly (the online linear rules)."""
    s = parts.spec
    return (chunk_size == 1 and s.memory.name == "linear" and not parts.kernel_trick
            and s.attentional_bias.name in ("l2", "dot") and s.inner_optimizer.name == "gd"
            and s.retention.name in ("none", "decay") and parts.window.size is not None)


def _slots(x_ext: torch.Tensor, h: int, T: int, c: int) -> torch.Tensor:
    """Window slots of every token: ``x_ext [B, H, h+T, ...]`` → ``[B, H, T, c, ...]``, slot (t, j) = ext index
    h + t − c + 1 + j (slots before the sequence hold ext index 0; their coefficient is zeroed by the caller).
    With c = 1 the slots are the tokens themselves: a view, no gather (and no scatter in the backward)."""
    if c == 1:
        return (x_ext if h == 0 else x_ext[:, :, h:]).unsqueeze(3)
    idx = torch.arange(T, device=x_ext.device).unsqueeze(1) + (h - c + 1) + torch.arange(c, device=x_ext.device)
    return x_ext[:, :, idx.clamp_min(0)]


def _blocks(x: Optional[torch.Tensor], n_blocks: int, L: int) -> Optional[torch.Tensor]:
    """``[B, H, T, ...]`` → zero-padded ``[B, H, N, L, ...]`` (padded tokens have zero coefficient and a = 1)."""
    if x is None:
        return None
    pad = n_blocks * L - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], 2)
    return x.reshape(*x.shape[:2], n_blocks, L, *x.shape[3:])


def _causal_exp(log_ratio: torch.Tensor, diagonal: int) -> torch.Tensor:
    """exp of ``[..., t, s]`` log-ratios where s ≤ t + diagonal; exactly 0 elsewhere (never inf)."""
    L = log_ratio.shape[-1]
    keep = torch.ones(L, L, dtype=torch.bool, device=log_ratio.device).tril(diagonal)
    return log_ratio.masked_fill(~keep, float("-inf")).exp()


def _ratio(log_t: torch.Tensor, log_s: torch.Tensor, diagonal: int, decays: bool) -> torch.Tensor:
    """``[..., t, s]`` = exp(log_t − log_s) for s ≤ t + diagonal, else 0 (a plain causal mask without decay)."""
    if not decays:
        L = log_t.shape[-1]
        mask = torch.ones(L, L, dtype=log_t.dtype, device=log_t.device).tril(diagonal)
        return mask.expand(*log_t.shape, L)
    return _causal_exp(log_t.unsqueeze(-1) - log_s.unsqueeze(-2), diagonal)


def block_operators(x, v, coef, q, log_a, is_l2: bool, before: bool, read_token: bool):
    """Block-local operators of every block, independent of the block-start memory.

    Shapes (N blocks of L tokens, c window slots): ``x [B,H,N,L,c,K]``, ``v [B,H,N,L,c,V]``,
    ``coef [B,H,N,L,c]`` (η_t γ_j, zero on empty slots), ``q [B,H,N,L,K]``, ``log_a`` None, ``[B,H,N,L]`` or
    ``[B,H,N,L,K]`` (channel-wise). Returns, for the ℓ2 bias, ``(K_q [B,H,N,L,Lc], P ⊙ q [B,H,N,L,K],
    U [B,H,N,Lc,V], X [B,H,N,Lc,K], X_d [B,H,N,Lc,K], P_L [B,H,N,K])``, so that a block with start memory M_0 has
    pseudo-values W = U − X M_0ᵀ, reads y = (P ⊙ q) M_0ᵀ + K_q W and end state M_L = M_0 Diag(P_L) + Wᵀ X_d; for
    the dot product ``(Y_u [B,H,N,L,V], Q_eff [B,H,N,L,K], P_L [B,H,N,K], Δ [B,H,N,V,K])`` with
    y = Y_u + Q_eff M_0ᵀ and M_L = M_0 Diag(P_L) + Δ.
    """
    B, H, N, L, c, K = x.shape
    channel = log_a is not None and log_a.dim() == 5
    decays = log_a is not None
    if log_a is None:
        log_a = x.new_zeros(B, H, N, L)
    logP = log_a.cumsum(3)
    logP_prev = logP - log_a
    logG = logP if before else logP_prev
    lp = logP if read_token else logP_prev              # the decay a read at t sees
    logP_L = logP[:, :, :, -1]                          # [B,H,N] or [B,H,N,K]
    flat = (B, H, N, L * c)
    xf = x.reshape(*flat, K)

    if channel:
        x_over_P = (x * (-logP).exp().unsqueeze(4)).reshape(*flat, K)         # x_{s,i} / P_s
        xG = x * logG.exp().unsqueeze(4)                                       # G_t ⊙ x_{t,j}
        q_eff = q * lp.exp()                                                   # P_t ⊙ q_t
        x_d = x_over_P * logP_L.exp().unsqueeze(3)                             # x ⊙ P_L / P_s
        diag_L = logP_L.exp()                                                  # [B,H,N,K]
    else:
        q_eff = q * lp.exp().unsqueeze(-1)
        x_d = (x * (logP_L.unsqueeze(-1) - logP).exp()[..., None, None]).reshape(*flat, K)
        diag_L = logP_L.exp().unsqueeze(-1).expand(B, H, N, K)

    rhs_v = coef.unsqueeze(-1) * v                                             # [B,H,N,L,c,V]
    read_ratio = None
    if not channel:
        read_ratio = _ratio(lp, logP, 0 if read_token else -1, decays)
    if is_l2:
        if channel:
            cxG = coef.unsqueeze(-1) * xG                                      # η_t γ_j G_t ⊙ x_{t,j}
            A = cxG.reshape(*flat, K) @ x_over_P.mT
        else:   # the scalars η_t γ_j G_t first: one product over the keys, not two
            cxG = (coef * logG.exp().unsqueeze(-1)).unsqueeze(-1) * x
            if c == 1:
                # the read's decay ratio doubles as the system's when G = the read's P and the read mask is strict
                # or the diagonal is ignored (the solve is unit-triangular: only the strict lower part is read)
                ratio = read_ratio if logG is lp else _ratio(logG, logP, -1, decays)
                A = (xf @ xf.mT) * (coef.reshape(flat).unsqueeze(-1) * ratio)  # η_t x_t·x_s G_t / P_s
            else:
                ratio = _ratio(logG, logP, -1, decays)                         # G_t / P_s, s < t
                A = ((coef.unsqueeze(-1) * x).reshape(*flat, K) @ xf.mT).reshape(B, H, N, L, c, L, c)
                A = (A * ratio[:, :, :, :, None, :, None]).reshape(*flat, L * c)
        if channel and c > 1:   # zero the t = s blocks (slots of one token do not see each other)
            strict = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)
            A = A.reshape(B, H, N, L, c, L, c) * strict[:, None, :, None]
            A = A.reshape(*flat, L * c)
        # the UT transform: one inverse of the unit lower-triangular system, then two products (cheaper than a
        # solve against the V + K right-hand columns, forward and backward, once V + K exceeds the L·c unknowns)
        inverse = unit_lower_inverse(A)                                        # [B,H,N,Lc,Lc]
        U, X = inverse @ rhs_v.reshape(*flat, -1), inverse @ cxG.reshape(*flat, K)   # w = U − X M_0ᵀ
    if channel:
        read_mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(0 if read_token else -1)
        kq = (q_eff @ x_over_P.mT).reshape(B, H, N, L, L, c) * read_mask[..., None]
    elif c == 1:
        kq = (q @ xf.mT) * read_ratio
    else:
        kq = (q @ xf.mT).reshape(B, H, N, L, L, c) * read_ratio.unsqueeze(-1)
    kq = kq.reshape(B, H, N, L, L * c)
    if not is_l2:   # dot product: w = η γ v does not depend on M_0, and Φ is the decay alone
        U = rhs_v.reshape(*flat, -1)
        return kq @ U, q_eff, diag_L, U.mT @ x_d
    return kq, q_eff, U, X, x_d, diag_L


def chain_blocks(M0: torch.Tensor, phi: torch.Tensor, delta: torch.Tensor):
    """M_{n+1} = M_n Φ_n + Δ_n (Φ full ``[B,H,N,K,K]`` or diagonal ``[B,H,N,K]``) → (block-start states
    ``[B,H,N,V,K]``, final state ``[B,H,V,K]``). The only sequential part of the dot-product rules."""
    starts, M = [], M0
    for phi_n, delta_n in zip(phi.unbind(2), delta.unbind(2)):   # unbind: one gradient buffer, not N
        starts.append(M)
        M = torch.addcmul(delta_n, M, phi_n.unsqueeze(-2)) if phi_n.dim() == M.dim() - 1 else delta_n + M @ phi_n
    return torch.stack(starts, 2), M


def chain_delta_blocks(M0: torch.Tensor, U: torch.Tensor, X: torch.Tensor, x_d: torch.Tensor, decay: torch.Tensor):
    """The ℓ2 rules' block chain: from ``M0 [B,H,V,K]``, per block n the pseudo-values W_n = U_n − X_n M_nᵀ
    ``[B,H,Lc,V]`` and M_{n+1} = M_n Diag(P_L) + W_nᵀ X_d (``U [B,H,N,Lc,V]``, ``X, x_d [B,H,N,Lc,K]``, ``decay``
    = P_L ``[B,H,N,K]``) → (block-start states ``[B,H,N,V,K]``, W ``[B,H,N,Lc,V]``, final state). Equal to
    M_0 Φ + Δ with Φ = Diag(P_L) − Xᵀ X_d, Δ = Uᵀ X_d, in 2·Lc·K·V multiply-adds a block instead of K²·V + the
    K²·Lc and Lc·K·V that forming Φ and Δ costs: fewer whenever K ≥ Lc·V / (Lc + V), so always when K = V (and the
    reads then skip K_q X, another L·Lc·K)."""
    starts, pseudo, M = [], [], M0
    for U_n, X_n, xd_n, a_n in zip(U.unbind(2), X.unbind(2), x_d.unbind(2), decay.unbind(2)):
        starts.append(M)
        W_n = U_n - X_n @ M.mT
        pseudo.append(W_n)
        M = torch.addcmul(W_n.mT @ xd_n, M, a_n.unsqueeze(-2))
    return torch.stack(starts, 2), torch.stack(pseudo, 2), M


def block_forms(x, v, coef, q, log_a, M0: torch.Tensor, is_l2: bool, before: bool, read_token: bool, T: int):
    """All of a call's block work: :func:`block_operators`, the block chain from ``M0 [B,H,V,K]`` and the reads
    (shapes as :func:`block_operators`) → (y ``[B,H,T,V]``, final state ``[B,H,V,K]``); the unit that
    ``compile: true`` compiles. Reads: y = P ⊙ q M_nᵀ + K_q W_n (ℓ2) or Y_u + Q_eff M_nᵀ (dot product)."""
    ops = block_operators(x, v, coef, q, log_a, is_l2, before, read_token)
    if is_l2:
        kq, q_eff, U, X, x_d, decay = ops
        starts, W, M = chain_delta_blocks(M0, U, X, x_d, decay)
        y = q_eff @ starts.mT + kq @ W
    else:
        y_u, q_eff, decay, delta = ops
        starts, M = chain_blocks(M0, decay, delta)
        y = y_u + q_eff @ starts.mT
    return y.flatten(2, 3)[:, :, :T], M                                        # [B,H,T,V]


def memorize_linear_delta(q, k, v, parts: "MemoryParts", gates: Gates, state: MemoryState,
                          block_size: Optional[int] = None, compile: bool = False):
    """Online linear rules over ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` in blocks of ``block_size``
    (default :func:`default_block` of the feature dimension); ``compile`` runs :func:`block_forms` through
    ``torch.compile`` (:mod:`atlaslab.engines.compiled`)."""
    state = dataclasses.replace(state)
    spec = parts.spec
    ret = parts.retention
    c, fm = parts.window.size, parts.feature_map
    T = q.shape[1]
    h = state.hist_k.shape[1]
    k_ext, v_ext, g_ext, d_ext = with_history(state, k, v, gates)
    x = _slots(_bh(fm(k_ext)), h, T, c)                                    # [B,H,T,c,K]
    L = max(1, min(block_size or default_block(x.shape[-1]), T))
    if ret.channel_wise and gates.retention is not None:
        L = min(L, CHANNEL_BLOCK)   # x / P_s is formed per channel: short blocks keep it finite
    N = -(-T // L)
    vs = _slots(_bh(v_ext), h, T, c)
    coef = _bh(gates.lr).unsqueeze(-1) * _slots(_bh(g_ext), h, T, c)
    if c > 1:   # slots before the sequence's (and the history's) start
        coef = coef * ((torch.arange(T, device=q.device).unsqueeze(1) + (h - c + 1)
                        + torch.arange(c, device=q.device)) >= 0)
    log_a = None
    if gates.retention is not None and ret.uses_alpha:
        a = _bh(gates.retention)
        log_a = a.clamp_min(torch.finfo(a.dtype).tiny).log()
    before = ret.before_step and gates.retention is not None
    forms = maybe_compiled(block_forms, compile, q.device)
    y, M = forms(_blocks(x, N, L), _blocks(vs, N, L), _blocks(coef, N, L), _blocks(_bh(fm(q)), N, L),
                 _blocks(log_a, N, L), state.weights["W"], spec.attentional_bias.name == "l2", before,
                 parts.read == "token", T)

    keep_history(state, parts.window.history(), k_ext, v_ext, g_ext, d_ext)
    if gates.retention is not None:
        state.chunk_alpha = gates.retention[:, -1]
    state.position += T
    state.weights = {"W": M}
    state.anchor = state.weights   # with b = 1 the anchor is refreshed at every token
    return y.transpose(1, 2), state
