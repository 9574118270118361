"""The recurrent state a memory carries between calls, and the normalised gates of one call.

A second ``memorize`` call given the first call's state continues exactly where the first stopped: the
state holds the memory, the chunk-start anchor (gradients of a partly processed chunk are taken there),
the momentum and mirror-map accumulators, the last c − 1 window tokens, and the running per-chunk
products that ``before_step`` decay and chunk-granular Muon need.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional

import torch

Weights = Dict[str, torch.Tensor]

GATE_NAMES = ("lr", "retention", "momentum", "window", "delta")


@dataclass
class MemoryState:
    """State of a batch of memories after ``position`` tokens.

    weights:   M_t, ``{name: [B, H, ...]}``; a linear memory is ``{"W": [B, H, D_v, D_k]}``.
    anchor:    M_{t'}, the state at the start of the current training chunk.
    momentum:  S_t (momentum GD and Muon), shaped like ``weights``; else None.
    dual:      A_t, the accumulator of mirror-map retentions (ℓq, KL, …); else None.
    position:  tokens consumed so far (chunk boundaries are at multiples of b from position 0).
    hist_k, hist_v, hist_gamma, hist_delta: the last tokens the window still covers,
               ``[B, n, H, D_k]``, ``[B, n, H, D_v]``, ``[B, n, H]``, ``[B, n, H]`` (raw keys, before φ).
    chunk_alpha: Π α over the current chunk so far (``[B, H]`` or ``[B, H, D_k]``).
    chunk_lr:    Σ η over the current chunk so far (``[B, H]``; chunk-granular Muon).
    bank_k, bank_u, bank_s, anchor_u: the exp kernel trick's slots (``[B, H, N, D_k]`` keys, value
               coefficients of the memory / momentum / chunk-start memory); else None.
    """

    weights: Optional[Weights]
    anchor: Optional[Weights]
    momentum: Optional[Weights]
    dual: Optional[Weights]
    position: int
    hist_k: torch.Tensor
    hist_v: torch.Tensor
    hist_gamma: torch.Tensor
    hist_delta: Optional[torch.Tensor]
    chunk_alpha: Optional[torch.Tensor]
    chunk_lr: torch.Tensor
    bank_k: Optional[torch.Tensor] = None
    bank_u: Optional[torch.Tensor] = None
    bank_s: Optional[torch.Tensor] = None
    anchor_u: Optional[torch.Tensor] = None

    def detach(self) -> "MemoryState":
        """A copy cut from the autograd graph (truncated back-propagation between calls)."""
        def cut(x):
            if isinstance(x, torch.Tensor):
                return x.detach()
            if isinstance(x, dict):
                return {k: v.detach() for k, v in x.items()}
            return x
        return dataclasses.replace(self, **{f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)})


@dataclass
class Gates:
    """Gates of one call in ``[B, T, H]`` (``[B, T, H, D_k]`` for channel-wise α); None = not used."""

    lr: torch.Tensor
    retention: Optional[torch.Tensor]
    momentum: Optional[torch.Tensor]
    window: torch.Tensor
    delta: Optional[torch.Tensor]


def keep_last(x: Optional[torch.Tensor], n: Optional[int]) -> Optional[torch.Tensor]:
    """The last ``n`` entries along dim 1 (all when n is None)."""
    if x is None or n is None:
        return x
    return x[:, max(0, x.shape[1] - n):]


def with_history(state: "MemoryState", k: torch.Tensor, v: torch.Tensor, gates: "Gates"):
    """The call's k, v, γ (and δ) preceded by the window tokens the state still carries: ``[B, h + T, H, ...]``
    (the call's own tensors, not copies, when the state carries none)."""
    def ext(hist, x):
        return x if hist.shape[1] == 0 else torch.cat([hist, x], 1)
    return (ext(state.hist_k, k), ext(state.hist_v, v), ext(state.hist_gamma, gates.window),
            ext(state.hist_delta, gates.delta) if gates.delta is not None else None)


def keep_history(state: "MemoryState", window_history: Optional[int], k_ext, v_ext, g_ext, d_ext) -> None:
    """Store the last c − 1 (``window_history``; None = all) tokens of :func:`with_history`'s tensors in ``state``."""
    state.hist_k, state.hist_v, state.hist_gamma = (keep_last(z, window_history) for z in (k_ext, v_ext, g_ext))
    state.hist_delta = keep_last(d_ext, window_history)


def split_time(sizes, q, k, v, gates: "Gates"):
    """Cut a call into pieces along time: ``[(q_i, k_i, v_i, gates_i)]`` with ``T_i = sizes[i]``.

    ``torch.split`` keeps the backward linear in T (slicing one piece at a time would allocate a zero
    gradient of the whole sequence per piece: quadratic time and memory).
    """
    def cut(x):
        return [None] * len(sizes) if x is None else list(torch.split(x, sizes, dim=1))

    fields = [f.name for f in dataclasses.fields(Gates)]
    gate_parts = {f: cut(getattr(gates, f)) for f in fields}
    return [(qi, ki, vi, Gates(**{f: gate_parts[f][i] for f in fields}))
            for i, (qi, ki, vi) in enumerate(zip(cut(q), cut(k), cut(v)))]


def normalise_gates(gates: Optional[Mapping[str, torch.Tensor]], parts, q: torch.Tensor) -> Gates:
    """Check the gate mapping against the spec and fill the constants of absent gates.

    η = ``inner_optimizer.lr`` × the ``lr`` gate; θ = the ``momentum`` gate or ``inner_optimizer.momentum``;
    γ = the ``window`` gate or 1; δ = the ``delta`` gate or the bias's constant; α stays None when absent.
    """
    gates = dict(gates or {})
    unknown = [g for g in gates if g not in GATE_NAMES]
    if unknown:
        raise ValueError(f"gates: unknown gate '{unknown[0]}'; valid gates: {', '.join(GATE_NAMES)}")
    B, T, H, D = q.shape
    opt, ret, bias = parts.inner_optimizer, parts.retention, parts.attentional_bias

    def take(name, shape, used, why):
        g = gates.get(name)
        if g is None:
            return None
        if not used:
            raise ValueError(f"gates.{name}: given, but {why}")
        if tuple(g.shape) != shape:
            raise ValueError(f"gates.{name}: expected shape {list(shape)}, got {list(g.shape)}")
        return g.to(q.dtype)

    ones = torch.ones(B, T, H, dtype=q.dtype, device=q.device)
    lr = take("lr", (B, T, H), True, "")
    lr = opt.cfg.lr * (lr if lr is not None else ones)
    alpha_shape = (B, T, H, parts.key_dim) if ret.channel_wise else (B, T, H)
    alpha = take("retention", alpha_shape, ret.uses_alpha, f"retention '{ret.cfg.name}' has no α gate")
    theta = take("momentum", (B, T, H), opt.has_momentum,
                 f"inner optimizer '{opt.cfg.name}' keeps no momentum")
    if theta is None and opt.has_momentum:
        theta = opt.cfg.momentum * ones
    gamma = take("window", (B, T, H), True, "")
    delta = take("delta", (B, T, H), bias.uses_delta, f"attentional bias '{bias.cfg.name}' has no δ gate")
    if delta is None and bias.uses_delta:
        delta = bias.cfg.delta * ones
    return Gates(lr=lr, retention=alpha, momentum=theta, window=gamma if gamma is not None else ones, delta=delta)


@dataclass
class WindowProblem:
    """The inner regression of one step: window tokens and how to differentiate their loss.

    ``x: [B, H, n, d_k]`` (featurised keys), ``v: [B, H, n, d_v]``, ``gamma: [B, H, n]``;
    ``grad(W)`` returns Σ_i γ_i ∇_W ℓ(W; x_i, v_i) as a dict shaped like W.
    """

    x: torch.Tensor
    v: torch.Tensor
    gamma: torch.Tensor
    grad: Callable[[Weights], Weights]
