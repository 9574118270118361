"""The report's text: markdown sections (header, results, MAD score, lengths, unfinished and failed trials) and
the CSVs (report.csv: one line per row; trials.csv: one line per trial), from the rows of
:mod:`atlaslab.search.aggregate`.
"""
from __future__ import annotations

import csv
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.aggregate import OK, mad_scores
from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.formatting import fmt_value, human_count, short_key
from atlaslab.search.schema import ExperimentConfig

def fmt_mean_std(v: Optional[float], std: Optional[float] = None, digits: int = 3) -> str:
    if v is None:
        return "—"
    s = f"{v:.{digits}f}"
    if std is not None:
        s += f" ± {std:.{digits}f}"
    return s


def fmt_delta(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:+.3f}"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def fmt_time(s: Optional[float]) -> str:
    if not s:
        return "?"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s"


#: what a trial cost, after its metrics in trials.csv (seconds of the training loop per step, and in all)
TRIAL_COSTS = ("step_time_s", "wall_time_s")


def write_csvs(run_dir: Path, exp: ExperimentConfig, rows, records, metrics) -> None:
    if rows:
        with open(run_dir / "report.csv", "w", newline="") as f:
            w = csv.writer(f)
            head = ["setting", "row", "variant", "protocol", "n_ok", "n", "n_failed", "num_parameters",
                    "state_size", "steps"]
            for m in metrics:
                head += [m, m + " std", m + " delta"]
            w.writerow(head)
            for r in rows:
                line = [r["setting"], r["row"], r["variant"], json.dumps(r["protocol"]), r["n_ok"], r["n"],
                        r["n_failed"], r["num_parameters"], r["state_size"], r["steps"]]
                for m in metrics:
                    line += [r.get(m), r.get(m + " std"), r.get(m + " delta")]
                w.writerow(line)
    keys = sorted({k for r in records for k in r.get("metrics", {})
                   if "/" in k and _num(r["metrics"][k]) is not None})
    # a search scored on several settings: one line per (candidate, setting), the candidate's id in its own column
    cand = ["candidate"] if any(r.get("candidate") for r in records) else []
    with open(run_dir / "trials.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key"] + cand + ["setting", "row", "seed", "protocol", "status", "message", "steps",
                                     "num_parameters", "state_size", "params"] + keys + list(TRIAL_COSTS))
        for r in records:
            info = r.get("info") or {}
            w.writerow([r["key"]] + [r.get("candidate", "") for _ in cand]
                       + [r.get("setting"), r.get("row"), r.get("seed"), json.dumps(r.get("protocol", {})),
                          r["status"], r.get("message", ""), r["metrics"].get("step"), info.get("num_parameters"),
                          info.get("state_size"), json.dumps(r.get("params", {}), default=str)]
                       + [r["metrics"].get(k) for k in keys] + [r["metrics"].get(k) for k in TRIAL_COSTS])


def settings_of(records: Sequence[Mapping[str, Any]]) -> "OrderedDict[Any, Any]":
    """Setting → its task node, in the order of the records."""
    return OrderedDict((r.get("setting"), r.get("task")) for r in records)


def header(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], state: Mapping[str, Any]) -> List[str]:
    """Title, description, the command that reproduces the run, trial counts, training settings and tasks."""
    lines = [f"# {exp.name}", ""]
    if exp.description:
        lines += [exp.description.strip(), ""]
    n_ok = sum(r["status"] in OK for r in records)
    n_failed = sum(r["failed"] for r in records)
    n_pruned = sum(r["status"] == "pruned" for r in records)
    cmd = state.get("command") or f"atlaslab run {state.get('source', '')}"
    lines.append(f"Reproduce: `{cmd}`  ")
    lines.append(f"Trials: {len(records)} ({n_ok} completed, {n_failed} failed"
                 + (f", {n_pruned} stopped early by {exp.scheduler.name.upper()}" if n_pruned else "")
                 + f") · wall time {fmt_time(state.get('wall_s'))} · seeds {exp.seeds}")
    first = records[0] if records else {}
    tr = first.get("train") or {}
    if tr:
        lines.append(f"Training: {tr.get('steps')} steps, batch {tr.get('batch_size')}, lr {tr.get('lr')}, "
                     f"weight decay {tr.get('weight_decay')}, {tr.get('schedule')} schedule; "
                     f"metric `{exp.metric}` ({exp.mode})")
    for s, t in settings_of(records).items():
        lines.append(f"Task `{s}`: " + ", ".join(f"{k}={fmt_value(v)}" for k, v in (t or {}).items()))
    lines.append("")
    return lines


