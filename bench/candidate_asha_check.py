"""What ``scheduler: candidate_asha`` saves on a small multi-task search, and whether it stops a candidate that the full
budget ranks in the top 3.

    RAY_ADDRESS=local python bench/candidate_asha_check.py --out /tmp/cand-check [--samples 12 --steps 100]

Runs one tiny search twice on the same draws (the random sampler, seed 0: Optuna draws the same points whatever it is
told): with ``candidate_asha`` and with no scheduler (every candidate trained to the end on every setting). Prints
and writes ``<out>/summary.json``: the steps each run trained (the sum over its trials of the last step), the
fraction saved, the candidates ranked by their full-budget score, which of them candidate_asha stopped and at which
rung, and whether one of the full budget's top 3 is among them. One trial at a time (``max_concurrent: 1``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ADDRESS", "local")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlaslab.search.driver import prepare, run  # noqa: E402
from atlaslab.search.fitness import candidates, ranked_candidates  # noqa: E402

MEM = "model.mixers.gated_deltanet.memory."


def experiment(name: str, scheduler: dict, samples: int, steps: int, interval: int, examples: int = 64) -> dict:
    """A two-setting search (MQAR, MAD in-context recall) over the learning rate, the retention and the inner
    optimizer of a tiny Gated DeltaNet."""
    return {
        "name": name,
        "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
        "tasks": {"mqar": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2],
                           "eval_examples": examples},
                  "recall": {"name": "in_context_recall", "vocab_size": 16, "seq_len": 16, "num_train_examples": 512,
                             "eval_examples": examples}},
        "eval": {"interval": interval, "examples": examples},
        "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "log_interval": interval},
        "search": {"sampler": "random", "seed": 0,
                   "space": {"train.lr": {"type": "float", "low": 3e-4, "high": 3e-2, "log": True},
                             MEM + "retention.name": ["decay", "none"],
                             MEM + "inner_optimizer.name": ["gd", "momentum"]}},
        "num_samples": samples, "max_concurrent": 1, "scheduler": scheduler, "tracking": {"enabled": False},
        "metric": "val/accuracy", "mode": "max",
    }


def trained_steps(records) -> int:
    return sum(int((r.get("metrics") or {}).get("step") or 0) for r in records)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--grace", type=int, default=10)
    ap.add_argument("--rf", type=float, default=3.0)
    ap.add_argument("--examples", type=int, default=64, help="validation examples per setting")
    ap.add_argument("--full-from", default="", help="a run folder of the full budget to reuse (the same search with "
                    "scheduler none, e.g. <an earlier --out>/full) instead of running it again")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for label, sched in (("candidate_asha", {"name": "candidate_asha", "grace_period": args.grace,
                                             "reduction_factor": args.rf}),
                         ("full", {"name": "none"})):
        p = prepare(node=experiment(f"check_{label}", sched, args.samples, args.steps, args.interval,
                                  args.examples))
        t0 = time.time()
        folder = out / label
        if label == "full" and args.full_from:
            folder = Path(args.full_from)
            summary = json.loads((folder / "state.json").read_text())
        else:
            summary = run(p, run_dir=folder, num_cpus=1, quiet=True)
        recs = json.loads((folder / "results.json").read_text())
        runs[label] = {"exp": p.exp, "records": recs, "wall_s": time.time() - t0, "status": summary["status"]}
        print(f"{label}: {summary['status']}, {len(recs)} trials, {trained_steps(recs)} steps, "
              f"{time.time() - t0:.0f} s", flush=True)
    exp = runs["full"]["exp"]
    full = ranked_candidates(exp, candidates(exp, runs["full"]["records"]))
    cands_asha = {c["key"]: c for c in candidates(exp, runs["candidate_asha"]["records"])}
    rec = json.loads((out / "candidate_asha" / "candidate_rungs.json").read_text())
    params_full = {c["key"]: c["params"] for c in full}
    for key, c in cands_asha.items():   # the same draws in both runs
        assert key not in params_full or c["params"] == params_full[key], (key, c["params"], params_full[key])
    stopped = {k: v for k, v in rec["candidates"].items() if v["status"] == "stopped"}
    ranking = []
    for rank, c in enumerate(full, 1):
        st = rec["candidates"].get(c["key"], {})
        ranking.append({"rank": rank, "candidate": c["key"], "full_score": c["metrics"].get(exp.metric),
                        "full_status": c["status"], "asha_status": cands_asha.get(c["key"], {}).get("status"),
                        "asha_score": cands_asha.get(c["key"], {}).get("metrics", {}).get(exp.metric),
                        "stopped_at": (max(int(k) for k in st.get("scores", {})) if c["key"] in stopped else None),
                        "rung_scores": st.get("scores", {})})
    s_asha, s_full = trained_steps(runs["candidate_asha"]["records"]), trained_steps(runs["full"]["records"])
    top3_stopped = [r["candidate"] for r in ranking[:3] if r["candidate"] in stopped]
    summary = {"samples": args.samples, "steps": args.steps, "examples": args.examples, "interval": args.interval,
               "grace_period": args.grace,
               "reduction_factor": args.rf, "rungs": rec["rungs"], "steps_candidate_asha": s_asha,
               "steps_full": s_full, "fraction_trained": s_asha / s_full if s_full else None,
               "stopped": sorted(stopped), "top3_stopped": top3_stopped,
               "wall_s": {k: round(v["wall_s"], 1) for k, v in runs.items()},
               "status": {k: v["status"] for k, v in runs.items()}, "ranking": ranking}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "ranking"}, indent=1))
    for r in ranking:
        print(f"{r['rank']:>3} {r['candidate']} full {r['full_score']} ({r['full_status']}) | candidate_asha "
              f"{r['asha_status']} {'stopped at ' + str(r['stopped_at']) if r['stopped_at'] else ''} "
              f"{r['rung_scores']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
