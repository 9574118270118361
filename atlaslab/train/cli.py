"""``atlaslab train CONFIG.yaml [key=value ...]``: train one model on one task, print and save the metrics.

A run config has three nodes (plus an optional ``name``)::

    name: mqar-atlas
    model:
      preset: atlas                 # atlaslab/presets/atlas.yaml, or a path to a preset YAML
      overrides: {d_model: 64}      # dotlist list or nested mapping (vocab_size defaults to the task's)
    task: {name: mqar, vocab_size: 128, seq_len: 64, num_kv_pairs: [4]}
    train: {steps: 250, lr: 3e-3, batch_size: 64}

``model`` may instead be an inline model config (a mapping with ``mixers``) or a factory:
``{factory: "my_pkg.models:make", kwargs: {...}}`` — ``make(**kwargs)`` gets ``vocab_size`` (the task's)
when it accepts it and kwargs do not set it. Command-line ``key=value`` overrides (OmegaConf dotlist:
``train.lr=1e-3 task.num_kv_pairs=[8]``) apply on top. Everything is validated before anything runs; a
configuration error prints one line naming the dotted path and exits with status 2.

The run directory (``--run-dir``, default ``runs/<name or config stem>``) holds ``checkpoint.pt``,
``config.yaml`` (the resolved run config) and ``result.json``; running the same command again resumes
from the checkpoint (``--fresh`` starts over). ``atlaslab train`` also logs the run to MLflow like a trial of an
experiment (params, metrics at every report, the final metrics; the store ``runs/mlflow.db`` beside the run folder,
``--tracking-uri`` elsewhere, ``--no-tracking`` none; :mod:`atlaslab.search.train_tracking`; the stand-alone
``python -m atlaslab.train.cli`` of this floor logs nothing). Exit status: 0 for a
finished run (completed, early stop), 3 when it diverged, 2 for a configuration error.

Wiring into the main CLI::

    from atlaslab.train.cli import add_train_parser
    add_train_parser(subparsers)          # sets func=train_command; main calls sys.exit(args.func(args))
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from atlaslab.models.lm import LanguageModel
from atlaslab.models.overrides import parse_override, update_node
from atlaslab.models.presets import build_model, preset_for_task
from atlaslab.registry import ConfigError, to_container
from atlaslab.tasks.base import Task, build_task
from atlaslab.train.config import resolve_train_config
from atlaslab.train.loop import CHECKPOINT_NAME, Callback, TrainResult, train

RUN_KEYS = ("name", "description", "model", "task", "train")


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------
def load_run_config(path: Optional[str] = None, overrides: Sequence[str] = (), node: Any = None) -> DictConfig:
    """The run config from a YAML file (or ``node``) with dotlist ``overrides`` applied (not yet validated)."""
    if node is not None:
        cfg = OmegaConf.create(to_container(node))
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"no such file {path!r}.", value=path)
        try:
            cfg = OmegaConf.load(p)
        except (OmegaConfBaseException, Exception) as exc:  # yaml errors
            raise ConfigError("config", f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError("config", "a run config must be a mapping with model, task and train.")
    for item in overrides:
        key, value = parse_override(item)
        update_node(cfg, key, value, merge=False)
    for key in cfg:
        if key not in RUN_KEYS:
            raise ConfigError(str(key), f"unknown run-config key '{key}'.", value=str(key), choices=list(RUN_KEYS))
    for key in ("model", "task"):
        if key not in cfg:
            raise ConfigError(key, f"the run config needs a '{key}' node.")
    return cfg


def import_callable(spec: str, path: str = "model.factory") -> Callable[..., Any]:
    """``"pkg.module:attr"`` or ``"pkg.module.attr"`` → the object."""
    module, sep, attr = spec.partition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ConfigError(path, f"expected 'package.module:callable', got {spec!r}.", value=spec)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(path, f"cannot import {spec!r} ({exc}).", value=spec) from None
    if not callable(obj):
        raise ConfigError(path, f"{spec!r} is not callable.", value=spec)
    return obj


def build_model_from_node(node: Any, task: Task, path: str = "model") -> nn.Module:
    """Build the model of a run config's ``model`` node for ``task`` (vocab size defaults to the task's).
    Errors are ConfigErrors whose path starts with ``model.``."""
    try:
        return _build_model(node, task, path)
    except ConfigError as exc:
        if exc.path == path or exc.path.startswith(path + "."):
            raise
        raise exc.prefixed(path) from None


def _build_model(node: Any, task: Task, path: str) -> nn.Module:
    node = to_container(node)
    if isinstance(node, str):
        node = {"preset": node}
    if not isinstance(node, dict):
        raise ConfigError(path, f"expected a mapping (preset / factory / inline model config), got {node!r}.")
    if "factory" in node:
        extra = set(node) - {"factory", "kwargs"}
        if extra:
            raise ConfigError(f"{path}.{sorted(extra)[0]}", "a factory model node has only 'factory' and 'kwargs'.",
                              choices=["factory", "kwargs"])
        fn = import_callable(str(node["factory"]), f"{path}.factory")
        kwargs = dict(node.get("kwargs") or {})
        try:
            params = inspect.signature(fn).parameters
            if "vocab_size" not in kwargs and ("vocab_size" in params or any(
                    p.kind == p.VAR_KEYWORD for p in params.values())):
                kwargs["vocab_size"] = task.vocab_size
        except (TypeError, ValueError):
            pass
        model = fn(**kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{path}.factory", f"{node['factory']!r} returned {type(model).__name__}, not an "
                              "nn.Module.")
        return model
    if "preset" in node:
        extra = set(node) - {"preset", "overrides"}
        if extra:
            raise ConfigError(f"{path}.{sorted(extra)[0]}", "a preset model node has only 'preset' and 'overrides'.",
                              choices=["preset", "overrides"])
        _, resolved = preset_for_task(str(node["preset"]), node.get("overrides") or [], task.vocab_size)
        return LanguageModel(resolved)
    inline = dict(node)
    inline.setdefault("vocab_size", task.vocab_size)
    return build_model(inline)


def validate_run_config(cfg: DictConfig) -> tuple:
    """(task, TrainConfig) of a run config, every node validated (ConfigError with a dotted path)."""
    task = build_task(cfg.get("task"), "task")
    tcfg = resolve_train_config(cfg.get("train") or {}, "train")
    return task, tcfg


def run_config(cfg: Any, run_dir: Optional[str] = None, callback: Optional[Callback] = None,
               overrides: Sequence[str] = ()) -> TrainResult:
    """Validate a run config, build the model (seeded by ``train.seed``), train, and return the result.
    Reusable by the search driver: ``run_config(trial_config, run_dir=trial_dir, callback=report)``."""
    if not isinstance(cfg, DictConfig) or overrides:
        cfg = load_run_config(node=cfg, overrides=overrides)
    task, tcfg = validate_run_config(cfg)
    torch.manual_seed(tcfg.seed)
    model = build_model_from_node(cfg.get("model"), task)
    return train(model, task, tcfg, callback=callback, checkpoint_dir=run_dir)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------------
# command
# --------------------------------------------------------------------------------------------------
def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser("train", help="train one model on one task; print and save the metrics",
                              description=__doc__.split("\n\n")[0])
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("config", help="run config YAML (model, task, train)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.lr=1e-3 task.seq_len=128")
    p.add_argument("--run-dir", default=None, help="checkpoint/result folder (default runs/<name>)")
    p.add_argument("--no-checkpoint", action="store_true", help="do not write or resume checkpoints")
    p.add_argument("--fresh", action="store_true", help="delete an existing checkpoint and start over")
    p.add_argument("--device", default=None, help="override train.device (cpu, cuda, auto)")
    p.add_argument("--quiet", action="store_true", help="print only the final JSON")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db beside the "
                   "run folder)")
    p.add_argument("--no-tracking", action="store_true", help="do not log the run to MLflow")
    p.set_defaults(func=train_command)
    return p


def train_command(args: argparse.Namespace, tracker_factory: Optional[Callable[..., Any]] = None) -> int:
    """Run ``atlaslab train``; returns the exit status.

    ``tracker_factory(run_dir, uri)`` (``atlaslab.search.train_tracking.TrainTracker`` from the ``atlaslab``
    command; this floor cannot import it) makes the object that logs the run: ``start(name, config, resumed)``,
    ``log(metrics, step)``, ``end(result)``, ``fail(message)``."""
    try:
        overrides = list(args.overrides or [])
        if args.device:
            overrides.append(f"train.device={args.device}")
        cfg = load_run_config(args.config, overrides)
        task, tcfg = validate_run_config(cfg)
        name = str(cfg.get("name") or Path(args.config).stem)
        run_dir = None if args.no_checkpoint else Path(args.run_dir or Path("runs") / name)
        if run_dir is not None:
            if args.fresh and (run_dir / CHECKPOINT_NAME).exists():
                (run_dir / CHECKPOINT_NAME).unlink()
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        torch.manual_seed(tcfg.seed)
        model = build_model_from_node(cfg.get("model"), task)
    except ConfigError as exc:
        print(f"atlaslab train: config error: {exc}", file=sys.stderr)
        return 2
    tracker = None
    if tracker_factory is not None and not getattr(args, "no_tracking", False):
        tracker = tracker_factory(run_dir, getattr(args, "tracking_uri", None))
        tracker.start(name, to_container(cfg), resumed=run_dir is not None and (run_dir / CHECKPOINT_NAME).exists())

    def report(metrics: Dict[str, float], step: int) -> None:
        if tracker is not None:
            tracker.log(metrics, step)
        if not args.quiet:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                              if k.count("/") == 1 and not k.startswith("train/tokens"))
            print(f"step {step}: {shown}", file=sys.stderr, flush=True)

    try:
        result = train(model, task, tcfg, callback=report, checkpoint_dir=run_dir)
    except BaseException as exc:
        if tracker is not None:
            tracker.fail(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, ConfigError):
            print(f"atlaslab train: config error: {exc}", file=sys.stderr)
            return 2
        raise
    if tracker is not None:
        tracker.end(result)
    out = _json_safe(result.to_dict(history=True))
    if run_dir is not None:
        (run_dir / "result.json").write_text(json.dumps(out, indent=2))
    summary = {k: v for k, v in out.items() if k != "history"}
    print(json.dumps(summary, indent=2))
    if not args.quiet:
        print(f"atlaslab train: {result.summary()}" + (f" (results in {run_dir})" if run_dir else ""),
              file=sys.stderr)
    return 3 if result.diverged else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry point: ``python -m atlaslab.train.cli CONFIG.yaml [overrides]``."""
    parser = configure_parser(argparse.ArgumentParser(prog="atlaslab train", description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    return train_command(args)


if __name__ == "__main__":
    sys.exit(main())
