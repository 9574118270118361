"""Eager against ``compile: true`` (torch.compile of the chunked engine's per-chunk work), side by side, on CPU.

    python bench/compiled.py --sizes small base   # → bench/results/compiled_cpu.{json,md} (the committed run)
    python bench/compiled.py                      # the small size only
    python bench/compiled.py --render        # rewrite the .md from the committed .json

For each row one worker process (one torch thread, a fresh Inductor cache folder: a cold compile, as on a fresh
machine or CI box) builds the same model twice from one seed, eager and with ``mixers.*.compile=true``. It times the
first step of each (wall clock: the compiled one includes Dynamo tracing and Inductor's C++ build), then asks both
for one training step (forward + backward of ``LanguageModel.loss``) in turn, alternating which goes first, and
keeps the process CPU seconds of every step (best and median). A second fresh process then times only the first
compiled step again with the now-warm cache folder: what a later trial on the same machine pays (Inductor's on-disk
cache; Dynamo still traces). The loss of the two models on the same batch is compared (float32).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DEFAULT_OUT = str(RESULTS / "compiled_cpu")
sys.path.insert(0, str(HERE))
from cost_space import SIZES  # noqa: E402  (the sizes of the cost benchmark, so the rows compare with its rows)

A = "mixers.atlas.memory."
#: (label, preset, overrides): one row per compiled path (online linear rule; dual form with momentum; dual form, GD)
ROWS = [
    ("gated_deltanet", "gated_deltanet", []),
    ("titans", "titans", []),
    ("atlas w/o Muon (GD)", "atlas", [A + "inner_optimizer={name: gd, lr: 0.1}"]),
]


# ----------------------------------------------------------------------------------------------------- worker side
def _build(preset, overrides, size, compile):
    import torch
    from atlaslab.models.presets import build_model, load_preset
    torch.manual_seed(0)
    return build_model(load_preset(preset, SIZES[size]["overrides"] + overrides
                                   + (["mixers.*.compile=true"] if compile else [])))


def worker(req: dict) -> dict:
    """One row in this process: first-step wall times, then interleaved step CPU times (see the module doc)."""
    import torch
    torch.set_num_threads(1)
    size = SIZES[req["size"]]
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq_len"] + 1),
                        generator=torch.Generator().manual_seed(1))
    models = {"eager": _build(req["preset"], req["overrides"], req["size"], False)}
    out = {}

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model.loss(ids)
        loss.backward()
        return loss.item()

    t = time.perf_counter()
    loss_e = step(models["eager"])
    out["first_step_s"] = {"eager": time.perf_counter() - t}
    models["compiled"] = _build(req["preset"], req["overrides"], req["size"], True)
    t = time.perf_counter()
    loss_c = step(models["compiled"])
    out["first_step_s"]["compiled"] = time.perf_counter() - t
    out["loss"] = {"eager": loss_e, "compiled": loss_c}
    if req.get("warm_only"):
        return out
    times = {"eager": [], "compiled": []}
    for name in models:                      # one more warm-up each (allocator, lazy paths)
        step(models[name])
    for r in range(req["repeats"]):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            models[name].zero_grad(set_to_none=True)
            t = time.process_time()
            models[name].loss(ids).backward()
            times[name].append(time.process_time() - t)
    out["step_s"] = times
    return out


def _run_worker(req: dict, cache_dir: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(req)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT))
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------- driver side
def run(args) -> dict:
    import torch
    log = lambda m: print(m, file=sys.stderr, flush=True)
    out = {"command": "python bench/compiled.py" + (f" --sizes {' '.join(args.sizes)}" if args.sizes else "")
           + (f" --repeats {args.repeats}" if args.repeats else "")
           + (f" --out {os.path.relpath(args.out, ROOT)}" if args.out != DEFAULT_OUT else ""),
           "commit": _git("rev-parse", "--short", "HEAD"),
           "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "torch": torch.__version__,
           "cxx": _cxx(), "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "torch_threads": 1, "repeats": args.repeats or 7, "sizes": {}, "rows": [],
           "load_average": {"start": os.getloadavg()}}
    for size in args.sizes or ["small"]:
        out["sizes"][size] = SIZES[size]["label"]
        for label, preset, overrides in ROWS:
            req = {"size": size, "preset": preset, "overrides": overrides, "repeats": out["repeats"]}
            with tempfile.TemporaryDirectory(prefix="compiled_inductor_") as cache:
                log(f"{size} {label}: cold compile + interleaved steps ...")
                cold = _run_worker(req, cache)
                log(f"{size} {label}: warm-cache compile ...")
                warm = _run_worker({**req, "warm_only": True}, cache)
            row = {"size": size, "label": label, "preset": preset, "overrides": overrides, "cold": cold,
                   "warm": warm}
            out["rows"].append(row)
            if "error" not in cold:
                log(f"  eager {min(cold['step_s']['eager']):.4f}s, compiled {min(cold['step_s']['compiled']):.4f}s, "
                    f"first compiled step {cold['first_step_s']['compiled']:.1f}s")
            else:
                log(f"  error: {cold['error']}")
    out["load_average"]["end"] = os.getloadavg()
    return out


def _git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def _cxx() -> str:
    try:
        from torch._inductor import cpp_builder
        cxx = cpp_builder.get_cpp_compiler()
        return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except Exception as exc:   # recorded, not fatal: the rows then carry the error
        return f"none ({type(exc).__name__})"


# ---------------------------------------------------------------------------------------------------------- report
def summary(out: dict) -> list:
    """The table docs/engines.md embeds: per row, eager and compiled step, their ratio and the compile time."""
    lines = ["| size | model | eager step (s) | compiled step (s) | eager / compiled | first compiled step, cold "
             "cache (s) | same, warm cache (s) |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        c, w = r["cold"], r["warm"]
        if "error" in c:
            lines.append(f"| {r['size']} | {r['label']} | error: {c['error']} | | | | |")
            continue
        e, k = min(c["step_s"]["eager"]), min(c["step_s"]["compiled"])
        warm = f"{w['first_step_s']['compiled']:.1f}" if "error" not in w else f"error: {w['error']}"
        lines.append(f"| {r['size']} | {r['label']} | {e:.4f} | {k:.4f} | {e / k:.2f} | "
                     f"{c['first_step_s']['compiled']:.1f} | {warm} |")
    return lines + ["", verdict(out)]


#: a row "wins" when compiled is at least this much faster, in the best AND the median of the interleaved repeats
WIN = 1.10


def verdict(out: dict) -> str:
    """One generated sentence: which rows compiled wins (≥ WIN× faster by best and by median step), and the steps
    a win needs to repay its cold compile."""
    wins, rest = [], []
    for r in out["rows"]:
        c = r["cold"]
        if "error" in c:
            continue
        e, k = c["step_s"]["eager"], c["step_s"]["compiled"]
        best, med = min(e) / min(k), statistics.median(e) / statistics.median(k)
        if best >= WIN and med >= WIN:
            saved = min(e) - min(k)
            wins.append(f"{r['label']} ({r['size']}: {best:.2f}× by best step, {med:.2f}× by median; the cold compile "
                        f"is repaid after {c['first_step_s']['compiled'] / saved:,.0f} steps)")
        else:
            rest.append(f"{r['label']} ({r['size']}, {best:.2f}× / {med:.2f}×)")
    if not wins:
        return (f"**Verdict:** no row runs {WIN:.2f}× or more faster compiled, by best and by median step: "
                + ", ".join(rest) + f". At {'these sizes' if len(out['sizes']) > 1 else 'this size'} `compile: true` does not "
                "pay; eager stays the default.")
    return (f"**Verdict:** compiled is ≥ {WIN:.2f}× faster for " + "; ".join(wins)
            + ("; not for " + ", ".join(rest) if rest else "") + ".")


def render(out: dict) -> str:
    la = out["load_average"]
    lines = [f"# Compiled chunked engine on CPU: {', '.join(out['sizes'])} size", "",
             f"Command: `{out['command']}` (torch {out['torch']}, {out['cxx']}, {out['cpus']} cores, one torch "
             f"thread; commit {out['commit']}{' + uncommitted changes' if out['dirty'] else ''}). Eager = the "
             "default; compiled = `compile: true` on every memory layer (torch.compile, Inductor's C++ backend, "
             "`dynamic=False`, of the chunked engine's per-chunk work: docs/engines.md#compiled).", "",
             f"**Machine load** (1-minute load average): {la['start'][0]:.1f} at the start, {la['end'][0]:.1f} at the "
             f"end, on {out['cpus']} cores. Absolute seconds are pessimistic under load; the eager / compiled ratio "
             "is measured side by side in one process, the two models' steps interleaved.", "",
             f"Step = process CPU seconds of one training step (forward + backward), best of {out['repeats']} "
             "interleaved repeats after a warm-up. First compiled step = wall seconds of the first step with "
             "`compile: true` (Dynamo tracing, Inductor's code generation and C++ build, then the step), from an "
             "empty Inductor cache folder (cold) and again in a new process with the folder the first filled (warm).",
             "", "<!-- --8<-- [start:summary] -->"] + summary(out) + ["<!-- --8<-- [end:summary] -->", ""]
    lines += ["## Every repeat", "", "| size | model | eager steps (s) | compiled steps (s) | median eager / compiled "
              "| loss eager | loss compiled |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        c = r["cold"]
        if "error" in c:
            continue
        fmt = lambda ts: ", ".join(f"{t:.4f}" for t in ts)
        med = statistics.median(c["step_s"]["eager"]) / statistics.median(c["step_s"]["compiled"])
        lines.append(f"| {r['size']} | {r['label']} | {fmt(c['step_s']['eager'])} | {fmt(c['step_s']['compiled'])} | "
                     f"{med:.2f} | {c['loss']['eager']:.6f} | {c['loss']['compiled']:.6f} |")
    for size, label in out["sizes"].items():
        lines.append(f"\nSize {size}: {label}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES))
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json only")
    ap.add_argument("--out", default=DEFAULT_OUT, help="results path without .json / .md")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
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
