"""The trials' results of a run folder: one record per trial, read from Ray Tune's results.

    records = collect(prepared, tuner.fit(), run_dir, partial=interrupted, statuses=saved_statuses(tune_path))
    records = read_records(run_dir, prepared, state, refresh=True)       # results.json, or Tune's folder
    picked = pick_trial(run_dir)               # a finished run folder's best trial (or pick_trial(run_dir, "t003"))

A record holds what a report needs of a trial: its place in the experiment (key, setting, variant, row,
axes, protocol, seed, params; ``candidate`` for a search scored on several settings), ``status`` (``completed`` / ``early_stopped`` / ``diverged`` / ``error`` /
``pruned``, and ``unfinished`` / ``pending`` for an experiment that has not finished), ``failed``,
``message``, the final ``metrics``, the learning curve (``history``), the validated model's ``info`` and
the ``train`` / ``task`` settings. The driver writes them to ``results.json``; :mod:`.report` reads them.

:func:`pick_trial` finds one trial of a finished run folder, by key or the best by the experiment's ``metric`` and
``mode``: what ``atlaslab export`` (:mod:`.export`) and ``atlaslab export-preset`` (:mod:`.preset_export`) write.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from omegaconf import OmegaConf

from atlaslab.registry import ConfigError
from atlaslab.search.aggregate import OK
from atlaslab.search.expand import Prepared, trial_from_params
from atlaslab.search.fitness import candidates, cells, is_multi, ranked_candidates
from atlaslab.search.schema import ExperimentConfig, load_experiment
from atlaslab.search.space import decode_params

RESULTS_NAME = "results.json"
#: a search's draws rejected before training (:mod:`atlaslab.search.searcher` writes it)
REJECTED_NAME = "rejected.json"
#: a search's synonymous choices, run with ``search.synonyms: allow`` (:mod:`atlaslab.search.synonyms`)
SYNONYMS_NAME = "synonyms.json"
#: the trial fields a record keeps
PLACE_KEYS = ("key", "index", "setting", "variant", "label", "row", "axes", "protocol", "seed", "params",
              "candidate")
#: Tune statuses of a trial that a resume continues
WAITING = ("RUNNING", "PENDING", "PAUSED")


def saved_trials(tune_path: os.PathLike) -> Dict[str, Tuple[str, Dict[str, Any]]]:
    """Trial folder name → ``(status, last result)`` in Tune's newest saved experiment state (what a restore
    resumes from: a trial continues from the checkpoint of that result, or the one before it)."""
    files = sorted(Path(tune_path).glob("experiment_state-*.json"))
    if not files:
        return {}
    try:
        data = json.loads(files[-1].read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for entry in data.get("trial_data", []):
        pair = entry if isinstance(entry, (list, tuple)) else [entry]
        try:
            t = json.loads(pair[0])
            meta = json.loads(pair[1]) if len(pair) > 1 else {}
        except (TypeError, ValueError):
            continue
        name = t.get("custom_dirname") or t.get("relative_logdir") or t.get("trial_id")
        last = meta.get("last_result") if isinstance(meta, dict) else None
        out[str(name)] = (str(t.get("status")), last if isinstance(last, dict) else {})
    return out


def saved_statuses(tune_path: os.PathLike) -> Dict[str, str]:
    """Trial folder name → status in Tune's newest saved experiment state (what a restore resumes from;
    after an interruption the in-memory trials read TERMINATED although they will be resumed)."""
    return {name: status for name, (status, _) in saved_trials(tune_path).items()}


def collect(p: Prepared, result_grid, run_dir: Path, partial: bool = False,
            statuses: Optional[Mapping[str, str]] = None) -> List[Dict[str, Any]]:
    """One record per trial from Tune's results: status, reason, final metrics, learning curve.

    ``partial`` (an experiment that has not finished): a trial without its final result is ``unfinished``
    rather than stopped by the scheduler, and a grid's trials Tune has not started are ``pending``."""
    records = [_record(p, r, partial, statuses or {}) for r in result_grid]
    if partial and p.exp.kind == "grid":
        seen = {r["key"] for r in records}
        records += [_pending_record(t) for t in p.trials if t["key"] not in seen]
    records.sort(key=lambda r: (r.get("index", 0), str(r["key"])))
    return records


