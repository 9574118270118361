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
from typing import Dict, List, Optional, Tuple

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


def _dact(z: torch.Tensor, name: str, second: bool = False):
    """σ'(z) (and σ''(z) with ``second``) in closed form."""
    if name == "gelu":     # σ = z Φ(z): σ' = Φ + z φ, σ'' = φ (2 − z²)
        pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
        d1 = 0.5 * (1.0 + torch.erf(z * _SQRT1_2)) + z * pdf
        return (d1, pdf * (2.0 - z * z)) if second else d1
    if name == "silu":     # σ = z s: σ' = s (1 + z (1 − s)), σ'' = s (1 − s)(2 + z (1 − 2 s))
        s = torch.sigmoid(z)
        d1 = s * (1.0 + z * (1.0 - s))
        return (d1, s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))) if second else d1
    if name == "relu":
        d1 = (z > 0).to(z.dtype)
        return (d1, torch.zeros_like(z)) if second else d1
    t = torch.tanh(z)      # σ' = 1 − t², σ'' = −2 t (1 − t²)
    d1 = 1.0 - t * t
    return (d1, -2.0 * t * d1) if second else d1


def _ln_back(u: torch.Tensor, nrm: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Jᵀ u for J = ∂ LN(z)/∂z (symmetric): rstd ⊙ (u − mean(u) − nrm ⊙ mean(u ⊙ nrm))."""
    return rstd * (u - u.mean(-1, keepdim=True) - nrm * (u * nrm).mean(-1, keepdim=True))


def _ln_affine(ln_w: torch.Tensor) -> torch.Tensor:
    """``[H, V]`` → ``[H, 1, V]`` (broadcast over ``[B, H, n, V]``, as ``_MLPBase._finish``)."""
    return ln_w[:, None, :]


def _reduce_ln(gz: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, V]`` → ``[H, V]`` (the gradient of an LN affine parameter)."""
    return gz.sum((0, 2))


def _rowsum(z: torch.Tensor) -> torch.Tensor:
    return z.sum((-1, -2))


def _cfg(parts, momentum: bool) -> tuple:
    """(depth, activation, residual, layer_norm, bias 'l2' | 'dot', momentum?): what the Functions branch on."""
    c = parts.memory.cfg
    return (c.depth, c.activation, bool(c.residual), bool(c.layer_norm),
            "dot" if isinstance(parts.attentional_bias, DotProduct) else "l2", momentum)


class MLPDualStep(torch.autograd.Function):
    """One chunk's gradient factors at the anchor and its chunk-end weights / momenta (module docstring, steps
    1–4 for the backward).

    ``apply(cfg, x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, ln_b, W_1 … W_L, S_1 … S_L)``: ``x [B, H, n, F]``,
    ``v [B, H, n, V]``, ``P_e, Q_e, Th_e [B, H]``, ``A_e, S_e [B, H, n]`` (Q_e, Th_e, S_e and the S_j None for GD),
    ``ln_w, ln_b [H, V]`` (None without LayerNorm), ``W_j [B, H, out_j, in_j]``. Returns
    ``(δ_1 … δ_L, h_1 … h_{L−1}, W_1' … W_L'[, S_1' … S_L'])``.
    """

    @staticmethod
    def forward(ctx, cfg, x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, ln_b, *ws):
        L, act, residual, layer_norm, bias, mom = cfg
        W, S = list(ws[:L]), (list(ws[L:]) if mom else None)
        hs, zs = [x], []
        for j in range(L):
            if j > 0:
                hs.append(_act(zs[-1], act))
            zs.append(hs[-1] @ W[j].mT)
        if layer_norm:
            y, _, rstd = torch.native_layer_norm(zs[-1], (zs[-1].shape[-1],), None, None, LN_EPS)
            nrm = y
            branch = y * _ln_affine(ln_w) + _ln_affine(ln_b)
        else:
            nrm = rstd = None
            branch = zs[-1]
        if bias == "l2":
            err = ((x + branch) if residual else branch) - v
        else:
            err = -v
        if layer_norm:
            e_ = err * _ln_affine(ln_w)
            deltas = [_ln_back(e_, nrm, rstd)]
        else:
            e_ = err
            deltas = [err]
        dacts = [None] * L
        for j in range(L - 2, -1, -1):
            dacts[j] = _dact(zs[j], act)
            deltas.insert(0, (deltas[0] @ W[j + 1]) * dacts[j])
        c = lambda s: s[..., None, None]                                  # noqa: E731
        new_w, new_s = [], []
        for j in range(L):
            dl, r = deltas[j], hs[j]
            wj = (dl * A_e.unsqueeze(-1)).mT @ r + c(P_e) * W[j]
            if mom:
                wj = wj + c(Q_e) * S[j]
                new_s.append((dl * S_e.unsqueeze(-1)).mT @ r + c(Th_e) * S[j])
            new_w.append(wj)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, nrm, rstd, err, e_,
                              *W, *(S or []), *zs, *hs[1:], *deltas)
        return (*deltas, *hs[1:], *new_w, *new_s)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        L, act, residual, layer_norm, bias, mom = ctx.cfg
        saved = ctx.saved_tensors
        x, v, P_e, Q_e, A_e, Th_e, S_e, ln_w, nrm, rstd, err, e_ = saved[:12]
        rest = list(saved[12:])
        W = rest[:L]
        rest = rest[L:]
        S = rest[:L] if mom else None
        rest = rest[L:] if mom else rest
        zs, hs, deltas = rest[:L], [x] + rest[L:2 * L - 1], rest[2 * L - 1:]
        g_delta = list(grads[:L])
        g_h = [None] + list(grads[L:2 * L - 1])             # g_h[j]: gradient of h_j (h_0 = x handled apart)
        g_w_new = grads[2 * L - 1:3 * L - 1]
        g_s_new = grads[3 * L - 1:4 * L - 1] if mom else [None] * L

        def add(a, b):
            return b if a is None else (a if b is None else a + b)

        c = lambda s: s[..., None, None]                                  # noqa: E731
        gW: List[Optional[torch.Tensor]] = [None] * L
        gS: List[Optional[torch.Tensor]] = [None] * L
        gP = gQ = gA = gTh = gSc = None
        gx = None
        # 1. chunk end
        for j in range(L):
            dl, r = deltas[j], hs[j]
            gr = None
            gwn, gsn = g_w_new[j], g_s_new[j]
            if gwn is not None:
                gW[j] = add(gW[j], c(P_e) * gwn)
                gP = add(gP, _rowsum(gwn * W[j]))
                if mom:
                    gS[j] = add(gS[j], c(Q_e) * gwn)
                    gQ = add(gQ, _rowsum(gwn * S[j]))
                M = r @ gwn.mT                                              # [B, H, n, out_j]
                g_delta[j] = add(g_delta[j], A_e.unsqueeze(-1) * M)
                gA = add(gA, (dl * M).sum(-1))
                gr = add(gr, (dl * A_e.unsqueeze(-1)) @ gwn)
            if mom and gsn is not None:
                gS[j] = add(gS[j], c(Th_e) * gsn)
                gTh = add(gTh, _rowsum(gsn * S[j]))
                N = r @ gsn.mT
                g_delta[j] = add(g_delta[j], S_e.unsqueeze(-1) * N)
                gSc = add(gSc, (dl * N).sum(-1))
                gr = add(gr, (dl * S_e.unsqueeze(-1)) @ gsn)
            if j == 0:
                gx = add(gx, gr)
            else:
                g_h[j] = add(g_h[j], gr)
        # 2. the δ chain (second order through σ'')
        gz: List[Optional[torch.Tensor]] = [None] * L
        for j in range(L - 1):
            if g_delta[j] is None:
                continue
            d1, d2 = _dact(zs[j], act, second=True)
            t = deltas[j + 1] @ W[j + 1]
            gt = g_delta[j] * d1
            gz[j] = add(gz[j], g_delta[j] * t * d2)
            g_delta[j + 1] = add(g_delta[j + 1], gt @ W[j + 1].mT)
            gW[j + 1] = add(gW[j + 1], deltas[j + 1].mT @ gt)
        # 3. δ_L → err, z_L, the LN affine, v and x
        g_lnw = g_lnb = None
        gv = None
        gd = g_delta[L - 1]
        g_err = None
        if gd is not None:
            if layer_norm:
                V = nrm.shape[-1]
                ge_ = _ln_back(gd, nrm, rstd)
                phi = (gd * deltas[L - 1]).sum(-1, keepdim=True)
                u = rstd * (-gd * (e_ * nrm).mean(-1, keepdim=True)
                            - (gd * nrm).sum(-1, keepdim=True) * e_ / V)
                gz[L - 1] = add(gz[L - 1], _ln_back(u, nrm, rstd) - (rstd * phi / V) * nrm)
                g_lnw = _reduce_ln(ge_ * err)
                g_err = ge_ * _ln_affine(ln_w)
            else:
                g_err = gd
        if g_err is not None:
            gv = -g_err
            if bias == "l2":
                if residual:
                    gx = add(gx, g_err)
                if layer_norm:
                    g_lnb = _reduce_ln(g_err)
                    g_lnw = add(g_lnw, _reduce_ln(g_err * nrm))
                    gz[L - 1] = add(gz[L - 1], _ln_back(g_err * _ln_affine(ln_w), nrm, rstd))
                else:
                    gz[L - 1] = add(gz[L - 1], g_err)
        # 4. the forward chain
        for j in range(L - 1, -1, -1):
            if gz[j] is not None:
                gW[j] = add(gW[j], gz[j].mT @ hs[j])
                g_h[j] = add(g_h[j], gz[j] @ W[j]) if j > 0 else g_h[j]
                if j == 0:
                    gx = add(gx, gz[j] @ W[j])
            if j > 0 and g_h[j] is not None:
                gz[j - 1] = add(gz[j - 1], g_h[j] * _dact(zs[j - 1], act))
        out = [gx, gv, gP, gQ, gA, gTh, gSc, g_lnw, g_lnb, *gW]
        if mom:
            out += gS
        need = ctx.needs_input_grad[1:]
        return (None, *[g if n else None for g, n in zip(out, need)])


