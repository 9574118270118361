"""What a search learned about its space: the candidates it tried, its Pareto front, and which choices mattered.

    lines = search_analysis(exp, records, run_dir)      # markdown sections of a search's report

* **Candidates.** Every draw the searcher made: trained (by status) and rejected before training
  (``rejected.json``, :mod:`atlaslab.search.searcher`), the rejections grouped by reason with an example of each.
* **Pareto front.** With ``search.objectives``, the trials no other finished trial dominates on every objective
  (the metric, then each objective in its own direction), best metric first.
* **Presets against the front.** With reference runs (``atlaslab report RUN --compare PRESETS_RUN``,
  :mod:`atlaslab.search.references`), each reference variant at its best point by the search's objective: its
  objectives, the front's members that dominate it (:func:`dominates`), those it dominates, and whether the front
  dominates the references' own front.
* **Importance.** Optuna's PED-ANOVA importance of each searched key for the metric (the share of the metric's
  variation over the good trials a key explains; Optuna ≥ 3.6), computed from the finished trials.
* **Marginals.** For each categorical key, each choice's finished trials: count, mean ± std and best of the metric.
  A marginal averages over everything else the search varied, so it says which choice did well *in this search*,
  not which is best alone.

A search scored on several settings passes its candidates (:func:`atlaslab.search.fitness.candidates`) instead of its
trials: each section then reads the candidate's score where it reads a trial's metric.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.aggregate import OK, mean_std
from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.formatting import fmt_value, human_count, short_key
from atlaslab.search.schema import ExperimentConfig
from atlaslab.search.results import read_rejected, read_synonyms
from atlaslab.search.synonyms import Synonym
from atlaslab.search.space import optuna_distributions, optuna_value
from atlaslab.search.tables import fmt_mean_std, md_table

#: characters of a rejection reason that group rejections (the trial's own label is cut off first)
REASON_KEY_CHARS = 90


def objective_value(record: Mapping[str, Any], name: str) -> Optional[float]:
    """A trial's value of objective ``name``: a reported metric, else a measure of its validated model (``info``)."""
    v = _num((record.get("metrics") or {}).get(name))
    return v if v is not None else _num((record.get("info") or {}).get(name))


def finished(records: Sequence[Mapping[str, Any]], exp: ExperimentConfig) -> List[Mapping[str, Any]]:
    """The trials that finished training with a finite metric."""
    return [r for r in records if r["status"] in OK and objective_value(r, exp.metric) is not None]


def dominates(a: Sequence[float], b: Sequence[float], modes: Sequence[str]) -> bool:
    """Whether point ``a`` is at least as good as ``b`` on every objective and better on one."""
    better = False
    for x, y, m in zip(a, b, modes):
        if (x < y) if m == "max" else (x > y):
            return False
        if x != y:
            better = True
    return better


def pareto_front(records: Sequence[Mapping[str, Any]], pairs: Sequence[Tuple[str, str]]) -> List[Mapping[str, Any]]:
    """The records no other record dominates on ``pairs`` (objective, mode); those missing a value are left out.
    Best first by the first objective."""
    pts = []
    for r in records:
        vals = [objective_value(r, n) for n, _ in pairs]
        if all(v is not None for v in vals):
            pts.append((r, vals))
    modes = [m for _, m in pairs]
    front = [(r, v) for r, v in pts if not any(dominates(w, v, modes) for _, w in pts)]
    front.sort(key=lambda rv: rv[1][0], reverse=modes[0] == "max")
    return [r for r, _ in front]


