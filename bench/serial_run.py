"""An experiment's grid trained without Ray, one trial after another in this process, into a run folder with the
same report files as ``atlaslab run`` (``report.md``, ``report.csv``, ``trials.csv``, ``curves.csv``,
``results.json``).

    python bench/serial_run.py experiments/quickstart.yaml 'seeds=[1,2]' --run-dir runs/table6_s12 [--part 0/2]

For a machine where Ray cannot start (its raylet must register within 30 s, which an overloaded machine can miss).
Each trial is built and trained as its Ray trial would be: the driver's validated trial (:func:`prepare`),
:func:`atlaslab.search.build.build_trial` (the model seeded with ``train.seed``), ``torch.set_num_threads`` of
``resources.cpus_per_trial``, :func:`atlaslab.train.loop.train`, then the trial's ``eval.lm_eval`` tasks. The
numbers are the ones a Ray trial computes; only the learning curve is finer (every logged step, where Tune keeps
one report per evaluation). ``--part i/n`` trains every n-th trial from the i-th, so n processes can share a grid;
``--merge`` joins their ``results.json`` into one report.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from atlaslab.search.build import build_trial, lm_eval_after_training, lm_eval_node
from atlaslab.search.driver import prepare
from atlaslab.search.report import write_report
from atlaslab.search.results import PLACE_KEYS
from atlaslab.train.loop import train


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def record(trial, threads: int):
    """Train one trial; its record in the driver's ``results.json`` shape."""
    torch.set_num_threads(threads)
    task, tcfg, model = build_trial(trial)
    res = train(model, task, tcfg)
    metrics = dict(res.metrics)
    metrics.update(lm_eval_after_training(res, task, lm_eval_node(trial)))
    metrics["step"] = res.steps
    info = dict(trial.get("info") or {})
    rec = {k: trial[k] for k in PLACE_KEYS if k in trial}
    rec.update({"status": res.status, "failed": bool(res.diverged), "message": res.message,
                "metrics": {k: _finite(v) for k, v in metrics.items()},
                "history": [{k: _finite(v) for k, v in h.items()} for h in res.history],
                "info": {k: v for k, v in info.items() if k not in ("train", "task")},
                "train": info.get("train") or trial["config"].get("train"), "task": trial["config"].get("task")})
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--part", default="0/1", help="i/n: train trials i, i+n, i+2n, ...")
    ap.add_argument("--merge", nargs="*", help="run folders of the parts to join into --run-dir's report")
    args = ap.parse_args()
    p = prepare(args.experiment, args.overrides)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf
    OmegaConf.save(OmegaConf.create(p.node), run_dir / "experiment.yaml")
    if args.merge is not None:
        recs = [r for d in args.merge for r in json.loads((Path(d) / "results.json").read_text())]
        recs.sort(key=lambda r: r.get("index", 0))
    else:
        i, n = map(int, args.part.split("/"))
        threads = max(1, int(p.exp.resources.cpus_per_trial))
        t0, recs = time.time(), []
        for t in p.trials[i::n]:
            recs.append(record(t, threads))
            print(f"{t['key']} {t['row']} seed {t['seed']}: {recs[-1]['status']} "
                  f"{p.exp.metric}={recs[-1]['metrics'].get(p.exp.metric)}", flush=True)
        (run_dir / "state.json").write_text(json.dumps({"wall_s": time.time() - t0, "command": "bench/serial_run.py "
                                                        + " ".join([args.experiment, *args.overrides])}))
    (run_dir / "results.json").write_text(json.dumps(recs, default=str))
    write_report(run_dir, p.exp, recs, {})


if __name__ == "__main__":
    main()
