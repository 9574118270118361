"""Chunk-parallel Triton kernels of the Omega-window rule (c ≤ 8 window slots per token, b = 1), forward and backward.

The delta rule's stages (the shared jit bodies of :mod:`atlaslab.kernels.common`, whose C > 1 case these kernels
run) with the L·c window slots of a chunk as the rows of the UT system, decays and causal masks taken at the
slots' tokens; ``_win_cw_*`` for channel-wise decay. The math is :func:`.naive.window_rule_chunk`
(docs/kernels.md#window-rule). Slots come from :func:`.naive.window_slots`: with ``cu_seqlens`` the kernels trust
its zero coefficients before each sequence's start. Here: the window UT body (``_win_ut``) and the per-head output
kernel, whose loads form their masks in their own order, and the op's entry points.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.delta_rule import chunk as delta_chunk
from atlaslab.kernels.delta_rule.chunk import value_block
from atlaslab.kernels.utils import (BEFORE_STEP, ChunkLayout, check_head_dims, dot_precision, log_decay, log_gate_grad,
                                   pow2, reference_backward, with_torch_fallback)
from atlaslab.kernels.window_rule.naive import MAX_WINDOW, check_window_args, window_rule_chunk

if triton is not None:
    # the shared stage bodies and pieces (C = 1 and window, per-head and channel-wise decay): kernels/common
    from atlaslab.kernels.common.chunk_grad import grad_channel, grad_per_head
    from atlaslab.kernels.common.chunk_h import dh_sweep, state_sweep
    from atlaslab.kernels.common.chunk_o import out_chunk, read_scores
    from atlaslab.kernels.common.chunk_ut import ut_solve
    from atlaslab.kernels.common.index import (causal_mask, chunk_rows, chunk_span, load_gates, load_tile, load_vec,
                                               read_gate, state_block)

    @triton.jit
    def _win_ut(xs, vs, coef, la, g, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr,
                IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                BS: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr, HAS_ALPHA: tl.constexpr, BEFORE: tl.constexpr,
                STORE_AINV: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1 (ℓ2 only) of the window kernels, per chunk × head: the UT system of the chunk's BT·C slots
        (:func:`.common.chunk_ut.ut_solve`), decays at the slots' tokens (g given, ``[B, T, H(, K)]``; G = g before_step,
        g − log α after_step)."""
        i_c = tl.program_id(0)            # global chunk index: all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(0, K, V, BK, BVV)     # all the values: one block of BVV
        m_t, rows, tau, m_s, srow, trow = chunk_rows(o_i, o_s, bos, i_t, i_h, T, H, C, BT)
        if CHANNEL:
            m_sk = m_s[:, None] & m_k[None, :]
            b_x = load_tile(xs, srow, o_k, K, m_sk)
        else:    # (the per-head kernel forms this mask after the address)
            b_x = tl.load(xs + srow[:, None] * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
        b_v = tl.load(vs + srow[:, None] * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_c = load_vec(coef, srow, m_s)
        if CHANNEL:
            b_g = load_gates(g, rows, m_t, o_k, m_k, K, True)          # g at the chunk's tokens [BT, BK]
        b_gs = load_gates(g, trow, m_s, o_k, m_k, K, CHANNEL)
        if not CHANNEL:
            b_g = b_gs
        b_G = read_gate(b_gs, la, trow, m_s, o_k, m_k, K, HAS_ALPHA, BEFORE, CHANNEL)   # (G has gq's form)
        ut_solve(b_x, b_c, b_v, b_G, b_gs, b_g, u_out, wk_out, ainv_out, srow, m_s, o_i, tau, o_s, o_k, m_k, o_v,
                  m_v, K, V, C, BT, BS, STORE_AINV, CHANNEL, PRECISION)

    @triton.jit
    def _win_ut_kernel(xs, vs, coef, la, g, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT,
                       H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                       BVV: tl.constexpr, HAS_ALPHA: tl.constexpr, BEFORE: tl.constexpr, STORE_AINV: tl.constexpr,
                       PRECISION: tl.constexpr):
        """Stage 1 (ℓ2 only), per chunk × head: A[r, r'] = coef_r e^{G_τr − g_τr'} x_r·x_r' (τr' < τr), its
        unit-triangular inverse by forward substitution, u = (I + A)⁻¹ (coef v), w_k = (I + A)⁻¹ (coef e^G x)."""
        _win_ut(xs, vs, coef, la, g, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, V,
                C, BT, BS, BK, BVV, HAS_ALPHA, BEFORE, STORE_AINV, False, PRECISION)

    @triton.jit
    def _win_state_kernel(xs, vs, coef, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                          H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, HAS_H0: tl.constexpr, IS_L2: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2 (:func:`.common.chunk_h.state_sweep` on the slots), per value block × head, sequential over chunks:
        w = u − w_k S_0ᵀ (dot: coef v), stores the chunk-start states, S ← e^{g_L} S + Σ_r e^{g_L − g_τr} w_r x_rᵀ."""
        state_sweep(xs, vs, coef, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K,
                     V, C, BT, BS, BK, BV, HAS_H0, IS_L2, False, PRECISION)

    @triton.jit
    def _win_out_kernel(q, xs, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr,
                        IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        HAS_ALPHA: tl.constexpr, READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 3, per value block × chunk × head: o = e^{gq} (q S_0ᵀ) + [m e^{gq_t − g_τr} q_t·x_r] w (the
        pieces of :func:`.common.chunk_o.out_chunk`, in this kernel's order of loads)."""
        i_v = tl.program_id(0)
        i_c = tl.program_id(1)
        i_h = tl.program_id(2)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        m_t, rows, tau, m_s, srow, trow = chunk_rows(o_i, o_s, bos, i_t, i_h, T, H, C, BT)
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_x = tl.load(xs + srow[:, None] * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_g = load_vec(g, rows, m_t)
        b_gs = load_vec(g, trow, m_s)
        b_gq = read_gate(b_g, la, rows, m_t, o_k, m_k, K, HAS_ALPHA, READ_TOKEN, False)
        causal = causal_mask(o_i, tau, m_s, C, not READ_TOKEN)
        b_w = tl.load(w + srow[:, None] * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
        h = tl.load(hs + (i_c.to(tl.int64) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :],
                    mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_o = tl.exp(b_gq)[:, None] * tl.dot(b_q, tl.trans(h), input_precision=PRECISION)
        b_o += tl.dot(read_scores(b_q, b_x, b_gq, b_g, b_gs, causal, m_t, o_i, o_s, C, BT, BS, READ_TOKEN, False,
                                   PRECISION), b_w, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    @triton.jit
    def _win_bwd_dh_kernel(q, xs, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT,
                           H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                           IS_L2: tl.constexpr, READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Reverse sweep over chunks (:func:`.common.chunk_h.dh_sweep`, value block × head): dw = Pᵀ do + e^{g_L − g_τ} ⊙
        (x dSᵀ) on the slots; dS ← e^{g_L} dS + (e^{gq} ⊙ do)ᵀ q − [l2] dwᵀ w_k."""
        dh_sweep(q, xs, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K, V, C,
                  BT, BS, BK, BV, HAS_ALPHA, HAS_DHT, HAS_H0, IS_L2, READ_TOKEN, False, PRECISION)

    @triton.jit
    def _win_bwd_grad_kernel(q, xs, vs, coef, la, g, ainv, w, hs, dhs, do, dw, dq, dx, dv, dcoef, dla,
                             cu_seqlens, chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                             BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                             IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                             PRECISION: tl.constexpr):
        """Per chunk × head: dq (tokens), dx, dv, dcoef (slots) and d log α (tokens) — the c = 1 grad kernel's
        equations with the slot rows in place of the tokens; slot terms of dg / dG are summed into their tokens
        (a one-hot [BT, BS] reduction) before the reverse cumsum."""
        grad_per_head(q, xs, vs, coef, la, g, ainv, w, hs, dhs, do, dw, dq, dx, dv, dcoef, dla, cu_seqlens,
                       chunk_indices, T, NT, H, IS_VARLEN, K, V, C, BT, BS, BK, BV, HAS_ALPHA, IS_L2, BEFORE,
                       READ_TOKEN, PRECISION)

    @triton.jit
    def _win_cw_ut_kernel(xs, vs, coef, la, g, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT,
                          H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr,
                          BEFORE: tl.constexpr, STORE_AINV: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1 (ℓ2 only), channel-wise, per chunk × head: A[r, r'] = coef_r Σ_c x_rc x_r'c e^{G_τr,c − g_τr',c}
        (τr' < τr), (I + A)⁻¹ by forward substitution, u = (I + A)⁻¹ (coef v), w_k = (I + A)⁻¹ (coef x ⊙ e^{G_τ})."""
        _win_ut(xs, vs, coef, la, g, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, V,
                C, BT, BS, BK, BVV, True, BEFORE, STORE_AINV, True, PRECISION)

    @triton.jit
    def _win_cw_state_kernel(xs, vs, coef, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                             H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, HAS_H0: tl.constexpr, IS_L2: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2, channel-wise (:func:`.common.chunk_h.state_sweep`), per value block × sequence × head: w = u − w_k S_0ᵀ
        (dot: coef v), stores the chunk-start states, S ← S Diag(e^{g_L}) + Σ_r w_r (x_r ⊙ e^{g_L − g_τr})ᵀ."""
        state_sweep(xs, vs, coef, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K,
                     V, C, BT, BS, BK, BV, HAS_H0, IS_L2, True, PRECISION)

    @triton.jit
    def _win_cw_out_kernel(q, xs, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr,
                           IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 3, channel-wise (:func:`.common.chunk_o.out_chunk`): o = (q ⊙ e^{gq}) S_0ᵀ + P w,
        P[t, r] = Σ_c q_tc x_rc e^{gq_tc − g_τr,c} (τr ≤ t for read token, < t for read chunk)."""
        out_chunk(q, xs, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, V, C, BT, BS, BK, BV,
                   True, READ_TOKEN, True, PRECISION)

    @triton.jit
    def _win_cw_bwd_dh_kernel(q, xs, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT,
                              H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, IS_L2: tl.constexpr,
                              READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Reverse sweep, channel-wise (:func:`.common.chunk_h.dh_sweep`): dw = Pᵀ do + (x ⊙ e^{g_L − g_τ}) dSᵀ on the
        slots; dS ← dS Diag(e^{g_L}) + doᵀ (q ⊙ e^{gq}) − [l2] dwᵀ w_k; the last dS is the initial state's."""
        dh_sweep(q, xs, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K, V, C,
                  BT, BS, BK, BV, True, HAS_DHT, HAS_H0, IS_L2, READ_TOKEN, True, PRECISION)

    @triton.jit
    def _win_cw_bwd_grad_kernel(q, xs, vs, coef, la, g, ainv, w, hs, dhs, do, dw, dq, dx, dv, dcoef, dla,
                                cu_seqlens, chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr,
                                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                                BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_L2: tl.constexpr,
                                BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Per chunk × head, channel-wise: dq (tokens), dx, dv, dcoef (slots), d log α ``[BT, K]`` (tokens).
        With D = do wᵀ, dr = (I + A)⁻ᵀ dw, dA = −strict(dr wᵀ), x_G = x ⊙ e^{G_τ}, Z = coef_r dA[r, r']:
        dq = (do S_0) ⊙ e^{gq} + Σ_r D[t, r] x_r ⊙ e^{gq_t − g_τr};
        dx = Σ_t D[t, r] q_t ⊙ e^{gq_t − g_τr} + (w dS) ⊙ e^{g_L − g_τ} − coef (dr S_0) ⊙ e^{G_τ}
             + Σ_r' Z[r, r'] x_r' ⊙ e^{G_τr − g_τr'} + Σ_r Z[r, r'] x_r ⊙ e^{G_τr − g_τr'} (the last at r');
        dcoef = Σ_v dr ⊙ (v − x_G S_0ᵀ) + x_r · Σ_r' dA[r, r'] x_r' ⊙ e^{G_τr − g_τr'}  (dot: Σ_v dw ⊙ v);
        per slot dg = −x ⊙ (dx_P + dx_S) − [l2] x ⊙ Z-column term, dG = −coef (dr S_0) ⊙ x_G + x ⊙ Z-row term;
        summed into their tokens (one-hot [BT, BS] products) with d gq = q ⊙ dq and, at the chunk's last token,
        e^{g_L} ⊙ Σ_v dS ⊙ S_0 + Σ_r x_r ⊙ dx_S,r; d log α = reverse-cumsum(dg + dG) − [after] dG − [chunk] d gq."""
        grad_channel(q, xs, vs, coef, la, g, ainv, w, hs, dhs, do, dw, dq, dx, dv, dcoef, dla, cu_seqlens,
                      chunk_indices, T, NT, H, IS_VARLEN, K, V, C, BT, BS, BK, BV, IS_L2, BEFORE, READ_TOKEN,
                      PRECISION)


def _win_sizes(K: int, V: int, c: int, chunk_size: int):
    """Window block sizes: BT tokens per chunk (a power of two ≥ 16, about chunk_size / c), BS = pow2(BT·c) slot
    rows, BK / BVV padded head dims, BV the state kernels' value block."""
    check_head_dims("chunk (triton)", K, V)
    if not 1 <= c <= MAX_WINDOW:
        raise ValueError(f"chunk window (triton): window c = {c} must be in [1, {MAX_WINDOW}]")
    per = max(1, int(chunk_size) // c)
    BT = max(16, 1 << (per.bit_length() - 1))
    BK, BVV = pow2(K), pow2(V)
    return BT, pow2(BT * c), BK, BVV, value_block(BK, BVV)


def _slot_warps(BS: int) -> int:
    """Warps for the kernels that hold [BS, BS] slot blocks in registers (UT solve, backward grads): 4 up to 32 slot
    rows, 8 at 64, 16 at 128. Compiled for sm_90 without a GPU (``bench/compile_sm90.py``, K = 8 test shapes): at 4
    warps the 64-row builds spill up to ~3 KB / thread (per-head UT) and ~2 KB (channel-wise grads), at 8 warps
    ≤ 0.7 KB; the 128-row builds (c ≥ 5 at 16-token chunks) spill ~1–3 KB at any warp count (the [BS, BS]
    forward substitution in registers; fla's blocked 16×16 solves would be the fix). Speed unmeasured."""
    return 4 if BS <= 32 else (8 if BS <= 64 else 16)


def _chunk_log_cumsum(la: Optional[torch.Tensor], B: int, T: int, H: int, BT: int, lay, device) -> torch.Tensor:
    """g ``[B, T, H]`` (``[B, T, H, K]`` for channel-wise la) fp32: the chunk-local (BT tokens) cumsum of log α
    (zeros without decay). With packed
    sequences (``lay.varlen``) the chunks are those of :func:`.chunk.prepare_chunk_indices`: each token is
    scattered to (its global chunk, its place in the chunk), cumsummed there and gathered back."""
    if la is None:
        return torch.zeros(B, T, H, dtype=torch.float32, device=device)
    if lay.varlen:
        cu = lay.cu.long()
        t = torch.arange(T, device=device)
        n = torch.searchsorted(cu, t, right=True) - 1
        local = t - cu[n]
        pos = (lay.offsets.long()[n] + local // BT) * BT + local % BT
        x = la.new_zeros(lay.NC * BT, *la.shape[2:]).index_copy_(0, pos, la[0])
        return x.reshape(lay.NC, BT, *la.shape[2:]).cumsum(1).reshape(-1, *la.shape[2:])[pos].unsqueeze(0).contiguous()
    NT = -(-T // BT)
    pad = NT * BT - T
    x = torch.cat([la, la.new_zeros(B, pad, *la.shape[2:])], 1) if pad else la
    return x.reshape(B, NT, BT, *la.shape[2:]).cumsum(2).reshape(B, NT * BT, *la.shape[2:])[:, :T].contiguous()


def _win_forward_stages(xs, vs, coef, la, h0, *, c, bias, placement, BT, BS, BK, BVV, BV, prec, lay,
                        store_ainv=False):
    """Stages 1–2 on the flattened slot tensors ``[B, T·c, H, ·]``: g, u / w_k (/ (I + A)⁻¹) and w, the
    chunk-start states ``hs [NC, H, V, K]`` and the final states ``ht [N, H, V, K]``; one launch each."""
    B, TC, H, K = xs.shape
    T = TC // c
    V = vs.shape[-1]
    f32 = dict(dtype=torch.float32, device=xs.device)
    g = _chunk_log_cumsum(la, B, T, H, BT, lay, xs.device)
    is_l2 = bias == "l2"
    u = torch.empty(B, T * c, H, V, **f32) if is_l2 else None
    wk = torch.empty(B, T * c, H, K, **f32) if is_l2 else None
    ainv = torch.empty(B, T * c, H, BS, **f32) if (is_l2 and store_ainv) else None
    w = torch.empty(B, T * c, H, V, **f32)
    hs = torch.empty(lay.NC, H, V, K, **f32)
    ht = torch.empty(lay.N, H, V, K, **f32)
    dummy = g
    if la is not None and la.dim() == 4:     # channel-wise decay: the _win_cw_* kernels
        if is_l2:
            _win_cw_ut_kernel[(lay.NC, H)](
                xs, vs, coef, la, g, u, wk, ainv if ainv is not None else dummy, lay.cu, lay.table, T, lay.NT, H=H,
                IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK, BVV=BVV, BEFORE=placement == BEFORE_STEP,
                STORE_AINV=ainv is not None, PRECISION=prec, num_warps=_slot_warps(BS))
        _win_cw_state_kernel[(triton.cdiv(V, BV), lay.N * H)](
            xs, vs, coef, g, u if is_l2 else dummy, wk if is_l2 else dummy, h0 if h0 is not None else dummy, w, hs,
            ht, lay.cu, lay.offsets, T, lay.NT, H=H, IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK,
            BV=BV, HAS_H0=h0 is not None, IS_L2=is_l2, PRECISION=prec, num_warps=4)
        return dict(g=g, wk=wk, ainv=ainv, w=w, hs=hs, ht=ht)
    if is_l2:
        _win_ut_kernel[(lay.NC, H)](
            xs, vs, coef, la if la is not None else dummy, g, u, wk, ainv if ainv is not None else dummy, lay.cu,
            lay.table, T, lay.NT, H=H, IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK, BVV=BVV,
            HAS_ALPHA=la is not None, BEFORE=placement == BEFORE_STEP, STORE_AINV=ainv is not None,
            PRECISION=prec, num_warps=_slot_warps(BS))
    _win_state_kernel[(triton.cdiv(V, BV), lay.N * H)](
        xs, vs, coef, g, u if is_l2 else dummy, wk if is_l2 else dummy, h0 if h0 is not None else dummy, w, hs, ht,
        lay.cu, lay.offsets, T, lay.NT, H=H, IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK, BV=BV,
        HAS_H0=h0 is not None, IS_L2=is_l2, PRECISION=prec, num_warps=4)
    return dict(g=g, wk=wk, ainv=ainv, w=w, hs=hs, ht=ht)


def window_forward(q, xs, vs, coef, alpha=None, initial_state=None, *, bias, placement,
                   read, cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
    """The window forward kernels, no autograd; arguments as :func:`chunk_window_rule`. One launch per stage,
    with or without ``cu_seqlens``."""
    c = check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = vs.shape[-1]
    BT, BS, BK, BVV, BV = _win_sizes(K, V, c, chunk_size)
    lay = ChunkLayout(B, T, BT, cu_seqlens, q)
    q = q.contiguous()
    xs, vs, coef = (x.contiguous().flatten(1, 2) for x in (xs, vs, coef))     # [B, T·c, H, ·]
    la = log_decay(alpha.float(), q).contiguous() if alpha is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    prec = dot_precision(q.dtype, allow_tf32)
    st = _win_forward_stages(xs, vs, coef, la, h0, c=c, bias=bias, placement=placement, BT=BT, BS=BS, BK=BK,
                             BVV=BVV, BV=BV, prec=prec, lay=lay)
    o = torch.empty(B, T, H, V, dtype=vs.dtype, device=q.device)
    if la is not None and la.dim() == 4:
        _win_cw_out_kernel[(triton.cdiv(V, BV), lay.NC, H)](
            q, xs, la, st["g"], st["w"], st["hs"], o, lay.cu, lay.table, T, lay.NT, H=H, IS_VARLEN=lay.varlen, K=K,
            V=V, C=c, BT=BT, BS=BS, BK=BK, BV=BV, READ_TOKEN=read == "token", PRECISION=prec, num_warps=4)
        return o, st["ht"].to(initial_state.dtype if initial_state is not None else q.dtype)
    _win_out_kernel[(triton.cdiv(V, BV), lay.NC, H)](
        q, xs, la if la is not None else st["g"], st["g"], st["w"], st["hs"], o, lay.cu, lay.table, T, lay.NT, H=H,
        IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK, BV=BV, HAS_ALPHA=la is not None,
        READ_TOKEN=read == "token", PRECISION=prec, num_warps=4)
    return o, st["ht"].to(initial_state.dtype if initial_state is not None else q.dtype)


def window_chunk_backward(q, xs, vs, coef, alpha, initial_state, do, dht, *, bias, placement,
                          read, cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
    """Gradients of :func:`window_forward` on the window backward kernels: ``(dq, dxs, dvs, dcoef, dalpha, dh0)``
    (``dalpha`` / ``dh0`` None when ``alpha`` / ``initial_state`` are). Re-runs stages 1–2 (storing (I + A)⁻¹),
    sweeps the chunks in reverse for dS and dw (``_win_bwd_dh_kernel``), then forms every chunk's gradients in
    parallel (``_win_bwd_grad_kernel``); channel-wise decay on the ``_win_cw_bwd_*`` kernels (``dalpha``
    ``[B, T, H, D_k]``). With ``cu_seqlens`` each stage is still one launch (the sweeps one program per value
    block × sequence × head, the rest over the chunk-index table)."""
    c = check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens)
    channel = alpha is not None and alpha.dim() == 4
    B, T, H, K = q.shape
    V = vs.shape[-1]
    BT, BS, BK, BVV, BV = _win_sizes(K, V, c, chunk_size)
    lay = ChunkLayout(B, T, BT, cu_seqlens, q)
    f32 = dict(dtype=torch.float32, device=q.device)
    q_, do_ = q.contiguous(), do.contiguous()
    xs_, vs_, coef_ = (x.contiguous().flatten(1, 2) for x in (xs, vs, coef))
    la = log_decay(alpha.float(), q).contiguous() if alpha is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    prec = dot_precision(q.dtype, allow_tf32)
    is_l2 = bias == "l2"
    st = _win_forward_stages(xs_, vs_, coef_, la, h0, c=c, bias=bias, placement=placement, BT=BT, BS=BS, BK=BK,
                             BVV=BVV, BV=BV, prec=prec, lay=lay, store_ainv=True)
    g = dummy = st["g"]
    dhs = torch.empty(lay.NC, H, V, K, **f32)
    dw = torch.empty(B, T * c, H, V, **f32)
    dh0 = torch.empty(lay.N, H, V, K, **f32) if h0 is not None else None
    meta = dict(H=H, IS_VARLEN=lay.varlen, K=K, V=V, C=c, BT=BT, BS=BS, BK=BK, BV=BV, IS_L2=is_l2,
                READ_TOKEN=read == "token", PRECISION=prec, num_warps=4)
    if not channel:
        meta["HAS_ALPHA"] = la is not None
    (_win_cw_bwd_dh_kernel if channel else _win_bwd_dh_kernel)[(triton.cdiv(V, BV), lay.N * H)](
        q_, xs_, la if la is not None else dummy, g, st["wk"] if is_l2 else dummy, do_,
        dht if dht is not None else dummy, dhs, dw, dh0 if dh0 is not None else dummy, lay.cu, lay.offsets, T,
        lay.NT, HAS_DHT=dht is not None, HAS_H0=dh0 is not None, **meta)
    dq = torch.empty(B, T, H, K, **f32)
    dx = torch.empty(B, T * c, H, K, **f32)
    dv = torch.empty(B, T * c, H, V, **f32)
    dcoef = torch.empty(B, T * c, H, **f32)
    dla = torch.empty(la.shape, **f32) if la is not None else None
    (_win_cw_bwd_grad_kernel if channel else _win_bwd_grad_kernel)[(lay.NC, H)](
        q_, xs_, vs_, coef_, la if la is not None else dummy, g, st["ainv"] if is_l2 else dummy, st["w"], st["hs"],
        dhs, do_, dw, dq, dx, dv, dcoef, dla if dla is not None else dummy, lay.cu, lay.table, T, lay.NT,
        BEFORE=placement == BEFORE_STEP, **{**meta, "num_warps": _slot_warps(BS)})
    dalpha = log_gate_grad(dla, alpha.float()).to(alpha.dtype) if alpha is not None else None
    unflat = lambda x, like: x.reshape(like.shape).to(like.dtype)   # noqa: E731
    return (dq.to(q.dtype), unflat(dx, xs), unflat(dv, vs), unflat(dcoef, coef), dalpha,
            dh0.to(initial_state.dtype) if dh0 is not None else None)


def window_torch_backward(saved, need, do, dht, opts, chunk_size):
    """Backward of a window kernel by autograd of :func:`.naive.window_rule_chunk`, recomputed (≥ fp32)."""
    return reference_backward(window_rule_chunk, saved, need, (do, dht), chunk_size=chunk_size, **opts)


def window_backward(saved, need, do, dht, opts, chunk_size):
    """Gradients of a window kernel's ``(q, xs, vs, coef, alpha, initial_state)`` (None where not needed): the
    window backward kernels (:func:`window_chunk_backward`, ``chunk_size`` as :func:`chunk_window_rule`'s), or
    autograd of the torch chunk form recomputed (:func:`window_torch_backward`) with ``BACKWARD == "torch"``."""
    q, xs, vs = saved[0], saved[1], saved[2]

    def torch_path():
        BT = _win_sizes(q.shape[-1], vs.shape[-1], xs.shape[2], chunk_size)[0]
        return window_torch_backward(saved, need, do, dht, opts, BT)

    def kernels():
        grads = window_chunk_backward(*saved, do, dht, chunk_size=chunk_size, **opts)
        return [gr if n else None for gr, n in zip(grads, need)]
    return torch_path() if delta_chunk.BACKWARD == "torch" else with_torch_fallback(kernels, torch_path, "window backward")


class WindowChunkFunction(torch.autograd.Function):
    """Window kernel forward; backward on the window backward kernels (:func:`window_backward`)."""

    @staticmethod
    def forward(ctx, q, xs, vs, coef, alpha, initial_state, bias, placement, read, cu_seqlens, chunk_size,
                allow_tf32):
        ctx.save_for_backward(q, xs, vs, coef, alpha, initial_state)
        ctx.opts = dict(bias=bias, placement=placement, read=read)
        if cu_seqlens is not None:
            ctx.opts["cu_seqlens"] = cu_seqlens
        ctx.chunk_size = chunk_size
        return window_forward(q, xs, vs, coef, alpha, initial_state, bias=bias, placement=placement, read=read,
                              cu_seqlens=cu_seqlens, chunk_size=chunk_size, allow_tf32=allow_tf32)

    @staticmethod
    def backward(ctx, do, dht):
        grads = window_backward(ctx.saved_tensors, ctx.needs_input_grad[:6], do, dht, ctx.opts, ctx.chunk_size)
        return (*grads, None, None, None, None, None, None)


def chunk_window_rule(q: torch.Tensor, xs: torch.Tensor, vs: torch.Tensor, coef: torch.Tensor,
                      alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                      bias: str, placement: str, read: str,
                      cu_seqlens: Optional[torch.LongTensor] = None, chunk_size: int = 64,
                      allow_tf32: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Omega-window (c ≥ 1) linear rule, chunk-parallel on Triton: the math of
    :func:`.naive.window_rule_chunk` (exact; same results as :func:`.naive.window_rule_recurrent`).

    Args:
        q: ``[B, T, H, D_k]`` queries (featurised).
        xs: ``[B, T, c, H, D_k]`` window keys (slot (t, j) = featurised key of token t − c + 1 + j), vs
            ``[B, T, c, H, D_v]`` their values, coef ``[B, T, c, H]`` the step coefficients η_t γ_j (0 on slots
            before the window history): :func:`.naive.window_slots` builds them. c ≤ :data:`MAX_WINDOW`.
        alpha: ``[B, T, H]`` per-head kept fraction, ``[B, T, H, D_k]`` channel-wise (S ← S Diag(α_t)), or None.
        initial_state: ``[N, H, D_v, D_k]`` or None (zeros); N = B, or the number of packed sequences.
        bias, placement, read: as :func:`chunk_delta_rule`.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1, tensors ``[1, total_T, ...]``), or None. Run
            natively as :func:`.chunk.chunk_delta_rule` does: one launch per stage over all chunks of all
            sequences (chunks never cross a boundary, states restart at each). The slots must not reach across a
            sequence start: build them with :func:`.naive.window_slots` (``cu_seqlens=...``), which gives the
            slots before a sequence's first token coefficient 0 (the kernels trust ``coef`` for this).
        chunk_size: about how many slot rows a chunk holds: BT = a power of two ≥ 16 near ``chunk_size / c``
            tokens per chunk (it does not change the result).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`atlaslab.kernels.utils.dot_precision` chooses.

    Returns:
        ``o: [B, T, H, D_v]`` and the final state(s) ``[N, H, D_v, D_k]``.

    Backward: the window backward kernels (:func:`window_chunk_backward`: the chunk states recomputed, a reverse
    sweep for dS, then every chunk's gradients in parallel; per-head or channel-wise decay); ``BACKWARD == "torch"``
    switches to autograd of the torch chunk form, recomputed.
    """
    return WindowChunkFunction.apply(q, xs, vs, coef, alpha, initial_state, bias, placement, read, cu_seqlens,
                                     int(chunk_size), allow_tf32)