def read_records(run_dir: Path, p: Prepared, state: Mapping[str, Any], refresh: bool = False) -> List[Dict[str, Any]]:
    """The records of a run folder: ``results.json``, or (without it, or with ``refresh``) collected again
    from Tune's experiment folder, partial unless the experiment finished."""
    run_dir = Path(run_dir)
    rp = run_dir / RESULTS_NAME
    if rp.is_file() and not refresh:
        return json.loads(rp.read_text())
    tune_path = Path(state.get("tune_path") or run_dir / "ray" / "tune")
    if not tune_path.is_dir() or not any(tune_path.glob("experiment_state-*.json")):
        raise ConfigError("run_dir", f"{run_dir} has no results yet (no Tune experiment state in {tune_path}).",
                          value=str(run_dir))
    from ray.tune import ExperimentAnalysis, ResultGrid
    return collect(p, ResultGrid(ExperimentAnalysis(str(tune_path))), run_dir,
                   partial=state.get("status") != "finished", statuses=saved_statuses(tune_path))


def _record(p: Prepared, r, partial: bool, statuses: Mapping[str, str]) -> Dict[str, Any]:
    """The record of one Tune result."""
    cfg = r.config or {}
    key = Path(str(r.path)).name if r.path else None
    if cfg.get("trial"):
        trial = dict(cfg["trial"])
    else:
        trial = trial_from_params(p.exp, decode_params(p.exp.space, cfg), key=str(key))
        trial["info"] = {}
    m = _clean_metrics(r.metrics or {})
    status, message = _status(r, m, statuses.get(str(key)), partial)
    info = dict(trial.get("info") or {})
    for k in ("num_parameters", "state_size"):
        if k not in info and k in m:
            info[k] = m[k]
    rec = {k: trial[k] for k in PLACE_KEYS if k in trial}
    rec.update({"status": status, "failed": status in ("error", "diverged"), "message": message, "metrics": m,
                "history": _history(r), "info": {k: v for k, v in info.items() if k not in ("train", "task")},
                "train": (info.get("train") or trial["config"].get("train")),
                "task": trial["config"].get("task"), "path": str(r.path)})
    return rec


def _status(r, m: Mapping[str, Any], saved: Optional[str], partial: bool) -> Tuple[str, str]:
    """``(status, message)`` of a Tune result with (clean) metrics ``m``; ``saved``: its status in Tune's
    saved state."""
    waiting = (f"last report at step {m.get('step')}" if m else "not started")
    if saved in WAITING and r.error is None and m.get("final") != 1:
        return "unfinished", waiting
    if r.error is not None:
        err = str(r.error).strip().splitlines()
        return "error", next((line for line in reversed(err) if line.strip()), "error")[:500]
    if m.get("final") == 1:
        return str(m.get("status", "completed")), str(m.get("message", "") or "")
    if partial:
        return "unfinished", waiting
    if m:
        return "pruned", f"stopped by the scheduler at step {m.get('step')}"
    return "error", "the trial reported nothing"


def _history(r) -> List[Dict[str, Any]]:
    """The learning curve of a Tune result: ``step`` and the split metrics of every report (NaN → None)."""
    try:
        df = r.metrics_dataframe
    except Exception:
        df = None
    if df is None or not len(df):
        return []
    keep = [c for c in df.columns if "/" in c or c == "step"]
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            for row in df[keep].to_dict("records")]


def _pending_record(t: Mapping[str, Any]) -> Dict[str, Any]:
    """The record of a grid trial Tune has not started."""
    rec = {k: t[k] for k in PLACE_KEYS if k in t}
    rec.update({"status": "pending", "failed": False, "message": "not started", "metrics": {}, "history": [],
                "info": {k: v for k, v in (t.get("info") or {}).items() if k not in ("train", "task")},
                "train": t["config"].get("train"), "task": t["config"].get("task"), "path": ""})
    return rec


def _clean_metrics(m: Mapping[str, Any]) -> Dict[str, Any]:
    """A Tune result's scalars (booleans as ints), without the config and the experiment's meta."""
    out = {}
    for k, v in (m or {}).items():
        if k in ("config",) or k.startswith("experiment"):
            continue
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float, str)) or v is None:
            out[k] = v
    return out


def read_rejected(run_dir: Path) -> Dict[str, Any]:
    """``{"rejected": [{number, params, reason, path}, …], "stopped": why the search stopped drawing, or ""}`` of a
    search's run folder (nothing rejected: empty)."""
    path = Path(run_dir) / REJECTED_NAME
    if not path.is_file():
        return {"rejected": [], "stopped": ""}
    return json.loads(path.read_text())


def read_synonyms(run_dir: Path) -> List[Dict[str, Any]]:
    """The synonymous choices a search ran with (``[{key, labels, where, checked}, …]``; none: empty)."""
    path = Path(run_dir) / SYNONYMS_NAME
    return json.loads(path.read_text()) if path.is_file() else []


