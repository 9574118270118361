"""The loss of a whole Ray node while a trial runs on it.

A two-node Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``): the head has no CPU, so every trial runs on the
worker node; each node has its own Ray temporary folder, so the trials' working folders (the loop's own
``checkpoint.pt``) are not shared. The first trial finishes on the worker node; the second is held by
:mod:`faultpoints` at step 25, after it reported the Ray checkpoint of step 20. The test then kills every process of
that node (SIGKILL, no graceful drain) and adds a fresh node. The driver is ``atlaslab run --ray-address …`` in a
subprocess (the nodes are added and removed in this process's main thread: Ray installs signal handlers there). Every
process the test started is ended by its own handle (the driver by its process group, the nodes by
``Cluster.remove_node`` / ``shutdown``), and the nodes' temporary folders are removed. The fault table of
docs/reliability.md lists this test.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# the nodes' workers import this checkout's atlaslab and faultpoints: the raylets (started below, in this process)
# pass PYTHONPATH on to them
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")) if p)

import faultpoints  # noqa: E402
from test_faults import held  # noqa: E402
from test_search_ray import cli, env, mlflow_runs  # noqa: E402

#: the head's health checks of the raylets: a killed node is found dead in about 2 s instead of Ray's 15
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 4}


def dead(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.timeout(600)       # a hang (a trial held for good, a node that never comes) fails, and cleans up
def test_a_lost_node_resumes_its_trial_from_its_checkpoint_on_a_new_node(tmp_path):
    import yaml
    from ray.cluster_utils import Cluster

    hold = tmp_path / "hold"
    hold.mkdir()
    node = held("nodeloss", hold, steps=40, hold_steps=[], max_concurrent=1, max_failures=1,
                grid={"variants": {"A": {}, "B": {"task.hold_steps": [25]}}})
    exp = tmp_path / "nodeloss.yaml"
    exp.write_text(yaml.safe_dump(node))
    run_dir = tmp_path / "run"
    temps = [tempfile.mkdtemp(prefix="al-head-"), tempfile.mkdtemp(prefix="al-node-")]
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temps[0], "_system_config": FAST_NODE_DEATH})
    proc, log = None, open(tmp_path / "driver.log", "w+")
    try:
        nodes = [cluster.add_node(num_cpus=1, temp_dir=temps[1])]
        cluster.wait_for_nodes()
        proc = subprocess.Popen(cli("run", str(exp), "--run-dir", str(run_dir), "--ray-address", cluster.address,
                                    "--quiet"), cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        info = faultpoints.wait_held(hold, 25, proc, timeout=300)   # B reported the checkpoint of step 20, waits
        assert info["node_id"] == nodes[0].node_id
        cluster.remove_node(nodes[0], allow_graceful=False)      # its raylet, object store, … SIGKILLed
        deadline = time.time() + 60
        while not dead(info["pid"]) and time.time() < deadline:  # the trial's process goes with its raylet
            time.sleep(faultpoints.POLL_S)
        assert dead(info["pid"])
        temps.append(tempfile.mkdtemp(prefix="al-node-"))
        nodes.append(cluster.add_node(num_cpus=1, temp_dir=temps[-1]))
        rc = proc.wait(timeout=300)
        assert rc == 0, Path(log.name).read_text()

        recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
        assert sorted(recs) == ["t000", "t001"] and all(r["status"] == "completed" for r in recs.values())
        a, b = recs["t000"]["metrics"], recs["t001"]["metrics"]
        assert a["node_id"] == nodes[0].node_id and "resumed_from" not in a   # done on the lost node: kept
        assert b["node_id"] == nodes[1].node_id                 # B finished on the fresh node …
        assert b["resumed_from"] == 20     # … from the Ray checkpoint reported at step 20, which holds step 20
        assert "checkpoint_fallback" not in b
        for d in temps[1:]:      # B's loop kept its own checkpoint in each node's folder: nothing shared them
            assert list(Path(d).rglob("working_dirs/t001/atlaslab-work/checkpoint.pt")), d
        for r in recs.values():
            val = [h["step"] for h in r["history"] if h.get("val/accuracy") is not None]
            assert val == [10, 20, 30, 40], (r["key"], val)    # none missing, none twice

        # A is B without the hold (same batches): B, lost after step 25 and resumed on another node, trained as A did
        keys = ("train/loss", "val/loss", "val/accuracy")
        assert [[h.get(k) for k in keys] for h in recs["t001"]["history"]] == \
            [[h.get(k) for k in keys] for h in recs["t000"]["history"]]
        for k in ("train/loss", "val/accuracy", "test/accuracy"):
            assert b[k] == a[k], k
        assert (b["training_iteration"], b["iterations_since_restore"]) == (4, 2)   # Tune restored B once

        report = (run_dir / "report.md").read_text()
        assert report.count("| A (baseline) |") == 1 and report.count("| B |") == 1
        state = json.loads((run_dir / "state.json").read_text())
        c, parents, children = mlflow_runs(state["tracking"]["uri"])
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        by_key = {r.data.tags["atlaslab.trial_key"]: r for r in children}
        assert sorted(by_key) == ["t000", "t001"] and all(r.info.status == "FINISHED" for r in children)
        for key, ch in by_key.items():                          # one run per trial, every evaluation logged once
            assert [m.step for m in c.get_metric_history(ch.info.run_id, "val/accuracy")] == [10, 20, 30, 40], key
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log.close()
        faultpoints.release(hold, 25)
        cluster.shutdown()
        for d in temps:
            shutil.rmtree(d, ignore_errors=True)
