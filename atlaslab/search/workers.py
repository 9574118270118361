"""A trial that spans several workers: Ray Train's ``TorchTrainer`` inside the Tune trial.

``resources.workers_per_trial: N > 1`` runs the training of a trial on N Ray Train workers, one process
each, in one ``torch.distributed`` group (gloo on CPU, NCCL on GPU). Every worker runs the one training
loop with :class:`~atlaslab.train.parallel.DataParallel` (its shard of the global batch, DDP's gradient
all-reduce). The Tune trial itself stays what :func:`atlaslab.search.trainable.run_trial` is for one
worker: it restores the trial's checkpoint, logs to MLflow and reports to Tune. Between the two::

    Tune trial (run_trial)                           Ray Train workers (rank 0 … N-1)
      checkpoint bytes ───── train_loop_config ────▶  each rank writes them into its own folder, resumes
      _Reporter (MLflow, tune.report) ◀── outbox ───  rank 0's callback: (metrics, step, checkpoint bytes)
      "go" / "stop" / "gone" ─────────── replies ──▶  rank 0's callback returns; "stop" ends every rank
      final report ◀───────────────────── outbox ───  rank 0: the TrainResult (with the metrics of the trial's
                                                       eval.lm_eval tasks, run on rank 0) and the last checkpoint

Ray Train removes its workers' placement group when its run ends. When the trial is killed first (an
interrupted sweep), the group stays reserved until the driver's job ends, because Ray Train's own cleaner
needs Ray's dashboard. Rank 0 therefore sends the group's id, the trial records it in ``work/``, and the
trial's next attempt (a resume, a retry) removes a group that is still there before it starts its workers.

Rank 0's metrics are the only ones that leave the workers; its checkpoint travels as bytes through Ray's
object store, so the workers need no storage shared with the trial. Reporting is synchronous (rank 0 waits
for the reply), so a checkpoint Tune holds is the one of the step it reports. When Tune stops a trial
(ASHA), the trial answers "gone" before it exits: the workers finish at once, sending nothing more, and Ray
Train releases their resources for the next trial. A worker that raises fails the Ray Train run, which raises in the
trial: Tune records the trial as errored and retries it (``max_failures``) from its last checkpoint, as for
one worker.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping

import torch

from atlaslab.registry import import_user_modules
from atlaslab.search.build import build_trial, lm_eval_after_training, lm_eval_node
from atlaslab.search.settings import TrialSettings, worker_resources
from atlaslab.train.loop import CHECKPOINT_NAME, TrainResult, train
from atlaslab.train.parallel import DataParallel

#: seconds the trial waits for a message before it checks that the workers are still running
POLL_S = 0.5
#: where a trial records the placement group of its workers (see the module docstring)
PLACEMENT_GROUP_FILE = "train_placement_group.txt"


def train_on_workers(trial: Mapping[str, Any], settings: TrialSettings, work: Path, reporter) -> TrainResult:
    """Train ``trial`` on ``settings.workers`` Ray Train workers, resuming from ``work/checkpoint.pt``
    when it is there; ``reporter`` (the trial's callback) gets rank 0's metrics, and ``work/checkpoint.pt`` is
    kept as rank 0 last reported it. Returns rank 0's result (without the model)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Empty, Queue

    n = settings.workers
    res = worker_resources(settings.resources)
    remove_stale_placement_group(work)
    outbox = Queue(actor_options={"num_cpus": 0})
    replies = Queue(actor_options={"num_cpus": 0})
    ckpt = work / CHECKPOINT_NAME
    config = {"trial": dict(trial), "imports": settings.imports, "outbox": outbox,
              "replies": replies, "threads": max(1, int(res["CPU"])),
              "checkpoint": ckpt.read_bytes() if ckpt.is_file() else None}
    trainer = TorchTrainer(
        worker_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=n, use_gpu="GPU" in res, resources_per_worker=res),
        run_config=RunConfig(name=f"{trial['key']}-{int(time.time() * 1000)}", storage_path=str(work / "train"),
                             failure_config=FailureConfig(max_failures=0)))
    box: Dict[str, Any] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # reported in the trial's thread
            box["error"] = exc

    thread = threading.Thread(target=fit, name=f"atlaslab-train-{trial['key']}", daemon=True)
    thread.start()
    final = None
    try:
        while True:
            alive = thread.is_alive()
            try:
                kind, payload, step, blob = outbox.get(timeout=POLL_S)
            except Empty:            # nothing more will come once the thread had ended before the wait
                if not alive:
                    break
                continue
            if kind == "placement_group":
                (work / PLACEMENT_GROUP_FILE).write_text(payload)
                continue
            if blob is not None:
                _write_atomic(ckpt, blob)
            if kind == "final":
                final = payload
                continue
            stop = reporter(payload, step) is True
            replies.put("stop" if stop else "go")
    except BaseException:
        # Tune stopped the trial (SystemExit from tune.report) or reporting failed: end the workers too
        try:
            replies.put("gone", timeout=5)
        except Exception:
            pass
        raise
    (work / PLACEMENT_GROUP_FILE).unlink(missing_ok=True)    # the run ended: Ray Train removed the group
    if "error" in box:
        raise RuntimeError(f"trial {trial['key']}: a Ray Train worker failed: {box['error']}") from box["error"]
    if final is None:
        raise RuntimeError(f"trial {trial['key']}: the Ray Train workers ended without a result")
    return TrainResult(**final)


