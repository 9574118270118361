"""The Ray Tune function trainable: one trial = build the model from the registry, train, report.

Each evaluation of the shared training loop (:func:`atlaslab.train.train`) becomes one ``tune.report``
(the metrics plus ``step``) carrying a Ray checkpoint of the loop's ``checkpoint.pt``; every metrics call
of the loop is logged to the trial's MLflow run. A restored or retried trial starts from its last Ray
checkpoint: the loop resumes bit-for-bit (CPU), steps already reported to Tune or logged to MLflow are not
reported or logged twice. With an ``eval.lm_eval`` node the trained model then runs those lm-eval tasks, whose
metrics (``lm_eval/<task>/<metric>``) join the final report and the MLflow run. The last report has ``final: 1``
and the trial's ``status``:

* ``completed`` / ``early_stopped`` (the loop's threshold) — a finished trial;
* ``over_cost`` — its training steps averaged more wall seconds than ``train.max_step_time_s`` at an evaluation:
  reported with its test metrics, ``train_step_time_s`` and the bound; the searcher tells it to the sampler as
  infeasible, and the report does not rank it;
* ``diverged`` — a non-finite loss or gradient: reported (metric NaN, ``failed: 1``, ``message``) and
  marked FAILED in MLflow, without an exception, so Ray does not retry a deterministic failure.

With ``resources.workers_per_trial > 1`` the loop runs on that many Ray Train workers
(:mod:`atlaslab.search.workers`); this function still restores, logs, reports and checkpoints, from rank 0's
metrics and checkpoints, and the final report adds ``workers`` and ``param_digests`` (one digest of the
parameters per worker: they are the same). The lm-eval tasks then run on rank 0, on its device, where the trained
model is (this function only coordinates and holds no model), and come back with its final result.

An exception (a bug, an out-of-memory) propagates: Ray retries it ``max_failures`` times from the last
checkpoint and then records the trial as errored; its MLflow run is ended FAILED with the error.

The loop's ``checkpoint.pt`` lives in a node-local folder that Ray never copies (:func:`_work_dir`); a Ray
checkpoint found torn on restore (truncated, a record failing its CRC) is passed over for the previous one Tune
kept, and the final report's ``checkpoint_fallback`` (and the MLflow tag ``atlaslab.checkpoint_fallback``) says so.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import logging
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from atlaslab.eval.lm_eval import PREFIX as LM_EVAL_PREFIX
from atlaslab.registry import import_user_modules
from atlaslab.search.build import build_trial, lm_eval_after_training, lm_eval_node
from atlaslab.search.settings import TrialSettings
from atlaslab.search.tracking import TrialRun
from atlaslab.search.workers import train_on_workers
from atlaslab.train import checkpoint as checkpoint_files
from atlaslab.train.config import TrainConfig
from atlaslab.train.loop import CHECKPOINT_KEYS, CHECKPOINT_NAME, TrainResult, train

CKPT_META = "atlaslab_trial.json"
log = logging.getLogger("atlaslab.search")


def run_trial(config: Dict[str, Any], settings: Optional[TrialSettings] = None) -> None:
    """Ray Tune function trainable (see the module docstring).

    ``config``: ``{"trial": trial}``, the trial as the driver admitted it (a grid's point, or a search's draw that
    :class:`~atlaslab.search.searcher.PartSearcher` sized and validated), with its typed model config
    ``resolved_model``; ``settings``: the experiment's :class:`~atlaslab.search.settings.TrialSettings`, bound by
    ``tune.with_parameters`` (so that a restored experiment gets them from the driver anew)."""
    t_start = time.time()
    from ray import tune

    if settings is None:
        raise ValueError("run_trial needs the experiment's settings: tune.with_parameters(run_trial, settings=…)")
    import_user_modules(settings.imports)
    torch.set_num_threads(settings.threads)
    trial = _trial_spec(config)
    work = _work_dir()
    work.mkdir(parents=True, exist_ok=True)
    restored, fallback, history = _restore_checkpoint(work)
    if restored is None:
        return
    mlrun = _child_run(settings, trial)
    if mlrun is not None:
        mlrun.replay(history)         # what an attempt that died while the tracking server was away had not sent
    status, tags = "FAILED", {}
    try:
        task, tcfg, model = build_trial(trial)
        if mlrun is not None:
            mlrun.log_config({k: v for k, v in trial.items() if k not in ("model_config", "resolved_model")},
                             {"model": model.resolved.to_dict(), "task": task.info(), "train": tcfg.to_dict()})
        reporter = _Reporter(mlrun, work, tcfg, reported_step=restored, t_start=t_start)
        if settings.workers > 1:
            result = train_on_workers(trial, settings, work, reporter)      # rank 0 ran the lm-eval tasks, if any
            lm_metrics = {k: v for k, v in result.metrics.items() if k.startswith(LM_EVAL_PREFIX + "/")}
        else:
            result = train(model, task, tcfg, callback=reporter, checkpoint_dir=work)
            lm_metrics = lm_eval_after_training(result, task, lm_eval_node(trial))
            result.metrics.update(lm_metrics)
        if lm_metrics and mlrun is not None:
            mlrun.log(lm_metrics, result.steps)
        final, status, tags = _final_result(result, settings, trial, reporter)
        fallback = "; ".join(x for x in (fallback, result.checkpoint_fallback) if x)
        if fallback:                  # resumed from an older checkpoint than the last: say so in the record
            final["checkpoint_fallback"] = fallback
            tags["atlaslab.checkpoint_fallback"] = fallback[:4000]
        if mlrun is not None:
            mlrun.log({k: v for k, v in final.items() if k in ("failed", "wall_time_s", "setup_s")}, result.steps)
            mlrun.flush(wait=True)    # metrics held back while the server was away reach it before the trial ends
        _report(final, work / CHECKPOINT_NAME, result.steps, final=True)
    except SystemExit:
        # Tune stops a trial (ASHA, a stopper) by exiting its thread from inside tune.report
        status, tags = "FINISHED", {"atlaslab.status": "pruned"}
        raise
    except BaseException as exc:
        tags = {"atlaslab.status": "error", "atlaslab.failure": f"{type(exc).__name__}: {exc}"[:4000]}
        if mlrun is not None:
            try:
                mlrun.c.log_text(mlrun.run_id, traceback.format_exc(), "error.txt")
            except Exception:
                pass
        raise
    finally:
        if mlrun is not None:
            mlrun.end(status, tags)


def _trial_spec(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The trial dict the driver admitted (a grid's point, or a search's draw from the searcher)."""
    if "trial" not in config:
        raise ValueError("this trial's config has no admitted trial: the run folder was started by an atlaslab whose "
                         "search sent sampled parameters to the trials; finish it with that version")
    return dict(config["trial"])


