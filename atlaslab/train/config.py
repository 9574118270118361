"""Training settings: one structured config for every model and task.

A YAML ``train:`` node is validated against :class:`TrainConfig` by :func:`resolve_train_config`; an
unknown field, a wrong type or a bad value raises one :class:`ConfigError` naming the dotted path
(``train.warmup_steps``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional


from atlaslab.registry import ConfigError, check_choice, check_range, to_container, validate_structured


def check_batch_split(batch_size: int, workers: int, path: str = "train.batch_size") -> None:
    """The global batch must split into ``workers`` equal shards (the one check, for the search's validation
    and for :class:`atlaslab.train.parallel.DataParallel`)."""
    if batch_size % workers:
        raise ConfigError(path, f"{batch_size} does not split over {workers} workers: the global batch must be a "
                          f"multiple of the number of workers (resources.workers_per_trial).", value=batch_size)


@dataclass
class TrainConfig:
    """Everything the training loop needs besides the model and the task."""

    steps: int = 1000                     # optimiser steps
    batch_size: int = 64                  # rows a step (the global batch, split over the data-parallel workers)
    micro_batch_size: int = 0             # rows per forward/backward pass on each worker (gradient accumulation); 0: all
    lr: float = 3e-3                      # peak learning rate (AdamW)
    min_lr_ratio: float = 0.0             # the schedule ends at lr · min_lr_ratio
    warmup_steps: int = 0                 # linear warm-up from 0
    schedule: str = "cosine"              # cosine | linear | constant (after warm-up)
    weight_decay: float = 0.1             # decoupled (AdamW); never on biases, norms and other 1-D tensors
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0                # max global gradient norm; 0 disables clipping
    seed: int = 0                         # training-data order and every RNG the loop touches

    eval_interval: int = 100              # evaluate on eval_split every N steps (0: only at the end)
    eval_split: str = "val"
    eval_examples: int = 0                # 0: the task's default evaluation size
    eval_batch_size: int = 0              # 0: batch_size
    final_eval: bool = True               # evaluate on test_split at the end
    test_split: str = "test"
    test_lengths: List[int] = field(default_factory=list)   # extra lengths for the final evaluation

    early_stop_metric: str = ""           # e.g. "accuracy" (an eval metric; default: the task's primary)
    early_stop_threshold: Optional[float] = None   # stop once the eval metric reaches it (None: never)
    early_stop_mode: str = "auto"         # max | min | auto (the task's direction)
    #: a declared step-cost bound: at each evaluation, a run whose training steps took more than this many wall
    #: seconds on average ends with status ``over_cost`` (None: no bound). A search uses it to keep parts whose
    #: arithmetic a machine cannot afford (per-token Newton–Schulz on a CPU) in its space at a bounded cost.
    max_step_time_s: Optional[float] = None

    precision: str = "fp32"               # fp32 | bf16 (bf16 autocast on CUDA; fp32 elsewhere)
    device: str = "auto"                  # auto (cuda if available) | cpu | cuda | cuda:N
    log_interval: int = 10                # emit train metrics every N steps
    checkpoint_interval: int = 100        # save every N steps when a checkpoint dir is given (0: at evals)
    progress: str = "auto"                # auto (a bar only when stdout is a TTY) | always | never

    def check(self) -> None:
        check_range("steps", self.steps, 1, None)
        check_range("batch_size", self.batch_size, 1, None)
        check_range("micro_batch_size", self.micro_batch_size, 0, None)
        self.check_micro_batch(1, path="micro_batch_size")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"bad value {self.lr!r}: must be a positive number.", value=self.lr)
        check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range("warmup_steps", self.warmup_steps, 0, None)
        check_choice("schedule", self.schedule, ("cosine", "linear", "constant"))
        check_range("weight_decay", self.weight_decay, 0.0, None)
        check_range("beta1", self.beta1, 0.0, 0.999999)
        check_range("beta2", self.beta2, 0.0, 0.999999999)
        check_range("eps", self.eps, 0.0, None)
        check_range("grad_clip", self.grad_clip, 0.0, None)
        check_range("seed", self.seed, 0, None)
        check_range("eval_interval", self.eval_interval, 0, None)
        check_choice("eval_split", self.eval_split, ("val", "test", "train"))
        check_choice("test_split", self.test_split, ("val", "test", "train"))
        check_range("eval_examples", self.eval_examples, 0, None)
        check_range("eval_batch_size", self.eval_batch_size, 0, None)
        for i, L in enumerate(self.test_lengths):
            check_range(f"test_lengths.{i}", L, 2, None)
        check_choice("early_stop_mode", self.early_stop_mode, ("auto", "max", "min"))
        if self.max_step_time_s is not None and not self.max_step_time_s > 0:
            raise ConfigError("max_step_time_s", f"a bound in seconds > 0 (or null: none), got "
                              f"{self.max_step_time_s!r}.", value=self.max_step_time_s)
        check_choice("precision", self.precision, ("fp32", "bf16"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"bad value {self.device!r}.", value=self.device,
                              choices=["auto", "cpu", "cuda", "cuda:N"])
        check_range("log_interval", self.log_interval, 1, None)
        check_range("checkpoint_interval", self.checkpoint_interval, 0, None)
        check_choice("progress", self.progress, ("auto", "always", "never"))

    def check_workers(self, workers: int) -> None:
        """The batch splits over ``workers`` data-parallel workers, and each shard into micro-batches."""
        check_batch_split(self.batch_size, workers)
        self.check_micro_batch(workers)

    def check_micro_batch(self, workers: int, path: str = "train.micro_batch_size") -> None:
        """Each of ``workers`` shards of the batch (``batch_size / workers`` rows) must split into micro-batches."""
        rows = self.batch_size // workers
        if self.micro_batch_size and rows % self.micro_batch_size:
            per = f"the {rows} rows each of the {workers} workers trains on" if workers > 1 else \
                f"the batch of {rows} rows"
            raise ConfigError(path, f"{self.micro_batch_size} does not divide {per}: pick a divisor (0: no "
                              f"accumulation).", value=self.micro_batch_size)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    #: fields that may change between a run and its resumption (they do not change the result; a micro-batch size
    #: only up to rounding, so a preempted run may resume on a device with less memory)
    RESUMABLE_CHANGES = ("progress", "log_interval", "checkpoint_interval", "device", "micro_batch_size")


def resolve_train_config(node: Any = None, path: str = "train", **overrides: Any) -> TrainConfig:
    """A validated :class:`TrainConfig` from a mapping / DictConfig / TrainConfig (plus keyword overrides)."""
    if isinstance(node, TrainConfig):
        node = dataclasses.asdict(node)
    node = dict(to_container(node) or {})
    node.update(overrides)
    return validate_structured(TrainConfig, node, path, what="training setting")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warm-up, then the decay schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (cfg.lr - floor) * (1.0 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def config_diff(a: Mapping[str, Any], b: Mapping[str, Any], ignore=TrainConfig.RESUMABLE_CHANGES) -> Dict[str, tuple]:
    """Fields whose values differ between two TrainConfig dicts (ignoring ``ignore``)."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)}


__all__ = ["TrainConfig", "config_diff", "lr_at", "resolve_train_config"]
