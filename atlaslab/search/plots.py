"""The report's figures (PNG, matplotlib's Agg backend): bars per metric, one per grid axis, metric against
recurrent-state size, learning curves, metric against evaluation length, and each search parameter against the
metric.
"""
from __future__ import annotations

import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.aggregate import OK, mean_std
from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.formatting import fmt_value, short_key
from atlaslab.search.schema import ExperimentConfig

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
    ms = [mean_std(v) for v in vals.values()]
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
        p = out / f"search_{slug(short_key(key))}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower() or "x"


def grid_plots(exp: ExperimentConfig, rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
                metrics: Sequence[str], plots: Path) -> List[Path]:
    """The grid's figures: bars per metric, one per axis, state size, learning curves, length."""
    main = metrics[0]
    figs = [plot_bars(rows, m, plots / f"bar_{slug(m)}.png", f"{exp.name}: {m}") for m in metrics]
    if exp.grid is not None:
        figs += [plot_axis(records, key, main, plots / f"axis_{slug(short_key(key))}.png") for key in exp.grid.axes]
    figs.append(plot_state(rows, main, plots / "state.png"))
    figs.append(plot_curves(rows, records, exp.report.curve_metric or exp.metric, plots / "curves.png"))
    figs.append(plot_lengths(rows, exp.report.length_metric, plots / "length.png"))
    return [p for p in figs if p]


def search_plots(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], ranked: Sequence[Mapping[str, Any]],
                 plots: Path) -> List[Path]:
    """A search's figures: each parameter against the metric, the curves of the best eight (``ranked``: best
    first)."""
    figs = plot_search(records, exp.metric, list(exp.space), plots)
    rows_like = [{"row": f"{r['key']}", "keys": [r["key"]], "baseline": i == 0} for i, r in enumerate(ranked[:8])]
    p = plot_curves(rows_like, records, exp.report.curve_metric or exp.metric, plots / "curves.png")
    if p:
        figs.append(p)
    return figs

