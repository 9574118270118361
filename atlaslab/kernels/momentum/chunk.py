"""Chunk-parallel Triton forward and backward of a linear memory trained by momentum GD at semantic chunk size
2 ≤ b ≤ 64 (Titans with a matrix memory), per-head or channel-wise decay, either placement, ``cu_seqlens`` natively.

The TTT / Titans dual form per chunk (:func:`.naive.momentum_chunk_reference`; docs/kernels.md#momentum): the
coefficient kernel (P, Θ, Q, A and the chunk-end rows; ``_mom_cw_coef_kernel`` channel-wise), the state sweep
and the output, as the delta rule's stages. The backward re-runs stages 1–2, sweeps the chunks in reverse for the
state gradients, forms dq, dk, dv and the coefficients' gradients per chunk, and maps those to the gates by
autograd through :func:`chunk_coefficients` (channel-wise: ``_mom_cw_gate_kernel`` in the same loops, since the
momentum coefficient there is a double sum that would overflow if factored). ``BACKWARD = "torch"``
(``ATLASLAB_MOMENTUM_BACKWARD=torch``) runs autograd through the reference instead.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.momentum.naive import MAX_D, check_args, momentum_chunk_reference
from atlaslab.kernels.utils import (ChunkLayout, dot_precision, log_gate, pow2, prepare_chunk_indices,
                                    reference_backward, with_torch_fallback)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from atlaslab.kernels.delta_rule.chunk import chunk_span, sequence_span

#: largest semantic chunk b the kernels take (the coefficient kernel holds [b, b] blocks in registers)
MAX_CHUNK = 64
#: largest b the dispatch gives the kernels with channel-wise decay: at b = 64 and D_k = 128 the channel-wise state
#: sweeps ask for more shared memory than an sm_90 block has (up to 409 KiB fp32 / 313 KiB fp16 in
#: ``_mom_bwd_state_kernel``); every build at b ≤ 32 fits (``bench/compile_sm90.py``)
MAX_CHANNEL_CHUNK = 32


# ------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:

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
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
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
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        NT = (T + b - 1) // b             # chunks of b tokens (the helper counts BT-token ones)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
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
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        h_offs = (i_c.to(tl.int64) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :]
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

    @triton.jit
    def _mom_bwd_state_kernel(q, k, do, aq, p, qc, th, aend, send, dmt, dst, dma, de_out, dhm, dhs, dm0, ds0,
                              cu_seqlens, chunk_offsets, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                              HAS_DMT: tl.constexpr, HAS_DST: tl.constexpr, HAS_DMA: tl.constexpr,
                              IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Backward stage 2, reverse over one sequence's chunks (value block × sequence·head). dM, dS = ∂L/∂(chunk-end
        M, S): dE = (A ⊙ q kᵀ)ᵀ dO + a_end ⊙ (k dMᵀ) + s_end ⊙ (k dSᵀ);
        dM ← P_L dM + (P ⊙ dO)ᵀ q + [ℓ2] dEᵀ k (before_step: (P ⊙ dE)ᵀ k)   (read chunk: dOᵀ q);
        dS ← Q_L dM + Θ_L dS + (Q ⊙ dO)ᵀ q.  ``CHANNEL``: dE = Wᵀ dO + (k ⊙ a_end) dMᵀ + s_end ⊙ (k dSᵀ);
        dM ← dM Diag(P_L) + dOᵀ (q ⊙ P) + [ℓ2] dEᵀ (k [⊙ P, before_step]);  dS ← dM Diag(Q_L) + Θ_L dS + dOᵀ (q ⊙ Q)."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        NT = (T + b - 1) // b
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        b_dM = tl.zeros([BV, BK], dtype=tl.float32)
        b_dS = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_DMT:
            b_dM += tl.load(dmt + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        if HAS_DST:
            b_dS += tl.load(dst + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for j in range(0, NT):
            i_t = NT - 1 - j
            h_base = ((boc + i_t) * H + i_h) * V * K
            tl.store(dhm + h_base + h_offs, b_dM, mask=m_h)
            tl.store(dhs + h_base + h_offs, b_dS, mask=m_h)
            o_t = i_t * b + o_i
            m_t = (o_i < b) & (o_t < T)
            rows = (bos + o_t) * H + i_h
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_se = tl.load(send + rows, mask=m_t, other=0.0)
            last = tl.minimum(T - i_t * b, b) - 1
            r_last = (bos + i_t * b + last) * H + i_h
            t_l = tl.load(th + r_last)
            if CHANNEL:
                b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                p_l = tl.load(p + r_last * K + o_k, mask=m_k, other=0.0)
                q_l = tl.load(qc + r_last * K + o_k, mask=m_k, other=0.0)
                b_ka = b_k * tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_de = tl.dot(b_ka, tl.trans(b_dM), input_precision=PRECISION) \
                    + b_se[:, None] * tl.dot(b_k, tl.trans(b_dS), input_precision=PRECISION)
                if READ_TOKEN:
                    b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                    b_de += tl.dot(tl.trans(b_aq), b_do, input_precision=PRECISION)
                    b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                    new_dM = b_dM * p_l[None, :] + tl.dot(tl.trans(b_do), b_q * b_p, input_precision=PRECISION)
                    b_dS = b_dM * q_l[None, :] + t_l * b_dS \
                        + tl.dot(tl.trans(b_do), b_q * b_qc, input_precision=PRECISION)
                else:
                    new_dM = b_dM * p_l[None, :] + tl.dot(tl.trans(b_do), b_q, input_precision=PRECISION)
                    b_dS = b_dM * q_l[None, :] + t_l * b_dS
                if IS_L2:
                    if BEFORE:  # ∂e_s / ∂M_a = (P_s ⊙ k_s)ᵀ
                        new_dM += tl.dot(tl.trans(b_de), b_k * b_p, input_precision=PRECISION)
                    else:
                        new_dM += tl.dot(tl.trans(b_de), b_k, input_precision=PRECISION)
            else:
                b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
                b_p = tl.load(p + rows, mask=m_t, other=0.0)
                p_l = tl.load(p + r_last)
                q_l = tl.load(qc + r_last)
                b_de = b_ae[:, None] * tl.dot(b_k, tl.trans(b_dM), input_precision=PRECISION) \
                    + b_se[:, None] * tl.dot(b_k, tl.trans(b_dS), input_precision=PRECISION)
                if READ_TOKEN:
                    b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                    b_de += tl.dot(tl.trans(b_aq), b_do, input_precision=PRECISION)
                    b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
                    new_dM = p_l * b_dM + tl.dot(tl.trans(b_do * b_p[:, None]), b_q, input_precision=PRECISION)
                    b_dS = q_l * b_dM + t_l * b_dS \
                        + tl.dot(tl.trans(b_do * b_qc[:, None]), b_q, input_precision=PRECISION)
                else:
                    new_dM = p_l * b_dM + tl.dot(tl.trans(b_do), b_q, input_precision=PRECISION)
                    b_dS = q_l * b_dM + t_l * b_dS
                if IS_L2:
                    if BEFORE:      # ∂e_s / ∂M_a = P_s k_sᵀ
                        new_dM += tl.dot(tl.trans(b_de * b_p[:, None]), b_k, input_precision=PRECISION)
                    else:
                        new_dM += tl.dot(tl.trans(b_de), b_k, input_precision=PRECISION)
            b_dM = new_dM
            tl.store(de_out + rows[:, None] * V + o_v[None, :], b_de, mask=m_tv)
            if HAS_DMA:         # the anchor output is the start state of the last chunk
                if j == 0:
                    b_dM += tl.load(dma + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        tl.store(dm0 + i_bh.to(tl.int64) * V * K + h_offs, b_dM, mask=m_h)
        tl.store(ds0 + i_bh.to(tl.int64) * V * K + h_offs, b_dS, mask=m_h)

    @triton.jit
    def _mom_bwd_grad_kernel(q, k, do, a, p, qc, aend, send, e, de, hm, hs, dhm, dhs, dq, dk, dv, dp, dqc, dth,
                             dae, dse, da, cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                             IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Backward stage 3, per global chunk × head (a loop over value blocks), from M_a, S_a (chunk start) and
        dM, dS (chunk end): G = dO eᵀ; dq = P ⊙ (dO M_a) + Q ⊙ (dO S_a) + (G ⊙ A) k (read chunk: dO M_a);
        dk = (G ⊙ A)ᵀ q + [ℓ2] dE M_a (before_step: P ⊙ (dE M_a)) + a_end ⊙ (e dM) + s_end ⊙ (e dS); dv = −dE; and
        the coefficients' grads dP = rowsum(dO ⊙ q M_aᵀ) (+⟨dM, M_a⟩ at L; before_step: + rowsum(k ⊙ dE M_a)),
        dQ = rowsum(dO ⊙ q S_aᵀ) (+⟨dM, S_a⟩ at L), dΘ = ⟨dS, S_a⟩ at L, d a_end = rowsum(k ⊙ e dM),
        d s_end = rowsum(k ⊙ e dS), dA = G ⊙ q kᵀ (read token).  ``CHANNEL`` (P, Q, a_end and their gradients
        ``[B, T, H, K]``): dq = P ⊙ (dO M_a) + Q ⊙ (dO S_a), dk = [ℓ2] (c ⊙) dE M_a + a_end ⊙ (e dM) + s_end ⊙ (e dS)
        (the intra-chunk W terms are added by ``_mom_cw_gate_kernel``), dP = q ⊙ (dO M_a) (+ Σ_v dM ⊙ M_a at L;
        before_step: + k ⊙ (dE M_a)), dQ = q ⊙ (dO S_a) (+ Σ_v dM ⊙ S_a at L), d a_end = k ⊙ (e dM), and G itself
        into ``da``."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if CHANNEL:     # per key channel: [BT, BK] coefficients and gradients
            b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_ae = tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_p = tl.load(p + rows, mask=m_t, other=0.0)
            b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
            b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
        b_se = tl.load(send + rows, mask=m_t, other=0.0)
        last = tl.minimum(T - i_t * b, b) - 1
        h_base = (i_c.to(tl.int64) * H + i_h) * V * K
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_G = tl.zeros([BT, BT], dtype=tl.float32)
        if CHANNEL:
            b_dp = tl.zeros([BT, BK], dtype=tl.float32)
            b_dqc = tl.zeros([BT, BK], dtype=tl.float32)
            b_dae = tl.zeros([BT, BK], dtype=tl.float32)
        else:
            b_dp = tl.zeros([BT], dtype=tl.float32)
            b_dqc = tl.zeros([BT], dtype=tl.float32)
            b_dae = tl.zeros([BT], dtype=tl.float32)
        b_dse = tl.zeros([BT], dtype=tl.float32)
        b_mm = tl.zeros([BV, BK], dtype=tl.float32)        # dM ⊙ M_a, dM ⊙ S_a, dS ⊙ S_a: summed at the end
        b_ms = tl.zeros([BV, BK], dtype=tl.float32)
        b_ss = tl.zeros([BV, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_h = m_v[:, None] & m_k[None, :]
            h_offs = h_base + o_v[:, None] * K + o_k[None, :]
            b_M = tl.load(hm + h_offs, mask=m_h, other=0.0)
            b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
            b_dM = tl.load(dhm + h_offs, mask=m_h, other=0.0)
            b_dS = tl.load(dhs + h_offs, mask=m_h, other=0.0)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            b_de = tl.load(de + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            tl.store(dv + rows[:, None] * V + o_v[None, :], (-b_de).to(dv.dtype.element_ty), mask=m_tv)
            b_doM = tl.dot(b_do, b_M, input_precision=PRECISION)
            if READ_TOKEN:
                b_doS = tl.dot(b_do, b_S, input_precision=PRECISION)
                if CHANNEL:
                    b_dq += b_p * b_doM + b_qc * b_doS
                    b_dp += b_q * b_doM
                    b_dqc += b_q * b_doS
                else:
                    b_dq += b_p[:, None] * b_doM + b_qc[:, None] * b_doS
                    b_dp += tl.sum(b_q * b_doM, axis=1)
                    b_dqc += tl.sum(b_q * b_doS, axis=1)
                b_G += tl.dot(b_do, tl.trans(b_e), input_precision=PRECISION)
            else:
                b_dq += b_doM
            if IS_L2:
                b_deM = tl.dot(b_de, b_M, input_precision=PRECISION)
                if BEFORE:      # e_s = P_s M_a k_s − v_s: dk_s = P_s M_aᵀ dE_s, dP_s += dE_s · M_a k_s
                    if CHANNEL:     # e_s = M_a (P_s ⊙ k_s) − v_s
                        b_dk += b_p * b_deM
                        b_dp += b_k * b_deM
                    else:
                        b_dk += b_p[:, None] * b_deM
                        b_dp += tl.sum(b_k * b_deM, axis=1)
                else:
                    b_dk += b_deM
            b_eM = tl.dot(b_e, b_dM, input_precision=PRECISION)
            b_eS = tl.dot(b_e, b_dS, input_precision=PRECISION)
            if CHANNEL:
                b_dk += b_ae * b_eM + b_se[:, None] * b_eS
                b_dae += b_k * b_eM
            else:
                b_dk += b_ae[:, None] * b_eM + b_se[:, None] * b_eS
                b_dae += tl.sum(b_k * b_eM, axis=1)
            b_dse += tl.sum(b_k * b_eS, axis=1)
            b_mm += b_dM * b_M
            b_ms += b_dM * b_S
            b_ss += b_dS * b_S
        if READ_TOKEN:
            if CHANNEL:     # the W terms need the per-channel C_s: the gate kernel takes G from here
                tl.store(da + rows[:, None] * BT + o_i[None, :], b_G, mask=m_t[:, None])
            else:
                b_A = tl.load(a + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_W = b_G * b_A
                b_dq += tl.dot(b_W, b_k, input_precision=PRECISION)
                b_dk += tl.dot(tl.trans(b_W), b_q, input_precision=PRECISION)
                causal = (o_i[:, None] >= o_i[None, :]) & m_t[None, :]
                qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
                tl.store(da + rows[:, None] * BT + o_i[None, :], tl.where(causal, b_G * qk, 0.0),
                         mask=m_t[:, None])
        sel = o_i == last
        if CHANNEL:     # Σ_v dM ⊙ M_a, Σ_v dM ⊙ S_a per key channel
            b_dp += tl.where(sel[:, None], tl.sum(b_mm, axis=0)[None, :], 0.0)
            b_dqc += tl.where(sel[:, None], tl.sum(b_ms, axis=0)[None, :], 0.0)
        else:
            b_dp += tl.where(sel, tl.sum(tl.sum(b_mm, axis=1), axis=0), 0.0)
            b_dqc += tl.where(sel, tl.sum(tl.sum(b_ms, axis=1), axis=0), 0.0)
        b_dth = tl.where(sel, tl.sum(tl.sum(b_ss, axis=1), axis=0), 0.0)
        tl.store(dq + rows[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + rows[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if CHANNEL:
            tl.store(dp + rows[:, None] * K + o_k[None, :], b_dp, mask=m_tk)
            tl.store(dqc + rows[:, None] * K + o_k[None, :], b_dqc, mask=m_tk)
        else:
            tl.store(dp + rows, b_dp, mask=m_t)
            tl.store(dqc + rows, b_dqc, mask=m_t)
        tl.store(dth + rows, b_dth, mask=m_t)
        if CHANNEL:
            tl.store(dae + rows[:, None] * K + o_k[None, :], b_dae, mask=m_tk)
        else:
            tl.store(dae + rows, b_dae, mask=m_t)
        tl.store(dse + rows, b_dse, mask=m_t)

    @triton.jit
    def _mom_cw_gate_kernel(q, k, beta, lth, la, qc, gm, dp, dqc, dth, dae, dse, dq, dk, dbeta, dla, dlth,
                            cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Backward stage 4, channel-wise (program: global chunk × head): from G = dO eᵀ (``gm``, read token) and
        the coefficient gradients dP, dQ, d a_end ``[B, T, H, K]``, dΘ_L, d s_end ``[B, T, H]`` of
        ``_mom_bwd_grad_kernel``, adds the intra-chunk W terms to dq, dk and forms dβ, d log α ``[B, T, H, K]`` and
        d log θ ``[B, T, H]`` (module docstring, "channel-wise backward"): a forward loop over s carrying C_s and a
        reverse loop over r carrying B_r = Â_r + B_{r+1} Diag(α_{r+1}) and R_r = dQ_r + α_{r+1} ⊙ R_{r+1}, then
        reverse cumsums of the log-decay gradients within the chunk."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        n = tl.minimum(T - i_t * b, b)
        m_t = o_i < n
        rows = (bos + i_t * b + o_i) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        t_offs = rows[:, None] * K + o_k[None, :]
        b_beta, b_gt, b_g, D_t, E, C_l, sel = _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K,
                                                             PRECISION)
        b_th = tl.exp(b_gt)
        b_P = tl.where(m_tk, tl.exp(b_g), 0.0)
        b_dae = tl.load(dae + t_offs, mask=m_tk, other=0.0)
        b_dse = tl.load(dse + rows, mask=m_t, other=0.0)
        b_dth = tl.load(dth + rows, mask=m_t, other=0.0)          # dΘ_L at row L, 0 elsewhere
        b_sl = tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0)     # D_θ[L, :]
        b_se = -b_beta * b_sl
        # P_s = e^{g_s}, Q_s (the '+' end of their log-decays), Θ_L = e^{gt_L}, s_end = −β e^{gt_L − gt}
        b_dg = tl.load(dp + t_offs, mask=m_tk, other=0.0) * b_P \
            + tl.load(dqc + t_offs, mask=m_tk, other=0.0) * tl.load(qc + t_offs, mask=m_tk, other=0.0)
        b_dgt = b_dth * b_th + tl.where(sel, tl.sum(b_dse * b_se, axis=0), 0.0) - b_dse * b_se
        b_db = -b_dse * b_sl
        # a_end = −β ⊙ C_L, C_L = D_θᵀ E: Â = −β ⊙ d a_end; X = Â ⊙ C_L; the '−' ends Σ_i D_θ[r, i] Â_i ⊙ E_r
        b_ah = -b_beta[:, None] * b_dae
        b_X = b_ah * C_l
        b_dg += tl.where(sel[:, None], tl.sum(b_X, axis=0)[None, :], 0.0)
        b_dgt -= tl.sum(b_X, axis=1)
        b_db -= tl.sum(b_dae * C_l, axis=1)
        b_Y = E * tl.dot(D_t, b_ah, input_precision=PRECISION)
        b_dg -= b_Y
        b_dgt += tl.sum(b_Y, axis=1)
        b_k = tl.load(k + t_offs, mask=m_tk, other=0.0).to(tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        if READ_TOKEN:      # W[s, i] = −β_i Σ_c C_s[i, c] k_ic q_sc
            b_C = tl.zeros([BT, BK], dtype=tl.float32)
            for s in range(0, n):
                row = (bos + i_t * b + s) * H + i_h
                b_a = tl.exp(tl.load(la + row * K + o_k, mask=m_k, other=0.0))
                d_row, th_s = _cw_theta_row(b_gt, s, o_i)
                b_C = b_C * b_a[None, :] + d_row[:, None]
                b_qs = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_gr = tl.load(gm + row * BT + o_i, mask=o_i <= s, other=0.0)      # G[s, i], i ≤ s
                b_u = -b_beta * b_gr
                b_KC = b_k * b_C
                dq_s = tl.sum(b_u[:, None] * b_KC, axis=0)                       # Σ_i G A[s, i, :] ⊙ k_i
                w_s = tl.sum(b_KC * b_qs[None, :], axis=1)                        # Σ_c C_s k q_s
                b_dk += b_u[:, None] * b_C * b_qs[None, :]
                b_db -= b_gr * w_s
                b_dgt -= b_u * w_s
                b_dg = tl.where((o_i == s)[:, None], b_dg + (b_qs * dq_s)[None, :], b_dg)
                tl.store(dq + row * K + o_k, tl.load(dq + row * K + o_k, mask=m_k, other=0.0) + dq_s, mask=m_k)
        b_B = tl.zeros([BT, BK], dtype=tl.float32)
        b_R = tl.zeros([BK], dtype=tl.float32)
        for j in range(0, n):
            r = n - 1 - j
            row = (bos + i_t * b + r) * H + i_h
            b_an = tl.exp(tl.load(la + (row + H) * K + o_k, mask=m_k & (o_k < K * (n - 1 - r)),
                                    other=0.0))                                 # α_{r+1} (r < L)
            d_row, th_r = _cw_theta_row(b_gt, r, o_i)
            b_R = tl.load(dqc + row * K + o_k, mask=m_k, other=0.0) + b_an * b_R
            dgm = th_r * b_R
            dgt_r = tl.sum(dgm, axis=0)
            if READ_TOKEN:
                b_qr = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_u = -b_beta * tl.load(gm + row * BT + o_i, mask=o_i <= r, other=0.0)
                b_B = b_B * b_an[None, :] + b_u[:, None] * b_k * b_qr[None, :]
                b_YB = d_row[:, None] * b_B
                dgm += tl.sum(b_YB, axis=0)
                dgt_r += tl.sum(tl.sum(b_YB, axis=1), axis=0)
            b_dg = tl.where((o_i == r)[:, None], b_dg - dgm[None, :], b_dg)
            b_dgt = tl.where(o_i == r, b_dgt + dgt_r, b_dgt)
        tl.store(dla + t_offs, tl.cumsum(b_dg, axis=0, reverse=True), mask=m_tk)
        tl.store(dlth + rows, tl.cumsum(b_dgt, axis=0, reverse=True), mask=m_t)
        tl.store(dbeta + rows, b_db, mask=m_t)
        if READ_TOKEN:
            tl.store(dk + t_offs, tl.load(dk + t_offs, mask=m_tk, other=0.0) + b_dk, mask=m_tk)


def _channel(alpha) -> bool:
    """Whether α is channel-wise (``[B, T, H, D_k]``, one kept fraction per key channel)."""
    return alpha is not None and alpha.dim() == 4


def _before(placement: str, alpha, bias: str) -> bool:
    """Whether e carries the before_step factor P (ℓ2 with decay placed before the step)."""
    return placement == "before_step" and alpha is not None and bias == "l2"


def _forward_stages(q, k, v, beta, theta, alpha, m0, s0, *, b: int, bias: str, read: str, prec: str,
                    placement: str = "after_step", cu_seqlens=None, store_a: bool = False) -> dict:
    """Stages 1–2 on contiguous inputs → fp32 ``p, qc, th, aend, send [B, T, H]``, ``aq`` / ``a [B, T, H, BT]``
    (read token / ``store_a``), ``e [B, T, H, V]``, ``hm, hs [NC, H, V, K]`` (chunk-start M, S of every chunk of
    every sequence), ``mt, st [N, H, V, K]`` and the chunk ``layout`` (:class:`atlaslab.kernels.utils.ChunkLayout` over b-token chunks:
    B dense sequences of T tokens, or the packed sequences of ``cu_seqlens``). One launch per stage either way."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BVV = pow2(b), pow2(K), pow2(V)
    # two [BV, BK] fp32 states live in the state kernels; channel-wise, their [BT, BK] coefficient blocks (P, Q,
    # k ⊙ a_end) take the room of half of them (sm_90 shared memory at b = 64, bench/compile_sm90.py)
    BV = min(BVV, max(16, (2048 if _channel(alpha) else 4096) // BK))
    lay = ChunkLayout(B, T, b, cu_seqlens, q)     # the chunk table counts b-token chunks
    lth = log_gate(theta.float()).contiguous()
    la = log_gate(alpha.float()).contiguous() if alpha is not None else None
    f32 = {"dtype": torch.float32, "device": q.device}
    channel = _channel(alpha)
    st = {name: torch.empty(B, T, H, *((K,) if channel and name in ("p", "qc", "aend") else ()), **f32)
          for name in ("p", "qc", "th", "aend", "send")}
    token = read == "token"
    st["aq"] = torch.empty(B, T, H, BT, **f32) if token else None
    st["a"] = torch.empty(B, T, H, BT, **f32) if store_a and not channel else None
    dummy = st["p"]
    if channel:
        _mom_cw_coef_kernel[(lay.NC, H)](q, k, beta, lth, la, st["p"], st["qc"], st["th"], st["aend"], st["send"],
                                         st["aq"] if token else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                         BT=BT, BK=BK, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec,
                                         num_warps=4)
    else:
        _mom_coef_kernel[(lay.NC, H)](q, k, beta, lth, la if la is not None else lth, st["p"], st["qc"], st["th"],
                                      st["aend"], st["send"], st["aq"] if token else dummy,
                                      st["a"] if store_a else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                      BT=BT, BK=BK, HAS_ALPHA=la is not None, READ_TOKEN=token, STORE_A=store_a,
                                      IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
    st["la"], st["lth"] = la, lth
    st["e"] = torch.empty(B, T, H, V, **f32)
    for name in ("hm", "hs"):
        st[name] = torch.empty(lay.NC, H, V, K, **f32)
    for name in ("mt", "st"):
        st[name] = torch.empty(lay.N, H, V, K, **f32)
    _mom_state_kernel[(triton.cdiv(V, BV), lay.N * H)](
        k, v, st["p"], st["qc"], st["th"], st["aend"], st["send"], m0, s0, st["e"], st["hm"], st["hs"], st["mt"],
        st["st"], lay.cu, lay.offsets, T, b, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, IS_L2=bias == "l2",
        BEFORE=_before(placement, alpha, bias), IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4,
        **({"CHANNEL": True} if channel else {}))
    st["sizes"] = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV)
    st["channel"] = {"CHANNEL": True} if channel else {}    # launched only when set: the scalar builds unchanged
    st["layout"] = lay
    return st


def _last_chunks(lay) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per sequence: the global index of its last chunk (the anchor's row of ``hm``), and (varlen) which
    sequences are empty (no chunk: the anchor is the initial memory), else None."""
    if not lay.varlen:
        idx = torch.arange(lay.N, device=lay.cu.device) * lay.NT + lay.NT - 1
        return idx, None
    off = lay.offsets.long()
    empty = off[1:] == off[:-1]
    return (off[1:] - 1).clamp_min(0), (empty if bool(empty.any()) else None)


def _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens):
    check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens)
    K, V, b = q.shape[-1], v.shape[-1], int(chunk_size)
    if max(K, V) > MAX_D or b > MAX_CHUNK or q.shape[1] == 0:
        raise ValueError(f"chunk_momentum (triton): needs D_k, D_v ≤ {MAX_D}, b ≤ {MAX_CHUNK} and T ≥ 1; "
                         f"got D_k = {K}, D_v = {V}, b = {b}, T = {q.shape[1]}")
    return [x.contiguous() if x is not None else None for x in (q, k, v, beta, theta, alpha, m0, s0)]


def chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, *, chunk_size: int, bias: str = "l2",
                           read: str = "token", placement: str = "after_step", cu_seqlens=None,
                           allow_tf32: Optional[bool] = None):
    """The three forward kernels, no autograd; arguments and results as :func:`chunk_momentum`. One launch per
    stage, with or without ``cu_seqlens``."""
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read,
                                                   placement, cu_seqlens)
    T = q.shape[1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens)
    sz, lay = st["sizes"], st["layout"]
    o = torch.empty_like(v)
    token = read == "token"
    _mom_out_kernel[(triton.cdiv(sz["V"], sz["BV"]), lay.NC, sz["H"])](
        q, st["p"], st["qc"], st["aq"] if token else st["p"], st["e"], st["hm"], st["hs"], o, lay.cu, lay.table, T,
        b, lay.NT, **sz, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    idx, empty = _last_chunks(lay)
    anchor = st["hm"][idx]
    if empty is not None:
        anchor = torch.where(empty[:, None, None, None], m0.float(), anchor)
    out_dtype = m0.dtype
    return o, st["mt"].to(out_dtype), st["st"].to(out_dtype), anchor.to(out_dtype)


def _chunk_rows(B: int, T: int, b: int, cu_seqlens, device):
    """Every b-token chunk's token rows in the flattened ``[B·T]`` order: ``rows [NC, b]`` (clamped in range),
    ``valid [NC, b]`` and ``count [NC]`` (real tokens per chunk), chunks in the kernels' order (B dense sequences
    of T tokens, or the packed sequences of ``cu_seqlens``, each chunked from its first token)."""
    cu = (torch.arange(B + 1, device=device) * T if cu_seqlens is None
          else cu_seqlens.to(device=device, dtype=torch.long))
    table, _ = prepare_chunk_indices(cu, b)
    seq, within = table[:, 0].long(), table[:, 1].long()
    start = cu[seq] + within * b
    count = torch.clamp(cu[seq + 1] - start, max=b)
    j = torch.arange(b, device=device)
    valid = j[None, :] < count[:, None]
    rows = (start[:, None] + j[None, :]).clamp(max=B * T - 1)
    return rows, valid, count


def chunk_coefficients(beta: torch.Tensor, theta: torch.Tensor, alpha: Optional[torch.Tensor], chunk_size: int,
                       cu_seqlens: Optional[torch.Tensor] = None):
    """Stage 1 in torch, all chunks at once (differentiable; the backward maps the coefficients' gradients to
    β, θ, α through it): per token ``P, Q, Θ, a_end, s_end: [B, T, H]`` and ``A: [B, T, H, b]`` (row s of its
    chunk's A; a_end / s_end are indexed by the column i, as in the kernels). With ``cu_seqlens`` (B = 1) the
    chunks restart at every sequence start."""
    B, T, H = beta.shape
    b = int(chunk_size)
    rows, valid, count = _chunk_rows(B, T, b, cu_seqlens, beta.device)
    NC = rows.shape[0]

    def chunks(x):      # [B, T, H] → [H, NC, b], padded with 0 (β = 0; log-gate 0 = factor 1)
        x = x.reshape(B * T, H)[rows]                 # [NC, b, H]
        return torch.where(valid.unsqueeze(-1), x, torch.zeros_like(x)).permute(2, 0, 1)

    def tokens(x):      # [H, NC, b, ...] → [B, T, H, ...]
        x = x.movedim(0, 2)                           # [NC, b, H, ...]
        return x[valid].reshape(B, T, H, *x.shape[3:])

    lb = chunks(beta)
    gt = chunks(log_gate(theta)).cumsum(-1)
    ga = chunks(log_gate(alpha)).cumsum(-1) if alpha is not None else torch.zeros_like(gt)
    upper = torch.ones(b, b, dtype=torch.bool, device=beta.device).triu(1)
    D_a = (ga.unsqueeze(-1) - ga.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    D_t = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    P, Th = ga.exp(), gt.exp()
    Q = (D_a @ Th.unsqueeze(-1)).squeeze(-1)
    A = -(D_a @ (D_t * lb.unsqueeze(-2)))
    n = torch.arange(NC, device=beta.device)
    last = count - 1
    a_end = A[:, n, last]                                                       # [H, NC, b]
    s_end = -D_t[:, n, last] * lb
    return tokens(P), tokens(Q), tokens(Th), tokens(a_end), tokens(s_end), tokens(A)


def chunk_momentum_backward(q, k, v, beta, theta, alpha, m0, s0, do, dmt, dst, dma, *, chunk_size: int,
                            bias: str = "l2", read: str = "token", placement: str = "after_step", cu_seqlens=None,
                            allow_tf32: Optional[bool] = None):
    """Gradients of :func:`chunk_momentum_forward` → ``(dq, dk, dv, dβ, dθ, dα, dM_0, dS_0)`` (dα None without α;
    dM_0, dS_0 ``[N, H, D_v, D_k]``).

    Stages 1–2 are re-run (coefficients, e, chunk-start states), ``_mom_bwd_state_kernel`` sweeps the chunks in
    reverse for the chunk-end state gradients and dE, ``_mom_bwd_grad_kernel`` forms dq, dk, dv and the
    coefficients' gradients per chunk in parallel, and autograd through :func:`chunk_coefficients` (torch, no
    memory-sized tensor) maps those to dβ, dθ, dα. With ``cu_seqlens`` every stage is still one launch.
    """
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read,
                                                   placement, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    token = read == "token"
    do = do.contiguous()
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens, store_a=token)
    sz, lay = st["sizes"], st["layout"]
    f32 = {"dtype": torch.float32, "device": q.device}
    dhm, dhs = (torch.empty(lay.NC, H, V, K, **f32) for _ in range(2))
    de = torch.empty(B, T, H, V, **f32)
    dm0, ds0 = (torch.empty(lay.N, H, V, K, **f32) for _ in range(2))
    dummy = st["p"]
    channel = _channel(alpha)
    meta = dict(sz, IS_L2=bias == "l2", BEFORE=_before(placement, alpha, bias), READ_TOKEN=token,
                IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    _mom_bwd_state_kernel[(triton.cdiv(V, sz["BV"]), lay.N * H)](
        q, k, do, st["aq"] if token else dummy, st["p"], st["qc"], st["th"], st["aend"], st["send"],
        *(x.contiguous() if x is not None else dummy for x in (dmt, dst, dma)), de, dhm, dhs, dm0, ds0, lay.cu,
        lay.offsets, T, b, lay.NT, HAS_DMT=dmt is not None, HAS_DST=dst is not None, HAS_DMA=dma is not None,
        **meta)
    if dma is not None:             # an empty sequence's anchor is its initial memory
        _, empty = _last_chunks(lay)
        if empty is not None:
            dm0 = dm0 + torch.where(empty[:, None, None, None], dma.float(), torch.zeros_like(dm0))
    dq = torch.empty(B, T, H, K, **f32)
    dk = torch.empty(B, T, H, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    kc = (K,) if channel else ()
    dp, dqc, dae = (torch.empty(B, T, H, *kc, **f32) for _ in range(3))
    dth, dse = (torch.empty(B, T, H, **f32) for _ in range(2))
    da = torch.empty(B, T, H, sz["BT"], **f32) if token else None       # dA (scalar decay) or G (channel-wise)
    _mom_bwd_grad_kernel[(lay.NC, H)](
        q, k, do, st["a"] if token and not channel else dummy, st["p"], st["qc"], st["aend"], st["send"], st["e"],
        de, st["hm"], st["hs"], dhm, dhs, dq, dk, dv, dp, dqc, dth, dae, dse, da if token else dummy, lay.cu,
        lay.table, T, b, lay.NT, **meta)
    if channel:
        dbeta, dlth = (torch.empty(B, T, H, **f32) for _ in range(2))
        dla = torch.empty(B, T, H, K, **f32)
        _mom_cw_gate_kernel[(lay.NC, H)](
            q, k, beta, st["lth"], st["la"], st["qc"], da if token else dummy, dp, dqc, dth, dae, dse, dq, dk, dbeta,
            dla, dlth, lay.cu, lay.table, T, b, lay.NT, H=H, K=K, BT=sz["BT"], BK=sz["BK"], READ_TOKEN=token,
            IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype),
                _from_log_grad(dlth, theta), _from_log_grad(dla, alpha), dm0.to(m0.dtype), ds0.to(s0.dtype))
    with torch.enable_grad():
        gates = [x.detach().float().requires_grad_(True) if x is not None else None for x in (beta, theta, alpha)]
        coef = chunk_coefficients(*gates, b, cu_seqlens=cu_seqlens)
        grads_out = [dp, dqc, dth, dae, dse] + ([da[..., :b]] if token else [])
        pairs = [(c, g) for c, g in zip(coef, grads_out) if c.requires_grad]   # P is constant without α
        leaves = [g for g in gates if g is not None]
        dgates = torch.autograd.grad([c for c, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    dgates = [torch.zeros_like(g) if d is None else d for g, d in zip(leaves, dgates)]
    dbeta, dtheta = dgates[0].to(beta.dtype), dgates[1].to(theta.dtype)
    dalpha = dgates[2].to(alpha.dtype) if alpha is not None else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta, dtheta, dalpha, dm0.to(m0.dtype),
            ds0.to(s0.dtype))


def _from_log_grad(dlog: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """∂L/∂x from ∂L/∂ log x, with log x = log max(x, tiny) as :func:`atlaslab.kernels.utils.log_gate` (no gradient below tiny)."""
    xf = x.float()
    tiny = torch.finfo(xf.dtype).tiny
    return torch.where(xf >= tiny, dlog / xf.clamp_min(tiny), torch.zeros_like(dlog)).to(x.dtype)


#: Which backward :class:`ChunkMomentumFunction` uses: ``"triton"`` (the backward kernels + autograd through
#: :func:`chunk_coefficients`) or ``"torch"`` (autograd through :func:`momentum_chunk_reference`, recomputed).
#: ``ATLASLAB_MOMENTUM_BACKWARD`` sets the default.
BACKWARD = os.environ.get("ATLASLAB_MOMENTUM_BACKWARD", "triton").strip().lower()


class ChunkMomentumFunction(torch.autograd.Function):
    """Triton forward (:func:`chunk_momentum_forward`); backward on the backward kernels
    (:func:`chunk_momentum_backward`), or, with ``BACKWARD == "torch"``, autograd of
    :func:`momentum_chunk_reference` recomputed (≥ fp32) under ``enable_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens,
                allow_tf32):
        ctx.save_for_backward(q, k, v, beta, theta, alpha, m0, s0)
        ctx.opts = {"chunk_size": chunk_size, "bias": bias, "read": read, "placement": placement,
                    "cu_seqlens": cu_seqlens}
        ctx.allow_tf32 = allow_tf32
        return chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, allow_tf32=allow_tf32, **ctx.opts)

    @staticmethod
    def backward(ctx, do, dmt, dst, dma):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:8]
        if not any(need):
            return (None,) * 14
        def torch_path():
            return _torch_backward(saved, need, (do, dmt, dst, dma), ctx.opts)

        def kernels():
            grads = chunk_momentum_backward(*saved, do, dmt, dst, dma, allow_tf32=ctx.allow_tf32, **ctx.opts)
            return [g if n else None for g, n in zip(grads, need)]
        grads = (torch_path() if BACKWARD == "torch"
                 else with_torch_fallback(kernels, torch_path, "momentum chunk backward"))
        return (*grads, None, None, None, None, None, None)


