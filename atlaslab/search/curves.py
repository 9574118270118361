"""The learning curves of a run folder as one small CSV, ``curves.csv``, beside ``trials.csv``.

    write_curves(run_dir, records)     # records: results.json's list (each with its ``history``)
    read_curves(path)                  # → {trial key: [{"step": 25, "val/accuracy": 0.42, ...}, ...]}

One line per trial and logged step: the trial's ``key``, ``variant``, ``row`` and ``seed``, the ``step``, then one
column per metric the trials logged (``val/accuracy``, ``train/loss``, ...; a metric a step did not log is empty).
These are the values each trial reported to Ray Tune at that step, the same as its MLflow metric history; they are
what a results page needs to recompute "steps to 0.9" or redraw a curve without the run's checkpoints or MLflow
store. The columns are sorted, the lines in the records' order, so a run folder rewritten from the same
``results.json`` gives the same file.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from atlaslab.search.formatting import finite_number

_value = finite_number          # a finite number, or None (missing, NaN, text)
CURVES_NAME = "curves.csv"
PLACE = ("key", "variant", "row", "seed", "step")


def curve_metrics(records: Sequence[Mapping[str, Any]]) -> List[str]:
    """The metric columns: every ``split/name`` key some history entry holds a number for, sorted. Tune's flattened
    trial config (``config/...``), which its results carry beside the metrics, is not a metric."""
    return sorted({k for r in records for h in r.get("history") or [] for k, v in h.items()
                   if "/" in k and not k.startswith("config/") and _value(v) is not None})


def write_curves(run_dir: Path, records: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``run_dir/curves.csv`` from the records' histories; returns its path."""
    metrics = curve_metrics(records)
    path = Path(run_dir) / CURVES_NAME
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(PLACE) + metrics)
        for r in records:
            for h in r.get("history") or []:
                step = _value(h.get("step"))
                vals = [_value(h.get(m)) for m in metrics]
                if step is None or all(v is None for v in vals):
                    continue
                w.writerow([r.get("key"), r.get("variant"), r.get("row"), r.get("seed"), int(step)]
                           + ["" if v is None else repr(v) for v in vals])
    return path


def read_curves(path: Path) -> Dict[str, List[Dict[str, Any]]]:
    """Trial key → its logged steps, each ``{"step": int, "variant", "row", "seed": int, metric: float}`` with
    the metrics that step logged (empty cells left out), in file order."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    with open(path, newline="") as f:
        for line in csv.DictReader(f):
            entry: Dict[str, Any] = {"step": int(line["step"]), "variant": line["variant"], "row": line["row"],
                                     "seed": int(line["seed"])}
            entry.update({k: float(v) for k, v in line.items() if k not in PLACE and v not in ("", None)})
            out.setdefault(line["key"], []).append(entry)
    return out


def first_step(curve: Sequence[Mapping[str, Any]], metric: str, threshold: float, mode: str = "max") -> Optional[int]:
    """The first logged step at which ``metric`` reached ``threshold`` (≥ for ``max``, ≤ for ``min``); None if
    it never did. The same rule as the run report's "steps to" column."""
    for h in curve:
        v = h.get(metric)
        if v is not None and (v >= threshold if mode == "max" else v <= threshold):
            return int(h["step"])
    return None


def first_step_of_mean(curves: Sequence[Sequence[Mapping[str, Any]]], metric: str, threshold: float) -> Optional[int]:
    """The first logged step at which the mean of ``metric`` over several curves (one trial per setting of a
    multi-task score) reached ``threshold``; None if it never did or a curve logged no value.

    At a step some curve did not log, that curve counts with its last value before the step: a trial that ended
    early (early stopping at its target) holds its final value, and one that has logged nothing yet counts as 0.
    This is "steps to 0.9" for a score that is the plain mean over settings, read from the curves the trials
    reported, so the rule needs no rerun."""
    series = [{int(h["step"]): float(h[metric]) for h in c if h.get(metric) is not None} for c in curves]
    if not series or any(not s for s in series):
        return None
    for step in sorted(set().union(*series)):
        held = [s[max(k for k in s if k <= step)] if any(k <= step for k in s) else 0.0 for s in series]
        if sum(held) / len(held) >= threshold:
            return step
    return None


__all__ = ["CURVES_NAME", "curve_metrics", "first_step", "first_step_of_mean", "read_curves", "write_curves"]
