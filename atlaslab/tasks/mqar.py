"""Multi-query associative recall (MQAR), as in Zoology (Arora et al. 2023, ``zoology/data/multiquery_ar.py``).

A sequence of ``T`` tokens opens with ``n`` key-value pairs ``k_1 v_1 … k_n v_n`` (keys drawn without
replacement from ``[1, V/2)``, values from ``[V/2, V)``); every key is then queried once in the rest of the
sequence, at offset ``2 · gap`` after the pairs, where the gaps are drawn without replacement from a power
law ``p(g) ∝ a · (g + 1)^(a − 1)`` over ``g ∈ [0, (T − 2n) / 2)`` (``power_a = a``; 1.0 is uniform, Zoology's
0.01 favours short gaps). The other positions hold random tokens (``random_non_queries``) or 0. At a query
position the target is the queried key's value; every other position is ignored:

    inputs : k1 v1 k2 v2  x  x  k2  x  x  x  k1  x …
    targets:  -  -  -  -  -  -  v2  -  -  -  v1  - …

Metrics: ``accuracy`` over answer positions, its ``accuracy/kv_<n>`` slices per number of pairs, and
``exact_match`` (every query of a sequence right). Training draws each example's ``n`` from
``num_kv_pairs``; evaluation sets split their examples evenly over ``eval_num_kv_pairs`` (default: the
training values), skipping the values that do not fit a given evaluation length (``4 n ≤ T``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List

import numpy as np

from atlaslab.registry import ConfigError, check_range, register
from atlaslab.tasks.base import IGNORE_INDEX, Example, Task, TaskConfig


def power_law_probs(space: int, power_a: float) -> np.ndarray:
    """Zoology's gap distribution over ``[0, space)``: ``p ∝ a · (g + 1)^(a − 1)``."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return p / p.sum()


@functools.lru_cache(maxsize=256)
def _log_probs(space: int, power_a: float) -> np.ndarray:
    return np.log(power_law_probs(space, power_a))


def sample_gaps(rng: np.random.Generator, space: int, n: int, power_a: float) -> np.ndarray:
    """``n`` distinct gaps from the power law, drawn one after another without replacement (as
    ``rng.choice(space, n, replace=False, p=…)``), by the Gumbel-top-k trick: one vectorised draw."""
    g = _log_probs(space, power_a) - np.log(-np.log(rng.random(space)))
    return np.argsort(-g, kind="stable")[:n]


@register("task", "mqar")
class MQAR(Task):
    """Zoology's multi-query associative recall with power-law key→query gaps."""

    @dataclass
    class Config(TaskConfig):
        vocab_size: int = 8192
        seq_len: int = 256
        num_kv_pairs: List[int] = field(default_factory=lambda: [16])   # training mixture
        eval_num_kv_pairs: List[int] = field(default_factory=list)      # [] → num_kv_pairs
        power_a: float = 0.01
        random_non_queries: bool = True
        eval_examples: int = 1000

        def check(self) -> None:
            super().check()
            if not self.num_kv_pairs:
                raise ConfigError("num_kv_pairs", "needs at least one number of key-value pairs.", value=[])
            for name in ("num_kv_pairs", "eval_num_kv_pairs"):
                for i, n in enumerate(getattr(self, name)):
                    check_range(f"{name}.{i}", n, 1, None)
                    if n > self.vocab_size // 2 - 1:
                        raise ConfigError(f"{name}.{i}", f"{n} pairs need {n} distinct keys but the key "
                                          f"vocabulary [1, {self.vocab_size // 2}) has {self.vocab_size // 2 - 1}.",
                                          value=n)
            for i, n in enumerate(self.num_kv_pairs):
                if 4 * n > self.seq_len:
                    raise ConfigError(f"num_kv_pairs.{i}", f"{n} pairs do not fit seq_len {self.seq_len} "
                                      f"(need 4 · pairs ≤ seq_len).", value=n)
            check_range("vocab_size", self.vocab_size, 4, None)
            if not (self.power_a > 0):
                raise ConfigError("power_a", "must be > 0 (1.0 is uniform).", value=self.power_a)

    primary_metric = "accuracy"
    slice_keys = ("kv",)

    @property
    def eval_kv(self) -> List[int]:
        return list(self.cfg.eval_num_kv_pairs or self.cfg.num_kv_pairs)

    def kv_for_length(self, length: int) -> List[int]:
        return [n for n in self.eval_kv if 4 * n <= length]

    def check_length(self, length: int) -> None:
        if not self.kv_for_length(length) and length != self.seq_len:
            raise ValueError(f"mqar: no eval_num_kv_pairs fits length {length} (need 4 · pairs ≤ length)")

    def generate(self, rng: np.random.Generator, split: str, length: int, index: int) -> Example:
        c = self.cfg
        V, T = c.vocab_size, length
        if split == "train":
            n = int(c.num_kv_pairs[int(rng.integers(len(c.num_kv_pairs)))]) if len(c.num_kv_pairs) > 1 \
                else int(c.num_kv_pairs[0])
        else:
            kvs = self.kv_for_length(T)
            n = kvs[index % len(kvs)]
        if 4 * n > T:
            raise ValueError(f"mqar: {n} pairs do not fit length {T}")
        half = V // 2
        keys = 1 + rng.permutation(half - 1)[:n]
        values = half + rng.permutation(V - half)[:n]
        space = (T - 2 * n) // 2
        gaps = sample_gaps(rng, space, n, c.power_a)
        if c.random_non_queries:
            inputs = rng.integers(0, V, size=T)
        else:
            inputs = np.zeros(T, dtype=np.int64)
        inputs[0:2 * n:2] = keys
        inputs[1:2 * n:2] = values
        qpos = 2 * n + 2 * gaps
        inputs[qpos] = keys
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        targets[qpos] = values
        return Example(inputs.astype(np.int64), targets, meta={"kv": n})


__all__ = ["MQAR", "power_law_probs", "sample_gaps"]
