"""Faults of a sweep, each injected on an event (a trial held at a step by :mod:`faultpoints`, a result of a given
step), never after a number of seconds: a torn Ray checkpoint on resume, and Ray's copy of the trial folders
racing with the loop's checkpoint writes. The fault table of docs/reliability.md lists these tests."""
import json
import os
import signal
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# the trials import faultpoints (``imports: [faultpoints]``): Ray's workers inherit PYTHONPATH from this process
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import faultpoints  # noqa: E402,F401
from ray.tune import Stopper  # noqa: E402
from test_search_ray import mlflow_runs, tiny  # noqa: E402
from test_workers_per_trial import InterruptAtStep  # noqa: E402


def held(name, hold_dir, steps, hold_steps, **extra):
    """The tiny experiment of the search tests on ``held_mqar``: its trials wait at ``hold_steps`` once."""
    node = tiny(name, steps=steps, **extra)
    node["task"] = {**node["task"], "name": "held_mqar", "hold_dir": str(hold_dir), "hold_steps": list(hold_steps)}
    node["imports"] = ["faultpoints"]
    return node


class InterruptAtResult(InterruptAtStep, Stopper):
    """Ctrl-C (SIGINT to this process) when the driver handles the result of ``step``, once."""


def flip_a_tensor_byte(path):
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.compress_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def loop_files(root):
    """Files of the training loop's own checkpoint (``checkpoint.pt``, its previous copy, temporary files) under
    ``root`` that are not inside a Ray checkpoint (``checkpoint_<index>/``)."""
    return [p for p in Path(root).rglob("*checkpoint*.pt*")
            if p.is_file() and not any(part.startswith("checkpoint_") for part in p.relative_to(root).parts[:-1])]


def test_a_torn_ray_checkpoint_falls_back_to_the_previous_one_and_no_copy_sees_the_loop_files(local_ray, tmp_path):
    """The trial reports at steps 10, 20, 30, 40, each with a Ray checkpoint of the loop's checkpoint of that step
    (the loop writes it before it calls back); the driver is interrupted on the result of step 40, and a hold at step
    45 keeps the trial from finishing before that. The loop's checkpoint files are in none of the folders Tune copies
    (its trial folders under ``driver_artifacts`` and the run's storage). Ray checkpoints are then torn (one bit of a
    tensor), and the resumed trial falls back to the one before them (step 20), says so in its record and its MLflow
    run, and ends with the metrics of an uninterrupted run."""
    import ray

    from atlaslab.search.build import build_trial
    from atlaslab.search.driver import prepare, resume, run
    from atlaslab.train import train

    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    node = held("torn", hold_dir, steps=60, hold_steps=[45])
    run_dir = tmp_path / "run"
    summary = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True,
                  stop=InterruptAtResult(tmp_path / "flag", 40))
    assert summary["status"] == "interrupted"               # the hold at step 45 kept the trial from finishing first
    faultpoints.release(hold_dir, 45)
    staging = Path(ray._private.worker._global_node.get_session_dir_path()) / "artifacts"
    synced = [p for p in staging.rglob("driver_artifacts") if p.is_dir()]
    assert synced and not [f for d in synced for f in loop_files(d)]    # Tune's trial folders: no loop file
    assert not loop_files(run_dir / "ray")                              # nor the run's storage

    trial_dir = next((run_dir / "ray" / "tune").glob("t000*"))
    kept = sorted(trial_dir.glob("checkpoint_*"))
    steps = [json.loads((d / "atlaslab_trial.json").read_text())["reported_step"] for d in kept]
    assert steps == [20, 30, 40], steps
    # Tune restores the last checkpoint its saved state records: that of step 40 or, when the interruption came
    # before Tune recorded it, that of step 30. Both are torn, so the trial must go back to the one of step 20.
    for d in kept[1:]:
        flip_a_tensor_byte(d / "checkpoint.pt")

    s2 = resume(run_dir, quiet=True)
    assert s2["status"] == "finished" and s2["completed"] == 1
    rec = json.loads((run_dir / "results.json").read_text())[0]
    note = rec["metrics"]["checkpoint_fallback"]
    assert f"Ray checkpoint {kept[1].name}" in note and "CRC-32" in note
    assert f"previous Ray checkpoint {kept[0].name} (reported at step 20)" in note
    assert rec["metrics"]["resumed_from"] == 20             # the loop state that checkpoint holds: its own step

    plain = dict(node, task={k: v for k, v in node["task"].items() if k not in ("hold_dir", "hold_steps")})
    plain["task"]["name"] = "mqar"
    task, tcfg, model = build_trial(prepare(node=plain).trials[0])
    ref = train(model, task, tcfg)
    for k in ("train/loss", "val/accuracy", "test/accuracy"):
        assert rec["metrics"][k] == ref.metrics[k], k        # trained on the kept checkpoint, not on the torn one

    state = json.loads((run_dir / "state.json").read_text())
    c, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(children) == 1 and children[0].info.status == "FINISHED"
    assert "CRC-32" in children[0].data.tags["atlaslab.checkpoint_fallback"]
    val = [m.step for m in c.get_metric_history(children[0].info.run_id, "val/accuracy")]
    assert val == [10, 20, 30, 40, 50, 60]                   # none missing, none twice


