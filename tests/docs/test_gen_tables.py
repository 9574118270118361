"""docs/gen_tables.py: every generated block of the README and the site equals what its committed data gives, and
the prose around a generated table quotes only numbers the table holds."""
from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

import pytest

from tests.scripts import same_figure as _same_figure

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gt = _load("gen_tables")
gr = _load("gen_runs")


def test_every_generated_block_matches_its_committed_data():
    stale = gt.stale()
    assert not stale, ("generated blocks differ from their data: "
                       + ", ".join(str(p.relative_to(gt.ROOT)) for p, _ in stale)
                       + " (run `python docs/gen_tables.py --write` and commit)")


def test_no_number_in_the_prose_drifts_from_its_generated_table():
    problems = gt.drift_all()
    assert not problems, "\n".join(problems)


def test_the_tables_this_issue_generates_are_on_their_pages():
    where = {}
    for page in gt.pages():
        for m in gt.blocks(page.read_text(), str(page)):
            where.setdefault(m.group("name"), []).append(page.relative_to(gt.ROOT).as_posix())
    assert where["quickstart"] == ["README.md", "docs/results.md"]
    assert where["lm-table2-cpu"] == ["docs/results/lm-table2.md"]
    assert where["recall-vs-state"] == ["docs/results/recall-vs-state.md"]
    assert where["lm-geometry"] == ["docs/concepts/memory.md"]
    for name in ("ablation-grid", "optuna-asha", "own-retention"):
        assert where[f"tutorial-{name}"] == [f"docs/tutorials/{name}.md"]


GENS = {"t": ("test", lambda: "| a |\n|---|\n| 0.961 ± 0.023 |")}
PAGE = "# T\n\nText 0.961 ± 0.023.\n\n<!-- generated: t -->\n\n| a |\n|---|\n| 0.961 ± 0.023 |\n\n<!-- end generated -->\n"


def test_a_changed_number_in_a_block_is_stale_and_write_restores_it():
    assert gt.render(PAGE, GENS) == PAGE
    edited = PAGE.replace("| 0.961 ± 0.023 |", "| 0.962 ± 0.023 |")
    assert gt.render(edited, GENS) == PAGE


def test_bad_markers_and_unknown_blocks_are_errors():
    with pytest.raises(ValueError, match="no generator for block 'u'"):
        gt.render(PAGE.replace("generated: t", "generated: u"), GENS)
    with pytest.raises(ValueError, match="has no"):
        gt.render(PAGE.replace("<!-- end generated -->", ""), GENS)


def test_drift_flags_a_planted_number_and_passes_the_true_one():
    assert gt.drift(PAGE) == []
    assert gt.drift(PAGE.replace("Text 0.961 ± 0.023", "Text 0.961 ± 0.024")) != []
    assert gt.drift(PAGE.replace("Text 0.961", "Text 0.951")) != []
    assert gt.drift(PAGE.replace("Text 0.961 ± 0.023.", "Text 2/3 seeds.")) != []
    # a section without a generated block is not checked; inline code and fences are not prose
    assert gt.drift(PAGE + "\n## Other\n\n0.123 and `0.456`\n") == []
    assert gt.drift(PAGE.replace("Text 0.961 ± 0.023.", "`0.999` and\n```\n0.998\n```\n")) == []


def test_drift_finds_a_wrong_number_planted_in_a_real_page():
    page = (DOCS / "results.md").read_text()
    assert gt.drift(page) == []
    block = next(gt.blocks(page)).group("body")
    row = next(line for line in block.splitlines() if line.startswith("| Titans (LMM)"))
    acc = row.split(" | ")[1]                                   # the quickstart's Titans accuracy, e.g. 0.877
    head, prose = page.split("<!-- end generated -->", 1)
    assert acc in prose.split("\n## ", 1)[0]                   # the section's prose quotes it ...
    wrong = f"{float(acc) + 0.004:.3f}"
    planted = head + "<!-- end generated -->" + prose.replace(acc, wrong, 1)
    assert any(wrong in p for p in gt.drift(planted))          # ... and a wrong quote is found
    # a claim of seeds that the table does not hold is found too
    planted = head + "<!-- end generated -->" + prose.replace("Seven of the eight", "Seven of the eight (3/3 seeds)", 1)
    assert any("3/3 seeds" in p for p in gt.drift(planted))