def worker_loop(config: Dict[str, Any]) -> None:
    """One Ray Train worker: build the trial's task and model, resume from the checkpoint sent (if any), train
    its shard; rank 0 relays its metrics, its checkpoints and its result to the trial."""
    import ray.train
    from ray.util import get_current_placement_group

    import_user_modules(config["imports"])
    torch.set_num_threads(int(config["threads"]))
    rank = ray.train.get_context().get_world_rank()
    folder = Path(tempfile.mkdtemp(prefix=f"atlaslab-rank{rank}-"))
    try:
        if config["checkpoint"] is not None:
            _write_atomic(folder / CHECKPOINT_NAME, config["checkpoint"])
        task, tcfg, model = build_trial(config["trial"])
        relay = _Relay(config["outbox"], config["replies"], folder, tcfg.eval_split) if rank == 0 else None
        pg = get_current_placement_group()
        if relay is not None and pg is not None:
            relay.send("placement_group", pg.id.hex(), 0, with_checkpoint=False)
        parallel = DataParallel()
        result = train(model, task, tcfg, callback=relay, checkpoint_dir=folder, parallel=parallel)
        digests = parallel.digests(result.model)
        if len(set(digests)) != 1:
            raise RuntimeError(f"the workers' parameters differ at the end of training (digests {digests})")
        if relay is not None and not relay.gone:
            # the trained model is here (and on this rank's device), not in the trial: score lm-eval tasks now
            result.metrics.update(lm_eval_after_training(result, task, lm_eval_node(config["trial"])))
            out = result.to_dict(history=True)
            out["model_info"] = {**out["model_info"], "workers": parallel.world_size,
                                 "param_digests": digests}
            relay.send("final", out, result.steps, with_checkpoint=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Relay:
    """Rank 0's training callback: every metrics call goes to the trial (with the checkpoint file's bytes on
    evaluation steps, which the trial reports to Tune with that checkpoint), and the trial's reply decides
    whether to stop."""

    def __init__(self, outbox, replies, folder: Path, eval_split: str):
        self.outbox, self.replies, self.folder = outbox, replies, folder
        self.eval_prefix = eval_split + "/"
        self.gone = False      # the trial stopped listening (Tune stopped it): finish without it

    def __call__(self, metrics: Dict[str, float], step: int) -> bool:
        if self.gone:
            return True
        evaluation = any(k.startswith(self.eval_prefix) for k in metrics)
        self.send("log", metrics, step, with_checkpoint=evaluation)
        reply = self.replies.get()
        self.gone = reply == "gone"
        return reply != "go"

    def send(self, kind: str, payload: Any, step: int, with_checkpoint: bool) -> None:
        ckpt = self.folder / CHECKPOINT_NAME
        blob = ckpt.read_bytes() if with_checkpoint and ckpt.is_file() else None
        self.outbox.put((kind, payload, step, blob))


def remove_stale_placement_group(work: Path) -> None:
    """Remove the placement group an earlier attempt of this trial recorded, if Ray still holds it."""
    f = work / PLACEMENT_GROUP_FILE
    if not f.is_file():
        return
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
    try:
        pg = PlacementGroup(PlacementGroupID.from_hex(f.read_text().strip()))
        if placement_group_table(pg).get("state") not in (None, "REMOVED"):
            remove_placement_group(pg)
    except Exception:   # best effort: an unknown or malformed id leaves nothing to remove
        pass
    f.unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".part{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


__all__ = ["remove_stale_placement_group", "train_on_workers", "worker_loop", "worker_resources"]
