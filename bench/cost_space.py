"""What a training step costs for every part choice the discovery search can make, before vs after an engine change.

    python bench/cost_space.py                        # → bench/results/cost_space_cpu.{json,md}
    python bench/cost_space.py --quick                # fewer rows, GDN shapes and trials (minutes)
    python bench/cost_space.py --baseline main        # "before" = the atlaslab package of git ref ``main``
    python bench/cost_space.py --render               # rewrite the .md from the committed .json

Side by side in one run: one long-lived worker process per side ("after" = this checkout's ``atlaslab``, "before"
= the package of ``--baseline``, unpacked with ``git archive`` into a temporary folder), each with one torch thread,
asked in turn for the same measurement (the order of the sides alternates between repeats). A time is the worker's
process CPU seconds of one step, best of the repeats after a warm-up: load from other processes only ever adds
time, so the best of interleaved repeats is the most robust ratio a shared machine gives (the load average at
start and end is written beside the numbers).

Rows:

- ``space``: one LM training step (forward + backward of ``LanguageModel.loss``) for the presets and for one part
  choice at a time off the ATLAS preset (memory depth, inner optimizer incl. Muon per token / per chunk, Omega
  window, feature-map degree, chunk size, read), at two sizes. GFLOP counts matmul-class operators
  (``torch.utils.flop_counter``, forward + backward); "× transformer" is the multiple of the Transformer preset's
  step at the same size, measured in the same run.
- ``gdn``: our chunked Gated DeltaNet (b = 1) against fla's plain-PyTorch ``naive_chunk_gated_delta_rule``
  (forward + backward, B 2, H 4, same inputs; needs ``python bench/peers.py --install``).
- ``trials``: trials per hour of a small discovery-like space on 2 cores: a trial is model build + ``TRIAL_STEPS``
  AdamW steps on MQAR-sized batches (quickstart size), two one-thread trials at a time; Ray / MLflow start-up
  (≈ 5 s per worker) and evaluation are not included.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

#: the two sizes: quickstart / discovery CPU scale, and the learning bench's calibration size (bench/atlas_cost.py)
SIZES = {
    "small": {"overrides": ["vocab_size=32", "d_model=32", "num_layers=1", "mixers.*.num_heads=4"],
              "batch": 32, "seq_len": 16, "vocab": 32, "label": "d_model 32, 1 layer, 4 heads of 8, T 16, batch 32"},
    "base": {"overrides": ["vocab_size=128", "d_model=64", "num_layers=2"],
             "batch": 4, "seq_len": 64, "vocab": 128, "label": "d_model 64, 2 layers, 4 heads of 16, T 64, batch 4"},
}
A = "mixers.atlas.memory."
#: (axis, label, preset, overrides): presets, then one part choice at a time off the ATLAS preset
ROWS = [
    ("preset", "transformer", "transformer", []),
    ("preset", "gated_deltanet", "gated_deltanet", []),
    ("preset", "titans", "titans", []),
    ("preset", "omeganet", "omeganet", []),
    ("preset", "atlas (per-token NS)", "atlas", []),
    ("preset", "atlas, NS per chunk + read chunk", "atlas",
     [A + "inner_optimizer.ns_granularity=chunk", A + "read=chunk"]),
    ("memory", "linear memory", "atlas", [A + "memory={name: linear}"]),
    ("memory", "mlp depth 1", "atlas", [A + "memory.depth=1"]),
    ("memory", "mlp depth 3", "atlas", [A + "memory.depth=3"]),
    ("optimizer", "gd", "atlas", [A + "inner_optimizer={name: gd, lr: 0.1}"]),
    ("optimizer", "momentum", "atlas", [A + "inner_optimizer={name: momentum, lr: 0.1}"]),
    # (Muon with NS per chunk and a per-token read is rejected by the config: not causal; see the preset row above)
    ("window", "omega c = 1", "atlas", [A + "window.size=1"]),
    ("window", "omega c = 16", "atlas", [A + "window.size=16"]),
    ("feature map", "identity", "atlas", [A + "feature_map={name: identity}"]),
    ("feature map", "polynomial degree 3", "atlas", [A + "feature_map.degree=3"]),
    ("chunk", "chunk 8", "atlas", [A + "chunk_size=8"]),
    ("chunk", "chunk 64", "atlas", [A + "chunk_size=64"]),
    ("read", "read chunk (NS per token)", "atlas", [A + "read=chunk"]),
]
QUICK_ROWS = {"transformer", "gated_deltanet", "titans", "omeganet", "atlas (per-token NS)",
              "atlas, NS per chunk + read chunk", "gd", "mlp depth 3", "omega c = 16", "chunk 64"}
#: degree-3 features of a 16-dim head (C(19, 3) = 969) under per-token NS: far outside a CPU study's budget
SKIP = {("base", "polynomial degree 3"): "969 features per head with per-token NS: minutes per step on one thread"}
GDN_SHAPES = [(D, T) for D in (32, 64, 128) for T in (512, 2048, 8192)]
GDN_QUICK = [(32, 512), (64, 2048), (128, 512)]
#: the small discovery-like space whose trials per hour are measured (the quickstart's variants)
TRIAL_ROWS = ["transformer", "gated_deltanet", "titans", "atlas (per-token NS)", "gd", "omega c = 1", "identity",
              "linear memory"]
QUICK_TRIAL_ROWS = ["transformer", "gated_deltanet", "titans", "atlas (per-token NS)", "gd", "identity"]
TRIAL_STEPS = 10


# ----------------------------------------------------------------------------------------------------- worker side
class Worker:
    """Runs in a child process with one torch thread; answers one JSON request per stdin line."""

    def __init__(self):
        import torch
        torch.set_num_threads(1)
        self.torch = torch
        self.cache = {}

    def _model(self, req):
        key = json.dumps([req["size"], req["preset"], req["overrides"]])
        if key not in self.cache:
            from atlaslab.models.presets import build_model, load_preset
            size = SIZES[req["size"]]
            self.torch.manual_seed(0)
            model = build_model(load_preset(req["preset"], size["overrides"] + req["overrides"]))
            ids = self.torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1))
            self.cache = {key: (model, ids)}          # one model alive at a time
        return self.cache[key]

    def step(self, req):
        model, ids = self._model(req)

        def once():
            model.zero_grad(set_to_none=True)
            t = time.process_time()
            model.loss(ids).backward()
            return time.process_time() - t

        if req.get("warm", True):
            once()
        return {"seconds": once()}

    def flops(self, req):
        from torch.utils.flop_counter import FlopCounterMode
        model, ids = self._model(req)
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as counter:
            model.loss(ids).backward()
        return {"flops": counter.get_total_flops(), "state": model.state_size(SIZES[req["size"]]["seq_len"]),
                "params": model.num_parameters()}

    def gdn(self, req):
        torch = self.torch
        B, T, H, D = 2, req["T"], 4, req["D"]
        if req["impl"] == "fla":
            sys.path.append(str(HERE / ".peers"))
            from peers import load_fla_naive
            naive = load_fla_naive().naive_chunk_gated_delta_rule
            fn = lambda q, k, v, eta, alpha: naive(q, k, v, alpha.log(), eta, chunk_size=64, scale=1.0)[0]
        else:
            from atlaslab import build_memory, memorize
            from peers import GDN_SPEC
            parts = build_memory(GDN_SPEC, H, D, D)
            fn = lambda q, k, v, eta, alpha: memorize(q, k, v, parts, {"lr": eta, "retention": alpha},
                                                      mode="chunked", chunk_size=1)[0]
        torch.manual_seed(0)
        leaves = [torch.randn(B, T, H, D) for _ in range(3)] + [torch.full((B, T, H), 0.1), torch.full((B, T, H), 0.9)]

        def once():
            xs = [x.clone().requires_grad_() for x in leaves]
            q, k, v, eta, alpha = xs
            t = time.process_time()
            o = fn(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), v, eta, alpha)
            o.sum().backward()
            return time.process_time() - t

        once()
        return {"seconds": once()}

    def trial(self, req):
        """Model build + TRIAL_STEPS AdamW steps at the small size (a discovery trial's training, no eval)."""
        torch = self.torch
        t = time.process_time()
        self.cache = {}
        model, ids = self._model({**req, "size": "small"})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(req["steps"]):
            batch = torch.randint(0, SIZES["small"]["vocab"], ids.shape, generator=gen)
            opt.zero_grad(set_to_none=True)
            model.loss(batch).backward()
            opt.step()
        self.cache = {}
        return {"seconds": time.process_time() - t}

    def bmm_rate(self, req):
        torch = self.torch
        x = torch.randn(256, 64, 153)
        torch.bmm(x, x.mT)
        best = float("inf")
        for _ in range(5):
            t = time.process_time()
            torch.bmm(x, x.mT)
            best = min(best, time.process_time() - t)
        return {"gflops_per_s": 2 * 256 * 64 * 64 * 153 / best / 1e9}

    def where(self, req):
        import atlaslab
        return {"atlaslab": atlaslab.__file__, "torch": self.torch.__version__}


def serve() -> None:
    worker = Worker()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = getattr(worker, req["op"])(req)
        except Exception as exc:   # reported to the driver, which records the row as skipped
            out = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------------- driver side
class Side:
    """A worker process whose ``atlaslab`` is the package under ``tree``."""

    def __init__(self, name: str, tree: Path):
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(HERE))
        self.info = self.ask({"op": "where"})

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker '{self.name}' died on {req}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def unpack(ref: str, into: Path) -> Path:
    """The ``atlaslab`` package (and the presets it loads) of git ``ref`` under ``into`` (git archive; no worktree is created)."""
    # the presets are package data (atlaslab/presets) since 2026-12-06; older refs keep them in experiments/presets
    old = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}:experiments/presets"],
                         capture_output=True).returncode == 0
    paths = ["atlaslab"] + (["experiments/presets"] if old else [])
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *paths], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def best_of(sides, req: dict, repeats: int, log) -> dict:
    """Interleaved repeats of ``req`` on every side (the order alternates); best (min) and all seconds per side."""
    times = {s.name: [] for s in sides}
    for r in range(repeats):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            out = s.ask({**req, "warm": r == 0})
            if "error" in out:
                return {s.name: {"error": out["error"]} for s in sides}
            times[s.name].append(out["seconds"])
    log(f"  {req.get('label', req)}: " + ", ".join(f"{n} {min(t):.3f}s" for n, t in times.items()))
    return {n: {"seconds": min(t), "all": t} for n, t in times.items()}


