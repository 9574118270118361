"""The sequential sweeps over a sequence's chunks: the forward state sweep (stage 2: chunk-start states and the
pseudo-values w) and the backward reverse sweep for the state gradients dS and dw, C = 1 and window slots, per-head
and channel-wise decay (fla's ``chunk_delta_h`` stage).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:
    from atlaslab.kernels.common.index import _last_gate, _sweep_program, slot_rows, slot_tokens, state_block, sweep_span
    from atlaslab.kernels.common.decay import _decayed_dot, _masked_decay, _slot_decayed_dot

    @triton.jit
    def state_sweep(k, v, beta, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                     H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                     IS_L2: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2 (one program per value block × sequence × head, sequential over its chunks): stores every
        chunk-start state S_0 (``hs [NC, H, V, K]``), the pseudo-values w = u − w_k S_0ᵀ (ℓ2) or c v (dot) of the
        chunk's write rows, and steps S ← e^{g_L} S + Σ_r e^{g_L − g_τr} w_r k_rᵀ (per head) or
        S ← S Diag(e^{g_L}) + Σ_r w_r (k_r ⊙ e^{g_L − g_τr})ᵀ (channel-wise); the last S to ``ht [N, H, V, K]``.
        k, v, beta, u, wk, w_out: the write rows (tokens, or window slots for C > 1); g ``[B, T, H(, K)]``."""
        i_v, i_bh, i_h, bos, T, NT, boc = sweep_span(cu_seqlens, chunk_offsets, T, NT, H, BT, IS_VARLEN)
        o_s = tl.arange(0, BS)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        tau = slot_tokens(o_s, C)
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_H0:
            h += tl.load(h0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        # (the loop's helpers, slot_rows and _last_gate, were checked with bench/compile_sm90.py: every sm_90 build
        # keeps its registers, stack and shared memory but one C = 2 channel-wise test build, 188 -> 190 registers)
        for i_t in range(0, NT):
            tl.store(hs + ((boc + i_t) * H + i_h) * V * K + h_offs, h, mask=m_h)   # chunk-start state [NC, H, V, K]
            m_s, srow, trow = slot_rows(bos, i_t, i_h, o_s, tau, T, H, C, BT)
            m_sk = m_s[:, None] & m_k[None, :]
            m_sv = m_s[:, None] & m_v[None, :]
            b_x = tl.load(k + srow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0).to(tl.float32)
            if IS_L2:
                b_u = tl.load(u + srow[:, None] * V + o_v[None, :], mask=m_sv, other=0.0)
                b_wk = tl.load(wk + srow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0)
                b_w = b_u - tl.dot(b_wk, tl.trans(h), input_precision=PRECISION)
            else:
                b_v = tl.load(v + srow[:, None] * V + o_v[None, :], mask=m_sv, other=0.0).to(tl.float32)
                b_w = tl.load(beta + srow, mask=m_s, other=0.0).to(tl.float32)[:, None] * b_v
            tl.store(w_out + srow[:, None] * V + o_v[None, :], b_w, mask=m_sv)
            if CHANNEL:
                b_gs = tl.load(g + trow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0)
            else:
                b_gs = tl.load(g + trow, mask=m_s, other=0.0)
            last, g_last = _last_gate(g, bos, i_t, i_h, T, H, K, C, BT, o_k, m_k, CHANNEL)
            if CHANNEL:
                b_xd = b_x * tl.exp(tl.where(m_sk, g_last[None, :] - b_gs, 0.0))
                h = h * tl.exp(g_last)[None, :] + tl.dot(tl.trans(b_w), b_xd, input_precision=PRECISION)
            else:
                decay = tl.exp(tl.where(m_s, g_last - b_gs, 0.0))
                h = h * tl.exp(g_last) + tl.dot(tl.trans(b_w * decay[:, None]), b_x, input_precision=PRECISION)
        tl.store(ht + i_bh.to(tl.int64) * V * K + h_offs, h, mask=m_h)

    @triton.jit
    def dh_sweep(q, k, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT, H: tl.constexpr,
                  IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                  BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                  HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, IS_L2: tl.constexpr, READ_TOKEN: tl.constexpr,
                  CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Backward reverse sweep over chunks (value block × sequence × head), C = 1 and window, both decays.
        dS = ∂L/∂S_L of each chunk's end (stored, ``dhs [NC, H, V, K]``; from ``dht``):
        dw = Pᵀ do + e^{g_L − g_τ} ⊙ (x dSᵀ) (per head) or Pᵀ do + (x ⊙ e^{g_L − g_τ}) dSᵀ (channel-wise) on the
        write rows (k: the tokens' keys, or the window slots for C > 1), P the intra-chunk read (causal
        e^{gq_t − g_τr} q_t·x_r, or Σ_c q_tc x_rc e^{gq_tc − g_τr,c}); dS ← e^{g_L} dS + (e^{gq} ⊙ do)ᵀ q (per head)
        or dS Diag(e^{g_L}) + doᵀ (q ⊙ e^{gq}) (channel-wise), − dwᵀ w_k for l2; the last dS is the initial state's
        gradient (``dh0 [N, H, V, K]``). The loop is written out without nested helpers (their inlined debug scopes put
        labels in the PTX that can shift ptxas' register allocation); the loads keep each variant's order of masks."""
        i_bh, i_h, bos, T, NT, boc, o_i, o_s, tau, o_k, o_v, m_k, m_v, m_h, h_offs = _sweep_program(
            cu_seqlens, chunk_offsets, T, NT, H, K, V, C, BT, BS, BK, BV, IS_VARLEN)
        dh = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_DHT:
            dh += tl.load(dht + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for j in range(0, NT):
            i_t = NT - 1 - j
            # ∂L/∂(end state of chunk i_t), [NC, H, V, K]
            tl.store(dhs + ((boc + i_t) * H + i_h) * V * K + h_offs, dh, mask=m_h)
            o_t = i_t * BT + o_i
            m_t = o_t < T
            rows = (bos + o_t) * H + i_h
            if C == 1:
                m_s = m_t
                srow = rows
                trow = rows
                m_sk = m_t[:, None] & m_k[None, :]
                m_tv = m_t[:, None] & m_v[None, :]
                b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_sk, other=0.0).to(tl.float32)
                b_x = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_sk, other=0.0).to(tl.float32)
                b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            else:
                tok = i_t * BT + tau
                m_s = (o_s < BT * C) & (tok < T)
                srow = ((bos + i_t * BT) * C + o_s) * H + i_h
                trow = (bos + tok) * H + i_h
                m_sk = m_s[:, None] & m_k[None, :]
                if CHANNEL:
                    m_tk = m_t[:, None] & m_k[None, :]
                    b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
                else:
                    b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                                  other=0.0).to(tl.float32)
                b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                               other=0.0).to(tl.float32)
                b_x = tl.load(k + srow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0).to(tl.float32)
            if CHANNEL:
                b_g = tl.load(g + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
                if C == 1:
                    b_gs = b_g
                else:
                    b_gs = tl.load(g + trow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0)
            else:
                b_g = tl.load(g + rows, mask=m_t, other=0.0)
                if C == 1:
                    b_gs = b_g
                else:
                    b_gs = tl.load(g + trow, mask=m_s, other=0.0)
            last, g_last = _last_gate(g, bos, i_t, i_h, T, H, K, C, BT, o_k, m_k, CHANNEL)
            if READ_TOKEN:
                b_gq = b_g
            elif CHANNEL:
                b_gq = b_g - tl.load(la + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                                     other=0.0).to(tl.float32)
            elif HAS_ALPHA:
                b_gq = b_g - tl.load(la + rows, mask=m_t, other=0.0).to(tl.float32)
            else:
                b_gq = b_g
            if CHANNEL:
                if C == 1:
                    P = _decayed_dot(b_q, b_x, b_gq, b_g, o_i, BT, not READ_TOKEN)
                else:
                    P = _slot_decayed_dot(b_q, b_gq, m_t, o_i, b_x, b_g, o_i, o_s, BT, BT, BS, C, not READ_TOKEN)
                b_xd = b_x * tl.exp(tl.where(m_sk, g_last[None, :] - b_gs, 0.0))
                b_dw = tl.dot(tl.trans(P), b_do, input_precision=PRECISION) \
                    + tl.dot(b_xd, tl.trans(dh), input_precision=PRECISION)
            else:
                if C == 1:   # (the read mask's comparison written as each family always had it)
                    if READ_TOKEN:
                        causal = (o_i[:, None] >= o_i[None, :]) & m_t[None, :]
                    else:
                        causal = (o_i[:, None] > o_i[None, :]) & m_t[None, :]
                else:
                    if READ_TOKEN:
                        causal = (tau[None, :] <= o_i[:, None]) & m_s[None, :]
                    else:
                        causal = (tau[None, :] < o_i[:, None]) & m_s[None, :]
                qx = tl.dot(b_q, tl.trans(b_x), input_precision=PRECISION)
                P = tl.where(causal, qx * _masked_decay(b_gq, b_gs, causal), 0.0)
                decay = tl.exp(tl.where(m_s, g_last - b_gs, 0.0))
                b_dw = tl.dot(tl.trans(P), b_do, input_precision=PRECISION) \
                    + decay[:, None] * tl.dot(b_x, tl.trans(dh), input_precision=PRECISION)
            tl.store(dw + srow[:, None] * V + o_v[None, :], b_dw, mask=m_s[:, None] & m_v[None, :])
            if CHANNEL:
                dh = dh * tl.exp(g_last)[None, :] \
                    + tl.dot(tl.trans(b_do), b_q * tl.exp(b_gq), input_precision=PRECISION)
            else:
                dh = dh * tl.exp(g_last) \
                    + tl.dot(tl.trans(b_do * tl.exp(b_gq)[:, None]), b_q, input_precision=PRECISION)
            if IS_L2:
                b_wk = tl.load(wk + srow[:, None] * K + o_k[None, :], mask=m_sk, other=0.0)
                dh -= tl.dot(tl.trans(b_dw), b_wk, input_precision=PRECISION)
        if HAS_H0:
            tl.store(dh0 + i_bh.to(tl.int64) * V * K + h_offs, dh, mask=m_h)
