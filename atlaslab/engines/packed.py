"""Packed variable-length batches for ``memorize``: N sequences of different lengths in one ``[1, ΣT_i, …]`` call.

fla's convention (``cu_seqlens``): the sequences are concatenated along time and ``cu_seqlens = [0, T_0, T_0 + T_1,
…, ΣT_i]`` marks where each starts. Every sequence is its own memory: it starts from its own initial state (the
learned initial memory, or the state a previous call left for it), its training chunks are counted
from its own first token, its Omega window never reaches into the sequence before it, and it ends in its own final
state. So a packed call equals N separate calls, one per sequence — that is the definition, and the reference
implementation (:func:`memorize_packed` loops over the sequences with the chosen engine).

An engine may compute a packed call in one go: an engine function with a ``packed`` attribute (today
``memorize(mode="triton")``, whose Triton kernels take ``cu_seqlens`` natively: one launch per stage over the chunks
of all sequences) is asked first; it returns None when it cannot, and the loop runs instead.

States: a packed call takes and returns one :class:`~.state.MemoryState` of batch 1 per sequence (the sequences
may stand at different positions, which one batched state cannot express); :func:`split_state` cuts a batch-N
state (e.g. ``initial_state(parts, N, …)``) into such a list, and :func:`stack_states` stacks such a list back into
one batch-N state where that is exact (e.g. a packed prefill of N prompts, then batched decoding).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Sequence, Tuple, Union

import torch

from atlaslab.engines.recurrent import initial_state as fresh
from atlaslab.memory.state import Gates, MemoryState, split_time

CuSeqlens = Union[torch.Tensor, Sequence[int]]


def check_cu_seqlens(cu_seqlens: CuSeqlens, B: int, T: int) -> List[int]:
    """Validate ``cu_seqlens`` for packed inputs of ``B`` × ``T`` tokens → the offsets as Python ints.

    Raises ValueError naming ``cu_seqlens`` when the inputs are not packed (B ≠ 1), or the offsets are not
    ``[N + 1]`` integers rising strictly from 0 to T (an empty sequence has no memory to run).
    """
    if B != 1:
        raise ValueError(f"memorize: cu_seqlens needs packed inputs of batch 1 ([1, ΣT_i, H, D]); got B = {B}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"memorize: cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                             f"{list(cu_seqlens.shape)}")
        offsets = [int(x) for x in cu_seqlens.tolist()]
    else:
        offsets = list(cu_seqlens)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets):
            raise ValueError(f"memorize: cu_seqlens must hold integers, got {offsets!r}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"memorize: cu_seqlens must be [N + 1] offsets from 0 to T = {T} (N ≥ 1 sequences), "
                         f"got {offsets}")
    empty = [i for i in range(len(offsets) - 1) if offsets[i + 1] <= offsets[i]]
    if empty:
        raise ValueError(f"memorize: cu_seqlens must rise strictly (every sequence ≥ 1 token); sequence {empty[0]} "
                         f"spans [{offsets[empty[0]]}, {offsets[empty[0] + 1]}) in {offsets}")
    return offsets


def sequence_positions(offsets: Sequence[int], device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's sequence and its position in it: ``(seq [T], pos [T])`` (long) for offsets ``[N + 1]``."""
    cu = torch.as_tensor(list(offsets), device=device, dtype=torch.long)
    t = torch.arange(int(cu[-1]), device=device)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return seq, t - cu[seq]


def state_batch(state: MemoryState) -> int:
    """The batch size of a state (its window history always has the batch dim)."""
    return state.hist_k.shape[0]


def _map_tensors(state: MemoryState, fn: Callable[[torch.Tensor], torch.Tensor]) -> MemoryState:
    """A copy of ``state`` with ``fn`` applied to every tensor (also inside the weight dicts)."""
    def apply(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict):
            return {name: fn(w) for name, w in x.items()}
        return x
    return dataclasses.replace(state, **{f.name: apply(getattr(state, f.name)) for f in dataclasses.fields(state)})


def split_state(state: MemoryState) -> List[MemoryState]:
    """A batch-N state → N states of batch 1 (views; every sequence at the state's position)."""
    return [_map_tensors(state, lambda x, i=i: x[i:i + 1]) for i in range(state_batch(state))]


