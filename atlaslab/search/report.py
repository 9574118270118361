"""Reports: a markdown table of variants × metrics, CSVs and PNG plots, from a run folder's records.

Rows are the experiment's variants (× axis values, × settings). Within a row, the seeds give mean ± std;
with ``protocol`` (MAD) the row is the best (lr, weight decay) by the mean of ``metric`` over seeds, and
the chosen point is printed. Deltas are against the baseline row of the same setting and axis values
(``grid.baseline``, default the first variant). Parameter count and recurrent-state size (scalars per
sequence at the task's length, zoology's ``state_size``) come from the validated models. Failed trials
(diverged, errored) are listed with their reason and left out of the means. ``report.averages`` adds columns
that are each trial's mean of other metrics (ATLAS Table 2's "Avg" of its accuracy columns), averaged over seeds
like the rest; ``report.labels`` names the columns.

    atlaslab report RUN_DIR      # rewrites report.md, report.csv, trials.csv, plots/*.png
"""
from __future__ import annotations

import csv
import json
import math
import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from atlaslab.search.curves import write_curves
from atlaslab.search.expand import Prepared
from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.formatting import fmt_value, human_count, short_key
from atlaslab.search.results import read_records
from atlaslab.search.schema import ExperimentConfig, load_experiment

OK = ("completed", "early_stopped")


