"""``atlaslab ui RUN_DIR``: the MLflow UI of a run folder's tracking store, served on 127.0.0.1.

A thin wrapper around ``mlflow server``: the backend store is the run folder's SQLite store (by default
``runs/mlflow.db``, shared by every run under ``runs/``; ``atlaslab ui runs`` opens it too) and proxied
artifacts go to ``mlartifacts/`` beside it (the layout the driver writes, :mod:`.tracking`; runs whose artifact
URIs are plain ``file://`` paths there are read directly). The server is the lean one (``--workers 1``, job
execution off, no telemetry) and runs in its own process group, so stopping it ends the server and its worker.

    server = UIServer("runs/quickstart-20261201-170507", port=0)   # 0: a free port
    server.start(); server.wait_ready()
    print(server.url)                                              # http://127.0.0.1:<port>
    server.stop()                                                  # SIGTERM to the group, SIGKILL on timeout
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional, Tuple

from atlaslab.registry import ConfigError
from atlaslab.search.tracking import ARTIFACTS_NAME, STORE_NAME

DB_NAME = "mlruns.db"                   # a store of one run's own (runs before the shared default, --tracking-uri)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5000


def find_store(run_dir) -> Tuple[Path, Path]:
    """``(store .db, mlartifacts/)`` of a run folder (the SQLite store its ``state.json`` names: by default
    ``mlflow.db`` shared with the run folders beside it; an older run's own ``mlruns.db``), of the folder that
    holds the runs (``runs/``: its ``mlflow.db``) or of the ``.db`` file itself; ConfigError if none."""
    p = Path(run_dir).expanduser()
    uri = None
    state = p / "state.json"
    if state.is_file():
        try:
            uri = json.loads(state.read_text()).get("tracking", {}).get("uri")
        except (ValueError, AttributeError):
            uri = None
    candidates = [p] if p.suffix == ".db" else [p / DB_NAME, p / STORE_NAME]
    if uri and str(uri).startswith("sqlite:///"):
        candidates.insert(0, Path(str(uri)[len("sqlite:///"):]))
    for db in candidates:
        if db.is_file():
            return db.resolve(), (db.parent / ARTIFACTS_NAME).resolve()
    if not p.exists():
        raise ConfigError("run_dir", f"{p} does not exist.", value=str(p))
    hint = f"; this run was tracked at {uri}: open that server's UI instead" \
        if uri and not str(uri).startswith("sqlite:") else ""
    raise ConfigError("run_dir", f"no MLflow store in {p} (expected {' or '.join(map(str, candidates))}){hint}.",
                      value=str(p))


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def server_command(db: Path, artifacts: Path, host: str, port: int) -> List[str]:
    """The ``mlflow server`` command line for a store (run with this interpreter)."""
    return [sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", "sqlite:///" + str(db),
            "--artifacts-destination", str(artifacts),
            "--host", host, "--port", str(port), "--workers", "1"]


def server_env() -> dict:
    env = dict(os.environ)
    env.update(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    env.pop("MLFLOW_TRACKING_URI", None)   # the server's store is the run folder's, whatever the shell says
    return env


def _http_get(url: str, timeout: float = 2.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # 127.0.0.1 never via a proxy
    with opener.open(url, timeout=timeout) as r:
        return r.read()


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies count as gone)."""
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()   # state ppid pgrp ...
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class UIServer:
    """An ``mlflow server`` subprocess for one run folder's store, with a handle to stop it."""

    def __init__(self, run_dir, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, quiet: bool = False):
        self.db, self.artifacts = find_store(run_dir)
        self.host = host
        self.port = free_port(host) if port == 0 else int(port)
        self.quiet = quiet
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> List[str]:
        return server_command(self.db, self.artifacts, self.host, self.port)

    def start(self) -> "UIServer":
        if port_in_use(self.host, self.port):
            raise ConfigError("port", f"{self.host}:{self.port} is in use; pass --port N (0 picks a free one).",
                              value=self.port)
        out = subprocess.DEVNULL if self.quiet else None
        self.proc = subprocess.Popen(self.command, env=server_env(), stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=out, start_new_session=True)   # own process group
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the server answers ``/health``; RuntimeError if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"mlflow server exited (code {code}) before it answered on {self.url}")
            try:
                _http_get(self.url + "/health", timeout=2.0)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.25)
        raise RuntimeError(f"mlflow server did not answer on {self.url} within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the server's process group, wait, SIGKILL what is left after ``timeout`` s."""
        if self.proc is None:
            return
        pgid = self.proc.pid   # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None and not _group_alive(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    break
                time.sleep(0.1)
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL always ends it
            pass

    def __enter__(self) -> "UIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(run_dir, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, ready_timeout: float = 120.0) -> int:
    """Start the UI, print its URL, wait until Ctrl-C / SIGTERM (or the server exits), then stop it."""
    server = UIServer(run_dir, host, port)

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt

    # explicit handlers: a shell's background job inherits SIGINT ignored, and Python then never raises on it
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"starting the MLflow UI for {server.db.parent} …", flush=True)
        server.wait_ready(ready_timeout)
        print(f"MLflow UI: {server.url}  (store sqlite:///{server.db}; Ctrl-C stops it)", flush=True)
        code = server.proc.wait()
        print(f"error: mlflow server exited with code {code}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping the MLflow UI …", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_ui(args: argparse.Namespace) -> int:
    return serve(args.run_dir, host=args.host, port=args.port)


def add_ui(sub) -> None:
    p = sub.add_parser("ui", help="serve the MLflow UI of a run folder's store on 127.0.0.1")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run folder (runs/<name>-<time>), the folder of runs (runs) or a .db store")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"interface to bind (default {DEFAULT_HOST})")
    p.set_defaults(func=cmd_ui)


__all__ = ["UIServer", "add_ui", "find_store", "free_port", "serve", "server_command"]
