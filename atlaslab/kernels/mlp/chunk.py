"""One chunk's step of the 2-layer MLP memory (residual or not, ℓ2 or dot bias, GD or momentum), fused in Triton: the
gradient factors δ1, δ2, a at the chunk-start anchor and the chunk-end weights and momenta.

Two kernels (docs/kernels.md#mlp): ``_mlp_err_kernel`` (ℓ2 only; the hidden reduction in the prediction is the
step's one synchronisation point) and ``_mlp_update_kernel`` (hidden block × batch·head, one ``tl.dot`` per new
weight block). :class:`MLPChunkStep` differentiates them by autograd through :func:`.naive.mlp_chunk_reference`
recomputed, first order only (what the outer loss needs). Limits: D_in, D_out ≤ 256, W ≤ 128 window tokens per
chunk, any hidden width (looped in blocks).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from atlaslab.kernels.common.lang import tl, triton
from atlaslab.kernels.mlp.naive import ACTIVATIONS, Outputs, check_args, mlp_chunk_reference
from atlaslab.kernels.utils import MAX_D, dot_precision, pow2, reference_backward

MAX_W = 128
#: the hidden units one program of the update kernel owns (at most)
MAX_BLOCK_HIDDEN = 64
#: cap on a program's [hidden-block, D-block] weight tile (elements): BHID ≤ this / max(BD_in, BD_out)
MAX_TILE = 8192


def supports_shapes(x: torch.Tensor, W1: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the kernels take ``x [B, H, W, D_in]``, ``W1 [B, H, hidden, D_in]`` (and ``v [B, H, W, D_out]``),
    else why not."""
    W, D = x.shape[-2:]
    DO = D if v is None else v.shape[-1]
    if max(D, DO) > MAX_D or W > MAX_W or W < 1 or W1.shape[2] < 1:
        return (f"window tokens W = {W} (1..{MAX_W}), D_in = {D}, D_out = {DO} (≤ {MAX_D}), "
                f"hidden = {W1.shape[2]} (≥ 1)")
    return None


