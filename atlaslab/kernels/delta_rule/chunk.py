"""Chunk-parallel Triton forward and backward of the linear-memory (gated) delta / Hebbian rule, in fla's stages.

Forward: the UT transform per chunk (``_chunk_ut_kernel``, all chunks in parallel), the inter-chunk state sweep
(``_chunk_state_kernel``, sequential over chunks) and the output (``_chunk_out_kernel``); backward: the stages
re-run, a reverse sweep for dS (``_chunk_bwd_dh_kernel``) and every chunk's gradients in parallel
(``_chunk_bwd_grad_kernel``); the ``_cw_*`` kernels for channel-wise decay. The math is :func:`.naive.delta_rule_chunk`
and :func:`.naive.delta_rule_chunk_backward` (docs/kernels.md#delta-rule). Each stage is one ``@triton.jit`` body
(public here, so the Omega-window kernels of :mod:`atlaslab.kernels.window_rule.chunk` reuse them with C > 1
slots per token), inlined into the named kernels and switched by constexpr flags; ``cu_seqlens`` runs natively
(one launch per stage over all chunks of all sequences). ``BACKWARD = "torch"`` (``ATLASLAB_CHUNK_BACKWARD=torch``)
switches this op's and the window op's backward to autograd through the torch chunk form.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.delta_rule.naive import check_args, delta_rule_chunk
from atlaslab.kernels.utils import ChunkLayout, dot_precision, log_decay, pow2, reference_backward, with_torch_fallback

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_D = 256


if triton is not None:

    @triton.jit
    def chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN: tl.constexpr):
        """Where chunk program ``i_c`` works: (chunk within its sequence, the sequence's first row, its length).
        Varlen: fla's chunk-index table row (sequence, chunk within it) and ``cu_seqlens``; dense: B equal
        sequences of T tokens, NT chunks each."""
        if IS_VARLEN:
            i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
            i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        else:
            i_t = i_c % NT
            bos = (i_c // NT).to(tl.int64) * T
        return i_t, bos, T

    @triton.jit
    def sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
        """Sequence ``i_n``'s (first row, length, chunks, first chunk row) for the sequential sweeps."""
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
            NT = (T + BT - 1) // BT
            boc = tl.load(chunk_offsets + i_n).to(tl.int64)
        else:
            bos = i_n.to(tl.int64) * T
            boc = i_n.to(tl.int64) * NT
        return bos, T, NT, boc

    # ------------------------------------------------------------------ shared pieces (Triton inlines them)
    # Row conventions of every kernel here and in :mod:`atlaslab.kernels.window_rule.chunk`: a tensor [B, T, H, N] (or [B, T·C, H, N]
    # for window slots) is addressed by flat rows (b·T + t)·H + h and a column index < N; a chunk has BT tokens
    # (rows ``rows``, mask ``m_t``) and BS write rows ("slots": the tokens themselves for C = 1, the BT·C window
    # slots for C > 1; rows ``srow``, their tokens' rows ``trow``, local token ``tau``, mask ``m_s``).

    @triton.jit
    def load_tile(ptr, rows, cols, N, mask):
        """The fp32 block ``ptr[rows, cols]`` ``[R, BC]`` of a row-major tensor with N columns (rows ``[R]``, cols
        ``[BC]``), 0 where the ``[R, BC]`` mask is off."""
        return tl.load(ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def load_vec(ptr, rows, m):
        """The fp32 entries ``ptr[rows]`` ``[R]`` of a per-row tensor ([B, T, H]: β, coef, per-head g or log α)."""
        return tl.load(ptr + rows, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _state_tile(ptr, row, h_offs, m_h, V: tl.constexpr, K: tl.constexpr):
        """The fp32 value block ``[BV, BK]`` of state ``row`` of a ``[rows, H, V, K]``-flat state tensor (initial /
        final states: row = sequence × head; chunk states: row = global chunk × H + head); h_offs, m_h: the
        block's offsets o_v·K + o_k and mask."""
        return tl.load(ptr + row * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)

    @triton.jit
    def _put_state(ptr, row, h_offs, m_h, V: tl.constexpr, K: tl.constexpr, x):
        """Stores the value block x ``[BV, BK]`` as state ``row`` (layout of :func:`_state_tile`)."""
        tl.store(ptr + row * V * K + h_offs, x, mask=m_h)

    @triton.jit
    def token_rows(o_i, bos, i_t, i_h, T, H: tl.constexpr, BT: tl.constexpr):
        """Chunk i_t (tokens o_i = arange(BT)) of a sequence starting at row bos (length T): (m_t (t < T), the
        tokens' flat rows ``(bos + t)·H + i_h``)."""
        o_t = i_t * BT + o_i
        m_t = o_t < T
        rows = (bos + o_t) * H + i_h
        return m_t, rows

    @triton.jit
    def slot_tokens(o_s, C: tl.constexpr):
        """tau: the local token of each write row o_s ``[BS]`` (o_s // C; for C = 1 the rows are the tokens)."""
        if C == 1:
            tau = o_s
        else:
            tau = o_s // C
        return tau

    @triton.jit
    def slot_rows(bos, i_t, i_h, o_s, tau, T, H: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
        """The write rows of chunk i_t (o_s, tau from :func:`slot_tokens`): (m_s, srow = their flat rows, trow = their
        tokens' flat rows). C = 1: the chunk's BT tokens (trow = srow); C > 1: the BT·C Omega-window slots
        s = τ·C + j of the ``[B, T·C, H, ·]`` slot tensors (rows past BT·C or T masked)."""
        if C == 1:
            tok = i_t * BT + o_s
            m_s = tok < T
            srow = (bos + tok) * H + i_h
            trow = srow
        else:
            tok = i_t * BT + tau
            m_s = (o_s < BT * C) & (tok < T)
            srow = ((bos + i_t * BT) * C + o_s) * H + i_h
            trow = (bos + tok) * H + i_h
        return m_s, srow, trow

    @triton.jit
    def _sweep_program(cu_seqlens, chunk_offsets, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
        """Set-up of a sequential sweep program (grid: value block × sequence·head): (i_bh the state row, i_h, the
        sequence's first row bos, length T, chunks NT, first chunk row boc, o_i = arange(BT) (a chunk's tokens),
        o_s = arange(BS) (its write rows), tau = their local tokens, o_k, o_v (this value block), m_k, m_v, and
        m_h, h_offs: a ``[BV, BK]`` state block's mask and offsets o_v·K + o_k)."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        tau = slot_tokens(o_s, C)
        return i_bh, i_h, bos, T, NT, boc, o_i, o_s, tau, o_k, o_v, m_k, m_v, m_h, h_offs

    @triton.jit
    def load_gates(g, rows, m, o_k, m_k, K: tl.constexpr, CHANNEL: tl.constexpr):
        """A gate tensor (g or log α) at ``rows``: ``[R]`` per head ([B, T, H]), ``[R, BK]`` channel-wise."""
        if CHANNEL:
            x = load_tile(g, rows, o_k, K, m[:, None] & m_k[None, :])
        else:
            x = load_vec(g, rows, m)
        return x

    @triton.jit
    def _last_gate(g, bos, i_t, i_h, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, o_k,
                   m_k, CHANNEL: tl.constexpr):
        """(last, g_L): the index of chunk i_t's last real token and g there (a scalar, or ``[BK]`` channel-wise;
        the row's address is formed as each kernel family always has, which its compiled builds depend on)."""
        last = tl.minimum(T - i_t * BT, BT) - 1
        if not CHANNEL:
            g_last = tl.load(g + (bos + i_t * BT + last) * H + i_h)
        elif C == 1:
            g_last = tl.load(g + (bos + i_t * BT + last) * H * K + i_h * K + o_k, mask=m_k, other=0.0)
        else:
            g_last = tl.load(g + ((bos + i_t * BT + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        return last, g_last

    @triton.jit
    def read_gate(b_g, la, rows, m_t, o_k, m_k, K: tl.constexpr, HAS_ALPHA: tl.constexpr,
                   READ_TOKEN: tl.constexpr, CHANNEL: tl.constexpr):
        """gq, the log-decay a read sees: g for read token (o_t = S_t q_t), g − log α for read chunk
        (o_t = S_{t−1} q_t); shape of b_g."""
        if READ_TOKEN:
            b_gq = b_g
        elif HAS_ALPHA:
            b_gq = b_g - load_gates(la, rows, m_t, o_k, m_k, K, CHANNEL)
        else:
            b_gq = b_g
        return b_gq

    @triton.jit
    def _write_gate(b_g, b_la, BEFORE: tl.constexpr):
        """G, the log-decay a write's key carries: g for before_step (S_t = α_t S_{t−1} − ...), g − log α
        for after_step (the decay applied after the step)."""
        if BEFORE:
            b_G = b_g
        else:
            b_G = b_g - b_la
        return b_G

    @triton.jit
    def causal_mask(o_i, tau, m_s, C: tl.constexpr, STRICT: tl.constexpr):
        """``[BT, BS]`` read mask: token t sees write row r where τ_r < t (STRICT: read chunk) or τ_r ≤ t, and m_s
        (the comparison written as each kernel family always has: the builds depend on the form)."""
        if C == 1:
            if STRICT:
                causal = (o_i[:, None] > tau[None, :]) & m_s[None, :]
            else:
                causal = (o_i[:, None] >= tau[None, :]) & m_s[None, :]
        else:
            if STRICT:
                causal = (tau[None, :] < o_i[:, None]) & m_s[None, :]
            else:
                causal = (tau[None, :] <= o_i[:, None]) & m_s[None, :]
        return causal

    @triton.jit
    def _masked_decay(a, b, mask):
        """e^{a_t − b_s} ``[R, S]`` where mask holds, 1 elsewhere (a ``[R]``, b ``[S]``: per-head log-decays).

        The exponent is clamped at 0: on a mask's causal entries of real rows a_t − b_s ≤ 0 already (cumulative
        log-decays only fall), but a padded row past a ragged chunk's end loads a = 0, and e^{−b_s} overflows to inf
        once the chunk has decayed below e^−88 (a fast-forgetting head); inf times that row's zero is NaN in every
        product over rows (the backward's Pᵀ do, the UT solve)."""
        return tl.exp(tl.minimum(tl.where(mask, a[:, None] - b[None, :], 0.0), 0.0))

    @triton.jit
    def _row(x, sel):
        """Row ``sel`` (a one-hot [BT] mask) of a [BT, N] block, as an [N] vector."""
        return tl.sum(tl.where(sel[:, None], x, 0.0), axis=0)

    @triton.jit
    def _decayed_dot(x, y, a, b, o_i, BT: tl.constexpr, STRICT: tl.constexpr):
        """M[t, s] = Σ_c x[t, c] y[s, c] e^{a[t, c] − b[s, c]} for s < t (STRICT) or s ≤ t, else 0. [BT, BT].

        The exponents are clamped at 0: on the causal part of a chunk's real rows a − b ≤ 0 already (cumulative
        log-decays only fall), and a padded row past a ragged chunk's end (a loaded as 0) must not give
        exp(−b) = inf, which times its zero x is NaN in the column sums of the backward."""
        M = tl.zeros([BT, BT], dtype=tl.float32)
        for s in range(0, BT):
            sel = o_i == s
            if STRICT:
                rows = o_i > s
            else:
                rows = o_i >= s
            e = tl.exp(tl.minimum(tl.where(rows[:, None], a - _row(b, sel)[None, :], 0.0), 0.0))
            col = tl.sum(x * _row(y, sel)[None, :] * e, axis=1)
            M = tl.where(sel[None, :] & rows[:, None], col[:, None], M)
        return M

    @triton.jit
    def _decayed_mm(D, x, y, a, b, o_i, BT: tl.constexpr, STRICT: tl.constexpr):
        """For D [BT, BT] (used on its causal part): R[t, c] = Σ_s D[t, s] y[s, c] e^{a_tc − b_sc} and
        C[s, c] = Σ_t D[t, s] x[t, c] e^{a_tc − b_sc}, both [BT, N] (the two gradients of :func:`_decayed_dot`)."""
        R = tl.zeros_like(x)
        C = tl.zeros_like(x)
        for s in range(0, BT):
            sel = o_i == s
            if STRICT:
                rows = o_i > s
            else:
                rows = o_i >= s
            d_s = tl.where(rows, tl.sum(tl.where(sel[None, :], D, 0.0), axis=1), 0.0)
            e = tl.exp(tl.minimum(tl.where(rows[:, None], a - _row(b, sel)[None, :], 0.0), 0.0))
            R += d_s[:, None] * _row(y, sel)[None, :] * e
            C = tl.where(sel[:, None], tl.sum(d_s[:, None] * x * e, axis=0)[None, :], C)
        return R, C

    @triton.jit
    def _slot_decayed_dot(x, a, ok, tok, xs, g_tok, o_i, o_s, R: tl.constexpr, BT: tl.constexpr,
                          BS: tl.constexpr, C: tl.constexpr, STRICT: tl.constexpr):
        """M[r, s'] = Σ_c x[r, c] xs[s', c] e^{a[r, c] − g_tok[τ_s', c]} where τ_s' < tok[r] (STRICT) or ≤ tok[r],
        and ok[r]; else 0. x, a ``[R, BK]`` (rows: tokens or slots, local token ``tok [R]``); xs ``[BS, BK]`` the
        chunk's slots (slot s' = τ·C + j); g_tok ``[BT, BK]`` the chunk-local log-decay cumsum at its tokens.
        Returns ``[R, BS]`` (columns past BT·C are 0). The window (C > 1) form of :func:`_decayed_dot`: one
        ``[R, BK]`` exponential per token, shared by its C slots."""
        M = tl.zeros([R, BS], dtype=tl.float32)
        for s in range(0, BT):
            b_s = tl.sum(tl.where((o_i == s)[:, None], g_tok, 0.0), axis=0)             # [BK]: g at token s
            if STRICT:
                rows = ok & (tok > s)
            else:
                rows = ok & (tok >= s)
            e = tl.exp(tl.where(rows[:, None], a - b_s[None, :], 0.0))                # ≤ 1 where used
            for j in tl.static_range(C):
                sel = o_s == s * C + j
                y = tl.sum(tl.where(sel[:, None], xs, 0.0), axis=0)
                col = tl.sum(x * y[None, :] * e, axis=1)
                M = tl.where(sel[None, :] & rows[:, None], col[:, None], M)
        return M

    @triton.jit
    def _slot_decayed_mm(D, x, a, ok, tok, xs, g_tok, o_i, o_s, BT: tl.constexpr, C: tl.constexpr,
                         STRICT: tl.constexpr):
        """The two gradients of :func:`_slot_decayed_dot` for D ``[R, BS]`` (used on the same causal part):
        Rm[r, c] = Σ_s' D[r, s'] xs[s', c] e^{a_rc − g_τs',c} ``[R, BK]`` and
        Cm[s', c] = Σ_r D[r, s'] x[r, c] e^{a_rc − g_τs',c} ``[BS, BK]``."""
        Rm = tl.zeros_like(x)
        Cm = tl.zeros_like(xs)
        for s in range(0, BT):
            b_s = tl.sum(tl.where((o_i == s)[:, None], g_tok, 0.0), axis=0)
            if STRICT:
                rows = ok & (tok > s)
            else:
                rows = ok & (tok >= s)
            e = tl.exp(tl.where(rows[:, None], a - b_s[None, :], 0.0))
            for j in tl.static_range(C):
                sel = o_s == s * C + j
                d = tl.where(rows, tl.sum(tl.where(sel[None, :], D, 0.0), axis=1), 0.0)      # column s' of D
                y = tl.sum(tl.where(sel[:, None], xs, 0.0), axis=0)
                Rm += d[:, None] * y[None, :] * e
                Cm = tl.where(sel[:, None], tl.sum(d[:, None] * x * e, axis=0)[None, :], Cm)
        return Rm, Cm

    @triton.jit
    def _channel_scores(x, a, ok, tok, xs, g_tok, o_i, o_s, R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
                        BS: tl.constexpr, STRICT: tl.constexpr):
        """Channel-wise decayed products ``[R, BS]`` M[r, s'] = Σ_c x_rc xs_s'c e^{a_rc − g_τs',c} (causal, see
        :func:`_slot_decayed_dot`): :func:`_decayed_dot` for C = 1 (rows and columns the chunk's tokens),
        :func:`_slot_decayed_dot` for C > 1."""
        if C == 1:
            M = _decayed_dot(x, xs, a, g_tok, o_i, BT, STRICT)
        else:
            M = _slot_decayed_dot(x, a, ok, tok, xs, g_tok, o_i, o_s, R, BT, BS, C, STRICT)
        return M

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
    def state_sweep(k, v, beta, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                     H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                     IS_L2: tl.constexpr, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2 (one program per value block × sequence × head, sequential over its chunks): stores every
        chunk-start state S_0 (``hs [NC, H, V, K]``), the pseudo-values w = u − w_k S_0ᵀ (ℓ2) or c v (dot) of the
        chunk's write rows, and steps S ← e^{g_L} S + Σ_r e^{g_L − g_τr} w_r k_rᵀ (per head) or
        S ← S Diag(e^{g_L}) + Σ_r w_r (k_r ⊙ e^{g_L − g_τr})ᵀ (channel-wise); the last S to ``ht [N, H, V, K]``.
        k, v, beta, u, wk, w_out: the write rows (tokens, or window slots for C > 1); g ``[B, T, H(, K)]``."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        o_s = tl.arange(0, BS)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        if C == 1:
            tau = o_s
        else:
            tau = o_s // C
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_H0:
            h += tl.load(h0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        # (no helper calls inside the loop: their inlined debug scopes put labels in the PTX that shift ptxas'
        # register allocation; written out, the builds equal the separate kernels' this body replaced)
        for i_t in range(0, NT):
            tl.store(hs + ((boc + i_t) * H + i_h) * V * K + h_offs, h, mask=m_h)   # chunk-start state [NC, H, V, K]
            if C == 1:
                tok = i_t * BT + o_s
                m_s = tok < T
                srow = (bos + tok) * H + i_h
                trow = srow
            else:
                tok = i_t * BT + tau
                m_s = (o_s < BT * C) & (tok < T)
                srow = ((bos + i_t * BT) * C + o_s) * H + i_h
                trow = (bos + tok) * H + i_h
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
            last = tl.minimum(T - i_t * BT, BT) - 1
            if not CHANNEL:
                g_last = tl.load(g + (bos + i_t * BT + last) * H + i_h)
            elif C == 1:
                g_last = tl.load(g + (bos + i_t * BT + last) * H * K + i_h * K + o_k, mask=m_k, other=0.0)
            else:
                g_last = tl.load(g + ((bos + i_t * BT + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
            if CHANNEL:
                b_xd = b_x * tl.exp(tl.where(m_sk, g_last[None, :] - b_gs, 0.0))
                h = h * tl.exp(g_last)[None, :] + tl.dot(tl.trans(b_w), b_xd, input_precision=PRECISION)
            else:
                decay = tl.exp(tl.where(m_s, g_last - b_gs, 0.0))
                h = h * tl.exp(g_last) + tl.dot(tl.trans(b_w * decay[:, None]), b_x, input_precision=PRECISION)
        tl.store(ht + i_bh.to(tl.int64) * V * K + h_offs, h, mask=m_h)

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
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        tau = slot_tokens(o_s, C)
        m_s, srow, trow = slot_rows(bos, i_t, i_h, o_s, tau, T, H, C, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = load_tile(q, rows, o_k, K, m_tk)
        b_x = tl.load(k + srow[:, None] * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_g = load_gates(g, rows, m_t, o_k, m_k, K, CHANNEL)
        b_gq = read_gate(b_g, la, rows, m_t, o_k, m_k, K, HAS_ALPHA, READ_TOKEN, CHANNEL)
        causal = causal_mask(o_i, tau, m_s, C, not READ_TOKEN)        # (per head only)
        b_w = tl.load(w + srow[:, None] * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
        h = tl.load(hs + (_chunk_row(i_c, i_t, boc, C) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :],
                    mask=m_v[:, None] & m_k[None, :], other=0.0)
        if CHANNEL:
            b_o = tl.dot(b_q * tl.exp(b_gq), tl.trans(h), input_precision=PRECISION)
        else:
            b_o = tl.exp(b_gq)[:, None] * tl.dot(b_q, tl.trans(h), input_precision=PRECISION)
        P = read_scores(b_q, b_x, b_gq, b_g, b_g, causal, m_t, o_i, o_s, C, BT, BS, READ_TOKEN, CHANNEL, PRECISION)
        b_o += tl.dot(P, b_w, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    @triton.jit
    def _chunk_row(i_c, i_t, boc, C: tl.constexpr):
        """The global chunk index of chunk program i_c (its row in the chunk-state tensors), written as each kernel
        family always has: boc + i_t (C = 1; boc = i_c − i_t) or i_c (window kernels); their builds depend on it."""
        if C == 1:
            row = boc + i_t
        else:
            row = i_c.to(tl.int64)
        return row

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
        gradient (``dh0 [N, H, V, K]``). Written out without nested helpers (their inlined debug scopes put labels in
        the PTX that shift ptxas' register allocation); the loads keep each variant's order of masks."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        if C == 1:
            tau = o_s
        else:
            tau = o_s // C
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
            last = tl.minimum(T - i_t * BT, BT) - 1
            if not CHANNEL:
                g_last = tl.load(g + (bos + i_t * BT + last) * H + i_h)
            elif C == 1:
                g_last = tl.load(g + (bos + i_t * BT + last) * H * K + i_h * K + o_k, mask=m_k, other=0.0)
            else:
                g_last = tl.load(g + ((bos + i_t * BT + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
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
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        tau = slot_tokens(o_s, C)
        m_s, srow, trow = slot_rows(bos, i_t, i_h, o_s, tau, T, H, C, BT)
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
                b_dv = b_c[:, None] * b_dr
            else:
                b_db += tl.sum(b_dw * b_v, axis=1)
                b_dv = b_c[:, None] * b_dw
            tl.store(dv + srow[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_sv)
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
                b_dv = b_c[:, None] * b_dr
            else:
                b_db += tl.sum(b_dw * b_v, axis=1)
                b_dv = b_c[:, None] * b_dw
            tl.store(dv + srow[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_sv)
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

    # ------------------------------------------------------------------ the C = 1 kernels (launched by name)

    @triton.jit
    def _chunk_ut_kernel(k, v, beta, la, g_out, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT,
                         H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr,
                         HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                         STORE_AINV: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1 (chunk × head, all chunks in parallel): g = chunk-local cumsum of log α (stored); for l2 the UT
        system (:func:`ut_solve`): A[t, s] = β_t e^{G_t − g_s} k_t·k_s (s < t), (I + A)⁻¹ by forward
        substitution, u = (I + A)⁻¹ β v, w_k = (I + A)⁻¹ (β e^G k), (I + A)⁻¹ ``[B, T, H, BT]``."""
        i_c = tl.program_id(0)            # global chunk index: all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        if HAS_ALPHA:
            b_la = load_vec(la, rows, m_t)
        else:
            b_la = tl.zeros([BT], dtype=tl.float32)
        b_g = tl.cumsum(b_la, axis=0)
        tl.store(g_out + rows, b_g, mask=m_t)
        if IS_L2:
            o_k = tl.arange(0, BK)
            o_v = tl.arange(0, BVV)
            m_k = o_k < K
            m_v = o_v < V
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.0).to(tl.float32)
            b_beta = load_vec(beta, rows, m_t)
            b_G = _write_gate(b_g, b_la, BEFORE)
            ut_solve(b_k, b_beta, b_v, b_G, b_g, b_g, u_out, wk_out, ainv_out, rows, m_t, o_i, o_i, o_i, o_k, m_k,
                      o_v, m_v, K, V, 1, BT, BT, STORE_AINV, False, PRECISION)

    @triton.jit
    def _cw_ut_kernel(k, v, beta, la, g_out, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT,
                      H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr, IS_L2: tl.constexpr,
                      BEFORE: tl.constexpr, STORE_AINV: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1, channel-wise: g = chunk-local cumsum of log α per key channel; for l2 the UT system
        (:func:`ut_solve`): A[t, s] = β_t Σ_c k_tc k_sc e^{G_tc − g_sc} (s < t), (I + A)⁻¹, u = (I + A)⁻¹ β v,
        w_k = (I + A)⁻¹ β (k ⊙ e^G)."""
        i_c = tl.program_id(0)            # global chunk index: all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        b_la = load_tile(la, rows, o_k, K, m_tk)
        b_g = tl.cumsum(b_la, axis=0)
        tl.store(g_out + rows[:, None] * K + o_k[None, :], b_g, mask=m_tk)
        if IS_L2:
            o_v = tl.arange(0, BVV)
            m_v = o_v < V
            b_k = load_tile(k, rows, o_k, K, m_tk)
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.0).to(tl.float32)
            b_beta = load_vec(beta, rows, m_t)
            b_G = _write_gate(b_g, b_la, BEFORE)
            ut_solve(b_k, b_beta, b_v, b_G, b_g, b_g, u_out, wk_out, ainv_out, rows, m_t, o_i, o_i, o_i, o_k, m_k,
                      o_v, m_v, K, V, 1, BT, BT, STORE_AINV, True, PRECISION)

    @triton.jit
    def _chunk_state_kernel(k, v, beta, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                            H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_H0: tl.constexpr, IS_L2: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2, per head (the loop of :func:`state_sweep` with the masks formed in the loads, as this kernel's
        builds have them): w = u − w_k S_0ᵀ; S ← e^{g_L} S + Σ_s e^{g_L − g_s} w_s k_sᵀ."""
        i_bh, i_h, bos, T, NT, boc, o_i, o_s, tau, o_k, o_v, m_k, m_v, m_h, h_offs = _sweep_program(
            cu_seqlens, chunk_offsets, T, NT, H, K, V, 1, BT, BT, BK, BV, IS_VARLEN)
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_H0:
            h += _state_tile(h0, i_bh.to(tl.int64), h_offs, m_h, V, K)
        for i_t in range(0, NT):
            tl.store(hs + ((boc + i_t) * H + i_h) * V * K + h_offs, h, mask=m_h)   # chunk-start state [NC, H, V, K]
            o_t = i_t * BT + o_i
            m_t = o_t < T
            rows = (bos + o_t) * H + i_h
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            if IS_L2:
                b_u = tl.load(u + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
                b_wk = tl.load(wk + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_w = b_u - tl.dot(b_wk, tl.trans(h), input_precision=PRECISION)
            else:
                b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                              other=0.0).to(tl.float32)
                b_w = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)[:, None] * b_v
            tl.store(w_out + rows[:, None] * V + o_v[None, :], b_w, mask=m_t[:, None] & m_v[None, :])
            b_g = tl.load(g + rows, mask=m_t, other=0.0)
            last = tl.minimum(T - i_t * BT, BT) - 1
            g_last = tl.load(g + (bos + i_t * BT + last) * H + i_h)
            decay = tl.exp(tl.where(m_t, g_last - b_g, 0.0))
            h = h * tl.exp(g_last) + tl.dot(tl.trans(b_w * decay[:, None]), b_k, input_precision=PRECISION)
        _put_state(ht, i_bh.to(tl.int64), h_offs, m_h, V, K, h)

    @triton.jit
    def _cw_state_kernel(k, v, beta, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT,
                         H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         HAS_H0: tl.constexpr, IS_L2: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 2, channel-wise (:func:`state_sweep`): w = u − w_k S_0ᵀ;
        S ← S Diag(e^{g_L}) + Σ_s w_s (k_s ⊙ e^{g_L − g_s})ᵀ."""
        state_sweep(k, v, beta, g, u, wk, h0, w_out, hs, ht, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K, V,
                     1, BT, BT, BK, BV, HAS_H0, IS_L2, True, PRECISION)

    @triton.jit
    def _chunk_out_kernel(q, k, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT,
                          H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                          READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 3 (:func:`out_chunk`, per head): o = e^{g} (q S_0ᵀ) + [causal e^{g_t − g_s} q kᵀ] w."""
        out_chunk(q, k, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, V, 1, BT, BT, BK, BV,
                   HAS_ALPHA, READ_TOKEN, False, PRECISION)

    @triton.jit
    def _cw_out_kernel(q, k, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT,
                       H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_TOKEN: tl.constexpr,
                       PRECISION: tl.constexpr):
        """Stage 3, channel-wise (:func:`out_chunk`): o = (q ⊙ e^{gq}) S_0ᵀ + P w,
        P[t, s] = Σ_c q_tc k_sc e^{gq_tc − g_sc} (causal)."""
        out_chunk(q, k, la, g, w, hs, o, cu_seqlens, chunk_indices, T, NT, H, IS_VARLEN, K, V, 1, BT, BT, BK, BV,
                   True, READ_TOKEN, True, PRECISION)

    @triton.jit
    def _chunk_bwd_dh_kernel(q, k, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT,
                             H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             HAS_ALPHA: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                             IS_L2: tl.constexpr, READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Reverse sweep over chunks (:func:`dh_sweep`, per head). dS = ∂L/∂S_L of the chunk end:
        dw = Pᵀ do + e^{g_L − g} ⊙ (k dSᵀ);  dS ← e^{g_L} dS + (e^{gq} ⊙ do)ᵀ q − [l2] dwᵀ w_k."""
        dh_sweep(q, k, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K, V, 1,
                  BT, BT, BK, BV, HAS_ALPHA, HAS_DHT, HAS_H0, IS_L2, READ_TOKEN, False, PRECISION)

    @triton.jit
    def _cw_bwd_dh_kernel(q, k, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT,
                          H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, IS_L2: tl.constexpr,
                          READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Reverse sweep, channel-wise (:func:`dh_sweep`): dw = Pᵀ do + (k ⊙ e^{g_L − g}) dSᵀ;
        dS ← dS Diag(e^{g_L}) + doᵀ (q ⊙ e^{gq}) − [l2] dwᵀ w_k."""
        dh_sweep(q, k, la, g, wk, do, dht, dhs, dw, dh0, cu_seqlens, chunk_offsets, T, NT, H, IS_VARLEN, K, V, 1,
                  BT, BT, BK, BV, True, HAS_DHT, HAS_H0, IS_L2, READ_TOKEN, True, PRECISION)

    @triton.jit
    def _chunk_bwd_grad_kernel(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                               chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                               V: tl.constexpr, BT: tl.constexpr,
                               BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr,
                               BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        """Per chunk × head (all chunks in parallel, a loop over value blocks): dq, dk, dv, dβ, d log α from
        S_0 (chunk start), dS (chunk end), w, dw and (I + A)⁻¹ — the equations of
        :func:`.naive.delta_rule_chunk_backward` step 3; d log α is a reverse cumsum of dg within the chunk."""
        grad_per_head(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                       chunk_indices, T, NT, H, IS_VARLEN, K, V, 1, BT, BT, BK, BV, HAS_ALPHA, IS_L2, BEFORE,
                       READ_TOKEN, PRECISION)

    @triton.jit
    def _cw_bwd_grad_kernel(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                            chunk_indices, T, NT, H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Per chunk × head, channel-wise: the equations of :func:`.naive._channel_wise_backward` step 3;
        d log α ``[B, T, H, K]`` is a reverse cumsum over the chunk of dg per channel."""
        grad_channel(q, k, v, beta, la, g, ainv, w, hs, dhs, do, dw, dq, dk, dv, dbeta, dla, cu_seqlens,
                      chunk_indices, T, NT, H, IS_VARLEN, K, V, 1, BT, BT, BK, BV, IS_L2, BEFORE, READ_TOKEN,
                      PRECISION)


#: a value block holds at most this many state elements (BV × BK): compiled for sm_90 (bench/compile_sm90.py), the
#: backward kernels at BK = 128 ask for 281–312 KB of shared memory per block with BV = 64 — over the 227 KiB of an
#: H100 / H200 — and 149–197 KB with BV = 32; at BK ≤ 64 the block stays BV = 64.
MAX_VALUE_BLOCK = 4096


def value_block(BK: int, BVV: int) -> int:
    """BV, the value block of the state and backward kernels, for padded head dims BK (keys) and BVV (values)."""
    return min(BVV, max(16, MAX_VALUE_BLOCK // BK))


def _sizes(K: int, V: int, chunk_size: int):
    """Block sizes: BT (chunk), BK / BVV (padded head dims), BV (value block of the state kernels)."""
    if max(K, V) > MAX_D:
        raise ValueError(f"chunk (triton): head dims D_k = {K}, D_v = {V} must be ≤ {MAX_D}")
    BK, BVV = pow2(K), pow2(V)
    return pow2(chunk_size), BK, BVV, value_block(BK, BVV)


def _forward_stages(k, v, beta, la, h0, *, bias, placement, chunk_size, prec, store_ainv=False, cu_seqlens=None):
    """Stages 1–2 (gate cumsum, UT transform, inter-chunk state sweep) on contiguous inputs.

    Returns a dict of fp32 tensors: ``g [B, T, H]``, ``wk [B, T, H, K]`` (l2), ``ainv [B, T, H, BT]`` (l2 and
    ``store_ainv``), ``w [B, T, H, V]``, ``hs [NC, H, V, K]`` (chunk-start states, NC = every chunk of every
    sequence), ``ht [N, H, V, K]``, and the chunk ``layout`` (:class:`ChunkLayout`). With ``cu_seqlens`` (B = 1) each
    stage is still one launch: the UT kernel over all chunks of all sequences (the chunk-index table), the state
    kernel one program per (value block, sequence × head) over that sequence's chunks.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT, BK, BVV, BV = _sizes(K, V, chunk_size)
    lay = ChunkLayout(B, T, BT, cu_seqlens, k)
    f32 = dict(dtype=torch.float32, device=k.device)
    is_l2 = bias == "l2"
    cw = la is not None and la.dim() == 4
    g = torch.empty(*la.shape, **f32) if cw else torch.empty(B, T, H, **f32)
    u = torch.empty(B, T, H, V, **f32) if is_l2 else None
    wk = torch.empty(B, T, H, K, **f32) if is_l2 else None
    ainv = torch.empty(B, T, H, BT, **f32) if (is_l2 and store_ainv) else None
    w = torch.empty(B, T, H, V, **f32)
    hs = torch.empty(lay.NC, H, V, K, **f32)
    ht = torch.empty(lay.N, H, V, K, **f32)
    dummy = g
    flags = dict(IS_L2=is_l2, BEFORE=placement == "before_step", STORE_AINV=ainv is not None, PRECISION=prec,
                 IS_VARLEN=lay.varlen, num_warps=4)
    if cw:
        _cw_ut_kernel[(lay.NC, H)](
            k, v, beta, la, g, u if is_l2 else dummy, wk if is_l2 else dummy, ainv if ainv is not None else dummy,
            lay.cu, lay.table, T, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BVV=BVV, **flags)
    else:
        _chunk_ut_kernel[(lay.NC, H)](
            k, v, beta, la if la is not None else dummy, g, u if is_l2 else dummy, wk if is_l2 else dummy,
            ainv if ainv is not None else dummy, lay.cu, lay.table, T, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BVV=BVV,
            HAS_ALPHA=la is not None, **flags)
    (_cw_state_kernel if cw else _chunk_state_kernel)[(triton.cdiv(V, BV), lay.N * H)](
        k, v, beta, g, u if is_l2 else dummy, wk if is_l2 else dummy, h0 if h0 is not None else dummy, w, hs, ht,
        lay.cu, lay.offsets, T, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_H0=h0 is not None, IS_L2=is_l2,
        PRECISION=prec, IS_VARLEN=lay.varlen, num_warps=4)
    return dict(g=g, wk=wk, ainv=ainv, w=w, hs=hs, ht=ht, layout=lay)


def chunk_forward(q, k, v, beta, alpha=None, initial_state=None, *, bias="l2", placement="before_step",
                  read="token", cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
    """The three forward kernels, no autograd; arguments as :func:`chunk_delta_rule`. One launch per stage, with
    or without ``cu_seqlens``."""
    check_args(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BVV, BV = _sizes(K, V, chunk_size)
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    la = log_decay(alpha.float(), q).contiguous() if alpha is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    prec = dot_precision(q.dtype, allow_tf32)
    st = _forward_stages(k, v, beta, la, h0, bias=bias, placement=placement, chunk_size=chunk_size, prec=prec,
                         cu_seqlens=cu_seqlens)
    lay = st["layout"]
    o = torch.empty_like(v)
    args = (q, k, la if la is not None else st["g"], st["g"], st["w"], st["hs"], o, lay.cu, lay.table, T, lay.NT)
    meta = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, READ_TOKEN=read == "token", PRECISION=prec,
                IS_VARLEN=lay.varlen, num_warps=4)
    if la is not None and la.dim() == 4:
        _cw_out_kernel[(triton.cdiv(V, BV), lay.NC, H)](*args, **meta)
    else:
        _chunk_out_kernel[(triton.cdiv(V, BV), lay.NC, H)](*args, HAS_ALPHA=la is not None, **meta)
    return o, st["ht"].to(initial_state.dtype if initial_state is not None else q.dtype)


def chunk_backward(q, k, v, beta, alpha, initial_state, do, dht, *, bias="l2", placement="before_step",
                   read="token", cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
    """Gradients of :func:`chunk_forward` on the backward kernels (the Triton twin of
    :func:`.naive.delta_rule_chunk_backward`).

    Args: as :func:`chunk_delta_rule`, plus ``do: [B, T, H, D_v]`` and ``dht: [N, H, D_v, D_k]`` or None.

    Returns:
        ``(dq, dk, dv, dbeta, dalpha, dh0)`` in the dtypes of the inputs (``dalpha`` / ``dh0`` None when
        ``alpha`` / ``initial_state`` are None).

    Kernels: the forward stages 1–2 are re-run (recomputing g, w_k, (I + A)⁻¹, w and the chunk-start states),
    ``_chunk_bwd_dh_kernel`` sweeps the chunks in reverse for dS and dw, and ``_chunk_bwd_grad_kernel`` forms
    the per-input gradients of every chunk in parallel. With ``cu_seqlens`` each is still one launch (the reverse
    sweep: one program per value block × sequence × head over that sequence's chunks; the others over the
    chunk-index table).
    """
    check_args(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BVV, BV = _sizes(K, V, chunk_size)
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    la = log_decay(alpha.float(), q).contiguous() if alpha is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    prec = dot_precision(q.dtype, allow_tf32)
    is_l2 = bias == "l2"
    st = _forward_stages(k, v, beta, la, h0, bias=bias, placement=placement, chunk_size=chunk_size, prec=prec,
                         store_ainv=True, cu_seqlens=cu_seqlens)
    lay = st["layout"]
    f32 = dict(dtype=torch.float32, device=q.device)
    dhs = torch.empty(lay.NC, H, V, K, **f32)
    dw = torch.empty(B, T, H, V, **f32)
    dh0 = torch.empty(lay.N, H, V, K, **f32) if h0 is not None else None
    dummy = st["g"]
    cw = la is not None and la.dim() == 4
    meta = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, IS_L2=is_l2, READ_TOKEN=read == "token", PRECISION=prec,
                IS_VARLEN=lay.varlen, num_warps=4)
    if not cw:
        meta["HAS_ALPHA"] = la is not None
    (_cw_bwd_dh_kernel if cw else _chunk_bwd_dh_kernel)[(triton.cdiv(V, BV), lay.N * H)](
        q, k, la if la is not None else dummy, st["g"], st["wk"] if is_l2 else dummy, do,
        dht if dht is not None else dummy, dhs, dw, dh0 if dh0 is not None else dummy, lay.cu, lay.offsets, T, lay.NT,
        HAS_DHT=dht is not None, HAS_H0=dh0 is not None, **meta)
    dq = torch.empty(B, T, H, K, **f32)
    dk = torch.empty(B, T, H, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    dbeta = torch.empty(B, T, H, **f32)
    dla = torch.empty(*la.shape, **f32) if la is not None else None
    (_cw_bwd_grad_kernel if cw else _chunk_bwd_grad_kernel)[(lay.NC, H)](
        q, k, v, beta, la if la is not None else dummy, st["g"], st["ainv"] if is_l2 else dummy, st["w"], st["hs"],
        dhs, do, dw, dq, dk, dv, dbeta, dla if dla is not None else dummy, lay.cu, lay.table, T, lay.NT,
        BEFORE=placement == "before_step", **meta)
    dalpha = None
    if alpha is not None:   # log_decay clamps α at the smallest normal: no gradient below it
        a = alpha.float()
        tiny = torch.finfo(a.dtype).tiny
        dalpha = torch.where(a >= tiny, dla / a.clamp_min(tiny), torch.zeros_like(a)).to(alpha.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), dalpha,
            dh0.to(initial_state.dtype) if dh0 is not None else None)


#: Which backward :class:`ChunkFunction` uses: ``"triton"`` (the backward kernels) or ``"torch"`` (autograd
#: through the torch chunk form, recomputed: the reference, kept as a fallback). ``ATLASLAB_CHUNK_BACKWARD``
#: sets the default.
BACKWARD = os.environ.get("ATLASLAB_CHUNK_BACKWARD", "triton").strip().lower()


class ChunkFunction(torch.autograd.Function):
    """Kernel forward; backward on the backward kernels (:func:`chunk_backward`), or, with
    ``BACKWARD == "torch"``, autograd of the torch chunk form recomputed under ``enable_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens, chunk_size, allow_tf32):
        ctx.save_for_backward(q, k, v, beta, alpha, initial_state)
        ctx.opts = dict(bias=bias, placement=placement, read=read, cu_seqlens=cu_seqlens)
        ctx.chunk_size = chunk_size
        ctx.allow_tf32 = allow_tf32
        return chunk_forward(q, k, v, beta, alpha, initial_state, bias=bias, placement=placement, read=read,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, allow_tf32=allow_tf32)

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        def torch_path():
            return _torch_backward(saved, need, do, dht, ctx.opts, ctx.chunk_size)

        def kernels():
            grads = chunk_backward(*saved, do, dht, chunk_size=ctx.chunk_size, allow_tf32=ctx.allow_tf32, **ctx.opts)
            return [gr if n else None for gr, n in zip(grads, need)]
        grads = torch_path() if BACKWARD == "torch" else with_torch_fallback(kernels, torch_path, "chunk backward")
        return (*grads, None, None, None, None, None, None)


def _torch_backward(saved, need, do, dht, opts, chunk_size):
    """The reference backward: autograd of :func:`.naive.delta_rule_chunk`, recomputed (≥ fp32)."""
    return reference_backward(delta_rule_chunk, saved, need, (do, dht), chunk_size=chunk_size, **opts)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                     bias: str = "l2", placement: str = "before_step", read: str = "token",
                     cu_seqlens: Optional[torch.LongTensor] = None, chunk_size: int = 64,
                     allow_tf32: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linear-memory delta / Hebbian rule, chunk-parallel on Triton (exact; same results as the token loop).

    Args:
        q, k: ``[B, T, H, D_k]``; v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step size β_t = η_t γ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, ``[B, T, H, D_k]`` channel-wise (S ← S Diag(α_t)), or
            None.
        initial_state: ``[N, H, D_v, D_k]`` or None (zeros).
        bias, placement, read: as :func:`.fused_recurrent.fused_recurrent_delta_rule`.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1), or None. Run natively: one launch per
            kernel over the chunks of all sequences (:func:`prepare_chunk_indices`), states restart at each boundary.
        chunk_size: the kernel's compute block BT (a power of two ≥ 16; it does not change the result).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`atlaslab.kernels.utils.dot_precision` chooses (TF32
            for fp16 / bf16 inputs, else torch's float32 matmul precision).

    Returns:
        ``o: [B, T, H, D_v]`` and the final state ``[N, H, D_v, D_k]``.
    """
    return ChunkFunction.apply(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens,
                               int(chunk_size), allow_tf32)
