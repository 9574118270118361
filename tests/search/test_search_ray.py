"""The search driver end to end on a local Ray (127.0.0.1) with MLflow on SQLite.

Every Ray / MLflow process a test starts is ended by the test through its own handle: the in-process Ray by
``ray.shutdown()``, driver subprocesses (and the Ray processes they started, found through /proc) by pid.
Tiny models, tens of steps.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# a held trial imports faultpoints (``imports: [faultpoints]``): Ray's workers inherit PYTHONPATH from this process
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)

from ray.tune import Stopper

from atlaslab.search.driver import prepare, run

ROOT = Path(__file__).resolve().parents[2]

TINY_YAML = """
name: {name}
model:
  preset: gated_deltanet
  overrides: {{d_model: 16, "mixers.*.num_heads": 2}}
task: {{name: mqar, vocab_size: 16, seq_len: 16, num_kv_pairs: [2], eval_examples: 32}}
eval: {{interval: 10, examples: 32}}
train: {{steps: {steps}, batch_size: 8, lr: 3.0e-3, log_interval: 5}}
"""


def tiny(name, steps=30, **extra):
    import yaml
    node = yaml.safe_load(TINY_YAML.format(name=name, steps=steps))
    node.update(extra)
    return node


def mlflow_runs(uri):
    from mlflow.tracking import MlflowClient
    c = MlflowClient(uri)
    exps = [e for e in c.search_experiments() if e.name != "Default"]
    runs = c.search_runs([e.experiment_id for e in exps], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return c, parents, children


def test_parallel_trials_nan_failure_and_mlflow(local_ray, tmp_path):
    node = tiny("par", grid={"variants": {"GDN": {}, "GDN lr 1e-2": {"train.lr": 1e-2},
                                          "NaN": {"train.lr": 1e12},
                                          "raises": {"eval.lengths": [4]}},   # MQAR cannot make length 4
                             "baseline": "GDN"},
                max_concurrent=2, max_failures=1)
    p = prepare(node=node)
    summary = run(p, run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    run_dir = tmp_path / "run"
    recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    assert summary["trials"] == 4 and summary["failed"] == 2 and summary["completed"] == 2

    # two trials ran at the same time (overlapping wall-clock intervals)
    a, b = recs["t000"]["metrics"], recs["t001"]["metrics"]
    assert max(a["t_start"], b["t_start"]) < min(a["t_end"], b["t_end"]), (a, b)

    # the NaN trial is failed, with its reason; the others completed and are reported
    nan = recs["t002"]
    assert nan["status"] == "diverged" and nan["failed"] and "diverged at step" in nan["message"]
    assert "nan" in nan["message"]
    err = recs["t003"]                    # raised (at its final evaluation), retried once, then recorded
    assert err["status"] == "error" and err["failed"] and "length 4" in err["message"], err
    for k in ("t000", "t001"):
        assert recs[k]["status"] == "completed" and recs[k]["metrics"]["step"] == 30
        assert 0.0 <= recs[k]["metrics"]["test/accuracy"] <= 1.0
        assert [h["step"] for h in recs[k]["history"] if h.get("val/accuracy") is not None][:3] == [10, 20, 30]
    report = (run_dir / "report.md").read_text()
    assert "| GDN (baseline) |" in report and "| GDN lr 1e-2 |" in report
    assert "## Failed trials" in report and "diverged at step" in report and "| t003 | raises |" in report
    assert (run_dir / "plots" / "curves.png").is_file() and (run_dir / "report.csv").is_file()
    # curves.csv beside trials.csv: every trial's logged steps, the same values as results.json's history
    from atlaslab.search.curves import read_curves
    curves = read_curves(run_dir / "curves.csv")
    assert set(curves) >= {"t000", "t001"} and curves["t001"][0]["variant"] == "GDN lr 1e-2"
    for k in ("t000", "t001"):
        want = [(h["step"], h["val/accuracy"]) for h in recs[k]["history"] if h.get("val/accuracy") is not None]
        assert [(c["step"], c["val/accuracy"]) for c in curves[k] if "val/accuracy" in c] == want
        losses = [h["step"] for h in recs[k]["history"] if h.get("train/loss") is not None]
        assert losses and [c["step"] for c in curves[k] if "train/loss" in c] == losses

    # MLflow: one parent, one child per trial, with params, per-step metrics, tags and the config artifact
    state = json.loads((run_dir / "state.json").read_text())
    c, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(parents) == 1 and len(children) == 4
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.info.run_id == state["tracking"]["parent_run_id"]
    assert {x.path for x in c.list_artifacts(parent.info.run_id)} >= {"report.md", "experiment.yaml", "plots"}
    by_key = {r.data.tags["atlaslab.trial_key"]: r for r in children}
    assert set(by_key) == {"t000", "t001", "t002", "t003"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    ok = by_key["t001"]
    assert ok.info.status == "FINISHED"
    assert ok.data.params["model.preset"] == "gated_deltanet" and float(ok.data.params["train.lr"]) == 1e-2
    assert ok.data.params["param.train.lr"] == "0.01" and ok.data.params["train.seed"] == "0"
    assert ok.data.tags["component.gated_deltanet.inner_optimizer"] == "gd"
    assert ok.data.tags["component.gated_deltanet.retention"] == "decay"
    assert ok.data.tags["atlaslab.variant"] == "GDN lr 1e-2" and ok.data.tags["atlaslab.status"] == "completed"
    assert [m.step for m in c.get_metric_history(ok.info.run_id, "val/accuracy")] == [10, 20, 30]
    assert [m.step for m in c.get_metric_history(ok.info.run_id, "train/loss")] == [5, 10, 15, 20, 25, 30]
    assert "test/accuracy" in ok.data.metrics
    assert [x.path for x in c.list_artifacts(ok.info.run_id)] == ["resolved_config.yaml", "trial_config.yaml"]
    bad = by_key["t002"]
    assert bad.info.status == "FAILED" and bad.data.tags["atlaslab.status"] == "diverged"
    assert "diverged at step" in bad.data.tags["atlaslab.failure"]
    raised = by_key["t003"]
    assert raised.info.status == "FAILED" and raised.data.tags["atlaslab.status"] == "error"
    assert "length 4" in raised.data.tags["atlaslab.failure"]


@pytest.mark.slow     # CI covers Optuna + ASHA + a conditional space through the optuna-asha tutorial's test
def test_optuna_search_with_asha_conditional_space(local_ray, tmp_path):
    opt = "model.mixers.gated_deltanet.memory.inner_optimizer."
    node = tiny("srch", steps=40, search={"sampler": "random", "seed": 1, "space": {
        "train.lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
        opt + "name": ["gd", "momentum"],
        opt + "momentum": {"type": "float", "low": 0.5, "high": 0.9, "when": {opt + "name": "momentum"}}}},
        num_samples=4, max_concurrent=2,
        scheduler={"name": "asha", "grace_period": 10, "reduction_factor": 2})
    p = prepare(node=node)
    summary = run(p, run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    recs = json.loads((tmp_path / "run" / "results.json").read_text())
    assert summary["trials"] == 4 and summary["failed"] == 0
    for r in recs:
        assert (opt + "momentum" in r["params"]) == (r["params"][opt + "name"] == "momentum")
        assert r["status"] in ("completed", "pruned")
    assert sum(r["metrics"].get("step", 0) for r in recs) <= 4 * 40
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    c, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(parents) == 1 and len(children) == 4
    assert {r.info.status for r in children} == {"FINISHED"}
    for r in children:
        assert (f"param.{opt}momentum" in r.data.params) == (r.data.params[f"param.{opt}name"] == "momentum")
    assert "## Trials (best first)" in (tmp_path / "run" / "report.md").read_text()


# --------------------------------------------------------------------------------------------------
# interrupted and resumed
# --------------------------------------------------------------------------------------------------
class InterruptAfterFirstTrial(Stopper):
    """Presses Ctrl-C (SIGINT to this process) after a trial has finished: Tune saves its state and ends the
    run with the other trials unfinished, as when a user interrupts the driver. It fires on a later result of
    another trial, and only once a final result is on disk under ``tune_dir`` (seeing it in the stopper is not
    enough: Tune may not have written it yet — CI once interrupted before it had). A flag file keeps it from
    firing again in the restored experiment (Tune pickles its stopper with the experiment)."""

    def __init__(self, flag, tune_dir):
        self.flag, self.tune_dir = str(flag), str(tune_dir)

    def _final_on_disk(self) -> bool:
        return any('"final": 1' in f.read_text() for f in Path(self.tune_dir).rglob("result.json"))

    def __call__(self, trial_id, result):
        if result.get("final") != 1 and not os.path.exists(self.flag) and self._final_on_disk():
            Path(self.flag).write_text("fired")
            os.kill(os.getpid(), signal.SIGINT)
        return False

    def stop_all(self):
        return False


class InterruptOnceFinalOnDisk:
    """Ctrl-C (SIGINT to this process) from a watcher thread, on two events: a trial is held by :mod:`faultpoints`
    at ``hold_step`` (so the sweep cannot end meanwhile) and a final result is on disk under ``tune_dir`` (Tune copies
    its trial folders to the run's storage every few seconds: a stopper that waits for the next result can see the
    sweep end first, as CI did once). Used as a context manager around ``run``; on exit the hold is released, so the
    held trial goes on when the experiment resumes."""

    def __init__(self, tune_dir, hold_dir, hold_step, timeout=300):
        import threading
        self.tune_dir, self.hold_dir, self.hold_step, self.timeout = Path(tune_dir), hold_dir, hold_step, timeout
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.fired = False

    def _final_on_disk(self) -> bool:
        return any('"final": 1' in f.read_text() for f in self.tune_dir.rglob("result.json"))

    def _watch(self):
        held = Path(self.hold_dir) / f"held.{self.hold_step}"
        deadline = time.time() + self.timeout
        while not self.done.is_set() and time.time() < deadline:
            if held.is_file() and self._final_on_disk():
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        import faultpoints
        self.done.set()
        self.thread.join()
        faultpoints.release(self.hold_dir, self.hold_step)
        return False


def test_interrupted_experiment_resumes_every_trial_once(local_ray, tmp_path):
    """Ctrl-C once the first trial's final result is on disk and the long trial (B) is held at step 225, after its
    report of step 200; ``resume`` ends B from that checkpoint and runs what Tune had not finished, each trial
    once."""
    import shutil

    from atlaslab.models.presets import preset_path
    from atlaslab.search.driver import resume
    preset = tmp_path / "gdn.yaml"
    shutil.copy(preset_path("gated_deltanet"), preset)
    hold = tmp_path / "hold"
    hold.mkdir()
    node = tiny("intr", steps=100, grid={"variants": {"A": {}, "B": {"train.steps": 250}, "C": {}}},
                max_concurrent=2)
    node["task"] = {**node["task"], "name": "held_mqar", "hold_dir": str(hold), "hold_steps": [225]}
    node["imports"] = ["faultpoints"]
    node["model"]["preset"] = str(preset)
    node["eval"]["interval"] = 50
    run_dir = tmp_path / "run"
    with InterruptOnceFinalOnDisk(run_dir / "ray" / "tune", hold, 225) as interrupt:
        s1 = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True)
    assert interrupt.fired
    assert s1["status"] == "interrupted" and s1["unfinished"] >= 1
    first = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    done_before = {k for k, r in first.items() if r["status"] == "completed"}
    assert done_before and first["t001"]["status"] in ("unfinished", "pending")
    assert "## Unfinished trials" in (run_dir / "report.md").read_text()
    # the preset file changes before the resume: the trials build the models the driver validated and recorded
    preset.write_text("mixers: {gated_deltanet: {name: no_such_mixer}}\n")
    t_resume = time.time()

    s2 = resume(run_dir, quiet=True)
    assert s2["status"] == "finished" and s2["completed"] == 3
    recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    assert recs["t001"]["metrics"]["step"] == 250 and recs["t000"]["metrics"]["step"] == 100
    state = json.loads((run_dir / "state.json").read_text())
    c, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    by_key = {r.data.tags["atlaslab.trial_key"]: r for r in children}
    assert sorted(by_key) == ["t000", "t001", "t002"] and len(children) == 3     # one MLflow run per trial
    for key in done_before:                                    # finished trials were not run again
        assert "atlaslab.resumed" not in by_key[key].data.tags
        assert by_key[key].info.end_time / 1000 < t_resume
    assert by_key["t001"].data.tags.get("atlaslab.status") == "completed"
    for key, ch in by_key.items():
        assert ch.info.status == "FINISHED"
        steps = [m.step for m in c.get_metric_history(ch.info.run_id, "val/accuracy")]
        assert steps == list(range(50, recs[key]["metrics"]["step"] + 1, 50)), (key, steps)   # none twice


def fail_one_actor_task_with_a_ray_error(monkeypatch, flag, tune_dir):
    """Once a trial's final result is on disk, the next actor task that resolves fails instead with a
    ``ray.exceptions.OutOfMemoryError``, through Ray's own handler: what happens when Ray's memory monitor kills a
    trial's actor. Tune (2.60) then raises ``RuntimeError("Caught unexpected exception: …")`` out of ``fit``;
    before the driver restored the experiment on such an error, this ended the whole sweep."""
    from ray.air.execution._internal.actor_manager import RayActorManager
    from ray.exceptions import OutOfMemoryError
    resolved = RayActorManager._actor_task_resolved

    def resolve_or_fail(self, tracked_actor_task, result):
        if not flag.exists() and any('"final": 1' in f.read_text() for f in Path(tune_dir).rglob("result.json")):
            flag.write_text("fired")
            return self._actor_task_failed(tracked_actor_task, OutOfMemoryError("1 worker(s) were killed due to "
                                                                                "the node running low on memory."))
        return resolved(self, tracked_actor_task, result)

    monkeypatch.setattr(RayActorManager, "_actor_task_resolved", resolve_or_fail)


@pytest.mark.slow     # ~60 s of Ray restarts: in the slow set (the fault table says so)
def test_sweep_survives_a_crash_of_tunes_controller_on_a_ray_error(local_ray, tmp_path, monkeypatch):
    node = tiny("oom", steps=100, grid={"variants": {"A": {}, "B": {"train.steps": 250}, "C": {}}},
                max_concurrent=2)
    node["eval"]["interval"] = 50
    run_dir = tmp_path / "run"
    fail_one_actor_task_with_a_ray_error(monkeypatch, tmp_path / "f", run_dir / "ray" / "tune")
    s = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True)
    assert (tmp_path / "f").exists()                                  # the error was raised
    state = json.loads((run_dir / "state.json").read_text())
    assert [r["error"].split(":")[0] for r in state["controller_restarts"]] == ["OutOfMemoryError"]
    assert s["status"] == "finished" and s["completed"] == 3 and s["failed"] == 0
    recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    assert recs["t001"]["metrics"]["step"] == 250
    _, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(parents) == 1 and sorted(r.data.tags["atlaslab.trial_key"] for r in children) == ["t000", "t001", "t002"]


def test_only_rays_own_errors_restore_the_experiment():
    from ray.exceptions import OutOfMemoryError, RayTaskError

    from atlaslab.search.driver import ray_system_error
    oom = OutOfMemoryError("killed")
    try:
        raise RuntimeError("Caught unexpected exception") from oom
    except RuntimeError as e:
        assert ray_system_error(e) is oom
    assert ray_system_error(RuntimeError("a bug of ours")) is None
    task_error = RayTaskError("train", "Traceback …", ValueError("a trial's own error"))
    try:
        raise RuntimeError("wrapped") from task_error
    except RuntimeError as e:
        assert ray_system_error(e) is None


def descendants(pid):
    """Pids of every live descendant of ``pid`` (through /proc)."""
    children = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for ch in children.get(p, []):
            out.append(ch)
            todo.append(ch)
    return out


def kill_tree(proc, pids):
    for pid in [proc.pid] + list(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def cli(*args):
    return [sys.executable, "-m", "atlaslab.cli", *args]


def env():
    e = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    e.pop("RAY_ADDRESS", None)
    e.pop("MLFLOW_TRACKING_URI", None)
    return e


@pytest.mark.slow
def test_killed_driver_resumes_every_trial_exactly_once(tmp_path):
    """SIGKILL of the driver process (and of every process it started), then ``atlaslab resume``. The kill comes on
    an event, never after a number of seconds: the second trial is held at step 110 (:mod:`faultpoints`), so it
    cannot finish first, and the test kills once Tune's saved experiment state records the first trial finished
    and the second one's result of step 100 (its checkpoint), which is what the resume starts from."""
    import yaml

    import faultpoints
    from test_faults import held

    from atlaslab.search.results import saved_trials
    hold = tmp_path / "hold"
    hold.mkdir()
    node = held("res", hold, steps=400, hold_steps=[], max_concurrent=1,
                grid={"variants": {"A": {}, "B": {"train.lr": 1e-2, "task.hold_steps": [110]},
                                   "C": {"train.lr": 5e-3}}})
    node["eval"]["interval"] = 50
    node["train"]["log_interval"] = 25
    exp = tmp_path / "res.yaml"
    exp.write_text(yaml.safe_dump(node))
    run_dir = tmp_path / "run"
    # the driver and its trials import this checkout's atlaslab and faultpoints
    e = dict(env(), PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(Path(faultpoints.__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")) if p))
    log = open(tmp_path / "driver.log", "w+")
    proc = subprocess.Popen(cli("run", str(exp), "--run-dir", str(run_dir), "--num-cpus", "1"), cwd=tmp_path,
                            env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pids = []
    try:
        faultpoints.wait_held(hold, 110, proc)      # t000 finished, t001 reported step 100 and waits at 110

        def recorded():     # … and Tune's saved state has both: t000 finished, t001's result (checkpoint) of step 100
            s = {k[:4]: (status, last.get("step")) for k, (status, last) in saved_trials(tune_dir).items()}
            return s.get("t000", (None,))[0] == "TERMINATED" and s.get("t001", (None, None))[1] == 100
        tune_dir, deadline = run_dir / "ray" / "tune", time.time() + 120    # a bound for a broken test only
        while not recorded():
            assert proc.poll() is None and time.time() < deadline, Path(log.name).read_text()
            time.sleep(faultpoints.POLL_S)
        pids = descendants(proc.pid)
    finally:
        kill_tree(proc, pids)               # SIGKILL the driver and every process it started
    text = Path(log.name).read_text()
    assert "completed: t001" not in text and "completed: t002" not in text, text
    killed_at = time.time()

    r = subprocess.run(cli("resume", str(run_dir), "--quiet"), cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads((run_dir / "results.json").read_text())
    assert sorted(x["key"] for x in recs) == ["t000", "t001", "t002"]
    assert all(x["status"] == "completed" and x["metrics"]["step"] == 400 for x in recs)
    report = (run_dir / "report.md").read_text()
    for label in ("| A (baseline) |", "| B |", "| C |"):
        assert report.count(label) == 1

    state = json.loads((run_dir / "state.json").read_text())
    c, parents, children = mlflow_runs(state["tracking"]["uri"])
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    keys = sorted(r.data.tags["atlaslab.trial_key"] for r in children)
    assert keys == ["t000", "t001", "t002"]                    # each trial exactly one MLflow run
    assert all(r.info.status == "FINISHED" for r in children)
    by_key = {r.data.tags["atlaslab.trial_key"]: r for r in children}
    assert "atlaslab.resumed" not in by_key["t000"].data.tags   # the finished trial was not run again
    assert by_key["t000"].info.end_time / 1000 < killed_at
    assert by_key["t001"].data.tags.get("atlaslab.resumed") == "true"   # continued in the same run
    for key, ch in by_key.items():
        for metric, every in (("val/accuracy", 50), ("train/loss", 25)):
            steps = [m.step for m in c.get_metric_history(ch.info.run_id, metric)]
            assert steps == list(range(every, 401, every)), (key, metric, steps)   # none missing, none twice
    t001 = next(x for x in recs if x["key"] == "t001")
    assert t001["metrics"]["resumed_from"] == 100            # the Ray checkpoint of the result of step 100 holds it
    assert [h["step"] for h in t001["history"] if h.get("val/accuracy") is not None] == list(range(50, 401, 50))
