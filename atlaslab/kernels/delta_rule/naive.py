"""Plain-torch references of the linear-memory delta / Hebbian rules the Triton kernels of this op compute.

One head's state S ``[D_v, D_k]`` (the layout of ``MemoryState.weights["W"]``), per token t with step β_t (= η_t γ_t,
the learning rate times the c = 1 window gate) and kept fraction α_t (1 without retention):

    l2,  before_step:  S_t = α_t S_{t−1} − β_t (α_t S_{t−1} k_t − v_t) k_tᵀ      (Gated DeltaNet)
    l2,  after_step:   S_t = α_t S_{t−1} − β_t (S_{t−1} k_t − v_t) k_tᵀ          (Titans/ATLAS placement)
    dot (either):      S_t = α_t S_{t−1} + β_t v_t k_tᵀ                          (gated linear attention)
    read token:        o_t = S_t q_t          read chunk (b = 1):  o_t = S_{t−1} q_t

:func:`delta_rule_recurrent` is the literal token loop; :func:`delta_rule_chunk` is the exact chunk form the Triton
chunk kernel implements stage by stage (gate cumsum → UT transform → inter-chunk state → output), also used as the
recompute of the kernels' backward. With P_t = Π_{τ≤t} α_τ (chunk-local, g = log P), G = g (before) or g − log α
(after), the chunk's pseudo-values are

    w = (I + A)⁻¹ (β v) − (I + A)⁻¹ (β e^G k) S_0ᵀ,    A[t, s] = β_t e^{G_t − g_s} k_t·k_s  (s < t),

then o_t = e^{g_t} S_0 q_t + Σ_{s≤t} e^{g_t − g_s} (q_t·k_s) w_s and S_L = e^{g_L} S_0 + Σ_s e^{g_L − g_s} w_s k_sᵀ.
Decay ratios are always formed as exp(g_t − g_s) on the causal part only (never a division, never inf).

:func:`delta_rule_chunk_backward` is the hand-derived gradient of :func:`delta_rule_chunk`, stage by stage as the
Triton backward kernels compute it (tested equal to autograd in float64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.utils import (AFTER_STEP, BEFORE_STEP, log_decay, log_gate_grad, packed_sequences, per_sequence,
                                   solve_unit_lower, unit_lower_inverse)

def check_args(q, k, v, beta, alpha, initial_state, cu_seqlens) -> int:
    """Check the tensors' shapes; returns N, the number of sequences (``bias``, ``placement`` and ``read`` are not
    checked here: they come already valid from the memory's typed spec, checked once by the parts)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k: [B, T, H, D_k] and v: [B, T, H, D_v]; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta: expected {list(q.shape[:3])}, got {list(beta.shape)}")
    if alpha is not None and alpha.shape not in (q.shape[:3], q.shape):
        raise ValueError(f"alpha: expected {list(q.shape[:3])} (per-head scalar decay) or {list(q.shape)} "
                         f"(channel-wise decay of the key channels), got {list(alpha.shape)}")
    B, T, H, K = q.shape
    N = packed_sequences(cu_seqlens, B, T)
    if initial_state is not None and tuple(initial_state.shape) != (N, H, v.shape[-1], K):
        raise ValueError(f"initial_state: expected [N, H, D_v, D_k] = {[N, H, v.shape[-1], K]}, "
                         f"got {list(initial_state.shape)}")
    return N


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                         bias: str, placement: str, read: str,
                         cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token loop. ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]``, ``alpha: [B, T, H]`` or
    ``[B, T, H, K]`` (channel-wise: S ← S Diag(α_t)), ``initial_state: [N, H, V, K]`` → ``o: [B, T, H, V]``,
    final state ``[N, H, V, K]``."""
    check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
    kw = dict(bias=bias, placement=placement, read=read)
    if cu_seqlens is not None:
        return per_sequence(delta_rule_recurrent, q, k, v, beta, alpha, initial_state, cu_seqlens, **kw)
    B, T, H, K = q.shape
    S = (initial_state if initial_state is not None
         else q.new_zeros(B, H, v.shape[-1], K))
    outs = []
    for t in range(T):
        q_t, k_t, v_t, b_t = q[:, t], k[:, t], v[:, t], beta[:, t, :, None, None]
        if alpha is None:
            a_t = None
        else:   # per head: scales S; channel-wise: scales S's key columns (S Diag(α_t))
            a_t = alpha[:, t, :, None, None] if alpha.dim() == 3 else alpha[:, t, :, None, :]
        if read == "chunk":
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q_t))
        if bias == "l2":
            anchor = S * a_t if (a_t is not None and placement == BEFORE_STEP) else S
            err = torch.einsum("bhvk,bhk->bhv", anchor, k_t) - v_t
            step = -b_t * err.unsqueeze(-1) * k_t.unsqueeze(-2)
        else:
            step = b_t * v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
        S = (S * a_t if a_t is not None else S) + step
        if read == "token":
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q_t))
    return torch.stack(outs, 1), S


def causal_exp(diff: torch.Tensor, diagonal: int) -> torch.Tensor:
    """exp(diff[..., t, s]) where s ≤ t + diagonal, 0 elsewhere (never exp of a positive masked entry)."""
    L = diff.shape[-1]
    keep = torch.ones(L, L, dtype=torch.bool, device=diff.device).tril(diagonal)
    return diff.masked_fill(~keep, float("-inf")).exp()


def causal_exp3(a: torch.Tensor, b: torch.Tensor, diagonal: int) -> torch.Tensor:
    """Channel-wise decays: exp(a[..., t, c] − b[..., s, c]) ``[..., L, L, K]`` where s ≤ t + diagonal, else 0."""
    L = a.shape[-2]
    keep = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(diagonal).unsqueeze(-1)
    return (a.unsqueeze(-2) - b.unsqueeze(-3)).masked_fill(~keep, float("-inf")).exp()


def decayed_dot(x: torch.Tensor, y: torch.Tensor, decay3: torch.Tensor) -> torch.Tensor:
    """Σ_c x[t, c] y[s, c] decay3[t, s, c]: ``[..., L, L]`` (GLA's decay-weighted q kᵀ)."""
    return torch.einsum("...tc,...sc,...tsc->...ts", x, y, decay3)


def delta_rule_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     alpha: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None, *,
                     bias: str, placement: str, read: str,
                     cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = 64
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact chunk-parallel form of :func:`delta_rule_recurrent` (same arguments and results)."""
    check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
    kw = dict(bias=bias, placement=placement, read=read, chunk_size=chunk_size)
    if cu_seqlens is not None:
        return per_sequence(delta_rule_chunk, q, k, v, beta, alpha, initial_state, cu_seqlens, **kw)
    B, T, H, K = q.shape
    tr = lambda x: x.transpose(1, 2)   # noqa: E731  [B, T, H, ...] → [B, H, T, ...]
    qh, kh, vh, bh, lah = tr(q), tr(k), tr(v), tr(beta), tr(log_decay(alpha, q))
    S = initial_state if initial_state is not None else q.new_zeros(B, H, v.shape[-1], K)
    if alpha is not None and alpha.dim() == 4:
        return _chunk_channel_wise(qh, kh, vh, bh, lah, S, bias, placement, read, chunk_size)
    outs = []
    for t0 in range(0, T, chunk_size):
        sl = slice(t0, min(T, t0 + chunk_size))
        qc, kc, vc, bc, la = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], bh[:, :, sl], lah[:, :, sl]
        L = qc.shape[2]
        g = la.cumsum(-1)                                   # stage 1: chunk-local gate cumsum
        if bias == "l2":                                    # stage 2: UT transform of the delta rule
            G = g if placement == BEFORE_STEP else g - la
            kk = kc @ kc.transpose(-1, -2)
            A = bc.unsqueeze(-1) * kk * causal_exp(G.unsqueeze(-1) - g.unsqueeze(-2), -1)
            A = A + torch.eye(L, dtype=A.dtype, device=A.device)
            rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * G.exp()).unsqueeze(-1) * kc], -1)
            sol = solve_unit_lower(A, rhs)
            u, wk = sol[..., :vc.shape[-1]], sol[..., vc.shape[-1]:]
            w = u - wk @ S.transpose(-1, -2)                # stage 3: pseudo-values against the chunk-start state
        else:
            w = bc.unsqueeze(-1) * vc
        if read == "token":                                 # stage 4: output
            gq, diag = g, 0
        else:
            gq, diag = g - la, -1
        qk = (qc @ kc.transpose(-1, -2)) * causal_exp(gq.unsqueeze(-1) - g.unsqueeze(-2), diag)
        outs.append(gq.exp().unsqueeze(-1) * (qc @ S.transpose(-1, -2)) + qk @ w)
        g_last = g[..., -1:]
        S = S * g_last.exp().unsqueeze(-1) + ((g_last - g).exp().unsqueeze(-1) * w).transpose(-1, -2) @ kc
    return torch.cat(outs, 2).transpose(1, 2), S


def _chunk_channel_wise(qh, kh, vh, bh, lah, S, bias, placement, read, chunk_size):
    """:func:`delta_rule_chunk` with channel-wise decay (``[B, H, T, ·]`` inputs, la ``[B, H, T, K]``).

    With g the chunk-local cumsum of log α per key channel, a write at s reaches t with the key decayed channel
    by channel, k_s ⊙ e^{g_t − g_s}; so A[t, s] = β_t Σ_c k_tc k_sc e^{G_tc − g_sc}, w = (I + A)⁻¹ β (v − (k ⊙ e^G)
    S_0ᵀ), o_t = S_0 (q_t ⊙ e^{gq_t}) + Σ_s [Σ_c q_tc k_sc e^{gq_tc − g_sc}] w_s, S_L = S_0 Diag(e^{g_L}) +
    Σ_s w_s (k_s ⊙ e^{g_L − g_s})ᵀ. Every exponent is ≤ 0 on the causal part (no e^{−g} factorisation).
    """
    T = qh.shape[2]
    outs = []
    for t0 in range(0, T, chunk_size):
        sl = slice(t0, min(T, t0 + chunk_size))
        qc, kc, vc, bc, la = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], bh[:, :, sl], lah[:, :, sl]
        L = qc.shape[2]
        g = la.cumsum(-2)
        if bias == "l2":
            G = g if placement == BEFORE_STEP else g - la
            A = bc.unsqueeze(-1) * decayed_dot(kc, kc, causal_exp3(G, g, -1))
            A = A + torch.eye(L, dtype=A.dtype, device=A.device)
            rhs = torch.cat([bc.unsqueeze(-1) * vc, bc.unsqueeze(-1) * kc * G.exp()], -1)
            sol = solve_unit_lower(A, rhs)
            u, wk = sol[..., :vc.shape[-1]], sol[..., vc.shape[-1]:]
            w = u - wk @ S.transpose(-1, -2)
        else:
            w = bc.unsqueeze(-1) * vc
        gq, diag = (g, 0) if read == "token" else (g - la, -1)
        P = decayed_dot(qc, kc, causal_exp3(gq, g, diag))
        outs.append((qc * gq.exp()) @ S.transpose(-1, -2) + P @ w)
        g_last = g[..., -1:, :]
        S = S * g_last.exp() + w.transpose(-1, -2) @ (kc * (g_last - g).exp())
    return torch.cat(outs, 2).transpose(1, 2), S


def forward_sweep(chunks, stage, advance, S):
    """The backward pass's forward sweep over chunks: ``stage(chunk, S_0)`` → the chunk's saved tensors ``c``, then
    ``S ← advance(S, c)``. Returns the chunk-start states, the saved tensors and the final state."""
    starts, cs = [], []
    for sl in chunks:
        c = stage(sl, S)
        starts.append(S)
        cs.append(c)
        S = advance(S, c)
    return starts, cs, S


def reverse_sweep(chunks, cs, doh, retreat, dS):
    """The reverse sweep: ``dS`` = ∂L/∂(each chunk's end state), from the last chunk back; ``retreat(dS, c, do_c)`` →
    (dw of the chunk, dS of the previous chunk's end). Returns the chunk-end dS's, the dw's and ∂L/∂S_0."""
    dSs, dws = [None] * len(chunks), [None] * len(chunks)
    for i in reversed(range(len(chunks))):
        dSs[i] = dS
        dws[i], dS = retreat(dS, cs[i], doh[:, :, chunks[i]])
    return dSs, dws, dS


def delta_rule_chunk_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                              alpha: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                              do: torch.Tensor, dht: Optional[torch.Tensor], *, bias: str,
                              placement: str, read: str,
                              cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = 64):
    """Hand-derived gradients of :func:`delta_rule_chunk`, stage by stage as the Triton backward computes them.

    Shapes as :func:`delta_rule_chunk`; ``do: [B, T, H, V]``, ``dht: [N, H, V, K]`` or None. Returns
    ``(dq, dk, dv, dbeta, dalpha, dh0)`` (``dalpha`` / ``dh0`` None when ``alpha`` / ``initial_state`` are).

    Per chunk, with S_0 the chunk-start state, r = β ⊙ (v − e^G ⊙ k S_0ᵀ) (so w = (I + A)⁻¹ r) and
    P[t, s] = m[t, s] e^{gq_t − g_s} q_t·k_s (m: s ≤ t for read token, s < t for read chunk; gq = g or g − log α):

    1. forward sweep: chunk-start states S_0 (as the forward);
    2. reverse sweep over chunks, dS = ∂L/∂S_L of the chunk's end state (starting from ``dht``):
           dw  = Pᵀ do + e^{g_L − g} ⊙ (k dSᵀ)
           dS ← e^{g_L} dS + (e^{gq} ⊙ do)ᵀ q − [l2] dwᵀ w_k          (w_k = (I + A)⁻¹ (β e^G ⊙ k))
       and the last dS is ∂L/∂S_init;
    3. per chunk (parallel): dr = (I + A)⁻ᵀ dw, dA = −strict(dr wᵀ);
           dq = (e^{gq} ⊙ do) S_0 + dP k,      dP = m ⊙ e^{gq_t − g_s} ⊙ (do wᵀ)
           dk = dPᵀ q + (e^{g_L − g} ⊙ w) dS − β e^G ⊙ (dr S_0) + Z k + Zᵀ k,   Z = dA ⊙ β_t e^{G_t − g_s}
           dv = β ⊙ dr                        (dot bias: dv = β ⊙ dw, dβ = Σ_v dw ⊙ v)
           dβ = Σ_v dr ⊙ (v − e^G ⊙ k S_0ᵀ) + Σ_s dA ⊙ e^{G_t − g_s} k_t·k_s
           d gq = q ⊙ dq (row sums);  dG = −β e^G dr·(S_0 k) + rowsum(dA ⊙ A)
           dg  = d gq + dG − colsum(dA ⊙ A) − k·(dPᵀ q + (e^{g_L−g} ⊙ w) dS),
                 dg_L += e^{g_L} ⟨dS, S_0⟩ + Σ_s k_s·((e^{g_L−g} ⊙ w) dS)_s
           d log α = reverse-cumsum(dg) − [after_step] dG − [read chunk] d gq;   dα = d log α / α.
    """
    check_args(q, k, v, beta, alpha, initial_state, cu_seqlens)
    kw = dict(bias=bias, placement=placement, read=read, chunk_size=chunk_size)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        parts = []
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            sl = slice(s, e)
            parts.append(delta_rule_chunk_backward(
                q[:, sl], k[:, sl], v[:, sl], beta[:, sl], None if alpha is None else alpha[:, sl],
                None if initial_state is None else initial_state[n:n + 1], do[:, sl],
                None if dht is None else dht[n:n + 1], **kw))
        cat = [torch.cat(x, 1) if x[0] is not None else None for x in zip(*(p[:5] for p in parts))]
        dh0 = torch.cat([p[5] for p in parts], 0) if initial_state is not None else None
        return (*cat, dh0)
    B, T, H, K = q.shape
    V = v.shape[-1]
    tr = lambda x: x.transpose(1, 2)   # noqa: E731
    qh, kh, vh, bh, doh = tr(q), tr(k), tr(v), tr(beta), tr(do)
    la_all = tr(log_decay(alpha, q))
    S = initial_state if initial_state is not None else q.new_zeros(B, H, V, K)
    if alpha is not None and alpha.dim() == 4:
        dq, dk, dv, dbeta, dla, dh0 = _channel_wise_backward(qh, kh, vh, bh, doh, la_all, S, dht, **kw)
        dalpha = log_gate_grad(tr(dla), alpha)
        return tr(dq), tr(dk), tr(dv), tr(dbeta), dalpha, (dh0 if initial_state is not None else None)
    L_ = chunk_size
    chunks = [slice(t0, min(T, t0 + L_)) for t0 in range(0, T, L_)]

    def stage(sl, S0):
        """Per-chunk quantities of the forward (stages 1-3) at chunk-start state S0."""
        qc, kc, vc, bc, la = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], bh[:, :, sl], la_all[:, :, sl]
        g = la.cumsum(-1)
        G = g if placement == BEFORE_STEP else g - la
        gq = g if read == "token" else g - la
        c = dict(qc=qc, kc=kc, vc=vc, bc=bc, la=la, g=g, G=G, gq=gq)
        if bias == "l2":
            E = causal_exp(G.unsqueeze(-1) - g.unsqueeze(-2), -1)
            kk = kc @ kc.transpose(-1, -2)
            A = bc.unsqueeze(-1) * kk * E
            Ainv = unit_lower_inverse(A)
            kS = kc @ S0.transpose(-1, -2)
            r = bc.unsqueeze(-1) * (vc - G.exp().unsqueeze(-1) * kS)
            w = Ainv @ r
            wk = Ainv @ ((bc * G.exp()).unsqueeze(-1) * kc)
            c.update(E=E, kk=kk, A=A, Ainv=Ainv, kS=kS, w=w, wk=wk)
        else:
            c.update(w=bc.unsqueeze(-1) * vc)
        Pm = causal_exp(gq.unsqueeze(-1) - g.unsqueeze(-2), 0 if read == "token" else -1)
        c.update(Pm=Pm, qk=qc @ kc.transpose(-1, -2))
        return c

    def advance(S, c):
        g_last = c["g"][..., -1:]
        decayed_w = (g_last - c["g"]).exp().unsqueeze(-1) * c["w"]
        return S * g_last.exp().unsqueeze(-1) + decayed_w.transpose(-1, -2) @ c["kc"]

    def retreat(dS, c, do_c):
        g, gl = c["g"], c["g"][..., -1:]
        P = c["Pm"] * c["qk"]
        dw = P.transpose(-1, -2) @ do_c + (gl - g).exp().unsqueeze(-1) * (c["kc"] @ dS.transpose(-1, -2))
        dS = gl.exp().unsqueeze(-1) * dS + (c["gq"].exp().unsqueeze(-1) * do_c).transpose(-1, -2) @ c["qc"]
        return dw, (dS - dw.transpose(-1, -2) @ c["wk"] if bias == "l2" else dS)

    # 1. forward sweep: chunk-start states; 2. reverse sweep: dS at each chunk end, dw per chunk
    starts, cs, _ = forward_sweep(chunks, stage, advance, S)
    dSs, dws, dh0 = reverse_sweep(chunks, cs, doh, retreat, dht if dht is not None else q.new_zeros(B, H, V, K))
    # 3. per chunk, in parallel
    dq, dk, dv, dbeta, dla = [], [], [], [], []
    for i, sl in enumerate(chunks):
        c, do_c, S0, dSn, dw = cs[i], doh[:, :, sl], starts[i], dSs[i], dws[i]
        qc, kc, vc, bc, g, G, gq, w = c["qc"], c["kc"], c["vc"], c["bc"], c["g"], c["G"], c["gq"], c["w"]
        gl = g[..., -1:]
        dP = c["Pm"] * (do_c @ w.transpose(-1, -2))
        dq_c = (gq.exp().unsqueeze(-1) * do_c) @ S0 + dP @ kc
        dk_p = dP.transpose(-1, -2) @ qc
        dk_s = ((gl - g).exp().unsqueeze(-1) * w) @ dSn
        dg = (qc * dq_c).sum(-1) - (kc * (dk_p + dk_s)).sum(-1)       # d gq, and g_s in P and in S_L
        dgl = gl.exp().squeeze(-1) * (dSn * S0).sum((-1, -2)) + (kc * dk_s).sum((-1, -2))
        dg = dg.clone()
        dg[..., -1] += dgl
        dk_c = dk_p + dk_s
        dG = torch.zeros_like(g)
        if bias == "l2":
            dr = c["Ainv"].transpose(-1, -2) @ dw
            dA = -(dr @ w.transpose(-1, -2)).tril(-1)
            Ad = dA * c["A"]
            eG = G.exp()
            dv_c = bc.unsqueeze(-1) * dr
            db_c = (dr * (vc - eG.unsqueeze(-1) * c["kS"])).sum(-1) + (dA * c["E"] * c["kk"]).sum(-1)
            dG = -bc * eG * (dr * c["kS"]).sum(-1) + Ad.sum(-1)
            dg = dg - Ad.sum(-2)
            Z = dA * bc.unsqueeze(-1) * c["E"]
            dk_c = dk_c - (bc * eG).unsqueeze(-1) * (dr @ S0) + Z @ kc + Z.transpose(-1, -2) @ kc
        else:
            dv_c = bc.unsqueeze(-1) * dw
            db_c = (dw * vc).sum(-1)
        dg_tot = dg + dG
        dla_c = dg_tot.flip(-1).cumsum(-1).flip(-1)
        if placement == AFTER_STEP:
            dla_c = dla_c - dG
        if read == "chunk":
            dla_c = dla_c - (qc * dq_c).sum(-1)
        dq.append(dq_c), dk.append(dk_c), dv.append(dv_c), dbeta.append(db_c), dla.append(dla_c)
    cat = lambda xs: torch.cat(xs, 2).transpose(1, 2)   # noqa: E731
    dalpha = log_gate_grad(cat(dla), alpha) if alpha is not None else None
    return cat(dq), cat(dk), cat(dv), cat(dbeta), dalpha, (dh0 if initial_state is not None else None)


def _channel_wise_backward(qh, kh, vh, bh, doh, lah, S, dht, *, bias, placement, read, chunk_size):
    """:func:`delta_rule_chunk_backward` for channel-wise decay (``[B, H, T, ·]`` tensors; la ``[B, H, T, K]``).

    The scalar equations with every decay per key channel (E3[t, s, c] = e^{a_tc − b_sc} on the causal part):
    dw = Pᵀ do + (k ⊙ e^{g_L − g}) dSᵀ;  dS ← dS Diag(e^{g_L}) + doᵀ (q ⊙ e^{gq}) − [l2] dwᵀ w_k;
    dq = (do S_0) ⊙ e^{gq} + Σ_s D[t, s] k_s ⊙ e^{gq_t − g_s}, D = do wᵀ (causal);
    dk = Σ_t D[t, s] q_t ⊙ e^{gq_t − g_s} + (w dS) ⊙ e^{g_L − g} − β e^G ⊙ (dr S_0) + Σ_s Z[t, s] k_s ⊙ e^{G_t − g_s}
         + Σ_t Z[t, s] k_t ⊙ e^{G_t − g_s},  Z = β_t dA[t, s];
    dg (per channel) = q ⊙ dq − k ⊙ (dk_P + dk_S) + dG − k ⊙ dk_{A,2}, dG = k ⊙ e^G ⊙ dk̃ + k ⊙ dk_{A,1},
    dg_L += e^{g_L} ⊙ Σ_v dS ⊙ S_0 + Σ_s k_s ⊙ dk_S,s; d log α = reverse-cumsum(dg) − [after] dG − [chunk] q ⊙ dq.
    """
    B, H, T, K = qh.shape
    chunks = [slice(t0, min(T, t0 + chunk_size)) for t0 in range(0, T, chunk_size)]
    diag = 0 if read == "token" else -1

    def stage(sl, S0):
        qc, kc, vc, bc, la = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], bh[:, :, sl], lah[:, :, sl]
        g = la.cumsum(-2)
        G = g if placement == BEFORE_STEP else g - la
        gq = g if read == "token" else g - la
        c = dict(qc=qc, kc=kc, vc=vc, bc=bc, g=g, G=G, gq=gq, Pm3=causal_exp3(gq, g, diag))
        if bias == "l2":
            E3 = causal_exp3(G, g, -1)
            At = decayed_dot(kc, kc, E3)                       # A / β
            Ainv = unit_lower_inverse(bc.unsqueeze(-1) * At)
            kG = kc * G.exp()
            kS = kG @ S0.transpose(-1, -2)
            w = Ainv @ (bc.unsqueeze(-1) * (vc - kS))
            c.update(E3=E3, Ainv=Ainv, kG=kG, kS=kS, w=w, wk=Ainv @ (bc.unsqueeze(-1) * kG))
        else:
            c.update(w=bc.unsqueeze(-1) * vc)
        c["P"] = decayed_dot(qc, kc, c["Pm3"])
        return c

    def advance(S, c):
        gl = c["g"][..., -1:, :]
        return S * gl.exp() + c["w"].transpose(-1, -2) @ (c["kc"] * (gl - c["g"]).exp())

    def retreat(dS, c, do_c):
        g, gl = c["g"], c["g"][..., -1:, :]
        dw = c["P"].transpose(-1, -2) @ do_c + (c["kc"] * (gl - g).exp()) @ dS.transpose(-1, -2)
        dS = dS * gl.exp() + do_c.transpose(-1, -2) @ (c["qc"] * c["gq"].exp())
        return dw, (dS - dw.transpose(-1, -2) @ c["wk"] if bias == "l2" else dS)

    starts, cs, _ = forward_sweep(chunks, stage, advance, S)
    dSs, dws, dh0 = reverse_sweep(chunks, cs, doh, retreat, dht if dht is not None else S.new_zeros(S.shape))
    out = {n: [] for n in ("dq", "dk", "dv", "db", "dla")}
    for i, sl in enumerate(chunks):
        c, do_c, S0, dSn, dw = cs[i], doh[:, :, sl], starts[i], dSs[i], dws[i]
        qc, kc, vc, bc, g, G, gq, w = (c[n] for n in ("qc", "kc", "vc", "bc", "g", "G", "gq", "w"))
        gl = g[..., -1:, :]
        D = do_c @ w.transpose(-1, -2)
        dq = (do_c @ S0) * gq.exp() + torch.einsum("...ts,...sc,...tsc->...tc", D, kc, c["Pm3"])
        dk_p = torch.einsum("...ts,...tc,...tsc->...sc", D, qc, c["Pm3"])
        dk_s = (w @ dSn) * (gl - g).exp()
        dg = qc * dq - kc * (dk_p + dk_s)
        dg = dg.clone()
        dg[..., -1, :] += gl.exp().squeeze(-2) * (dSn * S0).sum(-2) + (kc * dk_s).sum(-2)
        dk = dk_p + dk_s
        dG = torch.zeros_like(g)
        if bias == "l2":
            dr = c["Ainv"].transpose(-1, -2) @ dw
            dA = -(dr @ w.transpose(-1, -2)).tril(-1)
            dv = bc.unsqueeze(-1) * dr
            dkA1 = torch.einsum("...ts,...sc,...tsc->...tc", dA, kc, c["E3"])    # before the β_t factor
            db = (dr * (vc - c["kS"])).sum(-1) + (kc * dkA1).sum(-1)
            Z = dA * bc.unsqueeze(-1)
            dkA1 = bc.unsqueeze(-1) * dkA1
            dkA2 = torch.einsum("...ts,...tc,...tsc->...sc", Z, kc, c["E3"])
            dkG = -bc.unsqueeze(-1) * (dr @ S0)
            dk = dk + dkG * G.exp() + dkA1 + dkA2
            dG = dkG * c["kG"] + kc * dkA1
            dg = dg - kc * dkA2
        else:
            dv = bc.unsqueeze(-1) * dw
            db = (dw * vc).sum(-1)
        dla = (dg + dG).flip(-2).cumsum(-2).flip(-2)
        if placement == AFTER_STEP:
            dla = dla - dG
        if read == "chunk":
            dla = dla - qc * dq
        for n, x in zip(("dq", "dk", "dv", "db", "dla"), (dq, dk, dv, db, dla)):
            out[n].append(x)
    cat = {n: torch.cat(x, 2) for n, x in out.items()}
    return cat["dq"], cat["dk"], cat["dv"], cat["db"], cat["dla"], dh0
