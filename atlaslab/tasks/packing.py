"""Documents packed into fixed-length rows whose targets and attention never cross a document.

Notation: T – row length (``seq_len``), N – tokens in a split, D – documents.

Each document is tokenised and ended with EOS; the documents are concatenated into one stream
(:class:`TokenStream`). Row ``i`` reads stream tokens ``[iT, iT + T)`` and predicts ``[iT + 1, iT + T + 1)``,
so rows tile the stream with no overlap and every token except each document's first is a target exactly once.
A document longer than what is left of a row continues at the start of the next one.

Boundaries, two ways together:

* **targets**: the target of a document's last token (its EOS) would be the next document's first token; it is
  ``IGNORE_INDEX``. A row's other targets lie in the document of their input.
* **attention**: ``segments`` are the row-relative offsets where a document (or the rest of one) begins (always
  ``0`` first). A batch of such rows is run as one packed sequence with ``cu_seqlens`` (fla's convention,
  :meth:`atlaslab.models.LanguageModel.forward`): every layer restarts at each offset — memories fresh, no
  attention or convolution across it, RoPE from 0 — so no token sees another document.

:class:`RowPacker` builds the same rows incrementally from a stream of documents (for corpora read by streaming):
pushing the documents of a :class:`TokenStream` in order and popping rows gives exactly its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from atlaslab.tasks.base import IGNORE_INDEX, Example


@dataclass
class TokenStream:
    """Documents concatenated, each ended by EOS. ``tokens``: [N] int32; ``starts``: [D] int64 offsets (``0`` first)."""

    tokens: np.ndarray
    starts: np.ndarray

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], eos_id: int) -> "TokenStream":
        pieces: List[np.ndarray] = []
        starts: List[int] = []
        n = 0
        for doc in docs:
            starts.append(n)
            arr = np.empty(len(doc) + 1, dtype=np.int32)
            arr[:-1] = doc
            arr[-1] = eos_id
            pieces.append(arr)
            n += len(arr)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        return cls(tokens, np.asarray(starts, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def num_documents(self) -> int:
        return int(len(self.starts))

    def num_rows(self, length: int) -> int:
        """Rows of ``length`` inputs (+ 1 target) the stream tiles."""
        return max(0, (self.num_tokens - 1) // int(length))

    def row(self, index: int, length: int) -> Example:
        """Row ``index`` of ``length`` tokens: inputs, boundary-masked targets and ``segments``."""
        T, first = int(length), int(index) * int(length)
        if not 0 <= index < self.num_rows(T):
            raise IndexError(f"row {index} of a stream with {self.num_rows(T)} rows of {T} tokens")
        window = self.tokens[first:first + T + 1].astype(np.int64)
        lo, hi = np.searchsorted(self.starts, [first + 1, first + T + 1])
        inside = self.starts[lo:hi] - first            # document starts at row positions 1 … T
        return make_row(window, inside)


def make_row(window: np.ndarray, starts: np.ndarray) -> Example:
    """The row of a ``window`` of T + 1 stream tokens, given the document starts at window positions 1 … T."""
    T = len(window) - 1
    inputs, targets = window[:-1].copy(), window[1:].copy()
    starts = np.asarray(starts, dtype=np.int64)
    targets[starts - 1] = IGNORE_INDEX                 # a document's EOS does not predict the next document
    segments = np.concatenate([[0], starts[starts < T]]).astype(np.int64)
    return Example(inputs, targets, segments=segments)


class RowPacker:
    """Rows from documents pushed one at a time (the rows of :class:`TokenStream` over the same documents)."""

    def __init__(self, length: int, eos_id: int):
        self.length, self.eos_id = int(length), int(eos_id)
        self.buffer = np.zeros(0, dtype=np.int32)      # stream tokens not yet consumed (the first: the next row's)
        self.starts = np.zeros(0, dtype=np.int64)      # document starts in the buffer

    def push(self, doc: Sequence[int]) -> None:
        arr = np.empty(len(doc) + 1, dtype=np.int32)
        arr[:-1] = doc
        arr[-1] = self.eos_id
        self.starts = np.append(self.starts, len(self.buffer))
        self.buffer = np.concatenate([self.buffer, arr])

    def ready(self) -> int:
        """Rows that can be popped now."""
        return max(0, (len(self.buffer) - 1) // self.length)

    def pop(self) -> Example:
        T = self.length
        if len(self.buffer) < T + 1:
            raise IndexError("not enough tokens for a row")
        window = self.buffer[:T + 1].astype(np.int64)
        ex = make_row(window, self.starts[(self.starts >= 1) & (self.starts <= T)])
        self.buffer = self.buffer[T:]                   # the row's last target is the next row's first input
        self.starts = self.starts[self.starts >= T] - T
        return ex

    def state_dict(self) -> Dict[str, list]:
        return {"buffer": self.buffer.tolist(), "starts": self.starts.tolist()}

    def load_state_dict(self, state: Optional[Dict[str, list]]) -> None:
        state = state or {}
        self.buffer = np.asarray(state.get("buffer", []), dtype=np.int32)
        self.starts = np.asarray(state.get("starts", []), dtype=np.int64)


__all__ = ["RowPacker", "TokenStream", "make_row"]
