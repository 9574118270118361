"""Where an ATLAS training step spends its time on CPU, beside the presets it is compared with.

    python bench/atlas_cost.py              # → bench/results/atlas_cost_cpu.{json,md}
    python bench/atlas_cost.py --batch 4    # smaller measured batch (times scale linearly in the batch)
    python bench/render_results.py bench/results/atlas_cost_cpu.json   # rewrite the .md from the .json only

One LM training step (forward + backward of ``LanguageModel.loss``) at the learning bench's calibration size
(d_model 64, 2 layers, 4 heads of dimension 16, vocabulary 128, T = 64), one torch thread, best of 2 after a
warm-up, measured side by side in one process. For ATLAS the torch profiler splits the step by operator, and
the labelled chunk-level variant (``ns_granularity: chunk`` with ``read: chunk``) shows what the per-token
Newton–Schulz costs. Seconds are process CPU seconds; "per 64-sequence step" scales the measured batch.

Each step's arithmetic is counted too (``torch.utils.flop_counter``: matmul-class operators, forward and backward),
and set beside what one thread does on a plain batched matmul of the shape that dominates ATLAS's Newton–Schulz
(the momentum of the first memory matrix, hidden 64 × 153 polynomial features, times its transpose). A step that
runs near that rate is bound by its arithmetic, which no engine change removes; one far below it is bound by
overhead (many small operators), which an engine can remove.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

RESULTS = Path(__file__).resolve().parent / "results"
BASE = ["vocab_size=128", "d_model=64", "num_layers=2"]
ROWS = {   # label: (preset, overrides)
    "atlas (per-token NS, the preset)": ("atlas", []),
    "atlas, ns_granularity chunk + read chunk (variant)": (
        "atlas", ["mixers.atlas.memory.inner_optimizer.ns_granularity=chunk", "mixers.atlas.memory.read=chunk"]),
    "atlas w/o Muon (GD)": ("atlas", ["mixers.atlas.memory.inner_optimizer={name: gd, lr: 0.1}"]),
    "omeganet": ("omeganet", []),
    "titans": ("titans", []),
    "gated_deltanet": ("gated_deltanet", []),
    "transformer": ("transformer", []),
}


def step_seconds(model, ids, repeats: int = 2) -> float:
    def once():
        model.zero_grad(set_to_none=True)
        t = time.process_time()
        model.loss(ids).backward()
        return time.process_time() - t
    once()
    return min(once() for _ in range(repeats))


def step_flops(model, ids) -> int:
    """Matmul-class floating-point operations of one training step (forward + backward)."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        model.loss(ids).backward()
    return counter.get_total_flops()


def matmul_rate(batch: int = 256, rows: int = 64, cols: int = 153, repeats: int = 5) -> float:
    """FLOP/s of one thread on ``bmm([batch, rows, cols], [batch, cols, rows])`` (Newton–Schulz's X Xᵀ)."""
    x = torch.randn(batch, rows, cols)
    torch.bmm(x, x.transpose(1, 2))
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        torch.bmm(x, x.transpose(1, 2))
        best = min(best, time.process_time() - t)
    return 2 * batch * rows * rows * cols / best


def operator_split(model, ids, top: int = 6):
    with torch.profiler.profile() as prof:
        model.loss(ids).backward()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "atlas_cost_cpu"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from atlaslab.models.presets import build_model, load_preset
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (args.batch, 65))
    rows, split = [], None
    for label, (preset, overrides) in ROWS.items():
        model = build_model(load_preset(preset, BASE + overrides))
        s = step_seconds(model, ids)
        flops = step_flops(model, ids)
        rows.append({"model": label, "seconds": s, "per_64": s * 64 / args.batch, "flops": flops,
                     "gflops_per_s": flops / s / 1e9, "state": model.state_size(64),
                     "params": model.num_parameters()})
        if split is None:
            split = operator_split(model, ids)
        print(f"{label}: {s:.2f} s per step at batch {args.batch}", flush=True)
    rate = matmul_rate() / 1e9
    out = {"batch": args.batch, "torch": torch.__version__, "machine": platform.machine(), "rows": rows,
           "bmm_gflops_per_s": rate,
           "atlas_operator_split": split, "command": f"python bench/atlas_cost.py --batch {args.batch}"}
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))
    Path(args.out + ".md").write_text(render(out))
    print(f"wrote {args.out}.md")


def render(out: dict) -> str:
    """bench/results/atlas_cost_cpu.md from the raw record of :func:`main` (``atlas_cost_cpu.json``) alone."""
    rows, batch, rate = out["rows"], out["batch"], out["bmm_gflops_per_s"]
    base = next(r for r in rows if r["model"] == "transformer")["seconds"]
    lines = ["# ATLAS step cost on CPU", "", f"Command: `{out['command']}` (torch {out['torch']}, one thread, "
             "process CPU seconds, best of 2 after a warm-up).", "",
             "One training step (forward + backward) at d_model 64, 2 layers, 4 heads of 16, T = 64, vocabulary 128.",
             "GFLOP = matmul-class operations of the step (forward + backward) at the measured batch; GFLOP/s = "
             f"GFLOP / seconds, beside {rate:.1f} GFLOP/s for one thread on a plain bmm of Newton–Schulz's "
             "X Xᵀ shape ([256, 64, 153] × [256, 153, 64]), measured in the same run. A row near that rate is "
             "bound by its arithmetic; one far below it by per-operator overhead. \"At the bmm rate\" is the time "
             "the step's arithmetic alone would take at that rate: a floor that no engine on this core goes below.",
             "", "| model | s / step (batch %d) | s / 64-sequence step | × transformer | 600 steps at batch 64 |"
             " GFLOP / step | GFLOP/s | 600 steps at batch 64, at the bmm rate | state (T = 64) |" % batch,
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['seconds']:.2f} | {r['per_64']:.1f} | {r['seconds'] / base:.0f} | "
                     f"{r['per_64'] * 600 / 3600:.1f} h | {r['flops'] / 1e9:.1f} | {r['gflops_per_s']:.1f} | "
                     f"{r['flops'] * 64 / batch * 600 / (rate * 1e9) / 3600:.1f} h | {r['state']:,} |")
    lines += ["", "ATLAS (the preset) by operator, share of the step's self CPU time:", "",
              "| operator | share | calls |", "|---|---|---|"]
    lines += [f"| {e['op']} | {e['share']:.0%} | {e['calls']} |" for e in out["atlas_operator_split"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