def test_a_grid_trial_tune_had_not_created_when_interrupted_runs_on_resume(local_ray, tmp_path):
    """Tune keeps a grid's typed model configs in memory only (its saved state holds placeholders for them): the
    driver is interrupted on the result of step 10 of the first trial (held at step 15, one trial at a time), so
    Tune has not created the second one; on resume it gets its typed config again and trains."""
    from atlaslab.search.driver import prepare, resume, run
    from atlaslab.search.results import saved_trials

    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    node = held("late", hold_dir, steps=20, hold_steps=[15], max_concurrent=1,
                grid={"variants": {"A": {}, "B": {"train.lr": 1e-2}}})
    run_dir = tmp_path / "run"
    s1 = run(prepare(node=node), run_dir=run_dir, num_cpus=1, quiet=True,
             stop=InterruptAtResult(tmp_path / "flag", 10))
    faultpoints.release(hold_dir, 15)
    assert s1["status"] == "interrupted"
    assert [k[:4] for k in saved_trials(run_dir / "ray" / "tune")] == ["t000"]     # t001 not created yet
    s2 = resume(run_dir, quiet=True)
    recs = json.loads((run_dir / "results.json").read_text())
    assert s2["status"] == "finished" and s2["completed"] == 2, [(r["key"], r["message"]) for r in recs]
    assert [(r["key"], r["status"], r["metrics"]["step"]) for r in recs] == [("t000", "completed", 20),
                                                                            ("t001", "completed", 20)]


