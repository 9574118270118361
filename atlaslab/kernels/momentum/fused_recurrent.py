"""Token-by-token Triton kernel for a linear memory trained by momentum GD at any semantic chunk size b ≥ 1, for
decoding with a cached state: M, S, the chunk-start anchor M_a and the running decay product P are inputs and
outputs, so one token per call equals one call.

One program per (value block × batch·head) keeps its rows of M, S and M_a in fp32 registers over the sequence
(rows evolve independently, so splitting D_v is exact; every step is rank-1, no ``tl.dot``). The backward
re-runs the forward storing the pre-step states, then one reverse sweep (``_fused_momentum_bwd_kernel``); the
sums over D_v are added in torch. Reference: :func:`.naive.momentum_recurrent_reference` (docs/kernels.md#momentum,
with the backward's equations). ``BACKWARD = "torch"`` (``ATLASLAB_MOMENTUM_BACKWARD=torch``) runs autograd
through the reference instead.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.momentum.naive import check_recurrent_args, momentum_recurrent_reference
from atlaslab.kernels.utils import BEFORE_STEP, pow2, reference_backward

#: fp32 elements of each state block one program holds: three in the forward (M, S, M_a), seven in the backward
#: (dM, dS, dM_a, M_{t−1}, S_{t−1}, M_a, M_t); sized so that neither spills registers on sm_90 at D_k = 128
#: (``bench/compile_sm90.py``)
STATE_BLOCK = 2048
STATE_BLOCK_BWD = 1024


# ------------------------------------------------------------------------------------------ Triton kernel

if triton is not None:
    from atlaslab.kernels.common.index import state_rows

    @triton.jit
    def _load_alpha(alpha, row, o_k, m_k, K: tl.constexpr, HAS_ALPHA: tl.constexpr, CHANNEL: tl.constexpr):
        """α_t of token ``row`` → (α_t, α_t as it multiplies M): 1 without retention, a scalar per head, or the
        [BK] key-channel vector and its [1, BK] row (channel-wise)."""
        b_a = 1.0
        b_am = 1.0
        if HAS_ALPHA:
            if CHANNEL:
                b_a = tl.load(alpha + row * K + o_k, mask=m_k, other=1.0).to(tl.float32)
                b_am = b_a[None, :]
            else:
                b_a = tl.load(alpha + row).to(tl.float32)
                b_am = b_a
        return b_a, b_am

    @triton.jit
    def _fused_momentum_kernel(q, k, v, beta, theta, alpha, m0, s0, a0, p0, o, mt, st, at, pt, hm, hs, ha, hp,
                               T, off, b, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                               BV: tl.constexpr, HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr,
                               BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr, STORE_STATES: tl.constexpr,
                               CHANNEL: tl.constexpr = False):
        """One program per (value block, batch·head): carries its rows of M, S, M_a and P over the T tokens (the
        module docstring's equations; ``off`` = position mod b of the first token). ``STORE_STATES`` (the backward's
        recompute) also writes every token's pre-step M_{t−1}, S_{t−1} and anchor M_a ``[B, T, H, D_v, D_k]`` and
        P before α_t, P̃_t ``[B, T, H]``. ``CHANNEL``: channel-wise α (``alpha [B, T, H, D_k]``, P a ``[BK]``
        vector, ``p0, pt [B, H, D_k]``, P̃ ``[B, T, H, D_k]``): M ← M Diag(α_t) + S, gradient at M_a Diag(P)."""
        i_v, i_bh, i_b, i_h, o_k, o_v, m_k, m_v, m_h, state_offs = state_rows(H, K, V, BK, BV)
        b_M = tl.load(m0 + state_offs, mask=m_h, other=0.0).to(tl.float32)
        b_S = tl.load(s0 + state_offs, mask=m_h, other=0.0).to(tl.float32)
        b_A = tl.load(a0 + state_offs, mask=m_h, other=0.0).to(tl.float32)
        if CHANNEL:
            b_P = tl.load(p0 + i_bh.to(tl.int64) * K + o_k, mask=m_k, other=1.0).to(tl.float32)   # [BK]
        else:
            b_P = tl.load(p0 + i_bh).to(tl.float32)
        for t in range(0, T):
            row = (i_b.to(tl.int64) * T + t) * H + i_h      # flat (token, head) index of [B, T, H, ...]
            start = ((off + t) % b) == 0                    # a chunk starts: M_a ← M, P ← 1
            b_A = tl.where(start, b_M, b_A)
            b_P = tl.where(start, 1.0, b_P)
            if STORE_STATES:
                t_offs = row * V * K + o_v[:, None] * K + o_k[None, :]
                tl.store(hm + t_offs, b_M, mask=m_h)
                tl.store(hs + t_offs, b_S, mask=m_h)
                tl.store(ha + t_offs, b_A, mask=m_h)
                if CHANNEL:
                    tl.store(hp + row * K + o_k, b_P, mask=o_k + i_v * BK < K)
                else:
                    tl.store(hp + row, b_P, mask=i_v == 0)
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + row).to(tl.float32)
            b_th = tl.load(theta + row).to(tl.float32)
            b_a, b_am = _load_alpha(alpha, row, o_k, m_k, K, HAS_ALPHA, CHANNEL)
            b_P = b_P * b_a
            if IS_L2:
                if CHANNEL:
                    if BEFORE:
                        pred = tl.sum(b_A * (b_P * b_k)[None, :], axis=1)   # (M_a Diag(P)) k_t
                    else:
                        pred = tl.sum(b_A * b_k[None, :], axis=1)
                else:
                    pred = tl.sum(b_A * b_k[None, :], axis=1)   # M_a k_t
                    if BEFORE:
                        pred = pred * b_P                       # (P M_a) k_t
                b_e = pred - b_v
            else:
                b_e = -b_v
            b_S = b_th * b_S - (b_beta * b_e)[:, None] * b_k[None, :]
            b_M = b_am * b_M + b_S
            if READ_TOKEN:
                b_o = tl.sum(b_M * b_q[None, :], axis=1)
            else:
                b_o = tl.sum(b_A * b_q[None, :], axis=1)
            tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(mt + state_offs, b_M, mask=m_h)
        tl.store(st + state_offs, b_S, mask=m_h)
        tl.store(at + state_offs, b_A, mask=m_h)
        if CHANNEL:                                         # every value block has the same P: one writes it
            tl.store(pt + i_bh.to(tl.int64) * K + o_k, b_P, mask=o_k + i_v * BK < K)
        else:
            tl.store(pt + i_bh, b_P, mask=i_v == 0)

    @triton.jit
    def _fused_momentum_bwd_kernel(q, k, v, beta, theta, alpha, hm, hs, ha, hp, do, dmt, dst, dat, dpt,
                                   dq, dk, dv, dbeta, dtheta, dalpha, dm0, ds0, da0, dp0, T, off, b, B,
                                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                                   BV: tl.constexpr, HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr,
                                   BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr, HAS_DMT: tl.constexpr,
                                   HAS_DST: tl.constexpr, HAS_DAT: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Reverse sweep, one program per (value block, batch·head): carries dM, dS, dM_a = ∂L/∂(state after token t)
        and this block's share of dP back over the tokens, from the stored pre-step states (the module docstring's
        backward). Reductions over D_v (dq, dk, dβ, dθ, dα, dP_0) are written per value block (leading ``[NV]``) and
        summed in torch; dv and the initial states' gradients are per row. ``CHANNEL``: channel-wise α, dP and dα
        per key channel (``[BK]``; dα ``[NV, B, T, H, D_k]``, dP_0 ``[NV, B, H, D_k]``)."""
        i_v, i_bh, i_b, i_h, o_k, o_v, m_k, m_v, m_h, state_offs = state_rows(H, K, V, BK, BV)
        part = i_v.to(tl.int64) * B * T * H                 # this value block's slice of the [NV, B, T, H, ...] sums
        b_dM = tl.zeros([BV, BK], dtype=tl.float32)
        b_dS = tl.zeros([BV, BK], dtype=tl.float32)
        b_dA = tl.zeros([BV, BK], dtype=tl.float32)
        if CHANNEL:   # dP_T: counted by one value block
            b_dP = tl.load(dpt + i_bh.to(tl.int64) * K + o_k, mask=o_k + i_v * BK < K, other=0.0).to(tl.float32)
        else:
            b_dP = tl.load(dpt + i_bh, mask=i_v == 0, other=0.0).to(tl.float32)   # dP_T: counted by one value block
        if HAS_DMT:
            b_dM += tl.load(dmt + state_offs, mask=m_h, other=0.0).to(tl.float32)
        if HAS_DST:
            b_dS += tl.load(dst + state_offs, mask=m_h, other=0.0).to(tl.float32)
        if HAS_DAT:
            b_dA += tl.load(dat + state_offs, mask=m_h, other=0.0).to(tl.float32)
        for i in range(0, T):
            t = T - 1 - i
            row = (i_b.to(tl.int64) * T + t) * H + i_h
            t_offs = row * V * K + o_v[:, None] * K + o_k[None, :]
            start = ((off + t) % b) == 0
            b_Mp = tl.load(hm + t_offs, mask=m_h, other=0.0)    # M_{t−1}, S_{t−1}, M_a (fp32)
            b_Sp = tl.load(hs + t_offs, mask=m_h, other=0.0)
            b_A = tl.load(ha + t_offs, mask=m_h, other=0.0)
            if CHANNEL:                                         # P̃_t: P before α_t
                b_Pt = tl.load(hp + row * K + o_k, mask=m_k, other=0.0)
            else:
                b_Pt = tl.load(hp + row)
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_do = tl.load(do + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + row).to(tl.float32)
            b_th = tl.load(theta + row).to(tl.float32)
            b_a, b_am = _load_alpha(alpha, row, o_k, m_k, K, HAS_ALPHA, CHANNEL)
            b_c = 1.0
            if BEFORE:
                b_c = b_Pt * b_a                                # the gradient's point P_t M_a (M_a Diag(P_t))
            if CHANNEL:
                b_kc = b_c * b_k                                # P_t ⊙ k_t (k_t after_step)
                b_u = tl.sum(b_A * b_kc[None, :], axis=1)       # M_a (P_t ⊙ k_t)
                if IS_L2:
                    b_e = b_u - b_v
                else:
                    b_e = -b_v
            else:
                b_u = tl.sum(b_A * b_k[None, :], axis=1)        # M_a k_t
                if IS_L2:
                    b_e = b_c * b_u - b_v
                else:
                    b_e = -b_v
            # the read
            if READ_TOKEN:
                b_Mt = b_am * b_Mp + b_th * b_Sp - (b_beta * b_e)[:, None] * b_k[None, :]
                b_dq = tl.sum(b_Mt * b_do[:, None], axis=0)
                b_dM += b_do[:, None] * b_q[None, :]
            else:
                b_dq = tl.sum(b_A * b_do[:, None], axis=0)
                b_dA += b_do[:, None] * b_q[None, :]
            # M_t = α_t M_{t−1} + S_t;  S_t = θ_t S_{t−1} − β_t e_t k_tᵀ
            b_dS += b_dM
            if CHANNEL:
                b_dal = tl.sum(b_dM * b_Mp, axis=0)             # per key channel: column sums of dM ⊙ M_{t−1}
            else:
                b_dal = tl.sum(tl.sum(b_dM * b_Mp, axis=1), axis=0)
            b_dth = tl.sum(tl.sum(b_dS * b_Sp, axis=1), axis=0)
            b_dSk = tl.sum(b_dS * b_k[None, :], axis=1)         # dS_t k_t
            b_de = -b_beta * b_dSk
            b_dk = -b_beta * tl.sum(b_dS * b_e[:, None], axis=0)
            b_dbeta = -tl.sum(b_e * b_dSk, axis=0)
            if IS_L2:
                if CHANNEL:   # e_t = M_a (c_t ⊙ k_t) − v_t
                    b_Ade = tl.sum(b_A * b_de[:, None], axis=0)     # M_aᵀ de  [BK]
                    b_dA += b_de[:, None] * b_kc[None, :]
                    b_dk += b_c * b_Ade
                    if BEFORE:
                        b_dP += b_k * b_Ade
                else:         # e_t = c_t M_a k_t − v_t
                    b_dA += (b_c * b_de)[:, None] * b_k[None, :]
                    b_dk += tl.sum(b_A * (b_c * b_de)[:, None], axis=0)
                    if BEFORE:
                        b_dP += tl.sum(b_de * b_u, axis=0)
            # P_t = P̃_t α_t
            if HAS_ALPHA:
                b_dal += b_dP * b_Pt
            b_dP = b_dP * b_a
            b_dM = b_am * b_dM
            b_dS = b_th * b_dS
            # a chunk start: M_a = M_{t−1} and P̃ = 1
            b_dM = tl.where(start, b_dM + b_dA, b_dM)
            b_dA = tl.where(start, 0.0, b_dA)
            b_dP = tl.where(start, 0.0, b_dP)
            tl.store(dv + row * V + o_v, -b_de, mask=m_v)
            tl.store(dq + (part + row) * K + o_k, b_dq, mask=m_k)
            tl.store(dk + (part + row) * K + o_k, b_dk, mask=m_k)
            tl.store(dbeta + part + row, b_dbeta)
            tl.store(dtheta + part + row, b_dth)
            if HAS_ALPHA:
                if CHANNEL:
                    tl.store(dalpha + (part + row) * K + o_k, b_dal, mask=m_k)
                else:
                    tl.store(dalpha + part + row, b_dal)
        tl.store(dm0 + state_offs, b_dM, mask=m_h)
        tl.store(ds0 + state_offs, b_dS, mask=m_h)
        tl.store(da0 + state_offs, b_dA, mask=m_h)
        if CHANNEL:
            tl.store(dp0 + (i_v.to(tl.int64) * B * H + i_bh) * K + o_k, b_dP, mask=m_k)
        else:
            tl.store(dp0 + i_v.to(tl.int64) * B * H + i_bh, b_dP)


