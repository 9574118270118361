"""The task interface every workload implements, and the generic token-task evaluation.

A *token task* maps a seed to sequences of integer tokens with per-position targets:

    task = build_task({"name": "mqar", "vocab_size": 128, "seq_len": 64, "num_kv_pairs": [4]})
    batch = task.batch("train", step=0, batch_size=64, seed=0)   # a pure function of its arguments
    batch.inputs        # [B, T] long: what the model reads
    batch.targets       # [B, T] long: what is scored (IGNORE_INDEX = -100 where nothing is)
    batch.loss_targets  # [B, T] long: what the training loss uses (= targets unless the task says so)
    batch.meta          # {"kv": [B] long, ...}: per-example slice labels
    metrics = task.evaluate(model, split="test", lengths=[64, 128])   # model: [B, T] -> logits [B, T, V]

Determinism and splits
    Every example is generated from its own numpy ``Generator`` seeded by
    ``(task.cfg.seed, split, stream, length, index)``, so a batch is a pure function of
    ``(task config, split, step, batch_size, seed, length)``: a resumed run regenerates the same data,
    evaluation sets do not depend on the evaluation batch size, and train / val / test come from
    independent streams. ``task.cfg.seed`` fixes the task itself (fixed maps, the val and test sets, a
    finite training set); the training ``seed`` passed to :meth:`Task.batch` fixes the order of training
    data (and, for unbounded training streams, which examples are drawn), so runs with different training
    seeds are compared on the same test set. Text tasks also draw their text from disjoint spans of the
    corpus per split (:mod:`atlaslab.tasks.corpus`).

Targets
    ``targets[b, t]`` is the token the model must output at position ``t`` (for next-token tasks that is
    ``sequence[t + 1]``); positions with nothing to score hold ``IGNORE_INDEX``. A multi-token answer is
    scored token by token under teacher forcing; ``exact_match`` (every scored token of an example right)
    is then exactly what greedy decoding would get.

Metrics (:meth:`Task.evaluate`, all floats)
    ``loss`` (mean cross-entropy in nats over scored tokens), ``accuracy`` (token accuracy over scored
    tokens), ``exact_match`` (fraction of examples with every scored token right), per-slice
    ``accuracy/<key>_<value>`` and ``exact_match/<key>_<value>`` for the task's :attr:`Task.slice_keys`,
    with ``eval_position_span = S > 0`` the token accuracy by position, ``accuracy/pos_<a>_<b>`` over the scored
    positions ``a ≤ t < b`` of each span ``[a, a + S)`` that holds any (e.g. by segment of a segment-level
    memory: which queries only the memory reaches), plus task extras (``bpb``, ``ppl`` for language modelling).
    With ``lengths=[...]`` every key is prefixed ``len_<L>/``. Names use only characters MLflow accepts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import struct
import weakref
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.registry import ConfigError, PartConfig, build_part, check_range, resolve_part

IGNORE_INDEX = -100
SPLITS = ("train", "val", "test")
_SPLIT_ID = {"train": 0, "val": 1, "test": 2}


def split_id(split: str) -> int:
    if split not in _SPLIT_ID:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return _SPLIT_ID[split]


def stable_int(text: str) -> int:
    """A 32-bit integer of ``text`` that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(text.encode("utf-8"))


