"""Reference models on a search's Pareto axes (``atlaslab report RUN --compare PRESETS_RUN``): each grid variant placed
at its best learning rate by the search's own score and objectives, the front members that dominate it, a bad
reference folder refused early by name; and the discovery page's comparison regenerated from the committed runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from atlaslab.cli import main
from atlaslab.registry import ConfigError
from atlaslab.search.mattered import against_front, references_section
from atlaslab.search.references import Reference, ReferenceRun, load_reference_run, place, read_trials
from atlaslab.search.schema import load_experiment
from atlaslab.search.tables import write_csvs
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "discovery"
SETTINGS = ("mqar", "in_context_recall", "selective_copying")


def _node(run: str) -> dict:
    return yaml.safe_load((DATA / run / "data" / "experiment.yaml").read_text())


def _search(weights=None):
    node = _node("suite_search")
    if weights:
        node["search"]["score"]["weights"] = weights
    return load_experiment(node=node)


def _trial(i, variant, lr, setting, acc, step_time=0.1, state=1600, seed=0, status="completed"):
    """One grid trial's record, as ``read_trials`` gives it and ``write_csvs`` writes it."""
    return {"key": f"t{i:03d}", "setting": setting, "row": f"{setting} · {variant}", "seed": seed,
            "protocol": {"lr": lr}, "status": status, "failed": status in ("error", "diverged"), "message": "",
            "params": {"train.lr": lr},
            "metrics": {"val/accuracy": acc, "test/accuracy": acc, "step": 300, "step_time_s": step_time},
            "info": {"state_size": state, "num_parameters": 30000}}


def _grid_records():
    """Two presets × two learning rates × three settings (seed 0; A's lr 0.01 on two seeds). A at lr 0.03 has the
    best mean but diverged on one setting, so it does not count; B finishes no learning rate on every setting."""
    recs, i = [], 0
    accs = {("A", 0.01): (0.9, 0.6, 0.3), ("A", 0.003): (0.5, 0.5, 0.5), ("A", 0.03): (1.0, 1.0, 1.0),
            ("B", 0.01): (0.2, 0.2, 0.2), ("B", 0.03): (0.3, 0.3, 0.3)}
    for (v, lr), vals in accs.items():
        for s, acc in zip(SETTINGS, vals):
            seeds = (0, 1) if (v, lr) == ("A", 0.01) else (0,)
            for seed in seeds:
                status = "completed"
                if (v, lr) == ("A", 0.03) and s == "mqar":
                    status = "diverged"
                if v == "B" and s == {0.01: "in_context_recall", 0.03: "selective_copying"}[lr]:
                    status = "error"
                recs.append(_trial(i, v, lr, s, acc + 0.02 * seed, step_time=0.1 if s == "mqar" else 0.2,
                                   state=1600 if s != "mqar" else 1700, seed=seed, status=status))
                i += 1
    return recs


def test_each_variant_sits_at_its_best_lr_by_the_searchs_score():
    refs = {r.label: r for r in place(_search(), _grid_records())}
    a = refs["A"]
    assert a.protocol == {"lr": 0.01} and a.points == 2 and a.seeds == 2      # lr 0.03 diverged on mqar: not a point
    assert a.by_setting["mqar"] == pytest.approx(0.91)                         # the mean over its two seeds
    assert a.value("val/accuracy") == pytest.approx((0.91 + 0.61 + 0.31) / 3)  # the search's score: the mean
    assert a.value("step_time_s") == pytest.approx((0.1 + 0.2 + 0.2) / 3)     # mean over the settings
    assert a.value("state_size") == 1700                                       # the largest
    assert not refs["B"].placed                                               # no lr finished every setting
    # the search's own fitness: its score's weights choose the lr too
    w = {r.label: r for r in place(_search({"selective_copying": 10.0}), _grid_records())}
    assert w["A"].protocol == {"lr": 0.003}                                    # 0.5 beats 0.31 on the heavy setting
    assert w["A"].value("val/accuracy") == pytest.approx((0.5 + 0.5 + 10 * 0.5) / 12)


def _front():
    return [{"key": "c1", "status": "completed", "metrics": {"val/accuracy": 0.7, "step_time_s": 0.04}},
            {"key": "c2", "status": "completed", "metrics": {"val/accuracy": 0.6, "step_time_s": 0.03}}]


def test_the_dominance_column_names_the_front_members_that_dominate_each_reference():
    exp = _search()
    refs = [Reference("slow and bad", {"lr": 0.01}, {"val/accuracy": 0.5, "step_time_s": 0.1}),
            Reference("good", {"lr": 0.03}, {"val/accuracy": 0.9, "step_time_s": 0.05}),
            Reference("fast", {"lr": 0.03}, {"val/accuracy": 0.65, "step_time_s": 0.035}),
            Reference("tie", {"lr": 0.03}, {"val/accuracy": 0.6, "step_time_s": 0.03}),
            Reference("unplaced")]
    rows = {r["reference"].label: r for r in against_front(exp, _front(), refs)}
    assert rows["slow and bad"]["dominated_by"] == ["c1", "c2"]
    assert rows["good"]["dominated_by"] == [] and rows["good"]["dominates"] == []
    assert rows["fast"]["dominated_by"] == [] and rows["fast"]["dominates"] == []
    assert rows["tie"]["dominated_by"] == [] and rows["tie"]["dominates"] == []     # equal is not better
    assert rows["unplaced"]["point"] is None
    cands = [dict(c, by_setting={}) for c in _front()]
    text = "\n".join(references_section(exp, cands, [ReferenceRun(Path("p"), "presets", tuple(refs))],
                                        {"rejected": [{"reason": "x"}]}))
    assert "## Presets against the front" in text
    assert "The search tried 3 candidates (2 trained, 1 rejected before training" in text
    assert "| slow and bad | presets | 0.01 |" in text and "| c1, c2 | — |" in text
    assert "not placed: no point finished every setting" in text
    assert "Not dominated: good (score 0.900 against the front's best 0.700)" in text
    assert "**not** dominated by the search's front" in text


