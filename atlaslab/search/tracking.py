"""MLflow: one parent run per experiment, one child run per trial, each trial exactly one run.

* Tracking URI: ``tracking.uri`` / ``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the one default
  store of every run beside each other: ``sqlite:///<parent of the run dir>/mlflow.db`` (``runs/mlflow.db`` for
  the default run folders ``runs/<name>-<time>``) with artifacts in ``mlartifacts/`` beside it, so one MLflow UI
  compares all of them. A store of one run's own: ``--tracking-uri sqlite:///<run dir>/mlruns.db``.
* The driver creates the parent run (tag ``atlaslab.run_dir``) before any trial starts; each trial,
  inside its Ray worker, finds its child run by the tags ``mlflow.parentRunId`` + ``atlaslab.trial_key``
  or creates it, so a retried or restored trial continues the same run (one run per trial,
  created inside the trainable with an explicit parent tag). Metrics already logged at a step are not logged
  again after a restore (the trial replays from its last checkpoint).
* Params are the flattened trial config, logged in batches (``log_batch``; ≈ 15 ms per single param);
  tags are the component choices and the trial's key, variant, seed and status.
* Every MLflow call retries a few times (SQLite is shared by concurrent trials). A trial's metrics that the
  tracking server does not take (the server is down) are buffered in the trial and sent, in order and each once,
  when it answers again (the run's tag ``atlaslab.tracking_outages`` says which steps waited); training goes on. A server that stays away longer than
  ``ATLASLAB_TRACKING_OUTAGE_S`` seconds (default 300) ends the trial with :class:`TrackingUnavailable`, naming
  the steps whose metrics were not sent; the run folder resumes once the server is back.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import yaml

log = logging.getLogger("atlaslab.search")
# nothing leaves the machine but what the user points MLflow at (MLflow 3 otherwise sends usage telemetry)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

TAG_KEY = "atlaslab.trial_key"
TAG_EXPERIMENT = "atlaslab.experiment"
TAG_KIND = "atlaslab.kind"
PARENT_TAG = "mlflow.parentRunId"
MAX_PARAM_LEN = 6000
MAX_KEY_LEN = 250
OUTAGE_ENV = "ATLASLAB_TRACKING_OUTAGE_S"
RETRY_WHILE_DOWN_S = 2.0      # while the server is away, a trial tries again at most this often


class TrackingUnavailable(RuntimeError):
    """The tracking server stayed unreachable for longer than the outage bound (``ATLASLAB_TRACKING_OUTAGE_S``)."""


def outage_limit_s() -> float:
    """How long a trial keeps training while the tracking server does not answer (``$ATLASLAB_TRACKING_OUTAGE_S``,
    default 300 s)."""
    return float(os.environ.get(OUTAGE_ENV, "300"))


def default_tracking_uri(run_dir: Path, uri: Optional[str] = None) -> str:
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return "sqlite:///" + str(default_store(run_dir))


STORE_NAME = "mlflow.db"
ARTIFACTS_NAME = "mlartifacts"


def default_store(run_dir: Path) -> Path:
    """The default SQLite store of a run folder: ``mlflow.db`` in the folder that holds it (shared by its siblings)."""
    return Path(run_dir).resolve().parent / STORE_NAME


def artifact_location(uri: str) -> Optional[str]:
    """Where a new experiment in a local SQLite store keeps artifacts: ``mlartifacts/`` beside the ``.db``."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).resolve().parent / ARTIFACTS_NAME).as_uri()


def is_local_uri(uri: str) -> bool:
    return uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri


def client(uri: str):
    """An MlflowClient for ``uri``. For a server, MLflow's own retries of a call (up to minutes of back-off) are
    turned off: :func:`retry` retries a few times, and a trial's metrics wait in :class:`TrialRun` while the server
    is away, so a server that is down never stalls training or the driver for long."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if not is_local_uri(uri):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri)


def retry(fn, *args, tries: int = 5, what: str = "mlflow", **kwargs):
    delay = 0.2
    for i in range(tries):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if i == tries - 1:
                log.warning("%s failed after %d tries: %s", what, tries, exc)
                return None
            time.sleep(delay)
            delay *= 2


def flatten(d: Any, prefix: str = "", out: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Nested config → ``{"a.b.c": "value"}`` (lists of scalars stay one value)."""
    out = {} if out is None else out
    if isinstance(d, Mapping):
        if not d and prefix:
            out[prefix] = "{}"
        for k, v in d.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(d, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple)) for x in d):
        for i, v in enumerate(d):
            flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = json.dumps(d) if isinstance(d, (list, tuple)) else str(d)
    return out


