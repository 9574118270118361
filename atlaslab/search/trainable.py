"""The Ray Tune function trainable: one trial = build the model from the registry, train, report.

Each evaluation of the shared training loop (:func:`atlaslab.train.train`) becomes one ``tune.report``
(the metrics plus ``step``) carrying a Ray checkpoint of the loop's ``checkpoint.pt``; every metrics call
of the loop is logged to the trial's MLflow run. A restored or retried trial starts from its last Ray
checkpoint: the loop resumes bit-for-bit (CPU), steps already reported to Tune or logged to MLflow are not
reported or logged twice. The last report has ``final: 1`` and the trial's ``status``:

* ``completed`` / ``early_stopped`` (the loop's threshold) — a finished trial;
* ``diverged`` — a non-finite loss or gradient: reported (metric NaN, ``failed: 1``, ``message``) and
  marked FAILED in MLflow, without an exception, so Ray does not retry a deterministic failure.

An exception (a bug, an out-of-memory) propagates: Ray retries it ``max_failures`` times from the last
checkpoint and then records the trial as errored; its MLflow run is ended FAILED with the error.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

CKPT_META = "atlaslab_trial.json"


def _trial_spec(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The trial dict: given (grid), or built from the sampled params (search) and validated here."""
    if "trial" in config:
        return dict(config["trial"])
    from ray import tune

    from atlaslab.search.expand import Validator, trial_from_params
    from atlaslab.search.schema import load_experiment
    from atlaslab.search.space import decode_params
    exp = load_experiment(node=config["experiment"]["node"])
    params = decode_params(exp.space, config)
    tid = tune.get_context().get_trial_id()
    trial = trial_from_params(exp, params, key=tid)
    Validator(exp).validate(trial)
    return trial


def run_trial(config: Dict[str, Any]) -> None:
    """Ray Tune function trainable (see the module docstring)."""
    t_start = time.time()
    from ray import tune

    meta = config["experiment"]
    for mod in meta.get("imports", []):
        __import__(mod)
    import torch

    threads = max(1, int(meta.get("cpus_per_trial", 1)))
    torch.set_num_threads(threads)

    from atlaslab.models.presets import build_model
    from atlaslab.tasks.base import build_task
    from atlaslab.train.config import resolve_train_config
    from atlaslab.train.loop import CHECKPOINT_NAME, train
    from atlaslab.search.expand import model_config
    from atlaslab.search.tracking import TrialRun

    trial = _trial_spec(config)
    ctx = tune.get_context()
    work = Path(ctx.get_trial_dir()) / "work"
    work.mkdir(parents=True, exist_ok=True)
    reported_step = -1
    ckpt = tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            m = Path(d) / CKPT_META
            ck_meta = json.loads(m.read_text()) if m.is_file() else {}
            if ck_meta.get("final"):
                # finished before an interruption that Tune did not record: report the stored result again,
                # train nothing and leave the MLflow run as it is
                tune.report(ck_meta["final"])
                return
            src = Path(d) / CHECKPOINT_NAME
            if src.is_file():
                shutil.copyfile(src, work / (CHECKPOINT_NAME + ".part"))
                os.replace(work / (CHECKPOINT_NAME + ".part"), work / CHECKPOINT_NAME)
            reported_step = int(ck_meta.get("reported_step", -1))
    elif (work / CHECKPOINT_NAME).exists():
        (work / CHECKPOINT_NAME).unlink()          # a fresh start: no stale state from an earlier attempt

    tr = meta.get("tracking") or {}
    mlrun: Optional[TrialRun] = None
    if tr.get("uri") and tr.get("parent_run_id"):
        mlrun = TrialRun(tr["uri"], tr["experiment_id"], tr["parent_run_id"], trial,
                         run_name=f"{trial['key']} {trial['label']}"[:200])

    cfg = trial["config"]
    status, tags = "FAILED", {}
    try:
        task = build_task(cfg["task"])
        tcfg = resolve_train_config(cfg["train"], "train")
        torch.manual_seed(tcfg.seed)
        model = build_model(model_config(cfg["model"], task.vocab_size))
        if mlrun is not None:
            mlrun.log_config(trial, {"model": model.resolved.to_dict(), "task": task.info(),
                                     "train": tcfg.to_dict()})
        info = trial.get("info", {})
        eval_prefix = tcfg.eval_split + "/"
        state = {"prev_eval": None, "last_train": {}, "t0": time.time()}
        setup_s = state["t0"] - t_start          # imports, MLflow run, model build: the per-trial overhead

        def callback(metrics: Dict[str, float], step: int) -> None:
            if mlrun is not None:
                mlrun.log(metrics, step)
            train_part = {k: v for k, v in metrics.items() if k.startswith("train/")}
            if train_part:
                state["last_train"] = train_part
            if not any(k.startswith(eval_prefix) for k in metrics):
                return
            prev = state["prev_eval"]
            state["prev_eval"] = step
            if step <= reported_step or step >= tcfg.steps:
                return        # replayed after a restore / the last one: the final report carries it
            rep = {**state["last_train"], **metrics, "step": step, "final": 0,
                   "elapsed_s": time.time() - state["t0"], "setup_s": setup_s, "t_start": t_start}
            _report(rep, work / CHECKPOINT_NAME if prev is not None else None, step)
            return

        result = train(model, task, tcfg, callback=callback, checkpoint_dir=work)
        final = {**result.metrics, "step": result.steps, "final": 1, "status": result.status,
                 "message": result.message, "failed": int(result.diverged), "wall_time_s": result.wall_time_s,
                 "setup_s": setup_s, "t_start": t_start, "t_end": time.time(), "node_id": _node_id(),
                 "num_parameters": info.get("num_parameters", 0), "state_size": info.get("state_size", 0)}
        if result.best:
            final["best_value"] = result.best.get("value")
            final["best_step"] = result.best.get("step")
        if result.diverged:
            final[meta.get("metric", "val/accuracy")] = float("nan")
            status = "FAILED"
            tags = {"atlaslab.status": "diverged", "atlaslab.failure": result.message}
        else:
            status = "FINISHED"
            tags = {"atlaslab.status": result.status}
        if mlrun is not None:
            mlrun.log({k: v for k, v in final.items() if k in ("failed", "wall_time_s", "setup_s")}, result.steps)
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


def _node_id() -> str:
    try:
        import ray
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""


def _report(metrics: Dict[str, Any], ckpt_file: Optional[Path], step: int, final: bool = False) -> None:
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
