"""Token-by-token Triton kernel of the Omega-window rule (c ≥ 1 slots per token), for decoding with a cached state.

As :mod:`atlaslab.kernels.delta_rule.fused_recurrent`: one program per (value block, sequence, head) keeps its rows
of the state in registers over the sequence; at each token the c slots' errors are taken at the pre-step state
(reference: :func:`.naive.window_rule_recurrent`). With ``cu_seqlens`` the state restarts at every sequence start
and the slots' gather (:func:`.naive.window_slots`) stops there. The backward runs on the chunk window backward
kernels (:func:`.chunk.window_backward`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.delta_rule.fused_recurrent import recurrent_launch
from atlaslab.kernels.window_rule.chunk import window_backward
from atlaslab.kernels.window_rule.naive import check_window_args

if triton is not None:
    from atlaslab.kernels.common.index import recurrent_program

    @triton.jit
    def _fused_window_kernel(q, xs, vs, coef, alpha, h0, o, ht, cu_seqlens, T, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             HAS_ALPHA: tl.constexpr, CHANNEL: tl.constexpr, HAS_H0: tl.constexpr,
                             STORE_FINAL: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                             READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr):
        """One program per (value block, sequence, head): at token t, the C window slots' errors are all taken at
        the pre-step (decayed, before_step) state, then S ← S Diag(a_t) + Σ_j coef_j (v_j − S x_j) x_jᵀ.
        Varlen (``IS_VARLEN``): sequence i_n is rows ``cu_seqlens[i_n] … cu_seqlens[i_n + 1]`` of the packed B = 1
        tensors (its slots, rows (bos + t)·C + j, never reach before bos: the caller's gather gives them coef 0)."""
        i_h, bos, length, o_k, o_v, m_k, m_v, m_h, state_offs, h = recurrent_program(
            h0, cu_seqlens, T, H, K, V, BK, BV, HAS_H0, IS_VARLEN)
        for t in range(0, length.to(tl.int32)):
            row = (bos + t) * H + i_h
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if not READ_TOKEN:
                b_o = tl.sum(h * b_q[None, :], axis=1)
            if HAS_ALPHA:
                if CHANNEL:
                    b_a = tl.load(alpha + row * K + o_k, mask=m_k, other=1.0).to(tl.float32)[None, :]
                else:
                    b_a = tl.load(alpha + row).to(tl.float32)
                if BEFORE:
                    h = h * b_a
            upd = tl.zeros([BV, BK], dtype=tl.float32)
            for j in tl.static_range(C):
                srow = ((bos + t) * C + j) * H + i_h          # slot (t, j) of [B, T, C, H, ...]
                b_x = tl.load(xs + srow * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_v = tl.load(vs + srow * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_c = tl.load(coef + srow).to(tl.float32)
                if IS_L2:
                    e = b_c * (b_v - tl.sum(h * b_x[None, :], axis=1))
                else:
                    e = b_c * b_v
                upd += e[:, None] * b_x[None, :]
            if HAS_ALPHA:
                if not BEFORE:
                    h = h * b_a
            h += upd
            if READ_TOKEN:
                b_o = tl.sum(h * b_q[None, :], axis=1)
            tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_FINAL:
            tl.store(ht + state_offs, h.to(ht.dtype.element_ty), mask=m_h)


def fused_window_forward(q, xs, vs, coef, alpha=None, initial_state=None, *, bias, placement,
                         read, cu_seqlens=None, output_final_state=True):
    """The token-by-token window kernel alone (no autograd); arguments as :func:`fused_recurrent_window_rule`."""
    c = check_window_args(q, xs, vs, coef, alpha, initial_state, cu_seqlens)
    B, T, H, _ = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    V = vs.shape[-1]
    q, xs, vs, coef = (x.contiguous() for x in (q, xs, vs, coef))
    alpha, h0, ht, grid, meta = recurrent_launch(q, alpha, initial_state, cu_seqlens, N, V, bias=bias,
                                                 placement=placement, read=read,
                                                 output_final_state=output_final_state)
    o = torch.empty(B, T, H, V, dtype=vs.dtype, device=q.device)
    dummy = q
    cu = cu_seqlens.to(q.device).contiguous() if cu_seqlens is not None else dummy
    _fused_window_kernel[grid](
        q, xs, vs, coef, alpha if alpha is not None else dummy, h0 if h0 is not None else dummy, o,
        ht if ht is not None else dummy, cu, T, C=c, **meta)
    if ht is not None:
        ht = ht.to(initial_state.dtype if initial_state is not None else q.dtype)
    return o, ht


class FusedWindowFunction(torch.autograd.Function):
    """Token-by-token window kernel forward; backward on the chunk window backward kernels
    (``chunk.BACKWARD == "torch"``: autograd of the torch window chunk form, recomputed)."""

    @staticmethod
    def forward(ctx, q, xs, vs, coef, alpha, initial_state, bias, placement, read, cu_seqlens):
        ctx.save_for_backward(q, xs, vs, coef, alpha, initial_state)
        ctx.opts = dict(bias=bias, placement=placement, read=read)
        if cu_seqlens is not None:
            ctx.opts["cu_seqlens"] = cu_seqlens
        return fused_window_forward(q, xs, vs, coef, alpha, initial_state, bias=bias, placement=placement, read=read,
                                    cu_seqlens=cu_seqlens)

    @staticmethod
    def backward(ctx, do, dht):
        grads = window_backward(ctx.saved_tensors, ctx.needs_input_grad[:6], do, dht, ctx.opts, 64)
        return (*grads, None, None, None, None)


def fused_recurrent_window_rule(q: torch.Tensor, xs: torch.Tensor, vs: torch.Tensor, coef: torch.Tensor,
                                alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                                *, bias: str, placement: str, read: str,
                                cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Omega-window (c ≥ 1) linear rule, token by token on one fused Triton kernel (the rule of
    :func:`.naive.window_rule_recurrent`).

    Args:
        q: ``[B, T, H, D_k]``; xs ``[B, T, c, H, D_k]``, vs ``[B, T, c, H, D_v]``, coef ``[B, T, c, H]``: the window
            slots (:func:`.naive.window_slots`; coef = η_t γ_j, 0 on slots before the history).
        alpha: ``[B, T, H]`` per head, ``[B, T, H, D_k]`` channel-wise, or None.
        initial_state: ``[N, H, D_v, D_k]`` or None (N = B, or the number of packed sequences).
        bias, placement, read: as :func:`atlaslab.kernels.delta_rule.fused_recurrent.fused_recurrent_delta_rule`.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1, tensors ``[1, total_T, ...]``), or None: one
            program per (value block, sequence, head), the state restarting from ``initial_state[n]`` (or zero) at
            each sequence start. The slots must not reach across a sequence start: build them with
            :func:`.naive.window_slots` (``cu_seqlens=...``), which gives those slots coefficient 0.

    Returns:
        ``o: [B, T, H, D_v]`` and the final state(s) ``[N, H, D_v, D_k]``.

    Backward: as :func:`.chunk.chunk_window_rule`'s (:func:`.chunk.window_backward`: the window
    backward kernels, per-head or channel-wise decay, with the same ``cu_seqlens``).
    """
    return FusedWindowFunction.apply(q, xs, vs, coef, alpha, initial_state, bias, placement, read, cu_seqlens)