def _mean_std(vals: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
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
            m, _ = _mean_std([_num(r["metrics"].get(exp.metric)) for r in prs if r["status"] in OK])
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
            mean, std = _mean_std([_num(r["metrics"].get(m)) for r in ok])
            out[m] = mean
            out[m + " std"] = std
        if exp.report.steps_to is not None:
            hit = [steps_to(r, exp.metric, exp.report.steps_to, exp.mode) for r in ok]
            out["steps_to"], out["steps_to std"] = _mean_std([h for h in hit if h is not None])
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
    return {L: _mean_std(v) for L, v in sorted(vals.items())}


def _fmt(v: Optional[float], std: Optional[float] = None, digits: int = 3) -> str:
    if v is None:
        return "—"
    s = f"{v:.{digits}f}"
    if std is not None:
        s += f" ± {std:.{digits}f}"
    return s


def _delta(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:+.3f}"


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save_line_plot(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, **legend) -> Path:
    """Label, grid and legend a line plot, write it to ``path`` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_bars(rows: Sequence[Mapping[str, Any]], metric: str, path: Path, title: str) -> Optional[Path]:
    rows = [r for r in rows if r.get(metric) is not None]
    if not rows:
        return None
    plt = _plt()
    settings = list(OrderedDict.fromkeys(r["setting"] for r in rows))
    labels = list(OrderedDict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(labels) * len(settings) + 2), 3.8))
    width = 0.8 / len(settings)
    for j, s in enumerate(settings):
        xs, ys, es, colors = [], [], [], []
        for i, lab in enumerate(labels):
            r = next((r for r in rows if r["setting"] == s and r["label"] == lab), None)
            if r is None:
                continue
            xs.append(i + (j - (len(settings) - 1) / 2) * width)
            ys.append(r[metric])
            es.append(r.get(metric + " std") or 0.0)
            colors.append("tab:orange" if r["baseline"] else f"C{j}")
        ax.bar(xs, ys, width=width * 0.9, yerr=es, capsize=3, color=colors,
               label=s if len(settings) > 1 else None)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    if len(settings) > 1:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_axis(records: Sequence[Mapping[str, Any]], key: str, metric: str, path: Path) -> Optional[Path]:
    vals: "OrderedDict[str, List[float]]" = OrderedDict()
    for r in records:
        if r["status"] not in OK or key not in r.get("axes", {}):
            continue
        v = _num(r["metrics"].get(metric))
        if v is not None:
            vals.setdefault(fmt_value(r["axes"][key]), []).append(v)
    if len(vals) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(3.5, 0.8 * len(vals) + 1.5), 3.2))
    ms = [_mean_std(v) for v in vals.values()]
    ax.bar(range(len(vals)), [m for m, _ in ms], yerr=[s or 0.0 for _, s in ms], capsize=3, color="C0")
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(list(vals), fontsize=8)
    ax.set_xlabel(short_key(key))
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by {short_key(key)} (mean over the other axes)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_state(rows: Sequence[Mapping[str, Any]], metric: str, path: Path) -> Optional[Path]:
    """``metric`` against recurrent-state size (log scale), one line per variant (zoology's recall-vs-state plot).

    Drawn when some variant appears at two or more state sizes (a grid axis that changes the width)."""
    series: "OrderedDict[str, List[Tuple[float, float, float]]]" = OrderedDict()
    several_settings = len({r.get("setting") for r in rows}) > 1
    for r in rows:
        if r.get(metric) is None or not r.get("state_size"):
            continue
        name = r["variant"] if r.get("variant") is not None else r["label"]
        if r.get("setting") is not None and several_settings:
            name = f"{name} [{r['setting']}]"
        series.setdefault(str(name), []).append((float(r["state_size"]), r[metric], r.get(metric + " std") or 0.0))
    if not any(len({x for x, _, _ in pts}) > 1 for pts in series.values()):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for i, (name, pts) in enumerate(series.items()):
        pts.sort()
        ax.errorbar([x for x, _, _ in pts], [y for _, y, _ in pts], yerr=[e for _, _, e in pts], marker="o",
                    ms=4, capsize=3, label=name, color=f"C{i % 10}")
    ax.set_xscale("log")
    return _save_line_plot(fig, ax, path, "recurrent state (scalars per sequence)", metric, f"{metric} vs state size",
                           fontsize=7)


def plot_curves(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]], metric: str,
                path: Path) -> Optional[Path]:
    by_key = {r["key"]: r for r in records}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    drawn = 0
    for i, row in enumerate(rows):
        curves: Dict[float, List[float]] = defaultdict(list)
        for k in row["keys"]:
            for h in by_key.get(k, {}).get("history", []):
                s, v = _num(h.get("step")), _num(h.get(metric))
                if s is not None and v is not None:
                    curves[s].append(v)
        if not curves:
            continue
        xs = sorted(curves)
        ax.plot(xs, [sum(curves[x]) / len(curves[x]) for x in xs], marker=".", label=row["row"][:40],
                color=f"C{i % 10}", lw=2.2 if row["baseline"] else 1.2)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    return _save_line_plot(fig, ax, path, "step", metric, f"learning curves ({metric})", fontsize=6, ncol=2)


def plot_lengths(rows: Sequence[Mapping[str, Any]], name: str, path: Path) -> Optional[Path]:
    rows = [r for r in rows if len(r.get("lengths") or {}) >= 2]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for i, r in enumerate(rows):
        Ls = sorted(r["lengths"])
        ax.errorbar(Ls, [r["lengths"][L][0] for L in Ls], yerr=[r["lengths"][L][1] or 0.0 for L in Ls],
                    marker="o", capsize=2, label=r["row"][:40], color=f"C{i % 10}")
    ax.set_xscale("log", base=2)
    return _save_line_plot(fig, ax, path, "evaluation length (tokens)", f"test {name}", f"{name} vs evaluation length",
                           fontsize=6, ncol=2)


def plot_search(records: Sequence[Mapping[str, Any]], metric: str, space_keys: Sequence[str],
                out: Path) -> List[Path]:
    plt = _plt()
    paths = []
    for key in space_keys:
        pts = [(r["params"].get(key), _num(r["metrics"].get(metric))) for r in records
               if key in r.get("params", {}) and r["status"] in OK + ("pruned",)]
        pts = [(x, y) for x, y in pts if y is not None]
        if len(pts) < 2:
            continue
        fig, ax = plt.subplots(figsize=(4.2, 3.2))
        xs = [x for x, _ in pts]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
            ax.scatter(xs, [y for _, y in pts], s=18)
            if min(xs) > 0 and max(xs) / max(min(xs), 1e-300) > 50:
                ax.set_xscale("log")
        else:
            cats = list(OrderedDict.fromkeys(fmt_value(x) for x in xs))
            ax.scatter([cats.index(fmt_value(x)) for x in xs], [y for _, y in pts], s=18)
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels(cats, fontsize=8)
        ax.set_xlabel(short_key(key))
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out / f"search_{_slug(short_key(key))}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower() or "x"


# --------------------------------------------------------------------------------------------------
# MAD score
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------
def _fmt_time(s: Optional[float]) -> str:
    if not s:
        return "?"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s"


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
    with open(run_dir / "trials.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "setting", "row", "seed", "protocol", "status", "message", "steps", "num_parameters",
                    "state_size", "params"] + keys)
        for r in records:
            info = r.get("info") or {}
            w.writerow([r["key"], r.get("setting"), r.get("row"), r.get("seed"), json.dumps(r.get("protocol", {})),
                        r["status"], r.get("message", ""), r["metrics"].get("step"), info.get("num_parameters"),
                        info.get("state_size"), json.dumps(r.get("params", {}), default=str)]
                       + [r["metrics"].get(k) for k in keys])


def write_report(run_dir: Path, exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                 state: Optional[Mapping[str, Any]] = None) -> Path:
    """Write report.md, report.csv, trials.csv and plots/ into ``run_dir``; returns report.md's path."""
    run_dir = Path(run_dir)
    state = state or {}
    records = with_averages(exp, records)
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    metrics = report_metrics(exp, records)
    lines = _header(exp, records, state)
    rows: List[Dict[str, Any]] = []
    if exp.kind == "grid":
        rows = aggregate(exp, records)
        lines += _grid_sections(exp, rows, metrics, multi=len(_settings(records)) > 1)
        figs = _grid_plots(exp, rows, records, metrics, plots) if exp.report.plots else []
        lines += _length_section(exp, rows)
    else:
        section, figs = _search_section(exp, records, metrics, plots)
        lines += section
    lines += _waiting_section(exp, records) + _failed_section(records)
    if figs:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}](plots/{p.name})" for p in figs]
        lines.append("")
    lines.append("Per-trial numbers: `trials.csv`; per-row numbers: `report.csv`; MLflow: "
                 f"`{(state.get('tracking') or {}).get('uri', 'off')}`.")
    write_csvs(run_dir, exp, rows, records, metrics)
    write_curves(run_dir, records)                       # curves.csv: every trial's learning curve
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _settings(records: Sequence[Mapping[str, Any]]) -> "OrderedDict[Any, Any]":
    """Setting → its task node, in the order of the records."""
    return OrderedDict((r.get("setting"), r.get("task")) for r in records)


