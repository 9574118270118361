"""A trial's record → the objects it trains (its task, its training config and its model) and the zero-shot
evaluation it runs after training (its ``eval.lm_eval`` node).

Shared by the one-process trial (:mod:`atlaslab.search.trainable`) and every Ray Train worker of a multi-worker
trial (:mod:`atlaslab.search.workers`), so that all of them build the same thing from the same record.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from atlaslab.eval import run_lm_eval, tokenizer_for
from atlaslab.models.presets import build_model
from atlaslab.search.expand import model_config
from atlaslab.tasks.base import build_task
from atlaslab.train.config import TrainConfig, resolve_train_config
from atlaslab.train.loop import TrainResult


def build_trial(trial: Mapping[str, Any]) -> Tuple[Any, TrainConfig, torch.nn.Module]:
    """``(task, train config, model)`` of a trial, the model seeded with the training seed. The model is the
    one the driver validated: its typed config (``trial["resolved_model"]``, a ResolvedLM, built as it is, without
    a second validation), else its recorded config (``trial["model_config"]``); a trial recorded before trials
    carried either (a run folder of an older version, resumed) builds it from its preset and overrides."""
    cfg = trial["config"]
    task = build_task(cfg["task"])
    tcfg = resolve_train_config(cfg["train"], "train")
    torch.manual_seed(tcfg.seed)
    mcfg = trial.get("resolved_model") or trial.get("model_config")
    model = build_model(mcfg if mcfg is not None else model_config(cfg["model"], task.vocab_size))
    return task, tcfg, model


def lm_eval_node(trial: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The trial's ``eval.lm_eval`` node (None without one)."""
    return (trial["config"].get("eval") or {}).get("lm_eval")


def lm_eval_after_training(result: TrainResult, task: Any, node: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    """The trial's ``eval.lm_eval`` metrics (``lm_eval/<task>/<metric>``) on the trained model: {} without the
    node or when the run diverged."""
    if not node or result.diverged or result.model is None:
        return {}
    return run_lm_eval(result.model, tokenizer_for(task.info()), node, max_length=task.seq_len)
