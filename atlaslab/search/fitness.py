"""A fitness of several tasks: how a search candidate trained on every task setting is scored.

    s = score(exp, {"mqar": 0.8, "copy": 0.6})                # ``search.score`` over the settings' ``metric``
    v = combine_objective(exp, "step_time_s", {"mqar": 0.02, "copy": 0.03})
    cands = candidates(exp, records)                            # one record per candidate (its settings' trials)

A search whose experiment declares several settings (``tasks: {setting: task node, …}``) trains each candidate (one
draw of the sampler) on every setting, one trial per setting (:mod:`atlaslab.search.searcher`). The candidate's
value of each objective combines its settings' values:

* the experiment's ``metric`` → the **score** ``search.score``: ``mean`` is Σ_s w_s·m_s / Σ_s w_s (weights default
  to 1), ``worst`` the value of the setting it does worst on (by ``mode``);
* another reported metric (``search.objectives``, ``<split>/<name>``) → combined the same way (``worst`` by that
  objective's own direction);
* ``step_time_s`` → the **mean** over the settings: every setting trains the same candidate for its own steps, so
  with a fixed set of settings the sum and the mean rank candidates alike, and the mean keeps the unit of a
  one-task search (seconds per training step), so the numbers compare with the presets' own runs;
* ``steps_trained`` → the **mean** over the settings: the training steps each setting ran, which with
  ``train.early_stop_threshold`` is the step at which the candidate solved it (its whole budget where it never did);
  minimised, it asks for a candidate that learns every setting in few steps;
* ``state_size`` and ``num_parameters`` → the **max** over the settings: each setting sizes the candidate to the
  budget at its own sequence length, and the memory a deployed model needs is the largest of them.

A value that is missing or not finite on any setting leaves the candidate without that objective (``None``).

**Several seeds** (``seeds: [0, 1, …]`` in a search): each candidate is trained on every setting × seed, one trial
per *cell* (:func:`cells`), and a setting's value of each objective is first the **mean over its seeds**; the
settings then combine as above. A score measured on one seed rewards what happens to work on that seed (a learning
rate that catches MQAR's jump on seed 0 can miss it on every other); the mean over seeds rewards what works on
most, at a cost of the seed count per candidate. With one seed a cell is its setting, named as before.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.aggregate import OK
from atlaslab.search.formatting import finite_number
from atlaslab.search.schema import MODEL_OBJECTIVES, ExperimentConfig

#: objectives taken as the max over the settings (sizes of the model as each setting sized it)
MAX_OBJECTIVES = ("state_size", "num_parameters")
#: objectives taken as the mean over the settings (costs of one training step; the steps a setting took)
MEAN_OBJECTIVES = ("step_time_s", "steps_trained")
#: statuses of a setting's trial that leave its candidate waiting for a result
WAITING_STATUSES = ("unfinished", "pending")


def settings_of(exp: ExperimentConfig) -> List[str]:
    """The experiment's setting names, in the file's order."""
    return list(exp.settings())


def cell_name(exp: ExperimentConfig, setting: str, seed: int) -> str:
    """The name of a candidate's trial on ``setting`` and ``seed``: the setting's name when the experiment has one
    seed, else ``<setting>@<seed>``."""
    return str(setting) if len(exp.seeds) == 1 else f"{setting}@{int(seed)}"


def cells(exp: ExperimentConfig) -> List[Tuple[str, str, int]]:
    """``[(cell name, setting, seed), …]``: what a search trains each candidate on, every setting × every seed (in
    the file's order, seeds inner)."""
    return [(cell_name(exp, s, seed), s, int(seed)) for s in settings_of(exp) for seed in exp.seeds]


def is_multi(exp: ExperimentConfig) -> bool:
    """Whether a search trains each candidate on several cells (settings, or seeds)."""
    return exp.kind == "search" and len(cells(exp)) > 1


def per_setting(exp: ExperimentConfig, values: Mapping[str, Any]) -> Dict[str, Optional[float]]:
    """Setting → the mean of its cells' ``values`` (``values``: cell name → value) over the experiment's seeds; None
    for a setting with a seed missing or not finite (its candidate then has no value: a mean over fewer seeds
    would compare unlike with the others)."""
    out: Dict[str, Optional[float]] = {}
    for setting in settings_of(exp):
        vals = [finite_number(values.get(cell_name(exp, setting, seed))) for seed in exp.seeds]
        out[setting] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    return out


def cell_score(exp: ExperimentConfig, values: Mapping[str, Any]) -> Optional[float]:
    """The score of a candidate from its cells' ``metric`` (cell name → value): :func:`per_setting`, then
    :func:`score`."""
    return score(exp, per_setting(exp, values))


def _combine(values: Mapping[str, float], settings: Sequence[str], how: str, weights: Mapping[str, float],
             mode: str) -> Optional[float]:
    vals = {s: finite_number(values.get(s)) for s in settings}
    if not settings or any(v is None for v in vals.values()):
        return None
    if how == "worst":
        return min(vals.values()) if mode == "max" else max(vals.values())
    w = {s: float(weights.get(s, 1.0)) for s in settings}
    return sum(w[s] * vals[s] for s in settings) / sum(w.values())


def score(exp: ExperimentConfig, values: Mapping[str, Any]) -> Optional[float]:
    """The score of a candidate: ``search.score`` over its settings' ``metric`` (``values``: setting → value)."""
    node = exp.search.score
    return _combine(values, settings_of(exp), node.combine, node.weights, exp.mode)


def combine_objective(exp: ExperimentConfig, name: str, values: Mapping[str, Any], mode: str = "max") -> Optional[float]:
    """The candidate's value of objective ``name`` (``mode``: its direction) from its settings' ``values``."""
    settings = settings_of(exp)
    if name == exp.metric:
        return score(exp, values)
    if name in MAX_OBJECTIVES:
        vals = [finite_number(values.get(s)) for s in settings]
        return None if any(v is None for v in vals) else max(vals)
    if name in MEAN_OBJECTIVES:
        return _combine(values, settings, "mean", {}, mode)
    node = exp.search.score
    return _combine(values, settings, node.combine, node.weights, mode)


def candidate_status(statuses: Mapping[str, str], settings: Sequence[str]) -> str:
    """A candidate's status from its settings' trials: failed (``error`` / ``diverged``) if one failed, else
    ``over_cost`` if one went over the step-cost bound (``train.max_step_time_s``), else ``pruned`` if one was
    stopped by the scheduler, ``unfinished`` while one has no final result, else ``completed``."""
    got = [statuses.get(s, "unfinished") for s in settings]
    for bad in ("error", "diverged", "over_cost"):
        if bad in got:
            return bad
    if "pruned" in got:
        return "pruned"
    if any(s not in OK for s in got):
        return "unfinished"
    return "completed"


def candidates(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """One record per candidate of a search with several settings, shaped like a trial's record so that the
    report's ranking, Pareto front, importances and marginals read it as they read a trial:

    ``key`` / ``candidate`` (its id), ``params`` (the draw: the searched keys, without the budget's sizes, which
    differ per setting), ``status`` and ``failed`` (:func:`candidate_status`), ``message`` (the first failed
    setting's), ``metrics`` (the experiment's ``metric`` holds the **score**; every other objective and
    ``step_time_s`` combined by :func:`combine_objective`; ``step``: steps trained over all settings), ``info``
    (``state_size``, ``num_parameters``: the max), ``by_setting`` (setting → that setting's ``metric``), ``trials``
    (setting → its trial's key) and ``sizes`` (setting → the budget's size chosen there)."""
    names_of_cells = [c for c, _, _ in cells(exp)]
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    groups: "OrderedDict[str, Dict[str, Mapping[str, Any]]]" = OrderedDict()
    for r in records:
        cid = r.get("candidate")
        if cid:
            cell = cell_name(exp, str(r.get("setting")), int(r.get("seed", exp.seeds[0])))
            groups.setdefault(str(cid), {})[cell] = r
    out = []
    for cid, by in groups.items():
        first = next(iter(by.values()))
        sized = set(exp.budget.size_by)
        params = {k: v for k, v in (first.get("params") or {}).items() if k not in sized}
        status = candidate_status({c: r["status"] for c, r in by.items()}, names_of_cells)
        metrics: Dict[str, Any] = {}
        names = [n for n, _ in pairs] + [n for n in MEAN_OBJECTIVES if n not in dict(pairs)]
        for name in names:
            mode = dict(pairs).get(name, "min")
            v = combine_objective(exp, name, per_setting(exp, {c: _value(r, name) for c, r in by.items()}), mode)
            if v is not None:
                metrics[name] = v
        metrics["step"] = sum(finite_number((r.get("metrics") or {}).get("step")) or 0 for r in by.values())
        info = {}
        for name in MAX_OBJECTIVES:
            v = combine_objective(exp, name, per_setting(exp, {c: _value(r, name) for c, r in by.items()}))
            if v is not None:
                info[name] = int(v)
        failed = [by[c] for c in names_of_cells if c in by and by[c].get("failed")]
        out.append({
            "key": cid, "candidate": cid, "index": first.get("index", 0), "setting": "", "row": cid,
            "label": first.get("label", cid), "params": params, "status": status, "failed": bool(failed),
            "message": (f"{_cell_of(exp, failed[0])}: {failed[0].get('message', '')}" if failed else ""),
            "metrics": metrics, "info": info, "history": [],
            "by_setting": per_setting(exp, {c: _value(r, exp.metric) for c, r in by.items()}),
            "by_cell": {c: _value(by[c], exp.metric) if c in by else None for c in names_of_cells},
            "trials": {c: by[c]["key"] for c in names_of_cells if c in by},
            "sizes": {c: ((by[c].get("info") or {}).get("budget") or {}).get("size") for c in names_of_cells
                      if c in by},
            "train": first.get("train"), "task": None,
        })
    out.sort(key=lambda c: (c["index"], c["key"]))
    return out


def ranked_candidates(exp: ExperimentConfig, cands: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The candidates with a score, best first: those that finished on every setting first, then those stopped early
    on some setting (their score mixes shorter training, so it does not outrank a finished one)."""
    scored = [c for c in cands if finite_number(c["metrics"].get(exp.metric)) is not None]
    sign = -1.0 if exp.mode == "max" else 1.0
    return sorted(scored, key=lambda c: (c["status"] not in OK, sign * c["metrics"][exp.metric]))


def _cell_of(exp: ExperimentConfig, record: Mapping[str, Any]) -> str:
    """The cell name of a candidate's trial record (its setting, and its seed when the search has several)."""
    return cell_name(exp, str(record.get("setting")), int(record.get("seed", exp.seeds[0])))


def _value(record: Mapping[str, Any], name: str) -> Optional[float]:
    """A trial's value of ``name``: a reported metric, else a measure of its validated model."""
    v = finite_number((record.get("metrics") or {}).get(name))
    if v is None and name in MODEL_OBJECTIVES:
        v = finite_number((record.get("info") or {}).get(name))
    return v


__all__ = ["MAX_OBJECTIVES", "MEAN_OBJECTIVES", "candidate_status", "candidates", "cell_name", "cell_score", "cells",
           "combine_objective", "is_multi", "per_setting", "ranked_candidates", "score", "settings_of"]
