"""The driver-side Tune callback: live progress and the MLflow backstop (picklable, so a restore keeps it)."""
from __future__ import annotations

import math
import sys
import time

from ray.tune import Callback

from atlaslab.search.formatting import fmt_value, short_key
from atlaslab.search.tracking import finalize_child


class Progress(Callback):
    """Live progress in the terminal (trials running / done / failed, best so far) + MLflow backstop.

    A Tune ``Callback`` on the driver: one line per trial event (and a heartbeat every 30 s); it ends a
    trial's MLflow run when the trial process could not (stopped by ASHA, killed)."""

    def __init__(self, name, metric, mode, tracking, stream_name="stdout", total=None):
        self.name, self.metric, self.mode = name, metric, mode
        self.tracking = tracking
        self.stream_name = stream_name
        self.total = total
        self.t0 = time.time()
        self.last_beat = 0.0
        self.best = None

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info):
        self.t0 = time.time()          # also after a restore (the callback is unpickled with the experiment)
        self.last_beat = 0.0

    def _out(self, msg: str) -> None:
        stream = getattr(sys, self.stream_name)
        el = int(time.time() - self.t0)
        print(f"[{self.name} {el // 60:02d}:{el % 60:02d}] {msg}", file=stream, flush=True)

    @staticmethod
    def _label(trial) -> str:
        t = trial.config.get("trial")
        if t:
            return f"{t['key']} {t['row']}" + (f" seed {t['seed']}" if "seed" in t else "")
        params = {k: v for k, v in trial.config.items() if k != "experiment"}
        return f"{trial.trial_id} " + ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in params.items())

    def _counts(self, trials) -> str:
        done, failed = set(getattr(self, "_done", ())), set(getattr(self, "_failed", ()))
        for t in trials:                    # trials finished before a restore
            if t.status in ("TERMINATED", "ERROR"):
                done.add(t.trial_id)
                if t.status == "ERROR" or (t.last_result or {}).get("failed") == 1:
                    failed.add(t.trial_id)
        running = sum(t.status == "RUNNING" and t.trial_id not in done for t in trials)
        total = self.total or len(trials)
        s = f"{running} running · {len(done)}/{total} done · {len(failed)} failed"
        if self.best is not None:
            s += f" · best {self.metric} {self.best[0]:.4g} ({self.best[1]})"
        return s

    def _mark(self, trial, failed: bool) -> None:
        if not hasattr(self, "_done"):
            self._done, self._failed = set(), set()
        self._done.add(trial.trial_id)
        if failed:
            self._failed.add(trial.trial_id)

    def _update_best(self, trial, result) -> None:
        v = result.get(self.metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            if self.best is None or (v > self.best[0] if self.mode == "max" else v < self.best[0]):
                self.best = (float(v), self._label(trial).split(" ")[0])

    def on_trial_start(self, iteration, trials, trial, **info):
        self._out(f"start {self._label(trial)}  | {self._counts(trials)}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._update_best(trial, result)
        step = result.get("step")
        shown = result.get(self.metric)
        if isinstance(shown, (int, float)) and math.isfinite(shown) and result.get("final") != 1:
            self._out(f"step {step}: {self._label(trial).split(' ')[0]} {self.metric}={shown:.4g}  | "
                      + self._counts(trials))
            self.last_beat = time.time()

    def on_step_end(self, iteration, trials, **info):
        if time.time() - self.last_beat > 60:           # a heartbeat while nothing reports
            self.last_beat = time.time()
            self._out(self._counts(trials))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        self._mark(trial, r.get("failed") == 1)
        self._update_best(trial, r)
        if r.get("final") == 1:
            status = r.get("status", "completed")
            msg = f"{status}" + (f" ({r.get('message')})" if r.get("failed") else "")
        else:
            status, msg = "pruned", f"stopped by the scheduler at step {r.get('step', '?')}"
        shown = r.get(self.metric)
        val = f" {self.metric}={shown:.4g}" if isinstance(shown, (int, float)) and math.isfinite(shown) else ""
        self._out(f"{msg}: {self._label(trial)}{val}  | {self._counts(trials)}")
        self._finalize(trial, "FAILED" if r.get("failed") == 1 else "FINISHED",
                       {"atlaslab.status": status} if status == "pruned" else {})

    def on_trial_error(self, iteration, trials, trial, **info):
        self._mark(trial, True)
        err = getattr(trial, "error_msg", None) or ""
        first = str(err).strip().splitlines()[-1] if err else "error"
        self._out(f"FAILED {self._label(trial)}: {first[:200]}  | {self._counts(trials)}")
        self._finalize(trial, "FAILED", {"atlaslab.status": "error", "atlaslab.failure": first[:4000]})

    def _finalize(self, trial, status, tags):
        tr = self.tracking or {}
        if not tr.get("parent_run_id"):
            return
        t = trial.config.get("trial")
        key = t["key"] if t else trial.trial_id
        try:
            finalize_child(tr["uri"], tr["experiment_id"], tr["parent_run_id"], key, status, tags)
        except Exception as exc:
            self._out(f"warning: could not end the MLflow run of {key}: {exc}")


__all__ = ["Progress"]