def marginals(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], objective: Optional[str] = None,
              mode: Optional[str] = None) -> "OrderedDict[str, List[Dict[str, Any]]]":
    """Categorical key → per choice ``{choice, n, mean, std, best}`` of ``objective`` (default the metric; ``mode``
    its direction, for "best") over the finished trials that have a value of it."""
    objective, mode = objective or exp.metric, mode or exp.mode
    out: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
    done = finished(records, exp)
    for key, p in exp.space.items():
        if p.type != "categorical":
            continue
        rows = []
        for choice in p.choices:
            vals = [v for r in done if key in r["params"] and r["params"][key] == choice
                    for v in [objective_value(r, objective)] if v is not None]
            mean, std = mean_std(vals)
            best = (max(vals) if mode == "max" else min(vals)) if vals else None
            rows.append({"choice": choice, "n": len(vals), "mean": mean, "std": std, "best": best})
        out[key] = rows
    return out


def importances(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], objective: Optional[str] = None,
                mode: Optional[str] = None) -> Dict[str, float]:
    """Searched key → PED-ANOVA importance for ``objective`` (default the metric; ``mode`` its direction) (empty
    with fewer than 4 finished trials or an Optuna without PED-ANOVA)."""
    import optuna

    pedanova = getattr(optuna.importance, "PedAnovaImportanceEvaluator", None)
    if pedanova is None:
        return {}
    study = search_study(exp, records, objective, mode)
    if len(study.trials) < 4:
        return {}
    try:
        imp = optuna.importance.get_param_importances(study, evaluator=pedanova())
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
    # largest first; equal values (to 6 places) by name: Optuna's order of ties follows set iteration, which changes
    # with the process's hash seed, and a report must read the same from the same records
    return dict(sorted(imp.items(), key=lambda kv: (-round(float(kv[1]), 6), kv[0])))


def search_study(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], objective: Optional[str] = None,
                 mode: Optional[str] = None):
    """An in-memory Optuna study holding a search's finished trials (their sampled values and ``objective``, default
    the metric; ``mode`` its direction), for Optuna's importance and parallel-coordinate plots (the run's own sampler
    state lives in Ray's checkpoint)."""
    import optuna
    objective, mode = objective or exp.metric, mode or exp.mode
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize" if mode == "max" else "minimize")
    finally:
        optuna.logging.set_verbosity(level)
    dists = optuna_distributions(exp.space)
    done = {id(r) for r in finished(records, exp)}
    for r in records:
        value = objective_value(r, objective)
        if value is None or id(r) not in done:
            continue
        params = {k: optuna_value(exp.space[k], r["params"][k]) for k in exp.space if k in (r.get("params") or {})}
        study.add_trial(optuna.trial.create_trial(params=params, distributions={k: dists[k] for k in params},
                                                  value=value))
    return study


def _reason_key(reason: str) -> str:
    """A rejection's reason without the trial's label (``trial … (…): ``), cut to group alike ones."""
    head, sep, rest = reason.partition("): ")
    text = rest if sep and head.startswith("trial ") else reason
    if "(tried " in text:                       # a budget rejection: the states tried differ per draw
        text = text.split("(tried ")[0].rstrip()
    return text[:REASON_KEY_CHARS]


def candidates_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                       rejected: Mapping[str, Any], synonyms: Sequence[Mapping[str, Any]] = ()) -> List[str]:
    """``## Candidates``: draws trained (by status) and rejected before training, with the reasons; and the space's
    synonymous choices when it ran with them (``search.synonyms: allow``)."""
    rej = list(rejected.get("rejected") or [])
    counts: Dict[str, int] = OrderedDict()
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    trained = ", ".join(f"{n} {s}" for s, n in counts.items())
    lines = ["## Candidates", "",
             f"The search drew {len(records) + len(rej)} candidates: {len(records)} trained ({trained or 'none'}) and "
             f"{len(rej)} rejected before training (they could not be built, or sized to the state budget; each was "
             f"told to the sampler as infeasible, so that it learns to avoid them).", ""]
    if rejected.get("stopped"):
        lines += [f"The search stopped early: {rejected['stopped']}.", ""]
    if rej:
        groups: "OrderedDict[str, List[Mapping[str, Any]]]" = OrderedDict()
        for r in rej:
            groups.setdefault(_reason_key(str(r.get("reason", ""))), []).append(r)
        table = []
        for reason, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            ex = rs[0]["params"]
            table.append([str(len(rs)), reason, ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in ex.items())])
        lines += ["Rejected, by reason (the full list with every reason is `rejected.json`):", ""]
        lines += md_table(["draws", "reason", "an example"], table)
        lines.append("")
    if synonyms:
        lines += ["Synonymous choices: the space ran with choices that build the same model at some points "
                  "(`search.synonyms: allow`; a mapping choice is merged into the config's mapping). A candidate's "
                  "label names the choice drawn, not a different model (the list is `synonyms.json`):", ""]
        lines += [f"- `{syn['key']}`: " + Synonym(**syn).describe() for syn in synonyms]
        lines.append("")
    return lines


