"""The reference engine: a memory's recurrence computed token by token, literally.

See docs/concepts/memory.md#recurrence.

For each token t (global position, chunk start t' = t − t mod b):

1. window: the last c tokens (k_i, v_i, γ_i), i ∈ (t − c, t]  (ATLAS Eq.9; spill past t' allowed,
   docs/concepts/memory.md#window-spill);
2. anchor: W_a = M_{t'} (``after_step``) or (Π_{τ=t'}^{t} α_τ) M_{t'} (``before_step``,
   docs/concepts/memory.md#retention-placement);
3. gradient: g = Σ_i γ_i ∇_θ ℓ(W_a; φ(k_i), v_i) by a vector–Jacobian product through the memory;
4. update: U_t from the inner optimizer (docs/concepts/memory.md#inner-optimizer); M_t = α_t M_{t−1} + U_t; for
   mirror-map retentions the dual A_t = α_t A_{t−1} + U_t and M_t ← Ψ(A_t) after each chunk's last token
   (docs/concepts/memory.md#mirror-maps, Miras §5.4); a projecting retention sets M_t ← Π(M_t; M_{t'}) after
   each chunk's last token (docs/concepts/memory.md#weight-norm);
   chunk-granular Muon instead steps once at the chunk end, (Π α) M_{t'} − η̄ NS_k(S_end)
   (docs/concepts/memory.md#ns-granularity);
5. read: y_t = M_t(φ(q_t)) (``read: token``, docs/concepts/memory.md#read-after-write) or M_{t'}(φ(q_t))
   (``read: chunk``, docs/concepts/memory.md#read-granularity).

φ* on a linear memory (the kernel trick, docs/concepts/memory.md#exponential-feature-map) keeps the memory as
slots, M = Σ_j u_j φ*(k_j)ᵀ, so that M φ*(x) = Σ_j u_j exp(k_jᵀx): a gradient step writes coefficients into
the window's slots.

This is the definition every fast path is tested against: plain, slow, and general.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional

import torch

from atlaslab.memory.state import Gates, MemoryState, WindowProblem, keep_last, split_time

if TYPE_CHECKING:
    from atlaslab.memory.spec import MemoryParts

Weights = Dict[str, torch.Tensor]


def _add(a: Weights, b: Weights) -> Weights:
    return {n: a[n] + b[n] for n in a}


def _bh(x: torch.Tensor) -> torch.Tensor:
    """``[B, n, H, ...]`` → ``[B, H, n, ...]``."""
    return x.transpose(1, 2)


def _normalised_kernel(parts: "MemoryParts") -> bool:
    return parts.kernel_trick and parts.spec.feature_map.normalize


def initial_state(parts: "MemoryParts", batch: int, dtype: torch.dtype, device: torch.device) -> MemoryState:
    """The state before the first token: the (learned) initial memory, zero momentum, empty window."""
    H, Dk, Dv = parts.num_heads, parts.key_dim, parts.value_dim
    kw = dict(dtype=dtype, device=device)
    weights = anchor = momentum = dual = None
    bank = {}
    if parts.kernel_trick:
        width = Dv + int(_normalised_kernel(parts))   # + the token-mass column of the softmax normaliser
        empty = torch.zeros(batch, H, 0, width, **kw)
        bank = dict(bank_k=torch.zeros(batch, H, 0, Dk, **kw), bank_u=empty, anchor_u=empty,
                    bank_s=empty if parts.inner_optimizer.has_momentum else None)
    else:
        w0 = {n: w.to(**kw) for n, w in parts.memory.initial_weights(batch).items()}
        if parts.retention.mirror:
            dual, weights = w0, parts.retention.psi(w0)
        else:
            weights = w0
        anchor = weights
        if parts.inner_optimizer.has_momentum:
            momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    alpha_shape = (batch, H, Dk) if parts.retention.channel_wise else (batch, H)
    return MemoryState(
        weights=weights, anchor=anchor, momentum=momentum, dual=dual, position=0,
        hist_k=torch.zeros(batch, 0, H, Dk, **kw), hist_v=torch.zeros(batch, 0, H, Dv, **kw),
        hist_gamma=torch.zeros(batch, 0, H, **kw),
        hist_delta=torch.zeros(batch, 0, H, **kw) if parts.attentional_bias.uses_delta else None,
        chunk_alpha=torch.ones(alpha_shape, **kw), chunk_lr=torch.zeros(batch, H, **kw), **bank)


def _kernel_read(coef: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, normalise: bool) -> torch.Tensor:
    """Σ_j coef_j exp(k_jᵀx) for ``coef: [B,H,N,V]``, ``keys: [B,H,N,D]``, ``x: [B,H,n,D]`` → ``[B,H,n,V']``.

    With ``normalise`` the last coefficient column is the token mass and the result is the softmax read
    (numerator / mass, both scaled by exp(−max score) for stability).
    """
    scores = torch.einsum("bhnd,bhjd->bhnj", x, keys)
    if not normalise:
        return torch.einsum("bhnj,bhjv->bhnv", scores.exp(), coef)
    if scores.shape[-1] == 0:
        return x.new_zeros(*x.shape[:-1], coef.shape[-1] - 1)
    w = (scores - scores.amax(-1, keepdim=True).detach()).exp()
    out = torch.einsum("bhnj,bhjv->bhnv", w, coef)
    num, mass = out[..., :-1], out[..., -1:]
    return num / (mass + (mass == 0).to(mass.dtype))   # an empty memory reads 0


def _weights_step(parts: "MemoryParts", state: MemoryState, gates: Gates, t: int, q_t, win, b: int):
    fm, mem, bias, ret, opt = (parts.feature_map, parts.memory, parts.attentional_bias, parts.retention,
                               parts.inner_optimizer)
    hk, hv, hg, hd = win
    x_win, v_win, g_win = _bh(fm(hk)), _bh(hv), _bh(hg)
    d_win = _bh(hd) if hd is not None else None

    def grad(weights: Weights) -> Weights:
        pred, vjp_fn = torch.func.vjp(lambda w: mem(w, x_win), weights)
        err = bias.output_grad(pred, v_win, d_win) * g_win.unsqueeze(-1)
        return vjp_fn(err)[0]

    problem = WindowProblem(x_win, v_win, g_win, grad)
    alpha_t = gates.retention[:, t] if gates.retention is not None else None
    lr_t = gates.lr[:, t]
    theta_t = gates.momentum[:, t] if gates.momentum is not None else None
    anchor = state.anchor
    if ret.before_step and alpha_t is not None:
        anchor = ret.decay(anchor, state.chunk_alpha)
    end_of_chunk = (state.position + 1) % b == 0

    if getattr(opt.cfg, "ns_granularity", "token") == "chunk":
        state.momentum = opt.accumulate(grad(anchor), state.momentum, theta_t)
        state.chunk_lr = state.chunk_lr + lr_t
        if end_of_chunk:
            eta = state.chunk_lr / b
            step = {n: -eta.reshape(eta.shape + (1,) * (s.dim() - 2)) * opt.orthogonalise(s)
                    for n, s in state.momentum.items()}
            if ret.mirror:
                state.dual = _add(ret.decay(state.dual, state.chunk_alpha), step)
                state.weights = ret.psi(state.dual)
            else:
                state.weights = _add(ret.decay(state.weights, state.chunk_alpha), step)
    else:
        update, state.momentum = opt.update(problem, anchor, state.momentum, lr_t, theta_t)
        state.weights = _add(ret.decay(state.weights, alpha_t), update)
        if ret.mirror:
            state.dual = _add(ret.decay(state.dual, alpha_t), update)
            if end_of_chunk:
                state.weights = ret.psi(state.dual)
    if ret.projects and end_of_chunk:
        state.weights = ret.project_chunk(state.weights, state.anchor)

    read_weights = state.weights if parts.read == "token" else state.anchor
    return mem(read_weights, fm(q_t).unsqueeze(2)).squeeze(2)


def _kernel_step(parts: "MemoryParts", state: MemoryState, gates: Gates, t: int, q_t, k_t, win):
    bias, ret, opt = parts.attentional_bias, parts.retention, parts.inner_optimizer
    normalise = _normalised_kernel(parts)
    hk, hv, hg, hd = win
    n = hk.shape[1]
    B, H = q_t.shape[:2]
    width = state.bank_u.shape[-1]
    # one new slot for token t
    state.bank_k = torch.cat([state.bank_k, k_t.unsqueeze(2)], dim=2)
    state.bank_u = torch.cat([state.bank_u, state.bank_u.new_zeros(B, H, 1, width)], dim=2)
    if state.bank_s is not None:
        state.bank_s = torch.cat([state.bank_s, state.bank_s.new_zeros(B, H, 1, width)], dim=2)
    N = state.bank_k.shape[2]
    anchor_u = torch.cat([state.anchor_u, state.anchor_u.new_zeros(B, H, N - state.anchor_u.shape[2], width)], 2)

    alpha_t = gates.retention[:, t] if gates.retention is not None else None
    # predictions of the window tokens at the anchor (the normaliser's mass column is carried along)
    x_win, v_win, g_win = _bh(hk), _bh(hv), _bh(hg)
    pred = torch.einsum("bhnj,bhjv->bhnv", torch.einsum("bhnd,bhjd->bhnj", x_win, state.bank_k).exp(), anchor_u)
    if ret.before_step and alpha_t is not None:
        pred = pred * state.chunk_alpha[..., None, None]
    target = torch.cat([v_win, v_win.new_ones(*v_win.shape[:-1], 1)], -1) if normalise else v_win
    err = bias.output_grad(pred, target, _bh(hd) if hd is not None else None) * g_win.unsqueeze(-1)
    slot_grad = torch.cat([err.new_zeros(B, H, N - n, width), err], dim=2)   # window slots = last n slots

    lr = gates.lr[:, t][..., None, None]
    alpha = alpha_t[..., None, None] if alpha_t is not None else 1.0
    if opt.has_momentum:
        state.bank_s = gates.momentum[:, t][..., None, None] * state.bank_s - lr * slot_grad
        state.bank_u = alpha * state.bank_u + state.bank_s
    else:
        state.bank_u = alpha * state.bank_u - lr * slot_grad
    coef = state.bank_u if parts.read == "token" else anchor_u
    return _kernel_read(coef, state.bank_k, q_t.unsqueeze(2), normalise).squeeze(2)


def read_memory(parts: "MemoryParts", state: MemoryState, q: torch.Tensor) -> torch.Tensor:
    """Read a memory without writing: y = M(φ(q)) for ``q: [B, T, H, D_k]`` → ``[B, T, H, D_v]``.

    Reads the current memory ``state.weights`` (or the kernel trick's slots), as ``read: token`` would
    after the last written token.
    """
    x = q.transpose(1, 2)
    if parts.kernel_trick:
        y = _kernel_read(state.bank_u, state.bank_k, x, _normalised_kernel(parts))
    else:
        y = parts.memory(state.weights, parts.feature_map(x))
    return y.transpose(1, 2)


def memorize_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: "MemoryParts", gates: Gates,
                       chunk_size: int, state: MemoryState, block_size: Optional[int] = None,
                       checkpoint: bool = False):
    """Token-by-token reference. ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` → ``([B, T, H, D_v], state)``.

    ``block_size`` and ``checkpoint`` are knobs of the fast paths, unused here.
    """
    state = dataclasses.replace(state)   # never mutate the caller's state object
    b = chunk_size
    keep = parts.window.history()        # c − 1, or None for the global window
    outputs = []
    for q_t, k_t, v_t, g_t in split_time([1] * q.shape[1], q, k, v, gates):   # pieces of one token
        if state.position % b == 0:       # a new training chunk starts: M_{t'} is the current memory
            state.anchor = state.weights
            state.anchor_u = state.bank_u
            state.chunk_alpha = torch.ones_like(state.chunk_alpha)
            state.chunk_lr = torch.zeros_like(state.chunk_lr)
        if g_t.retention is not None:
            state.chunk_alpha = state.chunk_alpha * g_t.retention[:, 0]
        win = (
            torch.cat([state.hist_k, k_t], 1),
            torch.cat([state.hist_v, v_t], 1),
            torch.cat([state.hist_gamma, g_t.window], 1),
            torch.cat([state.hist_delta, g_t.delta], 1) if g_t.delta is not None else None,
        )
        win = tuple(keep_last(w, None if keep is None else keep + 1) for w in win)
        if parts.kernel_trick:
            y = _kernel_step(parts, state, g_t, 0, q_t[:, 0], k_t[:, 0], win)
        else:
            y = _weights_step(parts, state, g_t, 0, q_t[:, 0], win, b)
        state.hist_k, state.hist_v, state.hist_gamma = (keep_last(w, keep) for w in win[:3])
        state.hist_delta = keep_last(win[3], keep)
        state.position += 1
        outputs.append(y)
    return torch.stack(outputs, dim=1), state
