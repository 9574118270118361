"""The discovery study's tables (docs/results/discovery.md), from its committed run data.

    python docs/gen_discovery.py discovery-verdict      # print one table (the names are the keys of TABLES)
    python docs/gen_discovery.py --plots                # redraw the page's figure (discovery/suite_pareto.png)

Three runs, each committed under ``docs/results/discovery/<run>/data/`` as ``atlaslab run`` wrote it (less
checkpoints, Tune's folder and MLflow's store): ``search`` (experiments/discovery.yaml, with ``rejected.json``),
``presets`` (experiments/discovery_presets.yaml) and ``verdict`` (experiments/discovery_verdict.yaml, written by
``bench/discovery_verdict.py`` from the first two). A block whose run is not committed yet says so.

The verdict rule, fixed before the verdict ran: on the held-out seeds (10, 11, 12), the best preset is the one with
the highest mean test accuracy. **no verdict** when that preset did not learn the task on every held-out seed
(test accuracy below :data:`LEARNED` on a seed; until 2026-12-07 the rule read "mean test accuracy below", which
gave the same outcome on every verdict of the page); **met** when the found model beats it by at least :data:`MARGIN` test accuracy on every seed, or
reaches 0.9 validation accuracy in at most :data:`STEP_RATIO` of its steps on every seed; **not met** otherwise.
The mean margin comes with a 90 % bootstrap interval over the seeds (paired: a seed's margin is one draw).
"""
from __future__ import annotations

import csv
import functools
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from atlaslab.search.curves import first_step, read_curves  # noqa: E402
from atlaslab.search.formatting import fmt_value, human_count, short_key  # noqa: E402

DATA = DOCS / "results" / "discovery"
FINISHED = ("completed", "early_stopped")
#: the verdict's thresholds (see the module docstring)
LEARNED = 0.5
MARGIN = 0.05
STEP_RATIO = 2 / 3
THRESHOLD = 0.9
#: how many of the search's finished trials the trials table shows
TOP = 10


def _folder(run: str) -> Path:
    return DATA / run / "data"


def _missing(run: str) -> Optional[str]:
    if not (_folder(run) / "trials.csv").is_file():
        return f"_(the {run} run is not committed yet: `docs/results/discovery/{run}/data/` is empty)_"
    return None