def _blocks(K: int, V: int, elements: int = STATE_BLOCK) -> Tuple[int, int]:
    """(BK, BV): all of D_k, and value rows so that one state block holds ≤ ``elements`` fp32 (≥ 16 rows)."""
    BK = pow2(K, 16)
    return BK, min(pow2(V, 16), max(16, elements // BK))


def fused_recurrent_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, a0, p0, *, position: int,
                                     chunk_size: int, bias: str, placement: str,
                                     read: str, store_states: bool = False):
    """The kernel alone (no autograd); arguments and results as :func:`fused_recurrent_momentum`.

    ``store_states`` (the backward's recompute) also returns every token's pre-step ``[M_{t−1}, S_{t−1}, M_a]``
    (``[B, T, H, D_v, D_k]`` fp32 each) and P̃_t (``[B, T, H]``, channel-wise ``[B, T, H, D_k]``; P before α_t):
    ``(outputs, states)``.
    """
    check_recurrent_args(q, k, v, beta, theta, alpha, m0, s0, a0, p0, position, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, beta, theta, m0, s0, a0, p0 = (x.contiguous() for x in (q, k, v, beta, theta, m0, s0, a0, p0))
    alpha = alpha.contiguous() if alpha is not None else None
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty_like(v)
    mt, st, at = (torch.empty(B, H, V, K, **f32) for _ in range(3))
    channel = p0.dim() == 3                             # channel-wise α: Π α per key channel
    pc = (K,) if channel else ()
    pt = torch.empty(B, H, *pc, **f32)
    BK, BV = _blocks(K, V)
    b = int(chunk_size)
    hist = [torch.empty(B, T, H, V, K, **f32) for _ in range(3)] + [torch.empty(B, T, H, *pc, **f32)] \
        if store_states else [pt] * 4   # never written without STORE_STATES
    _fused_momentum_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, beta, theta, alpha if alpha is not None else beta, m0, s0, a0, p0, o, mt, st, at, pt, *hist, T,
        int(position) % b, b, H=H, K=K, V=V, BK=BK, BV=BV, HAS_ALPHA=alpha is not None, IS_L2=bias == "l2",
        BEFORE=placement == BEFORE_STEP and alpha is not None, READ_TOKEN=read == "token",
        STORE_STATES=store_states, CHANNEL=channel, num_warps=4)
    out = (o, mt.to(m0.dtype), st.to(s0.dtype), at.to(a0.dtype), pt.to(p0.dtype))
    return (out, hist) if store_states else out


def fused_recurrent_momentum_backward(q, k, v, beta, theta, alpha, m0, s0, a0, p0, do, dmt, dst, dat, dpt, *,
                                      position: int, chunk_size: int, bias: str,
                                      placement: str, read: str):
    """Gradients of :func:`fused_recurrent_momentum_forward` → ``(dq, dk, dv, dβ, dθ, dα, dM_0, dS_0, dM_a0, dP_0)``
    (dα None without α; ``dmt, dst, dat, dpt`` may be None).

    The forward kernel is re-run storing every token's pre-step states; ``_fused_momentum_bwd_kernel`` then sweeps
    the tokens in reverse (memory: three ``[B, T, H, D_v, D_k]`` fp32 buffers, as many states as the torch
    autograd fallback keeps).
    """
    _, (hm, hs, ha, hp) = fused_recurrent_momentum_forward(
        q, k, v, beta, theta, alpha, m0, s0, a0, p0, position=position, chunk_size=chunk_size, bias=bias,
        placement=placement, read=read, store_states=True)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V, STATE_BLOCK_BWD)
    NV = triton.cdiv(V, BV)
    b = int(chunk_size)
    q, k, v, beta, theta, do = (x.contiguous() for x in (q, k, v, beta, theta, do))
    alpha = alpha.contiguous() if alpha is not None else None
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk = (torch.empty(NV, B, T, H, K, **f32) for _ in range(2))
    dv = torch.empty(B, T, H, V, **f32)
    dbeta, dtheta = (torch.empty(NV, B, T, H, **f32) for _ in range(2))
    channel = p0.dim() == 3
    pc = (K,) if channel else ()
    dalpha = torch.empty(NV, B, T, H, *pc, **f32) if alpha is not None else None
    dm0, ds0, da0 = (torch.empty(B, H, V, K, **f32) for _ in range(3))
    dp0 = torch.empty(NV, B, H, *pc, **f32)
    dpt = dpt.contiguous() if dpt is not None else torch.zeros(B, H, *pc, **f32)
    dummy = dpt
    _fused_momentum_bwd_kernel[(NV, B * H)](
        q, k, v, beta, theta, alpha if alpha is not None else beta, hm, hs, ha, hp, do,
        *(x.contiguous() if x is not None else dummy for x in (dmt, dst, dat)), dpt, dq, dk, dv, dbeta, dtheta,
        dalpha if dalpha is not None else dummy, dm0, ds0, da0, dp0, T, int(position) % b, b, B, H=H, K=K, V=V,
        BK=BK, BV=BV, HAS_ALPHA=alpha is not None, IS_L2=bias == "l2",
        BEFORE=placement == BEFORE_STEP and alpha is not None, READ_TOKEN=read == "token",
        HAS_DMT=dmt is not None, HAS_DST=dst is not None, HAS_DAT=dat is not None, CHANNEL=channel,
        num_warps=4 if BK * BV <= STATE_BLOCK_BWD else 8)   # D_k ≥ 128 (the 16-row floor): twice the threads
    return (dq.sum(0).to(q.dtype), dk.sum(0).to(k.dtype), dv.to(v.dtype), dbeta.sum(0).to(beta.dtype),
            dtheta.sum(0).to(theta.dtype), dalpha.sum(0).to(alpha.dtype) if alpha is not None else None,
            dm0.to(m0.dtype), ds0.to(s0.dtype), da0.to(a0.dtype), dp0.sum(0).to(p0.dtype))


