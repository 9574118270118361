"""Data-parallel training on a streamed corpus: each rank reads its own documents.

Two processes (gloo over 127.0.0.1) train a tiny attention LM on a streamed jsonl corpus (byte tokenizer, packed
rows). Checked: the ranks train on disjoint documents, each tokenising only its own share of the stream; both end
with bitwise-identical parameters; a run resumed from the step-3 checkpoint (which holds both ranks' cursors) sees
exactly the rows the uninterrupted run saw on each rank and ends bitwise where it did; a checkpoint written by
another number of workers is refused, naming the field.
"""
import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import Recorder, free_port

from atlaslab.models.lm import LanguageModel
from atlaslab.registry import ConfigError
from atlaslab.tasks import build_task
from atlaslab.tasks.lm_corpus import LMCorpus
from atlaslab.train import train
from atlaslab.train.parallel import DataParallel

pytest.importorskip("datasets", reason="lm_corpus reads corpora with the datasets library")

TRAIN = dict(steps=6, batch_size=4, lr=1e-2, eval_interval=3, log_interval=1, checkpoint_interval=3, seed=1,
             device="cpu", progress="never")


def _node(root):
    return {"name": "lm_corpus", "path": "json", "data_files": str(root / "train.jsonl"), "seq_len": 24,
            "val_fraction": 0.1, "test_fraction": 0.1, "eval_examples": 2, "streaming": True, "shuffle_buffer": 8,
            "cache_dir": str(root / "hf"), "tokenizer": {"name": "byte"}}


def _model():
    torch.manual_seed(0)
    return LanguageModel({"vocab_size": 257, "d_model": 16, "num_layers": 1, "layers": ["attn"],
                          "mixers": {"attn": {"name": "attention", "num_heads": 2}}})


def _documents(rows) -> set:
    """The document ids (``d017``) that the byte rows hold."""
    text = bytes(int(t) for r, _ in rows for t in r.reshape(-1) if int(t) < 256).decode("utf-8", "replace")
    return set(re.findall(r"d\d{3}", text))


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from pathlib import Path
        root = Path(root)
        par = DataParallel()
        tokenised = []
        encode = LMCorpus._tokenize

        def counting(self, texts):                   # the texts this rank tokenises
            for n, ids in encode(self, texts):
                tokenised.append(bytes(int(t) for t in ids if t < 256).decode()[:4])
                yield n, ids
        LMCorpus._tokenize = counting
        ck = root / f"ck{rank}"

        def keep_step3(metrics, step):
            if step == 4:                             # the checkpoint of step 3 is on disk
                shutil.copytree(ck, root / "mid")
        model = Recorder(_model())
        res = train(model, build_task(_node(root)), TRAIN, callback=keep_step3 if rank == 0 else None,
                    checkpoint_dir=ck, parallel=par)
        full = {"digests": par.digests(res.model), "state": res.model.state_dict(), "seen": model.seen,
                "tokenised": [t for t in tokenised if t.startswith("d")]}
        dist.barrier()
        again = root / f"again{rank}"
        shutil.copytree(root / "mid", again)
        model2 = Recorder(_model())
        res2 = train(model2, build_task(_node(root)), TRAIN, checkpoint_dir=again, parallel=par)
        resumed = {"digests": par.digests(res2.model), "seen": model2.seen, "resumed_from": res2.resumed_from}
        torch.save({"full": full, "resumed": resumed}, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    with open(root / "train.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"d{i:03d} " + "memory reads keys. " * (1 + i % 3)}) + "\n")
    mp.start_processes(_worker, args=(2, free_port(), str(root)), nprocs=2, join=True, start_method="fork")
    return root, [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_each_rank_trains_on_its_own_documents_and_tokenises_only_those(two_ranks):
    _, ranks = two_ranks
    seen = [_documents(r["full"]["seen"]) for r in ranks]
    assert all(len(s) >= 3 for s in seen) and not seen[0] & seen[1]
    for r, s in zip(ranks, seen):
        assert [x.shape for x, _ in r["full"]["seen"]] == [(1, 2 * 24)] * TRAIN["steps"]   # 2 packed rows a step
        assert s <= {t[:4] for t in r["full"]["tokenised"]}                 # what it trained on, it tokenised
    tok = [set(r["full"]["tokenised"]) for r in ranks]
    assert tok[0] and tok[1] and not tok[0] & tok[1]                        # and no rank the other's documents


def test_the_ranks_stay_identical_and_a_resumed_run_sees_exactly_the_rows_it_had_not_seen(two_ranks):
    _, ranks = two_ranks
    assert ranks[0]["full"]["digests"] == ranks[1]["full"]["digests"]
    for r in ranks:
        resumed, full = r["resumed"], r["full"]
        assert resumed["resumed_from"] == 3 and len(resumed["seen"]) == 3
        for (a, ca), (b, cb) in zip(resumed["seen"], full["seen"][3:]):
            assert torch.equal(a, b) and torch.equal(ca, cb)
        assert resumed["digests"] == full["digests"]


def test_a_checkpoint_of_another_number_of_workers_is_refused(two_ranks):
    from atlaslab.train.loop import _rank_data_state
    root, _ = two_ranks
    data = torch.load(root / "mid" / "checkpoint.pt", weights_only=True)["data"]
    assert [d["shard"] for d in data["ranks"]] == [[0, 2], [1, 2]]

    class Three:
        rank, world_size = 0, 3
    with pytest.raises(ConfigError, match=r"resources\.workers_per_trial: .* read by 2 workers"):
        _rank_data_state(data, Three())
    with pytest.raises(ConfigError, match=r"read by one process"):
        _rank_data_state(data["ranks"][0], Three())
    task = build_task(_node(root))
    task.shard_stream(1, 2)
    with pytest.raises(ConfigError, match=r"rank 0 of 2's .* rank 1 of 2"):
        task.load_data_state(data["ranks"][0])