# ------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _act(z, ACT: tl.constexpr):
        """σ(z), σ'(z) for ACT = 0 gelu (exact), 1 silu, 2 relu."""
        if ACT == 0:
            cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
            a = z * cdf
            da = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        elif ACT == 1:
            s = tl.sigmoid(z)
            a = z * s
            da = s * (1.0 + z * (1.0 - s))
        else:
            a = tl.maximum(z, 0.0)
            da = (z > 0).to(z.dtype)
        return a, da

    @triton.jit
    def _mlp_err_kernel(x, v, w1, w2, a_out, e_out, W, DI, DO, HID, BW: tl.constexpr, BDI: tl.constexpr,
                        BDO: tl.constexpr, BHID: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
                        PRECISION: tl.constexpr):
        """Kernel 1, ℓ2 bias (one program per batch·head): a = σ(x W1ᵀ) block by block, pred = [x +] Σ_blocks a W2ᵀ,
        e = pred − v. ``x [BH, W, DI]``, ``v, e_out [BH, W, DO]``, ``w1 [BH, HID, DI]``, ``w2 [BH, DO, HID]``,
        ``a_out [BH, W, HID]``; RESIDUAL needs DI == DO (so BDI == BDO). Computes in ``e_out``'s dtype (fp32 / fp64)."""
        i_bh = tl.program_id(0).to(tl.int64)
        ct = e_out.dtype.element_ty
        o_w = tl.arange(0, BW)
        o_di = tl.arange(0, BDI)
        o_do = tl.arange(0, BDO)
        o_h = tl.arange(0, BHID)
        m_w = o_w < W
        m_di = o_di < DI
        m_do = o_do < DO
        m_wi = m_w[:, None] & m_di[None, :]
        m_wo = m_w[:, None] & m_do[None, :]
        xo = i_bh * W * DI + o_w[:, None] * DI + o_di[None, :]                                # [BW, BDI]
        vo = i_bh * W * DO + o_w[:, None] * DO + o_do[None, :]                                # [BW, BDO]
        b_x = tl.load(x + xo, mask=m_wi, other=0.0).to(ct)
        b_pred = tl.zeros([BW, BDO], dtype=ct)
        if RESIDUAL:
            b_pred += b_x
        for h0 in range(0, HID, BHID):
            c_h = h0 + o_h
            m_h = c_h < HID
            b_w1 = tl.load(w1 + i_bh * HID * DI + c_h[:, None] * DI + o_di[None, :],
                           mask=m_h[:, None] & m_di[None, :], other=0.0).to(ct)                # [BHID, BDI]
            z = tl.dot(b_x, tl.trans(b_w1), input_precision=PRECISION)                      # [BW, BHID]
            a, _ = _act(z, ACT)
            m_wh = m_w[:, None] & m_h[None, :]
            a = tl.where(m_wh, a, 0.0)
            tl.store(a_out + i_bh * W * HID + o_w[:, None] * HID + c_h[None, :], a, mask=m_wh)
            b_w2 = tl.load(w2 + i_bh * DO * HID + o_do[:, None] * HID + c_h[None, :],
                           mask=m_do[:, None] & m_h[None, :], other=0.0).to(ct)                # [BDO, BHID]
            b_pred += tl.dot(a, tl.trans(b_w2), input_precision=PRECISION)
        b_v = tl.load(v + vo, mask=m_wo, other=0.0).to(ct)
        tl.store(e_out + vo, b_pred - b_v, mask=m_wo)

    @triton.jit
    def _mlp_update_kernel(x, e, w1, w2, s1, s2, p, q, th, a_row, s_row, d1_out, w1_out, w2_out, s1_out, s2_out,
                           a_out, e_out, W, DI, DO, HID, BW: tl.constexpr, BDI: tl.constexpr, BDO: tl.constexpr,
                           BHID: tl.constexpr, ACT: tl.constexpr, HAS_MOM: tl.constexpr, DOT: tl.constexpr,
                           PRECISION: tl.constexpr):
        """Kernel 2 (hidden block × batch·head): for the block's hidden units, δ1 = (e W2[:, blk]) ⊙ σ'(x W1[blk]ᵀ),
        W1_e[blk] = P W1[blk] + Q S1[blk] + (A ⊙ δ1)ᵀ x,  W2_e[:, blk] = P W2[:, blk] + Q S2[:, blk] + (A ⊙ e)ᵀ a,
        S1_e[blk] = Θ S1[blk] + (S ⊙ δ1)ᵀ x,  S2_e[:, blk] = Θ S2[:, blk] + (S ⊙ e)ᵀ a.

        ``x [BH, W, DI]``, ``e [BH, W, DO]`` (kernel 1's errors; under DOT the targets v, and e = −v),
        ``w1, s1 [BH, HID, DI]``, ``w2, s2 [BH, DO, HID]``, ``p, q, th [BH]``, ``a_row, s_row [BH, W]``,
        ``d1_out [BH, W, HID]``; ``e_out [BH, W, DO]`` in the compute dtype (under ℓ2 the same buffer as ``e``). Under
        DOT it also stores its block of a into ``a_out [BH, W, HID]`` and (block 0) e = −v into ``e_out`` (no kernel 1
        then)."""
        i_hb = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        ct = e_out.dtype.element_ty                               # the compute dtype (fp32, or fp64)
        o_w = tl.arange(0, BW)
        o_di = tl.arange(0, BDI)
        o_do = tl.arange(0, BDO)
        c_h = i_hb * BHID + tl.arange(0, BHID)
        m_w = o_w < W
        m_di = o_di < DI
        m_do = o_do < DO
        m_h = c_h < HID
        m_wi = m_w[:, None] & m_di[None, :]
        m_wo = m_w[:, None] & m_do[None, :]
        m_wh = m_w[:, None] & m_h[None, :]
        m_hd = m_h[:, None] & m_di[None, :]
        m_dh = m_do[:, None] & m_h[None, :]
        xo = i_bh * W * DI + o_w[:, None] * DI + o_di[None, :]                                # [BW, BDI]
        eo = i_bh * W * DO + o_w[:, None] * DO + o_do[None, :]                                # [BW, BDO]
        wh = i_bh * W * HID + o_w[:, None] * HID + c_h[None, :]                               # [BW, BHID]
        w1_offs = i_bh * HID * DI + c_h[:, None] * DI + o_di[None, :]                         # [BHID, BDI]
        w2_offs = i_bh * DO * HID + o_do[:, None] * HID + c_h[None, :]                        # [BDO, BHID]
        b_x = tl.load(x + xo, mask=m_wi, other=0.0).to(ct)
        b_e = tl.load(e + eo, mask=m_wo, other=0.0).to(ct)
        if DOT:                                                   # e = ∂(−⟨pred, v⟩)/∂pred = −v
            b_e = -b_e
            w_store = tl.where(i_hb == 0, W, 0)                   # block 0 stores e; the others store nothing
            tl.store(e_out + eo, b_e, mask=(o_w < w_store)[:, None] & m_do[None, :])
        b_w1 = tl.load(w1 + w1_offs, mask=m_hd, other=0.0).to(ct)
        b_w2 = tl.load(w2 + w2_offs, mask=m_dh, other=0.0).to(ct)
        z = tl.dot(b_x, tl.trans(b_w1), input_precision=PRECISION)                          # [BW, BHID]
        a, da = _act(z, ACT)
        a = tl.where(m_wh, a, 0.0)
        if DOT:
            tl.store(a_out + wh, a.to(a_out.dtype.element_ty), mask=m_wh)
        b_d1 = tl.where(m_wh, tl.dot(b_e, b_w2, input_precision=PRECISION) * da, 0.0)     # δ1 [BW, BHID]
        tl.store(d1_out + wh, b_d1.to(d1_out.dtype.element_ty), mask=m_wh)
        b_ar = tl.load(a_row + i_bh * W + o_w, mask=m_w, other=0.0).to(ct)
        p_e = tl.load(p + i_bh).to(ct)
        new_w1 = p_e * b_w1 + tl.dot(tl.trans(b_d1 * b_ar[:, None]), b_x, input_precision=PRECISION)
        new_w2 = p_e * b_w2 + tl.dot(tl.trans(b_e * b_ar[:, None]), a, input_precision=PRECISION)
        if HAS_MOM:
            b_s1 = tl.load(s1 + w1_offs, mask=m_hd, other=0.0).to(ct)
            b_s2 = tl.load(s2 + w2_offs, mask=m_dh, other=0.0).to(ct)
            q_e = tl.load(q + i_bh).to(ct)
            t_e = tl.load(th + i_bh).to(ct)
            b_sr = tl.load(s_row + i_bh * W + o_w, mask=m_w, other=0.0).to(ct)
            new_w1 += q_e * b_s1
            new_w2 += q_e * b_s2
            new_s1 = t_e * b_s1 + tl.dot(tl.trans(b_d1 * b_sr[:, None]), b_x, input_precision=PRECISION)
            new_s2 = t_e * b_s2 + tl.dot(tl.trans(b_e * b_sr[:, None]), a, input_precision=PRECISION)
            tl.store(s1_out + w1_offs, new_s1.to(s1_out.dtype.element_ty), mask=m_hd)
            tl.store(s2_out + w2_offs, new_s2.to(s2_out.dtype.element_ty), mask=m_dh)
        tl.store(w1_out + w1_offs, new_w1.to(w1_out.dtype.element_ty), mask=m_hd)
        tl.store(w2_out + w2_offs, new_w2.to(w2_out.dtype.element_ty), mask=m_dh)


