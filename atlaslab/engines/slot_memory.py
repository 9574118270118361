"""The φ* slot memory, chunk-parallel: a linear memory under φ* kept as slots (ATLAS Eq.22-23, §4 DeepTransformers).

See docs/concepts/memory.md#exponential-feature-map.

With φ*(x)ᵀφ*(y) = exp(xᵀy) the memory is a bank of slots, M = Σ_j u_j φ*(k_j)ᵀ (one slot per token, key k_j),
read as M φ*(q) = Σ_j u_j exp(k_jᵀq). A gradient step of the window loss at the chunk-start anchor writes
coefficients only into the window's slots: g_r = Σ_e C[r, e] e_{r,e} into slot e, with e_{r,e} the bias's
output gradient of window token e (predicted by the anchor bank, scaled by the running Π α for
``before_step``). GD and momentum keep every coefficient linear in those writes, so a whole chunk follows the
TTT dual form (as ``chunked._dual_segment`` does for weight matrices):

    u_s = P_s u_0 + Q_s S_0 + Σ_r A[s, r] g_r,    S_s = Θ_s S_0 + Σ_r S_coef[s, r] g_r,

with P, Θ the cumulative products of α, θ and A = −D_α diag(η) (GD) or D_α S_coef, S_coef = −D_θ diag(η)
(momentum). The reads y_s = Σ_j u_{s,j} exp(k_jᵀq_s) therefore need no per-position bank: the chunk-start
bank is read once (scaled by P_s, Q_s) and the chunk's new coefficients through a [positions × window]
matrix. ``normalize: true`` divides by the same read of the token-mass column (softmax attention), with
the row maximum of the causal scores subtracted first. Cost per chunk: O(b · N · (D + D_v)) for N slots,
i.e. causal attention's O(T²) over a sequence, never a per-token copy of the bank.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from atlaslab.engines.recurrent import _bh, _kernel_read, _normalised_kernel
from atlaslab.engines.scan import cumulative, dual_coefficients, window_matrix
from atlaslab.memory.state import Gates, MemoryState, keep_history, split_time, with_history

if TYPE_CHECKING:
    from atlaslab.memory.spec import MemoryParts


#: pieces of at most this many tokens when none is given (dot bias, token read: pieces may span chunks)
BLOCK = 64


def memorize_slot_memory(q, k, v, parts: "MemoryParts", gates: Gates, chunk_size: int, state: MemoryState,
                          block_size: Optional[int] = None):
    """``q, k: [B, T, H, D]``, ``v: [B, T, H, D_v]`` → (``[B, T, H, D_v]``, state).

    Pieces end at training-chunk ends. With the dot-product bias and ``read: token`` nothing depends on the
    chunk-start anchor (the writes are −v), so pieces of up to ``block_size`` tokens may span chunks; only the
    last chunk boundary is kept as a cut, so that the state (anchor bank, running Π α) is the reference's.
    """
    state = dataclasses.replace(state)
    block_size = block_size or BLOCK
    b, T, pos = chunk_size, q.shape[1], state.position
    if parts.attentional_bias.cfg.name == "dot" and parts.read == "token":
        last = max((t for t in range(T) if (pos + t) % b == 0), default=0)   # the last chunk start in the call
        sizes = [min(block_size, e - s) for lo, hi in ((0, last), (last, T))
                 for s in range(lo, hi, block_size) for e in [hi]]
    else:
        sizes = []
        while sum(sizes) < T:
            sizes.append(min(T - sum(sizes), b - (pos + sum(sizes)) % b))
    outputs = [_piece(parts, state, b, *piece) for piece in split_time(sizes, q, k, v, gates)]
    return torch.cat(outputs, 1), state


def _window_writes(coef: torch.Tensor, C: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Σ_r coef[s, r] C[r, e] e_{r,e} → ``[B, H, L, W, width]``; ``err`` is ``[B,H,W,width]`` or per step
    ``[B,H,L,W,width]`` (``before_step``)."""
    if err.dim() == 4:
        return (coef @ C).unsqueeze(-1) * err.unsqueeze(2)
    return torch.einsum("bhsr,bhre,bhrew->bhsew", coef, C, err)


def _place(old: torch.Tensor, writes: torch.Tensor, h: int) -> torch.Tensor:
    """Bank ``old [B,H,N0,w]`` plus the window writes ``[B,H,h+L,w]`` on its last h slots and L new slots."""
    N0 = old.shape[2]
    return torch.cat([old[:, :, :N0 - h], old[:, :, N0 - h:] + writes[:, :, :h], writes[:, :, h:]], 2)