def _header(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], state: Mapping[str, Any]) -> List[str]:
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
                 + f") · wall time {_fmt_time(state.get('wall_s'))} · seeds {exp.seeds}")
    first = records[0] if records else {}
    tr = first.get("train") or {}
    if tr:
        lines.append(f"Training: {tr.get('steps')} steps, batch {tr.get('batch_size')}, lr {tr.get('lr')}, "
                     f"weight decay {tr.get('weight_decay')}, {tr.get('schedule')} schedule; "
                     f"metric `{exp.metric}` ({exp.mode})")
    for s, t in _settings(records).items():
        lines.append(f"Task `{s}`: " + ", ".join(f"{k}={fmt_value(v)}" for k, v in (t or {}).items()))
    lines.append("")
    return lines


def _grid_sections(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], metrics: Sequence[str],
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
    lines += _md_table(*_results_table(exp, rows, metrics, multi))
    lines.append("")
    if exp.report.mad_score or (proto and multi):
        lines += _mad_section(rows, metrics[0])
    return lines


def _results_table(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], metrics: Sequence[str],
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
            line += [_fmt(r.get(m), r.get(m + " std")), "" if r["baseline"] else _delta(r.get(m + " delta"))]
        if reach is not None:
            n_hit = r.get("steps_to n", 0)
            line.append("—" if not n_hit else _fmt(r["steps_to"], r["steps_to std"], digits=0)
                        + ("" if n_hit == r["n_ok"] else f" ({n_hit}/{r['n_ok']})"))
        line += [human_count(r["num_parameters"]), human_count(r["state_size"])]
        if proto:
            line.append(", ".join(fmt_value(v) for v in r["protocol"].values()) or "—")
        line.append(f"{r['n_ok']}/{r['n']}")
        table.append(line)
    return head, table


def _mad_section(rows: Sequence[Mapping[str, Any]], main: str) -> List[str]:
    """``## MAD score``: best ``main`` per setting, mean over a task's settings, then over tasks."""
    scores = mad_scores(rows, main)
    if not scores:
        return []
    tasks = sorted({t for s in scores.values() for t in s if t != "mad_score"})
    lines = ["## MAD score", "", f"best `{main}` per setting, mean over a task's settings, then over "
             "tasks.", ""]
    lines += _md_table(["variant"] + tasks + ["MAD score"],
                       [[lab] + [_fmt(s.get(t)) for t in tasks] + [_fmt(s["mad_score"])]
                        for lab, s in scores.items()])
    lines.append("")
    return lines


def _grid_plots(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
                metrics: Sequence[str], plots: Path) -> List[Path]:
    """The grid's figures: bars per metric, one per axis, state size, learning curves, length."""
    main = metrics[0]
    figs = [plot_bars(rows, m, plots / f"bar_{_slug(m)}.png", f"{exp.name}: {m}") for m in metrics]
    if exp.grid is not None:
        figs += [plot_axis(records, key, main, plots / f"axis_{_slug(short_key(key))}.png") for key in exp.grid.axes]
    figs.append(plot_state(rows, main, plots / "state.png"))
    figs.append(plot_curves(rows, records, exp.report.curve_metric or exp.metric, plots / "curves.png"))
    figs.append(plot_lengths(rows, exp.report.length_metric, plots / "length.png"))
    return [p for p in figs if p]