def config_params(config: Mapping[str, Any]) -> Dict[str, str]:
    """MLflow params of a trial config: flattened, model overrides as ``model.overrides.<key>`` (last wins)."""
    cfg = dict(config)
    model = dict(cfg.get("model") or {})
    ovs = model.get("overrides") or []
    if isinstance(ovs, list):
        model["overrides"] = {str(o[0]): o[1] for o in ovs if isinstance(o, (list, tuple)) and len(o) >= 2}
    cfg["model"] = model
    return flatten(cfg)


def safe_key(k: str) -> str:
    k = re.sub(r"[^A-Za-z0-9_\-. /:]", "_", k)
    return k[:MAX_KEY_LEN]


def ensure_experiment(uri: str, name: str, artifact_location: Optional[str] = None) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=artifact_location)
    except Exception:
        exp = c.get_experiment_by_name(name)       # created concurrently
        if exp is None:
            raise
        return exp.experiment_id


def log_params(c, run_id: str, params: Mapping[str, Any], existing: Optional[Mapping[str, str]] = None) -> None:
    from mlflow.entities import Param
    existing = existing or {}
    items = []
    for k, v in params.items():
        k, v = safe_key(k), str(v)[:MAX_PARAM_LEN]
        if k in existing:
            continue       # MLflow refuses to change a logged param; a restored trial has the same ones
        items.append(Param(k, v))
    for i in range(0, len(items), 100):
        retry(c.log_batch, run_id, params=items[i:i + 100], what="log_params")