def _torch_backward(saved, need, grads_out, opts):
    """The reference backward: autograd of :func:`.naive.momentum_chunk_reference`, recomputed (≥ fp32)."""
    return reference_backward(momentum_chunk_reference, saved, need, grads_out, **opts)


def chunk_momentum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, theta: torch.Tensor,
                   alpha: Optional[torch.Tensor], initial_state: torch.Tensor, initial_momentum: torch.Tensor, *,
                   chunk_size: int, bias: str = "l2", read: str = "token", placement: str = "after_step",
                   cu_seqlens: Optional[torch.Tensor] = None, allow_tf32: Optional[bool] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear memory + momentum GD at semantic chunk size b (module docstring), Triton forward and backward.

    Args:
        q, k: ``[B, T, H, D_k]`` (feature map already applied); v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step β_t = η_t γ_t.
        theta: ``[B, T, H]`` momentum gate θ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, ``[B, T, H, D_k]`` channel-wise (per key channel,
            M ← M Diag(α_t) + S; before_step takes the gradient at M_a Diag(P_s)), or None.
        initial_state, initial_momentum: M and S before the first token, ``[N, H, D_v, D_k]`` (N = B, or the
            number of packed sequences); every sequence starts at a chunk boundary.
        chunk_size: the semantic chunk b (2 ≤ b ≤ 64 on the kernels; it changes the result).
        bias: ``l2`` or ``dot``; read: ``token`` or ``chunk``.
        placement: ``after_step`` (gradients at M_a) or ``before_step`` (at P_s M_a; the same for ``dot``).
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed as B = 1, or None. Run natively (one launch per
            stage over all chunks of all sequences); each sequence is its own call (states and semantic chunks
            restart at its first token; an empty sequence returns its initial states).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`atlaslab.kernels.utils.dot_precision` chooses.

    Returns:
        ``o: [B, T, H, D_v]``, the final memory M_T and momentum S_T, and the memory at the start of the last chunk
        (the ``MemoryState`` anchor), each ``[N, H, D_v, D_k]``.
    """
    return ChunkMomentumFunction.apply(q, k, v, beta, theta, alpha, initial_state, initial_momentum,
                                       int(chunk_size), bias, read, placement, cu_seqlens, allow_tf32)


__all__ = ["ChunkMomentumFunction", "chunk_coefficients", "chunk_momentum", "chunk_momentum_backward",
           "chunk_momentum_forward"]
