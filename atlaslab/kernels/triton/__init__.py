"""Triton kernels for the hot paths of ``memorize``, and the dispatch that chooses them (docs/engines.md#triton).

Kernels (each beside its plain-torch reference in :mod:`.reference` / :mod:`atlaslab.kernels.newton_schulz`):

- :func:`.newton_schulz.newton_schulz`: fused Newton–Schulz (Muon quintic) for batches of small matrices;
- :func:`.fused_recurrent.fused_recurrent_delta_rule`: token-by-token linear delta / Hebbian rule (decoding,
  ``cu_seqlens``);
- :func:`.chunk.chunk_delta_rule`: chunk-parallel forward and backward of the same rules (fla-style stages;
  the backward recomputes the chunk states, sweeps the chunks in reverse for dS, then forms dq, dk, dv, dβ,
  dα and the initial state's gradient per chunk in parallel), per-head or channel-wise (GLA-style) decay;
  ``cu_seqlens`` natively (one launch per stage over all chunks of all packed sequences, fla's chunk-index table);
- :func:`.chunk_momentum.chunk_momentum`: linear memory trained by momentum GD at semantic chunk size b > 1
  (Titans with a matrix memory), the TTT/Titans dual form per chunk, decay after or before the step, ``cu_seqlens``
  natively (one launch per stage over all chunks of all packed sequences); Triton forward and backward (the gates'
  gradients by autograd through the torch stage-1 coefficients, no memory-sized tensor);
- :func:`.fused_recurrent_momentum.fused_recurrent_momentum`: token-by-token linear memory + momentum GD at any
  semantic chunk b ≥ 1 (decoding with a cached state: M, S, the chunk-start anchor and Π α carried across calls);
  Triton forward and reverse-sweep backward (autograd through its torch token loop as the fallback);
- :func:`.mlp_chunk.mlp_chunk_step`: one chunk's step of the 2-layer MLP memory (residual or not, D_in ≠ D_out, ℓ2 or
  dot bias: Titans, OmegaNet, DLA, SWDT, DeepTransformer, DoT; the gradient factors δ1, δ2, a at the chunk-start
  anchor and the chunk-end weights and momenta, GD or momentum);
  :func:`select_mlp_step` returns its ``chunked._dual_step``-compatible form (:func:`.mlp_chunk.mlp_dual_step`).

Dispatch, in the spirit of fla's backend registry: a Triton kernel is used only when

1. :func:`available`: ``triton`` imports AND (CUDA is available OR ``TRITON_INTERPRET=1``), and
   ``ATLASLAB_FORCE_TORCH`` is not set (``ATLASLAB_FORCE_TORCH=1`` always forces the torch path);
2. the tensors' device and dtype suit it: CUDA tensors in fp32 / fp16 / bf16, or CPU tensors in fp32 / fp16
   while the interpreter is on (the interpreter's bf16 ``tl.dot`` is wrong; it is ~1000× slower than torch,
   so it is for tests only);
3. the spec is one the kernel computes exactly: linear memory (any non-kernel-trick feature map, applied in
   torch), ℓ2 or dot bias, GD, no retention, per-head scalar decay or channel-wise (per key channel, GLA-style)
   decay (either placement), Omega window c ≤ 8 (c > 1 with either decay too), semantic chunk b = 1,
   ``read`` token or chunk; head dims ≤ 256;
   or, for the momentum kernels (linear memory, ℓ2 or dot bias, inner optimizer momentum, no retention,
   per-head scalar or channel-wise decay, c = 1, read token or chunk): the token-by-token kernel
   (:func:`.fused_recurrent_momentum.spec_reason`: any b ≥ 1, either placement, channel-wise decay too;
   ``fused_recurrent``) and the chunk kernel (:func:`.chunk_momentum.spec_reason`: 2 ≤ b ≤ 64, channel-wise
   decay at b ≤ 32; ``chunk``). ``auto`` takes the token kernel for
   T ≤ ``RECURRENT_MAX_T``, for a call that starts mid-chunk (``state.position`` mod b ≠ 0) with
   T ≤ ``MOMENTUM_MID_CHUNK_MAX_T`` (decoding), and whenever the chunk kernel does not take the spec; otherwise the
   chunk kernel (a long call starting mid-chunk finishes that chunk on the torch ``chunked`` engine, then runs it).

:func:`select_kernel` returns an engine with the ``MODES`` signature or None; ``memorize(mode="triton")``
(:func:`memorize_triton`) uses it and falls back to the torch ``chunked`` engine. Nothing else changes: the
default ``memorize`` mode and every torch engine stay as they are.

Packed calls (``memorize(..., mode="triton", cu_seqlens=...)``, :mod:`atlaslab.engines.packed`):
:func:`memorize_triton_packed` runs all sequences in one kernel call with ``cu_seqlens`` where
:func:`_packed_kernel_kind` finds a kernel — the c = 1 chunk / token kernels always, the Omega-window kernels while
no sequence carries window history yet, the momentum chunk kernel when every sequence starts on a chunk boundary
and the call is long — and each sequence's final state is cut from the kernel's ``[N, …]`` states; otherwise every
sequence runs alone through :func:`memorize_triton` (``tests/test_memorize_packed.py``: one kernel call counted,
outputs, states and gradients against each sequence alone on the float64 reference).

Precision: every kernel keeps fp32 intermediates; the input precision of their fp32 ``tl.dot`` is
:func:`.precision.dot_precision` (TF32 for fp16 / bf16 inputs, torch's float32 matmul precision for fp32, IEEE for
fp64; ``allow_tf32`` forces either), because IEEE fp32 dots compile to CUDA-core FMA loops without tensor cores.

Status: every kernel is tested against its torch reference under the interpreter (``tests/test_triton*.py``);
none has yet run on a GPU. Every launch those tests make, and bench/kernels.py's cases at head dims 64 and 128,
compile for sm_90 (H100 / H200) on a CPU machine: ``python bench/compile_sm90.py`` reports registers, spills,
shared memory and tensor-core use per build (``bench/results/compile_sm90.md``). On a CUDA machine run
``bash bench/device/check.sh`` (``TRITON_INTERPRET=0 pytest tests/test_triton*.py``, the same tests on the device,
then ``python bench/kernels.py``, correctness-gated timings; bench/device/README.md). The chunk kernel's
backward runs on Triton backward kernels (``tests/test_triton_chunk_bwd.py``: every input gradient against the
float64 token loop, RMS-error ratio ~1e-7 in fp32 under the interpreter; channel-wise decay in
``tests/test_triton_channel.py``, the same bar); its torch recompute remains as the reference and the
``ATLASLAB_CHUNK_BACKWARD=torch`` fallback. Variable-length batches (``cu_seqlens``) run natively on the c = 1 chunk
kernels, forward and backward, scalar and channel-wise decay: one launch per stage for all packed sequences
(``tests/test_triton_varlen.py``: packed outputs, final states and every input gradient against each sequence run
alone through the float64 token loop, RMS-error ratio ~1e-7 in fp32 under the interpreter; launches counted), and
on the Omega-window chunk kernels (c > 1, ``chunk_window_rule(..., cu_seqlens=...)``, slots from
``reference.window_slots(..., cu_seqlens=...)``, which never reach across a sequence start;
``tests/test_triton_window_varlen.py``, the same bar against ``window_rule_recurrent`` per sequence, c = 2, 3;
interpreter only). The token-by-token kernel's backward runs on the same chunk backward
kernels. The Newton–Schulz kernel's backward is a Triton kernel (the forward saves the iterates X_0 … X_{k−1}; one
program per matrix walks the quintic's adjoints in reverse, then the normalisation's; ``tests/test_triton_ns.py``:
gradients against the float64 torch reference, square / wide / tall, steps 1 and 5, ``shape_factor``, RMS-error
ratio ~1e-6 in fp32 under the interpreter); ``ATLASLAB_NS_BACKWARD=torch`` falls back to autograd of the reference.
The momentum chunk kernel's backward runs on Triton backward kernels (reverse dM/dS sweep, per-chunk dq, dk, dv)
with torch only for the gates' coefficient gradients; ``ATLASLAB_MOMENTUM_BACKWARD=torch`` falls back to autograd
through its torch reference (``tests/test_triton_momentum.py``: outputs, final memory and momentum and every input
gradient against the float64 token loop at b = 4, 8, both placements, RMS-error ratio ~1e-7 in fp32 under the
interpreter; packed sequences in ``tests/test_triton_momentum_varlen.py``, launches counted).
The token-by-token momentum kernel's backward is one Triton reverse sweep over the tokens (from the pre-step states
a re-run of the forward kernel stores; the sums over D_v per value block, added in torch); the same
``ATLASLAB_MOMENTUM_BACKWARD=torch`` falls back to autograd through its torch token loop
(``tests/test_triton_momentum_recurrent.py``: outputs, final memory, momentum, anchor and Π α and every input
gradient against ``memorize(mode="recurrent")`` in float64 at b = 1, 4, both placements, ℓ2 and dot, read token
and chunk, per-head and channel-wise decay; decoding one token per call from the cached state equals one call;
RMS-error ratio ~2e-7 in fp32 under the interpreter).

Omega windows c > 1 (ATLAS Eq.9 with γ gates, b = 1; ``chunk_window_rule`` / ``fused_recurrent_window_rule``,
references ``reference.window_rule_recurrent`` / ``window_rule_chunk``): the engine gathers every token's c window
slots (key, value, coefficient η_t γ_j; the window's start from the state's history) in torch; the chunk kernel
solves the UT system over a chunk's BT·c slot rows with decays and masks at the slots' tokens, the token-by-token
kernel takes the c rank-1 terms of each step from the pre-step state. Both backwards run on the window backward
kernels (``chunk_window.window_chunk_backward``; the slots' gradients reach k, v, η, γ and the history through the torch
gather), per-head or channel-wise decay (the ``_win_cw_*`` kernels: pairwise per-channel decays with exponents ≤ 0,
so no overflow however fast a channel forgets), with autograd of the torch chunk form recomputed under
``ATLASLAB_CHUNK_BACKWARD=torch``. Both kernels take ``cu_seqlens`` (state and window restart at each sequence).
Tested under the interpreter only (``tests/test_triton_window.py``, ``tests/test_triton_window_varlen.py``:
outputs, final state and the gradients of q, k, v, η, γ, α and the initial state against
``memorize(mode="recurrent")`` / the float64 token loop, c = 2, 3, chained calls, channel-wise decay down to
α ≈ 0.05; RMS-error ratio ~1e-7 in fp32); never run on a GPU, so speed is unmeasured (register pressure of the
BT·c ≤ 128 slot rows per program: ``bench/results/compile_sm90.md``).

Deep-memory chunk step (``mlp_chunk.py``, issue 6): memory ``mlp`` (depth 2, residual or not, no LayerNorm, σ gelu /
silu / relu, D_in, D_out ≤ 256 — a polynomial φ of degree 2 fits head dims up to 21), ℓ2 or dot bias, GD or momentum
in the dual form. Two kernels (ℓ2: anchor errors e over hidden blocks; then per hidden block δ1 and the block's
chunk-end W1, W2, S1, S2; the dot bias needs only the second, e = −v); backward by autograd through its torch reference (first-order,
which is all the outer loss needs). :func:`select_mlp_step` returns the step when a kernel can run;
``memorize(mode="triton")`` passes it to the ``chunked`` fallback (``dual_step``), whose ``_dual_aligned`` then calls
it in place of ``_dual_step`` (``mode="chunked"`` stays pure torch). Tested under the interpreter only
(``tests/test_triton_mlp.py``: outputs and gradients vs the float64 reference, the step vs ``chunked._dual_step``, the
engine with the step, ``mode="triton"`` end to end); never run on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable, Optional

import torch

from atlaslab.engines.chunked import memorize_chunked
from atlaslab.memory.state import keep_history, with_history
from atlaslab.kernels.triton.fallback import with_torch_fallback

FORCE_TORCH_ENV = "ATLASLAB_FORCE_TORCH"
#: T at or below which ``auto`` picks the token-by-token kernel (fla switches to fused_recurrent at ≤ 64).
RECURRENT_MAX_T = 64
#: T at or below which ``auto`` runs a momentum call that starts mid-chunk wholly on the token-by-token kernel
MOMENTUM_MID_CHUNK_MAX_T = 128
MAX_HEAD_DIM = 256
MAX_WINDOW = 8              # the window kernels' largest Omega window c (= reference.MAX_WINDOW)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package imports."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:   # ImportError, or a broken install
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at decoration time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def forced_torch() -> bool:
    """True when ``ATLASLAB_FORCE_TORCH`` asks for the torch path (any value but empty / 0 / false / no)."""
    return os.environ.get(FORCE_TORCH_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def available() -> bool:
    """Triton kernels can run here: triton imports AND (CUDA is available OR the interpreter is on)."""
    return triton_importable() and (torch.cuda.is_available() or interpreting())


def device_ok(x: torch.Tensor) -> Optional[str]:
    """None when a kernel can run on ``x``'s device and dtype, else the reason it cannot."""
    if x.is_cuda:
        if x.dtype not in CUDA_DTYPES:
            return f"dtype {x.dtype} (CUDA kernels take {', '.join(map(str, CUDA_DTYPES))})"
        return None
    if x.device.type == "cpu" and interpreting():
        if x.dtype not in INTERPRETER_DTYPES:
            return f"dtype {x.dtype} under the interpreter (takes float32 / float16)"
        return None
    return f"device {x.device} (needs CUDA, or CPU with TRITON_INTERPRET=1)"