def log_metrics(c, run_id: str, metrics: Mapping[str, float], step: int) -> None:
    from mlflow.entities import Metric
    ts = int(time.time() * 1000)
    items = [Metric(safe_key(k), float(v), ts, int(step)) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
    for i in range(0, len(items), 500):
        retry(c.log_batch, run_id, metrics=items[i:i + 500], what="log_metrics")


def set_tags(c, run_id: str, tags: Mapping[str, Any]) -> None:
    from mlflow.entities import RunTag
    items = [RunTag(safe_key(k), str(v)[:5000]) for k, v in tags.items()]
    if items:
        retry(c.log_batch, run_id, tags=items, what="set_tags")


def find_child(c, experiment_id: str, parent_id: str, trial_key: str):
    runs = c.search_runs([experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}' and "
                         f"tags.`{TAG_KEY}` = '{trial_key}'", max_results=10)
    if not runs:
        return None
    runs = sorted(runs, key=lambda r: r.info.start_time or 0)
    return runs[0]


def children(c, experiment_id: str, parent_id: str) -> List[Any]:
    out, token = [], None
    while True:
        page = c.search_runs([experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'",
                             max_results=1000, page_token=token)
        out.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return out


class TrialRun:
    """The MLflow child run of one trial (find-or-create; metrics deduped by step after a restore)."""

    def __init__(self, uri: str, experiment_id: str, parent_id: str, trial: Mapping[str, Any], run_name: str):
        self.c = client(uri)
        self.uri, self.key = uri, trial["key"]
        self.run_id: Optional[str] = None
        self.last_step = -1
        self.pending: List[Any] = []            # metrics the server has not taken yet, oldest first
        self.down_since: Optional[float] = None
        self.outages: List[str] = []            # what each outage held back (also the run's tag)
        self.held = [0, 0]                      # the first and last step held back in the current outage
        self.next_try = 0.0
        self.outage_s = outage_limit_s()
        self._wait_for_server(lambda: self.c.search_experiments(max_results=1))
        run = retry(find_child, self.c, experiment_id, parent_id, trial["key"], what="find child run")
        tags = {PARENT_TAG: parent_id, TAG_KEY: trial["key"], "atlaslab.variant": trial.get("variant", ""),
                "atlaslab.setting": trial.get("setting", ""), "atlaslab.seed": trial.get("seed", 0),
                "atlaslab.row": trial.get("row", ""), "atlaslab.status": "running"}
        for k, v in (trial.get("info", {}).get("components") or {}).items():
            tags[f"component.{k}"] = v
        if run is None:
            from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME
            run = retry(self.c.create_run, experiment_id,
                        tags={k: str(v) for k, v in {**tags, MLFLOW_RUN_NAME: run_name}.items()},
                        run_name=run_name, what="create child run")
            if run is None:
                return
            self.run_id = run.info.run_id
            existing_params: Dict[str, str] = {}
        else:
            self.run_id = run.info.run_id
            existing_params = dict(run.data.params)
            retry(self.c.update_run, self.run_id, status="RUNNING", what="reopen run")
            hist = retry(self.c.get_metric_history, self.run_id, "step", what="metric history") or []
            self.last_step = max((int(m.step) for m in hist), default=-1)
            set_tags(self.c, self.run_id, {"atlaslab.resumed": "true"})
        set_tags(self.c, self.run_id, tags)
        params = config_params(trial["config"])
        params.update({f"param.{k}": v for k, v in flatten(trial.get("params", {})).items()})
        info = trial.get("info", {})
        for k in ("num_parameters", "state_size", "state_size_fixed", "state_size_per_token"):
            if k in info:
                params[f"info.{k}"] = info[k]
        params["trial.key"] = trial["key"]
        params["trial.seed"] = trial.get("seed", 0)
        log_params(self.c, self.run_id, params, existing_params)
        self.artifact_logged = "atlaslab.config_logged" in (run.data.tags if hasattr(run, "data") else {})

    @property
    def ok(self) -> bool:
        return self.run_id is not None

    def log_config(self, trial: Mapping[str, Any], resolved: Optional[Mapping[str, Any]] = None) -> None:
        """Artifacts: ``trial_config.yaml`` (the trial as expanded: overrides and their sources) and
        ``resolved_config.yaml`` (model with every default filled in, task, training settings)."""
        if not self.ok or self.artifact_logged:
            return
        plain = json.loads(json.dumps(dict(trial), default=str))
        retry(self.c.log_text, self.run_id, yaml.safe_dump(plain, sort_keys=False), "trial_config.yaml",
              what="log config")
        if resolved is not None:
            text = yaml.safe_dump(json.loads(json.dumps(dict(resolved), default=str)), sort_keys=False)
            retry(self.c.log_text, self.run_id, text, "resolved_config.yaml", what="log resolved config")
        set_tags(self.c, self.run_id, {"atlaslab.config_logged": "1"})
        self.artifact_logged = True

    def _wait_for_server(self, call) -> None:
        """Call ``call`` until the server answers, at most for the outage bound (then :class:`TrackingUnavailable`)."""
        start = time.time()
        while True:
            try:
                call()
                return
            except Exception as exc:
                waited = time.time() - start
                if waited >= self.outage_s:
                    raise TrackingUnavailable(
                        f"the tracking server {self.uri} did not answer for {waited:.0f} s ({OUTAGE_ENV}="
                        f"{self.outage_s:g}): {type(exc).__name__}: {str(exc)[:300]}. The run folder is resumable "
                        "(`atlaslab resume <run dir>`) once the server is back.") from exc
                time.sleep(min(RETRY_WHILE_DOWN_S, max(0.1, self.outage_s - waited)))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` (a step at or below one already logged is skipped: a restored trial replays
        it). While the server is away they wait in :attr:`pending` and training goes on; see :meth:`flush`."""
        if not self.ok or step <= self.last_step:
            return
        from mlflow.entities import Metric
        ts = int(time.time() * 1000)
        self.pending.extend(Metric(safe_key(k), float(v), ts, int(step)) for k, v in {**metrics, "step": step}.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)))
        self.flush()

    def flush(self, wait: bool = False) -> None:
        """Send the pending metrics, oldest first, each once. While the server is away, try again at most every
        :data:`RETRY_WHILE_DOWN_S` (``wait``: until it answers); past the outage bound raise
        :class:`TrackingUnavailable`, naming the steps whose metrics were not sent."""
        while self.pending:
            now = time.time()
            if self.down_since is not None and now < self.next_try:
                self.held[1] = self.pending[-1].step
                if not wait:
                    return
                time.sleep(self.next_try - now)
                continue
            try:
                while self.pending:
                    self.c.log_batch(self.run_id, metrics=self.pending[:500])
                    del self.pending[:500]
            except Exception as exc:
                now = time.time()
                if self.down_since is None:
                    self.down_since = now
                    self.held = [self.pending[0].step, self.pending[-1].step]
                    log.warning("trial %s: the tracking server %s does not answer (%s: %s); its metrics wait here "
                                "and training goes on (at most %g s)", self.key, self.uri, type(exc).__name__,
                                str(exc)[:200], self.outage_s)
                self.held[1] = self.pending[-1].step
                if now - self.down_since >= self.outage_s:
                    steps = sorted({m.step for m in self.pending})
                    raise TrackingUnavailable(
                        f"the tracking server {self.uri} did not answer for {now - self.down_since:.0f} s "
                        f"({OUTAGE_ENV}={self.outage_s:g}); the metrics of trial {self.key} at steps "
                        f"{steps[0]}–{steps[-1]} ({len(self.pending)} values) were not sent. The run folder is "
                        "resumable (`atlaslab resume <run dir>`) once the server is back.") from exc
                self.next_try = now + RETRY_WHILE_DOWN_S
                continue
            if self.down_since is not None:
                what = (f"the tracking server did not answer for {time.time() - self.down_since:.0f} s; the metrics of "
                        f"steps {self.held[0]}–{self.held[1]} waited in the trial and were sent when it answered again")
                log.warning("trial %s: %s", self.key, what)
                self.outages.append(what)
                self.down_since = None
                set_tags(self.c, self.run_id, {"atlaslab.tracking_outages": "; ".join(self.outages)})

    def replay(self, history) -> None:
        """Log the records of a restored loop's history (``{"step": s, <metrics>}``) that the run lacks: those
        above the last step it holds, which a trial that died while the server was away had not sent."""
        for rec in history:
            self.log({k: v for k, v in rec.items() if k != "step"}, int(rec["step"]))

    def mark_logged(self, step: int) -> None:
        self.last_step = max(self.last_step, step)

    def end(self, status: str, tags: Optional[Mapping[str, Any]] = None) -> None:
        if not self.ok:
            return
        if self.pending:
            self.flush(wait=True)
        if tags:
            set_tags(self.c, self.run_id, tags)
        retry(self.c.set_terminated, self.run_id, status=status, what="end run")


def wait_for_server(uri: str, limit_s: Optional[float] = None) -> None:
    """Return once the tracking server at ``uri`` answers its health check (at once for a local store); after
    ``limit_s`` (default :func:`outage_limit_s`) raise :class:`TrackingUnavailable`."""
    if is_local_uri(uri):
        return
    import urllib.request
    limit_s = outage_limit_s() if limit_s is None else limit_s
    start = time.time()
    while True:
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError as exc:
            err = exc
        waited = time.time() - start
        if waited >= limit_s:
            raise TrackingUnavailable(f"the tracking server {uri} did not answer for {waited:.0f} s ({OUTAGE_ENV}="
                                      f"{limit_s:g}): {err}")
        time.sleep(min(RETRY_WHILE_DOWN_S, max(0.1, limit_s - waited)))


def run_status(c, run_id: str) -> Optional[str]:
    r = retry(c.get_run, run_id, what="get run")
    return r.info.status if r is not None else None


def finalize_child(uri: str, experiment_id: str, parent_id: str, trial_key: str, status: str,
                   tags: Mapping[str, Any]) -> None:
    """Driver-side backstop: end a trial's run if the trial process could not (killed, stopped by ASHA)."""
    c = client(uri)
    run = retry(find_child, c, experiment_id, parent_id, trial_key, what="find child run")
    if run is None:
        return
    have = run.data.tags
    # what the trial recorded itself (its status and reason) is more precise than the driver's view
    tags = {k: v for k, v in tags.items() if have.get(k) in (None, "", "running")
            or (k == "atlaslab.status" and v == "pruned")}
    set_tags(c, run.info.run_id, tags)
    if run.info.status != status:
        retry(c.set_terminated, run.info.run_id, status=status, what="end run")


__all__ = ["TAG_KEY", "TrackingUnavailable", "TrialRun", "artifact_location", "children", "client", "config_params",
           "default_store", "default_tracking_uri", "ensure_experiment", "finalize_child", "flatten", "is_local_uri",
           "log_metrics", "log_params", "outage_limit_s", "retry", "set_tags", "wait_for_server"]