def _write_run(folder: Path):
    folder.mkdir()
    (folder / "experiment.yaml").write_text(
        "name: x\nmetric: val/accuracy\nmode: max\ngrid: {baseline: B}\n"
        "report: {metrics: [test/accuracy], steps_to: 0.9, averages: {Avg: [test/accuracy, test/other]},"
        " labels: {test/accuracy: acc}}\n")
    head = ["key", "row", "seed", "status", "num_parameters", "state_size", "test/accuracy", "test/other"]
    trials = [("t0", "A", 0, "completed", 1000, 64, 0.9, 0.5), ("t1", "A", 1, "completed", 1000, 64, 0.8, 0.7),
              ("t2", "B", 0, "early_stopped", 23400, 14100, 0.99, 0.1), ("t3", "B", 1, "diverged", 23400, 14100,
                                                                        "", "")]
    with open(folder / "trials.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerows(trials)
    with open(folder / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "variant", "row", "seed", "step", "val/accuracy"])
        w.writerows([("t0", "A", "A", 0, 25, 0.5), ("t0", "A", "A", 0, 50, 0.95), ("t1", "A", "A", 1, 25, 0.6),
                     ("t2", "B", "B", 0, 25, 0.91)])


def test_run_table_means_steps_to_and_seed_counts(tmp_path):
    _write_run(tmp_path / "data")
    lines = gr.run_table(tmp_path / "data").splitlines()
    assert lines[0] == "| variant | acc | Avg | steps to 0.9 | params | state |"
    # A: two seeds, one reached 0.9 (at 50); Avg is each trial's mean of its two metrics, then over seeds
    assert lines[2] == "| A | 0.850 ± 0.071 | 0.725 ± 0.035 | 50 (1/2 seeds) | 1k | 64 |"
    # B: the diverged seed is left out and counted
    assert lines[3] == "| B (baseline) (1/2 finished) | 0.990 | 0.545 | 25 | 23.4k | 14.1k |"


grl = _load("gen_reading_list")


def test_the_reading_list_tables_are_generated_on_their_page():
    page = (DOCS / "results" / "reading-list.md").read_text()
    names = [m.group("name") for m in gt.blocks(page)]
    assert sorted(names) == sorted(grl.TABLES)
    assert not any(line.startswith("| model") for line in gt.BLOCK.sub("", page).splitlines())


def test_every_reading_list_run_without_data_is_in_the_pages_rerun_list():
    """A row printed as "no committed data" names its lost run, and the page's one rerun list names it too."""
    page = (DOCS / "results" / "reading-list.md").read_text()
    rerun = page.split("{#rerun}", 1)[1].split("\n## ", 1)[0]
    lost = set()
    for name, fn in grl.TABLES.items():
        for line in fn().splitlines():
            if grl.LOST in line:
                lost |= set(re.findall(r"\b(?:rlist|rvs)_\w+", line.split(grl.LOST, 1)[1]))
    assert {"rvs_atlas8", "rlist_mqar", "rlist_swa16", "rlist_lact_lr0", "rlist_lact_lr", "rlist_long",
            "rlist_armt_long"} <= lost
    assert not [run for run in lost if f"`{run}`" not in rerun and f"`runs/{run}`" not in rerun]


def test_reading_list_cells_and_a_missing_row_is_an_error(tmp_path):
    assert grl.seeds_cell([0.9, 0.8, 1.0]) == "0.900 ± 0.100 (0.900, 0.800, 1.000)"
    assert grl.seeds_cell([0.0, 0.0]) == "0" and grl.seeds_cell([0.25]) == "0.250" and grl.seeds_cell([]) == "—"
    assert grl.each_cell([0.0, 0.1234]) == "0 / 0.123"
    _write_run(tmp_path / "r")
    assert [t["seed"] for t in grl.trials("r", "A", tmp_path)] == ["0", "1"]
    assert [t["seed"] for t in grl.trials("r", "B", tmp_path)] == ["0"]        # the diverged seed is left out
    with pytest.raises(ValueError, match="no finished trial of row 'C'"):
        grl.trials("r", "C", tmp_path)


