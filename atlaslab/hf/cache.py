"""Decoding state for Hugging Face–style calls: each layer's recurrent state, kept per group of equal-length rows.

A recurrent memory has no mask to hide a pad token behind: whatever it reads, it writes. So a batch with padding is
never run as one tensor. Its rows are grouped by how many real tokens they hold, each group runs only its real
tokens (gathered out of the padded batch), and the group keeps its own per-layer state. Rows with equal lengths
share their positions, so a group is still one batched call; an unpadded batch is one group of every row. The
result equals each row run alone, exactly (what the left-padding tests check), at one call per distinct length.

Tensor key: B batch rows, T new tokens (columns), n real tokens of a row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class RowGroup:
    """Rows that hold the same number of real tokens: ``rows`` (``[G]`` row indices, None: every row of the batch),
    and ``state``, what their last call returned (None before their first real token)."""

    rows: Optional[torch.Tensor]
    state: Any = None


@dataclass
class CacheEntry:
    """One user of a cache (the whole model, or one fla-style layer): its row groups (None before its first call)
    and ``seen``, the columns it consumed so far, pads included."""

    groups: Optional[List[RowGroup]] = None
    seen: int = 0


@dataclass
class StateCache:
    """The ``past_key_values`` (``cache``) of an atlaslab model, or of the atlaslab layers in a user's model.

    ``entries``: ``"model"`` → the language model's :class:`CacheEntry`, or a layer's ``layer_idx`` → that layer's,
    so several fla-style layers share one cache object as fla's layers do. ``get_seq_length`` reports the columns
    consumed, pads included, which ``generate`` uses to slice the new tokens off a grown ``input_ids``.
    """

    entries: Dict[Any, CacheEntry] = field(default_factory=dict)
    is_compileable = False            # generate asks before deciding whether to compile the forward

    def entry(self, key: Any) -> CacheEntry:
        return self.entries.setdefault(key, CacheEntry())

    def get_seq_length(self, layer_idx: Optional[int] = None) -> int:
        if not self.entries:
            return 0
        key = "model" if "model" in self.entries else (layer_idx if layer_idx is not None else min(self.entries))
        return self.entries[key].seen if key in self.entries else 0


def padding_runs(attention_mask: Optional[torch.Tensor], B: int, T: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's first real column and its number of real tokens (``[B]`` each) from ``attention_mask: [B, T]``
    (1 = token, 0 = pad). The real tokens of a row must be one contiguous run (left or right padding)."""
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long), torch.full((B,), T, dtype=torch.long)
    if attention_mask.shape != (B, T):
        raise ValueError(f"attention_mask must be [B, T] = {[B, T]} for the new tokens, got "
                         f"{list(attention_mask.shape)}")
    m = attention_mask.detach().to("cpu", torch.bool)
    n = m.sum(1)
    start = torch.where(n > 0, m.to(torch.int8).argmax(1), torch.zeros_like(n))
    cols = torch.arange(T)[None, :]
    run = (cols >= start[:, None]) & (cols < (start + n)[:, None])
    if not torch.equal(run, m):
        raise ValueError("attention_mask: each row's tokens must be one contiguous run (left or right padding); "
                         "a pad between two tokens is not supported")
    return start, n


def group_rows(attention_mask: Optional[torch.Tensor], B: int, T: int) -> List[Tuple[RowGroup, torch.Tensor, int]]:
    """The groups of a first call: ``(group, start [G], n)`` per distinct real length n (descending), where
    ``start`` holds each row's first real column."""
    start, n = padding_runs(attention_mask, B, T)
    if bool((n == T).all()):
        return [(RowGroup(None), start, T)]
    out = []
    for length in sorted(set(n.tolist()), reverse=True):
        rows = (n == length).nonzero()[:, 0]
        out.append((RowGroup(rows), start[rows], int(length)))
    return out


def run_grouped(entry: CacheEntry, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                fn: Callable[[torch.Tensor, Any], Tuple[torch.Tensor, Any]]) -> Optional[torch.Tensor]:
    """Advance every row group of ``x: [B, T, ...]`` through ``fn(x_group [G, n, ...], state) -> (y, state)``, the
    states kept in ``entry`` (its ``seen`` grows by T).

    On the entry's first call its groups come from ``attention_mask`` (the new tokens' columns); later calls must
    bring T real tokens for every row. Returns ``y: [B, T, ...]`` with zeros at the pads (None if no row had a token).
    """
    B, T = x.shape[:2]
    dev = x.device
    if entry.groups is None:
        plan = group_rows(attention_mask, B, T)
        entry.groups = [g for g, _, _ in plan]
    else:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("attention_mask: after the first call every new token must be real (1); padding "
                             "belongs in the first call")
        plan = [(g, torch.zeros(B if g.rows is None else len(g.rows), dtype=torch.long), T) for g in entry.groups]
    entry.seen += T
    out = None
    for group, start, n in plan:
        if n == 0:
            continue
        if group.rows is None:                       # every row, every column: no gather
            y, group.state = fn(x, group.state)
            return y
        rows = group.rows.to(dev)
        cols = start.to(dev)[:, None] + torch.arange(n, device=dev)[None, :]
        y, group.state = fn(x[rows[:, None], cols], group.state)
        if out is None:
            out = y.new_zeros((B, T) + tuple(y.shape[2:]))
        out[rows[:, None], cols] = y
    return out


__all__ = ["CacheEntry", "RowGroup", "StateCache", "group_rows", "padding_runs", "run_grouped"]
