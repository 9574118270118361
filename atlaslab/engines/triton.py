"""The Triton engine, ``memorize(mode="triton")``: for a memory spec it picks the Triton kernel that computes it
exactly (:mod:`atlaslab.kernels`), maps the spec's parts and the :class:`MemoryState` onto the kernel's tensors and
back, and falls back to the torch ``chunked`` engine where no kernel takes the call.

The kernels take tensors and return tensors; everything that knows of memories lives here: the spec checks that
say why a kernel does not apply (:func:`explain`), the selection (:func:`select_kernel`, :func:`select_mlp_step`),
the engines over the kernels (``MODES`` signature), packed sequences in one kernel call, and the state updates
(docs/engines.md#triton; the kernels themselves: docs/kernels.md).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from atlaslab.engines import chunked
from atlaslab.engines import packed
from atlaslab.engines.chunked import memorize_chunked
from atlaslab.kernels.utils import (AFTER_STEP, FORCE_TORCH_ENV, KERNEL_BIASES, MAX_D, READS, available, device_ok,
                                    forced_torch, interpreting, triton_importable, with_torch_fallback)
from atlaslab.memory.state import keep_history, split_time, with_history

#: T at or below which ``auto`` picks the token-by-token kernel (fla switches to fused_recurrent at ≤ 64).
RECURRENT_MAX_T = 64
#: T at or below which ``auto`` runs a momentum call that starts mid-chunk wholly on the token-by-token kernel
MOMENTUM_MID_CHUNK_MAX_T = 128


def spec_reason(parts, chunk_size: int) -> Optional[str]:
    """None when the linear delta kernels compute ``parts`` exactly, else the first reason they do not."""
    s = parts.spec
    if s.inner_optimizer.name == "momentum":      # the momentum kernels; the token-by-token one takes the most specs
        return fused_recurrent_momentum_reason(parts, chunk_size)
    from atlaslab.kernels.window_rule.naive import MAX_WINDOW
    checks = [
        (s.memory.name == "linear", f"memory '{s.memory.name}' (kernels: linear)"),
        (not parts.kernel_trick, "the exp kernel trick"),
        (s.attentional_bias.name in KERNEL_BIASES,
         f"attentional bias '{s.attentional_bias.name}' ({', '.join(KERNEL_BIASES)})"),
        (s.inner_optimizer.name == "gd", f"inner optimizer '{s.inner_optimizer.name}' (gd)"),
        (s.retention.name in ("none", "decay"), f"retention '{s.retention.name}' (none, decay)"),
        (parts.window.size is not None and parts.window.size <= MAX_WINDOW,
         f"window size {parts.window.size} (c ≤ {MAX_WINDOW})"),
        (chunk_size == 1, f"chunk_size b = {chunk_size} (b = 1)"),
        (parts.read in READS, f"read '{parts.read}'"),
        (max(parts.feature_map.out_dim, parts.value_dim) <= MAX_D, f"head dims > {MAX_D}"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    return None


def explain(parts, q: torch.Tensor, chunk_size: int) -> Optional[str]:
    """None when a Triton kernel will run for this call, else why the torch path is taken."""
    if forced_torch():
        return f"{FORCE_TORCH_ENV} is set"
    if not triton_importable():
        return "triton is not installed"
    if not available():
        return "no CUDA device and TRITON_INTERPRET is not 1"
    return device_ok(q) or spec_reason(parts, chunk_size)


def _linear_kernels(kind: str, block_size: int):
    """The delta-rule kernel ``kind`` (``chunk`` or ``fused_recurrent``), its Omega-window twin, and their extra
    options (the chunk kernels' compute block)."""
    if kind == "chunk":
        from atlaslab.kernels.delta_rule.chunk import chunk_delta_rule as kernel
        from atlaslab.kernels.window_rule.chunk import chunk_window_rule as window_kernel
        return kernel, window_kernel, dict(chunk_size=min(64, max(16, int(block_size))))
    from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule as kernel
    from atlaslab.kernels.window_rule.fused_recurrent import fused_recurrent_window_rule as window_kernel
    return kernel, window_kernel, {}


def _decay(parts, gates):
    """``(alpha, placement)`` for a kernel: the retention gate α ``[B, T, H(, D_k)]`` when the retention uses one
    (else None), and its placement (``after_step`` without α: the kernels then ignore it)."""
    ret = parts.retention
    alpha = gates.retention if (ret.uses_alpha and gates.retention is not None) else None
    return alpha, (ret.placement if alpha is not None else AFTER_STEP)


def _engine(kind: str) -> Callable:
    """A ``MODES``-style engine over the kernel ``kind`` (``fused_recurrent`` or ``chunk``)."""

    def run(q, k, v, parts, gates, chunk_size, state, block_size: int = 64, **engine_options):
        # engine_options (e.g. ``checkpoint``) concern the torch engines; the kernels recompute in backward anyway
        kernel, window_kernel, extra = _linear_kernels(kind, block_size)
        state = dataclasses.replace(state)
        alpha, placement = _decay(parts, gates)
        fm = parts.feature_map
        opts = dict(bias=parts.spec.attentional_bias.name, placement=placement, read=parts.read, **extra)
        c = parts.window.size
        if c == 1:
            beta = gates.lr * gates.window            # c = 1: the window gate scales the step
            o, W = kernel(fm(q), fm(k), v, beta, alpha, state.weights["W"], **opts)
        else:   # Omega window: every token's c slots; the window's first tokens come from the state's history
            from atlaslab.kernels.window_rule.naive import window_slots
            h = state.hist_k.shape[1]
            x_ext = fm(torch.cat([state.hist_k, k], 1))
            xs, vs, gs = window_slots(x_ext[:, h:], v, gates.window, c, x_ext[:, :h], state.hist_v, state.hist_gamma)
            o, W = window_kernel(fm(q), xs, vs, gates.lr.unsqueeze(2) * gs, alpha, state.weights["W"], **opts)
        state.weights = {"W": W}
        state.anchor = state.weights              # b = 1: the anchor is refreshed at every token
        keep_history(state, parts.window.history(), *with_history(state, k, v, gates))
        if gates.retention is not None:
            state.chunk_alpha = gates.retention[:, -1]
        state.position += q.shape[1]
        return o, state

    run.__name__ = f"memorize_triton_{kind}"
    run.kernel = kind
    return run


# ------------------------------------------------------------------------------------------ momentum engines

def linear_momentum_reason(parts, channel_wise_ok: bool = False) -> Optional[str]:
    """None when ``parts`` is a spec the momentum kernels (:mod:`atlaslab.kernels.momentum`: the chunk kernel and the
    token-by-token one) compute exactly, semantic chunk aside, else the first reason they do not:
    linear memory, ℓ2 or dot bias, momentum GD, no retention, per-head scalar decay or (``channel_wise_ok``, which
    both kernels now pass) channel-wise decay, either placement, Omega window c = 1, read token or chunk,
    head dims ≤ MAX_D."""
    s, ret = parts.spec, parts.retention
    bias = s.attentional_bias.name
    checks = [
        (s.memory.name == "linear", f"memory '{s.memory.name}' (momentum kernels: linear)"),
        (not parts.kernel_trick, "the exp kernel trick"),
        (bias in KERNEL_BIASES, f"attentional bias '{bias}' (momentum kernels: {', '.join(KERNEL_BIASES)})"),
        (s.inner_optimizer.name == "momentum", f"inner optimizer '{s.inner_optimizer.name}' (momentum)"),
        (s.retention.name in ("none", "decay"), f"retention '{s.retention.name}' (none, decay)"),
        (channel_wise_ok or not getattr(ret, "channel_wise", False),
         "channel-wise decay (momentum chunk kernel: per-head scalar)"),
        (parts.window.size == 1, f"window size {parts.window.size} (c = 1)"),
        (parts.read in READS, f"read '{parts.read}'"),
        (max(parts.feature_map.out_dim, parts.value_dim) <= MAX_D, f"head dims > {MAX_D}"),
    ]
    return next((why for ok, why in checks if not ok), None)


def chunk_momentum_reason(parts, chunk_size: int) -> Optional[str]:
    """None when the momentum chunk kernel computes ``parts`` at semantic chunk ``chunk_size`` exactly, else why not:
    :func:`linear_momentum_reason` with channel-wise decay allowed, and 2 ≤ b ≤ MAX_CHUNK (before_step with the ℓ2
    bias takes the gradients at P_s M_a, channel-wise at M_a Diag(P_s)); channel-wise decay only at b ≤
    MAX_CHANNEL_CHUNK (sm_90 shared memory; the token kernel takes larger b)."""
    from atlaslab.kernels.momentum.chunk import MAX_CHANNEL_CHUNK, MAX_CHUNK
    if not 2 <= chunk_size <= MAX_CHUNK:
        return f"chunk_size b = {chunk_size} (momentum chunk kernel: 2 ≤ b ≤ {MAX_CHUNK})"
    why = linear_momentum_reason(parts, channel_wise_ok=True)
    if why is None and getattr(parts.retention, "channel_wise", False) and chunk_size > MAX_CHANNEL_CHUNK:
        why = (f"chunk_size b = {chunk_size} with channel-wise decay (momentum chunk kernel: b ≤ {MAX_CHANNEL_CHUNK}, "
               f"sm_90 shared memory)")
    return why


def memorize_chunk_momentum(q, k, v, parts, gates, chunk_size, state, block_size: int = 64, **engine_options):
    """``MODES``-signature engine: ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` → ``([B, T, H, D_v], state)``.

    Updates weights, momentum, anchor, ``chunk_alpha`` (Π α over the last chunk), ``chunk_lr``, the (empty, c = 1)
    window history and ``position`` exactly as the torch engines. A call that starts mid-chunk runs its first
    piece (up to the next chunk boundary) on the torch ``chunked`` engine (``engine_options`` go there), then the
    kernels. ``block_size`` is unused (the kernels' block is the semantic chunk b).
    """
    from atlaslab.kernels.momentum.chunk import chunk_momentum
    b, T = int(chunk_size), q.shape[1]
    if T == 0:
        return memorize_chunked(q, k, v, parts, gates, b, state, block_size=block_size, **engine_options)
    outputs = []
    if state.position % b:
        n0 = min(T, b - state.position % b)
        (q0, k0, v0, g0), (q, k, v, gates) = split_time([n0, T - n0], q, k, v, gates)
        y, state = memorize_chunked(q0, k0, v0, parts, g0, b, state, block_size=block_size, **engine_options)
        outputs.append(y)
        if q.shape[1] == 0:
            return y, state
    state = dataclasses.replace(state)
    T = q.shape[1]
    fm = parts.feature_map
    alpha, placement = _decay(parts, gates)
    beta = gates.lr * gates.window                    # c = 1: the window gate scales the step
    o, M, S, anchor = chunk_momentum(fm(q), fm(k), v, beta, gates.momentum, alpha, state.weights["W"],
                                     state.momentum["W"], chunk_size=b, bias=parts.spec.attentional_bias.name,
                                     read=parts.read, placement=placement)
    state.weights, state.momentum, state.anchor = {"W": M}, {"W": S}, {"W": anchor}
    last = T - (-(-T // b) - 1) * b                  # real tokens of the last chunk
    if alpha is not None:
        state.chunk_alpha = alpha[:, T - last:].prod(1)
    else:
        state.chunk_alpha = torch.ones_like(state.chunk_alpha)
    state.chunk_lr = torch.zeros_like(state.chunk_lr)
    keep_history(state, parts.window.history(), *with_history(state, k, v, gates))
    state.position += T
    outputs.append(o)
    return torch.cat(outputs, 1), state


memorize_chunk_momentum.kernel = "chunk_momentum"


def fused_recurrent_momentum_reason(parts, chunk_size: int) -> Optional[str]:
    """None when the token-by-token momentum kernel computes ``parts`` at semantic chunk ``chunk_size`` exactly, else
    why not: :func:`linear_momentum_reason` with channel-wise decay allowed, at any b ≥ 1."""
    if chunk_size < 1:
        return f"chunk_size b = {chunk_size} (b ≥ 1)"
    return linear_momentum_reason(parts, channel_wise_ok=True)


def memorize_fused_recurrent_momentum(q, k, v, parts, gates, chunk_size, state, block_size: int = 64,
                                      **engine_options):
    """``MODES``-signature engine: ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` → ``([B, T, H, D_v], state)``.

    Continues from ``state`` at any position (mid-chunk included) and updates weights, momentum, anchor,
    ``chunk_alpha`` (Π α over the current chunk so far), ``chunk_lr`` (zero: momentum GD keeps no Σ η), the (empty,
    c = 1) window history and ``position`` exactly as ``memorize_recurrent``. ``block_size`` and ``engine_options``
    concern the torch engines (a T = 0 call goes to ``chunked`` with them).
    """
    from atlaslab.kernels.momentum.fused_recurrent import fused_recurrent_momentum

    b, T = int(chunk_size), q.shape[1]
    if T == 0:
        return memorize_chunked(q, k, v, parts, gates, b, state, block_size=block_size, **engine_options)
    state = dataclasses.replace(state)
    fm = parts.feature_map
    alpha, placement = _decay(parts, gates)
    beta = gates.lr * gates.window                    # c = 1: the window gate scales the step
    W = state.weights["W"]
    anchor = state.anchor["W"] if state.anchor is not None else W
    o, M, S, A, P = fused_recurrent_momentum(fm(q), fm(k), v, beta, gates.momentum, alpha, W, state.momentum["W"],
                                             anchor, state.chunk_alpha, position=state.position, chunk_size=b,
                                             bias=parts.spec.attentional_bias.name, placement=placement,
                                             read=parts.read)
    state.weights, state.momentum, state.anchor = {"W": M}, {"W": S}, {"W": A}
    state.chunk_alpha = P if alpha is not None else torch.ones_like(state.chunk_alpha)
    state.chunk_lr = torch.zeros_like(state.chunk_lr)
    keep_history(state, parts.window.history(), *with_history(state, k, v, gates))
    state.position += T
    return o, state


memorize_fused_recurrent_momentum.kernel = "fused_recurrent_momentum"


# ------------------------------------------------------------------------------------------ deep-memory chunk step

def mlp_reason(parts) -> Optional[str]:
    """None when :func:`mlp_dual_step` computes ``parts``' chunk step exactly, else the first reason it does not.

    Memory ``mlp`` of depth 2, residual on or off, no LayerNorm, σ gelu / silu / relu, ℓ2 or dot bias, GD or
    momentum, D_in, D_out ≤ 256. The feature map (polynomial, Taylor φ*, …) is applied in torch before the step, and
    the window (any c), scalar decay after the step or no retention, the gates and the read are the caller's
    (``chunked._dual_aligned`` already requires the dual form: GD / momentum, after-step scalar decay).
    """
    from atlaslab.kernels.mlp.naive import ACTIVATIONS
    s = parts.spec
    cfg = getattr(parts.memory, "cfg", None)
    ret = parts.retention
    checks = [
        (s.memory.name == "mlp", f"memory '{s.memory.name}' (mlp)"),
        (getattr(cfg, "depth", None) == 2, f"depth {getattr(cfg, 'depth', None)} (2)"),
        (not getattr(cfg, "layer_norm", True), "layer norm on (off)"),
        (getattr(cfg, "activation", None) in ACTIVATIONS,
         f"activation '{getattr(cfg, 'activation', None)}' ({', '.join(ACTIVATIONS)})"),
        (s.attentional_bias.name in KERNEL_BIASES,
         f"attentional bias '{s.attentional_bias.name}' ({', '.join(KERNEL_BIASES)})"),
        (s.inner_optimizer.name in ("gd", "momentum"), f"inner optimizer '{s.inner_optimizer.name}' (gd, momentum)"),
        (not ret.mirror and not ret.projects and not ret.channel_wise,
         "mirror-map, projecting or channel-wise retention"),
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
    kernels do not take (:func:`atlaslab.kernels.mlp.chunk.supports_shapes`) run ``chunked._dual_step`` instead.
    """
    from atlaslab.kernels.mlp.chunk import supports_shapes

    def torch_path():
        return chunked._dual_step(parts, weights, momentum, x, v, d, P_e, Q_e, A_e, Th_e, S_e)
    if supports_shapes(x, weights["W1"], v) is not None:
        return torch_path()
    return with_torch_fallback(lambda: _mlp_dual_step_kernels(parts, weights, momentum, x, v, P_e, Q_e, A_e, Th_e, S_e),
                               torch_path, "mlp chunk step")


def _mlp_dual_step_kernels(parts, weights, momentum, x, v, P_e, Q_e, A_e, Th_e, S_e):
    """:func:`mlp_dual_step` on the kernels (shapes already checked)."""
    from atlaslab.kernels.mlp.chunk import mlp_chunk_step
    mom = S_e is not None
    cfg = parts.memory.cfg
    d1, d2, a, W1_e, W2_e, S1_e, S2_e = mlp_chunk_step(
        x, v, weights["W1"], weights["W2"], momentum["W1"] if mom else None, momentum["W2"] if mom else None,
        P_e, Q_e if mom else None, A_e, Th_e if mom else None, S_e, activation=cfg.activation,
        residual=cfg.residual, bias=parts.spec.attentional_bias.name)
    factors = {"W1": (d1, x), "W2": (d2, a)}
    new_momentum = {"W1": S1_e, "W2": S2_e} if mom else momentum
    return factors, {"W1": W1_e, "W2": W2_e}, new_momentum


ENGINES = {"fused_recurrent": _engine("fused_recurrent"), "chunk": _engine("chunk"),
           "chunk_momentum": memorize_chunk_momentum, "fused_recurrent_momentum": memorize_fused_recurrent_momentum}
_MODE_ALIASES = {"auto": "auto", "triton": "auto", "chunk": "chunk", "chunked": "chunk",
                 "fused_recurrent": "fused_recurrent", "recurrent": "fused_recurrent"}


def select_kernel(parts, q: torch.Tensor, chunk_size: int, mode: str = "auto",
                  position: int = 0) -> Optional[Callable]:
    """The Triton engine for this (device, dtype, spec), or None when the torch path must be used.

    Args:
        parts: the built :class:`MemoryParts`.
        q: ``[B, T, H, D_k]`` queries (their device, dtype and T decide).
        chunk_size: the semantic chunk b of the call.
        mode: ``auto`` / ``triton`` (token-by-token kernel for T ≤ 64, chunk kernel above), ``chunk`` /
            ``chunked``, or ``fused_recurrent`` / ``recurrent``. A momentum spec: ``fused_recurrent`` selects
            ``fused_recurrent_momentum``, ``chunk`` selects ``chunk_momentum`` (None where it does not take the
            spec), ``auto`` the token kernel for T ≤ ``RECURRENT_MAX_T``, for T ≤ ``MOMENTUM_MID_CHUNK_MAX_T`` when
            the call starts mid-chunk, and where the chunk kernel does not take the spec, else the chunk kernel.
        position: the state's position before the call (``MemoryState.position``; only the momentum dispatch
            reads it: position mod b ≠ 0 is a call that starts mid-chunk).

    Returns:
        A function with the ``MODES`` engine signature ``(q, k, v, parts, gates, chunk_size, state, block_size)``
        (its ``.kernel`` names the kernel), or None.
    """
    if mode not in _MODE_ALIASES:
        raise ValueError(f"select_kernel: unknown mode '{mode}'; valid: {', '.join(_MODE_ALIASES)}")
    if explain(parts, q, chunk_size) is not None:
        return None
    kind = _MODE_ALIASES[mode]
    if parts.spec.inner_optimizer.name == "momentum":
        chunk_ok = chunk_momentum_reason(parts, chunk_size) is None
        T = q.shape[1]
        if kind == "chunk":
            return ENGINES["chunk_momentum"] if chunk_ok else None
        short = T <= RECURRENT_MAX_T or (position % chunk_size != 0 and T <= MOMENTUM_MID_CHUNK_MAX_T)
        return ENGINES["chunk_momentum"] if (kind == "auto" and chunk_ok and not short) \
            else ENGINES["fused_recurrent_momentum"]
    if kind == "auto":
        kind = "fused_recurrent" if q.shape[1] <= RECURRENT_MAX_T else "chunk"
    return ENGINES[kind]


def memorize_triton(q, k, v, parts, gates, chunk_size, state, block_size: int = 64, **engine_options):
    """``memorize(mode="triton")``: a Triton kernel when :func:`select_kernel` finds one, else ``chunked``.

    ``engine_options`` (such as ``checkpoint``) are passed on to the ``chunked`` fallback, which runs its deep-
    memory dual-form chunks with the fused Triton step where :func:`select_mlp_step` finds one.
    """
    engine = select_kernel(parts, q, chunk_size, "auto", position=state.position)

    def chunked():
        return memorize_chunked(q, k, v, parts, gates, chunk_size, state, block_size=block_size,
                                dual_step=select_mlp_step(parts, q), **engine_options)
    if engine is None:
        return chunked()
    return with_torch_fallback(lambda: engine(q, k, v, parts, gates, chunk_size, state, block_size=block_size),
                               chunked, f"memorize(mode='triton') {engine.kernel} forward")


def _packed_kernel_kind(parts, q, chunk_size: int, states) -> Optional[str]:
    """The kernel that runs a packed call natively (``cu_seqlens``), or None (the caller loops over sequences).

    c = 1 chunk / token kernels: always (b = 1 specs need no position). Omega windows c > 1: only when no
    sequence carries a window history yet (the slots are gathered per packed sequence from its own tokens).
    Momentum: the chunk kernel, for specs it takes, when every sequence starts on a chunk boundary and the call
    is long enough for ``auto`` to choose it (otherwise each sequence picks its own kernel).
    """
    if explain(parts, q, chunk_size) is not None:
        return None
    T = q.shape[1]
    if parts.spec.inner_optimizer.name == "momentum":
        on_boundary = all(s.position % chunk_size == 0 for s in states)
        return "chunk_momentum" if (chunk_momentum_reason(parts, chunk_size) is None and on_boundary
                                    and T > RECURRENT_MAX_T) else None
    if parts.window.size != 1 and any(s.hist_k.shape[1] for s in states):
        return None
    return "fused_recurrent" if T <= RECURRENT_MAX_T else "chunk"


def _finish_sequences(parts, states, offsets, k, v, gates, weights, momentum=None, anchor=None,
                      chunk_alpha=None):
    """The N per-sequence final states of a native packed call: ``weights`` (and ``momentum`` / ``anchor``)
    ``[N, H, D_v, D_k]`` from the kernel, each sequence's window history and Π α, its position advanced."""
    sizes = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    finals = []
    pieces = split_time(sizes, k, k, v, gates)        # (split_time cuts q, k, v: k stands in for the unused q)
    for i, ((_, ki, vi, gi), state) in enumerate(zip(pieces, states)):
        state = dataclasses.replace(state)
        state.weights = {"W": weights[i:i + 1]}
        state.anchor = {"W": anchor[i:i + 1]} if anchor is not None else state.weights
        if momentum is not None:
            state.momentum = {"W": momentum[i:i + 1]}
            state.chunk_lr = torch.zeros_like(state.chunk_lr)
        if chunk_alpha is not None:
            state.chunk_alpha = chunk_alpha[i:i + 1]
        elif gates.retention is not None:
            state.chunk_alpha = gi.retention[:, -1]
        keep_history(state, parts.window.history(), *with_history(state, ki, vi, gi))
        state.position += sizes[i]
        finals.append(state)
    return finals


def _run_packed(kind: str, q, k, v, parts, gates, chunk_size: int, states, offsets, block_size: int):
    """Run one packed call on the ``kind`` kernel with ``cu_seqlens`` → ``(o, N final states)``."""
    cu = torch.tensor(offsets, device=q.device, dtype=torch.long)
    fm = parts.feature_map
    alpha, placement = _decay(parts, gates)
    bias = parts.spec.attentional_bias.name
    W0 = packed.stack_weights(states, "weights")
    if kind == "chunk_momentum":
        from atlaslab.kernels.momentum.chunk import chunk_momentum
        b = int(chunk_size)
        o, M, S, anchor = chunk_momentum(fm(q), fm(k), v, gates.lr * gates.window, gates.momentum, alpha, W0,
                                         packed.stack_weights(states, "momentum"), chunk_size=b, bias=bias,
                                         read=parts.read, placement=placement, cu_seqlens=cu)
        chunk_alpha = None
        if alpha is not None:   # Π α over each sequence's last (possibly partial) chunk
            chunk_alpha = torch.cat([alpha[:, offsets[i + 1] - ((offsets[i + 1] - offsets[i] - 1) % b + 1):
                                              offsets[i + 1]].prod(1) for i in range(len(offsets) - 1)], 0)
        else:
            chunk_alpha = torch.cat([torch.ones_like(s.chunk_alpha) for s in states], 0)
        return o, _finish_sequences(parts, states, offsets, k, v, gates, M, S, anchor, chunk_alpha)
    kernel, window_kernel, extra = _linear_kernels(kind, block_size)
    opts = dict(bias=bias, placement=placement, read=parts.read, cu_seqlens=cu, **extra)
    c = parts.window.size
    if c == 1:
        o, W = kernel(fm(q), fm(k), v, gates.lr * gates.window, alpha, W0, **opts)
    else:
        from atlaslab.kernels.window_rule.naive import window_slots
        xs, vs, gs = window_slots(fm(k), v, gates.window, c, cu_seqlens=cu)
        o, W = window_kernel(fm(q), xs, vs, gates.lr.unsqueeze(2) * gs, alpha, W0, **opts)
    return o, _finish_sequences(parts, states, offsets, k, v, gates, W)


def memorize_triton_packed(q, k, v, parts, gates, chunk_size, states, offsets, block_size: int = 64,
                           **engine_options):
    """``memorize(mode="triton", cu_seqlens=...)`` in one go (:mod:`atlaslab.engines.packed`): the packed sequences
    on one kernel with ``cu_seqlens`` (one launch per stage over all their chunks), or None when
    :func:`_packed_kernel_kind` finds no kernel that takes the call natively (then each sequence runs alone).

    ``q, k: [1, ΣT_i, H, D_k]``, ``v: [1, ΣT_i, H, D_v]``, ``states``: N batch-1 states, ``offsets``: the checked
    ``cu_seqlens`` → ``(o: [1, ΣT_i, H, D_v], N final states)``. A kernel that cannot launch on this GPU falls
    back to the per-sequence loop (:func:`atlaslab.kernels.utils.with_torch_fallback`).
    """
    kind = _packed_kernel_kind(parts, q, chunk_size, states)
    if kind is None:
        return None

    def per_sequence():
        return packed.memorize_packed(q, k, v, parts, gates, chunk_size, states, offsets, memorize_chunked,
                               block_size=block_size, **engine_options)
    return with_torch_fallback(
        lambda: _run_packed(kind, q, k, v, parts, gates, chunk_size, states, offsets, block_size),
        per_sequence, f"memorize(mode='triton', cu_seqlens) {kind} forward")


memorize_triton.packed = memorize_triton_packed


def select_mlp_step(parts, x: torch.Tensor) -> Optional[Callable]:
    """The Triton deep-memory chunk step (:func:`mlp_dual_step`, the contract of ``chunked._dual_step``)
    for ``parts`` on ``x``'s device and dtype (``x``: any of the call's inputs, e.g. ``[B, T, H, D]`` keys), or None.

    Chosen only when Triton runs here (:func:`available`, :func:`device_ok`, ``ATLASLAB_FORCE_TORCH`` unset) and the
    spec is one it computes (:func:`mlp_reason`: memory ``mlp`` of depth 2, residual on or off (off:
    D_in = the feature map's width may differ from D_out), no LayerNorm, activation gelu / silu / relu, ℓ2 or dot
    bias, GD or momentum, D_in, D_out ≤ 256; any Omega window, after-step scalar decay or none): the presets
    titans, omeganet, dla, swdt, deeptransformer and dot. Shapes beyond the kernels' limits fall back to
    ``_dual_step`` inside the returned step.
    """
    if forced_torch() or not available() or device_ok(x) is not None:
        return None
    return mlp_dual_step if mlp_reason(parts) is None else None


__all__ = ["FORCE_TORCH_ENV", "available", "chunk_momentum_reason", "device_ok", "explain", "forced_torch",
           "fused_recurrent_momentum_reason", "interpreting", "linear_momentum_reason", "memorize_chunk_momentum",
           "memorize_fused_recurrent_momentum", "memorize_triton", "memorize_triton_packed", "mlp_dual_step",
           "mlp_reason", "select_kernel", "select_mlp_step", "spec_reason", "triton_importable"]
