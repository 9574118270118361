"""MLflow for ``atlaslab train``: one run per training run, logged like a trial of an experiment.

    tracker = TrainTracker(run_dir="runs/tiny")             # store: runs/mlflow.db (tracking.default_tracking_uri)
    tracker.start("tiny", cfg, resumed=False)               # params: the flattened run config; tags
    tracker.log({"val/accuracy": 0.5}, step=100)            # every report of the training loop, final metrics too
    tracker.end(result)                                     # model info params, result.json, status
    tracker.fail(message)                                   # the training raised

The MLflow experiment is the run config's ``name`` (the config file's stem without one); a run is tagged
``atlaslab.kind = train`` and ``atlaslab.run_dir``. Running the same command again resumes from the checkpoint and
continues the same MLflow run (metrics at steps it already has are not logged again); ``--fresh`` starts a new one.
The store is the one experiments use (``runs/mlflow.db`` beside the default run folders), so the MLflow UI compares
single runs and trials; ``--tracking-uri`` or ``$MLFLOW_TRACKING_URI`` points elsewhere. Like a trial's, every
MLflow call retries and never fails the training run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from atlaslab.search import tracking as T

TAG_RUN_DIR = "atlaslab.run_dir"


class TrainTracker:
    """The MLflow run of one ``atlaslab train`` run (``run_dir=None``: a run without a folder, store under runs/)."""

    def __init__(self, run_dir: Optional[Path] = None, uri: Optional[str] = None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.uri = T.default_tracking_uri(self.run_dir or Path("runs") / "_", uri)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self.c = None
        self.run_id: Optional[str] = None
        self.last_step = -1
        self.reopen = False

    def start(self, name: str, config: Mapping[str, Any], resumed: bool = False) -> Optional[str]:
        """Create (or, for a resumed run, find) the MLflow run and log the config; returns the run id."""
        self.c = T.client(self.uri)
        exp_id = T.retry(T.ensure_experiment, self.uri, name, T.artifact_location(self.uri), what="experiment")
        if exp_id is None:
            return None
        run_dir = str(self.run_dir.resolve()) if self.run_dir is not None else ""
        run = None
        if resumed and run_dir:
            found = T.retry(self.c.search_runs, [exp_id], filter_string=f"tags.`{TAG_RUN_DIR}` = '{run_dir}'",
                            order_by=["attributes.start_time DESC"], max_results=1, what="find run") or []
            run = found[0] if found else None
        tags = {T.TAG_KIND: "train", T.TAG_EXPERIMENT: name, TAG_RUN_DIR: run_dir}
        if run is None:
            run = T.retry(self.c.create_run, exp_id, tags={**tags, "mlflow.runName": name}, run_name=name,
                          what="create run")
            if run is None:
                return None
            existing = {}
        else:
            existing = dict(run.data.params)
            self.reopen = True              # RUNNING again at its first new metric (a refused resume leaves it)
            hist = T.retry(self.c.get_metric_history, run.info.run_id, "step", what="metric history") or []
            self.last_step = max((int(m.step) for m in hist), default=-1)
            tags["atlaslab.resumed"] = "true"
        self.run_id = run.info.run_id
        T.set_tags(self.c, self.run_id, tags)
        T.log_params(self.c, self.run_id, T.flatten(dict(config)), existing)
        T.retry(self.c.log_text, self.run_id, json.dumps(dict(config), indent=2, default=str), "config.json",
                what="log config")
        return self.run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Metrics of one report of the training loop at ``step`` (the final metrics come this way too)."""
        if self.run_id is None or step <= self.last_step:
            return
        if self.reopen:
            T.retry(self.c.update_run, self.run_id, status="RUNNING", what="reopen run")
            self.reopen = False
        T.log_metrics(self.c, self.run_id, {**metrics, "step": step}, step)

    def end(self, result: Any) -> None:
        """Model info as params, ``result.json`` as an artifact, the status tag; the run ends FINISHED
        (FAILED when the training diverged)."""
        if self.run_id is None:
            return
        info = {f"info.{k}": v for k, v in (getattr(result, "model_info", None) or {}).items()
                if isinstance(v, (int, float, str, bool))}
        existing = (T.retry(self.c.get_run, self.run_id, what="get run") or None)
        T.log_params(self.c, self.run_id, info, dict(existing.data.params) if existing else {})
        out = result.to_dict(history=False)
        T.retry(self.c.log_text, self.run_id, json.dumps(out, indent=2, default=str), "result.json",
                what="log result")
        T.set_tags(self.c, self.run_id, {"atlaslab.status": result.status, "atlaslab.steps": result.steps})
        T.retry(self.c.set_terminated, self.run_id, status="FAILED" if result.diverged else "FINISHED",
                what="end run")

    def fail(self, message: str) -> None:
        """End the run as FAILED (the training raised); a resumed run that logged nothing new stays as it was (a
        resume refused for other settings does not fail the run that finished)."""
        if self.run_id is not None and not self.reopen:
            T.set_tags(self.c, self.run_id, {"atlaslab.status": "error", "atlaslab.message": message[:500]})
            T.retry(self.c.set_terminated, self.run_id, status="FAILED", what="end run")


__all__ = ["TrainTracker"]