def make_rng(*keys: int) -> np.random.Generator:
    """A numpy Generator that is a pure function of the integer ``keys`` (Philox keyed by their hash)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(keys)}q", *[int(k) & 0x7FFFFFFFFFFFFFFF for k in keys]),
                             digest_size=16).digest()
    return np.random.Generator(np.random.Philox(key=int.from_bytes(digest, "little")))


@dataclass
class Example:
    """One generated sequence. Arrays are int64 of length T; ``segments`` (packed text rows): the offsets in
    ``[0, T)`` where a document begins, ``0`` first (:mod:`atlaslab.tasks.packing`)."""

    inputs: np.ndarray
    targets: np.ndarray
    loss_targets: Optional[np.ndarray] = None
    meta: Dict[str, int] = field(default_factory=dict)
    segments: Optional[np.ndarray] = None


def row_cu_seqlens(cu_seqlens: Optional[torch.Tensor], rows: slice, seq_len: int) -> Optional[torch.Tensor]:
    """The document offsets of rows ``rows`` of a packed batch (``cu_seqlens`` over its ``B · T`` tokens, every
    row start included), rebased to the first token of those rows; None stays None."""
    if cu_seqlens is None:
        return None
    lo, hi = rows.start * seq_len, rows.stop * seq_len
    return cu_seqlens[(cu_seqlens >= lo) & (cu_seqlens <= hi)] - lo


@dataclass
class Batch:
    """A batch of examples of one length. ``inputs``/``targets``/``loss_targets``: ``[B, T]`` long.

    ``cu_seqlens`` (rows of packed documents): ``[N + 1]`` long offsets into the ``B · T`` tokens read as one
    packed sequence ``[1, B · T]``, one entry per document segment of every row (row starts included); the model
    then runs each segment as its own sequence (:func:`forward_batch`). It stays on the CPU (the offsets are
    read as Python ints)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    loss_targets: Optional[torch.Tensor] = None
    meta: Dict[str, torch.Tensor] = field(default_factory=dict)
    cu_seqlens: Optional[torch.Tensor] = None

    @property
    def train_targets(self) -> torch.Tensor:
        """What the training loss uses: ``loss_targets`` if the task set them, else ``targets``."""
        return self.targets if self.loss_targets is None else self.loss_targets

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(mv(self.inputs), mv(self.targets), mv(self.loss_targets),
                     {k: mv(v) for k, v in self.meta.items()}, self.cu_seqlens)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def rows(self, rows: slice) -> "Batch":
        """Rows ``rows`` of the batch (``[B, T]`` → ``[b, T]``, meta ``[B]`` → ``[b]``), document offsets rebased."""
        lt = self.loss_targets
        return Batch(self.inputs[rows], self.targets[rows], None if lt is None else lt[rows],
                     {k: v[rows] for k, v in self.meta.items()},
                     row_cu_seqlens(self.cu_seqlens, rows, self.inputs.shape[1]))

    @staticmethod
    def stack(examples: Sequence[Example]) -> "Batch":
        lengths = {len(e.inputs) for e in examples}
        if len(lengths) != 1:
            raise ValueError(f"examples of different lengths in one batch: {sorted(lengths)}")
        inputs = torch.from_numpy(np.stack([e.inputs for e in examples]).astype(np.int64))
        targets = torch.from_numpy(np.stack([e.targets for e in examples]).astype(np.int64))
        loss_targets = None
        if any(e.loss_targets is not None for e in examples):
            loss_targets = torch.from_numpy(np.stack(
                [e.targets if e.loss_targets is None else e.loss_targets for e in examples]).astype(np.int64))
        keys = sorted({k for e in examples for k in e.meta})
        meta = {k: torch.tensor([int(e.meta.get(k, -1)) for e in examples], dtype=torch.long) for k in keys}
        cu_seqlens = None
        if any(e.segments is not None for e in examples):
            T = lengths.pop()
            offsets = [b * T + np.asarray([0] if e.segments is None else e.segments, dtype=np.int64)
                       for b, e in enumerate(examples)]
            cu_seqlens = torch.from_numpy(np.concatenate(offsets + [np.asarray([len(examples) * T])]))
        return Batch(inputs, targets, loss_targets, meta, cu_seqlens)


def forward_batch(module: nn.Module, batch: Batch) -> torch.Tensor:
    """``module``'s logits ``[B, T, V]`` for ``batch``: ``module(inputs)``, or, for packed rows (``cu_seqlens``),
    the ``B · T`` tokens as one packed sequence ``module(inputs.view(1, B · T), cu_seqlens=…)`` so that no
    document sees another."""
    if batch.cu_seqlens is None:
        return module(batch.inputs)
    B, T = batch.inputs.shape
    return module(batch.inputs.reshape(1, B * T), cu_seqlens=batch.cu_seqlens).view(B, T, -1)