#: Which backward :class:`FusedRecurrentMomentumFunction` uses: ``"triton"`` (the reverse-sweep kernel) or
#: ``"torch"`` (autograd through :func:`momentum_recurrent_reference`, recomputed); ``ATLASLAB_MOMENTUM_BACKWARD``
#: (shared with the momentum chunk kernel) sets the default.
BACKWARD = os.environ.get("ATLASLAB_MOMENTUM_BACKWARD", "triton").strip().lower()


class FusedRecurrentMomentumFunction(torch.autograd.Function):
    """Kernel forward; backward on the reverse-sweep kernel (:func:`fused_recurrent_momentum_backward`), or, with
    ``BACKWARD == "torch"``, autograd through :func:`momentum_recurrent_reference` recomputed (≥ fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, theta, alpha, m0, s0, a0, p0, position, chunk_size, bias, placement, read):
        ctx.save_for_backward(q, k, v, beta, theta, alpha, m0, s0, a0, p0)
        ctx.opts = dict(position=int(position), chunk_size=int(chunk_size), bias=bias, placement=placement,
                        read=read)
        return fused_recurrent_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, a0, p0, **ctx.opts)

    @staticmethod
    def backward(ctx, do, dmt, dst, dat, dpt):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:10]
        grads = [None] * 10
        if any(need) and BACKWARD != "torch":
            got = fused_recurrent_momentum_backward(*saved, do, dmt, dst, dat, dpt, **ctx.opts)
            grads = [g if n else None for g, n in zip(got, need)]
        elif any(need):
            grads = reference_backward(momentum_recurrent_reference, saved, need, (do, dmt, dst, dat, dpt),
                                       **ctx.opts)
        return (*grads, None, None, None, None, None)


def fused_recurrent_momentum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                             theta: torch.Tensor, alpha: Optional[torch.Tensor], initial_state: torch.Tensor,
                             initial_momentum: torch.Tensor, initial_anchor: torch.Tensor,
                             initial_chunk_alpha: torch.Tensor, *, position: int, chunk_size: int, bias: str,
                             placement: str, read: str
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear memory + momentum GD at semantic chunk size b, token by token on one fused Triton kernel.

    Args:
        q, k: ``[B, T, H, D_k]`` (feature map already applied); v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step β_t = η_t γ_t.
        theta: ``[B, T, H]`` momentum gate θ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, or ``[B, T, H, D_k]`` channel-wise (per key channel,
            M ← M Diag(α_t) + S), or None (no retention).
        initial_state, initial_momentum, initial_anchor: M, S and the current chunk's start memory M_a before the
            first token, ``[B, H, D_v, D_k]`` (the anchor is used only until the next chunk start).
        initial_chunk_alpha: ``[B, H]`` P, the product of α over the current chunk's tokens so far (1 at a chunk
            start; ``MemoryState.chunk_alpha``); ``[B, H, D_k]`` with channel-wise α (this shape selects it).
        position: tokens consumed before this call (chunks start where the position is a multiple of b).
        chunk_size: the semantic chunk b ≥ 1 (it changes the result).
        bias: ``l2`` or ``dot``; placement: ``after_step`` or ``before_step`` (ℓ2: gradient at P M_a); read:
            ``token`` or ``chunk``.

    Returns:
        ``o: [B, T, H, D_v]`` (dtype of v), the final M, S and M_a ``[B, H, D_v, D_k]`` (dtypes of the initial
        ones) and the final P ``[B, H]`` (channel-wise ``[B, H, D_k]``).
    """
    return FusedRecurrentMomentumFunction.apply(q, k, v, beta, theta, alpha, initial_state, initial_momentum,
                                                initial_anchor, initial_chunk_alpha, int(position), int(chunk_size),
                                                bias, placement, read)


__all__ = ["FusedRecurrentMomentumFunction", "fused_recurrent_momentum", "fused_recurrent_momentum_backward",
           "fused_recurrent_momentum_forward"]
