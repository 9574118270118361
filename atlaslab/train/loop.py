"""One training loop for every model and task.

    result = train(model, task, TrainConfig(steps=250, lr=3e-3), callback=report, checkpoint_dir="runs/x")
    result.status          # "completed" | "early_stopped" | "stopped" | "over_cost" | "diverged"
    result.metrics         # {"train/loss": …, "val/accuracy": …, "test/accuracy": …, "test/len_128/…": …}

* ``model`` is any ``nn.Module`` mapping tokens ``[B, T]`` (long) to logits ``[B, T, V]``; ``task`` a
  :class:`~atlaslab.tasks.Task` or a task node (``{name: mqar, …}``). The task may wrap the model with a
  head (MAD compression); the wrapped module is what is trained, checkpointed and returned as
  ``result.model``.
* AdamW (decay on weight matrices only, never on norm gains: :mod:`atlaslab.registry.weight_decay`), linear
  warm-up then cosine / linear / constant schedule (the learning rate is a pure function of the step), global-norm
  gradient clipping, bf16 autocast on CUDA when ``precision: bf16``.
* Data: the batch of step ``s`` is ``task.batch("train", s, batch_size, seed)``, a pure function, so
  there is no data-loader state. :func:`train` seeds torch's global RNG with ``cfg.seed`` at the start of
  a fresh run (before a task head is built); evaluation runs under a forked RNG so it never shifts it.
* Metrics go to ``callback(metrics: dict, step: int)`` every ``log_interval`` steps (``train/loss`` —
  the mean over the interval —, ``train/lr``, ``train/grad_norm``, ``train/tokens``), at every evaluation
  (the same call also carries ``val/<metric>``), and once at the end with ``test/<metric>`` (and
  ``test/len_<L>/<metric>`` for ``test_lengths``). A callback that returns ``True`` stops the run
  (status ``stopped``). Evaluation steps are the calls whose dict has ``val/`` keys.
* Early stopping: once the evaluation metric reaches ``early_stop_threshold`` (status
  ``early_stopped``; zoology's rule). A non-finite loss or gradient norm ends the run with status
  ``diverged`` and ``message = "diverged at step N (…)"``, without an exception.
* A step-cost bound (``max_step_time_s``): at each evaluation, a run whose training steps (forward, backward and
  optimiser step, not evaluations) took more wall seconds on average than the bound ends with status
  ``over_cost``; its final evaluation still runs.
* Checkpoints (``checkpoint_dir``): ``checkpoint.pt`` is written atomically every ``checkpoint_interval`` steps
  (``0``: at every evaluation) and at the end, holding the module, the optimiser, the step, the RNG states, the
  partial metric accumulators, the history, the settings and the task's data cursor
  (:meth:`~atlaslab.tasks.Task.data_state`, for a streamed corpus), and the resolved model config of an atlaslab
  language model (``model_config``, what :mod:`atlaslab.eval` rebuilds it from). The checkpoint of step ``N`` is
  written after step ``N``'s record joined the history and before the callback sees that record, so a callback
  that copies the file (the search's Ray checkpoints) gets the state of the step it is called for. Calling
  :func:`train` again with the same directory resumes from it (a finished run returns its stored result at once;
  a run that reached its early-stop threshold at the checkpoint's step only runs its end); a run killed at any
  point and resumed ends with the same metrics as an uninterrupted one (CPU, same seed).
  The checkpoint it replaces stays as ``checkpoint.prev.pt``; a torn ``checkpoint.pt`` (truncated, a record failing
  its CRC) resumes from that one instead, with a warning and ``result.checkpoint_fallback`` saying so
  (:mod:`atlaslab.train.checkpoint`); both torn is an error, never a fresh start or training on garbage.
  Resuming with different settings (other than ``RESUMABLE_CHANGES``) or a different task is an error.
* Data parallelism (``parallel``, a :class:`~atlaslab.train.parallel.DataParallel`): the same loop in each
  process of a ``torch.distributed`` group, each on its shard of the global batch, gradients averaged by
  DDP; rank 0 alone evaluates, calls the callback and writes the checkpoint (see :mod:`atlaslab.train.parallel`).
  A task that reads its own share of the data on each rank (:meth:`~atlaslab.tasks.Task.shard_stream`: a streamed
  corpus) gives each rank its rows directly, and the checkpoint holds every rank's data cursor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from atlaslab.registry import ConfigError
from atlaslab.train import checkpoint as ckpt_file
from atlaslab.tasks.base import Task, build_task, forward_batch
from atlaslab.train.config import TrainConfig, config_diff, lr_at, resolve_train_config
from atlaslab.train.parallel import DataParallel
from atlaslab.registry.weight_decay import takes_weight_decay

Callback = Callable[[Dict[str, float], int], Optional[bool]]
CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_VERSION = 1
LOWER_IS_BETTER = ("loss", "bpb", "ppl", "rel_loss")


@dataclass
class TrainResult:
    """What a training run produced. ``to_dict()`` is JSON-ready (no tensors, no model)."""

    status: str                                   # completed | early_stopped | stopped | over_cost | diverged
    steps: int                                    # optimiser steps taken
    metrics: Dict[str, float]                     # final: last train + last val + test metrics
    best: Dict[str, Any] = field(default_factory=dict)      # {"metric", "value", "step"} of the eval metric
    history: List[Dict[str, float]] = field(default_factory=list)  # {"step": s, <metrics emitted at s>}
    message: str = ""
    diverged_at: Optional[int] = None
    resumed_from: Optional[int] = None
    checkpoint_fallback: str = ""                 # set when resuming fell back from a torn checkpoint: what and why
    wall_time_s: float = 0.0
    train_seconds: float = 0.0                    # wall seconds inside the training steps (no evaluations)
    config: Dict[str, Any] = field(default_factory=dict)
    task: Dict[str, Any] = field(default_factory=dict)
    model_info: Dict[str, Any] = field(default_factory=dict)
    model: Optional[nn.Module] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status != "diverged"

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def to_dict(self, history: bool = True) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        if not history:
            out.pop("history")
        return out

    def summary(self) -> str:
        main = {k: v for k, v in self.metrics.items() if k.count("/") == 1}
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(main.items()))
        return f"{self.status} after {self.steps} steps" + (f" — {self.message}" if self.message else "") + \
            (f": {shown}" if shown else "")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "CUDA is not available on this machine.", value=name,
                          choices=["auto", "cpu"])
    return dev


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


#: Bumped whenever the loop changes what training computes for an unchanged model and config, so that a
#: benchmark never reuses a run recorded under older rules as if it were current (see
#: :func:`revision_changes_training`). History: 1, until 2026-12-05; 2, weight decay skips the parameters marked
#: exempt (norm gains of shape ``[H, D]``), where revision 1 decayed every tensor of two or more dimensions.
TRAINING_REVISION = 2


def revision_changes_training(old_revision: int, module: nn.Module) -> bool:
    """Would training ``module`` now compute something other than it did under ``old_revision``? False only
    when every change since then leaves this module's training as it was (revision 1 → 2: both weight-decay
    rules pick the same parameters)."""
    if old_revision == TRAINING_REVISION:
        return False
    if old_revision == 1:
        return any(takes_weight_decay(p) != (p.ndim >= 2) for p in module.parameters() if p.requires_grad)
    return True


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with ``cfg.weight_decay`` on weight matrices only (``takes_weight_decay`` of
    :mod:`atlaslab.registry.weight_decay`: never on biases, norm gains and other parameters marked exempt)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if takes_weight_decay(p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _model_config(module: nn.Module) -> Optional[Dict[str, Any]]:
    """The resolved config of an atlaslab :class:`~atlaslab.models.LanguageModel` (what rebuilds it from a
    checkpoint, e.g. for :mod:`atlaslab.eval`); None for another module."""
    resolved = getattr(module, "resolved", None)
    return resolved.to_dict() if hasattr(resolved, "to_dict") else None


#: what every checkpoint of the loop holds (a file without them is torn, whatever its CRC says)
CHECKPOINT_KEYS = ("version", "config", "task", "model", "optimizer", "rng", "state")


def load_checkpoint(checkpoint_dir: Union[str, Path], map_location: Any = "cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint stored in ``checkpoint_dir`` (None if there is none), checked; a torn ``checkpoint.pt``
    gives the previous one (``checkpoint.prev.pt``), with a warning; both torn raise
    :class:`~atlaslab.train.checkpoint.CorruptCheckpoint`."""
    return read_checkpoint(checkpoint_dir, map_location)[0]