# --------------------------------------------------------------------------------------------------
# the tracking server down
# --------------------------------------------------------------------------------------------------
def start_server(tmp_path, port):
    """``mlflow server`` on 127.0.0.1:``port`` (SQLite store in ``tmp_path``), in its own process group."""
    import subprocess
    import sys

    from test_search_cluster import wait_http
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        cwd=tmp_path, env=env, stdout=open(tmp_path / "server.log", "a"), stderr=subprocess.STDOUT,
        start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def stop_server(proc):
    """End the server's process group (the server and its workers), by the handle that started it."""
    import subprocess
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.slow
def test_the_tracking_server_down_mid_sweep_loses_no_metric(tmp_path):
    """The trial is held at step 15; the test stops the MLflow server and lets the trial go: it trains on through
    two evaluations (steps 20 and 30) with nobody to log to, and is held again at step 35; the test starts the
    server again (same store, same port) and lets it go. Every metric of every step reaches the run, once."""
    import subprocess
    import sys

    import yaml

    from test_search_cluster import free_port
    from test_search_ray import cli, env

    hold = tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    node = held("outage", hold, steps=60, hold_steps=[15, 35], max_failures=0)
    exp = tmp_path / "outage.yaml"
    exp.write_text(yaml.safe_dump(node))
    server = start_server(tmp_path, port)
    log = open(tmp_path / "driver.log", "w+")
    proc = subprocess.Popen(cli("run", str(exp), "--run-dir", str(tmp_path / "run"), "--num-cpus", "1",
                                "--tracking-uri", uri), cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        faultpoints.wait_held(hold, 15, proc)
        stop_server(server)                                  # the server goes away at step 15 …
        faultpoints.release(hold, 15)
        faultpoints.wait_held(hold, 35, proc)                # … the trial trains on to step 35 …
        server = start_server(tmp_path, port)                # … and the server comes back
        faultpoints.release(hold, 35)
        rc = proc.wait(timeout=600)
        assert rc == 0, Path(log.name).read_text()
        recs = json.loads((tmp_path / "run" / "results.json").read_text())
        assert [r["status"] for r in recs] == ["completed"]
        c, parents, children = mlflow_runs(uri)
        assert len(parents) == 1 and len(children) == 1 and children[0].info.status == "FINISHED"
        outage = children[0].data.tags["atlaslab.tracking_outages"]           # the run says what happened
        assert "the metrics of steps 20–35 waited in the trial and were sent when it answered again" in outage, outage
        rid = children[0].info.run_id
        for metric, every in (("val/accuracy", 10), ("train/loss", 5)):
            steps = [m.step for m in c.get_metric_history(rid, metric)]
            assert sorted(steps) == list(range(every, 61, every)), (metric, steps)   # none missing, none twice
        hist = {h["step"]: h["val/accuracy"] for h in recs[0]["history"] if h.get("val/accuracy") is not None}
        assert {m.step: m.value for m in c.get_metric_history(rid, "val/accuracy")} == hist
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        stop_server(server)


@pytest.mark.slow
def test_a_tracking_server_that_never_comes_back_ends_the_sweep_clearly_and_the_run_resumes(tmp_path):
    """The server goes away at step 15 and does not come back: after the outage bound (``ATLASLAB_TRACKING_OUTAGE_S``
    = 20 s, a bound, not the trigger) the trial stops with ``TrackingUnavailable`` naming the steps not sent, and
    ``atlaslab run`` exits 1 with a clear error. With the server back, ``atlaslab resume`` finishes the trial, and
    its MLflow run ends with every metric of every step, once (what the dead attempt had not sent is re-sent from the
    restored loop's history)."""
    import subprocess

    import yaml

    from test_search_cluster import free_port
    from test_search_ray import cli, env

    hold = tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    node = held("gone", hold, steps=60, hold_steps=[15], max_failures=0)
    exp = tmp_path / "gone.yaml"
    exp.write_text(yaml.safe_dump(node))
    run_dir = tmp_path / "run"
    server = start_server(tmp_path, port)
    e = dict(env(), ATLASLAB_TRACKING_OUTAGE_S="20")
    log = open(tmp_path / "driver.log", "w+")
    proc = subprocess.Popen(cli("run", str(exp), "--run-dir", str(run_dir), "--num-cpus", "1", "--tracking-uri", uri),
                            cwd=tmp_path, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        faultpoints.wait_held(hold, 15, proc)
        stop_server(server)                                  # the server goes away for good
        faultpoints.release(hold, 15)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    text = Path(log.name).read_text()
    assert rc == 1, text
    assert f"error: the tracking server {uri} did not answer for" in text and "atlaslab resume" in text, text
    rec = json.loads((run_dir / "results.json").read_text())[0]
    assert rec["status"] == "error" and "TrackingUnavailable" in rec["message"], rec["message"]

    server = start_server(tmp_path, port)
    try:
        r = subprocess.run(cli("resume", str(run_dir), "--quiet"), cwd=tmp_path, env=e, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        rec = json.loads((run_dir / "results.json").read_text())[0]
        assert rec["status"] == "completed" and rec["metrics"]["step"] == 60
        c, parents, children = mlflow_runs(uri)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert len(children) == 1 and children[0].info.status == "FINISHED"
        rid = children[0].info.run_id
        for metric, every in (("val/accuracy", 10), ("train/loss", 5)):
            steps = [m.step for m in c.get_metric_history(rid, metric)]
            assert sorted(steps) == list(range(every, 61, every)), (metric, steps)   # none missing, none twice
    finally:
        stop_server(server)
