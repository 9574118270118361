"""A trial's record → the objects it trains: its task, its training config and its model.

Shared by the one-process trial (:mod:`atlaslab.search.trainable`) and every Ray Train worker of a multi-worker
trial (:mod:`atlaslab.search.workers`), so that all of them build the same thing from the same record.
"""
from __future__ import annotations

from typing import Any, Mapping, Tuple

import torch

from atlaslab.models.presets import build_model
from atlaslab.search.expand import model_config
from atlaslab.tasks.base import build_task
from atlaslab.train.config import TrainConfig, resolve_train_config


def build_trial(trial: Mapping[str, Any]) -> Tuple[Any, TrainConfig, torch.nn.Module]:
    """``(task, train config, model)`` of a trial, the model seeded with the training seed. The model is the
    one the driver validated (``trial["model_config"]``); a trial recorded before trials carried it (a run
    folder of an older version, resumed) builds it from its preset and overrides."""
    cfg = trial["config"]
    task = build_task(cfg["task"])
    tcfg = resolve_train_config(cfg["train"], "train")
    torch.manual_seed(tcfg.seed)
    mcfg = trial.get("model_config")
    model = build_model(mcfg if mcfg is not None else model_config(cfg["model"], task.vocab_size))
    return task, tcfg, model