class MLPDualRead(torch.autograd.Function):
    """The reads of all chunks (folded into the batch) through dual-form weights (module docstring, "Read").

    ``apply(cfg, xq, P, Q, A, ln_w, ln_b, W_1 … W_L, S_1 … S_L, l_1 … l_L, r_1 … r_L)``: ``xq [B', H, b, F]``,
    ``P, Q [B', H, b]`` (Q and the S_j None for GD), ``A [B', H, b, n]``, ``W_j, S_j [B', H, out_j, in_j]``,
    ``l_j [B', H, n, out_j]``, ``r_j [B', H, n, in_j]`` → ``[B', H, b, V]``.
    """

    @staticmethod
    def forward(ctx, cfg, xq, P, Q, A, ln_w, ln_b, *ts):
        L, act, residual, layer_norm, _, mom = cfg
        W = ts[:L]
        S = ts[L:2 * L] if mom else None
        off = 2 * L if mom else L
        ls, rs = ts[off:off + L], ts[off + L:off + 2 * L]
        hs, zs = [xq], []
        for j in range(L):
            if j > 0:
                hs.append(_act(zs[-1], act))
            h = hs[-1]
            z = (A * (h @ rs[j].mT)) @ ls[j]
            z = z + P.unsqueeze(-1) * (h @ W[j].mT)
            if mom:
                z = z + Q.unsqueeze(-1) * (h @ S[j].mT)
            zs.append(z)
        if layer_norm:
            y, _, rstd = torch.native_layer_norm(zs[-1], (zs[-1].shape[-1],), None, None, LN_EPS)
            nrm = y
            branch = y * _ln_affine(ln_w) + _ln_affine(ln_b)
        else:
            nrm = rstd = None
            branch = zs[-1]
        ctx.cfg = cfg
        ctx.save_for_backward(xq, P, Q, A, ln_w, nrm, rstd, *ts, *zs[:-1], *hs[1:])
        return xq + branch if residual else branch

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out):
        L, act, residual, layer_norm, _, mom = ctx.cfg
        saved = ctx.saved_tensors
        xq, P, Q, A, ln_w, nrm, rstd = saved[:7]
        nt = (3 if mom else 2) * L + L
        ts = saved[7:7 + nt]
        rest = saved[7 + nt:]
        W = ts[:L]
        S = ts[L:2 * L] if mom else None
        off = 2 * L if mom else L
        ls, rs = ts[off:off + L], ts[off + L:off + 2 * L]
        zs, hs = list(rest[:L - 1]), [xq] + list(rest[L - 1:])
        gxq = g_out if residual else None
        g_lnw = g_lnb = None
        if layer_norm:
            g_lnb = _reduce_ln(g_out)
            g_lnw = _reduce_ln(g_out * nrm)
            gz = _ln_back(g_out * _ln_affine(ln_w), nrm, rstd)
        else:
            gz = g_out
        gP = gQ = gA = None
        gW, gS, gl, gr = [None] * L, [None] * L, [None] * L, [None] * L
        for j in range(L - 1, -1, -1):
            h = hs[j]
            K = h @ rs[j].mT                                                # [B', H, b, n]
            G = A * K
            gl[j] = G.mT @ gz
            gG = gz @ ls[j].mT
            gA = gG * K if gA is None else gA + gG * K
            gK = gG * A
            gh = gK @ rs[j]
            gr[j] = gK.mT @ h
            c1 = h @ W[j].mT
            gP = (gz * c1).sum(-1) if gP is None else gP + (gz * c1).sum(-1)
            gzP = P.unsqueeze(-1) * gz
            gW[j] = gzP.mT @ h
            gh = gh + gzP @ W[j]
            if mom:
                c2 = h @ S[j].mT
                gQ = (gz * c2).sum(-1) if gQ is None else gQ + (gz * c2).sum(-1)
                gzQ = Q.unsqueeze(-1) * gz
                gS[j] = gzQ.mT @ h
                gh = gh + gzQ @ S[j]
            if j > 0:
                gz = gh * _dact(zs[j - 1], act)
            else:
                gxq = gh if gxq is None else gxq + gh
        out = [gxq, gP, gQ, gA, g_lnw, g_lnb, *gW, *(gS if mom else []), *gl, *gr]
        need = ctx.needs_input_grad[1:]
        return (None, *[g if n else None for g, n in zip(out, need)])


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
