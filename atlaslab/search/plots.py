"""The report's figures (PNG, matplotlib's Agg backend): bars per metric, one per grid axis, metric against
recurrent-state size, learning curves with seed bands, metric against evaluation length, and for searches each
parameter against the metric, Optuna's parameter importances and a parallel-coordinate plot.

One colour per variant across a report's figures (:func:`variant_colors`: the order in which the variants first
appear in the rows); rows of one variant at other grid-axis values or settings get other line styles or hatches.
Error bars and seed bands of a fraction (an accuracy: :func:`bounded`) stop at 0 and 1.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.search.aggregate import OK, mean_std
from atlaslab.search.formatting import finite_number as _num
from atlaslab.search.formatting import fmt_value, human_count, short_key
from atlaslab.search.mattered import finished, objective_value, pareto_front, search_study
from atlaslab.search.schema import ExperimentConfig

#: line styles (and bar hatches) that tell apart the rows of one variant (axis values, settings)
LINE_STYLES = ("-", "--", ":", "-.")
HATCHES = ("", "//", "..", "xx", "\\\\")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def bounded(metric: str) -> bool:
    """Whether ``metric`` is a fraction in [0, 1] (an accuracy, recall, exact match, precision or F1)."""
    leaf = metric.rsplit("/", 1)[-1].lower()
    return any(word in leaf for word in ("acc", "recall", "exact", "precision", "f1"))


def variant_of(row: Mapping[str, Any]) -> str:
    """The variant a report row (or a search's stand-in row) belongs to: its colour's key."""
    for field in ("variant", "label", "row"):
        if row.get(field) is not None:
            return str(row[field])
    return ""


def variant_colors(rows: Sequence[Mapping[str, Any]]) -> Dict[str, str]:
    """variant → matplotlib colour, one per variant in the order of first appearance in ``rows``: the same map for
    every figure of a report (:func:`grid_plots` makes it once)."""
    names = list(OrderedDict.fromkeys(variant_of(r) for r in rows))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _styles(rows: Sequence[Mapping[str, Any]], colors: Mapping[str, str]) -> List[Tuple[str, str]]:
    """(colour, line style) per row: the variant's colour, and the n-th row of a variant the n-th line style."""
    seen: Dict[str, int] = defaultdict(int)
    out = []
    for r in rows:
        v = variant_of(r)
        out.append((colors.get(v, "C0"), LINE_STYLES[seen[v] % len(LINE_STYLES)]))
        seen[v] += 1
    return out


def error_bars(means: Sequence[float], stds: Sequence[Optional[float]], metric: str) -> List[List[float]]:
    """``[lower, upper]`` error-bar lengths (± std), clipped so that a fraction's bars stay within [0, 1]."""
    lower = [s or 0.0 for s in stds]
    upper = list(lower)
    if bounded(metric):
        lower = [min(e, max(m, 0.0)) for e, m in zip(lower, means)]
        upper = [min(e, max(1.0 - m, 0.0)) for e, m in zip(upper, means)]
    return [lower, upper]


def _save_line_plot(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, outside: bool = False,
                    **legend) -> Path:
    """Label, grid and legend a line plot, write it to ``path`` and close it (``outside``: the legend to the right
    of the axes, off the data)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False, **legend)
    else:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight" if outside else None)
    _plt().close(fig)
    return path


def _fraction_axis(ax, metric: str) -> None:
    """y from 0 to just above 1 for a fraction."""
    if bounded(metric):
        ax.set_ylim(-0.02, 1.05)


def plot_bars(rows: Sequence[Mapping[str, Any]], metric: str, path: Path, title: str,
              colors: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """``metric`` per row (mean ± std over seeds), a bar per row in its variant's colour; settings side by side,
    told apart by hatches; the baseline's bars outlined."""
    rows = [r for r in rows if r.get(metric) is not None]
    if not rows:
        return None
    colors = colors or variant_colors(rows)
    plt = _plt()
    settings = list(OrderedDict.fromkeys(r["setting"] for r in rows))
    labels = list(OrderedDict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(labels) * len(settings) + 2), 3.8))
    width = 0.8 / len(settings)
    for j, s in enumerate(settings):
        xs, ys, sd, cs, edges = [], [], [], [], []
        for i, lab in enumerate(labels):
            r = next((r for r in rows if r["setting"] == s and r["label"] == lab), None)
            if r is None:
                continue
            xs.append(i + (j - (len(settings) - 1) / 2) * width)
            ys.append(r[metric])
            sd.append(r.get(metric + " std"))
            cs.append(colors.get(variant_of(r), "C0"))
            edges.append(1.5 if r["baseline"] else 0.0)
        ax.bar(xs, ys, width=width * 0.9, yerr=error_bars(ys, sd, metric), capsize=3, color=cs,
               edgecolor="black", linewidth=edges, hatch=HATCHES[j % len(HATCHES)],
               label=s if len(settings) > 1 else None)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    _fraction_axis(ax, metric)
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


