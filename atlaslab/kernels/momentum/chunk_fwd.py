"""The momentum chunk op's forward kernels (:mod:`atlaslab.kernels.momentum.chunk` launches them): the coefficient
kernel (stage 1: P, Θ, Q, A and the chunk-end rows, per head or channel-wise), the state sweep (stage 2) and the
output (stage 3) of the TTT / Titans dual form per chunk (docs/kernels.md#momentum).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:
    from atlaslab.kernels.common.index import chunk_program, chunk_span, sweep_span, state_block

    @triton.jit
    def _mom_coef_kernel(q, k, beta, lth, la, p_out, qc_out, th_out, aend_out, send_out, aq_out, a_out,
                         cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, HAS_ALPHA: tl.constexpr, READ_TOKEN: tl.constexpr,
                         STORE_A: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1, per chunk (program: global chunk × head): P, Θ, Q = D_α Θ, A = −D_α D_θ diag(β),
        a_end = A[L, :], s_end = −D_θ[L, :] β as ``[B, T, H]`` rows, and (read token) A ⊙ (q kᵀ) as rows
        ``[B, T, H, BT]``."""
        i_c = tl.program_id(0)            # all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        b_gt = tl.cumsum(tl.load(lth + rows, mask=m_t, other=0.0).to(tl.float32), axis=0)
        if HAS_ALPHA:
            b_ga = tl.cumsum(tl.load(la + rows, mask=m_t, other=0.0).to(tl.float32), axis=0)
        else:
            b_ga = tl.zeros([BT], dtype=tl.float32)
        causal = o_i[:, None] >= o_i[None, :]
        D_a = tl.where(causal, tl.exp(tl.where(causal, b_ga[:, None] - b_ga[None, :], 0.0)), 0.0)
        D_t = tl.where(causal, tl.exp(tl.where(causal, b_gt[:, None] - b_gt[None, :], 0.0)), 0.0)
        A = -tl.dot(D_a, D_t * b_beta[None, :], input_precision=PRECISION)
        b_th = tl.exp(b_gt)
        b_qc = tl.sum(D_a * b_th[None, :], axis=1)
        last = tl.minimum(T - i_t * b, b) - 1
        sel = o_i == last
        a_end = tl.sum(tl.where(sel[:, None], A, 0.0), axis=0)
        s_end = -tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0) * b_beta
        tl.store(p_out + rows, tl.exp(b_ga), mask=m_t)
        tl.store(qc_out + rows, b_qc, mask=m_t)
        tl.store(th_out + rows, b_th, mask=m_t)
        tl.store(aend_out + rows, a_end, mask=m_t)
        tl.store(send_out + rows, s_end, mask=m_t)
        if STORE_A:     # A's rows, [B, T, H, BT], for the backward
            tl.store(a_out + rows[:, None] * BT + o_i[None, :], A, mask=m_t[:, None])
        if READ_TOKEN:
            o_k = tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
            tl.store(aq_out + rows[:, None] * BT + o_i[None, :], A * qk, mask=m_t[:, None])

    @triton.jit
    def _cw_rows(x, s, o_i):
        """x[s] of a [BT] vector (s a runtime index)."""
        return tl.sum(tl.where(o_i == s, x, 0.0), axis=0)

    @triton.jit
    def _cw_theta_row(b_gt, s, o_i):
        """Row s of D_θ: [D_θ[s, i]]_i = e^{gt_s − gt_i} for i ≤ s, else 0 (exponent ≤ 0), and Θ_s = e^{gt_s}."""
        gt_s = _cw_rows(b_gt, s, o_i)
        return tl.where(o_i <= s, tl.exp(tl.minimum(gt_s - b_gt, 0.0)), 0.0), tl.exp(gt_s)

    @triton.jit
    def _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K: tl.constexpr, PRECISION: tl.constexpr):
        """The channel-wise chunk coefficients both the forward and the backward form in registers: β, g_θ (cumsum
        of log θ), g (cumsum of log α, [BT, BK]), D_θ, E[r, c] = D_α[L, r, c] = e^{g_Lc − g_rc} (r ≤ L, else 0;
        exponent ≤ 0), C_L = D_θᵀ E (C at the chunk's last row) and the one-hot row L."""
        b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        b_gt = tl.cumsum(tl.load(lth + rows, mask=m_t, other=0.0), axis=0)
        b_g = tl.cumsum(tl.load(la + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0), axis=0)
        causal = o_i[:, None] >= o_i[None, :]
        D_t = tl.where(causal, tl.exp(tl.minimum(tl.where(causal, b_gt[:, None] - b_gt[None, :], 0.0), 0.0)), 0.0)
        sel = o_i == n - 1
        g_l = tl.sum(tl.where(sel[:, None], b_g, 0.0), axis=0)
        E = tl.where(m_tk, tl.exp(tl.minimum(g_l[None, :] - b_g, 0.0)), 0.0)
        C_l = tl.dot(tl.trans(D_t), E, input_precision=PRECISION)
        return b_beta, b_gt, b_g, D_t, E, C_l, sel

    @triton.jit
    def _mom_cw_coef_kernel(q, k, beta, lth, la, p_out, qc_out, th_out, aend_out, send_out, aq_out,
                            cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Stage 1, channel-wise (program: global chunk × head): P = e^g, Θ, s_end = −β D_θ[L, :] as before;
        a_end = −β ⊙ C_L ``[B, T, H, K]`` by one ``tl.dot``; then a loop over the chunk's rows s carries
        C_s = C_{s−1} Diag(α_s) + D_θ[s, :] ⊗ 1 ([BT, BK]; every factor ≤ 1) and Q_s = α_s ⊙ Q_{s−1} + Θ_s,
        storing Q ``[B, T, H, K]`` and (read token) the read row W[s, :] = −β ⊙ ((C_s ⊙ k) q_s) ``[B, T, H, BT]``."""
        i_c, i_h, i_t, bos, T, o_i, o_k, m_k = chunk_program(cu_seqlens, chunk_indices, T, NT, K, BT, BK, IS_VARLEN)
        n = tl.minimum(T - i_t * b, b)                    # real tokens of this chunk (L = n − 1)
        m_t = o_i < n
        rows = (bos + i_t * b + o_i) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        b_beta, b_gt, b_g, D_t, E, C_l, sel = _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K,
                                                             PRECISION)
        tl.store(p_out + rows[:, None] * K + o_k[None, :], tl.exp(b_g), mask=m_tk)
        tl.store(th_out + rows, tl.exp(b_gt), mask=m_t)
        tl.store(send_out + rows, -tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0) * b_beta, mask=m_t)
        tl.store(aend_out + rows[:, None] * K + o_k[None, :], -b_beta[:, None] * C_l, mask=m_tk)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_C = tl.zeros([BT, BK], dtype=tl.float32)
        b_Q = tl.zeros([BK], dtype=tl.float32)
        for s in range(0, n):
            row = (bos + i_t * b + s) * H + i_h
            b_a = tl.exp(tl.load(la + row * K + o_k, mask=m_k, other=0.0))       # α_s
            d_row, th_s = _cw_theta_row(b_gt, s, o_i)
            b_C = b_C * b_a[None, :] + d_row[:, None]
            b_Q = b_Q * b_a + th_s
            tl.store(qc_out + row * K + o_k, b_Q, mask=m_k)
            if READ_TOKEN:
                b_qs = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                tl.store(aq_out + row * BT + o_i, -b_beta * tl.sum(b_C * b_k * b_qs[None, :], axis=1),
                         mask=o_i < BT)

    @triton.jit
    def _mom_state_kernel(k, v, p, qc, th, aend, send, m0, s0, e_out, hm, hs, mt, st, cu_seqlens, chunk_offsets,
                          T, b, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Stage 2, sequential over one sequence's chunks (program: value block × sequence·head): store (M_a, S_a)
        ``[NC, H, V, K]``, e = k M_aᵀ − v (ℓ2; before_step: P ⊙ (k M_aᵀ) − v) or −v (dot), then
        M ← P_L M + Q_L S + (a_end ⊙ e)ᵀ k and S ← Θ_L S + (s_end ⊙ e)ᵀ k; the last (M, S) → ``mt, st [N, H, V, K]``.
        ``CHANNEL`` (p, qc, aend ``[B, T, H, K]``): e = (k ⊙ P) M_aᵀ − v (before_step),
        M ← M Diag(P_L) + S Diag(Q_L) + eᵀ (k ⊙ a_end)."""
        i_v, i_bh, i_h, bos, T, NT, boc = sweep_span(cu_seqlens, chunk_offsets, T, NT, H, BT, IS_VARLEN)
        NT = (T + b - 1) // b             # chunks of b tokens (the helper counts BT-token ones)
        o_i = tl.arange(0, BT)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        b_M = tl.load(m0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        b_S = tl.load(s0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for i_t in range(0, NT):
            h_base = ((boc + i_t) * H + i_h) * V * K
            tl.store(hm + h_base + h_offs, b_M, mask=m_h)
            tl.store(hs + h_base + h_offs, b_S, mask=m_h)
            o_t = i_t * b + o_i
            m_t = (o_i < b) & (o_t < T)
            rows = (bos + o_t) * H + i_h
            m_tv = m_t[:, None] & m_v[None, :]
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            last = tl.minimum(T - i_t * b, b) - 1
            r_last = (bos + i_t * b + last) * H + i_h
            if CHANNEL:
                m_tk = m_t[:, None] & m_k[None, :]
                if IS_L2:
                    if BEFORE:  # the gradient at M_a Diag(P_s): e_s = M_a (P_s ⊙ k_s) − v_s
                        b_kp = b_k * tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                    else:
                        b_kp = b_k
                    b_e = tl.dot(b_kp, tl.trans(b_M), input_precision=PRECISION) - b_v
                else:
                    b_e = -b_v
                tl.store(e_out + rows[:, None] * V + o_v[None, :], b_e, mask=m_tv)
                # M ← M Diag(P_L) + S Diag(Q_L) + eᵀ (k ⊙ a_end)
                p_l = tl.load(p + r_last * K + o_k, mask=m_k, other=0.0)
                q_l = tl.load(qc + r_last * K + o_k, mask=m_k, other=0.0)
                t_l = tl.load(th + r_last)
                b_ka = b_k * tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_se = tl.load(send + rows, mask=m_t, other=0.0)
                new_M = b_M * p_l[None, :] + b_S * q_l[None, :] \
                    + tl.dot(tl.trans(b_e), b_ka, input_precision=PRECISION)
                b_S = t_l * b_S + tl.dot(tl.trans(b_e * b_se[:, None]), b_k, input_precision=PRECISION)
            else:
                if IS_L2:
                    b_e = tl.dot(b_k, tl.trans(b_M), input_precision=PRECISION)
                    if BEFORE:      # the gradient at the decayed anchor P_s M_a
                        b_pe = tl.load(p + rows, mask=m_t, other=0.0)
                        b_e = b_pe[:, None] * b_e
                    b_e = b_e - b_v
                else:
                    b_e = -b_v
                tl.store(e_out + rows[:, None] * V + o_v[None, :], b_e, mask=m_tv)
                p_l = tl.load(p + r_last)
                q_l = tl.load(qc + r_last)
                t_l = tl.load(th + r_last)
                b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
                b_se = tl.load(send + rows, mask=m_t, other=0.0)
                new_M = p_l * b_M + q_l * b_S + tl.dot(tl.trans(b_e * b_ae[:, None]), b_k,
                                                       input_precision=PRECISION)
                b_S = t_l * b_S + tl.dot(tl.trans(b_e * b_se[:, None]), b_k, input_precision=PRECISION)
            b_M = new_M
        tl.store(mt + i_bh.to(tl.int64) * V * K + h_offs, b_M, mask=m_h)
        tl.store(st + i_bh.to(tl.int64) * V * K + h_offs, b_S, mask=m_h)

    @triton.jit
    def _mom_out_kernel(q, p, qc, aq, e, hm, hs, o, cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                        CHANNEL: tl.constexpr = False):
        """Stage 3, per chunk (value block × global chunk × head): y = P ⊙ (q M_aᵀ) + Q ⊙ (q S_aᵀ) + (A ⊙ q kᵀ) e
        (read token); q M_aᵀ (read chunk). ``CHANNEL``: y = (q ⊙ P) M_aᵀ + (q ⊙ Q) S_aᵀ + W e (``aq`` holds W)."""
        i_v = tl.program_id(0)
        i_c = tl.program_id(1)
        i_h = tl.program_id(2)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        h_offs = (i_c.to(tl.int64) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :]   # the chunk's (M_a, S_a)
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_M = tl.load(hm + h_offs, mask=m_h, other=0.0)
        if CHANNEL:
            if READ_TOKEN:
                m_tk = m_t[:, None] & m_k[None, :]
                b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
                b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
                b_o = tl.dot(b_q * b_p, tl.trans(b_M), input_precision=PRECISION) \
                    + tl.dot(b_q * b_qc, tl.trans(b_S), input_precision=PRECISION) \
                    + tl.dot(b_aq, b_e, input_precision=PRECISION)
            else:
                b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
        else:
            b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
            if READ_TOKEN:
                b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
                b_p = tl.load(p + rows, mask=m_t, other=0.0)
                b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
                b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
                b_o = b_p[:, None] * b_o + b_qc[:, None] * tl.dot(b_q, tl.trans(b_S), input_precision=PRECISION) \
                    + tl.dot(b_aq, b_e, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