def pareto_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Pareto front`` of a multi-objective search."""
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    if len(pairs) < 2:
        return []
    front = pareto_front(finished(records, exp), pairs)
    multi = metric_label(exp, records) != exp.metric
    who = "Candidates no other finished candidate" if multi else "Trials no other finished trial"
    lines = ["## Pareto front", "",
             f"{who} beats on every objective (" +
             ", ".join(f"{'score' if multi and n == exp.metric else n} {'↑' if m == 'max' else '↓'}"
                       for n, m in pairs) + "):", ""]
    keys = list(exp.space)
    head = (["candidate" if multi else "trial"] + ["score" if multi and n == exp.metric else n for n, _ in pairs]
            + [short_key(k) for k in keys])
    table = [[r["key"]] + [_fmt_objective(objective_value(r, n)) for n, _ in pairs]
             + [fmt_value(r["params"][k]) if k in r["params"] else "—" for k in keys] for r in front]
    lines += md_table(head, table)
    lines.append("")
    return lines


def against_front(exp: ExperimentConfig, front: Sequence[Mapping[str, Any]],
                  references: Sequence[Any]) -> List[Dict[str, Any]]:
    """Per reference (:class:`atlaslab.search.references.Reference`): ``{reference, point, dominated_by,
    dominates}``, the keys of the ``front`` members that dominate it and of those it dominates on the search's
    objectives (``point`` None: the reference has no value of one of them, and is compared with nothing)."""
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    modes = [m for _, m in pairs]
    pts = [(r["key"], [objective_value(r, n) for n, _ in pairs]) for r in front]
    out = []
    for ref in references:
        point = [ref.value(n) for n, _ in pairs]
        if any(v is None for v in point):
            out.append({"reference": ref, "point": None, "dominated_by": [], "dominates": []})
            continue
        out.append({"reference": ref, "point": point,
                    "dominated_by": [k for k, v in pts if dominates(v, point, modes)],
                    "dominates": [k for k, v in pts if dominates(point, v, modes)]})
    return out


def references_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], runs: Sequence[Any],
                       rejected: Optional[Mapping[str, Any]] = None) -> List[str]:
    """``## Presets against the front``: every reference variant of ``runs``
    (:class:`atlaslab.search.references.ReferenceRun`) at its best point by the search's objective, its objectives,
    and the front's members that dominate it; how many candidates the search tried; whether the front dominates the
    references' own front (the references no other reference dominates)."""
    if not runs:
        return []
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    modes = [m for _, m in pairs]
    multi = metric_label(exp, records) != exp.metric
    done = finished(records, exp)
    front = pareto_front(done, pairs)
    what = "candidates" if multi else "trials"
    n_rej = len((rejected or {}).get("rejected") or [])
    settings = list(exp.settings()) if multi else []
    score = "score" if multi else exp.metric
    objs = ", ".join(f"{score if n == exp.metric else n} {'↑' if m == 'max' else '↓'}" for n, m in pairs)
    protocol_keys = sorted({k for run in runs for ref in run.references for k in ref.protocol})
    lines = ["## Presets against the front", "",
             f"The search tried {len(records) + n_rej} candidates ({len(records)} {'trained' if multi else 'trials'}"
             f"{f', {n_rej} rejected before training' if n_rej else ''}; {len(done)} finished"
             f"{' every setting' if multi else ''}); {len(front)} are on its Pareto front ({objs}). Each reference is a "
             "variant of a reference run at its best " + ("/".join(protocol_keys) or "point") + " by the search's "
             f"{'score over the same settings' if multi else exp.metric} (mean over its seeds; only points that "
             f"finished{' every setting' if multi else ''} count), with the search's other objectives"
             + (" (step time: mean over the settings; state, parameters: the largest)" if multi else "")
             + ". A reference is dominated when a front member is at least as good on every objective and better on "
             "one.", ""]
    head = (["reference", "run"] + [f"best {k}" for k in protocol_keys] + settings
            + [score if n == exp.metric else n for n, _ in pairs]
            + [n for n in ("state_size", "num_parameters") if n not in dict(pairs)]
            + ["dominated by", "it dominates"])
    table, placed = [], []
    for run in runs:
        for row in against_front(exp, front, run.references):
            ref = row["reference"]
            if not ref.placed:
                table.append([ref.label, run.name] + ["—"] * (len(head) - 3)
                             + ["not placed: no point finished every setting"])
                continue
            placed.append(row)
            table.append([ref.label, run.name] + [fmt_value(ref.protocol.get(k, "—")) for k in protocol_keys]
                         + [_fmt_objective(ref.by_setting.get(s)) for s in settings]
                         + [_fmt_objective(ref.value(n)) for n, _ in pairs]
                         + [human_count(ref.value(n)) if ref.value(n) is not None else "—"
                            for n in ("state_size", "num_parameters") if n not in dict(pairs)]
                         + [", ".join(row["dominated_by"]) or ("no" if row["point"] else "—"),
                            ", ".join(row["dominates"]) or "—"])
    lines += md_table(head, table)
    lines.append("")
    lines += _front_verdict(exp, front, placed, modes, pairs, score)
    return lines


