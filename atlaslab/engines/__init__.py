"""How a memory layer is computed: the public ``memorize`` op and its engines.

``mode="recurrent"`` is the token-by-token reference of the spec's equations (``recurrent.py``); the
chunk-parallel torch engine and Triton kernels plug into :data:`MODES` and must agree with it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from atlaslab.engines.chunked import memorize_chunked
from atlaslab.kernels.newton_schulz import newton_schulz
from atlaslab.engines.packed import (CuSeqlens, check_cu_seqlens, memorize_packed, sequence_states, split_state,
                                     stack_states)
from atlaslab.engines import recurrent as _recurrent
from atlaslab.engines.recurrent import initial_state, memorize_recurrent, read_memory
from atlaslab.memory.spec import MemoryParts, build_memory
from atlaslab.memory.state import GATE_NAMES, Gates, MemoryState, normalise_gates
from atlaslab.engines.triton import memorize_triton

#: Engines that compute ``memorize``; each must match the ``recurrent`` reference.
MODES = {"recurrent": memorize_recurrent, "chunked": memorize_chunked,
         "triton": memorize_triton}   # opt-in Triton kernels; falls back to chunked (engines/triton.py)


def memorize(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: Any,
    gates: Optional[Mapping[str, torch.Tensor]] = None,
    mode: str = "recurrent",
    chunk_size: Optional[int] = None,
    initial_state: Optional[MemoryState] = None,
    block_size: Optional[int] = None,
    checkpoint: bool = False,
    cu_seqlens: Optional[CuSeqlens] = None,
    compile: bool = False,
) -> Tuple[torch.Tensor, Union[MemoryState, List[MemoryState]]]:
    """Run a memory over a sequence: write every (k_t, v_t), read every q_t.

    Args:
        q: ``[B, T, H, D_k]`` queries, already projected (and normalised if wanted); the spec's feature
            map φ is applied inside.
        k: ``[B, T, H, D_k]`` keys, projected and normalised like ``q``; φ is applied inside.
        v: ``[B, T, H, D_v]`` values.
        spec: a memory config (dict / DictConfig / :class:`MemorySpec`) or its built parts
            (:class:`MemoryParts`, which carry learnable pieces: polynomial coefficients, initial memory).
        gates: mapping with any of ``lr`` (η, ``[B, T, H]``), ``retention`` (α, ``[B, T, H]`` or
            ``[B, T, H, D_k]`` channel-wise), ``momentum`` (θ, ``[B, T, H]``), ``window`` (γ, ``[B, T, H]``),
            ``delta`` (Huber δ, ``[B, T, H]``). A missing gate is not used (its constant from the config).
        mode: engine, one of :data:`MODES`.
        chunk_size: the semantic training chunk b (default: the spec's); gradients of all tokens of a chunk
            are taken at the chunk-start state; b = 1 is exact online learning.
        initial_state: a previous call's state to continue from (default: the learned initial memory).
        block_size: the engine's compute block for the online (b = 1) linear rules in ``chunked`` mode (how
            many tokens are processed in parallel; it does not change the result beyond rounding, unlike
            ``chunk_size``). Default: the engine's own (``chunked``: the key dimension within [16, 32] for the linear
            rules' blocks, measured in ``bench/block_size.py``; ``triton``: 64).
        checkpoint: ``chunked`` only: recompute each chunk in the backward pass instead of storing its
            activations (memory ∝ number of chunks × state size, for long sequences).
        cu_seqlens: packed variable-length sequences (:mod:`.packed`, fla's convention): inputs ``[1, ΣT_i, …]``
            and ``[N + 1]`` offsets ``[0, T_0, T_0 + T_1, …, ΣT_i]`` (a list or an integer tensor). Each sequence
            is its own memory, exactly as if it ran alone: its own initial state, chunks counted from its first
            token, a window that never reaches into the previous sequence. ``initial_state`` is then None, a
            batch-N state, or the N batch-1 states a previous packed call returned. ``mode="triton"`` runs the
            packed sequences natively (one launch per kernel stage) where its kernels take the spec; every other
            case runs the sequences one after another through the engine.
        compile: ``chunked`` only: run the per-chunk work through ``torch.compile`` (:mod:`.compiled`; Inductor's
            C++ backend on a CPU, Triton on a GPU). Equal to eager up to rounding; the first call at each shape
            compiles.

    Returns:
        ``o: [B, T, H, D_v]`` and the final :class:`MemoryState` (``state.weights["W"]: [B, H, D_v, D_k]`` for a
        linear memory), so a second call continues where this one stopped. With ``cu_seqlens``: a list of N
        batch-1 states, one per sequence.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"memorize: expected q, k: [B, T, H, D_k] and v: [B, T, H, D_v]; got "
                         f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    B, T, H, Dk = q.shape
    parts = spec if isinstance(spec, MemoryParts) else build_memory(spec, H, Dk, v.shape[-1])
    if (parts.num_heads, parts.key_dim, parts.value_dim) != (H, Dk, v.shape[-1]):
        raise ValueError(f"memorize: parts were built for H={parts.num_heads}, D_k={parts.key_dim}, "
                         f"D_v={parts.value_dim}; inputs have H={H}, D_k={Dk}, D_v={v.shape[-1]}")
    if mode not in MODES:
        raise ValueError(f"memorize: unknown mode '{mode}'; valid modes: {', '.join(MODES)}")
    b = parts.chunk_size if chunk_size is None else int(chunk_size)
    if b < 1:
        raise ValueError(f"memorize: chunk_size must be ≥ 1, got {b}")
    options: Dict[str, Any] = {"checkpoint": checkpoint}
    if block_size is not None:
        options["block_size"] = int(block_size)
    if compile:
        if mode != "chunked" or checkpoint:
            raise ValueError(f"memorize: compile=True runs the chunked engine without checkpoint; got mode '{mode}'"
                             f"{' with checkpoint=True' if checkpoint else ''}")
        options["compile"] = True
    normalised = normalise_gates(gates, parts, q)
    if cu_seqlens is not None:
        offsets = check_cu_seqlens(cu_seqlens, B, T)
        states = sequence_states(initial_state, parts, len(offsets) - 1, q)
        return memorize_packed(q, k, v, parts, normalised, b, states, offsets, MODES[mode], **options)
    state = initial_state if initial_state is not None else _recurrent.initial_state(parts, B, q.dtype, q.device)
    return MODES[mode](q, k, v, parts, normalised, b, state, **options)


__all__ = ["GATE_NAMES", "Gates", "MODES", "MemoryState", "initial_state", "memorize", "newton_schulz", "read_memory",
           "split_state", "stack_states"]
