"""Token-by-token Triton kernel for linear memory with the (gated) delta rule or the Hebbian rule.

For inference / decoding with a cached state (fla's ``fused_recurrent``): one program per (value block,
sequence, head) keeps its rows of the state S ``[BV, D_k]`` in registers over the whole sequence and writes
only o_t (and S_T at the end). The rules are those of :mod:`.naive` (l2 or dot bias, GD with step β_t,
per-head scalar or per-key-channel decay α_t placed ``before_step`` or ``after_step``, window c = 1, ``read``
token or chunk).
The state rows of a delta-rule memory evolve independently (S ← S(αI − βkkᵀ) + βvkᵀ acts on the right), so
splitting D_v across programs is exact.

Variable-length batches: ``cu_seqlens [N + 1]`` packs N sequences into B = 1; the state restarts from
``initial_state[n]`` (or zero) at each boundary.

Backward: :class:`FusedRecurrentFunction` runs the chunk backward kernels (:func:`.chunk.chunk_backward`, the same
rule's exact gradients); with ``chunk.BACKWARD == "torch"`` (``ATLASLAB_CHUNK_BACKWARD=torch``) it recomputes the
exact torch chunk form (:func:`.naive.delta_rule_chunk`) under ``enable_grad`` and differentiates it instead.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.delta_rule import chunk
from atlaslab.kernels.delta_rule.naive import check_args, delta_rule_chunk
from atlaslab.kernels.utils import BEFORE_STEP, check_head_dims, pow2, reference_backward


if triton is not None:
    from atlaslab.kernels.common.index import recurrent_program

    @triton.jit
    def _fused_recurrent_kernel(q, k, v, beta, alpha, h0, o, ht, cu_seqlens, T, H: tl.constexpr,
                                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                HAS_ALPHA: tl.constexpr, CHANNEL: tl.constexpr, HAS_H0: tl.constexpr,
                                STORE_FINAL: tl.constexpr,
                                IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                                IS_VARLEN: tl.constexpr):
        i_h, bos, length, o_k, o_v, m_k, m_v, m_h, state_offs, h = recurrent_program(
            h0, cu_seqlens, T, H, K, V, BK, BV, HAS_H0, IS_VARLEN)
        for t in range(0, length):
            row = (bos + t) * H + i_h                       # flat (token, head) index of [B, T, H, ...]
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + row).to(tl.float32)
            if not READ_TOKEN:
                b_o = tl.sum(h * b_q[None, :], axis=1)
            if HAS_ALPHA:
                if CHANNEL:   # S Diag(α_t): scales the key columns
                    b_a = tl.load(alpha + row * K + o_k, mask=m_k, other=1.0).to(tl.float32)[None, :]
                else:
                    b_a = tl.load(alpha + row).to(tl.float32)
                if BEFORE:
                    h = h * b_a
            if IS_L2:
                err = b_v - tl.sum(h * b_k[None, :], axis=1)   # v − S k  (S decayed already when BEFORE)
                upd = b_beta * err
            else:
                upd = b_beta * b_v
            if HAS_ALPHA:
                if not BEFORE:
                    h = h * b_a
            h += upd[:, None] * b_k[None, :]
            if READ_TOKEN:
                b_o = tl.sum(h * b_q[None, :], axis=1)
            tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_FINAL:
            tl.store(ht + state_offs, h.to(ht.dtype.element_ty), mask=m_h)


#: fp32 state elements (BV × BK) one program of the token-by-token delta and window kernels keeps in registers
STATE_BLOCK = 8192


def recurrent_launch(q, alpha, initial_state, cu_seqlens, N: int, V: int, *, bias, placement, read,
                     output_final_state):
    """The launch set-up the token-by-token delta and window kernels share: ``(alpha, h0, ht, grid, meta)`` with
    alpha, h0 contiguous (or None), ``ht`` the fp32 final states ``[N, H, D_v, D_k]`` to fill (or None), the grid
    (value block × sequence·head) and the sizes and constexpr flags. One program holds whole state rows (D_k ≤
    :data:`MAX_D <atlaslab.kernels.utils.MAX_D>`), D_v in blocks of ≤ :data:`STATE_BLOCK` elements."""
    H, K = q.shape[2], q.shape[3]
    check_head_dims("fused_recurrent", K)
    alpha = alpha.contiguous() if alpha is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    ht = torch.empty(N, H, V, K, dtype=torch.float32, device=q.device) if output_final_state else None
    BK = pow2(K, 16)
    BV = min(pow2(V, 16), max(16, STATE_BLOCK // BK))
    meta = dict(H=H, K=K, V=V, BK=BK, BV=BV, HAS_ALPHA=alpha is not None,
                CHANNEL=alpha is not None and alpha.dim() == 4, HAS_H0=h0 is not None, STORE_FINAL=ht is not None,
                IS_L2=bias == "l2", BEFORE=placement == BEFORE_STEP, READ_TOKEN=read == "token",
                IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return alpha, h0, ht, (triton.cdiv(V, BV), N * H), meta


def fused_recurrent_forward(q, k, v, beta, alpha=None, initial_state=None, *, bias, placement,
                            read, cu_seqlens=None, output_final_state=True):
    """The kernel alone (no autograd); arguments as :func:`fused_recurrent_delta_rule`."""
    N = check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    alpha, h0, ht, grid, meta = recurrent_launch(q, alpha, initial_state, cu_seqlens, N, v.shape[-1], bias=bias,
                                                 placement=placement, read=read,
                                                 output_final_state=output_final_state)
    o = torch.empty_like(v)
    dummy = q   # never read: the constexpr flags skip the loads
    _fused_recurrent_kernel[grid](
        q, k, v, beta, alpha if alpha is not None else dummy, h0 if h0 is not None else dummy, o,
        ht if ht is not None else dummy, cu_seqlens if cu_seqlens is not None else dummy, q.shape[1], **meta)
    if ht is not None:
        ht = ht.to(initial_state.dtype if initial_state is not None else q.dtype)
    return o, ht


class FusedRecurrentFunction(torch.autograd.Function):
    """Kernel forward; backward on the chunk backward kernels (or autograd of the torch chunk form, recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens):
        ctx.save_for_backward(q, k, v, beta, alpha, initial_state)
        ctx.opts = dict(bias=bias, placement=placement, read=read, cu_seqlens=cu_seqlens)
        return fused_recurrent_forward(q, k, v, beta, alpha, initial_state, bias=bias, placement=placement,
                                       read=read, cu_seqlens=cu_seqlens)

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        if chunk.BACKWARD != "torch":   # the chunk backward kernels compute the same rule's gradients
            T = saved[0].shape[1]
            grads = chunk.chunk_backward(*saved, do, dht, chunk_size=min(64, max(16, T)), **ctx.opts)
            return (*[g if n else None for g, n in zip(grads, need)], None, None, None, None)
        grads = reference_backward(delta_rule_chunk, saved, need, (do, dht), chunk_size=64, **ctx.opts)
        return (*grads, None, None, None, None)