def grid_sections(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], metrics: Sequence[str],
                   multi: bool) -> List[str]:
    """``## Results`` (one line per row; ``multi``: several settings) and, with several settings under the
    protocol or when asked for, ``## MAD score``."""
    proto = exp.protocol.active
    reach = exp.report.steps_to
    lines = ["## Results", ""]
    lines.append("mean ± std over seeds" + (f"; steps to {fmt_value(reach)} = the first evaluation with "
                                            f"`{exp.metric}` at {fmt_value(reach)} or better (seeds that got "
                                            "there)" if reach is not None else "")
                 + ("; each row at its best (lr, weight decay) of the protocol by "
                    f"`{exp.metric}`" if proto else "")
                 + "; Δ vs the baseline row; state = recurrent-state scalars per sequence at the training "
                   "length (KV cache for attention).")
    lines.append("")
    lines += md_table(*results_table(exp, rows, metrics, multi))
    lines.append("")
    if exp.report.mad_score or (proto and multi):
        lines += mad_section(rows, metrics[0])
    return lines


def results_table(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], metrics: Sequence[str],
                   multi: bool) -> Tuple[List[str], List[List[str]]]:
    """``(head, table)`` of the results: each metric with its Δ, steps to the threshold, size, best lr / wd."""
    proto = exp.protocol.active
    reach = exp.report.steps_to
    head = (["setting"] if multi else []) + ["variant"]
    for m in metrics:
        head += [exp.report.labels.get(m, m), "Δ"]
    if reach is not None:
        head.append(f"steps to {fmt_value(reach)}")
    head += ["params", "state"] + (["best lr / wd"] if proto else []) + ["seeds ok"]
    table = []
    for r in rows:
        line = ([r["setting"]] if multi else []) + [r["label"] + (" (baseline)" if r["baseline"] else "")]
        for m in metrics:
            line += [fmt_mean_std(r.get(m), r.get(m + " std")), "" if r["baseline"] else fmt_delta(r.get(m + " delta"))]
        if reach is not None:
            n_hit = r.get("steps_to n", 0)
            line.append("—" if not n_hit else fmt_mean_std(r["steps_to"], r["steps_to std"], digits=0)
                        + ("" if n_hit == r["n_ok"] else f" ({n_hit}/{r['n_ok']})"))
        line += [human_count(r["num_parameters"]), human_count(r["state_size"])]
        if proto:
            line.append(", ".join(fmt_value(v) for v in r["protocol"].values()) or "—")
        line.append(f"{r['n_ok']}/{r['n']}")
        table.append(line)
    return head, table


def mad_section(rows: Sequence[Mapping[str, Any]], main: str) -> List[str]:
    """``## MAD score``: best ``main`` per setting, mean over a task's settings, then over tasks."""
    scores = mad_scores(rows, main)
    if not scores:
        return []
    tasks = sorted({t for s in scores.values() for t in s if t != "mad_score"})
    lines = ["## MAD score", "", f"best `{main}` per setting, mean over a task's settings, then over "
             "tasks.", ""]
    lines += md_table(["variant"] + tasks + ["MAD score"],
                       [[lab] + [fmt_mean_std(s.get(t)) for t in tasks] + [fmt_mean_std(s["mad_score"])]
                        for lab, s in scores.items()])
    lines.append("")
    return lines


