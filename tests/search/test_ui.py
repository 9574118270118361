"""``atlaslab ui``: the MLflow UI of a run folder's store, on 127.0.0.1 only, stopped by its own handle."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atlaslab.cli import main
from atlaslab.search import ui

EXPERIMENT = "atlaslab-ui-test"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder's layout: mlruns.db (sqlite) with one experiment, artifacts under mlartifacts/.

    Created once per module: a fresh SQLite store costs ~7 s of MLflow schema migrations on 2 CPU cores.
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("ui") / "run"
    d.mkdir()
    c = MlflowClient(tracking_uri="sqlite:///" + str(d / "mlruns.db"))
    c.create_experiment(EXPERIMENT, artifact_location=(d / "mlartifacts").as_uri())
    return d


def _experiments(url: str) -> list:
    body = ui._http_get(url + "/api/2.0/mlflow/experiments/search?max_results=10", timeout=10)
    return [e["name"] for e in json.loads(body)["experiments"]]


def _server_processes(marker: str) -> list:
    """Live processes whose command line contains ``marker`` (the temp store's path)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(d.name))
    return out


def test_ui_refuses_a_folder_without_store(tmp_path, capsys):
    assert main(["ui", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run_dir: no MLflow store in ")
    assert main(["ui", str(tmp_path / "missing")]) == 2


def test_ui_server_handle(run_dir):
    server = ui.UIServer(run_dir, port=0, quiet=True)
    assert server.host == "127.0.0.1" and "--workers" in server.command
    try:
        server.start()
        server.wait_ready(timeout=120)
        assert EXPERIMENT in _experiments(server.url)
    finally:
        server.stop()
    assert server.proc.poll() is not None
    assert not ui._group_alive(server.proc.pid)
    assert not _server_processes(str(run_dir / "mlruns.db"))


@pytest.mark.slow   # a second server start (~10-20 s on 2 busy cores); the handle test above covers the server
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the server's processes")
def test_ui_cli_stops_on_sigint(run_dir):
    """The command as a user runs it: prints the URL, serves, and Ctrl-C ends it and its server (exit 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "atlaslab.cli", "ui", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)   # drain the pipe
    reader.start()
    try:
        url, deadline = None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = next((re.search(r"MLflow UI: (http://127\.0\.0\.1:\d+)", s) for s in list(lines)
                      if "MLflow UI:" in s), None)
            url = m.group(1) if m else None
            time.sleep(0.2)
        assert url, "".join(lines)
        assert EXPERIMENT in _experiments(url)
        assert _server_processes(str(run_dir / "mlruns.db"))
        proc.send_signal(signal.SIGINT)             # Ctrl-C
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:                     # only on failure: end what this test started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = _server_processes(str(run_dir / "mlruns.db"))
        for pid in left:                            # the server this test's CLI started, by its id
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=5)
    assert not left, "".join(lines)
