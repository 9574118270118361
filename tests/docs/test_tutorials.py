"""The tutorials under docs/tutorials/ run end to end, from the very files their pages include.

Each test runs a tutorial's shell script (``bash docs/tutorials/<name>/run.sh``) in a subprocess, at tiny size:
the overrides below (fewer steps, seeds or samples) are the only difference from what a reader runs, and each
page says so. Ray and MLflow talk only to 127.0.0.1; a script that starts servers stops them by their pids.
"""
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TUTORIALS = ROOT / "docs" / "tutorials"


def search_test_module(name):
    """A module of the search tests (``free_port`` and friends live there), in tests/ or tests/search/."""
    for folder in (TESTS, TESTS / "search"):
        if (folder / f"{name}.py").is_file():
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            return importlib.import_module(name)
    raise ImportError(f"{name}.py is in neither tests/ nor tests/search/")


def env(**extra):
    """The reader's shell: the venv's atlaslab / ray / mlflow on PATH, nothing pointing at a shared server."""
    e = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
             RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", **extra)
    for k in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        e.pop(k, None)
    return e


def bash(script, *args, timeout=300, **extra):
    t0 = time.time()
    r = subprocess.run(["bash", str(script), *map(str, args)], cwd=ROOT, env=env(**extra), capture_output=True,
                       text=True, timeout=timeout)
    print(f"{script.relative_to(ROOT)}: {time.time() - t0:.0f} s")
    return r


def records(run_dir):
    return {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}


@pytest.mark.parametrize("name", ["ablation-grid", "optuna-asha", "own-retention"])
def test_the_committed_run_is_a_run_of_the_tutorials_file_as_it_stands(name):
    """The page's table is generated from ``docs/tutorials/<name>/data/`` (docs/gen_runs.py); that run is of the
    tutorial's experiment file as committed, with no command-line override, and it finished: an edit of the file
    that would change what ``run.sh`` trains makes the committed data stale, and this fails until it is rerun."""
    import yaml
    data = TUTORIALS / name / "data"
    assert yaml.safe_load((data / "experiment.yaml").read_text()) == \
        yaml.safe_load((TUTORIALS / name / "experiment.yaml").read_text())
    state = json.loads((data / "state.json").read_text())
    assert state["overrides"] == [] and state["status"] == "finished"
    assert state["source"].endswith(f"docs/tutorials/{name}/experiment.yaml")
    for f in ("trials.csv", "curves.csv"):
        assert (data / f).is_file(), f


def test_own_retention(tmp_path):
    run_dir = tmp_path / "run"
    r = bash(TUTORIALS / "own-retention" / "run.sh", "train.steps=20", "eval.interval=10",
             "--run-dir", run_dir, "--quiet")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # check.py: three ConfigErrors with the dotted path and the choices, and the engines agree
    assert "memory.retention.name: module 'my_retention' was imported but registers no retention named " \
           "'norm_bal'. Did you mean 'norm_ball'?" in out
    assert "memory.retention.raduis: retention 'norm_ball' has no field 'raduis'. Did you mean 'radius'?" in out
    assert "memory.retention.radius: bad value -1.0" in out
    assert out.count("recurrent = chunked = triton") == 3 and "Triton kernel: retention 'norm_ball'" in out
    recs = records(run_dir)
    assert [recs[k]["status"] for k in sorted(recs)] == ["completed"] * 3, recs
    report = (run_dir / "report.md").read_text()
    assert "| decay (built-in) (baseline) |" in report and "| norm ball, R = 1 |" in report
    assert "| norm ball, R = 4 |" in report


