"""Decayed products inside a chunk: e^{a_t − b_s}-weighted scores per head or per key channel, token by token
(C = 1) or over the C window slots of each token, and their two gradients (docs/kernels.md#delta-rule).
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

if triton is not None:

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
    def _causal_column(o_i, s, STRICT: tl.constexpr):
        """Column s of a chunk's causal mask: (sel, the one-hot [BT] mask of token s; rows, the tokens t that see
        it: t > s (STRICT) or t ≥ s)."""
        sel = o_i == s
        if STRICT:
            rows = o_i > s
        else:
            rows = o_i >= s
        return sel, rows

    @triton.jit
    def _decayed_dot(x, y, a, b, o_i, BT: tl.constexpr, STRICT: tl.constexpr):
        """M[t, s] = Σ_c x[t, c] y[s, c] e^{a[t, c] − b[s, c]} for s < t (STRICT) or s ≤ t, else 0. [BT, BT].

        The exponents are clamped at 0: on the causal part of a chunk's real rows a − b ≤ 0 already (cumulative
        log-decays only fall), and a padded row past a ragged chunk's end (a loaded as 0) must not give
        exp(−b) = inf, which times its zero x is NaN in the column sums of the backward."""
        M = tl.zeros([BT, BT], dtype=tl.float32)
        for s in range(0, BT):
            sel, rows = _causal_column(o_i, s, STRICT)
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
            sel, rows = _causal_column(o_i, s, STRICT)
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
