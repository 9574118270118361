"""Chunked Triton forward of the linear-memory (gated) delta / Hebbian rule, fla-style stages.

The math is :func:`.reference.delta_rule_chunk` (exact for the online b = 1 rule), split as in fla's
``chunk_gated_delta_rule_fwd``:

1. ``_chunk_ut_kernel`` (one program per chunk × head, all chunks in parallel): chunk-local cumsum of log α,
   the strictly lower A[t, s] = β_t e^{G_t − g_s} k_t·k_s, its unit-triangular inverse (forward substitution in
   registers) and the UT/WY factors u = (I + A)⁻¹ β v, w_k = (I + A)⁻¹ (β e^G k);
2. ``_chunk_state_kernel`` (one program per value block × head, sequential over chunks): pseudo-values
   w = u − w_k S_0ᵀ against the chunk-start state, stores every chunk-start state, and steps
   S ← e^{g_L} S + Σ_s e^{g_L − g_s} w_s k_sᵀ;
3. ``_chunk_out_kernel`` (value block × chunk × head, parallel): o = e^{g} (q S_0ᵀ) + [causal e^{g_t − g_s} q kᵀ] w.

The dot-product (Hebbian) bias skips stage 1's solve (w = β v). Intermediates (g, u, w_k, w, chunk states)
are fp32. Backward: :class:`ChunkFunction` recomputes the torch chunk form under ``enable_grad`` and uses
``torch.autograd.grad`` (exact gradients, torch speed; a backward kernel is future work).

``cu_seqlens`` is handled by running the kernels once per packed sequence (a Python loop; fla's
chunk-index tables would remove it).

Performance notes (unmeasured: no GPU was available when this was written): the in-register forward
substitution costs BT iterations of O(BT²) work; fla's 16×16 diagonal solves merged by tl.dot are faster
for BT = 64. fp32 dots use IEEE precision by default (``allow_tf32=True`` trades ~1e-3 accuracy for speed).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import _per_sequence, _upcast, check_args, delta_rule_chunk, log_decay

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_D = 256


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _chunk_ut_kernel(k, v, beta, la, g_out, u_out, wk_out, T, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVV: tl.constexpr,
                         HAS_ALPHA: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                         PRECISION: tl.constexpr):
        i_t = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
        o_i = tl.arange(0, BT)
        o_t = i_t * BT + o_i
        m_t = o_t < T
        rows = (i_b.to(tl.int64) * T + o_t) * H + i_h
        if HAS_ALPHA:
            b_la = tl.load(la + rows, mask=m_t, other=0.0).to(tl.float32)
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
            b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
            if BEFORE:
                b_G = b_g
            else:
                b_G = b_g - b_la
            strict = o_i[:, None] > o_i[None, :]
            kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
            ratio = tl.exp(tl.where(strict, b_G[:, None] - b_g[None, :], 0.0))
            A = tl.where(strict, b_beta[:, None] * kk * ratio, 0.0)
            # (I + A)⁻¹ by forward substitution: row i = e_i − Σ_{j<i} A[i, j] · row j
            Ti = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
            for i in range(1, BT):
                a_i = tl.sum(tl.where(o_i[:, None] == i, A, 0.0), axis=0)
                new = tl.where(o_i == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Ti, axis=0)
                Ti = tl.where(o_i[:, None] == i, new[None, :], Ti)
            b_u = tl.dot(Ti, b_beta[:, None] * b_v, input_precision=PRECISION)
            b_wk = tl.dot(Ti, (b_beta * tl.exp(b_G))[:, None] * b_k, input_precision=PRECISION)
            tl.store(u_out + rows[:, None] * V + o_v[None, :], b_u, mask=m_t[:, None] & m_v[None, :])
            tl.store(wk_out + rows[:, None] * K + o_k[None, :], b_wk, mask=m_t[:, None] & m_k[None, :])

    @triton.jit
    def _chunk_state_kernel(k, v, beta, g, u, wk, h0, w_out, hs, ht, T, NT, H: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_H0: tl.constexpr, IS_L2: tl.constexpr, PRECISION: tl.constexpr):
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_H0:
            h += tl.load(h0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for i_t in range(0, NT):
            # chunk-start state, [B, NT, H, V, K]
            tl.store(hs + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * V * K + h_offs, h, mask=m_h)
            o_t = i_t * BT + o_i
            m_t = o_t < T
            rows = (i_b.to(tl.int64) * T + o_t) * H + i_h
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            if IS_L2:
                b_u = tl.load(u + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
                b_wk = tl.load(wk + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_w = b_u - tl.dot(b_wk, tl.trans(h), input_precision=PRECISION)
            else:
                b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                              other=0.0).to(tl.float32)
                b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
                b_w = b_beta[:, None] * b_v
            tl.store(w_out + rows[:, None] * V + o_v[None, :], b_w, mask=m_t[:, None] & m_v[None, :])
            b_g = tl.load(g + rows, mask=m_t, other=0.0)
            last = tl.minimum(T - i_t * BT, BT) - 1
            g_last = tl.load(g + (i_b.to(tl.int64) * T + i_t * BT + last) * H + i_h)
            decay = tl.exp(tl.where(m_t, g_last - b_g, 0.0))
            h = h * tl.exp(g_last) + tl.dot(tl.trans(b_w * decay[:, None]), b_k, input_precision=PRECISION)
        tl.store(ht + i_bh.to(tl.int64) * V * K + h_offs, h, mask=m_h)

    @triton.jit
    def _chunk_out_kernel(q, k, la, g, w, hs, o, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ALPHA: tl.constexpr,
                          READ_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
        i_v = tl.program_id(0)
        i_t = tl.program_id(1)
        i_bh = tl.program_id(2)
        i_b = i_bh // H
        i_h = i_bh % H
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        o_t = i_t * BT + o_i
        m_t = o_t < T
        rows = (i_b.to(tl.int64) * T + o_t) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.load(g + rows, mask=m_t, other=0.0)
        if READ_TOKEN:
            b_gq = b_g
            causal = (o_i[:, None] >= o_i[None, :]) & m_t[None, :]
        else:
            if HAS_ALPHA:
                b_gq = b_g - tl.load(la + rows, mask=m_t, other=0.0).to(tl.float32)
            else:
                b_gq = b_g
            causal = (o_i[:, None] > o_i[None, :]) & m_t[None, :]
        b_w = tl.load(w + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        h = tl.load(hs + ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :],
                    mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_o = tl.exp(b_gq)[:, None] * tl.dot(b_q, tl.trans(h), input_precision=PRECISION)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        qk = tl.where(causal, qk * tl.exp(tl.where(causal, b_gq[:, None] - b_g[None, :], 0.0)), 0.0)
        b_o += tl.dot(qk, b_w, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def chunk_forward(q, k, v, beta, alpha=None, initial_state=None, *, bias="l2", placement="before_step",
                  read="token", cu_seqlens=None, chunk_size: int = 64, allow_tf32: bool = False):
    """The three kernels, no autograd; arguments as :func:`chunk_delta_rule`."""
    check_args(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens)
    opts = dict(bias=bias, placement=placement, read=read, chunk_size=chunk_size, allow_tf32=allow_tf32)
    if cu_seqlens is not None:
        return _per_sequence(chunk_forward, q, k, v, beta, alpha, initial_state, cu_seqlens, **opts)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if max(K, V) > MAX_D:
        raise ValueError(f"chunk (triton): head dims D_k = {K}, D_v = {V} must be ≤ {MAX_D}")
    BT = _pow2(chunk_size)
    NT = triton.cdiv(T, BT)
    BK, BVV = _pow2(K), _pow2(V)
    BV = min(BVV, max(16, 8192 // BK))
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    la = log_decay(alpha.float(), q).contiguous() if alpha is not None else None
    f32 = dict(dtype=torch.float32, device=q.device)
    g = torch.empty(B, T, H, **f32)
    is_l2 = bias == "l2"
    u = torch.empty(B, T, H, V, **f32) if is_l2 else None
    wk = torch.empty(B, T, H, K, **f32) if is_l2 else None
    w = torch.empty(B, T, H, V, **f32)
    hs = torch.empty(B, NT, H, V, K, **f32)
    ht = torch.empty(B, H, V, K, **f32)
    o = torch.empty_like(v)
    h0 = initial_state.contiguous() if initial_state is not None else None
    prec = "tf32" if allow_tf32 else "ieee"
    dummy = g
    _chunk_ut_kernel[(NT, B * H)](
        k, v, beta, la if la is not None else dummy, g, u if is_l2 else dummy, wk if is_l2 else dummy, T,
        H=H, K=K, V=V, BT=BT, BK=BK, BVV=BVV, HAS_ALPHA=la is not None, IS_L2=is_l2,
        BEFORE=placement == "before_step", PRECISION=prec, num_warps=4)
    _chunk_state_kernel[(triton.cdiv(V, BV), B * H)](
        k, v, beta, g, u if is_l2 else dummy, wk if is_l2 else dummy, h0 if h0 is not None else dummy, w, hs, ht,
        T, NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_H0=h0 is not None, IS_L2=is_l2, PRECISION=prec,
        num_warps=4)
    _chunk_out_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, k, la if la is not None else dummy, g, w, hs, o, T, NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        HAS_ALPHA=la is not None, READ_TOKEN=read == "token", PRECISION=prec, num_warps=4)
    return o, ht.to(initial_state.dtype if initial_state is not None else q.dtype)


class ChunkFunction(torch.autograd.Function):
    """Kernel forward; backward = autograd of the torch chunk form, recomputed (no backward kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens, chunk_size, allow_tf32):
        ctx.save_for_backward(q, k, v, beta, alpha, initial_state)
        ctx.opts = dict(bias=bias, placement=placement, read=read, cu_seqlens=cu_seqlens)
        ctx.chunk_size = chunk_size
        return chunk_forward(q, k, v, beta, alpha, initial_state, bias=bias, placement=placement, read=read,
                             cu_seqlens=cu_seqlens, chunk_size=chunk_size, allow_tf32=allow_tf32)

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        with torch.enable_grad():
            inputs = [_upcast(x).detach().requires_grad_(True) if x is not None else None for x in saved]
            o, ht = delta_rule_chunk(*inputs, chunk_size=ctx.chunk_size, **ctx.opts)
            outs, grads_out = [o], [do.to(o.dtype)]
            if dht is not None:
                outs.append(ht)
                grads_out.append(dht.to(ht.dtype))
            leaves = [x for x, n in zip(inputs, need) if x is not None and n]
            grads = iter(torch.autograd.grad(outs, leaves, grads_out, allow_unused=True) if leaves else ())
        out = [next(grads).to(x.dtype) if (x is not None and n) else None for x, n in zip(saved, need)]
        return (*out, None, None, None, None, None, None)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                     bias: str = "l2", placement: str = "before_step", read: str = "token",
                     cu_seqlens: Optional[torch.LongTensor] = None, chunk_size: int = 64,
                     allow_tf32: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linear-memory delta / Hebbian rule, chunk-parallel on Triton (exact; same results as the token loop).

    Args:
        q, k: ``[B, T, H, D_k]``; v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step size β_t = η_t γ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, or None.
        initial_state: ``[N, H, D_v, D_k]`` or None (zeros).
        bias, placement, read: as :func:`.fused_recurrent.fused_recurrent_delta_rule`.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1), or None.
        chunk_size: the kernel's compute block BT (a power of two ≥ 16; it does not change the result).
        allow_tf32: let fp32 dots use TF32.

    Returns:
        ``o: [B, T, H, D_v]`` and the final state ``[N, H, D_v, D_k]``.
    """
    return ChunkFunction.apply(q, k, v, beta, alpha, initial_state, bias, placement, read, cu_seqlens,
                               int(chunk_size), bool(allow_tf32))