def test_the_papers_table2_avg_is_the_mean_of_its_eight_accuracies():
    """The paper's rows are typed once into a CSV; a mistyped cell shows as an Avg that is not the row's mean."""
    off = []
    for block in ("760M", "1.3B"):
        for r in gr.paper_rows(block):
            mean = sum(float(r[c]) for c in gr.PAPER_ACCURACIES) / len(gr.PAPER_ACCURACIES)
            if abs(float(r["avg"]) - mean) > 0.07:
                off.append((block, r["model"]))
    assert off == [("1.3B", "Memora")]          # the one row the page names as unchecked
    assert len(gr.paper_rows("760M")) == 16 and len(gr.paper_rows("1.3B")) == 12


def test_drift_reads_the_bench_reports_a_section_includes_or_names():
    """A section that includes a bench report (``--8<--``) is checked against it, ratios and intervals (r×, a–b×)
    included; a report the section names (``learning_hard_gdn_cpu``) counts as its data too."""
    report = gt.ROOT / "bench" / "results" / "learning_hard_gdn_cpu.md"
    row = next(line for line in report.read_text().splitlines() if line.startswith("| gated_deltanet | fla_"))
    ratio, interval = row.split(" | ")[6], row.split(" | ")[7]                 # e.g. 0.93×, 0.59–1.62×
    included = f'# P\n\n--8<-- "bench/results/learning_hard_gdn_cpu.md"\n\nOurs / fla: {ratio}, interval {interval}.\n'
    assert gt.drift(included) == []
    assert gt.drift(included.replace(ratio, "0.01×")) != []
    lo, hi = interval.rstrip("×").split("–")
    assert gt.drift(included.replace(interval, f"{lo}–9.99×")) != []
    named = f"# P\n\n<!-- generated: t -->\n| a |\n<!-- end generated -->\n\nIn `learning_hard_gdn_cpu`: {ratio}.\n"
    assert gt.drift(named) == [] and gt.drift(named.replace("`learning_hard_gdn_cpu`", "another file")) != []
    # a section with neither a generated block nor an included report is not checked
    assert gt.drift(f"# P\n\nIn `learning_hard_gdn_cpu`: 0.01×.\n") == []


def test_drift_finds_a_wrong_ratio_planted_in_a_page_that_includes_its_report():
    page = (DOCS / "results" / "learning-hard-deltanet.md").read_text()
    assert gt.drift(page) == [] and "1.45×" in page
    assert any("1.46×" in p for p in gt.drift(page.replace("1.45×", "1.46×", 1)))


def test_the_run_pages_figures_redraw_from_their_committed_data(tmp_path, monkeypatch):
    """The figures of Table 6 at CPU scale, the CPU-sized LM table and recall against state size are drawn from the
    committed run data (``python docs/gen_runs.py --plots``, ``python docs/gen_recall_vs_state.py``): every
    committed PNG of those folders is redrawn here and equals the committed one."""
    grv = _load("gen_recall_vs_state")
    checked = []
    for name, (folders, metric) in gr.PLOTS.items():
        (tmp_path / name).mkdir()
        drawn = {p.name: p for p in gr.plots(folders, tmp_path / name, metric)}
        for committed in sorted((DOCS / "results" / name).glob("*.png")):
            assert committed.name in drawn, f"{committed} is not drawn by docs/gen_runs.py --plots"
            assert _same_figure(drawn[committed.name], committed), f"{committed} differs from its redraw"
            checked.append(committed.name)
    monkeypatch.setattr(grv, "OUT", tmp_path / "state.png")
    grv.plot()
    assert _same_figure(tmp_path / "state.png", DOCS / "results" / "recall-vs-state" / "state.png")
    assert len(checked) == 4                     # table6-cpu's bar, curves and length plots; lm-table2's curves
