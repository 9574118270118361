"""The cluster path: a two-node Ray cluster on loopback and an MLflow tracking server on 127.0.0.1.

The test starts both itself (``ray.cluster_utils.Cluster``, ``mlflow server --workers 1`` on a free port with
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``), runs a tiny experiment through ``atlaslab run --ray-address …
--tracking-uri http://127.0.0.1:<port>`` in a subprocess, and ends every process it started by its handle.
Slow (two Ray nodes and a server start on 2 cores): ``pytest -m slow tests/test_search_cluster.py``.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def test_cluster_and_tracking_server(tmp_path):
    import yaml
    from ray.cluster_utils import Cluster
    from test_search_ray import descendants, tiny

    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        cwd=tmp_path, env=env, stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    server_pids = []
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        uri = f"http://127.0.0.1:{port}"
        wait_http(uri + "/health")
        server_pids = descendants(server.pid)
        node = tiny("cluster", steps=20, grid={"variants": {"A": {}, "B": {"train.lr": 1e-2}}}, max_concurrent=2)
        exp = tmp_path / "cluster.yaml"
        exp.write_text(yaml.safe_dump(node))
        run_env = dict(env)
        run_env.pop("RAY_ADDRESS", None)
        r = subprocess.run([sys.executable, "-m", "atlaslab.cli", "run", str(exp), "--run-dir", str(tmp_path / "run"),
                            "--ray-address", cluster.address, "--tracking-uri", uri, "--quiet"],
                           cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        recs = json.loads((tmp_path / "run" / "results.json").read_text())
        assert sorted(x["status"] for x in recs) == ["completed", "completed"]
        assert len({x["metrics"]["node_id"] for x in recs}) == 2        # one trial on each node
        from mlflow.tracking import MlflowClient
        c = MlflowClient(uri)
        exp_ = c.get_experiment_by_name("cluster")
        runs = c.search_runs([exp_.experiment_id])
        parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
        children = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
        assert len(parents) == 1 and len(children) == 2
        assert all(x.info.status == "FINISHED" for x in runs)
        assert {a.path for a in c.list_artifacts(children[0].info.run_id)} == {"trial_config.yaml",
                                                                               "resolved_config.yaml"}
        assert not (tmp_path / "run" / "mlruns.db").exists()        # nothing tracked locally
    finally:
        cluster.shutdown()
        for pid in [server.pid] + server_pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in [server.pid] + server_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server.wait(timeout=30)
