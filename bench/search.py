"""Benchmark: the search driver's parallel efficiency and its per-trial Ray + MLflow overhead (CPU).

    python bench/search.py                  # parallel efficiency + overhead (~8 minutes on 2 CPU cores)
    python bench/search.py --trials 4 --steps 60   # quicker
    python bench/search.py --asha           # also: ASHA vs the full grid on hpo_atlas's space (long)
    python bench/render_results.py bench/results/search_cpu.json   # rewrite the .md from the .json only

Eight equal trials (a tiny Gated DeltaNet on MQAR, fixed steps, one CPU each) are run

1. ``plain``    — in this process, one after another, with the training loop alone (no Ray, no MLflow);
2. ``seq``      — through ``atlaslab run`` with ``max_concurrent: 1`` (Ray Tune + MLflow, sequential);
3. ``seq_nomlf``— the same without MLflow (``tracking.enabled: false``);
4. ``par``      — through ``atlaslab run`` with ``max_concurrent: 2`` on a 2-CPU local Ray.

Parallel efficiency = fit time of ``seq`` / (2 × fit time of ``par``); per-trial overhead = (fit time of ``seq``
− ``plain``) / trials, split into Ray's share (``seq_nomlf`` − ``plain``) and MLflow's (``seq`` − ``seq_nomlf``);
the fixed costs (Ray start, MLflow store set-up, shutdown, report) are the driver's timings. The machine is
shared, so its load average is recorded with every number. ``--asha`` runs hpo_atlas's search space twice at
reduced size: every point of a small categorical grid (inner optimiser × window × polynomial degree) to the end,
then the same points under ASHA, and compares the best validation accuracy and the optimiser steps spent. Writes bench/results/search_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))


def tiny_experiment(name: str, trials: int, steps: int, concurrent: int, mlflow: bool = True) -> dict:
    return {
        "name": name,
        "model": {"preset": "gated_deltanet", "overrides": {"d_model": 32, "mixers.*.num_heads": 4}},
        "task": {"name": "mqar", "vocab_size": 64, "seq_len": 64, "num_kv_pairs": [4], "eval_examples": 128},
        "eval": {"interval": max(1, steps // 4), "examples": 128},
        "train": {"steps": steps, "batch_size": 32, "lr": 3e-3},
        "seeds": list(range(trials)),                 # equal trials: the same model, different seeds
        "grid": {"variants": {"GDN": {}}},
        "max_concurrent": concurrent,
        "resources": {"cpus_per_trial": 1},
        "tracking": {"enabled": mlflow},
    }


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run_plain(node: dict) -> dict:
    """The same trials in this process, sequentially, with the training loop only."""
    import torch

    from atlaslab.models.presets import build_model
    from atlaslab.search.driver import prepare
    from atlaslab.search.expand import model_config
    from atlaslab.tasks.base import build_task
    from atlaslab.train import train
    torch.set_num_threads(1)
    p = prepare(node=node)
    t0, l0 = time.time(), load()
    for t in p.trials:
        cfg = t["config"]
        task = build_task(cfg["task"])
        torch.manual_seed(t["seed"])
        model = build_model(model_config(cfg["model"], task.vocab_size))
        train(model, task, cfg["train"])
    return {"wall_s": time.time() - t0, "load_before": l0, "load_after": load()}


def run_driver(node: dict, num_cpus: int) -> dict:
    from atlaslab.search.driver import prepare, run
    p = prepare(node=node)
    with tempfile.TemporaryDirectory(prefix="bench-search-") as d:
        l0 = load()
        t0 = time.time()
        summary = run(p, run_dir=Path(d) / "run", num_cpus=num_cpus, quiet=True)
        wall = time.time() - t0
        state = json.loads((Path(d) / "run" / "state.json").read_text())
        recs = json.loads((Path(d) / "run" / "results.json").read_text())
    setup = [r["metrics"].get("setup_s") for r in recs if r["metrics"].get("setup_s") is not None]
    spans = [(r["metrics"]["t_start"], r["metrics"]["t_end"]) for r in recs if "t_end" in r["metrics"]]
    return {"wall_s": wall, "timings": state.get("timings", {}), "failed": summary["failed"],
            "trial_setup_s_mean": sum(setup) / max(1, len(setup)), "trial_setup_s": setup,
            "max_overlap": max_overlap(spans), "load_before": l0, "load_after": load()}


def max_overlap(spans) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def bench_parallel(trials: int, steps: int) -> dict:
    out = {}
    out["plain"] = run_plain(tiny_experiment("bench_plain", trials, steps, 1, mlflow=False))
    print("plain", out["plain"], flush=True)
    out["seq"] = run_driver(tiny_experiment("bench_seq", trials, steps, 1), num_cpus=2)
    print("seq", out["seq"]["timings"], flush=True)
    out["seq_nomlf"] = run_driver(tiny_experiment("bench_seq_nomlf", trials, steps, 1, mlflow=False), num_cpus=2)
    print("seq_nomlf", out["seq_nomlf"]["timings"], flush=True)
    out["par"] = run_driver(tiny_experiment("bench_par", trials, steps, 2), num_cpus=2)
    print("par", out["par"]["timings"], flush=True)
    out["summary"] = parallel_summary(out, trials, steps)
    return out


def parallel_summary(out: dict, trials: int, steps: int) -> dict:
    """Efficiency and overheads from the four runs' timings (``out``: plain, seq, seq_nomlf, par)."""
    fit = {k: out[k]["timings"]["fit_s"] for k in ("seq", "seq_nomlf", "par")}
    return {
        "trials": trials, "steps": steps,
        "parallel_efficiency": fit["seq"] / (2 * fit["par"]),
        "speedup_par_vs_seq": fit["seq"] / fit["par"],
        "per_trial_overhead_s": (fit["seq"] - out["plain"]["wall_s"]) / trials,
        "per_trial_overhead_ray_s": (fit["seq_nomlf"] - out["plain"]["wall_s"]) / trials,
        "per_trial_overhead_mlflow_s": (fit["seq"] - fit["seq_nomlf"]) / trials,
        "plain_per_trial_s": out["plain"]["wall_s"] / trials,
        "fixed_overhead_s": {k: v for k, v in out["seq"]["timings"].items() if k != "fit_s"},
        "max_concurrent_trials_observed": out["par"]["max_overlap"],
    }


