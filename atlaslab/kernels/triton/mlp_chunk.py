"""The per-chunk deep-memory update of a 2-layer MLP memory (residual or not, D_in = D_out or not) with the ℓ2 or the
dot-product bias, fused in Triton (issue 6): the gradient factors at the chunk-start anchor and the chunk-end weights
and momenta, with its plain torch reference beside it and the ``_dual_step``-compatible function that the torch
``chunked`` engine calls (``memorize(mode="triton")`` passes it as ``dual_step``).

Semantics (docs/concepts/memory.md: training chunk, after-step retention placement, GD / momentum, loss scaling
ℓ2 = ½‖M(x) − v‖², dot = −⟨M(x), v⟩; memory ``mlp`` with depth 2, no LayerNorm, ATLAS Eq.42:
M(x) = x + W2 σ(W1 x) with ``residual: true`` (needs D_in = D_out), M(x) = W2 σ(W1 x) with ``residual: false``).
One (batch, head) holds ``W1 [hidden, D_in]``, ``W2 [D_out, hidden]`` (and momenta ``S1, S2`` of the same shapes).
For the W window tokens i of one chunk (``x_i = φ(k_i) [D_in]``, ``v_i [D_out]``, the c − 1 window tokens before the
chunk included), every gradient is taken at the chunk-start anchor (W1, W2):

    z_i = W1 x_i,   a_i = σ(z_i),   pred_i = [x_i +] W2 a_i            ([x_i +]: residual only)
    e_i = ∂ℓ_i/∂pred_i = pred_i − v_i   (ℓ2)        e_i = −v_i   (dot: independent of the anchor, no forward)
    δ2_i = e_i                      (h2_i = a_i):  ∇_{W2} ℓ_i = δ2_i a_iᵀ
    δ1_i = (W2ᵀ e_i) ⊙ σ'(z_i)      (h1_i = x_i):  ∇_{W1} ℓ_i = δ1_i x_iᵀ

(the residual term changes pred, hence e under ℓ2, but not δ1, δ2: ∂(x + W2 a)/∂(W1, W2) = ∂(W2 a)/∂(W1, W2)), and
with row e (the chunk's last real token) of the dual-form coefficients of ``chunked._dual_aligned``
(``P_e, Q_e, Θ_e [B, H]``, ``A_e, S_e [B, H, W]``; no momentum: Q, Θ, S absent), for both weights W ∈ {W1, W2}:

    W_e = P_e W + Q_e S + Σ_i A_e[i] δ_i h_iᵀ
    S_e = Θ_e S + Σ_i S_e[i] δ_i h_iᵀ

σ ∈ {gelu (exact: σ = z Φ(z), σ' = Φ(z) + z φ(z)), silu (σ = z s, σ' = s (1 + z (1 − s)), s = sigmoid z),
relu (σ' = 1[z > 0], torch's convention at 0)}.

Pieces:

- :func:`mlp_chunk_reference`: exactly these equations in plain torch (differentiable: autograd through it gives the
  same first-order gradients as ``chunked.gradient_factors`` with ``create_graph`` plus ``_dual_step``'s sums);
- Triton, two kernels (fp32 intermediates; fp64 in, fp64 out, for tests; fp32 dots as
  :func:`.precision.dot_precision` chooses: TF32 for fp16 / bf16 inputs); ``RESIDUAL`` and ``DOT`` are constexpr switches:
  1. ``_mlp_err_kernel`` (ℓ2 only; one program per batch·head): z, a = σ(z) block by block over the hidden units
     (a is stored), pred = [x +] Σ_blocks a W2[:, blk]ᵀ, e = pred − v stored. The full hidden reduction in pred is
     the one synchronisation point of the step, hence the split into two kernels. Under the dot bias e = −v needs
     no forward, so this kernel is not launched;
  2. ``_mlp_update_kernel`` (hidden block × batch·head, parallel): each program owns one block of hidden units, i.e.
     rows of W1 / S1 and columns of W2 / S2: z and σ, σ' are recomputed from x and the W1 rows it loads anyway
     (σ'(z) at the anchor is needed for δ1 under both biases), δ1 = (e W2[:, blk]) ⊙ σ'(z) is stored, and the
     block's W1_e, W2_e (and S1_e, S2_e) are formed with one ``tl.dot`` each over the W window tokens. Under the dot
     bias it reads e = −v straight from v and also stores its block of a (and, block 0 only, e). Every weight /
     momentum element is read once by kernel 2 and written once; kernel 1 (ℓ2) reads W1, W2 once more.
- :class:`MLPChunkStep` / :func:`mlp_chunk_step`: the kernels as a ``torch.autograd.Function`` whose backward is
  autograd through :func:`mlp_chunk_reference` recomputed from the saved inputs (≥ fp32). It is first-order only
  (``once_differentiable``): the outer loss back-propagates *through the factors* δ1, δ2, a and the new states, which
  needs ∂(factors)/∂(W, x, v, …) — second derivatives of the inner loss, which the recompute provides because the
  reference writes δ1, δ2 in closed form — but never a gradient of those gradients. These are exactly the gradients
  that ``gradient_factors`` (``create_graph=True``) + ``_dual_step`` give the outer loss.
- :func:`mlp_dual_step`: the contract of ``chunked._dual_step`` for this memory and bias (returns the factors
  ``{"W1": (δ1, x), "W2": (δ2, a)}``, the new weights, the new momentum); :func:`spec_reason` says which specs it
  computes, and ``atlaslab.kernels.triton.select_mlp_step`` returns it when a kernel can run; ``chunked``'s
  ``_dual_aligned`` calls it once per chunk in place of ``_dual_step``.

Presets on it (``experiments/presets/``): omeganet (ℓ2, c = 4), dla (dot, c = 1),
swdt (dot, c = 4), deeptransformer (dot, no retention), dot (ℓ2, c = 4, no retention): all ``residual: false`` with the
polynomial / Taylor-φ* map, D_in = C(d + 2, 2) = 153 ≠ D_out = 16 at d = 16, hidden = 4 · 153 = 612. Not on it: atlas
(Muon; not the dual form), atlas_pp (``gated_mlp``), the ``mlp_ln`` presets (LayerNorm; titans and its hybrids
among them, whose plain residual ``mlp`` form — on it — diverges in training).

Limits: D_in, D_out ≤ 256, W ≤ 128 window tokens per chunk, any hidden width (looped in blocks of ≤ 64; ≤ 32 when
a D block is 256). Status: tested only under ``TRITON_INTERPRET=1`` on CPU (``tests/test_triton_mlp.py``); nothing
has run on a GPU and nothing is tuned (one config, ``num_warps=4``; kernel 2 holds [W, D_in] x, [W, D_out] e and
[hidden-block, D] weight tiles per program, which at D = 256, W = 128 may need a D-split).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from atlaslab.kernels.triton.fallback import with_torch_fallback
from atlaslab.kernels.triton.precision import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

#: activation name → the kernels' constexpr code
ACTIVATIONS = {"gelu": 0, "silu": 1, "relu": 2}
#: attentional bias name → the update kernel's ``DOT`` switch (ℓ2: e = pred − v; dot: e = −v)
BIASES = {"l2": 0, "dot": 1}
MAX_D = 256
MAX_W = 128
#: the hidden units one program of the update kernel owns (at most)
MAX_BLOCK_HIDDEN = 64
#: cap on a program's [hidden-block, D-block] weight tile (elements): BHID ≤ this / max(BD_in, BD_out)
MAX_TILE = 8192
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

Outputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                Optional[torch.Tensor], Optional[torch.Tensor]]


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


def check_args(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, activation, residual: bool = True,
               bias: str = "l2") -> None:
    """Validate shapes and options (see :func:`mlp_chunk_step`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got '{activation}'")
    if bias not in BIASES:
        raise ValueError(f"bias must be one of {tuple(BIASES)}, got '{bias}'")
    if x.dim() != 4 or v.dim() != 4 or v.shape[:3] != x.shape[:3]:
        raise ValueError(f"expected x: [B, H, W, D_in], v: [B, H, W, D_out]; got x {list(x.shape)}, "
                         f"v {list(v.shape)}")
    B, H, W, D = x.shape
    DO = v.shape[3]
    if residual and DO != D:
        raise ValueError(f"a residual memory needs D_in == D_out, got x {list(x.shape)}, v {list(v.shape)}")
    if W1.dim() != 4 or tuple(W1.shape[:2]) != (B, H) or W1.shape[3] != D:
        raise ValueError(f"W1: expected [B, H, hidden, D_in] = [{B}, {H}, hidden, {D}], got {list(W1.shape)}")
    hid = W1.shape[2]
    if tuple(W2.shape) != (B, H, DO, hid):
        raise ValueError(f"W2: expected [B, H, D_out, hidden] = {[B, H, DO, hid]}, got {list(W2.shape)}")
    mom = S_e is not None
    if any((z is not None) != mom for z in (S1, S2, Q_e, Th_e)):
        raise ValueError("momentum: give all of S1, S2, Q_e, Th_e, S_e (momentum GD) or none of them (GD)")
    for name, z, want in (("S1", S1, W1.shape), ("S2", S2, W2.shape), ("P_e", P_e, (B, H)), ("Q_e", Q_e, (B, H)),
                          ("Th_e", Th_e, (B, H)), ("A_e", A_e, (B, H, W)), ("S_e", S_e, (B, H, W))):
        if z is not None and tuple(z.shape) != tuple(want):
            raise ValueError(f"{name}: expected {list(want)}, got {list(z.shape)}")


def supports_shapes(x: torch.Tensor, W1: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the kernels take ``x [B, H, W, D_in]``, ``W1 [B, H, hidden, D_in]`` (and ``v [B, H, W, D_out]``),
    else why not."""
    W, D = x.shape[-2:]
    DO = D if v is None else v.shape[-1]
    if max(D, DO) > MAX_D or W > MAX_W or W < 1 or W1.shape[2] < 1:
        return (f"window tokens W = {W} (1..{MAX_W}), D_in = {D}, D_out = {DO} (≤ {MAX_D}), "
                f"hidden = {W1.shape[2]} (≥ 1)")
    return None


# ------------------------------------------------------------------------------------------ torch reference

def activation_and_derivative(z: torch.Tensor, activation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """σ(z) and σ'(z) in closed form (so autograd through σ' gives the second derivative the outer loss needs)."""
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _SQRT1_2))
        return z * cdf, cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    if activation == "silu":
        s = torch.sigmoid(z)
        return z * s, s * (1.0 + z * (1.0 - s))
    if activation == "relu":
        return torch.relu(z), (z > 0).to(z.dtype)
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got '{activation}'")


def mlp_chunk_reference(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, *, activation: str = "gelu",
                        residual: bool = True, bias: str = "l2") -> Outputs:
    """The module docstring's equations in plain torch (differentiable). Arguments and results as
    :func:`mlp_chunk_step`."""
    check_args(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, activation, residual, bias)
    z = x @ W1.mT                                        # z_i = W1 x_i                      [B, H, W, hidden]
    a, da = activation_and_derivative(z, activation)     # a_i = σ(z_i), σ'(z_i)
    if bias == "dot":
        e = -v                                           # e_i = −v_i (ℓ = −⟨M(x), v⟩)       [B, H, W, D_out]
    else:
        pred = a @ W2.mT                                 # W2 a_i
        e = (x + pred if residual else pred) - v         # e_i = [x_i +] W2 a_i − v_i = δ2_i [B, H, W, D_out]
    d1 = (e @ W2) * da                                   # δ1_i = (W2ᵀ e_i) ⊙ σ'(z_i)        [B, H, W, hidden]

    def rank1_sum(row, delta, h):                        # Σ_i row[i] δ_i h_iᵀ
        return (delta * row.unsqueeze(-1)).mT @ h

    def c(s):                                            # [B, H] → [B, H, 1, 1]
        return s[..., None, None]

    W1_e = c(P_e) * W1 + rank1_sum(A_e, d1, x)
    W2_e = c(P_e) * W2 + rank1_sum(A_e, e, a)
    S1_e = S2_e = None
    if S_e is not None:
        W1_e = W1_e + c(Q_e) * S1
        W2_e = W2_e + c(Q_e) * S2
        S1_e = c(Th_e) * S1 + rank1_sum(S_e, d1, x)
        S2_e = c(Th_e) * S2 + rank1_sum(S_e, e, a)
    return d1, e, a, W1_e, W2_e, S1_e, S2_e


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
    BW, BDI, BDO = _pow2(W), _pow2(DI), _pow2(DO)
    BHID = (int(block_hidden) if block_hidden
            else min(MAX_BLOCK_HIDDEN, _pow2(HID), max(16, MAX_TILE // max(BDI, BDO))))
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
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]

        def up(z):
            return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z

        with torch.enable_grad():
            leaves = [None if z is None else up(z.detach()).requires_grad_(bool(n)) for z, n in zip(inputs, needs)]
            outs = mlp_chunk_reference(*leaves, activation=ctx.activation, residual=ctx.residual, bias=ctx.bias)
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None and o.requires_grad]
        wanted = [i for i, (z, n) in enumerate(zip(leaves, needs)) if z is not None and n]
        result = [None] * len(inputs)
        if pairs and wanted:
            got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted],
                                      [g.to(o.dtype) for o, g in pairs], allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = torch.zeros_like(inputs[i]) if g is None else g.to(inputs[i].dtype)
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
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`.precision.dot_precision` chooses
            (TF32 for fp16 / bf16 inputs, else torch's float32 matmul precision; fp64 always IEEE).
        block_hidden: hidden units per program of the update kernel (power of two ≥ 16; default
            min(64, next power of two of hidden, max(16, 8192 / max(D-blocks)))).

    Returns:
        ``(δ1 [B, H, W, hidden], δ2 = e [B, H, W, D_out], a [B, H, W, hidden], W1_e, W2_e, S1_e, S2_e)`` in the
        inputs' dtypes (S1_e, S2_e None for GD). Intermediates are fp32 (fp64 for fp64 inputs).
    """
    return MLPChunkStep.apply(activation, bool(residual), bias, allow_tf32, block_hidden,
                              x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e)


# ------------------------------------------------------------------------------------------ engine contract

def spec_reason(parts) -> Optional[str]:
    """None when :func:`mlp_dual_step` computes ``parts``' chunk step exactly, else the first reason it does not.

    Memory ``mlp`` of depth 2, residual on or off, no LayerNorm, σ gelu / silu / relu, ℓ2 or dot bias, GD or
    momentum, D_in, D_out ≤ 256. The feature map (polynomial, Taylor φ*, …) is applied in torch before the step, and
    the window (any c), scalar decay after the step or no retention, the gates and the read are the caller's
    (``chunked._dual_aligned`` already requires the dual form: GD / momentum, after-step scalar decay).
    """
    s = parts.spec
    cfg = getattr(parts.memory, "cfg", None)
    ret = parts.retention
    checks = [
        (s.memory.name == "mlp", f"memory '{s.memory.name}' (mlp)"),
        (getattr(cfg, "depth", None) == 2, f"depth {getattr(cfg, 'depth', None)} (2)"),
        (not getattr(cfg, "layer_norm", True), "layer norm on (off)"),
        (getattr(cfg, "activation", None) in ACTIVATIONS,
         f"activation '{getattr(cfg, 'activation', None)}' ({', '.join(ACTIVATIONS)})"),
        (s.attentional_bias.name in BIASES, f"attentional bias '{s.attentional_bias.name}' ({', '.join(BIASES)})"),
        (s.inner_optimizer.name in ("gd", "momentum"), f"inner optimizer '{s.inner_optimizer.name}' (gd, momentum)"),
        (not ret.mirror and not ret.channel_wise, "mirror-map or channel-wise retention"),
        (not parts.kernel_trick, "the φ* kernel trick"),
        (parts.memory.in_dim <= MAX_D, f"key dim {parts.memory.in_dim} (≤ {MAX_D})"),
        (parts.memory.out_dim <= MAX_D, f"value dim {parts.memory.out_dim} (≤ {MAX_D})"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    return None


def mlp_dual_step(parts, weights, momentum, x, v, d, P_e, Q_e, A_e, Th_e, S_e):
    """``chunked._dual_step`` for the 2-layer MLP memory (residual or not) with the ℓ2 or dot bias, on the kernels.

    Args (as ``_dual_step``): ``weights = {"W1", "W2"}`` (anchor), ``momentum`` (same keys, or None for GD),
    ``x: [B, H, W, D_in]``, ``v: [B, H, W, D_out]``, ``d`` (Huber δ; unused by ℓ2 / dot), the coefficient rows
    ``P_e, Q_e, Th_e [B, H]``, ``A_e, S_e [B, H, W]`` (Q_e, Th_e, S_e None for GD).

    Returns ``(factors, new_weights, new_momentum)`` with ``factors = {"W1": (δ1, x), "W2": (δ2, a)}`` (the
    rank-1 factors of every per-token gradient at the anchor, ``gradient_factors``' layout and order). Shapes the
    kernels do not take (:func:`supports_shapes`) run ``chunked._dual_step`` instead.
    """
    from atlaslab.engines.chunked import _dual_step

    def torch_path():
        return _dual_step(parts, weights, momentum, x, v, d, P_e, Q_e, A_e, Th_e, S_e)
    if supports_shapes(x, weights["W1"], v) is not None:
        return torch_path()
    return with_torch_fallback(lambda: _mlp_dual_step_kernels(parts, weights, momentum, x, v, P_e, Q_e, A_e, Th_e, S_e),
                               torch_path, "mlp chunk step")


def _mlp_dual_step_kernels(parts, weights, momentum, x, v, P_e, Q_e, A_e, Th_e, S_e):
    """:func:`mlp_dual_step` on the kernels (shapes already checked)."""
    mom = S_e is not None
    cfg = parts.memory.cfg
    d1, d2, a, W1_e, W2_e, S1_e, S2_e = mlp_chunk_step(
        x, v, weights["W1"], weights["W2"], momentum["W1"] if mom else None, momentum["W2"] if mom else None,
        P_e, Q_e if mom else None, A_e, Th_e if mom else None, S_e, activation=cfg.activation,
        residual=cfg.residual, bias=parts.spec.attentional_bias.name)
    factors = {"W1": (d1, x), "W2": (d2, a)}
    new_momentum = {"W1": S1_e, "W2": S2_e} if mom else momentum
    return factors, {"W1": W1_e, "W2": W2_e}, new_momentum


__all__ = ["ACTIVATIONS", "BIASES", "MLPChunkStep", "activation_and_derivative", "mlp_chunk_forward",
           "mlp_chunk_reference", "mlp_chunk_step", "mlp_dual_step", "spec_reason", "supports_shapes"]
