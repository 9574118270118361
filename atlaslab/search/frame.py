"""A run folder as pandas DataFrames, for notebooks: one row per trial, and the learning curves.

    import atlaslab
    df = atlaslab.load_results("runs/quickstart-20261201-170507")      # one row per trial
    df.groupby("row")["test/accuracy"].agg(["mean", "std", "count"])   # mean ± std over the seeds
    curves = atlaslab.load_curves("runs/quickstart-20261201-170507")   # one row per (trial, report)

:func:`load_results` columns: ``key``, ``setting``, ``candidate`` (a search scored on several settings: the draw
the trial belongs to, one per setting; "" otherwise: ``df.groupby("candidate")``), ``variant``, ``row`` (variant and axes: the report's row),
``seed``, ``status``, ``message``, ``steps``, ``num_parameters``, ``state_size``, ``params`` (the trial's
parameters, a dict), ``axes`` and ``protocol`` (dicts), ``config`` (the trial's config: ``model``, ``task``,
``train``, a dict), then one column per final metric (``test/accuracy``, ``val/loss``, ``test/len_32/accuracy``, …).

The folder is read from what :mod:`.driver` and :mod:`.report` write: ``results.json`` (every record, with the
learning curves) when present, else ``trials.csv`` (final metrics; committed sweeps keep only that) with
``trials.json`` for the configs. A run still going has neither yet: ``atlaslab report RUN_DIR`` collects what
Tune has. A folder of ``atlaslab train`` (``result.json``, ``config.yaml``) reads as a frame of one row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping

import pandas as pd
from omegaconf import OmegaConf

from atlaslab.registry import ConfigError
from atlaslab.search.results import RESULTS_NAME, expanded_trials

#: the leading columns of :func:`load_results`, in order (the final metrics follow)
COLUMNS = ("key", "setting", "candidate", "variant", "row", "seed", "status", "message", "steps", "num_parameters",
           "state_size", "params", "axes", "protocol", "config")
#: the columns of :func:`load_curves` that name the trial (the step and the metrics follow)
CURVE_KEYS = ("key", "setting", "variant", "row", "seed")


def load_results(run_dir: str | Path) -> pd.DataFrame:
    """One row per trial of a run folder: its place (variant, row, seed), config, status and final metrics.

    Args:
        run_dir: a folder written by ``atlaslab run`` (or ``atlaslab train``).

    Returns:
        A DataFrame (columns :data:`COLUMNS`, then the metrics, named as logged); ``df.attrs["run_dir"]``.
    """
    run_dir = _folder(run_dir)
    if (run_dir / RESULTS_NAME).is_file():
        rows = [_row_of_record(r, expanded_trials(run_dir)) for r in json.loads((run_dir / RESULTS_NAME).read_text())]
    elif (run_dir / "trials.csv").is_file():
        rows = _rows_of_csv(run_dir)
    elif (run_dir / "result.json").is_file():
        rows = [_row_of_train_run(run_dir)]
    else:
        raise ConfigError("run_dir", f"{run_dir} has no results.json, trials.csv or result.json (a run still going: "
                          f"`atlaslab report {run_dir}` collects what Tune has).", value=str(run_dir))
    df = pd.DataFrame(rows)
    metrics = sorted(c for c in df.columns if c not in COLUMNS)
    df = df.reindex(columns=list(COLUMNS) + metrics)
    df.attrs["run_dir"] = str(run_dir)
    return df


def load_curves(run_dir: str | Path) -> pd.DataFrame:
    """The learning curves of a run folder, long form: one row per trial and report of the training loop.

    Columns: :data:`CURVE_KEYS`, ``step``, then every metric reported at that step (NaN where a report did not
    carry it: ``train/*`` every ``log_interval``, ``val/*`` every ``eval_interval``, ``test/*`` at the end).
    ``curves.pivot_table(index="step", columns="row", values="val/accuracy")`` gives one column per row (seed
    mean). Needs ``results.json`` (or ``result.json`` of ``atlaslab train``): ``trials.csv`` keeps no curves.
    """
    run_dir = _folder(run_dir)
    rows: List[Dict[str, Any]] = []
    if (run_dir / RESULTS_NAME).is_file():
        for r in json.loads((run_dir / RESULTS_NAME).read_text()):
            place = {k: r.get(k) for k in CURVE_KEYS}
            rows += [{**place, **h} for h in r.get("history") or []]
    elif (run_dir / "result.json").is_file():
        place = {k: v for k, v in _row_of_train_run(run_dir).items() if k in CURVE_KEYS}
        rows += [{**place, **h} for h in json.loads((run_dir / "result.json").read_text()).get("history") or []]
    else:
        raise ConfigError("run_dir", f"{run_dir} has no results.json: its learning curves were not kept (trials.csv "
                          "holds the final metrics only; load_results reads it).", value=str(run_dir))
    df = pd.DataFrame(rows)
    metrics = sorted(c for c in df.columns if c not in CURVE_KEYS and c != "step")
    df = df.reindex(columns=list(CURVE_KEYS) + ["step"] + metrics)
    df.attrs["run_dir"] = str(run_dir)
    return df


# --------------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------------
def _folder(run_dir: str | Path) -> Path:
    p = Path(run_dir).expanduser()
    if not p.is_dir():
        raise ConfigError("run_dir", f"{p} is not a folder.", value=str(p))
    return p


def _metrics(m: Mapping[str, Any]) -> Dict[str, float]:
    """The split metrics (``test/accuracy``, ``val/loss``, …) of a record, as numbers (None → NaN)."""
    return {k: (float("nan") if v is None else float(v)) for k, v in m.items()
            if "/" in k and (v is None or isinstance(v, (int, float)) and not isinstance(v, bool))}


def _row_of_record(r: Mapping[str, Any], trials: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    t = trials.get(r["key"], {})
    info = r.get("info") or {}
    config = t.get("config") or {"task": r.get("task"), "train": r.get("train")}
    m = r.get("metrics") or {}
    return {"key": r["key"], "setting": r.get("setting"), "candidate": r.get("candidate") or "",
            "variant": r.get("variant", t.get("variant")),
            "row": r.get("row"), "seed": r.get("seed"), "status": r.get("status"), "message": r.get("message", ""),
            "steps": m.get("step"), "num_parameters": info.get("num_parameters"),
            "state_size": info.get("state_size"), "params": dict(r.get("params") or {}),
            "axes": dict(r.get("axes") or {}), "protocol": dict(r.get("protocol") or {}), "config": config,
            **_metrics(m)}


def _rows_of_csv(run_dir: Path) -> List[Dict[str, Any]]:
    trials = expanded_trials(run_dir)
    csv = pd.read_csv(run_dir / "trials.csv", dtype={"key": str, "message": str}, keep_default_na=False,
                      na_values=[""])
    rows = []
    for rec in csv.to_dict("records"):
        t = trials.get(rec["key"], {})
        msg = rec.get("message")
        cand = rec.get("candidate")
        rows.append({"key": rec["key"], "setting": rec.get("setting"),
                     "candidate": "" if cand is None or pd.isna(cand) else str(cand), "variant": t.get("variant"),
                     "row": rec.get("row"), "seed": rec.get("seed"), "status": rec.get("status"),
                     "message": "" if pd.isna(msg) else msg, "steps": rec.get("steps"),
                     "num_parameters": rec.get("num_parameters"), "state_size": rec.get("state_size"),
                     "params": json.loads(rec.get("params") or "{}"), "axes": dict(t.get("axes") or {}),
                     "protocol": json.loads(rec.get("protocol") or "{}"), "config": t.get("config") or {},
                     **{k: v for k, v in rec.items() if "/" in k}})
    return rows


def _row_of_train_run(run_dir: Path) -> Dict[str, Any]:
    res = json.loads((run_dir / "result.json").read_text())
    cfg_path = run_dir / "config.yaml"
    config = OmegaConf.to_container(OmegaConf.load(cfg_path)) if cfg_path.is_file() else {}
    info = res.get("model_info") or {}
    name = str(config.get("name") or run_dir.name)
    return {"key": run_dir.name, "setting": "", "candidate": "", "variant": name, "row": name,
            "seed": (res.get("config") or {}).get("seed"), "status": res.get("status"),
            "message": res.get("message", ""), "steps": res.get("steps"),
            "num_parameters": info.get("num_parameters"), "state_size": info.get("state_size"), "params": {},
            "axes": {}, "protocol": {}, "config": {k: config[k] for k in ("model", "task", "train") if k in config},
            **_metrics(res.get("metrics") or {})}


__all__ = ["COLUMNS", "CURVE_KEYS", "load_curves", "load_results"]