def bench_asha(steps: int) -> dict:
    """hpo_atlas's model and task, with its space reduced to a categorical grid (optimiser × window × degree):
    every point trained to the end vs the same points under ASHA."""
    import yaml

    from atlaslab.search.driver import prepare, run
    base = yaml.safe_load((ROOT / "experiments" / "hpo_atlas.yaml").read_text())
    base["train"]["steps"] = steps
    base["eval"]["interval"] = max(1, steps // 6)
    opt = "model.mixers.atlas.memory."
    space = {opt + "inner_optimizer.name": ["muon", "gd"], opt + "window.size": [1, 4],
             opt + "feature_map.degree": [1, 2]}
    grid = copy.deepcopy(base)
    grid.pop("search")
    grid.pop("num_samples")
    grid["scheduler"] = {"name": "none"}
    grid["grid"] = {"axes": space}
    asha = copy.deepcopy(grid)             # the same 8 points, with ASHA stopping the weak ones early
    asha["scheduler"] = {"name": "asha", "grace_period": max(1, steps // 6), "reduction_factor": 3}
    out = {}
    for name, node in (("grid", grid), ("asha", asha)):
        with tempfile.TemporaryDirectory(prefix="bench-asha-") as d:
            t0 = time.time()
            run(prepare(node=node), run_dir=Path(d) / "run", num_cpus=2, quiet=True)
            recs = json.loads((Path(d) / "run" / "results.json").read_text())
        best = max((r["metrics"].get("val/accuracy") or 0.0) for r in recs)
        out[name] = {"wall_s": time.time() - t0, "best_val_accuracy": best,
                     "steps": sum(int(r["metrics"].get("step") or 0) for r in recs), "trials": len(recs)}
        print(name, out[name], flush=True)
    out["summary"] = asha_summary(out)
    return out


def asha_summary(out: dict) -> dict:
    """ASHA's share of the grid's optimiser steps, and whether it kept the grid's best (``out``: grid, asha)."""
    return {"steps_ratio": out["asha"]["steps"] / max(1, out["grid"]["steps"]),
            "asha_reaches_grid_best": out["asha"]["best_val_accuracy"] >= out["grid"]["best_val_accuracy"] - 1e-9}


def write(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "search_cpu.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "search_cpu.md").write_text(render(results))


def render(results: dict) -> str:
    """bench/results/search_cpu.md from the raw record of :func:`main` (``search_cpu.json``) alone: the summaries
    are recomputed from the runs' timings."""
    p = results["parallel"]
    s = parallel_summary(p, p["summary"]["trials"], p["summary"]["steps"])
    lines = ["# Search driver on CPU: parallel efficiency and per-trial overhead", "",
             f"`{' '.join(['python bench/search.py'] + results['argv'])}` on {results['machine']} "
             f"({results['cpus']} CPUs, shared: load average recorded per run), Ray {results['ray']}, "
             f"MLflow {results['mlflow']} (SQLite), torch {results['torch']}.", "",
             f"{s['trials']} equal trials (tiny Gated DeltaNet on MQAR, {s['steps']} steps, 1 CPU each).", "",
             "| run | what | wall of the trials (s) | load avg before → after |", "|---|---|---|---|",
             f"| plain | training loop in one process, sequential | {p['plain']['wall_s']:.1f} | "
             f"{p['plain']['load_before']} → {p['plain']['load_after']} |",
             f"| seq | Ray Tune + MLflow, 1 at a time | {p['seq']['timings']['fit_s']:.1f} | "
             f"{p['seq']['load_before']} → {p['seq']['load_after']} |",
             f"| seq_nomlf | Ray Tune, no MLflow, 1 at a time | {p['seq_nomlf']['timings']['fit_s']:.1f} | "
             f"{p['seq_nomlf']['load_before']} → {p['seq_nomlf']['load_after']} |",
             f"| par | Ray Tune + MLflow, 2 at a time on 2 CPUs | {p['par']['timings']['fit_s']:.1f} | "
             f"{p['par']['load_before']} → {p['par']['load_after']} |", "",
             f"- **parallel efficiency** (seq / (2 × par)): **{s['parallel_efficiency']:.2f}** "
             f"(speed-up {s['speedup_par_vs_seq']:.2f}×; at most {s['max_concurrent_trials_observed']} trials "
             "were seen running at once)",
             f"- **per-trial overhead** of Ray + MLflow: **{s['per_trial_overhead_s']:.2f} s** per trial "
             f"(Ray {s['per_trial_overhead_ray_s']:.2f} s, MLflow {s['per_trial_overhead_mlflow_s']:.2f} s) on top "
             f"of {s['plain_per_trial_s']:.2f} s of training; inside a trial, start-up (imports, MLflow run, model "
             f"build) took {p['seq']['trial_setup_s_mean']:.2f} s on average (reused workers skip the imports)",
             "- **fixed cost per experiment**: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["fixed_overhead_s"].items()),
             "",
             "The machine is shared with other work: an efficiency above 1 (or a negative overhead) means the load "
             "fell between runs; compare the load averages.", ""]
    if "asha" in results:
        a = {**results["asha"], "summary": asha_summary(results["asha"])}
        lines += ["## ASHA vs the full grid (hpo_atlas's model and task; space reduced to optimiser × window × "
                  "degree)", "",
                  "| run | trials | optimiser steps | best val/accuracy | wall (s) |", "|---|---|---|---|---|",
                  f"| grid | {a['grid']['trials']} | {a['grid']['steps']} | {a['grid']['best_val_accuracy']:.3f} | "
                  f"{a['grid']['wall_s']:.0f} |",
                  f"| grid + ASHA | {a['asha']['trials']} | {a['asha']['steps']} | "
                  f"{a['asha']['best_val_accuracy']:.3f} | {a['asha']['wall_s']:.0f} |", "",
                  f"ASHA spent {a['summary']['steps_ratio']:.2f} of the grid's steps; reached the grid's best: "
                  f"{a['summary']['asha_reaches_grid_best']}.", ""]
    else:
        lines += ["ASHA vs grid on hpo_atlas: not run (`--asha`; ATLAS with Muon costs ~1 s per step on one CPU "
                  "core, so the full grid alone takes tens of minutes on 2 cores).", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--asha", action="store_true")
    ap.add_argument("--asha-steps", type=int, default=150)
    ap.add_argument("--keep-parallel", action="store_true",
                    help="reuse the parallel-efficiency numbers of bench/results/search_cpu.json (with --asha)")
    args = ap.parse_args(argv)
    import mlflow
    import ray
    import torch
    results = {"argv": list(argv if argv is not None else sys.argv[1:]), "machine": platform.platform(),
               "cpus": os.cpu_count(), "ray": ray.__version__, "mlflow": mlflow.__version__,
               "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    old = RESULTS / "search_cpu.json"
    if args.keep_parallel and old.is_file():
        prev = json.loads(old.read_text())
        results["parallel"] = prev["parallel"]
        results["argv"] = prev.get("argv", []) + results["argv"]
    else:
        results["parallel"] = bench_parallel(args.trials, args.steps)
    if args.asha:
        results["asha"] = bench_asha(args.asha_steps)
    write(results)
    print((RESULTS / "search_cpu.md").read_text())


if __name__ == "__main__":
    main()