def fused_recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                               *, bias: str, placement: str, read: str,
                               cu_seqlens: Optional[torch.LongTensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linear-memory delta / Hebbian rule, token by token on one fused Triton kernel.

    Args:
        q, k: ``[B, T, H, D_k]`` queries and keys (featurised already; ℓ2-normalised keys keep the delta rule stable).
        v: ``[B, T, H, D_v]`` values.
        beta: ``[B, T, H]`` step size β_t = η_t γ_t.
        alpha: ``[B, T, H]`` kept fraction α_t of the per-head decay, ``[B, T, H, D_k]`` channel-wise decay
            (S ← S Diag(α_t), GLA-style), or None (no retention).
        initial_state: ``[N, H, D_v, D_k]`` state to continue from (N = B, or the number of sequences with
            ``cu_seqlens``), or None (zeros).
        bias: ``"l2"`` (delta rule) or ``"dot"`` (Hebbian / linear attention).
        placement: ``"before_step"`` (Gated DeltaNet: gradient at α_t S_{t−1}) or ``"after_step"``.
        read: ``"token"`` (o_t = S_t q_t) or ``"chunk"`` (o_t = S_{t−1} q_t, the b = 1 chunk read).
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B = 1), or None.

    Returns:
        ``o: [B, T, H, D_v]`` (dtype of v) and the final state ``[N, H, D_v, D_k]``.
    """
    return FusedRecurrentFunction.apply(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens)
