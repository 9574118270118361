"""Reference models on a search's Pareto axes: each variant of a grid run (the presets, tuned on their own learning
rates) placed at its best point by the objective the search itself used.

    run = load_reference_run(search_exp, "runs/presets")     # a ReferenceRun, validated once (ConfigError: "compare")
    ref = run.references[0]                                    # a Reference: ref.label, ref.protocol, ref.value(name)

A reference is one row of the grid: a variant at its axis values, without the setting. Each of its protocol points
(learning rate, weight decay) is scored as a search candidate is (:func:`atlaslab.search.fitness.combine_objective`,
with the *search's* experiment): every setting's value is the mean over the point's seeds, then the search's
``metric`` becomes its score (``search.score`` over the settings), ``step_time_s`` the mean over the settings, and
``state_size`` / ``num_parameters`` the max. Only points whose trials finished with the metric on every setting of the
search count; the reference sits at the best of them by the score (ties: the lower step time, then the protocol's
order). A variant with no such point is kept unplaced (``values`` empty), so that a report says so.

The run is read from its folder's ``trials.csv`` (what ``atlaslab report`` writes; a committed ``data/`` folder holds
the same file), so a live run folder and a committed one are read alike.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from omegaconf import OmegaConf

from atlaslab.registry import ConfigError, to_container
from atlaslab.search.aggregate import OK
from atlaslab.search.fitness import MAX_OBJECTIVES, MEAN_OBJECTIVES, combine_objective
from atlaslab.search.formatting import finite_number
from atlaslab.search.schema import MODEL_OBJECTIVES, ExperimentConfig, load_experiment
from atlaslab.search.tables import TRIAL_COSTS

#: the field a bad reference run is reported under (the report command's ``--compare``)
FIELD = "compare"


@dataclass(frozen=True)
class Reference:
    """One variant of a reference run at its best protocol point (``values`` empty: no point finished every
    setting). ``values``: objective → the variant's value as the search computes a candidate's (the search's metric
    holds the score); ``by_setting``: setting → its metric (mean over seeds); ``points``: the protocol points that
    finished every setting (what the choice was made among)."""

    label: str
    protocol: Mapping[str, Any] = field(default_factory=dict)
    values: Mapping[str, float] = field(default_factory=dict)
    by_setting: Mapping[str, float] = field(default_factory=dict)
    seeds: int = 0
    points: int = 0

    @property
    def placed(self) -> bool:
        return bool(self.values)

    def value(self, name: str) -> Optional[float]:
        return self.values.get(name)


@dataclass(frozen=True)
class ReferenceRun:
    """A validated reference run: its folder, its experiment's name and its variants placed (:class:`Reference`)."""

    path: Path
    name: str
    references: Tuple[Reference, ...]


def _bad(reason: str, value: Any, path: str = FIELD) -> ConfigError:
    return ConfigError(path, reason, value=value)


def _key(node: Any) -> str:
    return json.dumps(to_container(node), sort_keys=True, default=str)


def check_compatible(exp: ExperimentConfig, ref: ExperimentConfig, where: str) -> None:
    """A reference run must be a grid scored by the search's metric on every setting of the search, with the same
    task at each (else its numbers are not on the search's axes): a ConfigError naming what differs."""
    if exp.kind != "search":
        raise _bad("only a search's report draws reference models on its Pareto axes (this run is a grid).", where)
    if ref.kind != "grid":
        raise _bad(f"{where} is a search; reference models come from a grid run (e.g. presets × learning rates).",
                   where)
    if (ref.metric, ref.mode) != (exp.metric, exp.mode):
        raise _bad(f"{where} is scored by {ref.metric} ({ref.mode}), the search by {exp.metric} ({exp.mode}).", where)
    theirs = ref.settings()
    for s, task in exp.settings().items():
        if s not in theirs:
            raise ConfigError(f"{FIELD}.tasks.{s}", f"{where} has no setting {s!r} of the search.", value=s,
                              choices=list(theirs))
        if _key(theirs[s]) != _key(task):
            raise ConfigError(f"{FIELD}.tasks.{s}", f"{where} trained setting {s!r} on another task "
                              f"({_key(theirs[s])}) than the search ({_key(task)}).", value=s)