@dataclass
class TaskConfig(PartConfig):
    """Fields every token task has."""

    seed: int = 0                 # fixes the task: fixed maps, val/test sets, a finite training set
    seq_len: int = 64             # training length T (evaluation may use other lengths)
    eval_examples: int = 512      # default size of the val/test sets (0: the task's own default)
    eval_position_span: int = 0   # > 0: also accuracy/pos_<a>_<b> per span of this many positions (0: off)

    def check(self) -> None:
        check_range("seed", self.seed, 0, None)
        check_range("seq_len", self.seq_len, 2, None)
        check_range("eval_examples", self.eval_examples, 0, None)
        check_range("eval_position_span", self.eval_position_span, 0, None)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions whose target is not IGNORE_INDEX, in float32 (float64 logits stay
    float64, so equivalence tests in double precision see the loss in double precision too)."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def scored_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many positions of ``targets`` are scored (not IGNORE_INDEX): the count :func:`cross_entropy`
    averages over (a 0-d long tensor on ``targets``' device)."""
    return (targets != IGNORE_INDEX).sum()


class Task:
    """Base class of the registered tasks (kind ``"task"``). Subclasses implement :meth:`generate`."""

    Config = TaskConfig
    #: the metric a comparison or an early stop looks at, and whether higher is better
    primary_metric: str = "accuracy"
    primary_mode: str = "max"
    #: meta keys reported as slices (``accuracy/<key>_<value>``)
    slice_keys: tuple = ()
    #: whether ``exact_match`` means something for this task
    report_exact_match: bool = True

    def __init__(self, cfg: TaskConfig, **context: Any):
        self.cfg = cfg
        self._cache: Dict[tuple, Example] = {}
        self._perm_cache: Dict[tuple, np.ndarray] = {}
        self._wrapped: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()

    # -- description --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)  # type: ignore[attr-defined]

    @property
    def seq_len(self) -> int:
        return int(self.cfg.seq_len)

    def info(self) -> Dict[str, Any]:
        """The resolved config plus derived facts (vocab size), for logs and reports."""
        out = dataclasses.asdict(self.cfg)
        out["vocab_size"] = self.vocab_size
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cfg})"

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, rng: np.random.Generator, split: str, length: int, index: int) -> Example:
        """One example of ``length`` tokens from ``rng``. ``index`` is the example's number in its split
        (tasks use it to balance slices across an evaluation set)."""
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        """Raise ValueError if examples of ``length`` tokens cannot be generated."""
        if length < 2:
            raise ValueError(f"{self.name}: length {length} is too short")

    def num_train_examples(self) -> Optional[int]:
        """Size of a finite training set, or None for an unbounded stream of fresh examples."""
        return None

    def eval_size(self, split: str, length: int) -> int:
        """Default number of examples in an evaluation split at ``length``."""
        return int(self.cfg.eval_examples) or 512

    def example(self, split: str, index: int, length: Optional[int] = None, stream: int = 0) -> Example:
        """Example ``index`` of ``split`` at ``length`` (default: the training length): a pure function."""
        length = self.seq_len if length is None else int(length)
        key = (split, int(stream), length, int(index))
        ex = self._cache.get(key)
        if ex is None:
            rng = make_rng(0xA71A5, self.cfg.seed, split_id(split), stream, length, index)
            ex = self.generate(rng, split, length, int(index))
            if len(ex.inputs) != length or len(ex.targets) != length:
                raise AssertionError(f"{self.name} generated {len(ex.inputs)} tokens, expected {length}")
            if self._cacheable(split, stream):
                self._cache[key] = ex
        return ex

    def _cacheable(self, split: str, stream: int) -> bool:
        # a finite training set is revisited every epoch: keep it
        return split == "train" and stream == 0 and self.num_train_examples() is not None

    def sample(self, split: str, indices: Sequence[int], length: Optional[int] = None, stream: int = 0) -> Batch:
        """The batch of examples ``indices`` of ``split``."""
        if length is not None:
            self.check_length(int(length))
        return Batch.stack([self.example(split, i, length, stream) for i in indices])

    def train_indices(self, step: int, batch_size: int, seed: int = 0) -> tuple:
        """``(stream, indices)`` of the training batch at ``step``: a pure function of its arguments.

        A finite training set (``num_train_examples() = N``) is visited in epochs, each a permutation
        drawn from ``(task seed, seed, epoch)``; an unbounded stream uses fresh examples
        ``step * batch_size + b`` of a stream keyed by ``seed``."""
        n = self.num_train_examples()
        first = int(step) * int(batch_size)
        if n is None:
            return int(seed) + 1, list(range(first, first + int(batch_size)))
        out = []
        for pos in range(first, first + int(batch_size)):
            epoch, offset = divmod(pos, n)
            key = (int(seed), epoch, n)
            perm = self._perm_cache.get(key)
            if perm is None:
                if len(self._perm_cache) > 4:
                    self._perm_cache.clear()
                perm = make_rng(0x0DE5, self.cfg.seed, seed, epoch).permutation(n)
                self._perm_cache[key] = perm
            out.append(int(perm[offset]))
        return 0, out

    def batch(self, split: str, step: int, batch_size: int, seed: int = 0, length: Optional[int] = None) -> Batch:
        """The batch at ``step``: training data (order from ``seed``) or evaluation examples
        ``[step * batch_size, (step + 1) * batch_size)``."""
        if split == "train":
            stream, indices = self.train_indices(step, batch_size, seed)
            return self.sample(split, indices, length, stream)
        first = int(step) * int(batch_size)
        return self.sample(split, range(first, first + int(batch_size)), length)

    def eval_batches(self, split: str = "val", n_examples: Optional[int] = None, batch_size: int = 64,
                     length: Optional[int] = None) -> Iterator[Batch]:
        """The fixed evaluation set of ``split``, in batches (the last one may be smaller)."""
        length = self.seq_len if length is None else int(length)
        self.check_length(length)
        n = self.eval_size(split, length) if n_examples is None else int(n_examples)
        for first in range(0, n, batch_size):
            yield self.sample(split, range(first, min(n, first + batch_size)), length)

    def data_state(self) -> Optional[Dict[str, Any]]:
        """Where the training data stands, for tasks whose batches are not pure functions of the step (a streamed
        corpus' cursor): plain containers the training loop stores in its checkpoint. None (the default): nothing
        to store."""
        return None

    def load_data_state(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore what :meth:`data_state` returned (called when a run resumes from its checkpoint)."""

    def shard_stream(self, rank: int, world: int) -> bool:
        """Data-parallel training on ``world`` ranks: True when this task then reads only rank ``rank``'s share
        of the training data, and ``batch("train", step, B / world, …)`` gives that rank's rows of the step (a
        streamed corpus: each rank tokenises its own documents). False (the default): the batch of a step is a
        pure function of the step, every rank builds the global batch and keeps its rows."""
        return False

    # -- models ------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module that is trained and evaluated for ``model`` (identity unless the task adds a head,
        as MAD's compression does). The same wrapper is returned for the same model."""
        return model

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Training loss: mean cross-entropy over ``batch.train_targets``."""
        return cross_entropy(logits, batch.train_targets)

    def loss_weight(self, batch: Batch) -> torch.Tensor:
        """How many terms :meth:`loss` averages over for ``batch`` (a 0-d tensor): the weight that makes the
        losses of a batch's shards add up to the loss of the whole batch, ``Σ_r w_r·loss_r / Σ_r w_r``, as
        data-parallel training needs. A task that overrides :meth:`loss` overrides this with it."""
        return scored_tokens(batch.train_targets)

    # -- evaluation --------------------------------------------------------------------------------
    def slice_name(self, key: str, value: int) -> str:
        """The label of slice ``key = value`` in metric names (``kv_4``)."""
        return f"{key}_{value}"

    def extra_totals(self, batch: Batch, mask: torch.Tensor) -> Dict[str, float]:
        """Task-specific sums over one evaluation batch (``mask``: the scored positions), added into the totals
        that :meth:`extra_metrics` receives."""
        return {}

    def extra_metrics(self, totals: Dict[str, float]) -> Dict[str, float]:
        """Task-specific metrics from the accumulated totals (``nll``, ``tokens``, ...)."""
        return {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str = "test", n_examples: Optional[int] = None,
                 batch_size: int = 64, lengths: Optional[Sequence[int]] = None,
                 device: Any = None, autocast_dtype: Optional[torch.dtype] = None) -> Dict[str, float]:
        """Metrics of ``model`` ([B, T] tokens -> [B, T, V] logits) on ``split``.

        ``lengths=None`` evaluates at the training length with plain keys; a list evaluates at each
        length with keys prefixed ``len_<L>/``. ``n_examples`` defaults to the task's evaluation size.
        """
        module = self.wrap(model)
        if device is None:
            p = next(iter(module.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        was_training = module.training
        module.eval()
        try:
            if lengths is None:
                return self._evaluate_at(module, split, n_examples, batch_size, None, device, autocast_dtype)
            out: Dict[str, float] = {}
            for L in lengths:
                m = self._evaluate_at(module, split, n_examples, batch_size, int(L), device, autocast_dtype)
                out.update({f"len_{int(L)}/{k}": v for k, v in m.items()})
            return out
        finally:
            module.train(was_training)

    def _evaluate_at(self, module, split, n_examples, batch_size, length, device, autocast_dtype):
        tot = defaultdict(float)
        slices: Dict[str, Dict[int, List[float]]] = {k: defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
                                                     for k in self.slice_keys}
        span = self.cfg.eval_position_span
        by_span = {"correct": torch.zeros(0, dtype=torch.float64), "tokens": torch.zeros(0, dtype=torch.float64)}
        for batch in self.eval_batches(split, n_examples, batch_size, length):
            batch = batch.to(device)
            if autocast_dtype is not None and torch.device(device).type == "cuda":
                with torch.autocast("cuda", dtype=autocast_dtype):
                    logits = forward_batch(module, batch)
            else:
                logits = forward_batch(module, batch)
            logits = logits.float()
            tgt = batch.targets
            mask = tgt != IGNORE_INDEX
            safe = tgt.clamp_min(0)
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), safe.reshape(-1),
                                  reduction="none").view_as(tgt) * mask
            correct = (logits.argmax(-1) == tgt) & mask
            n_tok = mask.sum(1)                      # [B]
            n_ok = correct.sum(1)
            has = n_tok > 0
            exact = (n_ok == n_tok) & has
            tot["nll"] += nll.sum().item()
            tot["tokens"] += n_tok.sum().item()
            tot["correct"] += n_ok.sum().item()
            tot["examples"] += has.sum().item()
            tot["exact"] += exact.sum().item()
            for k, v in self.extra_totals(batch, mask).items():
                tot[k] += v
            if span:
                _add_by_span(by_span, correct, mask, span)
            for k in self.slice_keys:
                vals = batch.meta[k].tolist()
                for b, v in enumerate(vals):
                    s = slices[k][int(v)]
                    s[0] += n_ok[b].item()
                    s[1] += n_tok[b].item()
                    s[2] += float(exact[b].item())
                    s[3] += float(has[b].item())
        ntok = max(tot["tokens"], 1.0)
        out = {"loss": tot["nll"] / ntok, "accuracy": tot["correct"] / ntok}
        if self.report_exact_match:
            out["exact_match"] = tot["exact"] / max(tot["examples"], 1.0)
        for k in self.slice_keys:
            for v in sorted(slices[k]):
                ok, n, ex, ne = slices[k][v]
                label = self.slice_name(k, v)
                out[f"accuracy/{label}"] = ok / max(n, 1.0)
                if self.report_exact_match:
                    out[f"exact_match/{label}"] = ex / max(ne, 1.0)
        for i, (ok, n) in enumerate(zip(by_span["correct"].tolist(), by_span["tokens"].tolist())):
            if n > 0:
                out[f"accuracy/pos_{i * span}_{(i + 1) * span}"] = ok / n
        out.update(self.extra_metrics(dict(tot)))
        return out


def _add_by_span(acc: Dict[str, torch.Tensor], correct: torch.Tensor, mask: torch.Tensor, span: int) -> None:
    """Add one batch's right and scored tokens per span of ``span`` positions (``correct``, ``mask``: ``[B, T]``
    bools) into ``acc["correct"]`` / ``acc["tokens"]`` (float64 ``[n_spans]``, grown as longer batches come)."""
    n_spans = -(-correct.shape[1] // span)
    where = (torch.arange(correct.shape[1], device=mask.device) // span).expand_as(mask)[mask].cpu()
    right = torch.bincount(where, weights=correct[mask].double().cpu(), minlength=n_spans)
    scored = torch.bincount(where, minlength=n_spans).double()
    for key, add in (("correct", right), ("tokens", scored)):
        if acc[key].numel() < n_spans:
            acc[key] = torch.cat([acc[key], torch.zeros(n_spans - acc[key].numel(), dtype=torch.float64)])
        acc[key][:n_spans] += add


class CachedWrapperMixin:
    """For tasks whose :meth:`Task.wrap` builds a head: one wrapper per model, reused by evaluate."""

    def _make_wrapper(self, model: nn.Module) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def _wrapper_type(self) -> type:  # pragma: no cover - interface
        raise NotImplementedError

    def wrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, self._wrapper_type()):
            return model
        w = self._wrapped.get(model)  # type: ignore[attr-defined]
        if w is None:
            w = self._make_wrapper(model)
            p = next(iter(model.parameters()), None)
            if p is not None:
                w.to(p.device)
            self._wrapped[model] = w  # type: ignore[attr-defined]
        return w


def build_task(node: Any, path: str = "task") -> Task:
    """Validate a task node (``{name: mqar, ...}``, a name, or a task Config) and build the task."""
    if isinstance(node, Task):
        return node
    return build_part("task", node, path)


def resolve_task(node: Any, path: str = "task") -> PartConfig:
    """Validate a task node without building it (a ConfigError names the dotted path)."""
    return resolve_part("task", node, path)


__all__ = ["Batch", "CachedWrapperMixin", "ConfigError", "Example", "IGNORE_INDEX", "SPLITS", "Task",
           "TaskConfig", "build_task", "cross_entropy", "forward_batch", "make_rng", "resolve_task", "scored_tokens",
           "split_id", "stable_int"]
