"""Chunk-parallel Triton forward and backward of a linear memory trained by momentum GD at semantic chunk size
2 ≤ b ≤ 64 (Titans with a matrix memory), per-head or channel-wise decay, either placement, ``cu_seqlens`` natively.

The TTT / Titans dual form per chunk (:func:`.naive.momentum_chunk_reference`; docs/kernels.md#momentum), its
kernels in :mod:`.chunk_fwd` and :mod:`.chunk_bwd`: the coefficient kernel (P, Θ, Q, A and the chunk-end rows;
``_mom_cw_coef_kernel`` channel-wise), the state sweep and the output, as the delta rule's stages. The backward re-runs stages 1–2, sweeps the chunks in reverse for the
state gradients, forms dq, dk, dv and the coefficients' gradients per chunk, and maps those to the gates by
autograd through :func:`chunk_coefficients` (channel-wise: ``_mom_cw_gate_kernel`` in the same loops, since the
momentum coefficient there is a double sum that would overflow if factored). ``BACKWARD = "torch"``
(``ATLASLAB_MOMENTUM_BACKWARD=torch``) runs autograd through the reference instead.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.common.lang import triton
from atlaslab.kernels.momentum.naive import check_args, momentum_chunk_reference
from atlaslab.kernels.utils import (BEFORE_STEP, ChunkLayout, check_head_dims, dot_precision, log_gate, pow2,
                                    prepare_chunk_indices, reference_backward, with_torch_fallback)

if triton is not None:
    from atlaslab.kernels.momentum.chunk_bwd import _mom_bwd_grad_kernel, _mom_bwd_state_kernel, _mom_cw_gate_kernel
    from atlaslab.kernels.momentum.chunk_fwd import (_mom_coef_kernel, _mom_cw_coef_kernel, _mom_out_kernel,
                                                     _mom_state_kernel)

#: largest semantic chunk b the kernels take (the coefficient kernel holds [b, b] blocks in registers)
MAX_CHUNK = 64
#: largest b the dispatch gives the kernels with channel-wise decay: at b = 64 and D_k = 128 the channel-wise state
#: sweeps ask for more shared memory than an sm_90 block has (up to 409 KiB fp32 / 313 KiB fp16 in
#: ``_mom_bwd_state_kernel``); every build at b ≤ 32 fits (``bench/compile_sm90.py``)
MAX_CHANNEL_CHUNK = 32


def _channel(alpha) -> bool:
    """Whether α is channel-wise (``[B, T, H, D_k]``, one kept fraction per key channel)."""
    return alpha is not None and alpha.dim() == 4


def _before(placement: str, alpha, bias: str) -> bool:
    """Whether e carries the before_step factor P (ℓ2 with decay placed before the step)."""
    return placement == BEFORE_STEP and alpha is not None and bias == "l2"


def _forward_stages(q, k, v, beta, theta, alpha, m0, s0, *, b: int, bias: str, read: str, prec: str,
                    placement: str, cu_seqlens=None, store_a: bool = False) -> dict:
    """Stages 1–2 on contiguous inputs → fp32 ``p, qc, th, aend, send [B, T, H]``, ``aq`` / ``a [B, T, H, BT]``
    (read token / ``store_a``), ``e [B, T, H, V]``, ``hm, hs [NC, H, V, K]`` (chunk-start M, S of every chunk of
    every sequence), ``mt, st [N, H, V, K]`` and the chunk ``layout`` (:class:`atlaslab.kernels.utils.ChunkLayout` over b-token chunks:
    B dense sequences of T tokens, or the packed sequences of ``cu_seqlens``). One launch per stage either way."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BVV = pow2(b), pow2(K), pow2(V)
    # two [BV, BK] fp32 states live in the state kernels; channel-wise, their [BT, BK] coefficient blocks (P, Q,
    # k ⊙ a_end) take the room of half of them (sm_90 shared memory at b = 64, bench/compile_sm90.py)
    BV = min(BVV, max(16, (2048 if _channel(alpha) else 4096) // BK))
    lay = ChunkLayout(B, T, b, cu_seqlens, q)     # the chunk table counts b-token chunks
    lth = log_gate(theta.float()).contiguous()
    la = log_gate(alpha.float()).contiguous() if alpha is not None else None
    f32 = {"dtype": torch.float32, "device": q.device}
    channel = _channel(alpha)
    st = {name: torch.empty(B, T, H, *((K,) if channel and name in ("p", "qc", "aend") else ()), **f32)
          for name in ("p", "qc", "th", "aend", "send")}
    token = read == "token"
    st["aq"] = torch.empty(B, T, H, BT, **f32) if token else None
    st["a"] = torch.empty(B, T, H, BT, **f32) if store_a and not channel else None
    dummy = st["p"]
    if channel:
        _mom_cw_coef_kernel[(lay.NC, H)](q, k, beta, lth, la, st["p"], st["qc"], st["th"], st["aend"], st["send"],
                                         st["aq"] if token else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                         BT=BT, BK=BK, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec,
                                         num_warps=4)
    else:
        _mom_coef_kernel[(lay.NC, H)](q, k, beta, lth, la if la is not None else lth, st["p"], st["qc"], st["th"],
                                      st["aend"], st["send"], st["aq"] if token else dummy,
                                      st["a"] if store_a else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                      BT=BT, BK=BK, HAS_ALPHA=la is not None, READ_TOKEN=token, STORE_A=store_a,
                                      IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
    st["la"], st["lth"] = la, lth
    st["e"] = torch.empty(B, T, H, V, **f32)
    for name in ("hm", "hs"):
        st[name] = torch.empty(lay.NC, H, V, K, **f32)
    for name in ("mt", "st"):
        st[name] = torch.empty(lay.N, H, V, K, **f32)
    _mom_state_kernel[(triton.cdiv(V, BV), lay.N * H)](
        k, v, st["p"], st["qc"], st["th"], st["aend"], st["send"], m0, s0, st["e"], st["hm"], st["hs"], st["mt"],
        st["st"], lay.cu, lay.offsets, T, b, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, IS_L2=bias == "l2",
        BEFORE=_before(placement, alpha, bias), IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4,
        **({"CHANNEL": True} if channel else {}))
    st["sizes"] = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV)
    st["channel"] = {"CHANNEL": True} if channel else {}    # launched only when set: the scalar builds unchanged
    st["layout"] = lay
    return st


def _last_chunks(lay) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per sequence: the global index of its last chunk (the anchor's row of ``hm``), and (varlen) which
    sequences are empty (no chunk: the anchor is the initial memory), else None."""
    if not lay.varlen:
        idx = torch.arange(lay.N, device=lay.cu.device) * lay.NT + lay.NT - 1
        return idx, None
    off = lay.offsets.long()
    empty = off[1:] == off[:-1]
    return (off[1:] - 1).clamp_min(0), (empty if bool(empty.any()) else None)


def _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens):
    check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens)
    K, V, b = q.shape[-1], v.shape[-1], int(chunk_size)
    check_head_dims("chunk_momentum (triton)", K, V)
    if b > MAX_CHUNK or q.shape[1] == 0:
        raise ValueError(f"chunk_momentum (triton): needs b ≤ {MAX_CHUNK} and T ≥ 1; got b = {b}, T = {q.shape[1]}")
    return [x.contiguous() if x is not None else None for x in (q, k, v, beta, theta, alpha, m0, s0)]


def chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, *, chunk_size: int, bias: str,
                           read: str, placement: str, cu_seqlens=None,
                           allow_tf32: Optional[bool] = None):
    """The three forward kernels, no autograd; arguments and results as :func:`chunk_momentum`. One launch per
    stage, with or without ``cu_seqlens``."""
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens)
    T = q.shape[1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens)
    sz, lay = st["sizes"], st["layout"]
    o = torch.empty_like(v)
    token = read == "token"
    _mom_out_kernel[(triton.cdiv(sz["V"], sz["BV"]), lay.NC, sz["H"])](
        q, st["p"], st["qc"], st["aq"] if token else st["p"], st["e"], st["hm"], st["hs"], o, lay.cu, lay.table, T,
        b, lay.NT, **sz, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    idx, empty = _last_chunks(lay)
    anchor = st["hm"][idx]
    if empty is not None:
        anchor = torch.where(empty[:, None, None, None], m0.float(), anchor)
    out_dtype = m0.dtype
    return o, st["mt"].to(out_dtype), st["st"].to(out_dtype), anchor.to(out_dtype)


def _chunk_rows(B: int, T: int, b: int, cu_seqlens, device):
    """Every b-token chunk's token rows in the flattened ``[B·T]`` order: ``rows [NC, b]`` (clamped in range),
    ``valid [NC, b]`` and ``count [NC]`` (real tokens per chunk), chunks in the kernels' order (B dense sequences
    of T tokens, or the packed sequences of ``cu_seqlens``, each chunked from its first token)."""
    cu = (torch.arange(B + 1, device=device) * T if cu_seqlens is None
          else cu_seqlens.to(device=device, dtype=torch.long))
    table, _ = prepare_chunk_indices(cu, b)
    seq, within = table[:, 0].long(), table[:, 1].long()
    start = cu[seq] + within * b
    count = torch.clamp(cu[seq + 1] - start, max=b)
    j = torch.arange(b, device=device)
    valid = j[None, :] < count[:, None]
    rows = (start[:, None] + j[None, :]).clamp(max=B * T - 1)
    return rows, valid, count


def chunk_coefficients(beta: torch.Tensor, theta: torch.Tensor, alpha: Optional[torch.Tensor], chunk_size: int,
                       cu_seqlens: Optional[torch.Tensor] = None):
    """Stage 1 in torch, all chunks at once (differentiable; the backward maps the coefficients' gradients to
    β, θ, α through it): per token ``P, Q, Θ, a_end, s_end: [B, T, H]`` and ``A: [B, T, H, b]`` (row s of its
    chunk's A; a_end / s_end are indexed by the column i, as in the kernels). With ``cu_seqlens`` (B = 1) the
    chunks restart at every sequence start."""
    B, T, H = beta.shape
    b = int(chunk_size)
    rows, valid, count = _chunk_rows(B, T, b, cu_seqlens, beta.device)
    NC = rows.shape[0]

    def chunks(x):      # [B, T, H] → [H, NC, b], padded with 0 (β = 0; log-gate 0 = factor 1)
        x = x.reshape(B * T, H)[rows]                 # [NC, b, H]
        return torch.where(valid.unsqueeze(-1), x, torch.zeros_like(x)).permute(2, 0, 1)

    def tokens(x):      # [H, NC, b, ...] → [B, T, H, ...]
        x = x.movedim(0, 2)                           # [NC, b, H, ...]
        return x[valid].reshape(B, T, H, *x.shape[3:])

    lb = chunks(beta)
    gt = chunks(log_gate(theta)).cumsum(-1)
    ga = chunks(log_gate(alpha)).cumsum(-1) if alpha is not None else torch.zeros_like(gt)
    upper = torch.ones(b, b, dtype=torch.bool, device=beta.device).triu(1)
    D_a = (ga.unsqueeze(-1) - ga.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    D_t = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    P, Th = ga.exp(), gt.exp()
    Q = (D_a @ Th.unsqueeze(-1)).squeeze(-1)
    A = -(D_a @ (D_t * lb.unsqueeze(-2)))
    n = torch.arange(NC, device=beta.device)
    last = count - 1
    a_end = A[:, n, last]                                                       # [H, NC, b]
    s_end = -D_t[:, n, last] * lb
    return tokens(P), tokens(Q), tokens(Th), tokens(a_end), tokens(s_end), tokens(A)


def chunk_momentum_backward(q, k, v, beta, theta, alpha, m0, s0, do, dmt, dst, dma, *, chunk_size: int,
                            bias: str, read: str, placement: str, cu_seqlens=None,
                            allow_tf32: Optional[bool] = None):
    """Gradients of :func:`chunk_momentum_forward` → ``(dq, dk, dv, dβ, dθ, dα, dM_0, dS_0)`` (dα None without α;
    dM_0, dS_0 ``[N, H, D_v, D_k]``).

    Stages 1–2 are re-run (coefficients, e, chunk-start states), ``_mom_bwd_state_kernel`` sweeps the chunks in
    reverse for the chunk-end state gradients and dE, ``_mom_bwd_grad_kernel`` forms dq, dk, dv and the
    coefficients' gradients per chunk in parallel, and autograd through :func:`chunk_coefficients` (torch, no
    memory-sized tensor) maps those to dβ, dθ, dα. With ``cu_seqlens`` every stage is still one launch.
    """
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    token = read == "token"
    do = do.contiguous()
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens, store_a=token)
    sz, lay = st["sizes"], st["layout"]
    f32 = {"dtype": torch.float32, "device": q.device}
    dhm, dhs = (torch.empty(lay.NC, H, V, K, **f32) for _ in range(2))
    de = torch.empty(B, T, H, V, **f32)
    dm0, ds0 = (torch.empty(lay.N, H, V, K, **f32) for _ in range(2))
    dummy = st["p"]
    channel = _channel(alpha)
    meta = dict(sz, IS_L2=bias == "l2", BEFORE=_before(placement, alpha, bias), READ_TOKEN=token,
                IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    _mom_bwd_state_kernel[(triton.cdiv(V, sz["BV"]), lay.N * H)](
        q, k, do, st["aq"] if token else dummy, st["p"], st["qc"], st["th"], st["aend"], st["send"],
        *(x.contiguous() if x is not None else dummy for x in (dmt, dst, dma)), de, dhm, dhs, dm0, ds0, lay.cu,
        lay.offsets, T, b, lay.NT, HAS_DMT=dmt is not None, HAS_DST=dst is not None, HAS_DMA=dma is not None,
        **meta)
    if dma is not None:             # an empty sequence's anchor is its initial memory
        _, empty = _last_chunks(lay)
        if empty is not None:
            dm0 = dm0 + torch.where(empty[:, None, None, None], dma.float(), torch.zeros_like(dm0))
    dq = torch.empty(B, T, H, K, **f32)
    dk = torch.empty(B, T, H, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    kc = (K,) if channel else ()
    dp, dqc, dae = (torch.empty(B, T, H, *kc, **f32) for _ in range(3))
    dth, dse = (torch.empty(B, T, H, **f32) for _ in range(2))
    da = torch.empty(B, T, H, sz["BT"], **f32) if token else None       # dA (scalar decay) or G (channel-wise)
    _mom_bwd_grad_kernel[(lay.NC, H)](
        q, k, do, st["a"] if token and not channel else dummy, st["p"], st["qc"], st["aend"], st["send"], st["e"],
        de, st["hm"], st["hs"], dhm, dhs, dq, dk, dv, dp, dqc, dth, dae, dse, da if token else dummy, lay.cu,
        lay.table, T, b, lay.NT, **meta)
    if channel:
        dbeta, dlth = (torch.empty(B, T, H, **f32) for _ in range(2))
        dla = torch.empty(B, T, H, K, **f32)
        _mom_cw_gate_kernel[(lay.NC, H)](
            q, k, beta, st["lth"], st["la"], st["qc"], da if token else dummy, dp, dqc, dth, dae, dse, dq, dk, dbeta,
            dla, dlth, lay.cu, lay.table, T, b, lay.NT, H=H, K=K, BT=sz["BT"], BK=sz["BK"], READ_TOKEN=token,
            IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype),
                _from_log_grad(dlth, theta), _from_log_grad(dla, alpha), dm0.to(m0.dtype), ds0.to(s0.dtype))
    with torch.enable_grad():
        gates = [x.detach().float().requires_grad_(True) if x is not None else None for x in (beta, theta, alpha)]
        coef = chunk_coefficients(*gates, b, cu_seqlens=cu_seqlens)
        grads_out = [dp, dqc, dth, dae, dse] + ([da[..., :b]] if token else [])
        pairs = [(c, g) for c, g in zip(coef, grads_out) if c.requires_grad]   # P is constant without α
        leaves = [g for g in gates if g is not None]
        dgates = torch.autograd.grad([c for c, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    dgates = [torch.zeros_like(g) if d is None else d for g, d in zip(leaves, dgates)]
    dbeta, dtheta = dgates[0].to(beta.dtype), dgates[1].to(theta.dtype)
    dalpha = dgates[2].to(alpha.dtype) if alpha is not None else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta, dtheta, dalpha, dm0.to(m0.dtype),
            ds0.to(s0.dtype))


def _from_log_grad(dlog: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """∂L/∂x from ∂L/∂ log x, with log x = log max(x, tiny) as :func:`atlaslab.kernels.utils.log_gate` (no gradient below tiny)."""
    xf = x.float()
    tiny = torch.finfo(xf.dtype).tiny
    return torch.where(xf >= tiny, dlog / xf.clamp_min(tiny), torch.zeros_like(dlog)).to(x.dtype)


#: Which backward :class:`ChunkMomentumFunction` uses: ``"triton"`` (the backward kernels + autograd through
#: :func:`chunk_coefficients`) or ``"torch"`` (autograd through :func:`momentum_chunk_reference`, recomputed).
#: ``ATLASLAB_MOMENTUM_BACKWARD`` sets the default.
BACKWARD = os.environ.get("ATLASLAB_MOMENTUM_BACKWARD", "triton").strip().lower()


class ChunkMomentumFunction(torch.autograd.Function):
    """Triton forward (:func:`chunk_momentum_forward`); backward on the backward kernels
    (:func:`chunk_momentum_backward`), or, with ``BACKWARD == "torch"``, autograd of
    :func:`momentum_chunk_reference` recomputed (≥ fp32) under ``enable_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens,
                allow_tf32):
        ctx.save_for_backward(q, k, v, beta, theta, alpha, m0, s0)
        ctx.opts = {"chunk_size": chunk_size, "bias": bias, "read": read, "placement": placement,
                    "cu_seqlens": cu_seqlens}
        ctx.allow_tf32 = allow_tf32
        return chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, allow_tf32=allow_tf32, **ctx.opts)

    @staticmethod
    def backward(ctx, do, dmt, dst, dma):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:8]
        if not any(need):
            return (None,) * 14
        def torch_path():
            return _torch_backward(saved, need, (do, dmt, dst, dma), ctx.opts)

        def kernels():
            grads = chunk_momentum_backward(*saved, do, dmt, dst, dma, allow_tf32=ctx.allow_tf32, **ctx.opts)
            return [g if n else None for g, n in zip(grads, need)]
        grads = (torch_path() if BACKWARD == "torch"
                 else with_torch_fallback(kernels, torch_path, "momentum chunk backward"))
        return (*grads, None, None, None, None, None, None)