def _front_verdict(exp: ExperimentConfig, front: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]],
                   modes: Sequence[str], pairs: Sequence[Tuple[str, str]], score: str) -> List[str]:
    """How many references the front dominates, why each other one is not dominated (the objectives on which it
    beats every front member), and whether the front dominates the references' own front."""
    rows = [r for r in rows if r["point"] is not None]
    if not rows:
        return []
    free = [r for r in rows if not r["dominated_by"]]
    text = f"The search's front dominates {len(rows) - len(free)} of the {len(rows)} references placed."
    for r in free:
        better = []
        for i, (n, m) in enumerate(pairs):
            vals = [objective_value(c, n) for c in front]
            vals = [v for v in vals if v is not None]
            if vals and ((r["point"][i] > max(vals)) if m == "max" else (r["point"][i] < min(vals))):
                better.append(f"{score if n == exp.metric else n} {_fmt_objective(r['point'][i])} against the "
                              f"front's best {_fmt_objective(max(vals) if m == 'max' else min(vals))}")
        text += (f" Not dominated: {r['reference'].label}" + (f" ({'; '.join(better)})" if better else "")
                 + (f", which itself dominates {', '.join(r['dominates'])}" if r["dominates"] else "") + ".")
    own = [r for r in rows if not any(dominates(o["point"], r["point"], modes) for o in rows)]
    free_own = [r["reference"].label for r in own if not r["dominated_by"]]
    met = not free_own
    text += (f" The references' own front ({', '.join(r['reference'].label for r in own)}) is "
             + ("dominated by the search's front: every one of them is dominated by a front member." if met else
                "**not** dominated by the search's front ("
                + ", ".join(free_own) + (" is" if len(free_own) == 1 else " are") + " not)."))
    return [text, ""]


