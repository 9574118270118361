"""Data-parallel training (``train(..., parallel=DataParallel())``) against one process, in float64.

Two processes (``torch.multiprocessing``, gloo over 127.0.0.1) train a tiny Gated DeltaNet on MQAR with a
mixture of 1 and 4 key-value pairs, so the two halves of a batch score different numbers of tokens: the
loss weighting must make the averaged gradient that of the whole batch. Checked: both ranks end bitwise
equal; parameters, last gradients and every logged metric match one process on the same global batch; a
2-process run resumed from its step-3 checkpoint ends bitwise where the uninterrupted one did. Gradient
accumulation (``train.micro_batch_size``) gives the same training, in one process and on two ranks.
"""
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from atlaslab.models.presets import build_model
from atlaslab.registry import ConfigError
from atlaslab.tasks import build_task
from atlaslab.train import train
from atlaslab.train.parallel import DataParallel

TASK = {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [1, 4], "eval_examples": 16}
TRAIN = dict(steps=6, batch_size=8, lr=1e-2, warmup_steps=2, eval_interval=3, log_interval=1,
             checkpoint_interval=3, seed=1, device="cpu", progress="never")


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("gated_deltanet", ["d_model=16", "vocab_size=16", "mixers.gated_deltanet.num_heads=2",
                                          "num_layers=1"]).double()


def rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: a full run (rank 0 keeps its step-3 checkpoint aside), then a run resumed from that copy."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        par = DataParallel()
        task = build_task(TASK)
        with pytest.raises(ConfigError, match=r"train\.batch_size: 7 does not split over 2 workers"):
            train(tiny_model(), task, {**TRAIN, "batch_size": 7}, parallel=par)
        ck = os.path.join(out, f"ck{rank}")

        def keep_step3(metrics, step):
            if step == 4:                                 # the checkpoint of step 3 is on disk
                shutil.copytree(ck, os.path.join(out, "mid"))

        res = train(tiny_model(), task, TRAIN, callback=keep_step3 if rank == 0 else None, checkpoint_dir=ck,
                    parallel=par)
        full = {"digests": par.digests(res.model), "state": res.model.state_dict(), "history": res.history,
                "grads": {n: p.grad for n, p in res.model.named_parameters()}, "metrics": res.metrics}
        dist.barrier()
        again = os.path.join(out, f"again{rank}")
        shutil.copytree(os.path.join(out, "mid"), again)
        res2 = train(tiny_model(seed=7), task, TRAIN, checkpoint_dir=again, parallel=par)
        resumed = {"digests": par.digests(res2.model), "state": res2.model.state_dict(), "history": res2.history,
                   "resumed_from": res2.resumed_from}
        with pytest.raises(ConfigError, match=r"train\.micro_batch_size: 8 does not divide the 4 rows each of the 2"):
            train(tiny_model(), task, {**TRAIN, "micro_batch_size": 8}, parallel=par)
        res3 = train(tiny_model(), task, {**TRAIN, "micro_batch_size": 2}, parallel=par)   # 2 micro-batches a rank
        micro = {"digests": par.digests(res3.model), "state": res3.model.state_dict(), "history": res3.history}
        torch.save({"full": full, "resumed": resumed, "micro": micro}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # fork: the children inherit the imported modules (spawn would import torch and atlaslab again, ~10 s)
    mp.start_processes(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_the_shards_score_unequal_token_counts():
    """Otherwise the loss weighting would not be exercised (a plain mean of the shard means would do)."""
    task = build_task(TASK)
    unequal = 0
    for s in range(TRAIN["steps"]):
        b = task.batch("train", s, TRAIN["batch_size"], seed=TRAIN["seed"])
        halves = [int((b.train_targets[rows] != -100).sum()) for rows in (slice(0, 4), slice(4, 8))]
        assert int(task.loss_weight(b)) == sum(halves)
        unequal += halves[0] != halves[1]
    assert unequal >= 3


def test_two_ranks_stay_bitwise_identical(two_ranks):
    d0, d1 = two_ranks[0]["full"]["digests"], two_ranks[1]["full"]["digests"]
    assert d0 == d1 and len(d0) == 2 and d0[0] == d0[1]
    s0, s1 = two_ranks[0]["full"]["state"], two_ranks[1]["full"]["state"]
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_two_ranks_match_one_process_on_the_global_batch(two_ranks):
    ref = train(tiny_model(), build_task(TASK), TRAIN)
    full = two_ranks[0]["full"]
    ref_state = ref.model.state_dict()
    for k, v in full["state"].items():
        if v.is_floating_point():
            assert rms_ratio(v, ref_state[k]) < 1e-10, k
    for n, p in ref.model.named_parameters():        # the last step's (all-reduced, clipped) gradients
        assert rms_ratio(full["grads"][n], p.grad) < 1e-10, n
    assert len(full["history"]) == len(ref.history)
    for mine, theirs in zip(full["history"], ref.history):
        assert mine.keys() == theirs.keys()
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (mine["step"], k)
    assert full["metrics"]["train/loss"] == pytest.approx(ref.metrics["train/loss"], rel=1e-9)


def test_a_two_rank_run_resumes_from_its_checkpoint(two_ranks):
    for r in range(2):
        resumed, full = two_ranks[r]["resumed"], two_ranks[r]["full"]
        assert resumed["resumed_from"] == 3
        assert resumed["digests"] == full["digests"]
        assert all(torch.equal(resumed["state"][k], full["state"][k]) for k in full["state"])
    assert two_ranks[0]["resumed"]["history"] == two_ranks[0]["full"]["history"]


def test_a_shard_keeps_its_rows_document_boundaries():
    """Packed rows (lm_corpus): each rank's shard (and each micro-batch) carries the offsets of its own rows'
    documents, rebased, so no document sees another on any rank (row starts are always offsets)."""
    from atlaslab.tasks.base import row_cu_seqlens
    cu = torch.tensor([0, 3, 4, 8, 10, 16, 24, 29, 32])         # 4 rows of 8 tokens
    assert row_cu_seqlens(cu, slice(0, 2), 8).tolist() == [0, 3, 4, 8, 10, 16]
    assert row_cu_seqlens(cu, slice(2, 4), 8).tolist() == [0, 8, 13, 16]
    assert row_cu_seqlens(None, slice(0, 2), 8) is None


def _assert_same_training(state, history, ref, tol=1e-10):
    ref_state = ref.model.state_dict()
    for k, v in state.items():
        if v.is_floating_point():
            assert rms_ratio(v, ref_state[k]) < tol, k
    assert [h.keys() for h in history] == [h.keys() for h in ref.history]
    for mine, theirs in zip(history, ref.history):
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (mine["step"], k)


def test_gradient_accumulation_trains_as_the_whole_batch_does():
    """Micro-batches of 1 and 2 rows, whose rows score different numbers of tokens: each micro-batch's mean loss is
    weighted by its token share, so parameters and every logged metric match one pass over the batch of 8."""
    ref = train(tiny_model(), build_task(TASK), TRAIN)
    for m in (1, 2):
        res = train(tiny_model(), build_task(TASK), {**TRAIN, "micro_batch_size": m})
        _assert_same_training(res.model.state_dict(), res.history, ref)
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size: 3 does not divide the batch of 8 rows"):
        train(tiny_model(), build_task(TASK), {**TRAIN, "micro_batch_size": 3})


def test_two_ranks_accumulating_micro_batches_match_one_process(two_ranks):
    ref = train(tiny_model(), build_task(TASK), TRAIN)
    assert two_ranks[0]["micro"]["digests"] == two_ranks[1]["micro"]["digests"]
    _assert_same_training(two_ranks[0]["micro"]["state"], two_ranks[0]["micro"]["history"], ref)