def stack_states(states: Sequence[MemoryState], chunk_size: int) -> MemoryState:
    """N states (e.g. a packed prefill's, one per sequence) → one batch-N state, for batched decoding.

    Exact when the engines cannot tell the sequences apart by position: the engines read ``position`` only modulo
    the training chunk b (where a chunk starts), so the positions must agree modulo ``chunk_size``, and every
    tensor (window history, the exp kernel trick's slot bank) must have the same shape. The stacked state's
    ``position`` is the first state's (the others' differ by multiples of b). Raises ValueError naming what differs.
    """
    states = list(states)
    if not states:
        raise ValueError("stack_states: no states")
    b = int(chunk_size)
    rests = sorted({s.position % b for s in states})
    if len(rests) > 1:
        raise ValueError(f"stack_states: the positions {[s.position for s in states]} fall at different points of "
                         f"a b = {b} training chunk (position mod b: {rests}); only states at the same point stack")
    first = states[0]

    def stack(name, values):
        if all(x is None for x in values):
            return None
        if isinstance(values[0], dict):
            return {w: stack(f"{name}.{w}", [x[w] for x in values]) for w in values[0]}
        shapes = sorted({tuple(x.shape[1:]) for x in values})
        if len(shapes) > 1:
            raise ValueError(f"stack_states: '{name}' differs in shape between the states ({shapes}; e.g. a window "
                             f"history shorter than c − 1 tokens, or the exp kernel trick's bank of every token)")
        return torch.cat(values, 0)
    fields = {f.name: stack(f.name, [getattr(s, f.name) for s in states]) for f in dataclasses.fields(first)
              if f.name != "position"}
    return MemoryState(position=first.position, **fields)


def stack_weights(states: Sequence[MemoryState], field: str, name: str = "W") -> torch.Tensor:
    """``[N, …]``: the tensor ``name`` of the weight dict ``field`` (weights, momentum, anchor) of every state."""
    return torch.cat([getattr(s, field)[name] for s in states], 0)


def sequence_states(initial_state, parts, n: int, like: torch.Tensor) -> List[MemoryState]:
    """The N per-sequence states a packed call starts from.

    ``initial_state``: None (the learned initial memory for every sequence), a batch-N :class:`MemoryState`, or a
    sequence of N batch-1 states (what a previous packed call returned).
    """
    if initial_state is None:
        return split_state(fresh(parts, n, like.dtype, like.device))
    if isinstance(initial_state, MemoryState):
        if state_batch(initial_state) != n:
            raise ValueError(f"memorize: initial_state has batch {state_batch(initial_state)}, but cu_seqlens holds "
                             f"{n} sequences")
        return split_state(initial_state)
    states = list(initial_state)
    if len(states) != n or not all(isinstance(s, MemoryState) and state_batch(s) == 1 for s in states):
        raise ValueError(f"memorize: with cu_seqlens, initial_state must be None, a MemoryState of batch {n}, or "
                         f"{n} MemoryStates of batch 1 (one per sequence); got {len(states)} item(s)")
    return states


def memorize_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts, gates: Gates, chunk_size: int,
                    states: List[MemoryState], offsets: List[int], engine: Callable,
                    **engine_options) -> Tuple[torch.Tensor, List[MemoryState]]:
    """One packed call: ``q, k: [1, ΣT_i, H, D_k]``, ``v: [1, ΣT_i, H, D_v]``, gates ``[1, ΣT_i, H(, D_k)]``,
    ``offsets`` = the checked ``cu_seqlens``, ``states`` one per sequence → ``(o: [1, ΣT_i, H, D_v], N final states)``.

    ``engine.packed`` (when the engine has one and it does not return None) computes all sequences at once;
    otherwise every sequence runs through ``engine`` alone, from its own state (the definition).
    """
    packed = getattr(engine, "packed", None)
    if packed is not None:
        result = packed(q, k, v, parts, gates, chunk_size, states, offsets, **engine_options)
        if result is not None:
            return result
    sizes = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    outputs, finals = [], []
    for (qi, ki, vi, gi), state in zip(split_time(sizes, q, k, v, gates), states):
        o, final = engine(qi, ki, vi, parts, gi, chunk_size, state, **engine_options)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, 1), finals


__all__ = ["check_cu_seqlens", "memorize_packed", "sequence_positions", "sequence_states", "split_state",
           "stack_states", "stack_weights", "state_batch"]