def mattered_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                     objectives: Optional[Sequence[str]] = None) -> List[str]:
    """``## What mattered``: importances and the marginal of every categorical key, for the metric and then for each
    further objective of the search (``objectives``: only these of them)."""
    imp = importances(exp, records)
    marg = marginals(exp, records)
    n = len(finished(records, exp))
    label = metric_label(exp, records)
    what = "candidates that finished every setting" if label != exp.metric else "trials that finished"
    lines = ["## What mattered", "",
             f"From the {n} {what}. Importance: Optuna's PED-ANOVA importance of each key for "
             f"{label} (how much of the metric's spread among the good trials the key explains)." +
             (" Too few trials for importances." if not imp else ""), ""]
    lines += _importance_table(imp)
    if marg:
        lines += [f"Marginals: {label} of the finished {'candidates' if label != exp.metric else 'trials'} that "
                  "made each choice (mean ± std, best; averaged over whatever else the search varied).", ""]
        lines += _marginal_table(marg)
    for name, mode in exp.search.objective_pairs(exp.metric, exp.mode)[1:]:
        if objectives is None or name in objectives:
            lines += _objective_mattered(exp, records, name, mode)
    return lines


def _objective_mattered(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], name: str, mode: str) -> List[str]:
    """What mattered for one further objective of a multi-objective search: its importances and marginals."""
    imp = importances(exp, records, name, mode)
    marg = marginals(exp, records, name, mode)
    lines = [f"### For {name} ({mode})", "",
             f"The same for the objective {name} ({'lower' if mode == 'min' else 'higher'} is better)." +
             (" Too few trials for importances." if not imp else ""), ""]
    return lines + _importance_table(imp) + _marginal_table(marg)


def _importance_table(imp: Mapping[str, float]) -> List[str]:
    """The importances as a table and a blank line (nothing when there are none)."""
    if not imp:
        return []
    return md_table(["key", "importance"], [[short_key(k), f"{v:.3f}"] for k, v in imp.items()]) + [""]


def _marginal_table(marg: Mapping[str, List[Dict[str, Any]]]) -> List[str]:
    """:func:`marginals` as a table (a row per key and choice) and a blank line (nothing when there are none)."""
    table = [[short_key(key), fmt_value(row["choice"]), str(row["n"]), fmt_mean_std(row["mean"], row["std"]),
              fmt_mean_std(row["best"])] for key, rows in marg.items() for row in rows]
    return md_table(["key", "choice", "trials", "mean ± std", "best"], table) + [""] if table else []


def metric_label(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> str:
    """How the report names the first objective: the metric, or for candidates scored on several settings
    (:func:`atlaslab.search.fitness.candidates`) the score of the metric over the settings."""
    if any("by_setting" in r for r in records):
        return f"the score ({exp.search.score.combine} of {exp.metric} over the settings)"
    return exp.metric


def _fmt_objective(v: Optional[float]) -> str:
    if v is None:
        return "—"
    if float(v).is_integer() and abs(v) >= 10:
        return str(int(v))
    return f"{v:.3g}" if abs(v) < 1e-2 else f"{v:.3f}"


def search_analysis(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], run_dir: Path,
                    references: Sequence[Any] = ()) -> List[str]:
    """The search report's sections of this module, in order: candidates, Pareto front, the references against it
    (``references``: :class:`atlaslab.search.references.ReferenceRun`), what mattered."""
    rejected = read_rejected(run_dir)
    return (candidates_section(exp, records, rejected, read_synonyms(run_dir)) + pareto_section(exp, records)
            + references_section(exp, records, references, rejected) + mattered_section(exp, records))


__all__ = ["against_front", "candidates_section", "dominates", "importances", "marginals", "mattered_section", "metric_label",
           "objective_value",
           "pareto_front", "pareto_section", "references_section", "search_analysis", "search_study"]
