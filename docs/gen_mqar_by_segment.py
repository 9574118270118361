"""Test accuracy of trained MQAR checkpoints split by where the query is: tokens 0–15, 16–31, … (one column per
segment of ``--segment`` tokens). The reading-list page's "accuracy by the query's segment" table.

    python docs/gen_mqar_by_segment.py runs/rlist_long/ray/tune/t000/checkpoint_000030/checkpoint.pt ...

A finished trial keeps its last checkpoint in ``<run>/ray/tune/<trial>/checkpoint_<n>/`` (the highest n). The task
is rebuilt from the checkpoint's own task config, with ``eval_position_span = --segment``, so the test split is the
one the trial was scored on and the columns are the task's ``accuracy/pos_<a>_<b>`` metrics. A new run gets the same
numbers in its trial records by setting ``task.eval_position_span`` in its experiment file.
"""
from __future__ import annotations

import argparse
from typing import List, Tuple

import torch

from atlaslab.models.lm import LanguageModel
from atlaslab.tasks import build_task


def accuracy_by_segment(checkpoint: str, segment: int = 16, examples: int = 512) -> Tuple[float, List[float]]:
    """``(overall, [accuracy per segment that holds queries])`` on the test split."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = LanguageModel(ckpt["model_config"])        # a synthetic task has no tokenizer, so not load_trained
    model.load_state_dict(ckpt["model"])
    task = build_task({**ckpt["task"], "eval_position_span": segment})
    m = task.evaluate(model, split="test", n_examples=examples)
    spans = sorted((int(k.split("_")[1]), v) for k, v in m.items() if k.startswith("accuracy/pos_"))
    return m["accuracy"], [v for _, v in spans]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--segment", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for path in args.checkpoints:
        overall, acc = accuracy_by_segment(path, args.segment)
        print(f"{path}: overall {overall:.3f}; by segment {', '.join(f'{a:.3f}' for a in acc)}")


if __name__ == "__main__":
    main()