def spec_reason(parts, chunk_size: int) -> Optional[str]:
    """None when the linear delta kernels compute ``parts`` exactly, else the first reason they do not."""
    s = parts.spec
    if s.inner_optimizer.name == "momentum":      # the momentum kernels; the token-by-token one takes the most specs
        from atlaslab.kernels.triton.fused_recurrent_momentum import spec_reason as momentum_reason
        return momentum_reason(parts, chunk_size)
    checks = [
        (s.memory.name == "linear", f"memory '{s.memory.name}' (kernels: linear)"),
        (not parts.kernel_trick, "the exp kernel trick"),
        (s.attentional_bias.name in ("l2", "dot"), f"attentional bias '{s.attentional_bias.name}' (l2, dot)"),
        (s.inner_optimizer.name == "gd", f"inner optimizer '{s.inner_optimizer.name}' (gd)"),
        (s.retention.name in ("none", "decay"), f"retention '{s.retention.name}' (none, decay)"),
        (parts.window.size is not None and parts.window.size <= MAX_WINDOW,
         f"window size {parts.window.size} (c ≤ {MAX_WINDOW})"),
        (chunk_size == 1, f"chunk_size b = {chunk_size} (b = 1)"),
        (parts.read in ("token", "chunk"), f"read '{parts.read}'"),
        (max(parts.feature_map.out_dim, parts.value_dim) <= MAX_HEAD_DIM, f"head dims > {MAX_HEAD_DIM}"),
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


def _engine(kind: str) -> Callable:
    """A ``MODES``-style engine over the kernel ``kind`` (``fused_recurrent`` or ``chunk``)."""

    def run(q, k, v, parts, gates, chunk_size, state, block_size: int = 64, **engine_options):
        # engine_options (e.g. ``checkpoint``) concern the torch engines; the kernels recompute in backward anyway
        if kind == "chunk":
            from atlaslab.kernels.triton.chunk import chunk_delta_rule as kernel
            from atlaslab.kernels.triton.chunk_window import chunk_window_rule as window_kernel
            extra = dict(chunk_size=min(64, max(16, int(block_size))))
        else:
            from atlaslab.kernels.triton.fused_recurrent import (fused_recurrent_delta_rule as kernel,
                                                                 fused_recurrent_window_rule as window_kernel)
            extra = {}
        state = dataclasses.replace(state)
        ret = parts.retention
        alpha = gates.retention if (ret.uses_alpha and gates.retention is not None) else None
        placement = ret.placement if alpha is not None else "after_step"
        fm = parts.feature_map
        opts = dict(bias=parts.spec.attentional_bias.name, placement=placement, read=parts.read, **extra)
        c = parts.window.size
        if c == 1:
            beta = gates.lr * gates.window            # c = 1: the window gate scales the step
            o, W = kernel(fm(q), fm(k), v, beta, alpha, state.weights["W"], **opts)
        else:   # Omega window: every token's c slots; the window's first tokens come from the state's history
            from atlaslab.kernels.triton.reference import window_slots
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


def _momentum_engine(*args, **kwargs):
    """The momentum chunk kernel's engine (:func:`.chunk_momentum.memorize_chunk_momentum`), imported lazily."""
    from atlaslab.kernels.triton.chunk_momentum import memorize_chunk_momentum
    return memorize_chunk_momentum(*args, **kwargs)


def _momentum_recurrent_engine(*args, **kwargs):
    """The token-by-token momentum kernel's engine
    (:func:`.fused_recurrent_momentum.memorize_fused_recurrent_momentum`), imported lazily."""
    from atlaslab.kernels.triton.fused_recurrent_momentum import memorize_fused_recurrent_momentum
    return memorize_fused_recurrent_momentum(*args, **kwargs)


_momentum_engine.kernel = "chunk_momentum"
_momentum_recurrent_engine.kernel = "fused_recurrent_momentum"
ENGINES = {"fused_recurrent": _engine("fused_recurrent"), "chunk": _engine("chunk"),
           "chunk_momentum": _momentum_engine, "fused_recurrent_momentum": _momentum_recurrent_engine}
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
        from atlaslab.kernels.triton.chunk_momentum import spec_reason as chunk_reason
        chunk_ok = chunk_reason(parts, chunk_size) is None
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
        from atlaslab.kernels.triton.chunk_momentum import spec_reason as chunk_reason
        on_boundary = all(s.position % chunk_size == 0 for s in states)
        return "chunk_momentum" if (chunk_reason(parts, chunk_size) is None and on_boundary
                                    and T > RECURRENT_MAX_T) else None
    if parts.window.size != 1 and any(s.hist_k.shape[1] for s in states):
        return None
    return "fused_recurrent" if T <= RECURRENT_MAX_T else "chunk"


def _finish_sequences(parts, states, offsets, k, v, gates, weights, momentum=None, anchor=None,
                      chunk_alpha=None):
    """The N per-sequence final states of a native packed call: ``weights`` (and ``momentum`` / ``anchor``)
    ``[N, H, D_v, D_k]`` from the kernel, each sequence's window history and Π α, its position advanced."""
    from atlaslab.memory.state import split_time
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
    from atlaslab.engines import packed
    cu = torch.tensor(offsets, device=q.device, dtype=torch.long)
    fm, ret = parts.feature_map, parts.retention
    alpha = gates.retention if (ret.uses_alpha and gates.retention is not None) else None
    placement = ret.placement if alpha is not None else "after_step"
    bias = parts.spec.attentional_bias.name
    W0 = packed.stack_weights(states, "weights")
    if kind == "chunk_momentum":
        from atlaslab.kernels.triton.chunk_momentum import chunk_momentum
        b = int(chunk_size)
        o, M, S, anchor = chunk_momentum(fm(q), fm(k), v, gates.lr * gates.window, gates.momentum, alpha, W0,
                                         packed.stack_weights(states, "momentum"), chunk_size=b, bias=bias,
                                         read=parts.read, placement=ret.placement, cu_seqlens=cu)
        chunk_alpha = None
        if alpha is not None:   # Π α over each sequence's last (possibly partial) chunk
            chunk_alpha = torch.cat([alpha[:, offsets[i + 1] - ((offsets[i + 1] - offsets[i] - 1) % b + 1):
                                              offsets[i + 1]].prod(1) for i in range(len(offsets) - 1)], 0)
        else:
            chunk_alpha = torch.cat([torch.ones_like(s.chunk_alpha) for s in states], 0)
        return o, _finish_sequences(parts, states, offsets, k, v, gates, M, S, anchor, chunk_alpha)
    if kind == "chunk":
        from atlaslab.kernels.triton.chunk import chunk_delta_rule as kernel
        from atlaslab.kernels.triton.chunk_window import chunk_window_rule as window_kernel
        extra = dict(chunk_size=min(64, max(16, int(block_size))))
    else:
        from atlaslab.kernels.triton.fused_recurrent import (fused_recurrent_delta_rule as kernel,
                                                             fused_recurrent_window_rule as window_kernel)
        extra = {}
    opts = dict(bias=bias, placement=placement, read=parts.read, cu_seqlens=cu, **extra)
    c = parts.window.size
    if c == 1:
        o, W = kernel(fm(q), fm(k), v, gates.lr * gates.window, alpha, W0, **opts)
    else:
        from atlaslab.kernels.triton.reference import window_slots
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
    back to the per-sequence loop (:func:`.fallback.with_torch_fallback`).
    """
    kind = _packed_kernel_kind(parts, q, chunk_size, states)
    if kind is None:
        return None

    def per_sequence():
        from atlaslab.engines.packed import memorize_packed
        return memorize_packed(q, k, v, parts, gates, chunk_size, states, offsets, memorize_chunked,
                               block_size=block_size, **engine_options)
    return with_torch_fallback(
        lambda: _run_packed(kind, q, k, v, parts, gates, chunk_size, states, offsets, block_size),
        per_sequence, f"memorize(mode='triton', cu_seqlens) {kind} forward")


memorize_triton.packed = memorize_triton_packed


def select_newton_schulz(s: torch.Tensor) -> Optional[Callable]:
    """The fused Newton–Schulz kernel (``newton_schulz``-compatible) for ``s: [..., rows, cols]``, or None."""
    if forced_torch() or not available() or device_ok(s) is not None:
        return None
    from atlaslab.kernels.triton.newton_schulz import newton_schulz as kernel, supports
    return kernel if supports(s) else None


def orthogonalise(s: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=None,
                  shape_factor: bool = False) -> torch.Tensor:
    """Newton–Schulz on the fused kernel when :func:`select_newton_schulz` finds it, else the torch reference."""
    from atlaslab.kernels.newton_schulz import MUON_COEFFICIENTS, newton_schulz as torch_ns
    coefficients = MUON_COEFFICIENTS if coefficients is None else coefficients
    fn = select_newton_schulz(s) or torch_ns
    return fn(s, steps, eps, coefficients, shape_factor)


def select_mlp_step(parts, x: torch.Tensor) -> Optional[Callable]:
    """The Triton deep-memory chunk step (:func:`.mlp_chunk.mlp_dual_step`, the contract of ``chunked._dual_step``)
    for ``parts`` on ``x``'s device and dtype (``x``: any of the call's inputs, e.g. ``[B, T, H, D]`` keys), or None.

    Chosen only when Triton runs here (:func:`available`, :func:`device_ok`, ``ATLASLAB_FORCE_TORCH`` unset) and the
    spec is one it computes (:func:`.mlp_chunk.spec_reason`: memory ``mlp`` of depth 2, residual on or off (off:
    D_in = the feature map's width may differ from D_out), no LayerNorm, activation gelu / silu / relu, ℓ2 or dot
    bias, GD or momentum, D_in, D_out ≤ 256; any Omega window, after-step scalar decay or none): the presets
    titans, omeganet, dla, swdt, deeptransformer and dot. Shapes beyond the kernels' limits fall back to
    ``_dual_step`` inside the returned step.
    """
    if forced_torch() or not available() or device_ok(x) is not None:
        return None
    from atlaslab.kernels.triton.mlp_chunk import mlp_dual_step, spec_reason as mlp_reason
    return mlp_dual_step if mlp_reason(parts) is None else None


__all__ = ["FORCE_TORCH_ENV", "available", "explain", "forced_torch", "interpreting", "memorize_triton",
           "memorize_triton_packed",
           "orthogonalise", "select_kernel", "select_mlp_step", "select_newton_schulz", "spec_reason",
           "triton_importable"]
