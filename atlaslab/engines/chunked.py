"""Chunk-parallel torch engine, general over every registered part (Titans §3.2, ATLAS §3.3 and §5.1, TTT §2.4).

Inside a training chunk every gradient is taken at the chunk-start state (docs/concepts/memory.md#training-chunk),
so the whole chunk is computed at once (compute block = b):

1. per-token gradients u_i = ∇ℓ(W_a; φ(k_i), v_i) of every token the chunk's windows touch, in one batched
   ``vmap`` of a vector–Jacobian product (create-graph semantics: the outer loss differentiates through it);
2. the Omega window as a banded coefficient matrix C[s, i] = γ_i · 1[s − c < i ≤ s] (ATLAS §3.3's mask M_s),
   g_s = Σ_i C[s, i] u_i: window spill into the previous chunk uses those tokens' gradients at W_a
   (docs/concepts/memory.md#window-spill);
3. momentum and decay as parallel linear scans (``scan.py``); Muon's Newton–Schulz batched over positions;
4. per-token reads y_s = M_s(φ(q_s)) batched over the chunk's positions (or the chunk-start state for
   ``read: chunk``); mirror-map retentions apply Ψ at the chunk end, projecting ones Π, exactly as the reference.

Only one chunk's per-position weights ``[B, H, b, size(M)]`` exist at a time. Results equal
``recurrent`` (same state object, so calls chain and modes can be mixed).

Paths, in the order :func:`memorize_chunked` tries them:

- online (b = 1) linear rules: ``linear_delta.py`` (exact WY/UT blocks, any compute block);
- the φ* slot memory: ``slot_memory.py`` (slot bank in dual form, attention-like cost);
- GD / momentum on tape-capable memories with scalar after-step decay (Titans, TTT, OmegaNet-GD, …): the
  dual form, with every coefficient that does not depend on the memory (window, decay and momentum matrices)
  formed for all chunks at once (:func:`_dual_aligned`); per chunk only the gradient factors at the anchor,
  the reads and the chunk-end state remain;
  for the MLP memory (ℓ2 / dot bias, float32 / float64) each chunk's step and the reads run as single autograd
  nodes with hand-written backward (``mlp_step.py``); :func:`_dual_step` and :func:`_dual_read` are their
  reference;
- everything else (Muon, mirror maps and projections, before-step decay, implicit / multi-step GD, user memories
  without a tape): one chunk at a time (:func:`_segment`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Dict, Optional

import torch
import torch.utils.checkpoint
from torch.func import vjp, vmap

from atlaslab.engines import linear_delta, mlp_step
from atlaslab.engines.compiled import compiled, maybe_compiled
from atlaslab.engines.slot_memory import memorize_slot_memory
from atlaslab.engines.recurrent import _bh
from atlaslab.memory.fast_weights import DualForm, PerPosition, Tape
from atlaslab.memory.feature_maps import Identity
from atlaslab.engines.scan import (cumulative, decay_matrix, dual_coefficients, dual_coefficients_reference,
                                  scan_weights, window_matrix)
from atlaslab.memory.state import Gates, MemoryState, keep_history, split_time, with_history

if TYPE_CHECKING:
    from atlaslab.memory.spec import MemoryParts

Weights = Dict[str, torch.Tensor]


def _bcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape + (1,) * (like.dim() - x.dim()))


def gradient_factors(parts: "MemoryParts", weights: Weights, x, v, d) -> Dict[str, tuple]:
    """Per-token gradients of a tape-capable memory as rank-1 factors, from one backward pass.

    For every weight W (applied as z = W h): ∇_W ℓ(W; x_i, v_i) = δ_i h_iᵀ with δ_i = ∂ℓ_i/∂z_i.
    Returns ``{name: (δ [B, H, n, out], h [B, H, n, in])}``; differentiable (create-graph) when grad is on.
    """
    outer = torch.is_grad_enabled()
    with torch.enable_grad(), Tape() as tape:
        pred = parts.memory(weights, x)
        err = parts.attentional_bias.output_grad(pred, v, d)
        names = list(tape.records)
        deltas = torch.autograd.grad(pred, [tape.records[n][1] for n in names], grad_outputs=err,
                                     create_graph=outer, allow_unused=True)
    out = {}
    for name, delta in zip(names, deltas):
        h, z = tape.records[name]
        delta = torch.zeros_like(z) if delta is None else delta
        out[name] = (delta, h) if outer else (delta.detach(), h.detach())
    return out


def per_token_grads(parts: "MemoryParts", weights: Weights, x, v, d) -> Weights:
    """∇_θ ℓ(W; x_i, v_i) for every token: ``x: [B, H, n, F]`` → ``{name: [B, H, n, ...]}`` (W shared)."""
    mem, bias = parts.memory, parts.attentional_bias
    if mem.supports_tape:
        return {n: torch.einsum("bhno,bhni->bhnoi", dl, h)
                for n, (dl, h) in gradient_factors(parts, weights, x, v, d).items()}

    def one(xi, vi, di):
        pred, back = vjp(lambda w: mem(w, xi.unsqueeze(2)), weights)
        err = bias.output_grad(pred, vi.unsqueeze(2), None if di is None else di.unsqueeze(2))
        return back(err)[0]

    return vmap(one, in_dims=(2, 2, None if d is None else 2), out_dims=2)(x, v, d)


def window_grads_at(parts: "MemoryParts", weights: Weights, C: torch.Tensor, x, v, d) -> Weights:
    """g_s = Σ_i C[s, i] ∇ℓ(W_s; x_i, v_i) with per-position weights ``W_s: [B, H, L, ...]``."""
    mem, bias = parts.memory, parts.attentional_bias

    def one(w_s, c_s):
        pred, back = vjp(lambda w: mem(w, x), w_s)
        return back(bias.output_grad(pred, v, d) * c_s.unsqueeze(-1))[0]

    return vmap(one, in_dims=(2, 2), out_dims=2)(weights, C)


def _contract(C: torch.Tensor, u: Weights) -> Weights:
    """Σ_i C[s, i] u_i for every weight: ``[B,H,L,n] × [B,H,n,...] → [B,H,L,...]``."""
    return {name: torch.einsum("bhsn,bhnx->bhsx", C, g.reshape(*g.shape[:3], -1)).reshape(
        *C.shape[:3], *g.shape[3:]) for name, g in u.items()}


def _expand(weights: Weights, L: int) -> Weights:
    return {n: w.unsqueeze(2).expand(*w.shape[:2], L, *w.shape[2:]) for n, w in weights.items()}


def _scale_per_position(weights: Weights, scale: torch.Tensor, channel_wise: bool) -> Weights:
    """``scale [B,H,L]`` (or ``[B,H,L,K]``) ⊙ shared weights → per-position weights ``[B,H,L,...]``."""
    out = {}
    for n, w in weights.items():
        if channel_wise:
            s = scale.reshape(*scale.shape[:3], *(1,) * (w.dim() - 3), scale.shape[-1])
        else:
            s = scale.reshape(*scale.shape, *(1,) * (w.dim() - 2))
        out[n] = s * w.unsqueeze(2)
    return out


def _updates(parts, state, W_a, C, x, v, d, lr, theta, alpha, chunk_alpha, L):
    """Per-position updates U_s ``[B,H,L,...]`` (and the momentum trajectory), all gradients at the anchor."""
    opt, ret = parts.inner_optimizer, parts.retention
    name = opt.cfg.name
    before = ret.before_step and alpha is not None
    # the point each position's gradient is taken at: W_a, or (Π_{τ=t'}^{s} α_τ) W_a for before_step
    at = _scale_per_position(W_a, chunk_alpha, ret.channel_wise) if before else _expand(W_a, L)
    if name == "implicit_gd":
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        gram = torch.einsum("bhsn,bhni,bhnj->bhsij", C, x, x)
        rhs = at["W"] + lr[..., None, None] * torch.einsum("bhsn,bhnv,bhnk->bhsvk", C, v, x)
        w_star = torch.linalg.solve(eye + lr[..., None, None] * gram, rhs.mT).mT
        return {"W": w_star - at["W"]}, None
    if name == "multi_step_gd":
        u = {n: torch.zeros_like(w) for n, w in at.items()}
        for _ in range(opt.cfg.steps):
            g = window_grads_at(parts, {n: at[n] + u[n] for n in u}, C, x, v, d)
            u = {n: u[n] - _bcast(lr, g[n]) * g[n] for n in u}
        return u, None
    if (name == "muon" and opt.cfg.ns_granularity == "chunk" and not before
            and parts.memory.supports_tape):
        # only the momentum after the chunk's last token is used: S_end = Θ S₋₁ + Σ_i w_i δ_i h_iᵀ with
        # w = D_θ[L−1, :] C (no per-position gradient or momentum is formed)
        w = (decay_matrix(theta)[..., -1, :].unsqueeze(-2) @ C).squeeze(-2)          # [B, H, n]
        th = cumulative(theta)[..., -1]
        s_end = {n: _bcast(th, state.momentum[n]) * state.momentum[n] + (dl * w.unsqueeze(-1)).mT @ h
                 for n, (dl, h) in gradient_factors(parts, W_a, x, v, d).items()}
        return None, {n: s.unsqueeze(2) for n, s in s_end.items()}
    if before:    # a different point for every position: differentiate the window loss at each
        g = window_grads_at(parts, at, C, x, v, d)
    else:
        g = _contract(C, per_token_grads(parts, W_a, x, v, d))
    if name == "gd":
        return {n: -_bcast(lr, gi) * gi for n, gi in g.items()}, None
    if name == "momentum":
        s = scan_weights(state.momentum, theta, {n: -_bcast(lr, gi) * gi for n, gi in g.items()})
        return s, s
    if name == "muon":
        s = scan_weights(state.momentum, theta, g)
        if opt.cfg.ns_granularity == "chunk":
            return None, s
        return {n: -_bcast(lr, si) * opt.orthogonalise(si) for n, si in s.items()}, s
    raise NotImplementedError(f"chunked engine: no rule for inner optimizer '{name}'")


def uses_dual_form(parts: "MemoryParts", alpha) -> bool:
    """GD / momentum on a tape-capable memory with scalar decay (gradient at the chunk start)."""
    ret = parts.retention
    return (parts.memory.supports_tape and parts.inner_optimizer.cfg.name in ("gd", "momentum")
            and not ret.mirror and not ret.projects and not ret.channel_wise
            and not (ret.before_step and alpha is not None))


def _dual_segment(parts, state: MemoryState, C, x, v, d, lr, theta, alpha, xq) -> torch.Tensor:
    """One chunk in the dual form: no per-position weights (TTT §2.5 generalised to decay and momentum).

    M_s = P_s M_{−1} + Q_s S_{−1} + Σ_i A[s, i] u_i with u_i = δ_i h_iᵀ the per-token gradients at the anchor.
    GD: A = −D_α diag(η) C. Momentum: S_r = Θ_r S_{−1} − Σ D_θ[r, r'] η_r' g_r', so A = −D_α D_θ diag(η) C and
    Q = D_α Θ. (P, Θ: cumulative products; D: decay matrices of scan.py.)
    """
    ret, mem = parts.retention, parts.memory
    B, H, L = lr.shape
    factors = gradient_factors(parts, state.anchor, x, v, d)
    a = alpha if (alpha is not None and ret.uses_alpha) else torch.ones_like(lr)
    momentum = theta if parts.inner_optimizer.cfg.name == "momentum" else None
    P, Q, A, Th, S_coef = dual_coefficients(a, momentum, lr.unsqueeze(-1) * C)
    dual = {}
    for name, (left, right) in factors.items():
        bases = [(P, state.weights[name])] + ([(Q, state.momentum[name])] if Q is not None else [])
        dual[name] = DualForm(bases, A, left, right)
    y = mem(state.anchor, xq) if parts.read == "chunk" else mem(dual, xq)
    if S_coef is not None:
        state.momentum = {name: DualForm([(Th, state.momentum[name])], S_coef, *factors[name]).at(L - 1)
                          for name in factors}
    state.weights = {name: f.at(L - 1) for name, f in dual.items()}
    return y


def _window_slots(ext: Optional[torch.Tensor], h0: int, n_chunks: int, b: int, before: int):
    """Each chunk's window tokens: ``ext [B, H, h0+T, ...]`` → ``[B, H, N, before+b, ...]`` (ext indices
    h0 + n·b − before + e, clamped into range) and a validity mask ``[N, before+b]`` (inside the call's ext).

    Where the windows do not overlap (``before = 0``) or there is one chunk, the clamped gather is ext padded at
    its ends with copies of its first / last token and reshaped (no index, whose backward is a scatter);
    otherwise it is :func:`_window_slots_reference`, the plain gather."""
    if ext is None:
        return None, None
    if before and n_chunks > 1:
        return _window_slots_reference(ext, h0, n_chunks, b, before)
    n = ext.shape[2]
    lo, hi = h0 - before, h0 + n_chunks * b               # ext indices of the first slot and one past the last
    pieces = ([ext[:, :, :1].expand(*ext.shape[:2], -lo, *ext.shape[3:])] if lo < 0 else []) + \
        [ext[:, :, max(lo, 0):min(hi, n)]] + \
        ([ext[:, :, n - 1:].expand(*ext.shape[:2], hi - n, *ext.shape[3:])] if hi > n else [])
    padded = torch.cat(pieces, 2) if len(pieces) > 1 else pieces[0]           # [B, H, before + N·b, ...]
    slots = padded.reshape(*ext.shape[:2], n_chunks, before + b, *ext.shape[3:])
    return slots, _slot_mask(h0, n_chunks, b, before, n, ext.device)


@functools.lru_cache(maxsize=256)
def _slot_mask(h0: int, n_chunks: int, b: int, before: int, n: int, device: torch.device) -> torch.Tensor:
    """``[N, before+b]`` bool: slot e of chunk n (ext index h0 + n·b − before + e) lies inside the ext of n tokens."""
    idx = (torch.arange(n_chunks, device=device).unsqueeze(1) * b + (h0 - before)
           + torch.arange(before + b, device=device))
    return (idx >= 0) & (idx < n)


def _window_slots_reference(ext: Optional[torch.Tensor], h0: int, n_chunks: int, b: int, before: int):
    """:func:`_window_slots` as a plain gather of the clamped indices."""
    if ext is None:
        return None, None
    idx = (torch.arange(n_chunks, device=ext.device).unsqueeze(1) * b + (h0 - before)
           + torch.arange(before + b, device=ext.device))
    valid = (idx >= 0) & (idx < ext.shape[2])
    return ext[:, :, idx.clamp(0, ext.shape[2] - 1)], valid


def _pad_chunks(x: Optional[torch.Tensor], n_chunks: int, b: int, value: float) -> Optional[torch.Tensor]:
    """``[B, H, T, ...]`` → ``[B, H, N, b, ...]``, the tail filled with ``value``."""
    if x is None:
        return None
    pad = n_chunks * b - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:2], pad, *x.shape[3:]), value)], 2)
    return x.reshape(*x.shape[:2], n_chunks, b, *x.shape[3:])


def _dual_step(parts, weights: Weights, momentum: Optional[Weights], x, v, d, P_e, Q_e, A_e, Th_e, S_e,
               end=None):
    """The sequential part of one aligned chunk: the rank-1 gradient factors at its anchor ``weights`` and the
    state after its last real token e, M_e = P_e M + Q_e S + Σ_i A[e, i] l_i r_iᵀ, S_e = Θ_e S + Σ_i
    S_coef[e, i] l_i r_iᵀ (row e of the dual-form coefficients: ``P_e [B, H]``, ``A_e [B, H, W]``).
    ``end`` replaces :func:`_dual_end` (its compiled version); the factors are always eager."""
    factors = gradient_factors(parts, weights, x, v, d)
    return (factors, *(end or _dual_end)(factors, weights, momentum, P_e, Q_e, A_e, Th_e, S_e))


def _dual_end(factors: Dict[str, tuple], weights: Weights, momentum: Optional[Weights], P_e, Q_e, A_e, Th_e, S_e):
    """The chunk-end state of :func:`_dual_step` from the gradient factors ``{name: (l [B,H,W,out], r [B,H,W,in])}``
    → (weights, momentum) after the chunk's last real token."""

    def at(coef_row, bases):
        return {name: (left * coef_row.unsqueeze(-1)).mT @ r + sum(c[..., None, None] * base[name] for c, base in bases)
                for name, (left, r) in factors.items()}

    new_weights = at(A_e, [(P_e, weights)] + ([(Q_e, momentum)] if Q_e is not None else []))
    new_momentum = at(S_e, [(Th_e, momentum)]) if S_e is not None else momentum
    return new_weights, new_momentum


def _dual_read(memory, W_all: Weights, S_all: Optional[Weights], P_all, Q_all, A_all, lefts: Weights,
               rights: Weights, xq: torch.Tensor) -> torch.Tensor:
    """The reads of all chunks, folded into the batch (``[B·N, ...]``): each chunk's weights in dual form over its
    anchor ``W_all``, momentum ``S_all`` and gradient factors ``lefts``, ``rights``; ``xq [B·N, H, b, F]`` →
    ``[B·N, H, b, V]``."""
    dual = {n: DualForm([(P_all, W_all[n])] + ([(Q_all, S_all[n])] if Q_all is not None else []), A_all,
                        lefts[n], rights[n]) for n in W_all}
    return memory(dual, xq)


def _known_zero(weights: Optional[Weights]) -> bool:
    """True when every tensor is all zeros and takes no gradient (e.g. the momentum of a fresh state), so terms
    multiplied by it are exact zeros that can be left out. Checked on CPU tensors only: on an accelerator reading
    the values back would stall the stream once per call, so the (zero) terms are kept there."""
    return weights is not None and all(w.device.type == "cpu" and not w.requires_grad and not bool(w.any())
                                       for w in weights.values())


def _over_chunks(per_chunk: list) -> torch.Tensor:
    """N tensors ``[B, H, ...]`` → ``[B·N, H, ...]`` (chunk n of batch b at row b·N + n); one chunk: a view."""
    if len(per_chunk) == 1:
        return per_chunk[0]
    return torch.stack(per_chunk, 1).flatten(0, 1)


def _chunks_as_batch(z: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[B, H, N, ...]`` → ``[B·N, H, ...]``, the same row order as :func:`_over_chunks`."""
    return None if z is None else z.transpose(1, 2).flatten(0, 1)


def _dual_aligned(parts, state: MemoryState, gates: Gates, q, k, v, b: int, checkpoint: bool,
                  step=None, compile: bool = False) -> torch.Tensor:
    """Whole chunks from a chunk boundary (the last may be partial) in the dual form.

    Every coefficient that does not depend on the memory — windows, decay and momentum matrices of all chunks —
    is formed at once; the loop over chunks computes only each chunk's gradient factors at its anchor and its
    end state (:func:`_dual_step`); then the reads of ALL chunks run as one memory call with the chunks folded
    into the batch (each chunk's weights in dual form over its own anchor, momentum and factors).

    Padded tail positions have η = 0 and α = θ = 1 (they change no real position); the final state is read at
    the last real token. ``checkpoint`` recomputes each chunk's step in the backward pass; ``step`` replaces
    :func:`_dual_step` (same contract; e.g. the fused Triton MLP step). ``compile`` runs the coefficients, the chunk
    ends and the reads through ``torch.compile`` (:mod:`atlaslab.engines.compiled`). Mutates ``state``; returns
    ``[B, T, H, V]``.
    """
    # the MLP memory's step and read as single autograd nodes with hand-written backward (mlp_step.py) where they
    # apply (eager, float32 / float64); the autograd path below stays the reference for everything else
    fast = not compile and mlp_step.supports(parts, q.dtype) is None
    if step is None:
        if compile:
            step = functools.partial(_dual_step, end=compiled(_dual_end, q.device))
        else:
            step = mlp_step.dual_step if fast else _dual_step
    fm, ret = parts.feature_map, parts.retention
    B, T = q.shape[:2]
    N = -(-T // b)
    c = parts.window.size
    h0 = state.hist_k.shape[1]
    k_ext, v_ext, g_ext, d_ext = with_history(state, k, v, gates)
    if k_ext.shape == q.shape and not isinstance(fm, Identity):
        fk, fq = fm(torch.stack([k_ext, q])).unbind(0)         # φ of keys and queries in one call (φ is per vector)
    else:
        fk, fq = fm(k_ext), fm(q)
    x, valid = _window_slots(_bh(fk), h0, N, b, c - 1)                         # [B, H, N, W, F]
    vw, _ = _window_slots(_bh(v_ext), h0, N, b, c - 1)
    dw, _ = _window_slots(_bh(d_ext) if d_ext is not None else None, h0, N, b, c - 1)
    gw, _ = _window_slots(_bh(g_ext), h0, N, b, c - 1)
    C = window_matrix(c - 1, b, c, gw * valid)                                 # [B, H, N, b, W]
    lr = _pad_chunks(_bh(gates.lr), N, b, 0.0)                                 # [B, H, N, b]
    alpha = gates.retention.transpose(1, 2) if (gates.retention is not None and ret.uses_alpha) else None
    a = _pad_chunks(alpha, N, b, 1.0) if alpha is not None else torch.ones_like(lr)
    theta = _pad_chunks(_bh(gates.momentum), N, b, 1.0) if parts.inner_optimizer.cfg.name == "momentum" else None
    P, Q, A, Th, S_coef = (compiled(dual_coefficients_reference, q.device) if compile else dual_coefficients)(
        a, theta, lr.unsqueeze(-1) * C)                                        # each [B, H, N, b(, W)]

    # row e of every coefficient: the chunk's last real position (b − 1, or the last token of a partial chunk)
    last = T - (N - 1) * b
    if last == b:
        def end_row(z):
            return None if z is None else z[:, :, :, b - 1]
    else:
        ends = torch.full((N,), b - 1, device=q.device)
        ends[-1] = last - 1
        chunk = torch.arange(N, device=q.device)

        def end_row(z):
            return None if z is None else z[:, :, chunk, ends]

    def per_chunk(z):
        return [None] * N if z is None else z.unbind(2)

    steps = zip(*(per_chunk(z) for z in (x, vw, dw)), *(per_chunk(end_row(z)) for z in (P, Q, A, Th, S_coef)))
    anchors, momenta, factors = [], [], []
    weights, momentum = state.weights, state.momentum
    for args in steps:
        anchors.append(weights)
        momenta.append(momentum)
        if checkpoint and torch.is_grad_enabled():
            f, weights, momentum = torch.utils.checkpoint.checkpoint(
                step, parts, weights, momentum, *args, use_reentrant=False)
        else:
            f, weights, momentum = step(parts, weights, momentum, *args)
        factors.append(f)

    # all reads at once: chunks folded into the batch
    names = list(factors[0])
    W_all = {n: _over_chunks([w[n] for w in anchors]) for n in names}
    xq = _chunks_as_batch(_pad_chunks(_bh(fq), N, b, 0.0))                     # [B·N, H, b, F]
    if parts.read == "chunk":
        y = parts.memory(W_all, xq)
    else:
        S_all = {n: _over_chunks([s[n] for s in momenta]) for n in names} if Q is not None else None
        P_all, Q_all, A_all = (_chunks_as_batch(z) for z in (P, Q, A))
        if S_all is not None and N == 1 and _known_zero(momenta[0]):
            S_all = Q_all = None          # one chunk from a zero momentum (a fresh state): Q S₋₁ adds exact zeros
        lefts = {n: _over_chunks([f[n][0] for f in factors]) for n in names}
        rights = {n: _over_chunks([f[n][1] for f in factors]) for n in names}
        read = (functools.partial(mlp_step.dual_read, parts=parts) if fast
                else maybe_compiled(_dual_read, compile, q.device))
        y = read(parts.memory, W_all, S_all, P_all, Q_all, A_all, lefts, rights, xq)     # [B·N, H, b, V]
    y = y.reshape(B, N, *y.shape[1:]).permute(0, 1, 3, 2, 4).flatten(1, 2)[:, :T]   # [B, T, H, V]

    state.anchor = anchors[-1]
    state.weights, state.momentum = weights, momentum
    state.chunk_alpha = P[:, :, -1, last - 1] if alpha is not None else state.chunk_alpha.new_ones(
        state.chunk_alpha.shape)
    state.chunk_lr = torch.zeros_like(state.chunk_lr)
    keep_history(state, parts.window.history(), k_ext, v_ext, g_ext, d_ext)
    state.position += T
    return y


def _segment(parts, state: MemoryState, gates: Gates, q, k, v, b: int, outputs: list):
    """Process one piece of the call (``q: [B, L, H, D]``), all inside one training chunk. Mutates ``state``."""
    fm, mem, ret, opt = parts.feature_map, parts.memory, parts.retention, parts.inner_optimizer
    L = q.shape[1]
    if state.position % b == 0:
        state.anchor = state.weights
        state.chunk_alpha = torch.ones_like(state.chunk_alpha)
        state.chunk_lr = torch.zeros_like(state.chunk_lr)
    end_of_chunk = (state.position + L) % b == 0
    window = parts.window.size
    h = state.hist_k.shape[1]
    k_ext, v_ext, g_ext, d_ext = with_history(state, k, v, gates)
    x, vv, dd = _bh(fm(k_ext)), _bh(v_ext), (_bh(d_ext) if d_ext is not None else None)
    C = window_matrix(h, L, window, _bh(g_ext))

    lr = _bh(gates.lr)
    theta = _bh(gates.momentum) if gates.momentum is not None else None
    alpha = gates.retention.transpose(1, 2) if gates.retention is not None else None   # [B,H,L(,K)]
    # Π_{τ=t'}^{s} α_τ for every position s of the segment (continuing the running product of the chunk)
    if alpha is not None:
        a_for_cum = alpha.movedim(2, -1) if ret.channel_wise else alpha
        cum = cumulative(a_for_cum)
        cum = cum.movedim(-1, 2) if ret.channel_wise else cum
        chunk_alpha = state.chunk_alpha.unsqueeze(2) * cum
    else:
        chunk_alpha = state.chunk_alpha.unsqueeze(2).expand(*state.chunk_alpha.shape[:2], L,
                                                            *state.chunk_alpha.shape[2:])

    if uses_dual_form(parts, alpha):
        y = _dual_segment(parts, state, C, x, vv, dd, lr, theta, alpha, _bh(fm(q)))
        state.chunk_alpha = chunk_alpha[:, :, -1]
        _finish_segment(parts, state, outputs, y, k_ext, v_ext, g_ext, d_ext)
        return

    W_a = state.anchor
    U, S = _updates(parts, state, W_a, C, x, vv, dd, lr, theta, alpha, chunk_alpha, L)
    if S is not None:
        state.momentum = {n: s[:, :, -1] for n, s in S.items()}

    if U is None:   # chunk-granular Muon: the memory takes one step when the chunk completes
        M = _expand(state.weights, L)
        state.chunk_lr = state.chunk_lr + lr.sum(-1)
        if end_of_chunk:
            eta = state.chunk_lr / b
            step = {n: -_bcast(eta, s) * opt.orthogonalise(s) for n, s in state.momentum.items()}
            total = chunk_alpha[:, :, -1]
            if ret.mirror:
                state.dual = {n: ret.decay({n: state.dual[n]}, total)[n] + step[n] for n in step}
                state.weights = ret.psi(state.dual)
            else:
                state.weights = {n: ret.decay({n: state.weights[n]}, total)[n] + step[n] for n in step}
            if ret.projects:
                state.weights = ret.project_chunk(state.weights, state.anchor)
    else:
        a_scan = alpha if ret.uses_alpha else None
        M = scan_weights(state.weights, a_scan, U, ret.channel_wise)
        last = None
        if ret.mirror:
            A = scan_weights(state.dual, a_scan, U, ret.channel_wise)
            state.dual = {n: a[:, :, -1] for n, a in A.items()}
            if end_of_chunk:
                last = ret.psi(state.dual)
        if ret.projects and end_of_chunk:
            last = ret.project_chunk({n: m[:, :, -1] for n, m in M.items()}, state.anchor)
        if last is not None:
            M = {n: torch.cat([M[n][:, :, :-1], last[n].unsqueeze(2)], 2) for n in M}
        state.weights = {n: m[:, :, -1] for n, m in M.items()}
    state.chunk_alpha = chunk_alpha[:, :, -1]

    xq = _bh(fm(q))                                                   # [B, H, L, F]
    if parts.read == "chunk":
        y = mem(state.anchor, xq)
    elif mem.supports_tape:
        y = mem({n: PerPosition(w) for n, w in M.items()}, xq)
    else:
        y = vmap(lambda w, xs: mem(w, xs.unsqueeze(2)).squeeze(2), in_dims=(2, 2), out_dims=2)(M, xq)
    _finish_segment(parts, state, outputs, y, k_ext, v_ext, g_ext, d_ext)


def _finish_segment(parts, state, outputs, y, k_ext, v_ext, g_ext, d_ext):
    outputs.append(y.transpose(1, 2))

    keep_history(state, parts.window.history(), k_ext, v_ext, g_ext, d_ext)
    state.position += y.shape[2]


def _run_piece(parts, state: MemoryState, piece, b: int):
    """One training chunk as a pure function (for activation checkpointing): → (y, new state)."""
    state = dataclasses.replace(state)
    outputs: list = []
    qi, ki, vi, gi = piece
    _segment(parts, state, gi, qi, ki, vi, b, outputs)
    return outputs[0], state


def memorize_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: "MemoryParts", gates: Gates,
                     chunk_size: int, state: MemoryState, block_size: Optional[int] = None, checkpoint: bool = False,
                     dual_step=None, compile: bool = False):
    """Chunk-parallel engine. ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` → ``([B, T, H, D_v], state)``.

    Online (b = 1) linear rules run exactly in blocks of ``block_size`` tokens (``linear_delta.py``); every
    other spec runs with compute block = b. ``checkpoint=True`` keeps only each chunk's inputs and state for
    the backward pass and recomputes the chunk's internals (activation checkpointing, for long sequences).
    ``compile=True`` runs the per-chunk work of the online linear rules and of the dual form through
    ``torch.compile`` (:mod:`atlaslab.engines.compiled`); the other paths stay eager.
    """
    if linear_delta.supports(parts, chunk_size):
        return linear_delta.memorize_linear_delta(q, k, v, parts, gates, state, block_size, compile)
    if parts.kernel_trick:   # the φ* slot memory: attention-like, one dual-form piece per chunk
        return memorize_slot_memory(q, k, v, parts, gates, chunk_size, state, block_size)
    state = dataclasses.replace(state)
    b, T = chunk_size, q.shape[1]
    sizes, pos = [], state.position
    while sum(sizes) < T:                    # pieces end at training-chunk boundaries
        sizes.append(min(T - sum(sizes), b - (pos + sum(sizes)) % b))
    outputs: list = []
    if uses_dual_form(parts, gates.retention) and parts.window.size is not None:
        if state.position % b:               # finish the chunk a previous call left open, then batch the rest
            first, (q, k, v, gates) = split_time([sizes[0], T - sizes[0]], q, k, v, gates)
            y, state = _run_piece(parts, state, first, b)
            outputs.append(y)
        if q.shape[1]:
            outputs.append(_dual_aligned(parts, state, gates, q, k, v, b, checkpoint, dual_step, compile))
        return torch.cat(outputs, 1), state
    pieces = split_time(sizes, q, k, v, gates)
    for piece in pieces:
        if checkpoint and torch.is_grad_enabled():
            y, state = torch.utils.checkpoint.checkpoint(_run_piece, parts, state, piece, b, use_reentrant=False)
        else:
            y, state = _run_piece(parts, state, piece, b)
        outputs.append(y)
    return torch.cat(outputs, 1), state