def _trials(run: str) -> List[Dict[str, Any]]:
    with open(_folder(run) / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["params"] = json.loads(r.get("params") or "{}")
        r["protocol"] = json.loads(r.get("protocol") or "{}")
    return rows


def _num(r: Dict[str, Any], key: str) -> Optional[float]:
    v = r.get(key)
    return float(v) if v not in (None, "") else None


def _curves(run: str) -> Dict[str, List[Dict[str, Any]]]:
    path = _folder(run) / "curves.csv"
    return read_curves(path) if path.is_file() else {}


def _experiment(run: str) -> Dict[str, Any]:
    return yaml.safe_load((_folder(run) / "experiment.yaml").read_text())


def _fmt(vals: Sequence[float], digits: int = 3) -> str:
    if not vals:
        return "—"
    mu = statistics.mean(vals)
    return f"{mu:.{digits}f}" + (f" ± {statistics.stdev(vals):.{digits}f}" if len(vals) > 1 else "")


def _records(run: str) -> List[Dict[str, Any]]:
    """The run's trials as the report's records (what :mod:`atlaslab.search.mattered` reads)."""
    out = []
    for r in _trials(run):
        metrics = {k: float(v) for k, v in r.items() if ("/" in k or k == "step_time_s") and v not in ("", None)}
        if r.get("steps") not in ("", None):          # trials.csv's steps: the steps_trained objective
            metrics["steps_trained"] = float(r["steps"])
        out.append({"key": r["key"], "status": r["status"], "params": r["params"], "metrics": metrics,
                    "info": {"state_size": _num(r, "state_size"), "num_parameters": _num(r, "num_parameters")}})
    return out


def _search_exp():
    from atlaslab.search.schema import load_experiment
    return load_experiment(node=_experiment("search"))


def _parts(params: Dict[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{short_key(k)}={fmt_value(params[k])}" for k in keys if k in params and k != "train.lr")


# --------------------------------------------------------------------------------------------------
# search
# --------------------------------------------------------------------------------------------------
def search() -> str:
    """The search's candidates (trained by status, rejected) and its best finished trials."""
    if _missing("search"):
        return _missing("search")
    rows = _trials("search")
    rej_path = _folder("search") / "rejected.json"
    rejected = json.loads(rej_path.read_text())["rejected"] if rej_path.is_file() else []
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    exp = _experiment("search")
    keys = list(exp["search"]["space"])
    size_keys = list((exp.get("budget") or {}).get("size_by") or {})
    steps = sum(int(float(r["steps"] or 0)) for r in rows)
    full = len(rows) * int(exp["train"]["steps"])
    lines = [f"{len(rows) + len(rejected)} candidates drawn: {len(rows)} trained "
             f"({', '.join(f'{n} {s}' for s, n in counts.items())}), {len(rejected)} rejected before training. "
             f"Steps trained: {steps} of the {full} its trials × the step budget make ({steps / full:.0%}; against what the same trials take at the full budget, diverged ones ending early, see [Early stopping](#early-stopping)).", ""]
    done = [r for r in rows if r["status"] in FINISHED and _num(r, "val/accuracy") is not None]
    done.sort(key=lambda r: (-_num(r, "val/accuracy"), _num(r, "step_time_s") or 0.0))
    head = ["trial", "parts", "size", "lr", "val/accuracy", "test/accuracy", "steps", "state", "s/step"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in done[:TOP]:
        lines.append("| " + " | ".join([
            r["key"], _parts(r["params"], keys), _parts(r["params"], size_keys),
            f"{r['params'].get('train.lr', float('nan')):.2g}", f"{_num(r, 'val/accuracy'):.3f}",
            f"{_num(r, 'test/accuracy'):.3f}" if _num(r, "test/accuracy") is not None else "—",
            r["steps"], human_count(r["state_size"]),
            f"{_num(r, 'step_time_s'):.3f}" if _num(r, "step_time_s") is not None else "—"]) + " |")
    return "\n".join(lines)


def mattered() -> str:
    """Importance of each searched key and the marginal of each categorical one (atlaslab.search.mattered)."""
    if _missing("search"):
        return _missing("search")
    from atlaslab.search.mattered import mattered_section
    lines = mattered_section(_search_exp(), _records("search"), objectives=())   # the score (its step time: the report)
    return "\n".join(lines[2:]).strip()          # without the section's own heading


def pareto() -> str:
    """The search's Pareto front (val/accuracy up, step time down)."""
    if _missing("search"):
        return _missing("search")
    from atlaslab.search.mattered import pareto_section
    return "\n".join(pareto_section(_search_exp(), _records("search"))[2:]).strip()


def rejected() -> str:
    """The search's rejections grouped by reason."""
    if _missing("search"):
        return _missing("search")
    from atlaslab.search.mattered import candidates_section
    rej_path = _folder("search") / "rejected.json"
    rej = json.loads(rej_path.read_text()) if rej_path.is_file() else {"rejected": [], "stopped": ""}
    lines = candidates_section(_search_exp(), _records("search"), rej)
    return "\n".join(lines[2:]).strip()


# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------
def presets() -> str:
    """Every preset at every learning rate on seed 0 (the tuning run); the lr the verdict uses in bold."""
    if _missing("presets"):
        return _missing("presets")
    rows = _trials("presets")
    curves = _curves("presets")
    best: Dict[str, Dict[str, Any]] = {}
    for r in rows:
        if r["status"] in FINISHED and _num(r, "val/accuracy") is not None:
            if r["row"] not in best or _num(r, "val/accuracy") > _num(best[r["row"]], "val/accuracy"):
                best[r["row"]] = r
    head = ["preset", "lr", "val/accuracy", "test/accuracy", f"steps to {THRESHOLD:g}", "state", "params", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        chosen = best.get(r["row"]) is r
        step = first_step(curves.get(r["key"], []), "val/accuracy", THRESHOLD)
        lr = f"{r['protocol'].get('lr', float('nan')):g}"
        lines.append("| " + " | ".join([
            r["row"], f"**{lr}**" if chosen else lr,
            f"{_num(r, 'val/accuracy'):.3f}" if _num(r, "val/accuracy") is not None else "—",
            f"{_num(r, 'test/accuracy'):.3f}" if _num(r, "test/accuracy") is not None else "—",
            str(step) if step is not None else "—", human_count(r["state_size"]), human_count(r["num_parameters"]),
            r["status"]]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# verdict
# --------------------------------------------------------------------------------------------------
def _bootstrap(diffs: Sequence[float], n: int = 2000, seed: int = 0) -> tuple:
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choice(diffs) for _ in diffs) for _ in range(n))
    return means[int(0.05 * n)], means[int(0.95 * n) - 1]


def verdict_rows() -> Dict[str, Dict[int, Dict[str, Any]]]:
    """Row → seed → {acc, steps, state, params, s_per_step} of the verdict run's finished trials."""
    curves = _curves("verdict")
    out: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r in _trials("verdict"):
        if r["status"] not in FINISHED or _num(r, "test/accuracy") is None:
            continue
        out.setdefault(r["row"], {})[int(r["seed"])] = {
            "acc": _num(r, "test/accuracy"), "steps": first_step(curves.get(r["key"], []), "val/accuracy", THRESHOLD),
            "state": r["state_size"], "params": r["num_parameters"], "s_per_step": _num(r, "step_time_s")}
    return out


def verdict() -> str:
    """Held-out seeds: every row's test accuracy per seed and mean, steps to 0.9, and the verdict line."""
    if _missing("verdict"):
        return _missing("verdict")
    rows = verdict_rows()
    exp = _experiment("verdict")
    seeds = list(exp["seeds"])
    found = next(iter(exp["grid"]["variants"]))
    head = ["row"] + [f"seed {s}" for s in seeds] + ["mean ± std", f"steps to {THRESHOLD:g}", "state", "params",
                                                      "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in exp["grid"]["variants"]:
        by_seed = rows.get(row, {})
        accs = [by_seed[s]["acc"] for s in seeds if s in by_seed]
        steps = [by_seed[s]["steps"] for s in seeds if s in by_seed]
        got = [s for s in steps if s is not None]
        first = next(iter(by_seed.values()), {})
        lines.append("| " + " | ".join(
            [row] + [f"{by_seed[s]['acc']:.3f}" if s in by_seed else "—" for s in seeds] + [_fmt(accs)]
            + [(_fmt(got, 0) + (f" ({len(got)}/{len(steps)} seeds)" if len(got) < len(steps) else "")) if got else "—",
               human_count(first.get("state")), human_count(first.get("params")),
               _fmt([by_seed[s]["s_per_step"] for s in seeds if s in by_seed and by_seed[s]["s_per_step"]])]) + " |")
    lines += ["", verdict_line(rows, found, seeds)]
    return "\n".join(lines)


def verdict_line(rows: Dict[str, Dict[int, Dict[str, Any]]], found: str, seeds: Sequence[int]) -> str:
    """The verdict by the module docstring's rule, with the numbers it rests on."""
    presets = {row: by for row, by in rows.items() if row != found}
    mine = rows.get(found, {})
    if not presets or any(s not in mine for s in seeds):
        return "**Verdict: no verdict** — a row did not finish on every held-out seed."
    best = max(presets, key=lambda row: statistics.mean(presets[row][s]["acc"] for s in seeds if s in presets[row]))
    ref = presets[best]
    if any(s not in ref for s in seeds):
        return f"**Verdict: no verdict** — the best preset ({best}) did not finish on every held-out seed."
    ref_mean = statistics.mean(ref[s]["acc"] for s in seeds)
    diffs = [mine[s]["acc"] - ref[s]["acc"] for s in seeds]
    lo, hi = _bootstrap(diffs)
    margin = (f"found − {best}: {statistics.mean(diffs):+.3f} mean test accuracy (per seed "
              f"{', '.join(f'{d:+.3f}' for d in diffs)}; 90 % bootstrap interval {lo:+.3f} to {hi:+.3f})")
    unlearned = [s for s in seeds if ref[s]["acc"] < LEARNED]
    if unlearned:
        return (f"**Verdict: no verdict** — the best preset, {best}, did not learn the task on every held-out seed "
                f"(test accuracy below {LEARNED} on seed{'s' if len(unlearned) > 1 else ''} "
                f"{', '.join(map(str, unlearned))}; mean {ref_mean:.3f}); {margin}.")
    by_margin = all(d >= MARGIN for d in diffs)
    by_steps = all(mine[s]["steps"] is not None and ref[s]["steps"] is not None
                   and mine[s]["steps"] <= STEP_RATIO * ref[s]["steps"] for s in seeds)
    outcome = "met" if (by_margin or by_steps) else "not met"
    why = ("it beats the best preset by ≥ 0.05 on every held-out seed" if by_margin else
           "it reaches 0.9 in ≤ 2/3 of the best preset's steps on every held-out seed" if by_steps else
           f"it does not beat the best preset ({best}) by ≥ {MARGIN} on every held-out seed, nor reach "
           f"{THRESHOLD:g} in ≤ 2/3 of its steps on every seed")
    return f"**Verdict: {outcome}** — {why}; {margin}."


# --------------------------------------------------------------------------------------------------
# early stopping: did ASHA throw away a candidate the full budget would rank first?
# --------------------------------------------------------------------------------------------------
#: how many of the full budget's best candidates the check follows
EARLY_TOP = 3
CONTROL = "control "


def _val(r: Dict[str, Any]) -> Optional[float]:
    """A trial's last validation accuracy (what the search ranks on), or None (diverged, failed)."""
    return _num(r, "val/accuracy") if r["status"] in FINISHED + ("pruned",) else None


def early_stopping() -> str:
    """The search's trials at the full budget (its completed and diverged ones as they ran, the ones ASHA stopped
    trained again without a scheduler: ``early_stopping`` run), ranked; where ASHA's decisions fall in that ranking,
    the steps ASHA used, and the control (the winner rerun) against its search result."""
    for run in ("search", "early_stopping"):
        if _missing(run):
            return _missing(run)
    search = {r["key"]: r for r in _trials("search")}
    rerun = {r["row"]: r for r in _trials("early_stopping")}
    full = {k: (rerun[k] if r["status"] == "pruned" else r) for k, r in search.items()
            if r["status"] != "pruned" or k in rerun}
    ranked = sorted((k for k in full if full[k]["status"] in FINISHED and _val(full[k]) is not None),
                    key=lambda k: -_val(full[k]))
    rank = {k: i + 1 for i, k in enumerate(ranked)}
    pruned = [k for k, r in search.items() if r["status"] == "pruned"]
    steps_asha = sum(int(r["steps"] or 0) for r in search.values())
    steps_full = sum(int(full[k]["steps"] or 0) for k in full)
    keys = list(_experiment("search").get("search", {}).get("space", {}))
    lines = ["| full-budget rank | trial | parts | lr | in the search (ASHA): status at step, val acc | "
             "full budget: status at step, val acc |", "|---|---|---|---|---|---|"]

    def acc(r):
        return "—" if _val(r) is None else f"{_val(r):.3f}"

    for k in sorted(full, key=lambda k: rank.get(k, len(rank) + 1)):
        a, f = search[k], full[k]
        lines.append(f"| {rank.get(k, '—')} | `{k}` | {_parts(a['params'], keys)} | "
                     f"{fmt_value(a['params'].get('train.lr'))} | {a['status']} at {a['steps']}, {acc(a)} | "
                     f"{f['status']} at {f['steps']}, {acc(f)} |")
    top = ranked[:EARLY_TOP]
    lost = [k for k in top if k in pruned]
    best_pruned = min((rank[k] for k in pruned if k in rank), default=None)
    best_stopped = max((_val(full[k]) for k in pruned if k in rank), default=None)
    nominal = len(search) * int(_experiment("search")["train"]["steps"])
    controls = [r for row, r in rerun.items() if row.startswith(CONTROL)]
    control = ""
    for c in controls:
        key = c["row"][len(CONTROL):]
        control += (f" Control: the search's winner `{key}` rerun gives val acc {acc(c)} at step "
                    f"{c['steps']} (in the search: {acc(search[key])} at step {search[key]['steps']}).")
    summary = (f"ASHA stopped {len(pruned)} of the search's {len(search)} trained candidates and trained "
               f"**{steps_asha} of the {steps_full} steps** the same candidates take at the full budget "
               f"(**{steps_asha / max(steps_full, 1):.0%}**; {steps_asha / nominal:.0%} of {len(search)} × "
               f"{nominal // len(search)} steps, the budget before the diverged trials ended early). Trained to the "
               f"full budget, the stopped candidates' best rank is **{best_pruned if best_pruned is not None else '—'}"
               f"** of {len(ranked)} finished (val acc {'—' if best_stopped is None else f'{best_stopped:.3f}'}); of the "
               f"full budget's top {EARLY_TOP}, ASHA stopped **{len(lost)}**"
               f"{' (' + ', '.join(f'`{k}`, rank {rank[k]}' for k in lost) + ')' if lost else ''}.{control}")
    rung = int(_experiment("search").get("scheduler", {}).get("grace_period") or 0)
    curves = _curves("search")

    def at(k, step):
        v = [r.get("val/accuracy") for r in curves.get(k, []) if r["step"] == step]
        return v[0] if v and v[0] is not None else None

    if rung and curves:
        tops = [f"`{k}` {at(k, rung):.3f}" for k in top if at(k, rung) is not None]
        stopped = [at(k, rung) for k in pruned if at(k, rung) is not None]
        summary += (f" At ASHA's first rung (step {rung}) the full budget's top {EARLY_TOP} stood at val acc "
                    f"{', '.join(tops)}; the candidates it stopped there, at {min(stopped):.3f}–{max(stopped):.3f}.")
    return summary + "\n\n" + "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the multi-task study: a fitness of three settings (experiments/discovery_suite*.yaml)
# --------------------------------------------------------------------------------------------------
def _suite_exp(run: str = "suite_search"):
    from atlaslab.search.schema import load_experiment
    return load_experiment(node=_experiment(run))


def _suite_records(run: str = "suite_search") -> List[Dict[str, Any]]:
    """The run's trials as the report's records, with their candidate, setting and seed (a search with a fitness over
    several seeds has a cell per setting × seed)."""
    out = _records(run)
    for rec, r in zip(out, _trials(run)):
        rec["candidate"], rec["setting"] = r.get("candidate") or "", r.get("setting") or ""
        if r.get("seed") not in (None, ""):
            rec["seed"] = int(r["seed"])
    return out


def _suite_candidates(run: str = "suite_search"):
    from atlaslab.search.fitness import candidates, ranked_candidates
    exp = _suite_exp(run)
    cands = candidates(exp, _suite_records(run))
    return exp, cands, ranked_candidates(exp, cands)


def suite_search(run: str = "suite_search") -> str:
    """A multi-task search: what it drew, and every candidate with each setting's metric and the score."""
    if _missing(run):
        return _missing(run)
    from atlaslab.search.mattered import candidates_section
    from atlaslab.search.tables import candidates_table
    exp, cands, ranked = _suite_candidates(run)
    rej_path = _folder(run) / "rejected.json"
    rej = json.loads(rej_path.read_text()) if rej_path.is_file() else {"rejected": [], "stopped": ""}
    drawn = candidates_section(exp, cands, rej)[2:]
    table = candidates_table(exp, cands, ranked)[2:]
    return "\n".join(drawn + table).strip()


def suite_mattered(run: str = "suite_search", objectives: Sequence[str] = ()) -> str:
    """The Pareto front and the importances and marginals of a multi-task search, on the score and on each of
    ``objectives`` (further objectives of the search; its step time is left to the report)."""
    if _missing(run):
        return _missing(run)
    from atlaslab.search.mattered import mattered_section, pareto_section
    exp, cands, _ = _suite_candidates(run)
    return "\n".join(pareto_section(exp, cands)[2:] + [""] + mattered_section(exp, cands, objectives)[2:]).strip()


def _suite_score_rows(run: str):
    """``(experiment, table lines, rows)`` of a multi-task grid on held-out seeds: each row's score (the mean of its
    settings' test accuracy) per seed and its mean, the step at which its score on the validation set first reached
    0.9 (the mean over the settings' validation curves, an early-stopped trial held at its last value:
    ``first_step_of_mean``), and each setting's mean test accuracy; ``rows``: row → seed → {acc, steps}."""
    from atlaslab.search.curves import first_step_of_mean
    exp = _experiment(run)
    settings, seeds = list(exp["tasks"]), list(exp["seeds"])
    curves = read_curves(_folder(run) / "curves.csv")
    acc: Dict[str, Dict[int, Dict[str, float]]] = {}
    keys: Dict[str, Dict[int, Dict[str, str]]] = {}
    for r in _trials(run):
        if r["status"] in FINISHED and _num(r, "test/accuracy") is not None:
            row, seed = r["row"].split(" · ", 1)[-1], int(r["seed"])
            acc.setdefault(row, {}).setdefault(seed, {})[r["setting"]] = _num(r, "test/accuracy")
            keys.setdefault(row, {}).setdefault(seed, {})[r["setting"]] = r["key"]
    rows = {row: {seed: {"acc": statistics.mean(by[x] for x in settings),
                         "steps": first_step_of_mean([curves.get(keys[row][seed][x], []) for x in settings],
                                                     "val/accuracy", THRESHOLD)}
                  for seed, by in per.items() if all(x in by for x in settings)} for row, per in acc.items()}
    head = (["row"] + [f"score, seed {x}" for x in seeds] + ["mean ± std", f"score to {THRESHOLD:g} (steps)"]
            + [f"{x} (mean)" for x in settings])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in exp["grid"]["variants"]:
        by = rows.get(row, {})
        cells = [f"{by[x]['acc']:.3f}" if x in by else "—" for x in seeds]
        steps = " / ".join("—" if by.get(x, {}).get("steps") is None else str(by[x]["steps"]) for x in seeds)
        per_setting = [_fmt([acc[row][x][t] for x in seeds if x in acc.get(row, {}) and t in acc[row][x]])
                       for t in settings]
        lines.append("| " + " | ".join([row] + cells + [_fmt([by[x]["acc"] for x in seeds if x in by]), steps]
                                       + per_setting) + " |")
    return exp, lines, rows


def suite_verdict(run: str = "suite_verdict") -> str:
    """The multi-task verdict on the held-out seeds (:func:`_suite_score_rows`' table) and the verdict line by the
    same rule as the single-task study (the module docstring), applied to the score: met when the found model beats
    the best preset by the margin on every seed, or reaches 0.9 in at most 2/3 of its steps on every seed."""
    if _missing(run):
        return _missing(run)
    exp, lines, rows = _suite_score_rows(run)
    found = next(iter(exp["grid"]["variants"]))
    line = verdict_line(rows, found, list(exp["seeds"])).replace("mean test accuracy", "mean score")
    line = line.replace("test accuracy below", "score below")
    line = line.replace(f"nor reach {THRESHOLD:g} in", f"nor reach a score of {THRESHOLD:g} in")
    return "\n".join(lines + ["", line])


def suite_scores(run: str) -> str:
    """A multi-task grid's scores on held-out seeds with no verdict line (an ablation on a verdict's seeds)."""
    if _missing(run):
        return _missing(run)
    return "\n".join(_suite_score_rows(run)[1])


def suite_asha() -> str:
    """The first multi-task run, with ASHA per setting: how many candidates were scored (finished every setting)."""
    run = "suite_search_asha"
    if _missing(run):
        return _missing(run)
    from collections import Counter
    from atlaslab.search.fitness import candidates
    exp = _suite_exp(run)
    recs = _suite_records(run)
    cands = candidates(exp, recs)
    scored = [c for c in cands if c["status"] in FINISHED]
    trials = Counter(r["status"] for r in recs)
    sched = exp.scheduler
    return (f"With ASHA per setting (grace period {sched.grace_period}, reduction factor {sched.reduction_factor:g}) "
            f"the first run trained {len(cands)} candidates in {len(recs)} trials "
            f"({', '.join(f'{n} {s}' for s, n in sorted(trials.items()))}); **{len(scored)} of {len(cands)}** "
            f"finished every setting, so the sampler was told {len(scored)} scores.")


def suite_presets(run: str = "suite_presets", label: str = "preset") -> str:
    """Every preset at every learning rate on the three settings (each setting's value the mean over the run's
    seeds), the score as the search computes it; the lr with the best score in bold (the one a verdict would
    retrain)."""
    if _missing(run):
        return _missing(run)
    exp = _suite_exp(run)
    settings = list(exp.settings())
    seeds = [int(x) for x in exp.seeds]
    groups: Dict[tuple, Dict[str, List[Dict[str, Any]]]] = {}
    for r in _trials(run):
        variant = r["row"].split(" · ", 1)[-1]
        groups.setdefault((variant, r["protocol"].get("lr")), {}).setdefault(r["setting"], []).append(r)

    def value(by: Dict[str, List[Dict[str, Any]]], setting: str) -> Optional[float]:
        vals = [_num(t, exp.metric) for t in by.get(setting, []) if t["status"] in FINISHED]
        return statistics.mean(vals) if len(vals) == len(seeds) and None not in vals else None

    scores = {}
    for k, by in groups.items():
        vals = [value(by, x) for x in settings]
        scores[k] = None if None in vals else statistics.mean(vals)      # the search's score
    best: Dict[str, tuple] = {}
    for (variant, lr), sc in scores.items():
        if sc is not None and (variant not in best or sc > scores[best[variant]]):
            best[variant] = (variant, lr)
    head = [label, "lr"] + settings + ["score", "state", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (variant, lr), by in groups.items():
        chosen = best.get(variant) == (variant, lr)
        lab = f"{lr:g}" if isinstance(lr, (int, float)) else str(lr)
        cells = ["—" if value(by, x) is None else f"{value(by, x):.3f}" for x in settings]
        sc = scores[(variant, lr)]
        states = [human_count(by[x][0]["state_size"]) for x in settings if by.get(x)]
        status = ", ".join(sorted({t["status"] for x in settings for t in by.get(x, [])}))
        lines.append("| " + " | ".join([variant, f"**{lab}**" if chosen else lab] + cells
                                       + ["—" if sc is None else f"{sc:.3f}", " / ".join(states), status]) + " |")
    if len(seeds) > 1:
        lines += ["", f"Each setting's value is the mean over seeds {', '.join(map(str, seeds))}."]
    return "\n".join(lines)


def _suite_references(run: str = "suite_search", presets: str = "suite_presets"):
    """The multi-task presets' run as reference models of a multi-task search (each preset at its best learning
    rate by the search's score: :mod:`atlaslab.search.references`)."""
    from atlaslab.search.references import load_reference_run
    return load_reference_run(_suite_exp(run), _folder(presets))


def suite_front(run: str = "suite_search", presets: str = "suite_presets") -> str:
    """The presets against a multi-task search's Pareto front (score up, step time down): each preset's objectives,
    the front candidates that dominate it, how many candidates the search tried."""
    for name in (run, presets):
        if _missing(name):
            return _missing(name)
    from atlaslab.search.mattered import references_section
    from atlaslab.search.fitness import candidates
    exp = _suite_exp(run)
    cands = candidates(exp, _suite_records(run))
    rej_path = _folder(run) / "rejected.json"
    rej = json.loads(rej_path.read_text()) if rej_path.is_file() else {"rejected": [], "stopped": ""}
    return "\n".join(references_section(exp, cands, [_suite_references(run, presets)], rej)[2:]).strip()


#: the page's figure: the multi-task search's candidates, its front and the presets on the same axes
FIGURE = DATA / "suite_pareto.png"


def suite_pareto_points(run: str = "suite_search", presets: str = "suite_presets") -> Dict[str, Any]:
    """The points :func:`plot_suite_pareto` draws (:func:`atlaslab.search.plots.pareto_points`)."""
    from atlaslab.search.fitness import candidates
    from atlaslab.search.plots import pareto_points
    exp = _suite_exp(run)
    return pareto_points(exp, candidates(exp, _suite_records(run)), [_suite_references(run, presets)])


def plot_suite_pareto(out: Path = FIGURE, run: str = "suite_search", presets: str = "suite_presets") -> Optional[Path]:
    """Draw a multi-task search's Pareto plot with the presets, with the run report's own function."""
    from atlaslab.search.fitness import candidates
    from atlaslab.search.plots import plot_pareto
    exp = _suite_exp(run)
    return plot_pareto(exp, candidates(exp, _suite_records(run)), Path(out), [_suite_references(run, presets)])


#: the multi-task searches, in the order they ran: (label, run folder)
MULTI_TASK_SEARCHES = [("1600, free", "suite_search"), ("1600, from the presets", "suite_from_presets"),
                       ("3200, Muon under a step-cost bound", "suite_3200"), ("3200, two-seed fitness", "suite_seeds"),
                       ("3200, 1,000 steps, fewest steps to solve", "suite_1000")]
#: DeltaNet's parts in the searches' keys (the memory's init aside: in DeltaNet's layer both linear choices are one)
DELTANET_PARTS = {"attentional_bias.name": "l2", "retention.name": "none", "feature_map": {"name": "identity"},
                  "inner_optimizer.name": "gd", "window.size": 1, "chunk_size": 1, "read": "token"}


def _is_deltanet(params: Dict[str, Any]) -> bool:
    """Whether a candidate is the DeltaNet preset at some learning rate: DeltaNet's layer with DeltaNet's parts
    (a key the search did not have counts as the layer's own value) and a linear memory."""
    if params.get("model.layers") != ["deltanet"]:
        return False
    parts = {k.split("memory.", 1)[1]: v for k, v in params.items() if "memory." in k and not k.endswith("memory.memory")}
    memory = params.get("model.?mixers.*.memory.memory", {"name": "linear"})
    return memory.get("name") == "linear" and all(parts.get(k, v) == v for k, v in DELTANET_PARTS.items())


def learners() -> str:
    """Across the multi-task searches: which finished candidates reached a validation score of 0.9 within the step
    budget (the mean over every setting and seed's curve, an early-stopped trial held at its last value:
    ``first_step_of_mean``), split into the DeltaNet preset at some learning rate and everything else."""
    from atlaslab.search.curves import first_step_of_mean
    lines = ["| search | steps | finished candidates | reached 0.9 | of which DeltaNet's parts (lr; steps) | "
             "other parts that reached 0.9 |", "|---|---|---|---|---|---|"]
    for label, run in MULTI_TASK_SEARCHES:
        if _missing(run):
            continue
        curves, cells = _curves(run), {}
        for r in _trials(run):
            cells.setdefault(r["candidate"], []).append(r)
        finished, deltanet, other = 0, [], []
        for cand, rs in cells.items():
            if any(r["status"] not in FINISHED for r in rs):
                continue
            finished += 1
            steps = first_step_of_mean([curves.get(r["key"], []) for r in rs], "val/accuracy", THRESHOLD)
            if steps is None:
                continue
            params = dict(rs[0]["params"])
            (deltanet if _is_deltanet(params) else other).append((cand, params, steps))
        span = lambda xs: f"{min(xs):g}–{max(xs):g}" if len(set(xs)) > 1 else f"{xs[0]:g}"  # noqa: E731
        dn = (f"{len(deltanet)} ({span([round(p['train.lr'], 4) for _, p, _ in deltanet])}; "
              f"{span([s for _, _, s in deltanet])})" if deltanet else "0")
        others = "; ".join(f"{c}: {_parts(p, [k for k in p if k != 'train.lr'])}, lr {p['train.lr']:.3g}, {s} steps"
                           for c, p, s in other) or "none"
        lines.append(f"| {label} | {_experiment(run)['train']['steps']} | {finished} | {len(deltanet) + len(other)} | "
                     f"{dn} | {others} |")
    return "\n".join(lines)


TABLES = {"discovery-search": search, "discovery-rejected": rejected, "discovery-pareto": pareto,
          "discovery-mattered": mattered, "discovery-presets": presets, "discovery-verdict": verdict,
          "discovery-early-stopping": early_stopping, "discovery-suite-search": suite_search,
          "discovery-suite-mattered": suite_mattered, "discovery-suite-presets": suite_presets,
          "discovery-suite-asha": suite_asha, "discovery-suite-verdict": suite_verdict,
          # the second multi-task search (experiments/discovery_suite_from_presets.yaml) and its verdict
          "discovery-suite2-search": functools.partial(suite_search, "suite_from_presets"),
          "discovery-suite2-mattered": functools.partial(suite_mattered, "suite_from_presets"),
          "discovery-suite2-verdict": functools.partial(suite_verdict, "suite_from_presets_verdict")}

#: the presets against the multi-task search's Pareto front
TABLES["discovery-suite-front"] = suite_front
TABLES["discovery-suite2-front"] = functools.partial(suite_front, "suite_from_presets")
#: the second search's figure
FIGURE2 = DATA / "suite_from_presets_pareto.png"


def study_tables(tag: str, search: str, presets: str, verdict: str) -> Dict[str, Any]:
    """The generated blocks of one multi-task study's page section: ``discovery-<tag>-presets / search / mattered /
    front / verdict`` from its committed runs (presets' tuning, search, verdict)."""
    return {f"discovery-{tag}-presets": functools.partial(suite_presets, presets),
            f"discovery-{tag}-search": functools.partial(suite_search, search),
            f"discovery-{tag}-mattered": functools.partial(suite_mattered, search),
            f"discovery-{tag}-front": functools.partial(suite_front, search, presets),
            f"discovery-{tag}-verdict": functools.partial(suite_verdict, verdict)}


#: the search at the second budget (experiments/discovery_suite_3200.yaml), its presets' tuning and its verdict
TABLES.update(study_tables("suite3", "suite_3200", "suite_presets_3200", "suite_3200_verdict"))
FIGURE3 = DATA / "suite_3200_pareto.png"
#: the search at 3200 with a fitness over seeds 0 and 1 (experiments/discovery_suite_seeds.yaml), the presets tuned
#: on the same two seeds, and its verdict
TABLES.update(study_tables("suite4", "suite_seeds", "suite_presets_3200_s01", "suite_seeds_verdict"))
#: the ablation after its verdict (experiments/discovery_suite_seeds_control.yaml): initial memory or learning rate
TABLES["discovery-suite4-control"] = functools.partial(suite_scores, "suite_seeds_control")
#: across the four multi-task searches: the candidates whose score reached 0.9 within the budget
TABLES["discovery-learners"] = learners
FIGURE4 = DATA / "suite_seeds_pareto.png"
#: the layer-pattern study (experiments/discovery_layouts.yaml): every layout at every learning rate on seed 0, and
#: its verdict on the held-out seeds 50, 51, 52 (experiments/discovery_layouts_verdict.yaml)
TABLES["discovery-layouts-tuning"] = functools.partial(suite_presets, "layouts", "layout")
TABLES["discovery-layouts-verdict"] = functools.partial(suite_verdict, "layouts_verdict")
#: the check after that verdict (experiments/discovery_layouts_robustness.yaml): the stack and DeltaNet on seeds 60-65
TABLES["discovery-layouts-robustness"] = functools.partial(suite_scores, "layouts_robustness")
#: the pilot for the next study (experiments/discovery_steps_pilot.yaml): DeltaNet on MQAR at 300 and 1000 steps
TABLES["discovery-steps-pilot"] = functools.partial(suite_scores, "steps_pilot")


# --------------------------------------------------------------------------------------------------
# the step study (experiments/discovery_suite_1000.yaml): 1,000 steps, the search minimises the steps to solve
# --------------------------------------------------------------------------------------------------
STEP_STUDY = "suite_1000"
STEP_PRESET_NAMES = {"deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet"}


def step_presets(run: str = STEP_STUDY) -> str:
    """The presets' points the step study enqueued (DeltaNet's and Gated DeltaNet's layer at three learning rates
    each, seed 0): each setting's validation accuracy, the score, the mean over the settings of the steps trained
    (to the early-stop threshold, or the budget), and the step at which the score's curve first reached 0.9."""
    if _missing(run):
        return _missing(run)
    from atlaslab.search.curves import first_step_of_mean
    exp, cands, _ = _suite_candidates(run)
    settings = list(exp.settings())
    curves = _curves(run)
    keys_of = {}
    for r in _trials(run):
        keys_of.setdefault(r["candidate"], []).append(r["key"])
    points = [json.dumps(p, sort_keys=True) for p in _experiment(run)["search"]["enqueue"]]
    head = ["preset", "lr"] + settings + ["score", "steps trained (mean)", f"score to {THRESHOLD:g} (steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cands:
        if json.dumps(c["params"], sort_keys=True) not in points:
            continue
        steps = first_step_of_mean([curves.get(k, []) for k in keys_of.get(c["candidate"], [])], "val/accuracy",
                                   THRESHOLD)
        score, trained = c["metrics"].get(exp.metric), c["metrics"].get("steps_trained")
        lines.append("| " + " | ".join(
            [STEP_PRESET_NAMES[c["params"]["model.layers"][0]], f"{c['params']['train.lr']:g}"]
            + [_fmt([c["by_setting"][x]]) if c["by_setting"].get(x) is not None else "—" for x in settings]
            + ["—" if score is None else f"{score:.3f}", "—" if trained is None else f"{trained:.0f}",
               "—" if steps is None else str(steps)]) + " |")
    trained = [int(float(r["steps"])) for r in _trials(run) if r.get("steps") not in ("", None)]
    budget = len(trained) * int(exp.train["steps"])
    lines += ["", f"Steps trained by the search's {len(trained)} trials: {sum(trained):,} of the {budget:,} a "
              f"full budget would take ({100 * sum(trained) / budget:.0f} %; the early stop at "
              f"{exp.train['early_stop_threshold']:g} ends a solved setting)."]
    return "\n".join(lines)


TABLES["discovery-suite1000-presets"] = step_presets
TABLES["discovery-suite1000-search"] = functools.partial(suite_search, STEP_STUDY)
TABLES["discovery-suite1000-mattered"] = functools.partial(suite_mattered, STEP_STUDY, ("steps_trained",))
TABLES["discovery-suite1000-verdict"] = functools.partial(suite_verdict, "suite_1000_verdict")

if __name__ == "__main__":
    if sys.argv[1:] == ["--plots"]:
        print(f"wrote {plot_suite_pareto().relative_to(ROOT)}")
        print(f"wrote {plot_suite_pareto(FIGURE2, 'suite_from_presets').relative_to(ROOT)}")
        print(f"wrote {plot_suite_pareto(FIGURE3, 'suite_3200', 'suite_presets_3200').relative_to(ROOT)}")
        if not _missing("suite_seeds"):
            print(f"wrote {plot_suite_pareto(FIGURE4, 'suite_seeds', 'suite_presets_3200_s01').relative_to(ROOT)}")
        sys.exit(0)
    for name in sys.argv[1:] or list(TABLES):
        print(f"## {name}\n\n{TABLES[name]()}\n")