def read_checkpoint(checkpoint_dir: Union[str, Path], map_location: Any = "cpu") -> Tuple[Optional[Dict[str, Any]], str]:
    """``(checkpoint or None, note)``: :func:`load_checkpoint` and the note saying which torn file it fell back
    from (``""`` when it did not)."""
    return ckpt_file.load_with_fallback(Path(checkpoint_dir) / CHECKPOINT_NAME, map_location, CHECKPOINT_KEYS,
                                        describe=lambda c: f"step {c['state'].get('step')}")


def _direction(cfg: TrainConfig, task: Task, metric: str) -> str:
    if cfg.early_stop_mode != "auto":
        return cfg.early_stop_mode
    if metric == task.primary_metric:
        return task.primary_mode
    return "min" if metric.split("/")[-1] in LOWER_IS_BETTER else "max"


def _better(a: float, b: Optional[float], mode: str) -> bool:
    return b is None or (a > b if mode == "max" else a < b)


# --------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------
def train(model: nn.Module, task: Any, cfg: Any = None, callback: Optional[Callback] = None,
          checkpoint_dir: Optional[Union[str, Path]] = None, parallel: Optional[DataParallel] = None,
          **overrides: Any) -> TrainResult:
    """Train ``model`` on ``task`` with ``cfg`` (a TrainConfig, a mapping, or None for defaults; keyword
    ``overrides`` apply on top). See the module docstring for data, metrics, early stopping and resume;
    ``parallel`` trains this process's shard of a data-parallel group."""
    cfg = resolve_train_config(cfg, **overrides)
    task = _token_task(task)
    run = _Run.start(model, task, cfg, Path(checkpoint_dir) if checkpoint_dir is not None else None, parallel)
    if _finished(run.state):                      # a finished run: its stored result
        return run.result()
    run.t_start = time.time() - run.state["elapsed"]
    if run.state["status"] == "running":          # else stopped early at the checkpoint's step: only the end is left
        _loop(run, callback)
    _finish(run, callback)
    return run.result()


