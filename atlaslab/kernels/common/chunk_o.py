"""Stage 3 of the chunk kernels: the output o = decayed q S_0ᵀ + P w, with P the intra-chunk read scores (per
head or channel-wise, read token or read chunk; fla's ``chunk_o`` stage).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:
    from atlaslab.kernels.common.index import (causal_mask, _chunk_row, chunk_rows, chunk_span, load_gates, load_tile,
                                               read_gate, state_block)
    from atlaslab.kernels.common.decay import _channel_scores, _masked_decay

    @triton.jit
    def read_scores(b_q, b_x, b_gq, b_g, b_gs, causal, m_t, o_i, o_s, C: tl.constexpr, BT: tl.constexpr,
                     BS: tl.constexpr, READ_TOKEN: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """The intra-chunk read P ``[BT, BS]``: P[t, r] = e^{gq_t − g_τr} q_t·x_r (per head; on the ``causal``
        mask of :func:`causal`) or Σ_c q_tc x_rc e^{gq_tc − g_τr,c} (channel-wise) for τ_r ≤ t (read token) or
        τ_r < t (read chunk). b_q, b_gq ``[BT, ·]`` at the tokens, b_x ``[BS, BK]`` and b_gs (per head: g at the
        slots' tokens ``[BS]``) at the write rows, b_g the tokens' g (channel-wise ``[BT, BK]``)."""
        if CHANNEL:
            P = _channel_scores(b_q, b_gq, m_t, o_i, b_x, b_g, o_i, o_s, BT, C, BT, BS, not READ_TOKEN)
        else:
            qx = tl.dot(b_q, tl.trans(b_x), input_precision=PRECISION)
            P = tl.where(causal, qx * _masked_decay(b_gq, b_gs, causal), 0.0)
        return P

    @triton.jit
    def out_chunk(q, k, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr,
                   IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                   BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                   READ_TOKEN: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 3 (value block × chunk × head, all chunks in parallel): o = e^{gq} ⊙ (q S_0ᵀ) (per head) or
        (q ⊙ e^{gq}) S_0ᵀ (channel-wise) + P w, P of :func:`read_scores`. q, o ``[B, T, H, ·]``; k, w the write
        rows (tokens, or window slots for C > 1). The per-head window kernel has its own body
        (``window_rule.chunk._win_out_kernel``: its loads form their masks in another order)."""
        i_v = tl.program_id(0)
        i_c = tl.program_id(1)            # global chunk index
        i_h = tl.program_id(2)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        boc = i_c.to(tl.int64) - i_t      # global index of the sequence's first chunk (rows of hs / dhs)
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        m_t, rows, tau, m_s, srow, trow = chunk_rows(o_i, o_s, bos, i_t, i_h, T, H, C, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = load_tile(q, rows, o_k, K, m_tk)
        b_x = tl.load(k + srow[:, None] * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_g = load_gates(g, rows, m_t, o_k, m_k, K, CHANNEL)
        b_gq = read_gate(b_g, la, rows, m_t, o_k, m_k, K, HAS_ALPHA, READ_TOKEN, CHANNEL)
        causal = causal_mask(o_i, tau, m_s, C, not READ_TOKEN)        # (per head only)
        b_w = tl.load(w + srow[:, None] * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
        h = tl.load(hs + (_chunk_row(i_c, i_t, boc, C) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :],
                    mask=m_v[:, None] & m_k[None, :], other=0.0)     # (formed as the builds have it)
        if CHANNEL:
            b_o = tl.dot(b_q * tl.exp(b_gq), tl.trans(h), input_precision=PRECISION)
        else:
            b_o = tl.exp(b_gq)[:, None] * tl.dot(b_q, tl.trans(h), input_precision=PRECISION)
        P = read_scores(b_q, b_x, b_gq, b_g, b_g, causal, m_t, o_i, o_s, C, BT, BS, READ_TOKEN, CHANNEL, PRECISION)
        b_o += tl.dot(P, b_w, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
