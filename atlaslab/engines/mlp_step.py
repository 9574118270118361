"""The deep MLP memory's chunk step and read in the dual form as two ``torch.autograd.Function``s with hand-written
backward passes (one autograd node per chunk step, one per read).

The plain reference is :mod:`atlaslab.engines.chunked` (``gradient_factors`` + ``_dual_end`` for a chunk step,
``_dual_read`` over :class:`~atlaslab.memory.fast_weights.DualForm` weights for the reads): autograd builds a graph of
many small element-wise nodes there (the create-graph backward of the memory, the rank-1 sums), and on a CPU at
the search's sizes that bookkeeping, not the matmuls, is most of a training step. Here the same equations run
without a graph and their outer gradients are written out below. :func:`supports` says where this path applies
(``chunked._dual_aligned`` routes to it there and keeps the reference everywhere else).

Memory (Titans §3.2 L_M-layer MLP, ATLAS Eq.42, Miras §5.3 / TTT §2.7 with LayerNorm), depth L, per (batch, head),
window tokens i = 1..n (leading ``[B, H]`` dims dropped; every tensor below has them):

    h_0 = x                        [n, F]            (φ(k_i) of the chunk's window tokens)
    z_j = h_{j−1} W_jᵀ              [n, out_j]        W_j: [out_j, in_j], j = 1..L
    h_j = σ(z_j)                    (j < L)
    nrm = (z_L − μ) ⊙ rstd,  b = nrm ⊙ g + β  (layer_norm; else b = z_L)     g, β: [V] (outer-loop LN affine)
    pred = x + b (residual) or b                  [n, V]
    err = pred − v (ℓ2, Titans Eq.12)  or  err = −v (dot)

Per-token inner gradients ∇_{W_j} ℓ_i = δ_{j,i} h_{j−1,i}ᵀ (rank-1; ``gradient_factors``):

    e' = err ⊙ g,  δ_L = rstd ⊙ (e' − mean(e') − nrm ⊙ mean(e' ⊙ nrm))   (= Jᵀ e', J = ∂nrm/∂z_L; else δ_L = err)
    δ_j = (δ_{j+1} W_{j+1}) ⊙ σ'(z_j)              (j < L)

Chunk end (row e of the dual-form coefficients, ``chunked._dual_end``; P, Q, Θ: ``[B, H]``, A, S_c: ``[B, H, n]``):

    W_j' = P W_j + Q S_j + Σ_i A_i δ_{j,i} h_{j−1,i}ᵀ,     S_j' = Θ S_j + Σ_i S_{c,i} δ_{j,i} h_{j−1,i}ᵀ

Outer backward of the step (bars are the incoming gradients of the outputs δ_j, h_j, W_j', S_j'):

1. chunk end: W̄_j += P W̄_j',  S̄_j += Q W̄_j' + Θ S̄_j',  P̄ = Σ⟨W̄_j', W_j⟩, Q̄ = Σ⟨W̄_j', S_j⟩, Θ̄ = Σ⟨S̄_j', S_j⟩;
   with M_j = h_{j−1} W̄_j'ᵀ, N_j = h_{j−1} S̄_j'ᵀ ([n, out_j]): δ̄_j += A ⊙ M_j + S_c ⊙ N_j,
   Ā_i = Σ_j ⟨δ_{j,i}, M_{j,i}⟩, S̄_{c,i} = Σ_j ⟨δ_{j,i}, N_{j,i}⟩, h̄_{j−1} += (A ⊙ δ_j) W̄_j' + (S_c ⊙ δ_j) S̄_j'.
2. the δ chain, j = 1..L−1 (t_j = δ_{j+1} W_{j+1}): t̄ = δ̄_j ⊙ σ'(z_j), z̄_j += δ̄_j ⊙ t_j ⊙ σ''(z_j) (second order),
   δ̄_{j+1} += t̄ W_{j+1}ᵀ, W̄_{j+1} += δ_{j+1}ᵀ t̄.
3. δ_L: without LN ērr = δ̄_L. With LN, φ = ⟨δ̄_L, δ_L⟩: ē' = Jᵀ δ̄_L (J is symmetric), and through z_L
   z̄_L += Jᵀ u − rstd φ nrm / V with u = ∂φ/∂nrm = rstd (−δ̄_L mean(e' ⊙ nrm) − ⟨δ̄_L, nrm⟩ e' / V)
   (the last term from ∂rstd⁻¹/∂z_L = nrm / V); ḡ += Σ_i ē' ⊙ err, ērr = ē' ⊙ g.
   Then v̄ = −ērr, and for ℓ2 pred̄ = ērr: x̄ += pred̄ (residual); with LN β̄ += Σ pred̄, ḡ += Σ pred̄ ⊙ nrm,
   z̄_L += Jᵀ(pred̄ ⊙ g); else z̄_L += pred̄.
4. the forward chain, j = L..1: W̄_j += z̄_jᵀ h_{j−1}, h̄_{j−1} += z̄_j W_j, z̄_{j−1} += h̄_{j−1} ⊙ σ'(z_{j−1}) (x̄ for j = 1).

Read (every chunk's positions s = 1..b folded into the batch, ``_dual_read``): per layer
z_j = (A ⊙ (h_{j−1} r_jᵀ)) l_j + P ⊙ (h_{j−1} W_jᵀ) + Q ⊙ (h_{j−1} S_jᵀ) (``DualForm.apply``; A: ``[b, n]``, P, Q:
``[b]``, l_j = δ_j ``[n, out_j]``, r_j = h_{j−1} of the writes ``[n, in_j]``), then σ, LN and residual as above.
Its backward is first order: with K = h r_jᵀ, l̄_j = (A ⊙ K)ᵀ z̄, Ā += (z̄ l_jᵀ) ⊙ K, K̄ = (z̄ l_jᵀ) ⊙ A, r̄_j = K̄ᵀ h,
P̄ = Σ z̄ ⊙ (h W_jᵀ), W̄_j = (P z̄)ᵀ h (Q, S_j alike), h̄ = K̄ r_j + (P z̄) W_j + (Q z̄) S_j.

Both Functions are first-order (``once_differentiable``): the outer loss needs the first derivative of the step,
which contains the second derivative of the inner loss (step 2 and 3 above), and nothing differentiates it again.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch.autograd.function import once_differentiable

from atlaslab.memory.architectures import MLPMemory
from atlaslab.memory.attentional_biases import L2, DotProduct

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
ACTIVATIONS = ("gelu", "silu", "relu", "tanh")
LN_EPS = 1e-5     # F.layer_norm's default, what MLPMemory._finish uses


def supports(parts, dtype: torch.dtype) -> Optional[str]:
    """None when this path computes ``parts``' dual-form chunk step and read exactly, else the first reason not.

    The MLP memory (``mlp`` / ``mlp_ln``, any depth, residual and LayerNorm on or off, σ in :data:`ACTIVATIONS`)
    with the ℓ2 or dot bias, in float32 / float64. The dual form itself (GD / momentum, scalar decay after the step)
    is ``chunked.uses_dual_form``'s check.
    """
    mem, bias = parts.memory, parts.attentional_bias
    checks = [
        (isinstance(mem, MLPMemory), f"memory {type(mem).__name__} (MLPMemory)"),
        (getattr(getattr(mem, "cfg", None), "activation", None) in ACTIVATIONS, "activation"),
        (type(bias) in (L2, DotProduct), f"attentional bias {type(bias).__name__} (L2, DotProduct)"),
        (dtype in (torch.float32, torch.float64), f"dtype {dtype} (float32, float64)"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    return None


def _act(z: torch.Tensor, name: str) -> torch.Tensor:
    """σ(z), the same call as the memory's forward (``ACTIVATIONS`` of architectures.py)."""
    if name == "gelu":
        return torch.nn.functional.gelu(z)
    if name == "silu":
        return torch.nn.functional.silu(z)
    if name == "relu":
        return torch.relu(z)
    return torch.tanh(z)