def read_trials(path: Path) -> List[Dict[str, Any]]:
    """The rows of a run folder's ``trials.csv`` as records: ``key``, ``setting``, ``row``, ``seed``, ``protocol``,
    ``status``, ``metrics`` (every ``<split>/<name>`` column and the trial's costs) and ``info`` (sizes)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            metrics = {k: float(v) for k, v in r.items()
                       if ("/" in k or k in TRIAL_COSTS) and finite_number(_float(v)) is not None}
            info = {k: int(float(r[k])) for k in MAX_OBJECTIVES if finite_number(_float(r.get(k))) is not None}
            out.append({"key": r["key"], "setting": r.get("setting") or "", "row": r.get("row") or "",
                        "seed": r.get("seed"), "protocol": json.loads(r.get("protocol") or "{}"),
                        "status": r.get("status") or "", "metrics": metrics, "info": info})
    return out


def _float(v: Any) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _trial_value(record: Mapping[str, Any], name: str) -> Optional[float]:
    v = finite_number(record["metrics"].get(name))
    if v is None and name in MODEL_OBJECTIVES:
        v = finite_number(record["info"].get(name))
    return v


def _label(record: Mapping[str, Any], multi: bool) -> str:
    """The row without its setting (a multi-setting grid's row is ``<setting> · <variant>``)."""
    row, prefix = str(record["row"]), f"{record['setting']} · "
    return row[len(prefix):] if multi and row.startswith(prefix) else row


def place(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], multi: bool = True) -> List[Reference]:
    """Each variant of a grid run's ``records`` (:func:`read_trials`) at its best protocol point by the search's
    objective (``exp``: the search; see the module docstring), in the run's order. ``multi``: the rows carry their
    setting (``<setting> · <variant>``)."""
    settings = list(exp.settings())
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    modes = dict(pairs)
    names = [n for n, _ in pairs] + [n for n in MEAN_OBJECTIVES + MAX_OBJECTIVES if n not in modes]
    # variant → protocol point → setting → its trials (the seeds)
    groups: Dict[str, Dict[str, Dict[str, List[Mapping[str, Any]]]]] = {}
    protocols: Dict[str, Mapping[str, Any]] = {}
    for r in records:
        point = json.dumps(r["protocol"], sort_keys=True)
        protocols[point] = r["protocol"]
        groups.setdefault(_label(r, multi), {}).setdefault(point, {}).setdefault(r["setting"], []).append(r)
    out = []
    for label, by_point in groups.items():
        best: Optional[Tuple[Tuple[float, float], Reference]] = None
        n_points = 0
        for point, by_setting in by_point.items():
            runs = [by_setting.get(s, []) for s in settings]
            if not all(runs) or any(t["status"] not in OK or _trial_value(t, exp.metric) is None
                                    for ts in runs for t in ts):
                continue
            n_points += 1
            values: Dict[str, float] = {}
            for name in names:
                per = {s: _mean([_trial_value(t, name) for t in by_setting[s]]) for s in settings}
                v = combine_objective(exp, name, per, modes.get(name, "min"))
                if v is not None:
                    values[name] = v
            if exp.metric not in values:
                continue
            sign = 1.0 if exp.mode == "max" else -1.0
            rank = (sign * values[exp.metric], -(values.get("step_time_s") or 0.0))
            if best is None or rank > best[0]:
                ref = Reference(label=label, protocol=dict(protocols[point]), values=values,
                                by_setting={s: _mean([_trial_value(t, exp.metric) for t in by_setting[s]])
                                            for s in settings},
                                seeds=min(len(by_setting[s]) for s in settings))
                best = (rank, ref)
        if best is None:
            out.append(Reference(label=label))
        else:
            r = best[1]
            out.append(Reference(r.label, r.protocol, r.values, r.by_setting, r.seeds, n_points))
    return out


def _mean(vals: Sequence[Optional[float]]) -> Optional[float]:
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def load_reference_run(exp: ExperimentConfig, path: Union[str, Path]) -> ReferenceRun:
    """Validate the reference run folder ``path`` against the search ``exp`` and place its variants; a folder that is
    missing, is not a grid run, has no ``trials.csv``, or was trained on other settings is a ConfigError under
    ``compare`` saying which."""
    where = str(path)
    path = Path(path)
    if not path.is_dir():
        raise _bad(f"{where} is not a run folder (no such directory).", where)
    if not (path / "experiment.yaml").is_file():
        raise _bad(f"{where} has no experiment.yaml: not a run folder written by `atlaslab run`.", where)
    try:
        ref = load_experiment(node=OmegaConf.to_container(OmegaConf.load(path / "experiment.yaml")))
    except ConfigError as exc:
        raise _bad(f"{where}/experiment.yaml does not validate ({exc}).", where) from None
    check_compatible(exp, ref, where)
    if not (path / "trials.csv").is_file():
        raise _bad(f"{where} has no trials.csv yet (`atlaslab report {where}` writes it).", where)
    refs = place(exp, read_trials(path / "trials.csv"), multi=len(ref.settings()) > 1)
    if not refs:
        raise _bad(f"{where}/trials.csv has no trials.", where)
    return ReferenceRun(path=path, name=ref.name, references=tuple(refs))


__all__ = ["FIELD", "Reference", "ReferenceRun", "check_compatible", "load_reference_run", "place", "read_trials"]
