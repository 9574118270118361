"""A run's records → report rows: one row per (setting, variant, axis values), seeds averaged as mean ± sample
std, the protocol's best (lr, weight decay) chosen by the mean of the metric, deltas against the baseline row,
``report.averages`` columns, steps to a threshold, the per-length test metric, and MAD scores.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict, defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.schema import ExperimentConfig

OK = ("completed", "early_stopped")


def mean_std(vals: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def _better(a: float, b: Optional[float], mode: str) -> bool:
    return b is None or (a > b if mode == "max" else a < b)


def report_metrics(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[str]:
    """The table's metric columns: ``report.metrics`` (default: ``metric`` and its test twin), then each
    ``report.averages`` column not listed there."""
    if exp.report.metrics:
        out = list(exp.report.metrics)
    else:
        split, _, name = exp.metric.partition("/")
        out = []
        test = f"test/{name}"
        if any(test in r.get("metrics", {}) for r in records) and split != "test":
            out.append(test)
        out.append(exp.metric)
    return out + [a for a in exp.report.averages if a not in out]


def with_averages(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """``records`` with each ``report.averages`` column added to every record's metrics: the mean of the listed
    metrics for that trial (absent when the trial lacks one of them), so seeds then average it as any metric."""
    if not exp.report.averages:
        return list(records)
    out = []
    for r in records:
        metrics = dict(r.get("metrics") or {})
        for name, parts in exp.report.averages.items():
            vals = [_num(metrics.get(m)) for m in parts]
            if vals and all(v is not None for v in vals):
                metrics[name] = sum(vals) / len(vals)
        out.append({**r, "metrics": metrics})
    return out


def steps_to(record: Mapping[str, Any], metric: str, threshold: float, mode: str) -> Optional[float]:
    """The first evaluation step at which ``metric`` reached ``threshold`` (None if it never did)."""
    for h in record.get("history") or []:
        v = _num(h.get(metric))
        if v is not None and (v >= threshold if mode == "max" else v <= threshold):
            return _num(h.get("step"))
    return None


def aggregate(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Report rows (grid): one per (setting, variant, axis values); seeds averaged, protocol maximised."""
    records = with_averages(exp, records)
    metrics = report_metrics(exp, records)
    groups: "OrderedDict[str, List[Mapping[str, Any]]]" = OrderedDict()
    for r in records:
        groups.setdefault(r["row"], []).append(r)
    baseline_variant = None
    if exp.grid is not None and exp.grid.variants:
        baseline_variant = exp.grid.baseline or next(iter(exp.grid.variants))
    rows = []
    for row, recs in groups.items():
        by_point: "OrderedDict[str, List[Mapping[str, Any]]]" = OrderedDict()
        for r in recs:
            by_point.setdefault(json.dumps(r.get("protocol", {}), sort_keys=True), []).append(r)
        best_key, best_val = None, None
        for pk, prs in by_point.items():
            m, _ = mean_std([_num(r["metrics"].get(exp.metric)) for r in prs if r["status"] in OK])
            if m is not None and _better(m, best_val, exp.mode):
                best_key, best_val = pk, m
        chosen = by_point[best_key] if best_key is not None else next(iter(by_point.values()))
        ok = [r for r in chosen if r["status"] in OK]
        first = recs[0]
        out = {"row": row, "setting": first.get("setting"), "variant": first.get("variant"),
               "label": first.get("label"), "axes": first.get("axes", {}),
               "protocol": json.loads(best_key) if best_key else {}, "n_ok": len(ok), "n": len(chosen),
               "n_failed": sum(r["failed"] for r in recs), "n_trials": len(recs),
               "num_parameters": (first.get("info") or {}).get("num_parameters"),
               "state_size": (first.get("info") or {}).get("state_size"),
               "keys": [r["key"] for r in chosen], "baseline": False}
        for m in metrics:
            mean, std = mean_std([_num(r["metrics"].get(m)) for r in ok])
            out[m] = mean
            out[m + " std"] = std
        if exp.report.steps_to is not None:
            hit = [steps_to(r, exp.metric, exp.report.steps_to, exp.mode) for r in ok]
            out["steps_to"], out["steps_to std"] = mean_std([h for h in hit if h is not None])
            out["steps_to n"] = sum(h is not None for h in hit)
        steps = [_num(r["metrics"].get("step")) for r in ok]
        out["steps"] = max([s for s in steps if s is not None], default=None)
        lengths = _length_metrics(ok, exp.report.length_metric)
        out["lengths"] = lengths
        if baseline_variant is not None:
            out["baseline"] = first.get("variant") == baseline_variant
        rows.append(out)
    if baseline_variant is None and rows:
        seen = set()
        for r in rows:
            if r["setting"] not in seen:
                r["baseline"] = True
                seen.add(r["setting"])
    for r in rows:
        base = _baseline_of(r, rows, baseline_variant)
        for m in metrics:
            r[m + " delta"] = (r[m] - base[m]) if (base is not None and r[m] is not None and base[m] is not None
                                                     and base is not r) else None
    return rows


def _baseline_of(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], variant: Optional[str]):
    for r in rows:
        if r["setting"] != row["setting"] or not r["baseline"]:
            continue
        if variant is None or r["axes"] == row["axes"]:
            return r
    return None


def _length_metrics(recs: Sequence[Mapping[str, Any]], name: str) -> Dict[int, Tuple[float, Optional[float]]]:
    pat = re.compile(rf"^test/len_(\d+)/{re.escape(name)}$")
    vals: Dict[int, List[float]] = defaultdict(list)
    for r in recs:
        for k, v in r["metrics"].items():
            m = pat.match(k)
            if m and _num(v) is not None:
                vals[int(m.group(1))].append(float(v))
    return {L: mean_std(v) for L, v in sorted(vals.items())}


def mad_scores(rows: Sequence[Mapping[str, Any]], metric: str) -> Dict[str, Dict[str, float]]:
    """variant label → {task: mean over its settings of the best-protocol value, "mad_score": mean}.

    Setting names ``<task>/<change>`` group by ``<task>`` (MAD's difficulty grid)."""
    out: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        v = r.get(metric)
        if v is not None:
            out[r["label"]][str(r["setting"]).split("/")[0]].append(v)
    scores = {}
    for label, per_task in out.items():
        s = {t: sum(v) / len(v) for t, v in per_task.items()}
        s["mad_score"] = sum(s.values()) / len(s)
        scores[label] = s
    return scores


def ranked_trials(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """A search's trials that reported ``metric``, best first."""
    ok = [r for r in records if _num(r["metrics"].get(exp.metric)) is not None]
    ok.sort(key=lambda r: _num(r["metrics"].get(exp.metric)), reverse=exp.mode == "max")
    return ok


_mean_std = mean_std     # the name report.py has always offered (docs/gen_seed_table.py)

__all__ = ["OK", "aggregate", "mad_scores", "mean_std", "ranked_trials", "report_metrics", "steps_to",
           "with_averages"]
