"""The report's figures (``atlaslab.search.plots``): one colour per variant across a report's plots, seed bands on
learning curves, the state plot's ticks, legend and clipped error bars, and a search's Optuna importance and
parallel-coordinate plots in its report."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from atlaslab.search import plots  # noqa: E402
from atlaslab.search.schema import load_experiment  # noqa: E402

TINY = {
    "name": "tiny",
    "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
    "task": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 32},
    "eval": {"interval": 10, "examples": 32},
    "train": {"steps": 20, "batch_size": 8, "lr": 3e-3},
}


def _record(key, acc_by_step, params=None, status="completed"):
    return {"key": key, "status": status, "params": params or {}, "failed": False,
            "metrics": {"val/accuracy": acc_by_step[-1][1], "step": acc_by_step[-1][0]},
            "history": [{"step": s, "val/accuracy": a} for s, a in acc_by_step]}


def _row(variant, label, keys, baseline=False, **extra):
    return {"variant": variant, "label": label, "row": label, "keys": keys, "baseline": baseline, "setting": "mqar",
            **extra}


def test_one_colour_per_variant_in_every_plot():
    rows = [_row("B", "B", ["t0"]), _row("A", "A d=16", ["t1"], baseline=True), _row("A", "A d=32", ["t2"])]
    records = [_record(k, [(10, 0.2), (20, 0.4)]) for k in ("t0", "t1", "t2")]
    colors = plots.variant_colors(rows)
    assert colors == {"B": "C0", "A": "C1"}                         # first appearance orders the variants
    assert plots.variant_colors(list(reversed(rows))) == {"A": "C0", "B": "C1"}
    fig, ax = plt.subplots()
    assert plots.draw_curves(ax, rows, records, "val/accuracy", colors) == 3
    lines = ax.get_lines()
    assert [to_rgba(ln.get_color()) for ln in lines] == [to_rgba(c) for c in ("C0", "C1", "C1")]
    assert lines[1].get_linestyle() != lines[2].get_linestyle()      # one variant, two axis values
    series = {"B": [(100.0, 0.5, None), (200.0, 0.6, None)], "A": [(100.0, 0.7, None), (400.0, 0.8, None)]}
    fig2, ax2 = plt.subplots()
    plots.draw_state(ax2, series, "val/accuracy", plots._styles([rows[0], rows[1]], colors))
    assert [to_rgba(c.lines[0].get_color()) for c in ax2.containers] == [to_rgba("C0"), to_rgba("C1")]
    plt.close("all")


def test_learning_curve_band_is_mean_plus_minus_the_seed_std():
    records = [_record("s0", [(10, 0.2), (20, 0.5)]), _record("s1", [(10, 0.4), (20, 0.9)])]
    fig, ax = plt.subplots()
    plots.draw_curves(ax, [_row("A", "A", ["s0", "s1"])], records, "val/accuracy", {"A": "C0"})
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    ys = bands[0].get_paths()[0].vertices[:, 1]
    std10, std20 = 0.2 / 2 ** 0.5, 0.4 / 2 ** 0.5                    # sample std of two seeds
    assert ys.min() == pytest.approx(0.3 - std10) and ys.max() == pytest.approx(min(0.7 + std20, 1.0))
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.3, 0.7])
    fig, ax = plt.subplots()                                           # one seed: a line, no band
    plots.draw_curves(ax, [_row("A", "A", ["s0"])], records, "val/accuracy", {"A": "C0"})
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]
    plt.close("all")


def test_a_fractions_error_bars_and_bands_stop_at_one_and_zero():
    low, high = plots.error_bars([0.98, 0.5, 0.01], [0.05, 0.1, None], "test/accuracy")
    assert high == pytest.approx([0.02, 0.1, 0.0]) and low == pytest.approx([0.05, 0.1, 0.0])
    assert plots.error_bars([0.98], [0.05], "val/loss") == [[0.05], [0.05]]      # a loss is not clipped
    assert plots.bounded("test/len_32/accuracy") and not plots.bounded("val/loss")
    records = [_record("s0", [(10, 0.9)]), _record("s1", [(10, 1.0)])]
    fig, ax = plt.subplots()
    plots.draw_curves(ax, [_row("A", "A", ["s0", "s1"])], records, "val/accuracy", {"A": "C0"})
    band = [c for c in ax.collections if isinstance(c, PolyCollection)][0]
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(1.0)
    plt.close("all")


def test_state_plot_ticks_do_not_overlap_legend_is_off_the_data_and_bars_stay_below_one(tmp_path, monkeypatch):
    """The recall-vs-state figure's three faults: minor tick labels on top of the major ones, the legend over the
    lines, error bars above accuracy 1.0."""
    rows = [{"variant": v, "label": f"{v} {s}", "setting": None, "state_size": s, "test/accuracy": a,
             "test/accuracy std": sd} for v, s, a, sd in
            [("gdn", 1500, 0.3, 0.05), ("gdn", 2200, 0.97, 0.08), ("gdn", 3300, 0.99, 0.2),
             ("titans", 9000, 0.06, 0.0), ("titans", 35000, 0.86, 0.08), ("atlas", 20000, 0.55, 0.4),
             ("atlas", 60000, 0.99, 0.01)]]
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)            # keep the figure to look at it
    assert plots.plot_state(rows, "test/accuracy", tmp_path / "state.png") == tmp_path / "state.png"
    fig = plt.gcf()
    ax = fig.axes[0]
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
    assert labels and set(labels) <= {"1k", "2k", "5k", "10k", "20k", "50k", "100k"}
    assert not [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
    extents = sorted((t.get_window_extent().x0, t.get_window_extent().x1) for t in ax.get_xticklabels()
                     if t.get_text() and 1500 <= t.get_position()[0] <= 60000)
    assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:])), extents        # no two labels overlap
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1                # right of the axes
    tops = [seg[:, 1].max() for c in ax.collections for seg in c.get_segments()] if ax.collections else []
    assert tops and max(tops) <= 1.0 + 1e-9                                          # error bars clipped
    plt.close(fig)


def test_search_report_has_optuna_importance_and_parallel_coordinates(tmp_path):
    from atlaslab.search.report import write_report
    node = dict(TINY, search={"sampler": "random", "seed": 0, "space": {
        "train.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
        "model.d_model": [16, 32]}}, num_samples=4)
    exp = load_experiment(node=node)
    grid = [(2e-4, 16, 0.3), (1e-3, 32, 0.5), (5e-3, 16, 0.6), (9e-3, 32, 0.8)]
    recs = []
    for i, (lr, d, acc) in enumerate(grid):
        r = _record(f"t{i:03d}", [(10, acc / 2), (20, acc)], params={"train.lr": lr, "model.d_model": d})
        r.update(index=i, setting="mqar", seed=0, info={}, train={"steps": 20}, task={"name": "mqar"},
                 row=r["key"], label=r["key"], variant=r["key"], axes={}, protocol={})
        recs.append(r)
    study = plots.search_study(exp, recs)
    assert len(study.trials) == 4 and study.trials[3].params == {"train.lr": 9e-3, "model.d_model": 32}
    text = write_report(tmp_path, exp, recs).read_text()
    for name in ("search_importance", "search_parallel"):
        assert f"![{name}](plots/{name}.png)" in text
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    one = [recs[0]]                                                      # one finished trial: nothing to rank
    assert plots.plot_importance(plots.search_study(exp, one), tmp_path / "none.png") is None