# --------------------------------------------------------------------------------------------------
# one trial of a finished run folder
# --------------------------------------------------------------------------------------------------
def read_state(run_dir: Path) -> Dict[str, Any]:
    """The run folder's ``state.json`` (ConfigError when the folder is not an experiment's)."""
    p = Path(run_dir) / "state.json"
    if not p.is_file():
        raise ConfigError("run_dir", f"{run_dir} is not an experiment run folder (no state.json).", value=str(run_dir))
    return json.loads(p.read_text())


def finished_records(run_dir: Path) -> List[Dict[str, Any]]:
    """The records of ``results.json`` (ConfigError without it: the experiment has not finished)."""
    path = Path(run_dir) / RESULTS_NAME
    if not path.is_file():
        raise ConfigError("run_dir", f"{run_dir} has no {RESULTS_NAME} (the experiment has not finished; "
                          "`atlaslab report` collects a partial one).", value=str(run_dir))
    return json.loads(path.read_text())


def expanded_trials(run_dir: Path) -> Dict[str, Dict[str, Any]]:
    """Trial key → the trial of ``trials.json`` (a grid's expanded trials, each with its validated
    ``model_config``; a search's trials are made as it runs, so only its corners are there); {} without it."""
    p = Path(run_dir) / "trials.json"
    return {t["key"]: t for t in json.loads(p.read_text())} if p.is_file() else {}


def best_record(records: List[Mapping[str, Any]], metric: str, mode: str) -> Mapping[str, Any]:
    """The finished trial (completed, or stopped early at its threshold) with the best final ``metric`` (``mode`` max
    or min); ties: the first."""
    scored = [r for r in records if r.get("status") in OK
              and isinstance((r.get("metrics") or {}).get(metric), (int, float))
              and math.isfinite(r["metrics"][metric])]
    if not scored:
        raise ConfigError("trial", f"no finished trial has a final {metric!r}; name a trial to export.",
                          choices=[r["key"] for r in records])
    sign = 1.0 if mode == "max" else -1.0
    return max(scored, key=lambda r: sign * r["metrics"][metric])


def best_candidate_record(exp: ExperimentConfig, records: List[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """For a search scored on several settings: the trial, on the experiment's first setting, of the candidate with
    the best score among those that finished every setting (None when none did). The candidate's model is the same
    on every setting but for the budget's size, which each setting chose at its own length."""
    done = [c for c in ranked_candidates(exp, candidates(exp, records)) if c["status"] in OK]
    if not done:
        return None
    first = cells(exp)[0][0]                # the first setting (on the first seed, with several)
    key = done[0]["trials"].get(first)
    return next((r for r in records if r["key"] == key), None)


@dataclass
class PickedTrial:
    """One trial of a finished run folder (:func:`pick_trial`)."""

    run_dir: Path
    state: Dict[str, Any]                 # state.json
    exp: ExperimentConfig                 # experiment.yaml, validated
    records: List[Dict[str, Any]]         # results.json
    record: Dict[str, Any]                # the picked trial's record
    best: Optional[Dict[str, Any]]        # the best completed trial's record (None when no trial completed)

    @property
    def is_best(self) -> bool:
        return self.best is not None and self.record["key"] == self.best["key"]


def pick_trial(run_dir: Any, trial: Optional[str] = None) -> PickedTrial:
    """Trial ``trial`` (a key such as ``t003``) of the finished run folder ``run_dir``, or (``None``) the best
    completed one by the experiment's ``metric`` and ``mode`` (a search on several settings: the best candidate's
    trial on the first setting, :func:`best_candidate_record`). An unknown key, or no completed trial to choose
    from, is a ConfigError that lists the trial keys."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    exp = load_experiment(node=OmegaConf.to_container(OmegaConf.load(run_dir / "experiment.yaml")))
    records = finished_records(run_dir)
    if is_multi(exp):                    # a search scored on several settings: the best candidate by its score
        best = best_candidate_record(exp, records)
    else:
        best = best_record(records, exp.metric, exp.mode) if any(r.get("status") in OK for r in records) \
            else None
    if trial is None and best is None and is_multi(exp):
        raise ConfigError("trial", "no candidate finished every setting; name a trial to export.",
                          choices=[r["key"] for r in records])
    if trial is None:
        record = best if best is not None else best_record(records, exp.metric, exp.mode)   # raises, naming them
    else:
        by_key = {r["key"]: r for r in records}
        if trial not in by_key:
            raise ConfigError("trial", f"no trial {trial!r} in {run_dir}.", value=trial, choices=list(by_key))
        record = by_key[trial]
    return PickedTrial(run_dir, state, exp, records, record, best)


__all__ = ["PickedTrial", "REJECTED_NAME", "RESULTS_NAME", "best_candidate_record", "best_record", "collect", "expanded_trials", "finished_records",
           "pick_trial", "read_records", "read_rejected", "read_synonyms", "read_state", "saved_statuses", "saved_trials"]
