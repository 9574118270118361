"""Where a chunk program works and what it loads: chunk / sequence spans (dense or ``cu_seqlens``), token and
window-slot rows, tiles, gates and causal masks, shared by the chunk kernels of the delta, window and momentum rules.

Row conventions: a tensor [B, T, H, N] (or [B, T·C, H, N] for window slots) is addressed by flat rows (b·T + t)·H + h
and a column index < N; a chunk has BT tokens (rows ``rows``, mask ``m_t``) and BS write rows ("slots": the tokens
themselves for C = 1, the BT·C window slots for C > 1; rows ``srow``, their tokens' rows ``trow``, local token
``tau``, mask ``m_s``). Each piece is a ``@triton.jit`` body that Triton inlines into the calling kernel.
"""
from __future__ import annotations

from atlaslab.kernels.common.lang import tl, triton

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
    def chunk_program(cu_seqlens, chunk_indices, T, NT, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
        """Set-up of a per-chunk program (grid: global chunk × head, all chunks of all sequences in one launch):
        (i_c, i_h, :func:`chunk_span`'s i_t, bos, T, o_i = arange(BT), o_k = arange(BK), m_k)."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        return i_c, i_h, i_t, bos, T, o_i, o_k, m_k

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

    @triton.jit
    def sweep_span(cu_seqlens, chunk_offsets, T, NT, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
        """Where a sequential sweep program (grid: value block × sequence·head) works: (i_v its value block, i_bh
        the state row, i_h, and :func:`sequence_span`'s first row bos, length T, chunks NT, first chunk row boc)."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        return i_v, i_bh, i_h, bos, T, NT, boc

    @triton.jit
    def state_rows(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """A token-by-token program's state block (grid: value block × sequence·head): (i_v, i_nh the state row,
        i_n its sequence, i_h, :func:`state_block`'s o_k, o_v, m_k, m_v, m_h, and state_offs, the block's offsets
        in the ``[N, H, V, K]`` states)."""
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1)
        i_n = i_nh // H
        i_h = i_nh % H
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
        state_offs = i_nh.to(tl.int64) * V * K + h_offs
        return i_v, i_nh, i_n, i_h, o_k, o_v, m_k, m_v, m_h, state_offs

    @triton.jit
    def recurrent_program(h0, cu_seqlens, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
        """Set-up of a token-by-token program over one sequence of packed (``cu_seqlens``) or equal ones: (i_h, the
        sequence's first row bos and its length, :func:`state_rows`' o_k, o_v, m_k, m_v, m_h, state_offs, and the
        block's fp32 rows of the initial state h ``[BV, BK]`` (0 without ``HAS_H0``))."""
        i_v, i_nh, i_n, i_h, o_k, o_v, m_k, m_v, m_h, state_offs = state_rows(H, K, V, BK, BV)
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        else:
            bos = i_n.to(tl.int64) * T
            length = T
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_H0:
            h += tl.load(h0 + state_offs, mask=m_h, other=0.0).to(tl.float32)
        return i_h, bos, length, o_k, o_v, m_k, m_v, m_h, state_offs, h

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
    def state_block(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Value block i_v of a ``[V, K]`` state: (o_k = arange(BK), o_v = its BV value rows, m_k, m_v, m_h the
        ``[BV, BK]`` mask, h_offs = o_v·K + o_k the block's offsets within one state)."""
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        return o_k, o_v, m_k, m_v, m_h, h_offs

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
    def chunk_rows(o_i, o_s, bos, i_t, i_h, T, H: tl.constexpr, C: tl.constexpr, BT: tl.constexpr):
        """Chunk i_t's rows: its tokens (:func:`token_rows`: m_t, rows) and its write rows (:func:`slot_tokens`,
        :func:`slot_rows`: tau, m_s, srow, trow) for o_i = arange(BT), o_s = arange(BS)."""
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        tau = slot_tokens(o_s, C)
        m_s, srow, trow = slot_rows(bos, i_t, i_h, o_s, tau, T, H, C, BT)
        return m_t, rows, tau, m_s, srow, trow

    @triton.jit
    def _sweep_program(cu_seqlens, chunk_offsets, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       C: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
        """Set-up of a sequential sweep program (grid: value block × sequence·head): (i_bh the state row, i_h, the
        sequence's first row bos, length T, chunks NT, first chunk row boc, o_i = arange(BT) (a chunk's tokens),
        o_s = arange(BS) (its write rows), tau = their local tokens, o_k, o_v (this value block), m_k, m_v, and
        m_h, h_offs: a ``[BV, BK]`` state block's mask and offsets o_v·K + o_k)."""
        i_v, i_bh, i_h, bos, T, NT, boc = sweep_span(cu_seqlens, chunk_offsets, T, NT, H, BT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_s = tl.arange(0, BS)
        o_k, o_v, m_k, m_v, m_h, h_offs = state_block(i_v, K, V, BK, BV)
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
        (o_t = S_{t−1} q_t); shape of b_g. With READ_TOKEN = before_step, at the window slots' rows, it is also
        the write gate G of :func:`_write_gate` (g before_step, g − log α after_step) loading log α itself."""
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
    def _chunk_row(i_c, i_t, boc, C: tl.constexpr):
        """The global chunk index of chunk program i_c (its row in the chunk-state tensors), written as each kernel
        family always has: boc + i_t (C = 1; boc = i_c − i_t) or i_c (window kernels); their builds depend on it."""
        if C == 1:
            row = boc + i_t
        else:
            row = i_c.to(tl.int64)
        return row
