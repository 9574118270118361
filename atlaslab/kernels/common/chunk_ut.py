"""Stage 1 of the chunk kernels: the UT transform of a chunk's write rows, (I + A)⁻¹ by forward substitution and
the pseudo-keys / values it gives (:func:`atlaslab.kernels.delta_rule.naive.delta_rule_chunk`, step 1).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:
    from atlaslab.kernels.common.decay import _decayed_dot, _slot_decayed_dot

    @triton.jit
    def ut_solve(b_x, b_c, b_v, b_G, b_gs, b_g, u_out, wk_out, ainv_out, srow, m_s, o_i, tau, o_s, o_k, m_k, o_v,
                  m_v, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  STORE_AINV: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1's UT system over a chunk's write rows (x ``[BS, BK]``, v ``[BS, BVV]``, c ``[BS]`` = β or coef):
        A[r, r'] = c_r e^{G_τr − g_τr'} x_r·x_r' (per head; b_G, b_gs ``[BS]``) or c_r Σ_c x_rc x_r'c e^{G_τr,c −
        g_τr',c} (channel-wise; b_G ``[BS, BK]``, b_g ``[BT, BK]`` at the tokens) for τr' < τr; then
        u = (I + A)⁻¹ (c v), w_k = (I + A)⁻¹ (c e^G ⊙ x) stored at srow and, with STORE_AINV, (I + A)⁻¹ itself
        (``[B, T(·C), H, BS]``) for the backward's dr = (I + A)⁻ᵀ dw."""
        # (written out, no nested helpers but the decayed products: an inlined helper's debug scope puts labels in
        # the PTX that shift ptxas' register allocation, and these builds equal the separate kernels' this replaced)
        if CHANNEL:
            if C == 1:
                A = b_c[:, None] * _decayed_dot(b_x, b_x, b_G, b_g, o_i, BT, True)
            else:
                A = b_c[:, None] * _slot_decayed_dot(b_x, b_G, m_s, tau, b_x, b_g, o_i, o_s, BS, BT, BS, C, True)
        else:
            strict = tau[:, None] > tau[None, :]
            kk = tl.dot(b_x, tl.trans(b_x), input_precision=PRECISION)
            if C == 1:     # (the decay formed before the product, as the C = 1 kernel always had it)
                ratio = tl.exp(tl.minimum(tl.where(strict, b_G[:, None] - b_gs[None, :], 0.0), 0.0))
                A = tl.where(strict, b_c[:, None] * kk * ratio, 0.0)
            else:
                A = tl.where(strict, b_c[:, None] * kk * tl.exp(tl.minimum(tl.where(strict, b_G[:, None] - b_gs[None, :],
                                                                                   0.0), 0.0)),
                             0.0)
        # (I + A)⁻¹ by forward substitution: row i = e_i − Σ_{j<i} A[i, j] · row j
        Ti = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
        for i in range(1, BS):
            a_i = tl.sum(tl.where(o_s[:, None] == i, A, 0.0), axis=0)
            new = tl.where(o_s == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ti, axis=0)
            Ti = tl.where(o_s[:, None] == i, new[None, :], Ti)
        b_u = tl.dot(Ti, b_c[:, None] * b_v, input_precision=PRECISION)
        if CHANNEL:
            b_wk = tl.dot(Ti, b_c[:, None] * b_x * tl.exp(b_G), input_precision=PRECISION)
        else:
            b_wk = tl.dot(Ti, (b_c * tl.exp(b_G))[:, None] * b_x, input_precision=PRECISION)
        tl.store(u_out + srow[:, None] * V + o_v[None, :], b_u, mask=m_s[:, None] & m_v[None, :])
        tl.store(wk_out + srow[:, None] * K + o_k[None, :], b_wk, mask=m_s[:, None] & m_k[None, :])
        if STORE_AINV:
            tl.store(ainv_out + srow[:, None] * BS + o_s[None, :], Ti, mask=m_s[:, None])
