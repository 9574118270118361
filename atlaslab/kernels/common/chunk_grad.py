"""The backward's per-chunk gradients (all chunks in parallel, a loop over value blocks): dq, dk, dv, dβ and
d log α from the chunk-start state, the chunk-end dS, w, dw and (I + A)⁻¹, per-head and channel-wise decay
(:func:`atlaslab.kernels.delta_rule.naive.delta_rule_chunk_backward`, step 3).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:
    from atlaslab.kernels.common.index import (causal_mask, _chunk_row, chunk_rows, chunk_span, _last_gate, load_gates,
                                               load_tile, load_vec, _write_gate)
    from atlaslab.kernels.common.decay import _decayed_mm, _masked_decay, _slot_decayed_mm

    @triton.jit
    def _grad_program(q, k, beta, g, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr,
                      K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                      CHANNEL: tl.constexpr):
        """Set-up of a backward grad program (chunk × head): (i_c, i_h, bos, i_t, T, boc, o_i, o_s,
        tau, o_k, m_k, m_t, rows, m_s, srow, trow, m_tk, m_sk, q ``[BT, BK]``, x ``[BS, BK]`` (k or the window
        slots), c ``[BS]`` (β or coef), g at the tokens and gs at the write rows' tokens (per head ``[·]``,
        channel-wise ``[·, BK]``))."""
        i_c = tl.program_id(0)            # global chunk index: all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        boc = i_c.to(tl.int64) - i_t      # global index of the sequence's first chunk (rows of hs / dhs)
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_t, rows, tau, m_s, srow, trow = chunk_rows(o_i, o_s, bos, i_t, i_h, T, H, C, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_sk = m_s[:, None] & m_k[None, :]
        b_q = load_tile(q, rows, o_k, K, m_tk)
        b_x = load_tile(k, srow, o_k, K, m_sk)
        b_c = load_vec(beta, srow, m_s)
        b_g = load_gates(g, rows, m_t, o_k, m_k, K, CHANNEL)
        if C == 1:
            b_gs = b_g
        else:
            b_gs = load_gates(g, trow, m_s, o_k, m_k, K, CHANNEL)
        return (i_c, i_h, bos, i_t, T, boc, o_i, o_s, tau, o_k, m_k, m_t, rows, m_s, srow, trow, m_tk, m_sk, b_q, b_x,
                b_c, b_g, b_gs)

    @triton.jit
    def _grad_block(i_v, do, w, dw, v, hs, dhs, rows, m_t, srow, m_s, h_base, o_k, m_k, V: tl.constexpr,
                    K: tl.constexpr, BV: tl.constexpr):
        """Value block i_v of a grad program: (o_v, m_v, m_sv, do ``[BT, BV]``, w, dw, v ``[BS, BV]`` at the write
        rows, the chunk's S_0 and dS ``[BV, BK]`` (state offset h_base))."""
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_sv = m_s[:, None] & m_v[None, :]
        m_h = m_v[:, None] & m_k[None, :]
        b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                       other=0.0).to(tl.float32)
        b_w = tl.load(w + srow[:, None] * V + o_v[None, :], mask=m_sv, other=0.0)
        b_dw = tl.load(dw + srow[:, None] * V + o_v[None, :], mask=m_sv, other=0.0)
        b_v = tl.load(v + srow[:, None] * V + o_v[None, :], mask=m_sv, other=0.0).to(tl.float32)
        S0 = tl.load(hs + h_base + o_v[:, None] * K + o_k[None, :], mask=m_h, other=0.0)
        dS = tl.load(dhs + h_base + o_v[:, None] * K + o_k[None, :], mask=m_h, other=0.0)
        return o_v, m_sv, b_do, b_w, b_dw, b_v, S0, dS

    @triton.jit
    def _grad_l2_block(Ti, b_dw, S0, b_xS, PRECISION: tl.constexpr):
        """For the ℓ2 residual of one value block: (dr = (I + A)⁻ᵀ dw ``[BS, BV]``, b_xS S_0ᵀ ``[BS, BV]``), b_xS the
        keys the residual reads S_0 with (x per head, x ⊙ e^G channel-wise)."""
        b_dr = tl.dot(tl.trans(Ti), b_dw, input_precision=PRECISION)
        b_kS = tl.dot(b_xS, tl.trans(S0), input_precision=PRECISION)
        return b_dr, b_kS

    @triton.jit
    def _store_dla(dla, b_dg, b_dG, b_dgq, rows, m_t, o_k, m_k, K: tl.constexpr, BEFORE: tl.constexpr,
                   READ_TOKEN: tl.constexpr, CHANNEL: tl.constexpr):
        """d log α = reverse-cumsum over the chunk of (dg + dG) (g = chunk-local cumsum of log α) − [after] dG
        (G = g − log α) − [read chunk] d gq (gq = g − log α), per token ``[BT]`` (and channel ``[BT, BK]``)."""
        b_dla = tl.cumsum(b_dg + b_dG, axis=0, reverse=True)
        if not BEFORE:
            b_dla -= b_dG
        if not READ_TOKEN:
            b_dla -= b_dgq
        if CHANNEL:
            tl.store(dla + rows[:, None] * K + o_k[None, :], b_dla, mask=m_t[:, None] & m_k[None, :])
        else:
            tl.store(dla + rows, b_dla, mask=m_t)

    @triton.jit
    def grad_per_head(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                       chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                       READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Per chunk × head (all chunks in parallel, a loop over value blocks), per-head decay: dq (tokens), dk, dv,
        dβ (write rows) and d log α (tokens) from S_0 (chunk start), dS (chunk end), w, dw and (I + A)⁻¹ — the
        equations of :func:`.naive.delta_rule_chunk_backward` step 3 on the write rows (C > 1: the window slots,
        whose dg / dG terms are summed into their tokens by a one-hot [BT, BS] reduction before the reverse cumsum
        of d log α)."""
        (i_c, i_h, bos, i_t, T, boc, o_i, o_s, tau, o_k, m_k, m_t, rows, m_s, srow, trow, m_tk, m_sk, b_q, b_x, b_c,
         b_g, b_gs) = _grad_program(q, k, beta, g, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, C, BT, BS, BK,
                                    False)
        if HAS_ALPHA:
            b_la = load_vec(la, rows, m_t)
            if C == 1:
                b_las = b_la
            else:
                b_las = load_vec(la, trow, m_s)
        else:
            b_la = tl.zeros([BT], dtype=tl.float32)
            b_las = tl.zeros([BS], dtype=tl.float32)
        last, g_last = _last_gate(g, bos, i_t, i_h, T, H, K, C, BT, o_k, m_k, False)
        if READ_TOKEN:
            b_gq = b_g
        else:
            b_gq = b_g - b_la
        causal = causal_mask(o_i, tau, m_s, C, not READ_TOKEN)
        b_G = _write_gate(b_gs, b_las, BEFORE)
        e_gq = tl.exp(b_gq)
        e_G = tl.exp(b_G)
        decay = tl.exp(tl.where(m_s, g_last - b_gs, 0.0))
        Eq = tl.where(causal, _masked_decay(b_gq, b_gs, causal), 0.0)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dks = tl.zeros([BS, BK], dtype=tl.float32)       # (e^{g_L − g} ⊙ w) dS: the state path
        b_dkl = tl.zeros([BS, BK], dtype=tl.float32)       # −β e^G ⊙ (dr S_0): the l2 residual path
        b_dP = tl.zeros([BT, BS], dtype=tl.float32)        # do wᵀ
        b_dA = tl.zeros([BS, BS], dtype=tl.float32)        # −dr wᵀ
        b_db = tl.zeros([BS], dtype=tl.float32)
        b_dG = tl.zeros([BS], dtype=tl.float32)
        if C == 1:   # ⟨dS, S_0⟩: summed at the end (C = 1) or per value block (window), as the builds have it
            b_dgl = tl.zeros([BV, BK], dtype=tl.float32)
        else:
            b_dgl = tl.zeros([BK], dtype=tl.float32)
        h_base = (_chunk_row(i_c, i_t, boc, C) * H + i_h) * V * K
        if IS_L2:
            Ti = tl.load(ainv + srow[:, None] * BS + o_s[None, :], mask=m_s[:, None], other=0.0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v, m_sv, b_do, b_w, b_dw, b_v, S0, dS = _grad_block(i_v, do, w, dw, v, hs, dhs, rows, m_t, srow, m_s,
                                                                  h_base, o_k, m_k, V, K, BV)
            b_dq += tl.dot(b_do * e_gq[:, None], S0, input_precision=PRECISION)
            b_dP += tl.dot(b_do, tl.trans(b_w), input_precision=PRECISION)
            b_dks += tl.dot(b_w * decay[:, None], dS, input_precision=PRECISION)
            if C == 1:
                b_dgl += dS * S0
            else:
                b_dgl += tl.sum(dS * S0, axis=0)
            if IS_L2:
                b_dr, b_kS = _grad_l2_block(Ti, b_dw, S0, b_x, PRECISION)
                b_db += tl.sum(b_dr * (b_v - e_G[:, None] * b_kS), axis=1)
                b_dG -= b_c * e_G * tl.sum(b_dr * b_kS, axis=1)
                b_dkl -= (b_c * e_G)[:, None] * tl.dot(b_dr, S0, input_precision=PRECISION)
                b_dA -= tl.dot(b_dr, tl.trans(b_w), input_precision=PRECISION)
                b_dw = b_dr                                 # dv = c ⊙ dr (ℓ2), c ⊙ dw (dot)
            else:
                b_db += tl.sum(b_dw * b_v, axis=1)
            tl.store(dv + srow[:, None] * V + o_v[None, :], (b_c[:, None] * b_dw).to(dv.dtype.element_ty), mask=m_sv)
        b_dP = b_dP * Eq
        b_dq += tl.dot(b_dP, b_x, input_precision=PRECISION)
        b_dkp = tl.dot(tl.trans(b_dP), b_q, input_precision=PRECISION)
        b_dgq = tl.sum(b_q * b_dq, axis=1)
        ks = tl.sum(b_x * b_dks, axis=1)
        if C == 1:   # dg of the tokens (the write rows are the tokens)
            b_dgs = b_dgq - tl.sum(b_x * b_dkp, axis=1) - ks
            dgl = tl.exp(g_last) * tl.sum(tl.sum(b_dgl, axis=1), axis=0) + tl.sum(ks, axis=0)
            b_dgs += tl.where(o_i == last, dgl, 0.0)
        else:        # dg at the slots' tokens, key side
            b_dgs = -tl.sum(b_x * b_dkp, axis=1) - ks
            dgl = tl.exp(g_last) * tl.sum(b_dgl, axis=0) + tl.sum(ks, axis=0)
        b_dk = b_dkp + b_dks + b_dkl
        if IS_L2:
            strict = (tau[:, None] > tau[None, :]) & m_s[None, :]
            E = tl.where(strict, _masked_decay(b_G, b_gs, strict), 0.0)
            xx = tl.dot(b_x, tl.trans(b_x), input_precision=PRECISION)
            b_dA = tl.where(strict, b_dA, 0.0)
            Z = b_dA * b_c[:, None] * E                     # ∂L/∂(x_r·x_r')
            Ad = Z * xx                                     # dA ⊙ A
            b_db += tl.sum(b_dA * E * xx, axis=1)
            b_dG += tl.sum(Ad, axis=1)
            b_dgs -= tl.sum(Ad, axis=0)
            b_dk += tl.dot(Z, b_x, input_precision=PRECISION) + tl.dot(tl.trans(Z), b_x, input_precision=PRECISION)
        tl.store(dq + rows[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + srow[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_sk)
        tl.store(dbeta + srow, b_db.to(dbeta.dtype.element_ty), mask=m_s)
        if HAS_ALPHA:
            if C == 1:
                b_dg = b_dgs
                b_dG_t = b_dG
            else:
                own = (tau[None, :] == o_i[:, None]) & m_s[None, :]      # [BT, BS]: slot → its token
                b_dG_t = tl.sum(tl.where(own, b_dG[None, :], 0.0), axis=1)
                b_dg = b_dgq + tl.sum(tl.where(own, b_dgs[None, :], 0.0), axis=1) + tl.where(o_i == last, dgl, 0.0)
            _store_dla(dla, b_dg, b_dG_t, b_dgq, rows, m_t, o_k, m_k, K, BEFORE, READ_TOKEN, False)

    @triton.jit
    def grad_channel(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                      chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                      PRECISION: tl.constexpr):
        """Per chunk × head, channel-wise decay: the equations of :func:`.naive._channel_wise_backward` step 3
        on the write rows. With D = do wᵀ, dr = (I + A)⁻ᵀ dw, dA = −strict(dr wᵀ), x_G = x ⊙ e^{G_τ},
        Z = c_r dA[r, r']: dq = (do S_0) ⊙ e^{gq} + Σ_r D[t, r] x_r ⊙ e^{gq_t − g_τr};
        dx = Σ_t D[t, r] q_t ⊙ e^{gq_t − g_τr} + (w dS) ⊙ e^{g_L − g_τ} − c (dr S_0) ⊙ e^{G_τ}
             + Σ_r' Z[r, r'] x_r' ⊙ e^{G_τr − g_τr'} + Σ_r Z[r, r'] x_r ⊙ e^{G_τr − g_τr'} (the last at r');
        dc = Σ_v dr ⊙ (v − x_G S_0ᵀ) + x_r · Σ_r' dA[r, r'] x_r' ⊙ e^{G_τr − g_τr'}  (dot: Σ_v dw ⊙ v);
        per write row dg = −x ⊙ (dx_P + dx_S) − [l2] x ⊙ Z-column term, dG = −c (dr S_0) ⊙ x_G + x ⊙ Z-row term,
        summed into their tokens (C > 1: one-hot [BT, BS] products) with d gq = q ⊙ dq and, at the chunk's last
        token, e^{g_L} ⊙ Σ_v dS ⊙ S_0 + Σ_r x_r ⊙ dx_S,r; d log α ``[BT, K]`` = reverse-cumsum(dg + dG) − [after] dG
        − [read chunk] d gq. The pairwise decays: :func:`_decayed_mm` (C = 1) / :func:`_slot_decayed_mm`."""
        (i_c, i_h, bos, i_t, T, boc, o_i, o_s, tau, o_k, m_k, m_t, rows, m_s, srow, trow, m_tk, m_sk, b_q, b_x, b_c,
         b_g, b_gs) = _grad_program(q, k, beta, g, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, C, BT, BS, BK,
                                    True)
        b_la = load_tile(la, rows, o_k, K, m_tk)
        if C == 1:
            b_las = b_la
        else:
            b_las = load_tile(la, trow, o_k, K, m_sk)
        last, g_last = _last_gate(g, bos, i_t, i_h, T, H, K, C, BT, o_k, m_k, True)
        if READ_TOKEN:
            b_gq = b_g
        else:
            b_gq = b_g - b_la
        b_G = _write_gate(b_gs, b_las, BEFORE)
        e_G = tl.exp(b_G)
        b_xG = b_x * e_G
        decay = tl.exp(tl.where(m_sk, g_last[None, :] - b_gs, 0.0))
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)        # do S_0, then ⊙ e^{gq}
        b_dks = tl.zeros([BS, BK], dtype=tl.float32)       # w dS, then ⊙ e^{g_L − g_τ}
        b_dkG = tl.zeros([BS, BK], dtype=tl.float32)       # −c (dr S_0): gradient of x_G in r
        b_D = tl.zeros([BT, BS], dtype=tl.float32)         # do wᵀ
        b_dA = tl.zeros([BS, BS], dtype=tl.float32)        # −dr wᵀ
        b_db = tl.zeros([BS], dtype=tl.float32)
        b_dgl = tl.zeros([BK], dtype=tl.float32)           # Σ_v dS ⊙ S_0
        h_base = (_chunk_row(i_c, i_t, boc, C) * H + i_h) * V * K
        Ti = tl.zeros([BS, BS], dtype=tl.float32)          # (I + A)⁻¹ (ℓ2 only)
        if IS_L2:
            Ti = tl.load(ainv + srow[:, None] * BS + o_s[None, :], mask=m_s[:, None], other=0.0)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v, m_sv, b_do, b_w, b_dw, b_v, S0, dS = _grad_block(i_v, do, w, dw, v, hs, dhs, rows, m_t, srow, m_s,
                                                                  h_base, o_k, m_k, V, K, BV)
            b_dq += tl.dot(b_do, S0, input_precision=PRECISION)
            b_D += tl.dot(b_do, tl.trans(b_w), input_precision=PRECISION)
            b_dks += tl.dot(b_w, dS, input_precision=PRECISION)
            b_dgl += tl.sum(dS * S0, axis=0)
            if IS_L2:
                b_dr, b_kS = _grad_l2_block(Ti, b_dw, S0, b_xG, PRECISION)
                b_db += tl.sum(b_dr * (b_v - b_kS), axis=1)
                b_dkG -= b_c[:, None] * tl.dot(b_dr, S0, input_precision=PRECISION)
                b_dA -= tl.dot(b_dr, tl.trans(b_w), input_precision=PRECISION)
                b_dw = b_dr                                 # dv = c ⊙ dr (ℓ2), c ⊙ dw (dot)
            else:
                b_db += tl.sum(b_dw * b_v, axis=1)
            tl.store(dv + srow[:, None] * V + o_v[None, :], (b_c[:, None] * b_dw).to(dv.dtype.element_ty), mask=m_sv)
        b_dq = b_dq * tl.exp(b_gq)
        b_dks = b_dks * decay
        if C == 1:
            dq_p, dk_p = _decayed_mm(b_D, b_q, b_x, b_gq, b_g, o_i, BT, not READ_TOKEN)
        else:
            dq_p, dk_p = _slot_decayed_mm(b_D, b_q, b_gq, m_t, o_i, b_x, b_g, o_i, o_s, BT, C, not READ_TOKEN)
        b_dq += dq_p
        b_dgq = b_q * b_dq
        ks = b_x * b_dks
        if C == 1:   # dg of the tokens (the write rows are the tokens)
            b_dgs = b_dgq - b_x * dk_p - ks
            dgl = tl.exp(g_last) * b_dgl + tl.sum(ks, axis=0)
            b_dgs += tl.where((o_i == last)[:, None], dgl[None, :], 0.0)
        else:        # dg at the slots' tokens, key side
            b_dgs = -b_x * dk_p - ks
            dgl = tl.exp(g_last) * b_dgl + tl.sum(ks, axis=0)
        b_dk = dk_p + b_dks
        b_dGs = tl.zeros([BS, BK], dtype=tl.float32)
        if IS_L2:
            # A[r, r'] = c_r Σ_c x_rc x_r'c e^{G_τr,c − g_τr',c}: rows → dc, dx_r, dG; columns → dx_r', dg
            if C == 1:
                dA1, Z2 = _decayed_mm(b_dA, b_c[:, None] * b_x, b_x, b_G, b_g, o_i, BT, True)
            else:
                dA1, Z2 = _slot_decayed_mm(b_dA, b_c[:, None] * b_x, b_G, m_s, tau, b_x, b_g, o_i, o_s, BT, C, True)
            b_db += tl.sum(b_x * dA1, axis=1)
            dA1 = b_c[:, None] * dA1
            b_dk += b_dkG * e_G + dA1 + Z2
            b_dGs = b_dkG * b_xG + b_x * dA1
            b_dgs -= b_x * Z2
        tl.store(dq + rows[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + srow[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_sk)
        tl.store(dbeta + srow, b_db.to(dbeta.dtype.element_ty), mask=m_s)
        if C == 1:
            b_dg = b_dgs
            b_dG = b_dGs
        else:
            own = tl.where((tau[None, :] == o_i[:, None]) & m_s[None, :], 1.0, 0.0)     # [BT, BS]: slot → token
            b_dG = tl.dot(own, b_dGs, input_precision="ieee")
            b_dg = b_dgq + tl.dot(own, b_dgs, input_precision="ieee") \
                + tl.where((o_i == last)[:, None], dgl[None, :], 0.0)
        _store_dla(dla, b_dg, b_dG, b_dgq, rows, m_t, o_k, m_k, K, BEFORE, READ_TOKEN, True)