def _work_dir() -> Path:
    """The trial's working folder for the loop's ``checkpoint.pt``: node-local and outside every folder Ray copies.
    Tune's trial folder (``get_trial_dir()``, under ``driver_artifacts/``) is copied to the run folder's storage
    every few seconds on the driver's node, which raced with the loop's write-then-rename of its checkpoint; the
    trial's working directory (under Ray's session folder, ``working_dirs/``) is copied only with
    ``SyncConfig(sync_artifacts=True)``, which the driver leaves off. What outlives the node is the Ray checkpoint
    each report persists to the run's storage."""
    from ray import tune
    try:
        base = Path(tune.get_context().get_storage().trial_working_directory)
    except Exception:                          # outside a Tune session: a private temporary folder
        base = Path(tempfile.mkdtemp(prefix="atlaslab-trial-"))
    return base / "atlaslab-work"


def _restore_checkpoint(work: Path) -> Tuple[Optional[int], str, List[Dict[str, Any]]]:
    """Put the trial's last Ray checkpoint (if any) where the training loop resumes from. Returns ``(step, note,
    history)``: the last step reported to Tune (-1 for a fresh start), or None for a trial that had finished (its
    stored final result is reported again: there is nothing to train, and its MLflow run stays as it is); ``note``
    says which torn checkpoints were passed over; ``history`` is the restored loop's record of every step. A checkpoint is checked before it is used (:mod:`atlaslab.train.checkpoint`);
    a torn one gives the previous one Tune kept, and all torn raises ``CorruptCheckpoint``."""
    from ray import tune
    target = work / CHECKPOINT_NAME
    ckpt = tune.get_checkpoint()
    if ckpt is None:
        checkpoint_files.remove(target)        # a fresh start: no stale state from an earlier attempt
        return -1, "", []
    torn: List[str] = []
    reported: Optional[int] = None
    for cand in [ckpt] + _older_checkpoints(ckpt):
        name = Path(cand.path).name
        with cand.as_directory() as d:
            try:
                ck_meta = json.loads((Path(d) / CKPT_META).read_text())
            except (OSError, ValueError) as exc:
                torn.append(f"Ray checkpoint {name}: {CKPT_META} unreadable ({exc})")
                continue
            if reported is None:
                reported = int(ck_meta.get("reported_step", -1))
            if ck_meta.get("final") and not torn:
                # finished before an interruption that Tune did not record
                tune.report(ck_meta["final"])
                return None, "", []
            src = Path(d) / CHECKPOINT_NAME
            try:
                history = checkpoint_files.load(src, required=CHECKPOINT_KEYS)["state"].get("history", [])
            except checkpoint_files.CorruptCheckpoint as exc:
                torn.append(f"Ray checkpoint {name}: {exc}")
                log.warning("torn checkpoint: %s", torn[-1])
                continue
            checkpoint_files.remove(target)
            shutil.copyfile(src, work / (CHECKPOINT_NAME + ".part"))
            os.replace(work / (CHECKPOINT_NAME + ".part"), target)
        note = ""
        if torn:
            note = (f"{'; '.join(torn)} — resumed from the previous Ray checkpoint {name} "
                    f"(reported at step {ck_meta.get('reported_step')}) instead")
            log.warning("checkpoint fallback: %s", note)
        return reported, note, history
    raise checkpoint_files.CorruptCheckpoint("every checkpoint Tune kept for this trial is torn: " + "; ".join(torn))