def _act_back(g: torch.Tensor, z: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    """g ⊙ σ'(z) (``h = σ(z)``), with the same kernels autograd uses for σ's backward."""
    if name == "gelu":
        return torch.ops.aten.gelu_backward(g, z)
    if name == "silu":
        return torch.ops.aten.silu_backward(g, z)
    if name == "relu":
        return torch.ops.aten.threshold_backward(g, h, 0)
    return torch.ops.aten.tanh_backward(g, h)


def _act_deriv(z: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    """σ'(z) (``h = σ(z)``) as a tensor, from the kernels of :func:`_act_back` with a unit gradient: formed once
    per chunk step, then every g ⊙ σ'(z) of the step and its backward is one multiplication."""
    return _act_back(torch.ones_like(z), z, h, name)


def _act_second(z: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    """σ''(z) in closed form (``h = σ(z)``): gelu φ(z)(2 − z²), silu s(1 − s)(2 + z(1 − 2s)), relu 0,
    tanh −2 t (1 − t²)."""
    if name == "gelu":
        zz = z * z
        return torch.exp(zz * -0.5) * _INV_SQRT_2PI * (2.0 - zz)
    if name == "silu":
        sg = torch.sigmoid(z)
        return sg * (1.0 - sg) * (2.0 + z * (1.0 - 2.0 * sg))
    if name == "relu":
        return torch.zeros_like(z)
    return -2.0 * h * (1.0 - h * h)


def _ln_back(u: torch.Tensor, z: torch.Tensor, mu: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Jᵀ u for J = ∂ LN(z)/∂z (symmetric): rstd ⊙ (u − mean(u) − nrm ⊙ mean(u ⊙ nrm)), LayerNorm's own backward
    kernel (``mu``, ``rstd``: the forward's statistics ``[..., 1]``)."""
    return torch.ops.aten.native_layer_norm_backward(u, z, [z.shape[-1]], mu, rstd, None, None,
                                                     [True, False, False])[0]


def _narrow(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` has a narrow output (N < 16 columns, more rows than columns)."""
    return b.shape[-1] < 16 and a.shape[-2] > b.shape[-1]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``; a narrow product is computed as ``(bᵀ aᵀ)ᵀ`` and made contiguous, which on one thread
    at the memories' sizes takes about 60 % of MKL's batched GEMM on the narrow output (e.g.
    ``[128, 16, 32] @ [128, 32, 8]``; the same products, the sums possibly in another order). The copy keeps the
    element-wise work downstream on contiguous tensors (several times slower on a transposed view)."""
    return torch.bmm(b.mT, a.mT).mT.contiguous() if _narrow(a, b) else torch.bmm(a, b)


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.baddbmm(c, a, b)``, transposed like :func:`_bmm`."""
    return torch.baddbmm(c.mT, b.mT, a.mT).mT.contiguous() if _narrow(a, b) else torch.baddbmm(c, a, b)


def _flat(t: Optional[torch.Tensor], BH: int) -> Optional[torch.Tensor]:
    """``[B, H, ...]`` → ``[B·H, ...]`` (a view where the layout allows)."""
    return None if t is None else t.reshape(BH, *t.shape[2:])


def _col(t: Optional[torch.Tensor], BH: int) -> Optional[torch.Tensor]:
    """Per-(batch, head) scalars ``[B, H]`` → ``[B·H, 1, 1]``."""
    return None if t is None else t.reshape(BH, 1, 1)


def _head_rows(ln: Optional[torch.Tensor], B: int) -> Optional[torch.Tensor]:
    """A per-head LN affine ``[H, V]`` → ``[B·H, 1, V]`` (as ``_MLPBase._finish`` broadcasts it)."""
    return None if ln is None else ln.unsqueeze(0).expand(B, *ln.shape).reshape(-1, 1, ln.shape[-1])


def _head_sum(g: torch.Tensor, B: int) -> torch.Tensor:
    """``[B·H, n, V]`` → ``[H, V]`` (the gradient of a per-head LN affine)."""
    return g.sum(1).reshape(B, -1, g.shape[-1]).sum(0)


def _cfg(parts, momentum: bool) -> tuple:
    """(depth, activation, residual, layer_norm, bias 'l2' | 'dot', momentum?): what the Functions branch on."""
    c = parts.memory.cfg
    return (c.depth, c.activation, bool(c.residual), bool(c.layer_norm),
            "dot" if isinstance(parts.attentional_bias, DotProduct) else "l2", momentum)


def _add(a, b):
    return b if a is None else (a if b is None else a + b)


class MLPDualStep(torch.autograd.Function):
    """One chunk's gradient factors at the anchor and its chunk-end weights / momenta (module docstring, steps
    1–4 for the backward). Computes on ``[B·H, ...]`` views with ``bmm`` / ``baddbmm``.

    ``apply(cfg, x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, ln_b, W_1 … W_L, S_1 … S_L)``: ``x [B, H, n, F]``,
    ``v [B, H, n, V]``, ``P_e, Q_e, Th_e [B, H]``, ``A_e, S_e [B, H, n]`` (Q_e, Th_e, S_e and the S_j None for GD),
    ``ln_w, ln_b [H, V]`` (None without LayerNorm), ``W_j [B, H, out_j, in_j]``. Returns
    ``(δ_1 … δ_L, h_1 … h_{L−1}, W_1' … W_L'[, S_1' … S_L'])``, each ``[B, H, ...]``.
    """

    @staticmethod
    def forward(ctx, cfg, x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, ln_b, *ws):
        L, act, residual, layer_norm, bias, mom = cfg
        B, H = x.shape[:2]
        BH = B * H
        W = [_flat(w, BH) for w in ws[:L]]
        S = [_flat(w, BH) for w in ws[L:]] if mom else None
        x3, v3 = _flat(x, BH), _flat(v, BH)
        P, Q, Th = _col(P_e, BH), _col(Q_e, BH), _col(Th_e, BH)
        A = A_e.reshape(BH, -1, 1)
        Sc = S_e.reshape(BH, -1, 1) if mom else None
        g = _head_rows(ln_w, B)
        hs, zs = [x3], []
        for j in range(L):
            if j > 0:
                hs.append(_act(zs[-1], act))
            zs.append(_bmm(hs[-1], W[j].mT))
        zL = zs[-1]
        if layer_norm:
            nrm, mu, rstd = torch.native_layer_norm(zL, (zL.shape[-1],), None, None, LN_EPS)
            branch = torch.addcmul(_head_rows(ln_b, B), nrm, g)
        else:
            nrm = mu = rstd = None
            branch = zL
        if bias == "l2":
            err = ((x3 + branch) if residual else branch) - v3
        else:
            err = -v3
        e_ = err * g if layer_norm else err
        deltas = [None] * L
        deltas[L - 1] = _ln_back(e_, zL, mu, rstd) if layer_norm else err
        ts, ds = [None] * L, [None] * L
        for j in range(L - 2, -1, -1):
            ts[j] = _bmm(deltas[j + 1], W[j + 1])                   # t_j = δ_{j+1} W_{j+1}
            ds[j] = _act_deriv(zs[j], hs[j + 1], act)                    # σ'(z_j)
            deltas[j] = ts[j] * ds[j]
        new_w, new_s = [], []
        for j in range(L):
            dl, r = deltas[j], hs[j]
            base = P * W[j] + Q * S[j] if mom else P * W[j]
            new_w.append(_baddbmm(base, (dl * A).mT, r).view(ws[j].shape))
            if mom:
                new_s.append(_baddbmm(Th * S[j], (dl * Sc).mT, r).view(ws[j].shape))
        ctx.cfg = cfg
        ctx.shapes = (B, H, x.shape, v.shape, [w.shape for w in ws])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x3, P, Q, A, Th, Sc, g, nrm, mu, rstd, err, e_, *W, *(S or []), *zs, *hs[1:], *deltas,
                              *ts[:L - 1], *ds[:L - 1])
        return (*(d.view(B, H, *d.shape[1:]) for d in deltas), *(h.view(B, H, *h.shape[1:]) for h in hs[1:]),
                *new_w, *new_s)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        L, act, residual, layer_norm, bias, mom = ctx.cfg
        B, H, x_shape, v_shape, w_shapes = ctx.shapes
        BH = B * H
        saved = ctx.saved_tensors
        x3, P, Q, A, Th, Sc, g, nrm, mu, rstd, err, e_ = saved[:12]
        rest = list(saved[12:])
        W, rest = rest[:L], rest[L:]
        if mom:
            S, rest = rest[:L], rest[L:]
        zs, rest = rest[:L], rest[L:]
        hs, rest = [x3] + rest[:L - 1], rest[L - 1:]
        deltas, ts, ds = rest[:L], rest[L:2 * L - 1], rest[2 * L - 1:]
        g_delta = [_flat(t, BH) for t in grads[:L]]
        g_h = [None] + [_flat(t, BH) for t in grads[L:2 * L - 1]]      # g_h[j]: gradient of h_j (h_0 = x apart)
        g_w_new = [_flat(t, BH) for t in grads[2 * L - 1:3 * L - 1]]
        g_s_new = [_flat(t, BH) for t in grads[3 * L - 1:4 * L - 1]] if mom else [None] * L
        gW: List[Optional[torch.Tensor]] = [None] * L
        gS: List[Optional[torch.Tensor]] = [None] * L
        gP = gQ = gA = gTh = gSc = gx = None
        # 1. chunk end
        for j in range(L):
            dl, r = deltas[j], hs[j]
            gr = None
            gwn, gsn = g_w_new[j], g_s_new[j]
            if gwn is not None:
                gW[j] = P * gwn
                gP = _add(gP, (gwn * W[j]).sum((-1, -2)))
                if mom:
                    gS[j] = Q * gwn
                    gQ = _add(gQ, (gwn * S[j]).sum((-1, -2)))
                M = _bmm(r, gwn.mT)                                    # [BH, n, out_j]
                g_delta[j] = _add(g_delta[j], A * M)
                gA = _add(gA, (dl * M).sum(-1))
                gr = _bmm(dl * A, gwn)
            if mom and gsn is not None:
                gS[j] = _add(gS[j], Th * gsn)
                gTh = _add(gTh, (gsn * S[j]).sum((-1, -2)))
                N = _bmm(r, gsn.mT)
                g_delta[j] = _add(g_delta[j], Sc * N)
                gSc = _add(gSc, (dl * N).sum(-1))
                gr = _add(gr, _bmm(dl * Sc, gsn))
            if j == 0:
                gx = _add(gx, gr)
            else:
                g_h[j] = _add(g_h[j], gr)
        # 2. the δ chain (second order through σ'')
        gz: List[Optional[torch.Tensor]] = [None] * L
        for j in range(L - 1):
            if g_delta[j] is None:
                continue
            gt = g_delta[j] * ds[j]
            if act != "relu":
                gz[j] = _add(gz[j], g_delta[j] * ts[j] * _act_second(zs[j], hs[j + 1], act))
            g_delta[j + 1] = _add(g_delta[j + 1], _bmm(gt, W[j + 1].mT))
            gW[j + 1] = _add(gW[j + 1], _bmm(deltas[j + 1].mT, gt))
        # 3. δ_L → err, z_L, the LN affine, v and x
        g_lnw = g_lnb = g_err = gv = None
        gd = g_delta[L - 1]
        if gd is not None:
            if layer_norm:
                V = nrm.shape[-1]
                ge_ = _ln_back(gd, zs[L - 1], mu, rstd)
                phi = (gd * deltas[L - 1]).sum(-1, keepdim=True)
                u = rstd * (-gd * (e_ * nrm).mean(-1, keepdim=True)
                            - (gd * nrm).sum(-1, keepdim=True) * e_ / V)
                gz[L - 1] = _add(gz[L - 1], _ln_back(u, zs[L - 1], mu, rstd) - (rstd * phi / V) * nrm)
                g_lnw = _head_sum(ge_ * err, B)
                g_err = ge_ * g
            else:
                g_err = gd
        if g_err is not None:
            gv = -g_err
            if bias == "l2":
                if residual:
                    gx = _add(gx, g_err)
                if layer_norm:
                    g_lnb = _head_sum(g_err, B)
                    g_lnw = _add(g_lnw, _head_sum(g_err * nrm, B))
                    gz[L - 1] = _add(gz[L - 1], _ln_back(g_err * g, zs[L - 1], mu, rstd))
                else:
                    gz[L - 1] = _add(gz[L - 1], g_err)
        # 4. the forward chain
        for j in range(L - 1, -1, -1):
            if gz[j] is not None:
                gW[j] = _add(gW[j], _bmm(gz[j].mT, hs[j]))
                gh = _bmm(gz[j], W[j])
                if j == 0:
                    gx = _add(gx, gh)
                else:
                    g_h[j] = _add(g_h[j], gh)
            if j > 0 and g_h[j] is not None:
                gz[j - 1] = _add(gz[j - 1], g_h[j] * ds[j - 1])

        def shaped(t, shape):
            return None if t is None else t.reshape(shape)
        out = [shaped(gx, x_shape), shaped(gv, v_shape), shaped(gP, (B, H)), shaped(gQ, (B, H)),
               shaped(gA, (B, H, -1)), shaped(gTh, (B, H)), shaped(gSc, (B, H, -1)), g_lnw, g_lnb,
               *(shaped(t, s) for t, s in zip(gW, w_shapes[:L]))]
        if mom:
            out += [shaped(t, s) for t, s in zip(gS, w_shapes[L:])]
        need = ctx.needs_input_grad[1:]
        return (None, *[t if n else None for t, n in zip(out, need)])


class MLPDualRead(torch.autograd.Function):
    """The reads of all chunks (folded into the batch) through dual-form weights (module docstring, "Read").
    Computes on ``[B'·H, ...]`` views with ``bmm`` / ``baddbmm``.

    ``apply(cfg, xq, P, Q, A, ln_w, ln_b, W_1 … W_L, S_1 … S_L, l_1 … l_L, r_1 … r_L)``: ``xq [B', H, b, F]``,
    ``P, Q [B', H, b]`` (Q and the S_j None for GD), ``A [B', H, b, n]``, ``W_j, S_j [B', H, out_j, in_j]``,
    ``l_j [B', H, n, out_j]``, ``r_j [B', H, n, in_j]`` → ``[B', H, b, V]``.
    """

    @staticmethod
    def forward(ctx, cfg, xq, P, Q, A, ln_w, ln_b, *ts):
        L, act, residual, layer_norm, _, mom = cfg
        B, H = xq.shape[:2]
        BH = B * H
        flat = [_flat(t, BH) for t in ts]
        W = flat[:L]
        S = flat[L:2 * L] if mom else None
        off = 2 * L if mom else L
        ls, rs = flat[off:off + L], flat[off + L:off + 2 * L]
        x3 = _flat(xq, BH)
        P3 = P.reshape(BH, -1, 1)
        Q3 = Q.reshape(BH, -1, 1) if mom else None
        A3 = _flat(A, BH)
        hs, zs, Ks, c1s, c2s = [x3], [], [], [], []
        for j in range(L):
            if j > 0:
                hs.append(_act(zs[-1], act))
            h = hs[-1]
            K = _bmm(h, rs[j].mT)                                    # [BH, b, n]
            c1 = _bmm(h, W[j].mT)
            base = P3 * c1
            if mom:
                c2 = _bmm(h, S[j].mT)
                base = base + Q3 * c2
                c2s.append(c2)
            zs.append(_baddbmm(base, A3 * K, ls[j]))
            Ks.append(K)
            c1s.append(c1)
        zL = zs[-1]
        if layer_norm:
            g = _head_rows(ln_w, B)
            nrm, mu, rstd = torch.native_layer_norm(zL, (zL.shape[-1],), None, None, LN_EPS)
            branch = torch.addcmul(_head_rows(ln_b, B), nrm, g)
        else:
            g = nrm = mu = rstd = None
            branch = zL
        out = x3 + branch if residual else branch
        ctx.cfg = cfg
        ctx.shapes = (B, H, xq.shape, P.shape, A.shape, [t.shape for t in ts])
        ctx.save_for_backward(x3, P3, Q3, A3, g, nrm, mu, rstd, *flat, *zs, *hs[1:], *Ks, *c1s, *c2s)
        return out.view(B, H, *out.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out):
        L, act, residual, layer_norm, _, mom = ctx.cfg
        B, H, xq_shape, p_shape, a_shape, t_shapes = ctx.shapes
        BH = B * H
        saved = ctx.saved_tensors
        x3, P3, Q3, A3, g, nrm, mu, rstd = saved[:8]
        nt = (4 if mom else 3) * L
        flat, rest = saved[8:8 + nt], list(saved[8 + nt:])
        W = flat[:L]
        S = flat[L:2 * L] if mom else None
        off = 2 * L if mom else L
        ls, rs = flat[off:off + L], flat[off + L:off + 2 * L]
        zs, rest = rest[:L], rest[L:]
        hs, rest = [x3] + rest[:L - 1], rest[L - 1:]
        Ks, c1s, c2s = rest[:L], rest[L:2 * L], rest[2 * L:]
        go = _flat(g_out, BH)
        gxq = go if residual else None
        g_lnw = g_lnb = None
        if layer_norm:
            g_lnb = _head_sum(go, B)
            g_lnw = _head_sum(go * nrm, B)
            gz = _ln_back(go * g, zs[L - 1], mu, rstd)
        else:
            gz = go
        gP = gQ = gA = None
        gW, gS, gl, gr = [None] * L, [None] * L, [None] * L, [None] * L
        for j in range(L - 1, -1, -1):
            h, K = hs[j], Ks[j]
            gl[j] = _bmm((A3 * K).mT, gz)
            gG = _bmm(gz, ls[j].mT)
            gA = _add(gA, gG * K)
            gK = gG * A3
            gr[j] = _bmm(gK.mT, h)
            gP = _add(gP, (gz * c1s[j]).sum(-1, keepdim=True))
            gzP = P3 * gz
            gW[j] = _bmm(gzP.mT, h)
            gh = _baddbmm(_bmm(gK, rs[j]), gzP, W[j])
            if mom:
                gQ = _add(gQ, (gz * c2s[j]).sum(-1, keepdim=True))
                gzQ = Q3 * gz
                gS[j] = _bmm(gzQ.mT, h)
                gh = _baddbmm(gh, gzQ, S[j])
            if j > 0:
                gz = _act_back(gh, zs[j - 1], hs[j], act)
            else:
                gxq = _add(gxq, gh)
        grads_t = [*gW, *(gS if mom else []), *gl, *gr]
        out = [gxq.reshape(xq_shape), gP.reshape(p_shape), gQ.reshape(p_shape) if mom else None,
               gA.reshape(a_shape), g_lnw, g_lnb, *(t.reshape(s) for t, s in zip(grads_t, t_shapes))]
        need = ctx.needs_input_grad[1:]
        return (None, *[t if n else None for t, n in zip(out, need)])


def _ln_params(parts):
    mem = parts.memory
    return (mem.ln_weight, mem.ln_bias) if mem.cfg.layer_norm else (None, None)


def dual_step(parts, weights: Dict[str, torch.Tensor], momentum: Optional[Dict[str, torch.Tensor]], x, v, d,
              P_e, Q_e, A_e, Th_e, S_e):
    """``chunked._dual_step`` on :class:`MLPDualStep` (same contract): → ``(factors, new_weights, new_momentum)``,
    ``factors = {"W_j": (δ_j [B, H, n, out_j], h_{j−1} [B, H, n, in_j])}`` in the order the memory applies them."""
    names = list(parts.memory.shapes())
    L = len(names)
    mom = S_e is not None
    ln_w, ln_b = _ln_params(parts)
    out = MLPDualStep.apply(_cfg(parts, mom), x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, ln_b,
                            *(weights[n] for n in names), *((momentum[n] for n in names) if mom else ()))
    deltas, hs = out[:L], (x,) + tuple(out[L:2 * L - 1])
    new_w = dict(zip(names, out[2 * L - 1:3 * L - 1]))
    new_s = dict(zip(names, out[3 * L - 1:4 * L - 1])) if mom else momentum
    factors = {n: (deltas[j], hs[j]) for j, n in enumerate(names)}
    return factors, new_w, new_s


def dual_read(memory, W_all, S_all, P_all, Q_all, A_all, lefts, rights, xq: torch.Tensor,
              parts=None) -> torch.Tensor:
    """``chunked._dual_read`` on :class:`MLPDualRead` (same contract; ``parts`` gives the bias for the config)."""
    names = list(memory.shapes())
    mom = Q_all is not None
    cfg = _cfg(parts, mom)
    ln_w, ln_b = _ln_params(parts)
    return MLPDualRead.apply(cfg, xq, P_all, Q_all, A_all, ln_w, ln_b, *(W_all[n] for n in names),
                             *((S_all[n] for n in names) if mom else ()), *(lefts[n] for n in names),
                             *(rights[n] for n in names))


__all__ = ["ACTIVATIONS", "MLPDualRead", "MLPDualStep", "dual_read", "dual_step", "supports"]
