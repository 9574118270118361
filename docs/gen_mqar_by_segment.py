"""Test accuracy of trained MQAR checkpoints split by where the query is: tokens 0–15, 16–31, … (one column per
segment of ``--segment`` tokens). The reading-list page's "accuracy by the query's segment" table.

    python docs/gen_mqar_by_segment.py runs/rlist_long/ray/tune/t000/checkpoint_000030/checkpoint.pt ...

A finished trial keeps its last checkpoint in ``<run>/ray/tune/<trial>/checkpoint_<n>/`` (the highest n). The task
is rebuilt from the checkpoint's own task config, so the test split is the one the trial was scored on.
"""
from __future__ import annotations

import argparse

import torch

from atlaslab.models.lm import LanguageModel
from atlaslab.tasks import build_task


def accuracy_by_segment(checkpoint: str, segment: int = 16, examples: int = 512):
    """``(overall, [accuracy per segment], [share of the queries per segment])`` on the test split."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = LanguageModel(ckpt["model_config"])        # a synthetic task has no tokenizer, so not load_trained
    model.load_state_dict(ckpt["model"])
    model.eval()
    task = build_task(ckpt["task"])
    T = task.seq_len
    n = -(-T // segment)
    hit, total = torch.zeros(n), torch.zeros(n)
    with torch.no_grad():
        for batch in task.eval_batches("test", examples, 64):
            pred = model(batch.inputs).argmax(-1)
            scored = batch.targets >= 0
            where = (torch.arange(batch.targets.shape[1]) // segment).expand_as(batch.targets)
            for s in range(n):
                m = scored & (where == s)
                total[s] += m.sum()
                hit[s] += (pred[m] == batch.targets[m]).sum()
    return float(hit.sum() / total.sum()), (hit / total).tolist(), (total / total.sum()).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--segment", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for path in args.checkpoints:
        overall, acc, share = accuracy_by_segment(path, args.segment)
        print(f"{path}: overall {overall:.3f}; by segment {', '.join(f'{a:.3f}' for a in acc)}; "
              f"share of queries {', '.join(f'{s:.3f}' for s in share)}")


if __name__ == "__main__":
    main()