def _token_task(task: Any) -> Task:
    """``task`` itself, or the task a node builds; a task that is not a token task cannot be trained here."""
    if not isinstance(task, Task):
        task = build_task(task)
    if not isinstance(task, Task):
        raise TypeError(f"task {getattr(task, 'name', task)!r} is not a token task; it has its own evaluate() "
                        "(e.g. the learnability probe takes a memory learner) and is not trained by train().")
    return task


def _check_checkpoint(ckpt: Mapping[str, Any], ckpt_dir: Path, cfg: TrainConfig, task_info: Mapping[str, Any]) -> None:
    """A checkpoint resumes only with its format version, its settings (but ``RESUMABLE_CHANGES``) and its task."""
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise ConfigError("checkpoint", f"{ckpt_dir / CHECKPOINT_NAME} has format version "
                          f"{ckpt.get('version')}, expected {CHECKPOINT_VERSION}.")
    stored = {**TrainConfig().to_dict(), **ckpt["config"]}      # a field added since: its default
    diff = config_diff(stored, cfg.to_dict())
    if diff:
        changes = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in diff.items())
        raise ConfigError("train", f"the checkpoint in {ckpt_dir} was written with other settings ({changes}); "
                          "use a new checkpoint directory or the original settings.")
    tdiff = config_diff(ckpt["task"], task_info, ignore=())
    if tdiff:
        changes = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in tdiff.items())
        raise ConfigError("task", f"the checkpoint in {ckpt_dir} is of another task ({changes}).")


def _fresh_state() -> Dict[str, Any]:
    """The loop state of a run that has not started (what a checkpoint stores and restores)."""
    return {
        "step": 0, "status": "running", "message": "", "diverged_at": None, "history": [], "best": {},
        "last_train": {}, "last_eval": {}, "final": {}, "acc": {"loss": 0.0, "grad_norm": 0.0, "n": 0},
        "elapsed": 0.0, "train_seconds": 0.0, "finished": False,
    }