def _torch_backward(saved, need, grads_out, opts):
    """The reference backward: autograd of :func:`.naive.momentum_chunk_reference`, recomputed (≥ fp32)."""
    return reference_backward(momentum_chunk_reference, saved, need, grads_out, **opts)


def chunk_momentum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, theta: torch.Tensor,
                   alpha: Optional[torch.Tensor], initial_state: torch.Tensor, initial_momentum: torch.Tensor, *,
                   chunk_size: int, bias: str, read: str, placement: str,
                   cu_seqlens: Optional[torch.Tensor] = None, allow_tf32: Optional[bool] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear memory + momentum GD at semantic chunk size b (module docstring), Triton forward and backward.

    Args:
        q, k: ``[B, T, H, D_k]`` (feature map already applied); v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step β_t = η_t γ_t.
        theta: ``[B, T, H]`` momentum gate θ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, ``[B, T, H, D_k]`` channel-wise (per key channel,
            M ← M Diag(α_t) + S; before_step takes the gradient at M_a Diag(P_s)), or None.
        initial_state, initial_momentum: M and S before the first token, ``[N, H, D_v, D_k]`` (N = B, or the
            number of packed sequences); every sequence starts at a chunk boundary.
        chunk_size: the semantic chunk b (2 ≤ b ≤ 64 on the kernels; it changes the result).
        bias: ``l2`` or ``dot``; read: ``token`` or ``chunk``.
        placement: ``after_step`` (gradients at M_a) or ``before_step`` (at P_s M_a; the same for ``dot``).
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed as B = 1, or None. Run natively (one launch per
            stage over all chunks of all sequences); each sequence is its own call (states and semantic chunks
            restart at its first token; an empty sequence returns its initial states).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`atlaslab.kernels.utils.dot_precision` chooses.

    Returns:
        ``o: [B, T, H, D_v]``, the final memory M_T and momentum S_T, and the memory at the start of the last chunk
        (the ``MemoryState`` anchor), each ``[N, H, D_v, D_k]``.
    """
    return ChunkMomentumFunction.apply(q, k, v, beta, theta, alpha, initial_state, initial_momentum,
                                       int(chunk_size), bias, read, placement, cu_seqlens, allow_tf32)


__all__ = ["ChunkMomentumFunction", "chunk_coefficients", "chunk_momentum", "chunk_momentum_backward",
           "chunk_momentum_forward"]