def length_section(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Test <metric> vs evaluation length`` (rows with ``test_lengths`` results)."""
    len_rows = [r for r in rows if r.get("lengths")]
    if not len_rows:
        return []
    Ls = sorted({L for r in len_rows for L in r["lengths"]})
    lines = [f"## Test {exp.report.length_metric} vs evaluation length", ""]
    lines += md_table(["variant"] + [str(L) for L in Ls],
                       [[r["row"]] + [fmt_mean_std(*r["lengths"][L]) if L in r["lengths"] else "—" for L in Ls]
                        for r in len_rows])
    lines.append("")
    return lines


def waiting_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Unfinished trials`` of an experiment that has not finished."""
    waiting = [r for r in records if r["status"] in ("unfinished", "pending")]
    if not waiting:
        return []
    lines = ["## Unfinished trials", "", "(the experiment has not finished: `atlaslab resume` completes it)", ""]
    lines += md_table(["trial", "row", "seed", "status", "last step", exp.metric],
                       [[r["key"], r.get("row", ""), str(r.get("seed", "")), r["status"],
                         str(r["metrics"].get("step", "—")), fmt_mean_std(_num(r["metrics"].get(exp.metric)))]
                        for r in waiting])
    lines.append("")
    return lines


def failed_section(records: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Failed trials`` (diverged, errored) with their reasons."""
    failed = [r for r in records if r["failed"]]
    if not failed:
        return []
    lines = ["## Failed trials", ""]
    lines += md_table(["trial", "row", "seed", "status", "reason"],
                       [[r["key"], r.get("row", ""), str(r.get("seed", "")), r["status"], r.get("message", "")]
                        for r in failed])
    lines.append("")
    return lines


def search_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                   ranked: Sequence[Mapping[str, Any]], metrics: Sequence[str],
                   title: str = "Trials (best first)") -> List[str]:
    """``## Trials (best first)`` of a search (``ranked``: the trials with a result, best first; then the rest) and
    the steps trained; trials of a search on several settings also show their candidate and setting."""
    keys = list(exp.space)
    multi = any(r.get("candidate") for r in records)
    lines = [f"## {title}", ""]
    head = (["trial"] + (["candidate", "setting"] if multi else []) + [short_key(k) for k in keys]
            + [exp.report.labels.get(m, m) for m in metrics] + ["steps", "status", "params", "state"])
    table = []
    for r in list(ranked) + [r for r in records if r not in ranked]:
        table.append([r["key"]] + ([str(r.get("candidate", "")), str(r.get("setting", ""))] if multi else [])
                     + [fmt_value(r["params"][k]) if k in r["params"] else "—" for k in keys]
                     + [fmt_mean_std(_num(r["metrics"].get(m))) for m in metrics]
                     + [str(r["metrics"].get("step", "?")), r["status"],
                        human_count((r.get("info") or {}).get("num_parameters")),
                        human_count((r.get("info") or {}).get("state_size"))])
    lines += md_table(head, table)
    lines.append("")
    first = records[0] if records else {}
    total_steps = sum(_num(r["metrics"].get("step")) or 0 for r in records)
    lines.append(f"Steps trained in total: {int(total_steps)} (the full budget would be "
                 f"{len(records) * int(first.get('train', {}).get('steps') or 0)}).")
    lines.append("")
    return lines



def candidates_table(exp: ExperimentConfig, cands: Sequence[Mapping[str, Any]],
                     ranked: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Candidates by score`` of a search scored on several settings: one line per candidate (``cands``, from
    :func:`atlaslab.search.fitness.candidates`; ``ranked``: those with a score, best first), its searched values,
    each setting's ``metric``, the score, the mean step time, the largest state, its trials' status."""
    settings = list(exp.settings())
    sc = exp.search.score
    how = "the worst setting's" if sc.combine == "worst" else (
        "weighted mean (" + ", ".join(f"{k}: {fmt_value(v)}" for k, v in sc.weights.items()) + ") of the settings'"
        if sc.weights else "mean of the settings'")
    keys = list(exp.space)
    trained = ("Each candidate was trained on every setting; a setting's column is its" if len(exp.seeds) == 1 else
               f"Each candidate was trained on every setting and seed ({', '.join(str(x) for x in exp.seeds)}); a "
               f"setting's column is the mean over the seeds of its")
    lines = ["## Candidates by score", "",
             f"{trained} `{exp.metric}`, the score is "
             f"the {how} `{exp.metric}` (what the sampler was told). Step time: the mean over the settings; "
             "state: the largest (each setting sized the candidate to the budget at its own length). Best first: "
             "the candidates that finished every setting, then those stopped early on one (ranked by the values "
             "they had).", ""]
    # the search's further objectives that the table has no column for already (e.g. steps_trained: the mean over
    # the settings of the steps each ran)
    extra = [n for n, _ in exp.search.objective_pairs(exp.metric, exp.mode)[1:] if n not in ("step_time_s", "state_size")]
    head = (["candidate"] + [short_key(k) for k in keys] + [f"{s}" for s in settings] + ["score"] + extra
            + ["step_time_s", "state", "status"])
    table = []
    for c in list(ranked) + [c for c in cands if c not in ranked]:
        table.append([c["key"]] + [fmt_value(c["params"][k]) if k in c["params"] else "—" for k in keys]
                     + [fmt_mean_std(_num(c["by_setting"].get(s))) for s in settings]
                     + [fmt_mean_std(_num(c["metrics"].get(exp.metric)))]
                     + [_fmt_extra(_num(c["metrics"].get(n))) for n in extra]
                     + ["—" if _num(c["metrics"].get("step_time_s")) is None
                        else f"{c['metrics']['step_time_s']:.4f}",
                        human_count((c.get("info") or {}).get("state_size")), c["status"]])
    lines += md_table(head, table)
    lines.append("")
    return lines


def _fmt_extra(v: Optional[float]) -> str:
    """A further objective's value in the candidates' table: whole numbers from 10 up (steps), else 3 figures."""
    if v is None:
        return "—"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.3g}"
