"""``atlaslab train`` logs to MLflow like a trial (params, metrics at every report, the final metrics), in the one
default store beside the run folders (``runs/mlflow.db``), resumes into the same run, and a store of one run's own
stays an option (``--tracking-uri``). The UI finds the shared store from a run folder, the runs folder or an older
run's own ``mlruns.db``."""
import json
from pathlib import Path

import pytest
import yaml

from atlaslab.cli import main
from atlaslab.registry import ConfigError
from atlaslab.search import tracking as T
from atlaslab.search.ui import find_store

CONFIG = {"name": "tiny",
          "model": {"preset": "linear_attention", "overrides": {"d_model": 16, "num_layers": 1,
                                                                "mixers.*.num_heads": 2}},
          "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 16},
          "train": {"steps": 4, "batch_size": 4, "eval_interval": 2, "log_interval": 2, "eval_examples": 16,
                    "progress": "never"}}


def _client(db: Path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri="sqlite:///" + str(db))


def _write(tmp_path: Path, steps: int = 4) -> Path:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["train"]["steps"] = steps
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_logs_params_metrics_and_final_metrics_to_the_shared_store(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path)
    assert main(["train", str(cfg), "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    result = json.loads((tmp_path / "runs" / "tiny" / "result.json").read_text())
    db = tmp_path / "runs" / "mlflow.db"
    assert db.is_file() and not (tmp_path / "runs" / "tiny" / "mlruns.db").exists()
    c = _client(db)
    exp = c.get_experiment_by_name("tiny")
    (run,) = c.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["atlaslab.kind"] == "train" and run.data.tags["atlaslab.status"] == "completed"
    assert run.data.tags["atlaslab.run_dir"] == str((tmp_path / "runs" / "tiny").resolve())
    p = run.data.params
    assert p["model.preset"] == "linear_attention" and p["train.steps"] == "4" and p["task.name"] == "mqar"
    assert int(p["info.num_parameters"]) == result["model_info"]["num_parameters"]
    # every report of the loop is a metric at its step; the final metrics are the last value
    curve = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "val/accuracy")}
    want = {h["step"]: h["val/accuracy"] for h in result["history"] if "val/accuracy" in h}
    assert curve == pytest.approx(want) and sorted(curve) == [2, 4]
    for k in ("test/accuracy", "test/loss", "train/loss"):
        assert run.data.metrics[k] == pytest.approx(out["metrics"][k])
    assert (tmp_path / "runs" / "mlartifacts").is_dir()
    # the same command again resumes from the checkpoint into the same MLflow run, with no metric twice
    assert main(["train", str(cfg), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 4
    (again,) = c.search_runs([exp.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "val/accuracy")] == [2, 4]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "test/accuracy")] == [4]
    # a resume refused for other settings leaves the finished run as it was
    assert main(["train", str(cfg), "train.steps=6", "--quiet"]) == 2
    capsys.readouterr()
    assert c.get_run(run.info.run_id).info.status == "FINISHED"
    # --fresh starts a new run; a second config name is a second MLflow experiment in the same store
    assert main(["train", str(cfg), "--quiet", "--fresh"]) == 0
    assert main(["train", str(cfg), "name=other", "--quiet", "--no-checkpoint"]) == 0
    capsys.readouterr()
    assert len(c.search_runs([exp.experiment_id])) == 2
    assert c.get_experiment_by_name("other") is not None


def test_train_tracking_can_be_elsewhere_or_off(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = _write(tmp_path, steps=2)
    own = tmp_path / "runs" / "a" / "mlruns.db"
    assert main(["train", str(cfg), "--quiet", "--run-dir", "runs/a", "--tracking-uri", f"sqlite:///{own}"]) == 0
    assert own.is_file() and not (tmp_path / "runs" / "mlflow.db").exists()
    assert len(_client(own).search_runs([_client(own).get_experiment_by_name("tiny").experiment_id])) == 1
    assert main(["train", str(cfg), "--quiet", "--run-dir", "runs/b", "--no-tracking"]) == 0
    capsys.readouterr()
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_the_default_store_is_shared_by_the_run_folders_beside_each_other(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a, b = tmp_path / "runs" / "a-1", tmp_path / "runs" / "b-2"
    assert T.default_tracking_uri(a) == T.default_tracking_uri(b) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert T.artifact_location(T.default_tracking_uri(a)) == (tmp_path / "runs" / "mlartifacts").as_uri()
    assert T.default_tracking_uri(a, "http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert T.default_tracking_uri(a) == "sqlite:///elsewhere.db"
    assert T.artifact_location("http://127.0.0.1:5000") is None


def test_the_ui_finds_the_shared_store_from_a_run_folder_or_the_runs_folder(tmp_path):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no MLflow store"):
        find_store(runs / "a")
    (runs / "mlflow.db").write_bytes(b"")
    (runs / "a" / "state.json").write_text(json.dumps({"tracking": {"uri": f"sqlite:///{runs / 'mlflow.db'}"}}))
    assert find_store(runs / "a") == ((runs / "mlflow.db").resolve(), (runs / "mlartifacts").resolve())
    assert find_store(runs)[0] == (runs / "mlflow.db").resolve()
    (runs / "old").mkdir()
    (runs / "old" / "mlruns.db").write_bytes(b"")            # a run folder with its own store (older runs)
    old = runs / "old"
    assert find_store(old) == ((old / "mlruns.db").resolve(), (old / "mlartifacts").resolve())