def _length_section(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Test <metric> vs evaluation length`` (rows with ``test_lengths`` results)."""
    len_rows = [r for r in rows if r.get("lengths")]
    if not len_rows:
        return []
    Ls = sorted({L for r in len_rows for L in r["lengths"]})
    lines = [f"## Test {exp.report.length_metric} vs evaluation length", ""]
    lines += _md_table(["variant"] + [str(L) for L in Ls],
                       [[r["row"]] + [_fmt(*r["lengths"][L]) if L in r["lengths"] else "—" for L in Ls]
                        for r in len_rows])
    lines.append("")
    return lines


def _search_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], metrics: Sequence[str],
                    plots: Path) -> Tuple[List[str], List[Path]]:
    """``## Trials (best first)`` of a search, the steps trained, and its figures (each parameter against the
    metric, the curves of the best eight)."""
    ok = [r for r in records if _num(r["metrics"].get(exp.metric)) is not None]
    rev = exp.mode == "max"
    ok.sort(key=lambda r: _num(r["metrics"].get(exp.metric)), reverse=rev)
    keys = list(exp.space)
    lines = ["## Trials (best first)", ""]
    head = (["trial"] + [short_key(k) for k in keys] + [exp.report.labels.get(m, m) for m in metrics]
            + ["steps", "status", "params", "state"])
    table = []
    for r in ok + [r for r in records if r not in ok]:
        table.append([r["key"]] + [fmt_value(r["params"][k]) if k in r["params"] else "—" for k in keys]
                     + [_fmt(_num(r["metrics"].get(m))) for m in metrics]
                     + [str(r["metrics"].get("step", "?")), r["status"],
                        human_count((r.get("info") or {}).get("num_parameters")),
                        human_count((r.get("info") or {}).get("state_size"))])
    lines += _md_table(head, table)
    lines.append("")
    first = records[0] if records else {}
    total_steps = sum(_num(r["metrics"].get("step")) or 0 for r in records)
    lines.append(f"Steps trained in total: {int(total_steps)} (the full budget would be "
                 f"{len(records) * int(first.get('train', {}).get('steps') or 0)}).")
    lines.append("")
    figs: List[Path] = []
    if exp.report.plots:
        figs += plot_search(records, exp.metric, keys, plots)
        rows_like = [{"row": f"{r['key']}", "keys": [r["key"]], "baseline": i == 0} for i, r in enumerate(ok[:8])]
        p = plot_curves(rows_like, records, exp.report.curve_metric or exp.metric, plots / "curves.png")
        if p:
            figs.append(p)
    return lines, figs


def _waiting_section(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Unfinished trials`` of an experiment that has not finished."""
    waiting = [r for r in records if r["status"] in ("unfinished", "pending")]
    if not waiting:
        return []
    lines = ["## Unfinished trials", "", "(the experiment has not finished: `atlaslab resume` completes it)", ""]
    lines += _md_table(["trial", "row", "seed", "status", "last step", exp.metric],
                       [[r["key"], r.get("row", ""), str(r.get("seed", "")), r["status"],
                         str(r["metrics"].get("step", "—")), _fmt(_num(r["metrics"].get(exp.metric)))]
                        for r in waiting])
    lines.append("")
    return lines


def _failed_section(records: Sequence[Mapping[str, Any]]) -> List[str]:
    """``## Failed trials`` (diverged, errored) with their reasons."""
    failed = [r for r in records if r["failed"]]
    if not failed:
        return []
    lines = ["## Failed trials", ""]
    lines += _md_table(["trial", "row", "seed", "status", "reason"],
                       [[r["key"], r.get("row", ""), str(r.get("seed", "")), r["status"], r.get("message", "")]
                        for r in failed])
    lines.append("")
    return lines


def report_from_dir(run_dir: Path, refresh: bool = False) -> Path:
    """Rewrite the report of a run folder. Without ``results.json`` (an experiment still running or
    interrupted), or with ``refresh``, the records are read from Tune's experiment folder; trials without a
    final result are then reported as ``unfinished``."""
    run_dir = Path(run_dir)
    state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").is_file() else {}
    node = OmegaConf.to_container(OmegaConf.load(run_dir / "experiment.yaml"))
    exp = load_experiment(node=node)
    trials = json.loads((run_dir / "trials.json").read_text()) if (run_dir / "trials.json").is_file() else []
    records = read_records(run_dir, Prepared(node, exp, trials), state, refresh=refresh)
    return write_report(run_dir, exp, records, state)


__all__ = ["aggregate", "mad_scores", "report_from_dir", "report_metrics", "with_averages", "write_report"]