def _older_checkpoints(ckpt) -> list:
    """The trial's other checkpoints that Tune kept (``checkpoint_<index>`` beside ``ckpt``), newest first."""
    import pyarrow.fs as pafs
    from ray import tune
    path = Path(ckpt.path)
    try:
        infos = ckpt.filesystem.get_file_info(pafs.FileSelector(path.parent.as_posix()))
    except OSError:
        return []
    names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory
                    and i.base_name.startswith("checkpoint_") and i.base_name < path.name), reverse=True)
    return [tune.Checkpoint((path.parent / n).as_posix(), filesystem=ckpt.filesystem) for n in names]


def _child_run(settings: TrialSettings, trial: Mapping[str, Any]) -> Optional[TrialRun]:
    """The trial's MLflow run (found again after a restore), or None when tracking is off."""
    tr = settings.tracking
    if not (tr.get("uri") and tr.get("parent_run_id")):
        return None
    return TrialRun(tr["uri"], tr["experiment_id"], tr["parent_run_id"], trial,
                    run_name=f"{trial['key']} {trial['label']}"[:200])


class _Reporter:
    """The training loop's callback: every metrics call to MLflow; every evaluation but the last (which the final
    report carries) to Tune with the checkpoint of that step, unless a restored trial reported it already. The loop
    writes a step's checkpoint before it calls back for that step (:func:`atlaslab.train.train`), so the Ray
    checkpoint of the report of step N holds the loop's state at step N, its history up to N included; a trial
    restored from it resumes after step N."""

    def __init__(self, mlrun: Optional[TrialRun], work: Path, tcfg: TrainConfig, reported_step: int,
                 t_start: float):
        self.mlrun, self.work, self.tcfg = mlrun, work, tcfg
        self.reported_step, self.t_start = reported_step, t_start
        self.eval_prefix = tcfg.eval_split + "/"
        self.last_train: Dict[str, float] = {}
        self.t0 = time.time()
        self.setup_s = self.t0 - t_start          # imports, MLflow run, model build: the per-trial overhead

    def __call__(self, metrics: Dict[str, float], step: int) -> None:
        if self.mlrun is not None:
            self.mlrun.log(metrics, step)
        train_part = {k: v for k, v in metrics.items() if k.startswith("train/")}
        if train_part:
            self.last_train = train_part
        if not any(k.startswith(self.eval_prefix) for k in metrics):
            return
        if step <= self.reported_step or step >= self.tcfg.steps:
            # Tune has it already (a step trained again after a fallback from a torn Ray checkpoint, or restored
            # from a run folder whose checkpoints held the evaluation before their report's) / the final report has it
            return
        rep = {**self.last_train, **metrics, "step": step, "final": 0,
               "elapsed_s": time.time() - self.t0, "setup_s": self.setup_s, "t_start": self.t_start}
        _report(rep, self.work / CHECKPOINT_NAME, step)