def _finished(state: Mapping[str, Any]) -> bool:
    """Whether the run of this loop state has ended (:func:`_finish` ran). A checkpoint written before ``finished``
    was stored has ended exactly when its status is not ``running`` (only the end wrote such a checkpoint then)."""
    return bool(state.get("finished", state["status"] != "running"))


class _Run:
    """One training run: the trained module, its optimiser, the settings and the loop state that the steps of
    :func:`train` share, checkpoint and turn into the :class:`TrainResult`."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, task: Task, cfg: TrainConfig,
                 device: torch.device, ckpt_dir: Optional[Path], task_info: Dict[str, Any],
                 parallel: Optional[DataParallel] = None):
        self.module, self.optimizer, self.task, self.cfg = module, optimizer, task, cfg
        self.device, self.ckpt_dir, self.task_info = device, ckpt_dir, task_info
        self.parallel = parallel
        self.is_main = parallel is None or parallel.is_main
        self.forward_module = module           # what training steps call (DDP around ``module`` when parallel)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.model_info = {"num_parameters": num_parameters(module)}
        metric = cfg.early_stop_metric or task.primary_metric
        prefix = cfg.eval_split + "/"
        self.metric_name = metric[len(prefix):] if metric.startswith(prefix) else metric   # without the split
        self.mode = _direction(cfg, task, self.metric_name)
        self.state: Dict[str, Any] = _fresh_state()
        self.resumed_from: Optional[int] = None
        self.checkpoint_fallback = ""
        self.t_start = time.time()
        self.checked_shapes = False
        self.eval_bs = cfg.eval_batch_size or cfg.batch_size
        self.autocast_dtype = torch.bfloat16 if (cfg.precision == "bf16" and device.type == "cuda") else None
        self.own_shards = False               # data-parallel: each rank reads its own training data (Task.shard_stream)

    @classmethod
    def start(cls, model: nn.Module, task: Task, cfg: TrainConfig, ckpt_dir: Optional[Path],
              parallel: Optional[DataParallel] = None) -> "_Run":
        """Set a run up: the device; the checkpoint in ``ckpt_dir`` checked and restored, or else torch's RNG
        seeded with ``cfg.seed`` (before the task wraps the model, so a task head is seeded too); the wrapped
        module on the device and its optimiser (and, data-parallel, in DDP once restored)."""
        if parallel is not None:
            parallel.check_batch_size(cfg.batch_size)
            cfg.check_micro_batch(parallel.world_size)
        device = resolve_device(cfg.device)
        ckpt, fallback = read_checkpoint(ckpt_dir, map_location="cpu") if ckpt_dir is not None else (None, "")
        task_info = task.info()
        if ckpt is not None:
            _check_checkpoint(ckpt, ckpt_dir, cfg, task_info)
        else:
            torch.manual_seed(cfg.seed)
        module = task.wrap(model)
        module.to(device)
        module.train()
        run = cls(module, make_optimizer(module, cfg), task, cfg, device, ckpt_dir, task_info, parallel)
        run.own_shards = parallel is not None and task.shard_stream(parallel.rank, parallel.world_size)
        if ckpt is not None:
            module.load_state_dict(ckpt["model"])
            run.optimizer.load_state_dict(ckpt["optimizer"])
            run.state = ckpt["state"]
            _set_rng_state(ckpt["rng"])
            task.load_data_state(_rank_data_state(ckpt.get("data"), parallel) if run.own_shards else ckpt.get("data"))
            run.resumed_from = run.state["step"]
            run.checkpoint_fallback = fallback
        if parallel is not None:
            run.forward_module = parallel.wrap(module, device)
        return run

    def result(self) -> TrainResult:
        """The run's result so far (a run still going reads ``completed``)."""
        state = self.state
        metrics = {**state["last_train"], **state["last_eval"], **state["final"]}
        return TrainResult(status=state["status"] if state["status"] != "running" else "completed",
                           steps=state["step"], metrics=metrics, best=dict(state["best"]),
                           history=list(state["history"]), message=state["message"],
                           diverged_at=state["diverged_at"], resumed_from=self.resumed_from,
                           checkpoint_fallback=self.checkpoint_fallback,
                           wall_time_s=state["elapsed"], train_seconds=state.get("train_seconds", 0.0),
                           config=self.cfg.to_dict(), task=self.task_info,
                           model_info=self.model_info, model=self.module)

    def save(self) -> None:
        """Write the checkpoint atomically (nothing without a checkpoint directory, or on a rank other than 0).
        Ranks that read their own data first gather their cursors to rank 0 (a collective: every rank calls this)."""
        if self.ckpt_dir is None:
            return
        data = self.task.data_state()
        if self.own_shards:
            data = {"ranks": self.parallel.gather(data)}
        if not self.is_main:
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.state["elapsed"] = time.time() - self.t_start
        ckpt_file.save({"version": CHECKPOINT_VERSION, "config": self.cfg.to_dict(), "task": self.task_info,
                      "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                      "rng": _rng_state(), "state": self.state, "data": data,
                      "model_config": _model_config(self.module)},
                     self.ckpt_dir / CHECKPOINT_NAME)

    def evaluate(self, split: str, lengths=None) -> Dict[str, float]:
        """The task's metrics on ``split`` (under a forked RNG, so evaluating never shifts training);
        data-parallel, rank 0 evaluates and every rank gets its metrics."""
        device = self.device
        metrics = None
        if self.is_main:
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
                metrics = self.task.evaluate(self.module, split=split, n_examples=self.cfg.eval_examples or None,
                                             batch_size=self.eval_bs, lengths=lengths, device=device,
                                             autocast_dtype=self.autocast_dtype)
        return metrics if self.parallel is None else self.parallel.broadcast(metrics)


