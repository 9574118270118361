"""Zero-shot benchmarks with lm-evaluation-harness (``pip install 'atlaslab[eval]'``) on a trained model.

An experiment asks for them with an ``eval.lm_eval`` node, validated before any trial starts (lm-eval installed,
every task known to its task index, local task folders included), and run by each trial after training:

    eval:
      lm_eval: {tasks: [lambada_openai, my_cloze], limit: 200, include_path: lm_tasks/}

The metrics join the trial's final metrics (and its MLflow run) as ``lm_eval/<task>/<metric>``
(``lm_eval/my_cloze/acc``, ``lm_eval/my_cloze/acc_stderr``; a filter other than ``none`` is appended to the
metric name). Tasks whose data is not on the machine fail to load: offline, use local task YAMLs over local
files (``dataset_path: json`` with ``dataset_kwargs: {data_files: …}``) in ``include_path``.

A model is rebuilt from a training loop's checkpoint folder by :func:`atlaslab.eval.checkpoint.load_trained` (the checkpoint holds the
resolved model config and the task, whose tokenizer it names); ``lm_eval`` itself is imported only by the
functions that need it.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from atlaslab.registry import ConfigError, check_range, local_path, validate_structured
from atlaslab.tasks.tokenizer import Tokenizer

PREFIX = "lm_eval"


@dataclass
class LMEvalConfig:
    """The ``eval.lm_eval`` node: which lm-eval tasks, on how many documents."""

    tasks: List[str] = field(default_factory=list)     # task or group names (lm-eval's, or include_path's)
    limit: Optional[float] = None    # documents per task (≥ 1), or a fraction of each (< 1); None: all
    num_fewshot: Optional[int] = None
    batch_size: int = 16             # sequences per forward when scoring
    max_length: int = 0              # context tokens (0: the task's training length)
    max_gen_toks: int = 128          # generate_until's default budget (a task's gen_kwargs may set its own)
    include_path: str = ""           # a folder of local task YAMLs
    builtin_tasks: bool = True       # index lm-eval's own tasks too (false: only include_path's; ~10 s less)
    bootstrap_iters: int = 0         # lm-eval's bootstrap for the stderr of non-mean metrics (0: none)
    seed: int = 0                    # lm-eval's random, numpy, torch and few-shot seeds

    def check(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks", "name at least one lm-eval task.", value=[])
        if self.limit is not None and not (self.limit > 0 and math.isfinite(self.limit)):
            raise ConfigError("limit", "must be a positive number (documents, or a fraction < 1).", value=self.limit)
        if self.num_fewshot is not None:
            check_range("num_fewshot", self.num_fewshot, 0, None)
        check_range("batch_size", self.batch_size, 1, None)
        check_range("max_length", self.max_length, 0, None)
        check_range("max_gen_toks", self.max_gen_toks, 1, None)
        check_range("bootstrap_iters", self.bootstrap_iters, 0, None)
        if self.include_path and not Path(local_path(self.include_path)).is_dir():
            raise ConfigError("include_path", f"no such folder {self.include_path!r}.", value=self.include_path)
        if not self.builtin_tasks and not self.include_path:
            raise ConfigError("builtin_tasks", "with builtin_tasks: false, give include_path (the local tasks).",
                              value=False)


def _require_lm_eval(path: str) -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(path, "lm-eval is not installed (pip install 'atlaslab[eval]').")


def task_manager(include_path: str = "", builtin_tasks: bool = True):
    """lm-eval's task index: its own tasks (``builtin_tasks``) and the YAMLs under ``include_path``; built once per
    process for each folder (indexing lm-eval's own ~14 000 tasks takes seconds)."""
    return _task_manager(local_path(include_path) if include_path else "", bool(builtin_tasks))


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str, builtin_tasks: bool):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path or None, include_defaults=builtin_tasks)


