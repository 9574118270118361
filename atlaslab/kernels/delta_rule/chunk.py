"""Chunk-parallel Triton forward and backward of the linear-memory (gated) delta / Hebbian rule, in fla's stages.

Forward: the UT transform per chunk (``_chunk_ut_kernel``, all chunks in parallel), the inter-chunk state sweep
(``_chunk_state_kernel``, sequential over chunks) and the output (``_chunk_out_kernel``); backward: the stages
re-run, a reverse sweep for dS (``_chunk_bwd_dh_kernel``) and every chunk's gradients in parallel
(``_chunk_bwd_grad_kernel``); the ``_cw_*`` kernels for channel-wise decay. The math is :func:`.naive.delta_rule_chunk`
and :func:`.naive.delta_rule_chunk_backward` (docs/kernels.md#delta-rule). Each stage is one ``@triton.jit`` body
in :mod:`atlaslab.kernels.common` (shared with the Omega-window kernels of :mod:`atlaslab.kernels.window_rule.chunk`,
which run them with C > 1 slots per token), inlined into the kernels here and switched by constexpr flags; the
kernels here are the C = 1 entry points that the host code launches by name; ``cu_seqlens`` runs natively
(one launch per stage over all chunks of all sequences). ``BACKWARD = "torch"`` (``ATLASLAB_CHUNK_BACKWARD=torch``)
switches this op's and the window op's backward to autograd through the torch chunk form.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.delta_rule.naive import check_args, delta_rule_chunk
from atlaslab.kernels.utils import (BEFORE_STEP, ChunkLayout, check_head_dims, dot_precision, log_decay, log_gate_grad,
                                   pow2, reference_backward, with_torch_fallback)


if triton is not None:
    from atlaslab.kernels.common.index import (chunk_program, chunk_span, load_tile, load_vec, _put_state, _state_tile,
                                               _sweep_program, token_rows, _write_gate)
    from atlaslab.kernels.common.chunk_ut import ut_solve
    from atlaslab.kernels.common.chunk_h import dh_sweep, state_sweep
    from atlaslab.kernels.common.chunk_o import out_chunk
    from atlaslab.kernels.common.chunk_grad import grad_channel, grad_per_head

    @triton.jit
    def _token_ut(b_k, v, beta, b_g, b_la, u_out, wk_out, ainv_out, rows, m_t, o_i, o_k, m_k, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BVV: tl.constexpr, BEFORE: tl.constexpr, STORE_AINV: tl.constexpr,
                  CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """The ℓ2 UT system of a C = 1 chunk (:func:`ut_solve`, rows = its tokens) from its keys b_k ``[BT, BK]``,
        g and log α (per head ``[BT]`` or channel-wise ``[BT, BK]``): loads v and β, G = g (before_step) or
        g − log α (after_step)."""
        o_v = tl.arange(0, BVV)
        m_v = o_v < V
        b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.0).to(tl.float32)
        b_beta = load_vec(beta, rows, m_t)
        b_G = _write_gate(b_g, b_la, BEFORE)
        ut_solve(b_k, b_beta, b_v, b_G, b_g, b_g, u_out, wk_out, ainv_out, rows, m_t, o_i, o_i, o_i, o_k, m_k,
                  o_v, m_v, K, V, 1, BT, BT, STORE_AINV, CHANNEL, PRECISION)

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
            m_k = o_k < K
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            _token_ut(b_k, v, beta, b_g, b_la, u_out, wk_out, ainv_out, rows, m_t, o_i, o_k, m_k, K, V, BT, BVV,
                      BEFORE, STORE_AINV, False, PRECISION)

    @triton.jit
    def _cw_ut_kernel(k, v, beta, la, g_out, u_out, wk_out, ainv_out, cu_seqlens, chunk_indices, T, NT,
                      H: tl.constexpr, IS_VARLEN: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr, IS_L2: tl.constexpr,
                      BEFORE: tl.constexpr, STORE_AINV: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1, channel-wise: g = chunk-local cumsum of log α per key channel; for l2 the UT system
        (:func:`ut_solve`): A[t, s] = β_t Σ_c k_tc k_sc e^{G_tc − g_sc} (s < t), (I + A)⁻¹, u = (I + A)⁻¹ β v,
        w_k = (I + A)⁻¹ β (k ⊙ e^G)."""
        i_c, i_h, i_t, bos, T, o_i, o_k, m_k = chunk_program(cu_seqlens, chunk_indices, T, NT, K, BT, BK, IS_VARLEN)
        m_t, rows = token_rows(o_i, bos, i_t, i_h, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        b_la = load_tile(la, rows, o_k, K, m_tk)
        b_g = tl.cumsum(b_la, axis=0)
        tl.store(g_out + rows[:, None] * K + o_k[None, :], b_g, mask=m_tk)
        if IS_L2:
            b_k = load_tile(k, rows, o_k, K, m_tk)
            _token_ut(b_k, v, beta, b_g, b_la, u_out, wk_out, ainv_out, rows, m_t, o_i, o_k, m_k, K, V, BT, BVV,
                      BEFORE, STORE_AINV, True, PRECISION)

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
    check_head_dims("chunk (triton)", K, V)
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
    flags = dict(IS_L2=is_l2, BEFORE=placement == BEFORE_STEP, STORE_AINV=ainv is not None, PRECISION=prec,
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


def chunk_forward(q, k, v, beta, alpha=None, initial_state=None, *, bias, placement,
                  read, cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
    """The three forward kernels, no autograd; arguments as :func:`chunk_delta_rule`. One launch per stage, with
    or without ``cu_seqlens``."""
    check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
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


def chunk_backward(q, k, v, beta, alpha, initial_state, do, dht, *, bias, placement,
                   read, cu_seqlens=None, chunk_size: int = 64, allow_tf32: Optional[bool] = None):
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
    check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
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
        BEFORE=placement == BEFORE_STEP, **meta)
    dalpha = log_gate_grad(dla, alpha.float()).to(alpha.dtype) if alpha is not None else None
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
                     bias: str, placement: str, read: str,
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