def _presets_run(folder: Path, node=None, records=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    node = node or _node("suite_presets")
    (folder / "experiment.yaml").write_text(yaml.safe_dump(node))
    exp = load_experiment(node=node)
    write_csvs(folder, exp, [], records if records is not None else _grid_records(), [exp.metric])
    return folder


def test_the_reference_run_is_read_back_from_what_the_report_writes(tmp_path):
    run = load_reference_run(_search(), _presets_run(tmp_path / "presets"))
    assert run.name == "discovery_suite_presets"
    assert [r.label for r in run.references] == ["A", "B"]
    assert run.references[0].protocol == {"lr": 0.01}
    assert len(read_trials(tmp_path / "presets" / "trials.csv")) == len(_grid_records())


def test_a_bad_reference_folder_is_an_early_error_naming_it(tmp_path):
    exp = _search()
    with pytest.raises(ConfigError, match=r"compare: .*nope is not a run folder \(no such directory\)"):
        load_reference_run(exp, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"compare: .*empty has no experiment.yaml"):
        load_reference_run(exp, tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"compare: .* is a search; reference models come from a grid run"):
        load_reference_run(exp, _presets_run(tmp_path / "search", node=_node("suite_search")))
    other = _node("suite_presets")
    other["tasks"]["mqar"]["num_kv_pairs"] = [4]
    with pytest.raises(ConfigError, match=r"compare.tasks.mqar: .* trained setting 'mqar' on another task"):
        load_reference_run(exp, _presets_run(tmp_path / "other", node=other))
    fewer = _node("suite_presets")
    fewer["tasks"].pop("selective_copying")
    with pytest.raises(ConfigError, match=r"compare.tasks.selective_copying: .* has no setting 'selective_copying'"):
        load_reference_run(exp, _presets_run(tmp_path / "fewer", node=fewer, records=[]))
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "experiment.yaml").write_text(yaml.safe_dump(_node("suite_presets")))
    with pytest.raises(ConfigError, match=r"compare: .* has no trials.csv yet \(`atlaslab report"):
        load_reference_run(exp, tmp_path / "presets")


def _candidate_records():
    """A finished multi-task search of three candidates (results.json records)."""
    recs, i = [], 0
    for c, (lr, accs, t) in enumerate([(0.01, (0.7, 0.7, 0.7), 0.04), (0.02, (0.6, 0.6, 0.6), 0.03),
                                       (0.005, (0.2, 0.2, 0.2), 0.2)]):
        for s, acc in zip(SETTINGS, accs):
            recs.append({"key": f"t{i:03d}", "candidate": f"c{c:03d}", "setting": s, "row": f"c{c:03d} · {s}",
                         "seed": 0, "index": i, "label": f"c{c:03d}", "params": {"train.lr": lr},
                         "status": "completed", "failed": False, "message": "",
                         "metrics": {"val/accuracy": acc, "test/accuracy": acc, "step": 300, "step_time_s": t},
                         "info": {"state_size": 1500, "num_parameters": 20000}, "history": [],
                         "train": {"steps": 300, "batch_size": 32, "lr": lr}, "task": None})
            i += 1
    return recs


def test_report_compare_end_to_end(tmp_path, capsys):
    run = tmp_path / "search"
    run.mkdir()
    (run / "experiment.yaml").write_text(yaml.safe_dump(_node("suite_search")))
    (run / "results.json").write_text(json.dumps(_candidate_records()))
    presets = _presets_run(tmp_path / "presets")
    assert main(["report", str(run), "--compare", str(tmp_path / "missing")]) == 2
    assert "error: compare: " in capsys.readouterr().err and not (run / "report.md").exists()
    assert main(["report", str(run), "--compare", str(presets)]) == 0
    report = (run / "report.md").read_text()
    section = report.split("## Presets against the front")[1].split("\n## ")[0]
    assert "The search tried 3 candidates" in section
    assert "| A | discovery_suite_presets | 0.01 |" in section and "| c000 | — |" in section   # c000 dominates A
    assert "The search's front dominates 1 of the 1 references placed." in section
    assert (run / "plots" / "pareto.png").is_file()


def _gen_discovery():
    return load_script("docs/gen_discovery.py")


def test_the_discovery_page_comparison_regenerates_from_the_committed_runs(tmp_path):
    gd = _gen_discovery()
    table = gd.suite_front()
    row = next(line for line in table.splitlines() if line.startswith("| DeltaNet |"))
    assert "| 0.03 |" in row and "| 0.950 |" in row and row.endswith("| no | — |")   # the front does not dominate it
    assert "**not** dominated by the search's front (DeltaNet is not)" in table
    assert "The search tried 28 candidates" in table
    pts = gd.suite_pareto_points()
    refs = {label: (x, y) for label, x, y in pts["references"]}
    assert refs["DeltaNet"][1] == pytest.approx(0.9498, abs=1e-4)
    assert max(y for _, y in pts["front"]) == pytest.approx(0.726, abs=1e-3)
    assert len(pts["points"]) == 24 and len(refs) == 5
    assert gd.plot_suite_pareto(tmp_path / "pareto.png").is_file()
    assert gd.FIGURE.is_file()                                  # the page's figure is committed
    assert "(discovery/suite_pareto.png)" in (ROOT / "docs" / "results" / "discovery.md").read_text()
