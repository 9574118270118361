"""``atlaslab export RUN_DIR [TRIAL]``: a trained trial as a Hugging Face model folder, and the best trial's model in
MLflow's model registry.

    folder = export_trial("runs/quickstart")            # the best trial → runs/quickstart/export/<key>/
    folder = export_trial("runs/lm")                    # an `atlaslab train` folder → runs/lm/export/
    model = AutoModelForCausalLM.from_pretrained(folder)  # after `import atlaslab`

The folder holds ``config.json`` + ``model.safetensors`` (:class:`~atlaslab.hf.modeling.AtlaslabForCausalLM`), the
tokenizer the task trained with where it is text (byte, ``hf``, ``bpe_local``: ``tokenizer.json``; synthetic tasks
such as MQAR have none), and ``atlaslab_trial.json`` (the trial's key, variant, seed, metrics and run folder).

The best trial is the experiment's ``metric`` / ``mode`` over the trials that completed. When the exported trial is
the best one and the run folder has an MLflow parent run, the folder is logged as the artifact ``hf_model`` of the
trial's MLflow run and registered as a new version of the registered model ``atlaslab-<experiment>`` (SQLite stores
support the registry).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from atlaslab.eval.checkpoint import tokenizer_for
from atlaslab.eval.hf_tokenizer import to_transformers
from atlaslab.hf.modeling import AtlaslabForCausalLM
from atlaslab.models.lm import LanguageModel
from atlaslab.registry import ConfigError
from atlaslab.search import tracking as T
from atlaslab.search.results import pick_trial
from atlaslab.train.loop import CHECKPOINT_NAME

ARTIFACT = "hf_model"
TRIAL_FILE = "atlaslab_trial.json"


def checkpoint_of(record: Mapping[str, Any]) -> Path:
    """The trial's last ``checkpoint.pt``: in the newest Ray checkpoint the trial reported to the run's storage
    (``<trial folder>/checkpoint_<n>/``; the loop's own working copy lives on the node that ran it), else in a run
    folder written before that change, ``<trial folder>/work/``."""
    folder = Path(str(record.get("path") or ""))
    reported = sorted(folder.glob(f"checkpoint_*/{CHECKPOINT_NAME}"))
    path = reported[-1] if reported else folder / "work" / CHECKPOINT_NAME
    if not path.is_file():
        raise ConfigError("trial", f"trial {record.get('key')} has no checkpoint in {folder}.", value=record.get("key"))
    return path


def load_checkpoint_model(path: Path) -> Tuple[LanguageModel, Dict[str, Any]]:
    """``(LanguageModel in eval mode, task info)`` from a training loop's ``checkpoint.pt``."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("model_config") is None:
        raise ConfigError("trial", f"{path} holds no model config.", value=str(path))
    model = LanguageModel(ckpt["model_config"])
    model.load_state_dict(ckpt["model"])
    return model.eval(), dict(ckpt.get("task") or {})


def export_trial(run_dir: Any, trial: Optional[str] = None, out: Any = None, mlflow: bool = True,
                 registered_name: Optional[str] = None) -> Path:
    """Write trial ``trial`` (a key such as ``t003``; default the best) of ``run_dir`` as a Hugging Face model
    folder (default ``<run_dir>/export/<key>``) and, for the best trial, log and register it in MLflow."""
    run_dir = Path(run_dir)
    if not (run_dir / "state.json").is_file() and (run_dir / CHECKPOINT_NAME).is_file():
        if trial is not None:
            raise ConfigError("trial", f"{run_dir} is a training run (atlaslab train), not a sweep: it has no trials.",
                              value=trial)
        return export_checkpoint(run_dir / CHECKPOINT_NAME, Path(out) if out is not None else run_dir / "export")
    picked = pick_trial(run_dir, trial)
    record, exp = picked.record, picked.exp
    out = Path(out) if out is not None else run_dir / "export" / record["key"]
    tokenizer = _write_folder(checkpoint_of(record), out)
    meta = {k: record.get(k) for k in ("key", "variant", "label", "seed", "status", "metrics")}
    meta.update({"run_dir": str(run_dir.resolve()), "experiment": exp.name, "metric": exp.metric,
                 "mode": exp.mode, "best": picked.is_best,
                 "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None})
    (out / TRIAL_FILE).write_text(json.dumps(meta, indent=2, default=str))
    tr = picked.state.get("tracking") or {}
    if mlflow and meta["best"] and tr.get("parent_run_id"):
        log_and_register(tr, record["key"], out, registered_name or default_registered_name(exp.name))
    return out


def _write_folder(checkpoint: Path, out: Path):
    """The checkpoint's model (and its task's tokenizer, when the task is text) as a Hugging Face folder ``out``;
    returns the atlaslab tokenizer (None for a synthetic task such as MQAR: token ids, no text)."""
    model, info = load_checkpoint_model(checkpoint)
    tokenizer = None
    try:
        tokenizer = tokenizer_for(info)
    except ConfigError:
        pass
    extra = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.eos_id} if tokenizer is not None else {}
    AtlaslabForCausalLM.from_language_model(model, **extra).save_pretrained(out)
    if tokenizer is not None:
        to_transformers(tokenizer).save_pretrained(out)
    return tokenizer


def export_checkpoint(checkpoint: Any, out: Any) -> Path:
    """A training loop's ``checkpoint.pt`` (``atlaslab train``'s run folder) as a Hugging Face folder ``out``."""
    out = Path(out)
    tokenizer = _write_folder(Path(checkpoint), out)
    meta = {"checkpoint": str(Path(checkpoint).resolve()),
            "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None}
    (out / TRIAL_FILE).write_text(json.dumps(meta, indent=2))
    return out


def default_registered_name(experiment: str) -> str:
    return "atlaslab-" + re.sub(r"[^0-9A-Za-z_\-.]", "_", experiment)


def log_and_register(tracking: Mapping[str, Any], key: str, folder: Path, name: str):
    """Log ``folder`` as artifact :data:`ARTIFACT` of trial ``key``'s MLflow run and register it as a new version
    of ``name``. Returns the model version (None when the trial has no MLflow run)."""
    c = T.client(tracking["uri"])
    run = T.find_child(c, tracking["experiment_id"], tracking["parent_run_id"], key)
    if run is None:
        return None
    run_id = run.info.run_id
    T.retry(c.log_artifacts, run_id, str(folder), ARTIFACT, what="log the exported model")
    T.set_tags(c, run_id, {"atlaslab.exported": ARTIFACT})
    if not c.search_registered_models(filter_string=f"name = '{name}'"):
        T.retry(c.create_registered_model, name, what="create the registered model")
    return T.retry(c.create_model_version, name, f"{run.info.artifact_uri}/{ARTIFACT}", run_id=run_id,
                   tags={"atlaslab.trial_key": key}, what="register the model version")


__all__ = ["ARTIFACT", "checkpoint_of", "default_registered_name", "export_checkpoint", "export_trial",
           "load_checkpoint_model", "log_and_register"]