def mlp_chunk_forward(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, *, activation: str = "gelu",
                      residual: bool = True, bias: str = "l2", allow_tf32: Optional[bool] = None,
                      block_hidden: Optional[int] = None) -> Outputs:
    """The kernels, no autograd; arguments and results as :func:`mlp_chunk_step`."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("mlp_chunk_forward needs triton")
    check_args(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, activation, residual, bias)
    why = supports_shapes(x, W1, v)
    if why is not None:
        raise ValueError(f"mlp_chunk (triton): unsupported shape: {why}")
    B, H, W, DI = x.shape
    DO = v.shape[3]
    HID = W1.shape[2]
    has_mom = S_e is not None
    dot = bias == "dot"
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, v, W1, W2, P_e, A_e = (z.contiguous() for z in (x, v, W1, W2, P_e, A_e))
    if has_mom:
        S1, S2, Q_e, Th_e, S_e = (z.contiguous() for z in (S1, S2, Q_e, Th_e, S_e))
    kw = dict(device=x.device)
    a = torch.empty(B, H, W, HID, dtype=ct, **kw)
    e = torch.empty(B, H, W, DO, dtype=ct, **kw)
    d1 = torch.empty(B, H, W, HID, dtype=x.dtype, **kw)
    W1_e, W2_e = torch.empty_like(W1), torch.empty_like(W2)
    S1_e, S2_e = (torch.empty_like(S1), torch.empty_like(S2)) if has_mom else (None, None)
    BW, BDI, BDO = pow2(W), pow2(DI), pow2(DO)
    BHID = (int(block_hidden) if block_hidden
            else min(MAX_BLOCK_HIDDEN, pow2(HID), max(16, MAX_TILE // max(BDI, BDO))))
    if BHID < 16 or BHID & (BHID - 1):
        raise ValueError(f"block_hidden must be a power of two ≥ 16, got {block_hidden}")
    prec = dot_precision(x.dtype, allow_tf32)
    act = ACTIVATIONS[activation]
    if not dot:
        _mlp_err_kernel[(B * H,)](x, v, W1, W2, a, e, W, DI, DO, HID, BW=BW, BDI=BDI, BDO=BDO, BHID=BHID, ACT=act,
                                  RESIDUAL=bool(residual), PRECISION=prec, num_warps=4)
    dummy = P_e
    _mlp_update_kernel[(triton.cdiv(HID, BHID), B * H)](
        x, v if dot else e, W1, W2, S1 if has_mom else dummy, S2 if has_mom else dummy, P_e,
        Q_e if has_mom else dummy, Th_e if has_mom else dummy, A_e, S_e if has_mom else dummy, d1, W1_e, W2_e,
        S1_e if has_mom else dummy, S2_e if has_mom else dummy, a, e, W, DI, DO, HID, BW=BW, BDI=BDI, BDO=BDO,
        BHID=BHID, ACT=act, HAS_MOM=has_mom, DOT=dot, PRECISION=prec, num_warps=4)
    return d1, e.to(v.dtype), a.to(x.dtype), W1_e, W2_e, S1_e, S2_e


class MLPChunkStep(torch.autograd.Function):
    """Triton forward (:func:`mlp_chunk_forward`); backward = autograd through :func:`mlp_chunk_reference`
    recomputed from the saved inputs (in ≥ fp32). First-order only (``once_differentiable``): see the module
    docstring for why that is all the outer loss needs."""

    @staticmethod
    def forward(ctx, activation, residual, bias, allow_tf32, block_hidden, *inputs):
        ctx.activation, ctx.residual, ctx.bias = activation, residual, bias
        ctx.save_for_backward(*inputs)
        return mlp_chunk_forward(*inputs, activation=activation, residual=residual, bias=bias,
                                 allow_tf32=allow_tf32, block_hidden=block_hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        result = reference_backward(mlp_chunk_reference, ctx.saved_tensors, ctx.needs_input_grad[5:], grads,
                                    activation=ctx.activation, residual=ctx.residual, bias=ctx.bias)
        return (None, None, None, None, None, *result)


def mlp_chunk_step(x: torch.Tensor, v: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor,
                   S1: Optional[torch.Tensor], S2: Optional[torch.Tensor], P_e: torch.Tensor,
                   Q_e: Optional[torch.Tensor], A_e: torch.Tensor, Th_e: Optional[torch.Tensor],
                   S_e: Optional[torch.Tensor], *, activation: str = "gelu", residual: bool = True,
                   bias: str = "l2", allow_tf32: Optional[bool] = None, block_hidden: Optional[int] = None) -> Outputs:
    """One chunk's gradient factors at the anchor and chunk-end weights / momenta of the 2-layer MLP memory with the
    ℓ2 or dot bias, for all (batch, head) at once (Triton forward, torch-recompute backward).

    Args:
        x: ``[B, H, W, D_in]`` the chunk's window inputs φ(k_i) (W = c − 1 + b tokens); v: ``[B, H, W, D_out]``
            targets.
        W1: ``[B, H, hidden, D_in]``, W2: ``[B, H, D_out, hidden]``: the chunk-start (anchor) weights.
        S1, S2: the momenta (shapes of W1, W2), or None for GD.
        P_e: ``[B, H]``; Q_e, Th_e: ``[B, H]`` or None (GD); A_e: ``[B, H, W]``; S_e: ``[B, H, W]`` or None (GD):
            row e of the dual-form coefficients (``chunked._dual_aligned``).
        activation: ``gelu`` (exact), ``silu`` or ``relu``.
        residual: M(x) = x + W2 σ(W1 x) (needs D_in = D_out) or, False, M(x) = W2 σ(W1 x).
        bias: ``l2`` (e = M(x) − v) or ``dot`` (e = −v).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`atlaslab.kernels.utils.dot_precision` chooses
            (TF32 for fp16 / bf16 inputs, else torch's float32 matmul precision; fp64 always IEEE).
        block_hidden: hidden units per program of the update kernel (power of two ≥ 16; default
            min(64, next power of two of hidden, max(16, 8192 / max(D-blocks)))).

    Returns:
        ``(δ1 [B, H, W, hidden], δ2 = e [B, H, W, D_out], a [B, H, W, hidden], W1_e, W2_e, S1_e, S2_e)`` in the
        inputs' dtypes (S1_e, S2_e None for GD). Intermediates are fp32 (fp64 for fp64 inputs).
    """
    return MLPChunkStep.apply(activation, bool(residual), bias, allow_tf32, block_hidden,
                              x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e)


__all__ = ["MAX_D", "MAX_W", "MLPChunkStep", "mlp_chunk_forward", "mlp_chunk_step", "supports_shapes"]