def resolve_lm_eval(node: Any, path: str = "eval.lm_eval", check_tasks: bool = True) -> LMEvalConfig:
    """Validate an ``lm_eval`` node: its fields, lm-eval's presence and (``check_tasks``) that every task is one
    lm-eval knows. Raises ConfigError naming the dotted path."""
    cfg = node if isinstance(node, LMEvalConfig) else validate_structured(LMEvalConfig, node, path, what="lm_eval field")
    _require_lm_eval(path)
    if check_tasks:
        known = task_manager(cfg.include_path, cfg.builtin_tasks).all_tasks
        for i, name in enumerate(cfg.tasks):
            if name not in known:
                raise ConfigError(f"{path}.tasks.{i}", f"lm-eval knows no task {name!r}"
                                  + ("" if cfg.include_path else " (local task YAMLs go in include_path)") + ".",
                                  value=name, choices=_near(name, known))
    return cfg


def _near(name: str, known: Sequence[str]) -> List[str]:
    """A few known task names sharing a prefix with ``name`` (lm-eval knows thousands)."""
    import difflib
    return difflib.get_close_matches(name, list(known), n=5, cutoff=0.5) or sorted(known)[:5]


# --------------------------------------------------------------------------------------------------
# running lm-eval
# --------------------------------------------------------------------------------------------------
def _metric_name(task: str, key: str) -> Optional[str]:
    """``lm_eval/<task>/<metric>`` for a result key ``"acc,none"`` (None for lm-eval's bookkeeping keys), in the
    characters MLflow accepts."""
    if key in ("alias", "name", "sample_len", "samples") or "," not in key:
        return None
    metric, _, filt = key.partition(",")
    name = metric if filt in ("none", "") else f"{metric}_{filt}"
    clean = lambda s: re.sub(r"[^0-9A-Za-z_\-./ ]", "_", s)  # noqa: E731
    return f"{PREFIX}/{clean(task)}/{clean(name)}"


def lm_eval_metrics(results: Mapping[str, Any]) -> Dict[str, float]:
    """Flat ``{lm_eval/<task>/<metric>: value}`` from ``simple_evaluate``'s results (finite numbers only)."""
    out: Dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            name = _metric_name(task, key)
            if name is None or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if math.isfinite(float(value)):
                out[name] = float(value)
    return out


def run_lm_eval(model: torch.nn.Module, tokenizer: Tokenizer, cfg: Any, max_length: int = 0,
                device: Any = None) -> Dict[str, float]:
    """Evaluate ``model`` on ``cfg``'s lm-eval tasks → ``{lm_eval/<task>/<metric>: value}``."""
    cfg = resolve_lm_eval(cfg, check_tasks=False)
    from lm_eval import simple_evaluate
    from atlaslab.eval.harness import AtlaslabLM
    lm = AtlaslabLM(model=model, tokenizer=tokenizer, batch_size=cfg.batch_size,
                    max_length=cfg.max_length or max_length, max_gen_toks=cfg.max_gen_toks, device=device)
    was_training = model.training
    try:
        with torch.random.fork_rng():
            res = simple_evaluate(model=lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                  task_manager=task_manager(cfg.include_path, cfg.builtin_tasks), bootstrap_iters=cfg.bootstrap_iters,
                                  log_samples=False, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                                  torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    finally:
        model.train(was_training)
    return lm_eval_metrics(res or {})


def main(argv: Optional[List[str]] = None) -> int:
    """lm-eval's command line (``lm-eval run --model atlaslab --model_args checkpoint=DIR …``) with the
    ``atlaslab`` model class registered; ``--model hf --model_args pretrained=EXPORTED_DIR`` runs an exported model
    (``atlaslab export``) through lm-eval's own Hugging Face class, since ``import atlaslab`` registers it."""
    _require_lm_eval("lm_eval")
    import lm_eval.models  # noqa: F401  (lm-eval's own classes, "hf" too: it loads them only into an empty registry)
    import atlaslab.eval.harness  # noqa: F401  (registers the model class "atlaslab")
    from lm_eval.__main__ import cli_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    cli_evaluate()
    return 0


__all__ = ["LMEvalConfig", "PREFIX", "lm_eval_metrics", "main", "resolve_lm_eval", "run_lm_eval", "task_manager"]