def plot_state(rows: Sequence[Mapping[str, Any]], metric: str, path: Path,
               colors: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """``metric`` against recurrent-state size (log scale), one line per variant (zoology's recall-vs-state plot).

    Drawn when some variant appears at two or more state sizes (a grid axis that changes the width). The x ticks
    are 1, 2 and 5 per decade written as counts (2k, 10k), the legend sits right of the axes, and a fraction's
    error bars stop at 0 and 1."""
    series: "OrderedDict[str, List[Tuple[float, float, Optional[float]]]]" = OrderedDict()
    variant_rows: Dict[str, Mapping[str, Any]] = {}
    several_settings = len({r.get("setting") for r in rows}) > 1
    for r in rows:
        if r.get(metric) is None or not r.get("state_size"):
            continue
        name = variant_of(r)
        if r.get("setting") is not None and several_settings:
            name = f"{name} [{r['setting']}]"
        series.setdefault(name, []).append((float(r["state_size"]), r[metric], r.get(metric + " std")))
        variant_rows.setdefault(name, r)
    if not any(len({x for x, _, _ in pts}) > 1 for pts in series.values()):
        return None
    colors = colors or variant_colors(rows)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    draw_state(ax, series, metric, _styles(list(variant_rows.values()), colors))
    _fraction_axis(ax, metric)
    return _save_line_plot(fig, ax, path, "recurrent state (scalars per sequence)", metric, f"{metric} vs state size",
                           outside=True, fontsize=7)


def draw_state(ax, series: Mapping[str, List[Tuple[float, float, Optional[float]]]], metric: str,
               styles: Sequence[Tuple[str, str]]) -> None:
    """The lines of :func:`plot_state` on ``ax``: ``series`` name → [(state size, mean, std)], ``styles`` (colour,
    line style) per series."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    for (name, pts), (color, ls) in zip(series.items(), styles):
        pts = sorted(pts, key=lambda p: p[0])
        ys = [y for _, y, _ in pts]
        ax.errorbar([x for x, _, _ in pts], ys, yerr=error_bars(ys, [e for _, _, e in pts], metric), marker="o",
                    ms=4, capsize=3, label=name, color=color, ls=ls)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_count(x)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_curves(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]], metric: str,
                path: Path, colors: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Learning curves: per row the mean over its seeds at each evaluation step, with a band of ± one sample std
    where two or more seeds reported (:func:`draw_curves`)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    if not draw_curves(ax, rows, records, metric, colors or variant_colors(rows)):
        plt.close(fig)
        return None
    return _save_line_plot(fig, ax, path, "step", metric, f"learning curves ({metric}; band: ± std over seeds)",
                           fontsize=6, ncol=2)


def seed_curve(keys: Sequence[str], by_key: Mapping[str, Mapping[str, Any]],
               metric: str) -> List[Tuple[float, float, Optional[float]]]:
    """[(step, mean, sample std or None)] of ``metric`` over the trials ``keys`` (the seeds of one row)."""
    curves: Dict[float, List[float]] = defaultdict(list)
    for k in keys:
        for h in by_key.get(k, {}).get("history", []):
            s, v = _num(h.get("step")), _num(h.get(metric))
            if s is not None and v is not None:
                curves[s].append(v)
    return [(s, *mean_std(curves[s])) for s in sorted(curves)]


def draw_curves(ax, rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]], metric: str,
                colors: Mapping[str, str]) -> int:
    """Draw :func:`plot_curves`' lines and seed bands on ``ax``; returns how many rows had a curve."""
    by_key = {r["key"]: r for r in records}
    drawn = 0
    for row, (color, ls) in zip(rows, _styles(rows, colors)):
        pts = seed_curve(row["keys"], by_key, metric)
        if not pts:
            continue
        xs = [s for s, _, _ in pts]
        means = [m for _, m, _ in pts]
        ax.plot(xs, means, marker=".", label=row["row"][:40], color=color, ls=ls, lw=2.2 if row["baseline"] else 1.2)
        if any(sd is not None for _, _, sd in pts):
            low, high = error_bars(means, [sd for _, _, sd in pts], metric)
            ax.fill_between(xs, [m - e for m, e in zip(means, low)], [m + e for m, e in zip(means, high)],
                            color=color, alpha=0.18, lw=0)
        drawn += 1
    return drawn


def plot_lengths(rows: Sequence[Mapping[str, Any]], name: str, path: Path,
                 colors: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Test ``name`` against evaluation length, one line per row (mean ± std over seeds)."""
    rows = [r for r in rows if len(r.get("lengths") or {}) >= 2]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for r, (color, ls) in zip(rows, _styles(rows, colors or variant_colors(rows))):
        Ls = sorted(r["lengths"])
        means = [r["lengths"][L][0] for L in Ls]
        ax.errorbar(Ls, means, yerr=error_bars(means, [r["lengths"][L][1] for L in Ls], name), marker="o",
                    capsize=2, label=r["row"][:40], color=color, ls=ls)
    ax.set_xscale("log", base=2)
    _fraction_axis(ax, name)
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
    """The grid's figures: bars per metric, one per axis, state size, learning curves, length; one colour map
    (:func:`variant_colors`) for all of them."""
    main = metrics[0]
    colors = variant_colors(rows)
    figs = [plot_bars(rows, m, plots / f"bar_{slug(m)}.png", f"{exp.name}: {m}", colors) for m in metrics]
    if exp.grid is not None:
        figs += [plot_axis(records, key, main, plots / f"axis_{slug(short_key(key))}.png") for key in exp.grid.axes]
    figs.append(plot_state(rows, main, plots / "state.png", colors))
    figs.append(plot_curves(rows, records, exp.report.curve_metric or exp.metric, plots / "curves.png", colors))
    figs.append(plot_lengths(rows, exp.report.length_metric, plots / "length.png", colors))
    return [p for p in figs if p]


def search_plots(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], ranked: Sequence[Mapping[str, Any]],
                 plots: Path, trials: Optional[Sequence[Mapping[str, Any]]] = None,
                 references: Sequence[Any] = ()) -> List[Path]:
    """A search's figures: each parameter against the metric, Optuna's parameter importances and parallel
    coordinates (:func:`search_study`), the curves of the best eight (``ranked``: best first). With several
    settings ``records`` are the candidates (:func:`atlaslab.search.fitness.candidates`), ``trials`` their trials,
    and a candidate's curve is the mean over its settings' curves; ``references``
    (:class:`atlaslab.search.references.ReferenceRun`) are drawn on the Pareto plot."""
    figs = plot_search(records, exp.metric, list(exp.space), plots)
    pareto = plot_pareto(exp, records, plots / "pareto.png", references)
    figs += [pareto] if pareto else []
    study = search_study(exp, records)
    figs += [p for p in (plot_importance(study, plots / "search_importance.png"),
                         plot_parallel(study, plots / "search_parallel.png")) if p]
    rows_like = [{"row": f"{r['key']}", "keys": list((r.get("trials") or {}).values()) or [r["key"]],
                  "baseline": i == 0} for i, r in enumerate(ranked[:8])]
    p = plot_curves(rows_like, records if trials is None else trials, exp.report.curve_metric or exp.metric,
                    plots / "curves.png")
    if p:
        figs.append(p)
    return figs


def pareto_points(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                  references: Sequence[Any] = ()) -> Optional[Dict[str, Any]]:
    """What :func:`plot_pareto` draws, as numbers: ``{x, y}`` (the search's second objective and its metric),
    ``points`` (every finished trial or candidate, ``(x, y)``), ``front`` (the Pareto front on those two objectives,
    by x) and ``references`` (``(label, x, y)`` of each placed reference of ``references``,
    :class:`atlaslab.search.references.ReferenceRun`); None for a search with one objective or under two points."""
    pairs = exp.search.objective_pairs(exp.metric, exp.mode)
    if len(pairs) < 2:
        return None
    done = finished(records, exp)
    (ym, _), (xm, _) = pairs[0], pairs[1]
    pts = [(objective_value(r, xm), objective_value(r, ym)) for r in done]
    pts = [(x, y) for x, y in pts if x is not None and y is not None]
    if len(pts) < 2:
        return None
    front = sorted((objective_value(r, xm), objective_value(r, ym)) for r in pareto_front(done, pairs[:2]))
    refs = [(ref.label, ref.value(xm), ref.value(ym)) for run in references for ref in run.references
            if ref.value(xm) is not None and ref.value(ym) is not None]
    return {"x": xm, "y": ym, "points": pts, "front": front, "references": refs}


def plot_pareto(exp: ExperimentConfig, records: Sequence[Mapping[str, Any]], path: Path,
                references: Sequence[Any] = ()) -> Optional[Path]:
    """A multi-objective search's trials (or candidates): the metric against its second objective (log scale for a
    size or a time), every finished one a dot and the Pareto front (:func:`atlaslab.search.mattered.pareto_front`)
    joined; each placed reference model (``references``) a labelled diamond on the same axes."""
    data = pareto_points(exp, records, references)
    if data is None:
        return None
    pts, front, refs = data["points"], data["front"], data["references"]
    multi = any("by_setting" in r for r in records)
    what = "candidates" if multi else "trials"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    ax.scatter([x for x, _ in pts], [y for _, y in pts], s=14, color="0.6", label=what)
    ax.plot([x for x, _ in front], [y for _, y in front], "o-", color="C3", ms=5, label="Pareto front")
    if refs:
        ax.scatter([x for _, x, _ in refs], [y for _, _, y in refs], marker="D", s=30, color="C0", zorder=3,
                   label="references")
        for label, x, y in refs:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color="C0")
    if all(x > 0 for x, _ in pts) and all(x > 0 for _, x, _ in refs):
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
    _fraction_axis(ax, data["y"])
    ylabel = f"score ({data['y']})" if multi else data["y"]
    return _save_line_plot(fig, ax, path, data["x"], ylabel, f"{ylabel} vs {data['x']} ({len(pts)} {what})",
                           fontsize=7)


def _plain_log_ticks(axis) -> None:
    """Label a log axis in plain numbers at 1, 2 and 5 × each power of ten (matplotlib's default labels every minor
    tick of a narrow decade in scientific notation, and they overlap)."""
    from matplotlib.ticker import FuncFormatter

    def label(v: float, _pos: Any) -> str:
        if v <= 0:
            return ""
        lead = round(v / 10 ** math.floor(math.log10(v)), 6)
        return f"{v:g}" if lead in (1.0, 2.0, 5.0) else ""

    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(FuncFormatter(label))


def _optuna_figure(draw, study, path: Path, size: Tuple[float, float]) -> Optional[Path]:
    """Save the figure of one of Optuna's matplotlib plots (``draw(study)`` → Axes), or None where it has too
    little to show (fewer than two finished trials, or a parameter that never varied)."""
    import warnings

    import optuna
    if len(study.trials) < 2 or not any(t.params for t in study.trials):
        return None
    plt = _plt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            ax = draw(study)
        except (ValueError, RuntimeError, ZeroDivisionError):
            plt.close("all")
            return None
    fig = ax.figure
    fig.set_size_inches(*size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_importance(study, path: Path) -> Optional[Path]:
    """Optuna's parameter-importance bars of a search's study (PED-ANOVA, which needs no scikit-learn; Optuna's
    default fANOVA before 3.6)."""
    import optuna
    from optuna.visualization import matplotlib as ovm
    pedanova = getattr(optuna.importance, "PedAnovaImportanceEvaluator", None)     # Optuna ≥ 3.6
    evaluator = pedanova() if pedanova is not None else None
    return _optuna_figure(lambda s: ovm.plot_param_importances(s, evaluator=evaluator), study, path, (6.0, 3.2))


def plot_parallel(study, path: Path) -> Optional[Path]:
    """Optuna's parallel-coordinate plot of a search's study: one line per trial through its parameter values,
    coloured by the objective."""
    from optuna.visualization import matplotlib as ovm
    return _optuna_figure(ovm.plot_parallel_coordinate, study, path, (7.0, 3.6))
