"""Write the verdict experiment of the discovery study from its committed search and preset-tuning data.

    python bench/discovery_verdict.py                    # → experiments/discovery_verdict.yaml
    python bench/discovery_verdict.py --early-stopping   # → experiments/discovery_early_stopping.yaml
    python bench/discovery_verdict.py --layouts          # → experiments/discovery_layouts_verdict.yaml
    python bench/discovery_verdict.py --steps            # → experiments/discovery_suite_1000_verdict.yaml

The discovery study has three runs (docs/results/discovery.md):

1. ``experiments/discovery.yaml``: the search over parts at the state budget, seed 0;
2. ``experiments/discovery_presets.yaml``: the presets sized to the same budget, each at 4 learning rates, seed 0;
3. ``experiments/discovery_verdict.yaml`` (this script writes it): the search's winner and every preset at its
   best learning rate, retrained from scratch on the held-out seeds 10, 11, 12 (fixed before any run).

The winner is the finished search trial (completed, or stopped early at the threshold) with the highest
``val/accuracy`` on seed 0, ties broken by the lower ``step_time_s``; a preset's learning rate is the one of its
trials with the highest ``val/accuracy``. Each verdict row pins the size the budget chose for it (the head count,
and a deep memory's expansion), so that it trains exactly the model that was admitted. Nothing here reads a
held-out seed.

The early-stopping check (``--early-stopping``) asks whether the search's ASHA threw away a candidate the full
budget would have ranked first: every trial ASHA stopped is trained again at the full budget, on the search's own
seed (0) and settings, with no scheduler. The trials the search completed or that diverged already ran their full
budget (a divergence ends a run at the same step whatever the scheduler), so with these runs every trained
candidate has its full-budget result. The search's winner runs again beside them as a control: a faithful rerun
gives its search result again.
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "discovery"
FINISHED = ("completed", "early_stopped")
#: the verdict's seeds, fixed before the search ran (experiments/discovery.yaml says so)
VERDICT_SEEDS = [10, 11, 12]


def trials(folder: Path) -> List[Dict[str, Any]]:
    """The finished trials of a committed run folder, params decoded."""
    with open(folder / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        if r["status"] not in FINISHED or not r.get("val/accuracy"):
            continue
        out.append({**r, "params": json.loads(r["params"] or "{}"), "protocol": json.loads(r["protocol"] or "{}")})
    return out


def winner(search: Path) -> Dict[str, Any]:
    """The search's best finished trial: highest val/accuracy, then lowest step_time_s."""
    done = trials(search)
    if not done:
        raise SystemExit(f"{search}: no finished trial")
    return max(done, key=lambda r: (float(r["val/accuracy"]), -float(r.get("step_time_s") or 0.0)))


def tuned_presets(presets: Path) -> List[Tuple[str, Dict[str, Any]]]:
    """(row, its best trial) per preset row of the tuning run, in the run's order."""
    best: Dict[str, Dict[str, Any]] = {}
    for r in trials(presets):
        row = r["row"]
        if row not in best or float(r["val/accuracy"]) > float(best[row]["val/accuracy"]):
            best[row] = r
    return list(best.items())