def _final_result(result: TrainResult, settings: TrialSettings, trial: Mapping[str, Any],
                  reporter: _Reporter) -> Tuple[Dict[str, Any], str, Dict[str, str]]:
    """``(final report, MLflow status, MLflow tags)`` of a finished training run; a diverged one reports its
    metric as NaN and ends FAILED."""
    info = trial.get("info", {})
    final = {**result.metrics, "step": result.steps, "final": 1, "status": result.status,
             "message": result.message, "failed": int(result.diverged), "wall_time_s": result.wall_time_s,
             "setup_s": reporter.setup_s, "t_start": reporter.t_start, "t_end": time.time(), "node_id": _node_id(),
             "num_parameters": info.get("num_parameters", 0), "state_size": info.get("state_size", 0),
             # the search's step-cost objective: seconds of the training loop per step, evaluations included
             "step_time_s": result.wall_time_s / max(1, result.steps),
             # the training steps alone, what train.max_step_time_s bounds (status over_cost above it)
             "train_step_time_s": result.train_seconds / max(1, result.steps),
             # the steps it trained: where train.early_stop_threshold ended it, how fast it solved the setting
             "steps_trained": result.steps}
    if result.config.get("max_step_time_s") is not None:
        final["max_step_time_s"] = result.config["max_step_time_s"]
    if result.resumed_from is not None:           # the step the loop resumed from (a restored trial)
        final["resumed_from"] = result.resumed_from
    if "workers" in result.model_info:           # trained on several Ray Train workers
        final["workers"] = result.model_info["workers"]
        final["param_digests"] = ",".join(result.model_info["param_digests"])
    if result.best:
        final["best_value"] = result.best.get("value")
        final["best_step"] = result.best.get("step")
    if result.diverged:
        final[settings.metric] = float("nan")
        return final, "FAILED", {"atlaslab.status": "diverged", "atlaslab.failure": result.message}
    return final, "FINISHED", {"atlaslab.status": result.status}


def _node_id() -> str:
    """The Ray node this trial runs on ("" outside Ray)."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""


def _report(metrics: Dict[str, Any], ckpt_file: Optional[Path], step: int, final: bool = False) -> None:
    """``tune.report`` (non-finite values as NaN), with a Ray checkpoint of ``ckpt_file`` when it exists; the
    checkpoint's meta holds the step reported and, for the final report, the result itself."""
    from ray import tune
    clean = {}
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            clean[k] = float("nan")
        else:
            clean[k] = v
    if ckpt_file is None or not Path(ckpt_file).is_file():
        tune.report(clean)
        return
    with tempfile.TemporaryDirectory(prefix="atlaslab-ckpt-") as d:
        shutil.copyfile(ckpt_file, Path(d) / ckpt_file.name)
        meta = {"reported_step": step}
        if final:
            meta["final"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                             for k, v in clean.items()}
        (Path(d) / CKPT_META).write_text(json.dumps(meta))
        tune.report(clean, checkpoint=tune.Checkpoint.from_directory(d))


__all__ = ["run_trial"]