def _piece(parts: "MemoryParts", state: MemoryState, b: int, q, k, v, gates: Gates) -> torch.Tensor:
    """One piece inside one training chunk (``q: [B, L, H, D]``). Mutates ``state``; returns ``[B, L, H, D_v]``."""

    bias, ret = parts.attentional_bias, parts.retention
    normalise = _normalised_kernel(parts)
    L = q.shape[1]
    if state.position % b == 0:
        state.anchor_u = state.bank_u
        state.chunk_alpha = torch.ones_like(state.chunk_alpha)
        state.chunk_lr = torch.zeros_like(state.chunk_lr)
    h, N0 = state.hist_k.shape[1], state.bank_k.shape[2]
    k_ext, v_ext, g_ext, d_ext = with_history(state, k, v, gates)
    keys = torch.cat([state.bank_k, _bh(k)], 2)                                # [B, H, N0 + L, D]
    x, vv = _bh(k_ext), _bh(v_ext)                                             # window tokens = last h + L slots
    C = window_matrix(h, L, parts.window.size, _bh(g_ext))                     # [B, H, L, h + L]

    alpha = gates.retention.transpose(1, 2) if (gates.retention is not None and ret.uses_alpha) else None
    running = state.chunk_alpha.unsqueeze(2) * (cumulative(alpha) if alpha is not None else 1.0)
    # the anchor's predictions of the window tokens (slots written after the anchor hold 0 there)
    Na = state.anchor_u.shape[2]
    pred = (x @ keys[:, :, :Na].mT).exp() @ state.anchor_u                     # [B, H, h + L, width]
    target = torch.cat([vv, vv.new_ones(*vv.shape[:-1], 1)], -1) if normalise else vv
    d = _bh(d_ext) if d_ext is not None else None
    if ret.before_step and alpha is not None:   # the anchor seen at step s is (Π α) M_{t'}
        err = bias.output_grad(pred.unsqueeze(2) * running[..., None, None], target.unsqueeze(2),
                               None if d is None else d.unsqueeze(2))          # [B, H, L, h + L, width]
    else:
        err = bias.output_grad(pred, target, d)                                # [B, H, h + L, width]

    lr = _bh(gates.lr)
    theta = _bh(gates.momentum) if parts.inner_optimizer.has_momentum else None
    P, Q, A, Th, S_coef = dual_coefficients(alpha if alpha is not None else torch.ones_like(lr), theta,
                                            torch.diag_embed(lr))             # step r writes η_r into its own g_r
    writes = _window_writes(A, C, err)                                         # new coefficients at each s
    qb = _bh(q)
    if parts.read == "chunk":
        y = _kernel_read(state.anchor_u, keys[:, :, :Na], qb, normalise)
    else:
        scores = qb @ keys.mT                                                  # [B, H, L, N0 + L]
        future = torch.arange(N0 + L, device=q.device) > N0 + torch.arange(L, device=q.device).unsqueeze(1)
        scores = scores.masked_fill(future, float("-inf"))
        if normalise:
            scores = scores - scores.amax(-1, keepdim=True).detach()
        E = scores.exp()
        out = P.unsqueeze(-1) * (E[..., :N0] @ state.bank_u)
        if Q is not None:
            out = out + Q.unsqueeze(-1) * (E[..., :N0] @ state.bank_s)
        out = out + torch.einsum("bhse,bhsew->bhsw", E[..., N0 - h:], writes)
        if normalise:
            num, mass = out[..., :-1], out[..., -1:]
            out = num / (mass + (mass == 0).to(mass.dtype))
        y = out

    carried = P[:, :, -1, None, None] * state.bank_u
    if Q is not None:
        carried = carried + Q[:, :, -1, None, None] * state.bank_s
    state.bank_u = _place(carried, writes[:, :, -1], h)
    if S_coef is not None:
        momentum_writes = _window_writes(S_coef[:, :, -1:], C, err)[:, :, 0]
        state.bank_s = _place(Th[:, :, -1, None, None] * state.bank_s, momentum_writes, h)
    state.bank_k = keys
    state.chunk_alpha = running[:, :, -1]
    keep_history(state, parts.window.history(), k_ext, v_ext, g_ext, d_ext)
    state.position += L
    return y.transpose(1, 2)
