"""Which compute block the chunked engine's online linear rules (DeltaNet, Gated DeltaNet) should default to.

    python bench/block_size.py            # → bench/results/block_size_cpu.{json,md}
    python bench/block_size.py --render   # the markdown again from the committed JSON (or bench/render_results.py)

The block (``memorize(..., block_size=L)``, ``atlaslab.engines.linear_delta``) changes the result only by rounding;
it trades the L² and L³ work inside a block against the number of sequential block-to-block steps. Measured in one
process with one torch thread, every block size interleaved with the others (so machine load moves them alike),
best of the repeats in process CPU seconds, forward + backward:

- the memory call alone on bench/gdn_vs_fla.py's inputs (Gated DeltaNet, B 2, H 4, ℓ2-normalised q, k, constant
  gates), at D ∈ {32, 64, 128} and T ∈ {512, 2048};
- a training step of the DeltaNet and Gated DeltaNet presets at the learning bench's calibration size (d_model 64,
  2 layers, T 64, batch 64) and at T 256 (batch 16).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NAME = "block_size_cpu"
BLOCKS = (16, 32, 64, 128)
MEMORY_SHAPES = [(D, T) for D in (32, 64, 128) for T in (512, 2048)]
STEP_CASES = [("deltanet", 64, 64), ("gated_deltanet", 64, 64), ("deltanet", 16, 256), ("gated_deltanet", 16, 256)]
REPEATS = 5


def _interleaved(fns: Dict[int, Any], repeats: int) -> Dict[int, float]:
    """Best process-CPU seconds of each block's function, the blocks interleaved (one warm-up each first)."""
    for fn in fns.values():
        fn()
    times: Dict[int, List[float]] = {b: [] for b in fns}
    for _ in range(repeats):
        for b, fn in fns.items():
            t = time.process_time()
            fn()
            times[b].append(time.process_time() - t)
    return {b: min(v) for b, v in times.items()}


def measure(repeats: int = REPEATS) -> Dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    import atlaslab.engines.linear_delta as ld
    from atlaslab import build_memory, memorize
    from atlaslab.models.presets import build_model, load_preset
    spec = {"memory": {"name": "linear", "init": "zeros"}, "retention": {"name": "decay", "placement": "before_step"}}
    rows: List[Dict[str, Any]] = []
    for D, T in MEMORY_SHAPES:
        parts = build_memory(spec, 4, D, D)
        torch.manual_seed(0)
        leaves = [torch.randn(2, T, 4, D) for _ in range(3)] + [torch.full((2, T, 4), 0.1), torch.full((2, T, 4), 0.9)]

        def call(L, leaves=leaves, parts=parts):
            q, k, v, eta, alpha = [x.clone().requires_grad_() for x in leaves]
            o = memorize(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), v, parts,
                         {"lr": eta, "retention": alpha}, mode="chunked", chunk_size=1, block_size=L)[0]
            o.sum().backward()
        best = _interleaved({L: (lambda L=L: call(L)) for L in BLOCKS}, repeats)
        rows.append({"case": "memory", "D": D, "T": T, "seconds": {str(b): s for b, s in best.items()},
                     "default": ld.default_block(D), "load_average": os.getloadavg()[0]})
        print(rows[-1], file=sys.stderr, flush=True)
    default = ld.default_block
    try:
        for preset, batch, T in STEP_CASES:
            torch.manual_seed(0)
            model = build_model(load_preset(preset, ["vocab_size=128", "d_model=64", "num_layers=2"]))
            ids = torch.randint(0, 128, (batch, T + 1))
            key_dim = 64 // 4                                          # d_model 64, the presets' 4 heads

            def step(L, model=model, ids=ids):
                ld.default_block = lambda K, L=L: L
                model.zero_grad(set_to_none=True)
                model.loss(ids).backward()
            best = _interleaved({L: (lambda L=L: step(L)) for L in BLOCKS}, repeats)
            rows.append({"case": "step", "preset": preset, "batch": batch, "T": T, "key_dim": key_dim,
                         "seconds": {str(b): s for b, s in best.items()}, "default": default(key_dim),
                         "load_average": os.getloadavg()[0]})
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        ld.default_block = default
    return {"command": "python bench/block_size.py", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "blocks": list(BLOCKS), "repeats": repeats,
            "default": f"the key dimension within [{ld.BLOCK_MIN}, {ld.BLOCK_MAX}]", "rows": rows}


def render(res: Dict[str, Any]) -> str:
    blocks = [str(b) for b in res["blocks"]]
    lines = ["# The chunked engine's block for the online linear rules (CPU)", "",
             f"Command: `{res['command']}` ({res['machine']}, torch {res['torch']}, one thread). Process CPU seconds, "
             f"forward + backward, best of {res['repeats']} with every block interleaved in one process; each row's "
             f"fastest block in bold; the engine's default block: {res['default']}.", "",
             "| case | " + " | ".join(f"block {b} (s)" for b in blocks) + " | default block | default / fastest |",
             "|---|" + "---|" * (len(blocks) + 2)]
    for r in res["rows"]:
        label = (f"Gated DeltaNet memory, D {r['D']}, T {r['T']}" if r["case"] == "memory"
                 else f"{r['preset']} training step, batch {r['batch']}, T {r['T']} (D_k {r['key_dim']})")
        secs = r["seconds"]
        fastest = min(blocks, key=lambda b: secs[b])
        cells = [f"**{secs[b]:.4f}**" if b == fastest else f"{secs[b]:.4f}" for b in blocks]
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {r['default']} | {secs[str(r['default'])] / secs[fastest]:.2f} |")
    loads = [r["load_average"] for r in res["rows"]]
    lines += ["", f"1-minute load average during the run: {min(loads):.1f}-{max(loads):.1f} on 2 cores (the blocks of a "
              "row are interleaved, so load moves them alike)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    path = RESULTS / f"{NAME}.json"
    res = json.loads(path.read_text()) if args.render else measure(args.repeats)
    if not args.render:
        path.write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / f"{NAME}.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
