"""One training loop for every model and task.

    result = train(model, task, TrainConfig(steps=250, lr=3e-3), callback=report, checkpoint_dir="runs/x")
    result.status          # "completed" | "early_stopped" | "stopped" | "diverged"
    result.metrics         # {"train/loss": …, "val/accuracy": …, "test/accuracy": …, "test/len_128/…": …}

* ``model`` is any ``nn.Module`` mapping tokens ``[B, T]`` (long) to logits ``[B, T, V]``; ``task`` a
  :class:`~atlaslab.tasks.Task` or a task node (``{name: mqar, …}``). The task may wrap the model with a
  head (MAD compression); the wrapped module is what is trained, checkpointed and returned as
  ``result.model``.
* AdamW (decay on ≥2-D tensors only), linear warm-up then cosine / linear / constant schedule (the
  learning rate is a pure function of the step), global-norm gradient clipping, bf16 autocast on CUDA
  when ``precision: bf16``.
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
* Checkpoints (``checkpoint_dir``): ``checkpoint.pt`` is written atomically every
  ``checkpoint_interval`` steps and at the end, holding the module, the optimiser, the step, the RNG
  states, the partial metric accumulators, the history and the settings. Calling :func:`train` again
  with the same directory resumes from it (a finished run returns its stored result at once); a run
  killed at any point and resumed ends with the same metrics as an uninterrupted one (CPU, same seed).
  Resuming with different settings (other than ``RESUMABLE_CHANGES``) or a different task is an error.
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
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

from atlaslab.registry import ConfigError
from atlaslab.tasks.base import Task, build_task
from atlaslab.train.config import TrainConfig, config_diff, lr_at, resolve_train_config

Callback = Callable[[Dict[str, float], int], Optional[bool]]
CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_VERSION = 1
LOWER_IS_BETTER = ("loss", "bpb", "ppl", "rel_loss")


@dataclass
class TrainResult:
    """What a training run produced. ``to_dict()`` is JSON-ready (no tensors, no model)."""

    status: str                                   # completed | early_stopped | stopped | diverged
    steps: int                                    # optimiser steps taken
    metrics: Dict[str, float]                     # final: last train + last val + test metrics
    best: Dict[str, Any] = field(default_factory=dict)      # {"metric", "value", "step"} of the eval metric
    history: List[Dict[str, float]] = field(default_factory=list)  # {"step": s, <metrics emitted at s>}
    message: str = ""
    diverged_at: Optional[int] = None
    resumed_from: Optional[int] = None
    wall_time_s: float = 0.0
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


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
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


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(checkpoint_dir: Union[str, Path], map_location: Any = "cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint stored in ``checkpoint_dir`` (None if there is none)."""
    path = Path(checkpoint_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return torch.load(path, map_location=map_location, weights_only=True)


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
          checkpoint_dir: Optional[Union[str, Path]] = None, **overrides: Any) -> TrainResult:
    """Train ``model`` on ``task`` with ``cfg`` (a TrainConfig, a mapping, or None for defaults; keyword
    ``overrides`` apply on top). See the module docstring for data, metrics, early stopping and resume."""
    cfg = resolve_train_config(cfg, **overrides)
    if not isinstance(task, Task):
        task = build_task(task)
    if not isinstance(task, Task):
        raise TypeError(f"task {getattr(task, 'name', task)!r} is not a token task; it has its own evaluate() "
                        "(e.g. the learnability probe takes a memory learner) and is not trained by train().")
    device = resolve_device(cfg.device)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    ckpt = load_checkpoint(ckpt_dir, map_location="cpu") if ckpt_dir is not None else None
    task_info = task.info()

    if ckpt is not None:
        if ckpt.get("version") != CHECKPOINT_VERSION:
            raise ConfigError("checkpoint", f"{ckpt_dir / CHECKPOINT_NAME} has format version "
                              f"{ckpt.get('version')}, expected {CHECKPOINT_VERSION}.")
        diff = config_diff(ckpt["config"], cfg.to_dict())
        if diff:
            changes = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in diff.items())
            raise ConfigError("train", f"the checkpoint in {ckpt_dir} was written with other settings ({changes}); "
                              "use a new checkpoint directory or the original settings.")
        tdiff = config_diff(ckpt["task"], task_info, ignore=())
        if tdiff:
            changes = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in tdiff.items())
            raise ConfigError("task", f"the checkpoint in {ckpt_dir} is of another task ({changes}).")
    else:
        torch.manual_seed(cfg.seed)

    module = task.wrap(model)
    module.to(device)
    module.train()
    optimizer = make_optimizer(module, cfg)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    model_info = {"num_parameters": num_parameters(module)}
    metric_name = cfg.early_stop_metric or task.primary_metric
    metric_name = metric_name[len(cfg.eval_split) + 1:] if metric_name.startswith(cfg.eval_split + "/") else metric_name
    mode = _direction(cfg, task, metric_name)

    state: Dict[str, Any] = {
        "step": 0, "status": "running", "message": "", "diverged_at": None, "history": [], "best": {},
        "last_train": {}, "last_eval": {}, "final": {}, "acc": {"loss": 0.0, "grad_norm": 0.0, "n": 0},
        "elapsed": 0.0,
    }
    resumed_from = None
    if ckpt is not None:
        module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        _set_rng_state(ckpt["rng"])
        resumed_from = state["step"]

    def result() -> TrainResult:
        metrics = {**state["last_train"], **state["last_eval"], **state["final"]}
        return TrainResult(status=state["status"] if state["status"] != "running" else "completed",
                           steps=state["step"], metrics=metrics, best=dict(state["best"]),
                           history=list(state["history"]), message=state["message"],
                           diverged_at=state["diverged_at"], resumed_from=resumed_from,
                           wall_time_s=state["elapsed"], config=cfg.to_dict(), task=task_info,
                           model_info=model_info, model=module)

    if state["status"] != "running":          # a finished run: its stored result
        return result()

    t_start = time.time() - state["elapsed"]

    def save() -> None:
        if ckpt_dir is None:
            return
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        state["elapsed"] = time.time() - t_start
        _save_atomic({"version": CHECKPOINT_VERSION, "config": cfg.to_dict(), "task": task_info,
                      "model": module.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state(),
                      "state": state}, ckpt_dir / CHECKPOINT_NAME)

    eval_bs = cfg.eval_batch_size or cfg.batch_size
    autocast_dtype = torch.bfloat16 if (cfg.precision == "bf16" and device.type == "cuda") else None

    def evaluate(split: str, lengths=None) -> Dict[str, float]:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
            return task.evaluate(module, split=split, n_examples=cfg.eval_examples or None, batch_size=eval_bs,
                                 lengths=lengths, device=device, autocast_dtype=autocast_dtype)

    show = cfg.progress == "always" or (cfg.progress == "auto" and sys.stdout.isatty())
    bar = None
    if show:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=state["step"], desc=task.name, dynamic_ncols=True, file=sys.stdout)

    checked_vocab = False
    try:
        while state["step"] < cfg.steps:
            step = state["step"]
            batch = task.batch("train", step, cfg.batch_size, seed=cfg.seed).to(device, non_blocking=True)
            lr = lr_at(cfg, step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with _autocast(cfg, device):
                logits = module(batch.inputs)
            if not checked_vocab:
                if logits.shape[:2] != batch.inputs.shape or logits.shape[-1] < task.vocab_size:
                    raise ValueError(f"the model maps tokens {tuple(batch.inputs.shape)} to {tuple(logits.shape)}; "
                                     f"task {task.name} needs logits [B, T, ≥{task.vocab_size}]")
                checked_vocab = True
            loss = task.loss(logits, batch)
            loss_v = float(loss.item())
            if not math.isfinite(loss_v):
                state.update(status="diverged", diverged_at=step + 1,
                             message=f"diverged at step {step + 1} (loss = {loss_v})")
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            gn = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if not math.isfinite(gn):
                state.update(status="diverged", diverged_at=step + 1,
                             message=f"diverged at step {step + 1} (gradient norm = {gn})")
                break
            optimizer.step()
            state["step"] = step = step + 1
            acc = state["acc"]
            acc["loss"] += loss_v
            acc["grad_norm"] += gn
            acc["n"] += 1

            record: Dict[str, float] = {}
            if step % cfg.log_interval == 0 or step == cfg.steps:
                state["last_train"] = {"train/loss": acc["loss"] / acc["n"],
                                       "train/grad_norm": acc["grad_norm"] / acc["n"], "train/lr": lr,
                                       "train/tokens": float(step * cfg.batch_size * task.seq_len)}
                record.update(state["last_train"])
                state["acc"] = {"loss": 0.0, "grad_norm": 0.0, "n": 0}
            evaluated = False
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps:
                ev = evaluate(cfg.eval_split)
                evaluated = True
                state["last_eval"] = {f"{cfg.eval_split}/{k}": v for k, v in ev.items()}
                record.update(state["last_eval"])
                if metric_name not in ev:
                    raise ConfigError("train.early_stop_metric", f"task {task.name} reports no metric "
                                      f"'{metric_name}'.", value=metric_name, choices=sorted(ev))
                value = ev[metric_name]
                if _better(value, state["best"].get("value"), mode):
                    state["best"] = {"metric": f"{cfg.eval_split}/{metric_name}", "value": value, "step": step}
                if cfg.early_stop_threshold is not None and (
                        value >= cfg.early_stop_threshold if mode == "max" else value <= cfg.early_stop_threshold):
                    state["status"] = "early_stopped"
                    state["message"] = (f"{cfg.eval_split}/{metric_name} = {value:.4g} reached "
                                        f"{cfg.early_stop_threshold} at step {step}")
            if record:
                state["history"].append({"step": step, **record})
                if callback is not None and callback(dict(record), step) is True and state["status"] == "running":
                    state["status"] = "stopped"
                    state["message"] = f"stopped by the callback at step {step}"
            if bar is not None:
                bar.update(1)
                if record:
                    post = {"loss": f"{state['last_train'].get('train/loss', float('nan')):.4f}"}
                    if evaluated:
                        post[metric_name] = f"{state['last_eval'][f'{cfg.eval_split}/{metric_name}']:.4f}"
                    bar.set_postfix(post)
            if state["status"] != "running":
                break
            if ckpt_dir is not None and ((cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)
                                         or (not cfg.checkpoint_interval and evaluated)):
                save()
    finally:
        if bar is not None:
            bar.close()

    if state["status"] == "running":
        state["status"] = "completed"
    if state["status"] != "diverged" and cfg.final_eval:
        final = {f"{cfg.test_split}/{k}": v for k, v in evaluate(cfg.test_split).items()}
        if cfg.test_lengths:
            final.update({f"{cfg.test_split}/{k}": v for k, v in evaluate(cfg.test_split, cfg.test_lengths).items()})
        state["final"] = final
        state["history"].append({"step": state["step"], **final})
        if callback is not None:
            callback(dict(final), state["step"])
    state["elapsed"] = time.time() - t_start
    save()
    return result()


__all__ = ["CHECKPOINT_NAME", "Callback", "TrainResult", "load_checkpoint", "make_optimizer", "num_parameters",
           "resolve_device", "train"]