def held_out_experiment(base: Dict[str, Any], keys: Tuple[str, ...], name: str, description: str,
                        seeds: List[int], variants: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A verdict experiment: ``base``'s sections ``keys``, a grid of ``variants`` (the first is the baseline), the
    held-out ``seeds``."""
    exp = {k: base[k] for k in keys if k in base}
    exp.update({"name": name, "description": description, "seeds": list(seeds),
                "grid": {"variants": variants, "baseline": next(iter(variants))}})
    return exp


def verdict_experiment(search: Path, presets: Path) -> Dict[str, Any]:
    """The verdict experiment: the search's base settings, the winner and the tuned presets, held-out seeds."""
    base = yaml.safe_load((search / "experiment.yaml").read_text())
    tuning = yaml.safe_load((presets / "experiment.yaml").read_text())
    win = winner(search)
    variants: Dict[str, Dict[str, Any]] = {f"found ({win['key']})": dict(win["params"])}
    preset_variants = tuning["grid"]["variants"]
    for row, t in tuned_presets(presets):
        v = dict(preset_variants.get(row) or {})
        v.update({k: val for k, val in t["params"].items() if k.startswith("model.")})
        v["train.lr"] = t["protocol"].get("lr", float(tuning["train"]["lr"]))
        variants[row] = v
    return held_out_experiment(
        base, ("model", "task", "eval", "train", "metric", "mode", "max_concurrent", "max_failures", "resources",
               "report"), "discovery_verdict",
        (f"The discovery search's winner ({win['key']}, chosen on seed 0 by val/accuracy) and the presets at their "
         f"best learning rate on seed 0, each at the size the state budget chose, retrained on the held-out seeds "
         f"{VERDICT_SEEDS}."), VERDICT_SEEDS, variants)


def early_stopping_experiment(search: Path) -> Dict[str, Any]:
    """Every trial the search's scheduler stopped, at the full budget on the search's seed, no scheduler."""
    base = yaml.safe_load((search / "experiment.yaml").read_text())
    with open(search / "trials.csv", newline="") as f:
        pruned = [r for r in csv.DictReader(f) if r["status"] == "pruned"]
    if not pruned:
        raise SystemExit(f"{search}: the search's scheduler stopped no trial")
    variants = {r["key"]: json.loads(r["params"] or "{}") for r in pruned}
    win = winner(search)       # a control: it ran its full budget in the search, so this run must give it again
    variants[f"control {win['key']}"] = dict(win["params"])
    exp = {k: base[k] for k in ("model", "task", "eval", "train", "seeds", "metric", "mode", "max_concurrent",
                                "max_failures", "resources", "report") if k in base}
    exp.update({
        "name": "discovery_early_stopping",
        "description": (f"The {len(pruned)} trials the discovery search's ASHA stopped, trained at the full "
                        f"budget ({base['train']['steps']} steps) on the search's seed {base.get('seeds')}, "
                        f"no scheduler: would the full budget have ranked any of them first? The search's winner "
                        f"({win['key']}) reruns as a control."),
        "grid": {"variants": variants},
    })
    return exp


def _finished_on_every_setting(folder: Path, group_of) -> Tuple[Any, List[str], Dict[Any, Dict[str, List[Dict[str, Any]]]]]:
    """``(experiment, its settings, group → setting → its trials, one per seed)`` of a committed multi-setting run,
    keeping only the groups (``group_of(trial row, experiment)``: a candidate, or a preset and its learning rate)
    whose trials finished with the metric on every setting and every seed of the run."""
    from atlaslab.search.schema import load_experiment
    exp = load_experiment(node=yaml.safe_load((folder / "experiment.yaml").read_text()))
    settings = list(exp.settings())
    seeds = [str(int(x)) for x in exp.seeds]
    with open(folder / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    groups: Dict[Any, Dict[tuple, Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(group_of(r, exp), {})[(r["setting"], r.get("seed") or seeds[0])] = r
    done = {g: {s: [by[(s, x)] for x in seeds] for s in settings} for g, by in groups.items()
            if all((s, x) in by and by[(s, x)]["status"] in FINISHED and by[(s, x)].get(exp.metric)
                   for s in settings for x in seeds)}
    return exp, settings, done


def _mean_metric(trials: List[Dict[str, Any]], name: str) -> float:
    """The mean of ``name`` over a setting's trials (its seeds)."""
    return sum(float(t[name]) for t in trials) / len(trials)


def suite_winner(search: Path) -> Tuple[str, Dict[str, Any], float]:
    """The multi-task search's best candidate that finished every setting (and seed): ``(candidate, its params
    without the budget's sizes, its score)``; the score is the search's (a setting's value the mean over its seeds,
    then :func:`atlaslab.search.fitness.score`), ties broken by the lower total step time."""
    from atlaslab.search.fitness import score
    exp, settings, done = _finished_on_every_setting(search, lambda r, exp: r["candidate"])
    best = None
    for cid, by in done.items():
        sc = score(exp, {s: _mean_metric(by[s], exp.metric) for s in settings})
        cost = sum(float(t.get("step_time_s") or 0.0) for s in settings for t in by[s])
        if best is None or (sc, -cost) > (best[2], -best[3]):
            params = {k: v for k, v in json.loads(by[settings[0]][0]["params"] or "{}").items()
                      if k not in exp.budget.size_by}
            best = (cid, params, sc, cost)
    if best is None:
        raise SystemExit(f"{search}: no candidate finished every setting")
    return best[0], best[1], best[2]


def suite_tuned_presets(presets: Path) -> List[Tuple[str, float, float]]:
    """(preset row, its learning rate with the best score, that score) per preset of the multi-task tuning run; the
    score is the mean of the settings' metric (each the mean over the run's seeds), the search's
    (``search.score: {combine: mean}``, checked in :func:`suite_verdict_experiment`)."""
    def preset_and_lr(r, exp):
        return r["row"].split(" · ", 1)[-1], float(json.loads(r["protocol"] or "{}").get("lr", exp.train.get("lr")))

    exp, settings, done = _finished_on_every_setting(presets, preset_and_lr)
    best: Dict[str, Tuple[float, float]] = {}
    for (variant, lr), by in done.items():
        sc = sum(_mean_metric(by[s], exp.metric) for s in settings) / len(settings)
        if variant not in best or sc > best[variant][1]:
            best[variant] = (lr, sc)
    return [(v, lr, sc) for v, (lr, sc) in best.items()]


#: the multi-task searches: name → (its committed search data, the verdict experiment's name, its held-out seeds,
#: fixed in the search's experiment file before the search ran, the committed data of the presets' tuning at its
#: budget)
SUITE_STUDIES = {
    "suite": ("suite_search", "discovery_suite_verdict", [10, 11, 12], "suite_presets"),
    "suite_from_presets": ("suite_from_presets", "discovery_suite_from_presets_verdict", [20, 21, 22],
                           "suite_presets"),
    "suite_3200": ("suite_3200", "discovery_suite_3200_verdict", [30, 31, 32], "suite_presets_3200"),
    "suite_seeds": ("suite_seeds", "discovery_suite_seeds_verdict", [40, 41, 42], "suite_presets_3200_s01"),
}


def _seeds_text(node: Dict[str, Any]) -> str:
    """"seed 0" / "seeds 0, 1": the seeds a run's experiment file trained on."""
    seeds = [int(x) for x in node.get("seeds") or [0]]
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def suite_verdict_experiment(search: Path, presets: Path, name: str = "discovery_suite_verdict",
                             seeds: List[int] = VERDICT_SEEDS) -> Dict[str, Any]:
    """The multi-task verdict: the search's best candidate and each preset at its best learning rate, on every
    setting, on the held-out ``seeds``; the budget sizes each of them per setting as the search and the tuning
    did. The base (model, tasks, training) is the search's, so a layer the search's model defines (e.g. DeltaNet's
    layer as ``mixers.deltanet``) is there for the winner."""
    base = yaml.safe_load((search / "experiment.yaml").read_text())
    tuning = yaml.safe_load((presets / "experiment.yaml").read_text())
    declared = (base.get("search") or {}).get("score") or {}
    if declared.get("combine", "mean") != "mean" or declared.get("weights"):
        raise SystemExit(f"the presets are tuned by the plain mean; the search declared score {declared}")
    cid, params, sc = suite_winner(search)
    variants: Dict[str, Dict[str, Any]] = {f"found ({cid})": dict(params)}
    for row, lr, _ in suite_tuned_presets(presets):
        v = dict(tuning["grid"]["variants"].get(row) or {})
        v["train.lr"] = lr
        variants[row] = v
    exp = {k: base[k] for k in ("model", "tasks", "eval", "train", "budget", "metric", "mode", "max_concurrent",
                                "max_failures", "resources", "report") if k in base}
    exp["budget"] = dict(tuning.get("budget") or base["budget"])    # the tuning's size_by (expansions too)
    # a step-cost bound is the search's device for its sampler, not part of a model: the verdict trains every row
    # to its end (the winner passed the bound in the search; a preset was tuned without one)
    exp["train"] = {k: v for k, v in exp["train"].items() if k != "max_step_time_s"}
    exp.update({
        "name": name,
        "description": (f"The multi-task search's best candidate ({cid}, score {sc:.3f} on {_seeds_text(base)}) and the "
                        f"presets at their best learning rate on {_seeds_text(tuning)} (by the same score), each sized "
                        f"to the budget on every setting, retrained on the held-out seeds {list(seeds)}."),
        "seeds": list(seeds),
        "grid": {"variants": variants, "baseline": next(iter(variants))},
    })
    return exp


#: the step study (experiments/discovery_suite_1000.yaml): its committed search data, its verdict's name, its held-out
#: seeds and the score a found model must reach, all fixed in the study's file before the search ran; its presets are
#: its own enqueued points (DeltaNet's first three, Gated DeltaNet's next three)
STEPS = ("suite_1000", "discovery_suite_1000_verdict", [70, 71, 72, 73, 74, 75], 0.98)
STEPS_PRESETS = {"DeltaNet": (0, 3), "Gated DeltaNet": (3, 6)}


def _steps_trained(trial: Dict[str, Any]) -> float:
    """The steps a trial ran: trials.csv's ``steps`` column (its ``steps_trained`` objective)."""
    return float(trial["steps"])


def _parts(params: Dict[str, Any]) -> str:
    """A draw's parts: its params without the learning rate, as a key."""
    return json.dumps({k: v for k, v in params.items() if k != "train.lr"}, sort_keys=True)


def steps_candidates(search: Path) -> Tuple[Any, List[Dict[str, Any]]]:
    """``(experiment, candidates)`` of the step study's search: every candidate that finished every setting, with
    its ``params`` (no budget sizes), ``score`` (the search's), ``steps`` (the mean over the settings of the steps
    each trained) and ``step_time_s`` (the mean)."""
    from atlaslab.search.fitness import score
    exp, settings, done = _finished_on_every_setting(search, lambda r, exp: r["candidate"])
    out = []
    for cid, by in done.items():
        params = {k: v for k, v in json.loads(by[settings[0]][0]["params"] or "{}").items()
                  if k not in exp.budget.size_by}
        out.append({"candidate": cid, "params": params,
                    "score": score(exp, {s: _mean_metric(by[s], exp.metric) for s in settings}),
                    "steps": sum(_steps_trained(t) for s in settings for t in by[s]) / sum(len(by[s]) for s in settings),
                    "step_time_s": _mean_metric([t for s in settings for t in by[s]], "step_time_s")})
    return exp, out


def steps_choice(search: Path, min_score: float = STEPS[3]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """``(found, {preset: its candidate})`` by the step study's rules: each preset is the enqueued point of its
    parts with the fewest mean steps; the found model the candidate with the fewest mean steps among those scoring
    at least ``min_score`` whose parts are neither preset's (ties: the higher score, then the lower step time)."""
    base = yaml.safe_load((search / "experiment.yaml").read_text())
    enqueued = base["search"]["enqueue"]
    exp, cands = steps_candidates(search)
    rank = lambda c: (c["steps"], -c["score"], c["step_time_s"])     # noqa: E731
    presets, preset_parts = {}, set()
    for name, (lo, hi) in STEPS_PRESETS.items():
        points = [json.dumps(p, sort_keys=True) for p in enqueued[lo:hi]]
        preset_parts |= {_parts(p) for p in enqueued[lo:hi]}
        mine = [c for c in cands if json.dumps(c["params"], sort_keys=True) in points]
        if not mine:
            raise SystemExit(f"{search}: no enqueued point of {name} finished every setting")
        presets[name] = min(mine, key=rank)
    found = [c for c in cands if c["score"] >= min_score and _parts(c["params"]) not in preset_parts]
    if not found:
        raise SystemExit(f"{search}: no candidate other than the presets scored {min_score} or more")
    return min(found, key=rank), presets


def steps_verdict_experiment(search: Path, name: str = STEPS[1], seeds: List[int] = STEPS[2]) -> Dict[str, Any]:
    """The step study's verdict: the found model and both presets, each at its learning rate from the search, on
    the held-out ``seeds``, at the search's budget and schedule (the step-cost bound dropped: it is the sampler's)."""
    base = yaml.safe_load((search / "experiment.yaml").read_text())
    found, presets = steps_choice(search)
    variants: Dict[str, Dict[str, Any]] = {f"found ({found['candidate']})": dict(found["params"])}
    for row, c in presets.items():
        variants[row] = dict(c["params"])
    preset_steps = ", ".join(f"{row} {c['steps']:.0f} steps" for row, c in presets.items())
    exp = held_out_experiment(
        base, ("model", "tasks", "eval", "train", "budget", "metric", "mode", "max_concurrent", "max_failures",
               "resources", "report"), name,
        (f"The step study's found model ({found['candidate']}: {found['steps']:.0f} mean steps to solve, score "
         f"{found['score']:.3f} on {_seeds_text(base)}) and DeltaNet and Gated DeltaNet at their learning rates from "
         f"the same search ({preset_steps}), retrained on "
         f"the held-out seeds {list(seeds)}."), seeds, variants)
    exp["train"] = {k: v for k, v in exp["train"].items() if k != "max_step_time_s"}
    return exp


STEPS_HEADER = """\
# Written by `python bench/discovery_verdict.py --steps` from the committed data of the step study's search
# (docs/results/discovery/suite_1000/data); do not edit by hand. The found model (the fewest mean steps to solve
# among the candidates scoring at least 0.98 whose parts are neither preset's) and DeltaNet and Gated DeltaNet at
# the learning rate of their enqueued point with the fewest steps, retrained on the held-out seeds 70-75 (fixed in
# experiments/discovery_suite_1000.yaml before the search ran).
#
#   atlaslab run experiments/discovery_suite_1000_verdict.yaml
"""


#: the layer-pattern study (experiments/discovery_layouts.yaml): its committed grid, its verdict's name and held-out
#: seeds (fixed in the study's file before it ran), and the rows that are the presets themselves
LAYOUTS = ("layouts", "discovery_layouts_verdict", [50, 51, 52])
LAYOUT_PRESETS = ("DeltaNet", "Gated DeltaNet")


def layouts_verdict_experiment(grid: Path, name: str = LAYOUTS[1], seeds: List[int] = LAYOUTS[2]) -> Dict[str, Any]:
    """The layer-pattern verdict: the hybrid layout with the best seed-0 score (the mean of the settings'
    validation accuracy) at its best learning rate, and each preset layout at its own best learning rate, from the
    same grid (equal tuning effort), retrained on the held-out ``seeds``."""
    base = yaml.safe_load((grid / "experiment.yaml").read_text())
    tuned = suite_tuned_presets(grid)
    hybrids = [t for t in tuned if t[0] not in LAYOUT_PRESETS]
    if not hybrids or {t[0] for t in tuned} < set(LAYOUT_PRESETS):
        raise SystemExit(f"{grid}: the grid lacks a finished hybrid or preset layout: {[t[0] for t in tuned]}")
    row, lr, sc = max(hybrids, key=lambda t: t[2])
    variants: Dict[str, Dict[str, Any]] = {f"found ({row})": {**base["grid"]["variants"][row], "train.lr": lr}}
    for preset in LAYOUT_PRESETS:
        p_lr = next(t[1] for t in tuned if t[0] == preset)
        variants[preset] = {**base["grid"]["variants"][preset], "train.lr": p_lr}
    return held_out_experiment(
        base, ("model", "tasks", "eval", "train", "budget", "metric", "mode", "max_concurrent", "max_failures",
               "resources", "report"), name,
        (f"The layer-pattern study's best hybrid ({row}, lr {lr:g}, score {sc:.3f} on {_seeds_text(base)}) and "
         f"DeltaNet and Gated DeltaNet at their best learning rates in the same grid, retrained on the held-out "
         f"seeds {list(seeds)}."), seeds, variants)


LAYOUTS_HEADER = """\
# Written by `python bench/discovery_verdict.py --layouts` from the committed data of the layer-pattern study
# (docs/results/discovery/layouts/data); do not edit by hand. The best hybrid layout and both presets, each at its
# best seed-0 learning rate in the same grid, retrained on the held-out seeds 50, 51, 52 (fixed in
# experiments/discovery_layouts.yaml before it ran).
#
#   atlaslab run experiments/discovery_layouts_verdict.yaml
"""


HEADER = """\
# Written by `python bench/discovery_verdict.py` from the committed data of the discovery search
# (docs/results/discovery/search/data) and of the presets' learning-rate tuning (docs/results/discovery/presets/data);
# do not edit by hand. The winner and each preset at its tuned learning rate, with the size the state budget chose
# for it pinned, retrained on the held-out seeds 10, 11, 12 (fixed before the search ran).
#
#   atlaslab run experiments/discovery_verdict.yaml
"""


def suite_header(study: str) -> str:
    """The written verdict file's header for a multi-task study of :data:`SUITE_STUDIES`."""
    folder, name, seeds, presets = SUITE_STUDIES[study]
    flag = "--suite" if study == "suite" else f"--suite {study}"
    search_file = "discovery_suite.yaml" if study == "suite" else f"discovery_{study}.yaml"
    return (f"# Written by `python bench/discovery_verdict.py {flag}` from the committed data of the multi-task "
            f"discovery search\n# (docs/results/discovery/{folder}/data) and of the presets' tuning on its settings\n"
            f"# (docs/results/discovery/{presets}/data); do not edit by hand. The best candidate and each preset "
            f"at its tuned\n# learning rate, sized to the budget on every setting, retrained on the held-out seeds "
            f"{', '.join(map(str, seeds))} (fixed in\n# experiments/{search_file} before the search ran).\n#\n"
            f"#   atlaslab run experiments/{name}.yaml\n")


SUITE_HEADER = suite_header("suite")
ES_HEADER = """\
# Written by `python bench/discovery_verdict.py --early-stopping` from the committed data of the discovery search
# (docs/results/discovery/search/data); do not edit by hand. Every trial the search's ASHA stopped, trained again at
# the full budget on the search's seed, no scheduler (docs/results/discovery.md, "Early stopping").
#
#   atlaslab run experiments/discovery_early_stopping.yaml
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search", default=str(DATA / "search" / "data"))
    ap.add_argument("--presets", default=str(DATA / "presets" / "data"))
    ap.add_argument("--out", default=None, help="default experiments/discovery_verdict.yaml, or "
                    "experiments/discovery_early_stopping.yaml with --early-stopping")
    ap.add_argument("--suite", nargs="?", const="suite", choices=list(SUITE_STUDIES), default=None,
                    help="a multi-task study (default: the first, 'suite'): --search/--presets default to its runs, "
                    "out experiments/<its verdict name>.yaml")
    ap.add_argument("--early-stopping", action="store_true",
                    help="write the early-stopping check (the search's stopped trials at the full budget)")
    ap.add_argument("--layouts", action="store_true",
                    help="write the layer-pattern study's verdict (experiments/discovery_layouts_verdict.yaml)")
    ap.add_argument("--steps", action="store_true",
                    help="write the step study's verdict (experiments/discovery_suite_1000_verdict.yaml)")
    args = ap.parse_args()
    if args.steps:
        folder, name, seeds, _ = STEPS
        out = Path(args.out or ROOT / "experiments" / f"{name}.yaml")
        exp = steps_verdict_experiment(DATA / folder / "data", name, seeds)
        out.write_text(STEPS_HEADER + yaml.safe_dump(exp, sort_keys=False, width=120, allow_unicode=True))
        print(f"wrote {out}: {', '.join(exp['grid']['variants'])}")
        return
    if args.layouts:
        folder, name, seeds = LAYOUTS
        out = Path(args.out or ROOT / "experiments" / f"{name}.yaml")
        exp = layouts_verdict_experiment(DATA / folder / "data", name, seeds)
        out.write_text(LAYOUTS_HEADER + yaml.safe_dump(exp, sort_keys=False, width=120, allow_unicode=True))
        print(f"wrote {out}: {', '.join(exp['grid']['variants'])}")
        return
    if args.early_stopping:
        out = Path(args.out or ROOT / "experiments" / "discovery_early_stopping.yaml")
        exp = early_stopping_experiment(Path(args.search))
        out.write_text(ES_HEADER + yaml.safe_dump(exp, sort_keys=False, width=120, allow_unicode=True))
        print(f"wrote {out}: {len(exp['grid']['variants'])} trials")
        return
    if args.suite:
        folder, name, seeds, tuned = SUITE_STUDIES[args.suite]
        search = Path(args.search if args.search != str(DATA / "search" / "data") else DATA / folder / "data")
        presets = Path(args.presets if args.presets != str(DATA / "presets" / "data") else DATA / tuned / "data")
        out = Path(args.out or ROOT / "experiments" / f"{name}.yaml")
        exp = suite_verdict_experiment(search, presets, name=name, seeds=seeds)
        out.write_text(suite_header(args.suite) + yaml.safe_dump(exp, sort_keys=False, width=120,
                                                                 allow_unicode=True))
        print(f"wrote {out}: {', '.join(exp['grid']['variants'])}")
        return
    args.out = args.out or str(ROOT / "experiments" / "discovery_verdict.yaml")
    exp = verdict_experiment(Path(args.search), Path(args.presets))
    Path(args.out).write_text(HEADER + yaml.safe_dump(exp, sort_keys=False, width=120, allow_unicode=True))
    print(f"wrote {args.out}: {', '.join(exp['grid']['variants'])}")


if __name__ == "__main__":
    main()