def test_own_retention_typo_is_a_config_error(tmp_path):
    """The page's claim: a typo in the YAML fails before anything runs, naming the path and the choices."""
    here = TUTORIALS / "own-retention"
    bad = tmp_path / "experiment.yaml"
    bad.write_text((here / "experiment.yaml").read_text().replace("my_retention.norm_ball, radius: 4.0",
                                                                    "my_retention.norm_bal, radius: 4.0"))
    r = subprocess.run(["atlaslab", "run", str(bad), "--dry-run"], cwd=ROOT, env=env(PYTHONPATH=str(here)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trial t002 (norm ball, R = 4): model.mixers.gated_deltanet.memory.retention.name" in r.stderr
    assert "Did you mean 'norm_ball'?" in r.stderr and "Valid choices: decay, " in r.stderr


def test_ablation_grid(tmp_path):
    run_dir = tmp_path / "run"
    r = bash(TUTORIALS / "ablation-grid" / "run.sh", "seeds=[0]", "train.steps=20", "eval.interval=10",
             "--run-dir", run_dir, "--quiet")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "grid 'zip_widths': 3 trials" in out and "d_model=64 · num_heads=8" in out
    assert "grid 'ablation_grid': 5 trials" in out                 # 3 variants × 2 windows − 1 excluded
    recs = records(run_dir)
    assert sorted(r["row"] for r in recs.values()) == sorted(
        [f"{v} · window.size={c}" for v in ("Gated DeltaNet", "DeltaNet") for c in (1, 2)]
        + ["linear attention · window.size=1"])
    assert all(r["status"] == "completed" for r in recs.values()), recs
    report = (run_dir / "report.md").read_text()
    assert "| Gated DeltaNet · window.size=1 (baseline) |" in report and "steps to 0.9" in report
    assert "test/len_32/accuracy" in report and "## Test accuracy vs evaluation length" in report
    for plot in ("curves", "length", "axis_window_size", "bar_test_accuracy"):
        assert (run_dir / "plots" / f"{plot}.png").is_file(), plot


def test_optuna_asha(tmp_path):
    run_dir = tmp_path / "run"
    r = bash(TUTORIALS / "optuna-asha" / "run.sh", "num_samples=4", "train.steps=40", "eval.interval=10",
             "scheduler.grace_period=10", "--run-dir", run_dir, "--quiet")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "search 'optuna_asha': 4 samples, sampler tpe, scheduler asha" in out
    assert "when model.mixers.gated_deltanet.memory.inner_optimizer.name=momentum" in out
    recs = records(run_dir)
    assert len(recs) == 4 and all(r["status"] in ("completed", "pruned") for r in recs.values()), recs
    opt = "model.mixers.gated_deltanet.memory.inner_optimizer."
    for rec in recs.values():               # the conditional parameter exists exactly where its condition holds
        assert (opt + "momentum" in rec["params"]) == (rec["params"][opt + "name"] == "momentum"), rec["params"]
    report = (run_dir / "report.md").read_text()
    assert "## Trials (best first)" in report and "Steps trained in total" in report
    pruned = [r for r in recs.values() if r["status"] == "pruned"]
    if pruned:
        assert f"{len(pruned)} stopped early by ASHA" in report
        assert all(r["metrics"]["step"] < 40 for r in pruned)


@pytest.mark.slow
def test_ray_cluster_and_mlflow_server(tmp_path):
    """One trial is held at step 25 (after its first checkpoint, :mod:`faultpoints`), and the script presses Ctrl-C
    on that event (``INTERRUPT_ON``), so the interruption always finds the sweep unfinished; the resumed trial
    passes step 25 without a hold."""
    free_port = search_test_module("test_search_cluster").free_port
    work, hold = tmp_path / "work", tmp_path / "hold"
    hold.mkdir()
    held = ["imports=[faultpoints]", "task.name=held_mqar", f"task.hold_dir={hold}", "task.hold_steps=[25]"]
    path = os.pathsep.join([str(ROOT), str(TESTS / "search"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = bash(TUTORIALS / "ray-cluster-mlflow" / "cluster.sh", work, "seeds=[0]", "train.steps=100",
             "eval.interval=10", *held, timeout=600, RAY_PORT=str(free_port()), MLFLOW_PORT=str(free_port()),
             PYTHONPATH=path, INTERRUPT_ON=str(hold / "held.25"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Interrupted with" in out and "atlaslab resume" in out         # step 3 was cut short by Ctrl-C
    recs = records(work / "run")
    assert [recs[k]["status"] for k in sorted(recs)] == ["completed", "completed"], recs
    state = json.loads((work / "run" / "state.json").read_text())
    assert state["status"] == "finished" and state["tracking"]["uri"].startswith("http://127.0.0.1:")
    assert not (work / "run" / "mlruns.db").exists() and (work / "mlflow.db").is_file()   # tracked on the server
    assert out.count("FINISHED  t00") == 2 and "FINISHED  parent" in out
