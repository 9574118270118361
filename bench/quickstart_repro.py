"""Does the quickstart reproduce to the digit on another machine? One quickstart trial, trained in this process
(no Ray) exactly as its Ray trial trains it, printed as one JSON line with its final metrics at full precision.

    python bench/quickstart_repro.py "Titans (LMM)" --threads 1 >> docs/results/quickstart/data/machines.jsonl
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/quickstart_repro.py "Titans (LMM)" --threads 1

A Ray trial of the quickstart builds its model with ``torch.manual_seed(train.seed)`` and trains on
``resources.cpus_per_trial`` threads (1); so does this script, with ``--threads``. What a machine can change is
then the arithmetic itself: PyTorch and MKL pick their kernels by the CPU's instruction set (AVX-512, AVX2, ...)
and by the thread count, and two kernels may round a sum differently in its last bits. ``ATEN_CPU_CAPABILITY`` and
``MKL_ENABLE_INSTRUCTIONS`` make this machine use the kernels of a CPU without AVX-512, so one machine can show
what another would print. The line records the capability PyTorch used, the thread count, the training loss at
the first logged steps (where a rounding difference first shows) and the final test accuracies.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from atlaslab.search.build import build_trial
from atlaslab.search.driver import prepare
from atlaslab.train.loop import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row", help='a quickstart row, e.g. "Titans (LMM)"')
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a Ray trial uses cpus_per_trial)")
    ap.add_argument("--experiment", default="experiments/quickstart.yaml")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = prepare(args.experiment, [])
    trial = next(t for t in p.trials if t["row"] == args.row)
    task, tcfg, model = build_trial(trial)
    res = train(model, task, tcfg)
    loss = {h["step"]: h["train/loss"] for h in res.history if "train/loss" in h}
    print(json.dumps({
        "row": args.row, "threads": args.threads, "capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""), "torch": torch.__version__,
        "status": res.status, "steps": res.steps, "test/accuracy": res.metrics.get("test/accuracy"),
        "test/len_32/accuracy": res.metrics.get("test/len_32/accuracy"),
        "loss": {k: loss[k] for k in sorted(loss)[:3] + sorted(loss)[-1:]},
        "val": [(h["step"], h["val/accuracy"]) for h in res.history if "val/accuracy" in h]}))


if __name__ == "__main__":
    main()