def _rank_data_state(data: Optional[Dict[str, Any]], parallel: DataParallel) -> Optional[Dict[str, Any]]:
    """This rank's data cursor from a checkpoint whose ranks each read their own data (``{"ranks": [...]}``)."""
    if data is None:
        return None
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if ranks is None or len(ranks) != parallel.world_size:
        had = "one process" if ranks is None else f"{len(ranks)} workers"
        raise ConfigError("resources.workers_per_trial", f"the checkpoint's training data was read by {had}, each "
                          f"worker its own share of the stream; resume with the same number of workers, not "
                          f"{parallel.world_size}.", value=parallel.world_size)
    return ranks[parallel.rank]


def _loop(run: _Run, callback: Optional[Callback]) -> None:
    """Step until ``cfg.steps``, divergence, an early stop or the callback's stop: each step trains, logs the
    train metrics every ``log_interval``, evaluates every ``eval_interval``, records, checkpoints and reports.

    The order within a step is what makes a checkpoint mean "this step": the step's record goes into the history,
    then the checkpoint due at the step is written, and only then does the callback see the record. A callback that
    copies ``checkpoint.pt`` (the search's trainable, for the Ray checkpoint of each report) therefore copies the
    state of the step it is told about, history included; a run resumed from it starts after that step and never
    calls the callback for it again."""
    cfg, state = run.cfg, run.state
    bar = _progress_bar(run)
    try:
        while state["step"] < cfg.steps:
            t0 = time.perf_counter()
            lr = _train_step(run)
            state["train_seconds"] = state.get("train_seconds", 0.0) + time.perf_counter() - t0
            if lr is None:
                break
            step = state["step"]
            record = _train_metrics(run, step, lr)
            evaluated = (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps
            if evaluated:
                record.update(_evaluate(run, step))          # may end the run: early_stopped
            if record:
                state["history"].append({"step": step, **record})
            if run.ckpt_dir is not None and ((cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)
                                             or (not cfg.checkpoint_interval and evaluated)):
                run.save()           # a collective with data parallelism: every rank reaches it at the same steps
            if record:
                _notify(run, record, step, callback)
            if bar is not None:
                _update_bar(bar, run, record, evaluated)
            if state["status"] != "running":
                break
    finally:
        if bar is not None:
            bar.close()


def _train_step(run: _Run) -> Optional[float]:
    """One optimiser step on the batch of the current step (learning rate from the schedule, clipped gradients);
    the loss and gradient norm go into the interval's accumulators. Returns the learning rate, or None when the
    loss or the gradient norm is not finite: the run is then ``diverged`` and the parameters are not updated.

    The step's loss is the mean over the scored tokens of the whole (global) batch. With
    ``train.micro_batch_size`` this process's rows go forward and backward that many at a time, each
    micro-batch's mean loss scaled by its share of the scored tokens, so the accumulated gradient is the one
    the whole batch gives in one pass (up to rounding)."""
    cfg, task, state, parallel = run.cfg, run.task, run.state, run.parallel
    step = state["step"]
    if run.own_shards:                     # this rank's rows, read from its own share of the stream
        batch = task.batch("train", step, cfg.batch_size // parallel.world_size, seed=cfg.seed)
    else:
        batch = task.batch("train", step, cfg.batch_size, seed=cfg.seed)
        if parallel is not None:
            batch = parallel.shard(batch)
    m = cfg.micro_batch_size or len(batch)
    micro = [batch.rows(slice(i, i + m)) for i in range(0, len(batch), m)]
    weights = [float(task.loss_weight(mb)) for mb in micro]
    n = parallel.all_sum([sum(weights)])[0] if parallel is not None else sum(weights)
    ranks = parallel.world_size if parallel is not None else 1     # DDP averages the ranks' gradients
    lr = lr_at(cfg, step)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    one_pass = len(micro) == 1 and parallel is None     # the loss is the batch's own mean (no re-weighting)
    loss_sum, loss_v = 0.0, float("nan")
    for i, (mb, w) in enumerate(zip(micro, weights)):
        last = i == len(micro) - 1
        no_sync = run.forward_module.no_sync() if (parallel is not None and not last) else contextlib.nullcontext()
        with no_sync:
            loss, logits = _micro_loss(run, mb.to(run.device, non_blocking=True))
            if w > 0 and n > 0:
                loss_sum += float(loss.detach()) * w
                (loss * (ranks * w / n)).backward()
                if one_pass:
                    loss_v = float(loss.detach())
            else:                          # no scored token here: zero gradients (DDP's all-reduce still runs)
                (logits.sum() * 0.0).backward()
    if not one_pass:
        total = parallel.all_sum([loss_sum])[0] if parallel is not None else loss_sum
        loss_v = total / n if n > 0 else float("nan")
    if not math.isfinite(loss_v):
        state.update(status="diverged", diverged_at=step + 1, message=f"diverged at step {step + 1} (loss = {loss_v})")
        return None
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    gn = float(torch.nn.utils.clip_grad_norm_(run.params, max_norm))
    if not math.isfinite(gn):
        state.update(status="diverged", diverged_at=step + 1,
                     message=f"diverged at step {step + 1} (gradient norm = {gn})")
        return None
    run.optimizer.step()
    state["step"] = step + 1
    acc = state["acc"]
    acc["loss"] += loss_v
    acc["grad_norm"] += gn
    acc["n"] += 1
    return lr


def _micro_loss(run: _Run, batch) -> tuple:
    """``(mean training loss, logits)`` of one (micro-)batch already on the device; the first call checks that
    the model's logits fit the task."""
    with _autocast(run.cfg, run.device):
        logits = forward_batch(run.forward_module, batch)
    task = run.task
    if not run.checked_shapes:
        if logits.shape[:2] != batch.inputs.shape or logits.shape[-1] < task.vocab_size:
            raise ValueError(f"the model maps tokens {tuple(batch.inputs.shape)} to {tuple(logits.shape)}; "
                             f"task {task.name} needs logits [B, T, ≥{task.vocab_size}]")
        run.checked_shapes = True
    return task.loss(logits, batch), logits


def _train_metrics(run: _Run, step: int, lr: float) -> Dict[str, float]:
    """The train metrics (means over the interval) when ``step`` closes a log interval, else ``{}``."""
    cfg, state = run.cfg, run.state
    if not (step % cfg.log_interval == 0 or step == cfg.steps):
        return {}
    acc = state["acc"]
    state["last_train"] = {"train/loss": acc["loss"] / acc["n"], "train/grad_norm": acc["grad_norm"] / acc["n"],
                           "train/lr": lr, "train/tokens": float(step * cfg.batch_size * run.task.seq_len)}
    state["acc"] = {"loss": 0.0, "grad_norm": 0.0, "n": 0}
    return dict(state["last_train"])


def _evaluate(run: _Run, step: int) -> Dict[str, float]:
    """Evaluate on the evaluation split: the metrics (``val/…``); tracks the best value and stops the run
    early once the metric reaches ``early_stop_threshold``."""
    cfg, state, name, mode = run.cfg, run.state, run.metric_name, run.mode
    ev = run.evaluate(cfg.eval_split)
    state["last_eval"] = {f"{cfg.eval_split}/{k}": v for k, v in ev.items()}
    if name not in ev:
        raise ConfigError("train.early_stop_metric", f"task {run.task.name} reports no metric "
                          f"'{name}'.", value=name, choices=sorted(ev))
    value = ev[name]
    if _better(value, state["best"].get("value"), mode):
        state["best"] = {"metric": f"{cfg.eval_split}/{name}", "value": value, "step": step}
    threshold = cfg.early_stop_threshold
    if threshold is not None and (value >= threshold if mode == "max" else value <= threshold):
        state["status"] = "early_stopped"
        state["message"] = f"{cfg.eval_split}/{name} = {value:.4g} reached {threshold} at step {step}"
    bound = cfg.max_step_time_s
    per_step = state.get("train_seconds", 0.0) / max(1, step)
    if bound is not None and state["status"] == "running" and per_step > bound:
        state["status"] = "over_cost"
        state["message"] = (f"a training step took {per_step:.3g} s on average over {step} steps, above "
                            f"train.max_step_time_s = {bound:g}")
    return dict(state["last_eval"])


def _notify(run: _Run, record: Dict[str, float], step: int, callback: Optional[Callback]) -> None:
    """Pass ``record`` (already in the history) to the callback; a callback returning True stops the run."""
    state = run.state
    stop = run.is_main and callback is not None and callback(dict(record), step) is True
    if run.parallel is not None:           # every rank stops when rank 0's callback says so
        stop = run.parallel.broadcast(stop)
    if stop and state["status"] == "running":
        state["status"] = "stopped"
        state["message"] = f"stopped by the callback at step {step}"


def _progress_bar(run: _Run):
    """A tqdm bar (``progress: always``, or ``auto`` on a terminal), else None."""
    cfg = run.cfg
    if not run.is_main or not (cfg.progress == "always" or (cfg.progress == "auto" and sys.stdout.isatty())):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=run.state["step"], desc=run.task.name, dynamic_ncols=True, file=sys.stdout)


def _update_bar(bar, run: _Run, record: Mapping[str, float], evaluated: bool) -> None:
    """One step on the bar; the loss (and the evaluation metric) when the step logged."""
    bar.update(1)
    if record:
        state, name = run.state, run.metric_name
        post = {"loss": f"{state['last_train'].get('train/loss', float('nan')):.4f}"}
        if evaluated:
            post[name] = f"{state['last_eval'][f'{run.cfg.eval_split}/{name}']:.4f}"
        bar.set_postfix(post)


def _finish(run: _Run, callback: Optional[Callback]) -> None:
    """End of the loop: a run still going is ``completed``; unless it diverged, the final evaluation on the
    test split (and at ``test_lengths``) goes to the history and the callback; the checkpoint is written."""
    cfg, state = run.cfg, run.state
    if state["status"] == "running":
        state["status"] = "completed"
    if state["status"] != "diverged" and cfg.final_eval:
        final = {f"{cfg.test_split}/{k}": v for k, v in run.evaluate(cfg.test_split).items()}
        if cfg.test_lengths:
            final.update({f"{cfg.test_split}/{k}": v
                          for k, v in run.evaluate(cfg.test_split, cfg.test_lengths).items()})
        state["final"] = final
        state["history"].append({"step": state["step"], **final})
        if callback is not None and run.is_main:
            callback(dict(final), state["step"])
    state["elapsed"] = time.time() - run.t_start
    state["finished"] = True
    run.save()


__all__ = ["CHECKPOINT_NAME", "Callback", "TrainResult", "load_checkpoint", "make_optimizer", "num_parameters",
           "read_checkpoint",
           "resolve_device", "train"]
