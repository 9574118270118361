"""``atlaslab.load_results`` / ``load_curves``: a run folder as pandas DataFrames, from each file it may hold
(``results.json`` of a finished run, ``trials.csv`` of a committed sweep, ``result.json`` of ``atlaslab train``),
and end to end: an experiment run from Python (``atlaslab.prepare`` / ``atlaslab.run``) read back."""
import json
import math
import runpy
from pathlib import Path

import pandas as pd
import pytest

import atlaslab
from atlaslab.registry import ConfigError
from atlaslab.search import driver, frame

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "results" / "reading-list" / "runs" / "rlist_niah_s0"


def test_the_notebook_api_is_exported_lazily():
    assert atlaslab.run is driver.run and atlaslab.prepare is driver.prepare and atlaslab.resume is driver.resume
    assert atlaslab.load_results is frame.load_results and atlaslab.load_curves is frame.load_curves
    assert {"run", "prepare", "resume", "load_results", "load_curves"} <= set(atlaslab.__all__)
    with pytest.raises(AttributeError):
        atlaslab.no_such_name


def test_a_committed_sweep_reads_from_trials_csv():
    df = atlaslab.load_results(COMMITTED)
    csv = pd.read_csv(COMMITTED / "trials.csv")
    trials = json.loads((COMMITTED / "trials.json").read_text())
    assert list(df.columns[:len(frame.COLUMNS)]) == list(frame.COLUMNS) and len(df) == len(csv) == len(trials)
    assert list(df["key"]) == [t["key"] for t in trials] and list(df["variant"]) == [t["variant"] for t in trials]
    assert df["test/accuracy"].tolist() == pytest.approx(csv["test/accuracy"].tolist())
    assert df.loc[0, "config"] == trials[0]["config"] and df.loc[0, "params"] == trials[0]["params"]
    assert df.attrs["run_dir"] == str(COMMITTED)
    with pytest.raises(ConfigError, match="learning curves were not kept"):
        atlaslab.load_curves(COMMITTED)


def test_results_json_gives_rows_and_curves(tmp_path):
    trials = [{"key": f"t00{i}", "variant": v, "config": {"train": {"lr": lr}}} for i, (v, lr) in
              enumerate([("A", 1e-3), ("B", 3e-3)])]
    records = [{"key": t["key"], "setting": "s", "variant": t["variant"], "row": t["variant"], "seed": 0,
                "params": {"x": i}, "status": "completed", "message": "", "info": {"num_parameters": 10 + i},
                "metrics": {"step": 4, "test/accuracy": 0.5 + i / 4, "val/loss": None, "final": 1},
                "history": [{"step": 2, "val/accuracy": 0.1 * i}, {"step": 4, "val/accuracy": 0.2 * i,
                                                                    "test/accuracy": 0.5 + i / 4}]}
               for i, t in enumerate(trials)]
    (tmp_path / "results.json").write_text(json.dumps(records))
    (tmp_path / "trials.json").write_text(json.dumps(trials))
    df = atlaslab.load_results(tmp_path)
    assert df["test/accuracy"].tolist() == [0.5, 0.75] and df["steps"].tolist() == [4, 4]
    assert math.isnan(df.loc[0, "val/loss"]) and "final" not in df.columns
    assert df.loc[1, "config"] == {"train": {"lr": 3e-3}} and df["num_parameters"].tolist() == [10, 11]
    curves = atlaslab.load_curves(tmp_path)
    assert list(curves.columns) == list(frame.CURVE_KEYS) + ["step", "test/accuracy", "val/accuracy"]
    assert curves[curves["key"] == "t001"]["val/accuracy"].tolist() == pytest.approx([0.1, 0.2])
    with pytest.raises(ConfigError, match="is not a folder"):
        atlaslab.load_results(tmp_path / "missing")
    (tmp_path / "results.json").unlink()
    (tmp_path / "trials.json").unlink()
    with pytest.raises(ConfigError, match="atlaslab report"):
        atlaslab.load_results(tmp_path)


def test_a_train_run_folder_is_one_row(tmp_path, monkeypatch, capsys):
    from atlaslab.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.yaml").write_text(
        "name: one\nmodel: {preset: linear_attention, overrides: {d_model: 16, num_layers: 1}}\n"
        "task: {name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: [2], eval_examples: 16}\n"
        "train: {steps: 4, batch_size: 4, eval_interval: 2, eval_examples: 16, progress: never}\n")
    assert main(["train", "t.yaml", "--quiet", "--no-tracking"]) == 0
    out = json.loads(capsys.readouterr().out)
    df = atlaslab.load_results("runs/one")
    assert len(df) == 1 and df.loc[0, "variant"] == "one" and df.loc[0, "steps"] == 4
    assert df.loc[0, "test/accuracy"] == pytest.approx(out["metrics"]["test/accuracy"])
    assert df.loc[0, "config"]["model"]["preset"] == "linear_attention"
    curves = atlaslab.load_curves("runs/one")
    assert curves.dropna(subset=["val/accuracy"])["step"].tolist() == [2, 4]


TINY = {"name": "frame", "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
        "task": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 32},
        "eval": {"interval": 5, "examples": 32}, "train": {"steps": 10, "batch_size": 8, "log_interval": 5},
        "grid": {"variants": {"lr 3e-3": {"train.lr": 3e-3}, "lr 1e-2": {"train.lr": 1e-2}}}}


def test_run_from_python_and_read_it_back(local_ray, tmp_path, capsys):
    """The docs' curves example (docs/analysis_curves_example.py: analyse) on a run made with atlaslab.run."""
    p = atlaslab.prepare(node=TINY)
    summary = atlaslab.run(p, run_dir=tmp_path / "runs" / "frame", num_cpus=2, quiet=True)
    assert summary["completed"] == 2
    assert (tmp_path / "runs" / "mlflow.db").is_file()                 # the default store beside the run folder
    analyse = runpy.run_path(str(ROOT / "docs" / "analysis_curves_example.py"))["analyse"]
    df, curves = analyse(summary["run_dir"])
    printed = capsys.readouterr().out
    assert "lr 3e-3" in printed and "lr 1e-2" in printed
    records = {r["key"]: r for r in json.loads((Path(summary["run_dir"]) / "results.json").read_text())}
    assert set(df["key"]) == set(records) and set(df["status"]) == {"completed"}
    for _, row in df.iterrows():
        rec = records[row["key"]]
        assert row["test/accuracy"] == pytest.approx(rec["metrics"]["test/accuracy"])
        assert row["config"]["train"]["lr"] == rec["train"]["lr"]
        got = curves[curves["key"] == row["key"]].dropna(subset=["val/accuracy"])
        assert got["step"].tolist() == [h["step"] for h in rec["history"] if h.get("val/accuracy") is not None]


def test_a_multi_task_search_reads_with_its_candidates():
    """A search scored on several settings: each trial carries its candidate, so a notebook groups the settings of
    one draw (the committed multi-task discovery search: 24 candidates × 3 settings)."""
    run = ROOT / "docs" / "results" / "discovery" / "suite_search" / "data"
    df = atlaslab.load_results(run)
    csv = pd.read_csv(run / "trials.csv")
    assert df["candidate"].tolist() == csv["candidate"].tolist()
    sizes = df.groupby("candidate")["setting"].nunique()
    assert len(sizes) == 24 and set(sizes) == {3}
    assert atlaslab.load_results(COMMITTED)["candidate"].eq("").all()