def run(args) -> dict:
    sizes = args.sizes or list(SIZES)
    rows = [r for r in ROWS if (not args.quick or r[1] in QUICK_ROWS) and (not args.only or r[1] in args.only)]
    if args.only and "transformer" not in args.only:
        rows.insert(0, ROWS[0])                      # every ratio needs the Transformer's step of the same run
    repeats = args.repeats or 3
    tmp = tempfile.TemporaryDirectory(prefix="cost_space_")
    sides = [Side("after", ROOT)]
    if args.baseline:
        sides.insert(0, Side("before", unpack(args.baseline, Path(tmp.name))))
    log = lambda m: print(m, file=sys.stderr, flush=True)
    load = {"start": os.getloadavg()}
    out = {"command": "python bench/cost_space.py" + (" --quick" if args.quick else "")
           + (f" --baseline {args.baseline}" if args.baseline else ""),
           "baseline": args.baseline, "baseline_commit": _commit(args.baseline) if args.baseline else None,
           "after_commit": _commit("HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
           "sides": {s.name: s.info for s in sides}, "torch_threads": 1, "cpus": os.cpu_count(),
           "machine": platform.processor() or platform.machine(), "repeats": repeats, "sizes": {}, "space": [],
           "gdn": [], "trials": None, "trial_steps": TRIAL_STEPS}
    try:
        out["bmm_gflops_per_s"] = sides[-1].ask({"op": "bmm_rate"})["gflops_per_s"]
        for size in sizes:
            out["sizes"][size] = SIZES[size]["label"]
            for axis, label, preset, overrides in rows:
                row = {"size": size, "axis": axis, "label": label, "preset": preset, "overrides": overrides}
                if (size, label) in SKIP:
                    out["space"].append({**row, "skipped": SKIP[(size, label)]})
                    continue
                req = {"op": "step", "size": size, "preset": preset, "overrides": overrides, "label": f"{size} {label}"}
                row.update(sides[-1].ask({**req, "op": "flops"}))
                row["timing"] = best_of(sides, req, repeats, log)
                out["space"].append(row)
        if args.skip_gdn:
            out["gdn_skipped"] = "--skip-gdn"
        elif (HERE / ".peers" / "fla").exists():
            for D, T in (GDN_QUICK if args.quick else GDN_SHAPES):
                row = {"D": D, "T": T}
                for impl in ("ours", "fla"):
                    res = best_of(sides if impl == "ours" else sides[-1:],
                                  {"op": "gdn", "impl": impl, "D": D, "T": T, "label": f"gdn {impl} D{D} T{T}"},
                                  repeats, log)
                    row[impl] = res
                out["gdn"].append(row)
        else:
            out["gdn_skipped"] = "fla not installed: run python bench/peers.py --install"
        trial_rows = [r for r in ROWS if r[1] in (QUICK_TRIAL_ROWS if args.quick else TRIAL_ROWS)]
        out["trials"] = {s.name: [] for s in sides} if not args.skip_trials else None
        if args.skip_trials:
            trial_rows = []
        else:   # warm-up: the first trial of a process pays for lazy imports and allocator growth
            best_of(sides, {"op": "trial", "preset": "transformer", "overrides": [], "steps": 2,
                            "label": "trial warm-up"}, 1, log)
        for axis, label, preset, overrides in trial_rows:
            res = best_of(sides, {"op": "trial", "preset": preset, "overrides": overrides, "steps": TRIAL_STEPS,
                                  "label": f"trial {label}"}, 1, log)
            for name, r in res.items():
                out["trials"][name].append({"label": label, **r})
    finally:
        for s in sides:
            s.close()
        tmp.cleanup()
    load["end"] = os.getloadavg()
    out["load_average"] = load
    return out


def _git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def _commit(ref: str) -> str:
    return _git("rev-parse", "--short", ref)


# ---------------------------------------------------------------------------------------------------------- report
def _ratio_cell(x):
    return "—" if x is None else (f"{x:.1f}" if x < 10 else f"{x:.0f}")


def render(out: dict) -> str:
    sides = list(out["sides"])
    after, before = "after", ("before" if "before" in sides else None)
    la = out["load_average"]
    lines = ["# Cost of the search space on CPU", "",
             f"Command: `{out['command']}` (torch {out['sides'][after]['torch']}, {out['cpus']} cores, one torch thread "
             f"per worker; process CPU seconds of one step, best of {out['repeats']} interleaved repeats after a "
             f"warm-up). After = commit {out['after_commit']}{' + uncommitted changes' if out['dirty'] else ''}"
             + (f"; before = `{out['baseline']}` ({out['baseline_commit']})" if before else "") + ".", "",
             f"**Machine load** (1-minute load average): {la['start'][0]:.1f} at the start, {la['end'][0]:.1f} at the "
             f"end, on {out['cpus']} cores. Under load a step's CPU time grows (caches and memory bandwidth are "
             "shared), so absolute seconds are pessimistic; the ratios are measured side by side, interleaved, in "
             "the same run. Rows whose code is the same on both sides show this run's noise in \"after / before\": "
             "a goal is met only where the margin is well outside it.", "",
             f"One thread's plain bmm of Newton–Schulz's X Xᵀ shape ([256, 64, 153] × [256, 153, 64]) runs at "
             f"{out['bmm_gflops_per_s']:.1f} GFLOP/s in this run; GFLOP counts matmul-class operators of the step "
             "(forward + backward)."]
    for size, label in out["sizes"].items():
        rows = [r for r in out["space"] if r["size"] == size]
        base = next(r for r in rows if r["label"] == "transformer")["timing"]
        lines += ["", f"## Training step, {size}: {label}", "",
                  "| axis | choice | GFLOP | state | s (before) | s (after) | after / before | × transformer (before) "
                  "| × transformer (after) | GFLOP/s (after) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("skipped"):
                lines.append(f"| {r['axis']} | {r['label']} | — | — | skipped: {r['skipped']} | | | | | |")
                continue
            t = r["timing"]
            if "error" in t.get(after, {}):
                lines.append(f"| {r['axis']} | {r['label']} | — | — | error: {t[after]['error']} | | | | | |")
                continue
            sa = t[after]["seconds"]
            sb = t[before]["seconds"] if before and "seconds" in t.get(before, {}) else None
            lines.append(
                f"| {r['axis']} | {r['label']} | {r['flops'] / 1e9:.2f} | {r['state']:,} | "
                f"{'—' if sb is None else f'{sb:.3f}'} | {sa:.3f} | {'—' if sb is None else f'{sa / sb:.2f}'} | "
                f"{_ratio_cell(sb / base[before]['seconds'] if sb else None)} | "
                f"{_ratio_cell(sa / base[after]['seconds'])} | {r['flops'] / sa / 1e9:.1f} |")
    lines += _goals(out, before)
    if out.get("gdn"):
        lines += ["", "## Gated DeltaNet: ours (chunked, b = 1) vs fla's plain-PyTorch chunk function", "",
                  "Forward + backward, B 2, H 4, fla `naive_chunk_gated_delta_rule` (fla-core 0.6.0, chunk 64, "
                  "scale 1), ours `memorize(mode='chunked', chunk_size=1)`; same inputs (β = η = 0.1, α = 0.9). "
                  "Goal: fla / ours ≥ 2 at every shape.", "",
                  "| D | T | fla (s) | ours before (s) | ours after (s) | fla / ours (before) | fla / ours (after) |",
                  "|---|---|---|---|---|---|---|"]
        for r in out["gdn"]:
            fla = r["fla"][after].get("seconds")
            oa = r["ours"][after].get("seconds")
            ob = r["ours"][before].get("seconds") if before else None
            cell = lambda x: "—" if x is None else f"{x:.3f}"
            lines.append(f"| {r['D']} | {r['T']} | {cell(fla)} | {cell(ob)} | {cell(oa)} | "
                         f"{'—' if not (fla and ob) else f'{fla / ob:.2f}'} | "
                         f"{'—' if not (fla and oa) else f'{fla / oa:.2f}'} |")
    elif out.get("gdn_skipped"):
        lines += ["", f"Gated DeltaNet vs fla: skipped ({out['gdn_skipped']})."]
    if out.get("trials"):
        lines += ["", f"## Trials per hour of a small discovery-like space (2 cores)", "",
                  f"A trial = model build + {out['trial_steps']} AdamW steps at the small size ({SIZES['small']['label']}"
                  "), one thread; two trials run at a time on 2 cores, so trials per hour = 2 × 3600 / mean trial "
                  "seconds over the space's choices. Ray / MLflow start-up (≈ 5 s per worker) and evaluation are "
                  "not included.", "",
                  "| choice | " + " | ".join(f"s ({n})" for n in out["trials"]) + " |",
                  "|---|" + "---|" * len(out["trials"])]
        names = list(out["trials"])
        for i, r in enumerate(out["trials"][names[0]]):
            lines.append(f"| {r['label']} | " + " | ".join(
                f"{out['trials'][n][i].get('seconds', float('nan')):.2f}" for n in names) + " |")
        per_hour = {n: 2 * 3600 / (sum(r["seconds"] for r in rs) / len(rs)) for n, rs in out["trials"].items()
                    if all("seconds" in r for r in rs)}
        lines.append("| **trials per hour** | " + " | ".join(f"**{per_hour[n]:.0f}**" if n in per_hour else "—"
                                                         for n in names) + " |")
    return "\n".join(lines) + "\n"


def _goals(out: dict, before) -> list:
    """Issue 43's goals, met or not, before and after (from the rows above)."""
    lines = ["", "## Goals (ratios from this run)", "", "| goal | size | before | after | met (after) |",
             "|---|---|---|---|---|"]

    def t(size, label, side):
        r = next((r for r in out["space"] if r["size"] == size and r["label"] == label), None)
        if r is None or r.get("skipped") or side not in r["timing"] or "seconds" not in r["timing"][side]:
            return None, None
        return r["timing"][side]["seconds"], r["flops"]

    for size in out["sizes"]:
        tr = {s: t(size, "transformer", s)[0] for s in ("before", "after")}
        for label in ("gated_deltanet", "titans", "omeganet", "atlas, NS per chunk + read chunk"):
            limit = 10 if label.startswith("atlas") else 3
            val = {s: (t(size, label, s)[0] / tr[s]) if t(size, label, s)[0] and tr[s] else None
                   for s in ("before", "after")}
            lines.append(f"| {label} step ≤ {limit}× transformer | {size} | {_ratio_cell(val['before'])} | "
                         f"{_ratio_cell(val['after'])} | {'yes' if val['after'] and val['after'] <= limit else 'no'} |")
        rate = {s: (t(size, "atlas (per-token NS)", s)[1] / t(size, "atlas (per-token NS)", s)[0] / 1e9)
                if t(size, "atlas (per-token NS)", s)[0] else None for s in ("before", "after")}
        cell = lambda x: "—" if x is None else f"{x:.1f}"
        lines.append(f"| atlas (per-token NS) ≥ 60 GFLOP/s | {size} | {cell(rate['before'])} | {cell(rate['after'])} "
                     f"| {'yes' if rate['after'] and rate['after'] >= 60 else 'no'} |")
        # the same goal against this run's own bmm rate (60 GFLOP/s was half the measured 119; a loaded
        # machine slows both, so the fraction is what compares across runs)
        bmm = out.get("bmm_gflops_per_s")
        frac = {s: rate[s] / bmm if rate[s] and bmm else None for s in rate}
        fcell = lambda x: "—" if x is None else f"{x:.2f}"                     # noqa: E731
        lines.append(f"| atlas (per-token NS) ≥ ½ this run's bmm rate ({bmm:.1f} GFLOP/s): fraction | {size} | "
                     f"{fcell(frac['before'])} | {fcell(frac['after'])} | "
                     f"{'yes' if frac['after'] and frac['after'] >= 0.5 else 'no'} |" if bmm else
                     f"| atlas (per-token NS) ≥ ½ this run's bmm rate | {size} | — | — | no |")
    if out.get("gdn"):
        worst = {}
        for side in ("before", "after"):
            rs = [r["fla"]["after"]["seconds"] / r["ours"][side]["seconds"] for r in out["gdn"]
                  if "seconds" in r["ours"].get(side, {}) and "seconds" in r["fla"]["after"]]
            worst[side] = min(rs) if len(rs) == len(out["gdn"]) else None
        cell = lambda x: "—" if x is None else f"{x:.2f}"
        lines.append(f"| GDN: fla / ours ≥ 2 at every shape (worst shape) | — | {cell(worst['before'])} | "
                     f"{cell(worst['after'])} | {'yes' if worst['after'] and worst['after'] >= 2 else 'no'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline", help="git ref whose atlaslab is the 'before' side (e.g. main)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES))
    ap.add_argument("--only", nargs="+", help="row labels to measure (the Transformer is always added)")
    ap.add_argument("--skip-gdn", action="store_true")
    ap.add_argument("--skip-trials", action="store_true")
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json only")
    ap.add_argument("--out", default=str(RESULTS / "cost_space_cpu"))
    args = ap.parse_args()
    if args.worker:
        serve()
        return
    if args.render:
        out = json.loads(Path(args.out + ".json").read_text())
    else:
        out = run(args)
        Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    Path(args.out + ".md").write_text(render(out))
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
