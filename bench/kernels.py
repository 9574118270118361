"""Benchmark: Triton kernels vs the torch ``chunked`` engine and torch SDPA, forward+backward, correctness-gated.

    python bench/kernels.py                      # T ∈ {2K, 8K, 32K}, B = 1, H = 8, D = 64, fp32
    python bench/kernels.py --T 2048 8192 --heads 4 --dim 128 --dtype bf16
    python bench/kernels.py --quick              # T = 2K only

Rows (each at every T):
- ``gdn`` (Gated DeltaNet: linear memory, ℓ2, decay before the step, b = 1): ``memorize(mode="triton")``
  (the chunk kernel, forward and backward kernels) vs ``memorize(mode="chunked")``
  (the exact torch chunk engine) vs ``sdpa`` (torch causal scaled-dot-product attention of the same B, H, D);
  forward+backward. ``triton-fused_recurrent``: the token-by-token kernel, forward only (its use is decoding).
- ``newton_schulz`` (5 quintic steps, one D × D matrix per token and head): fused kernel vs the torch
  reference, forward+backward.

Correctness gate (fla's "no speed on a red gate"): before a Triton row is timed, the same call's outputs and
input gradients are compared with the torch reference in this run (RMS-error ratio ≤ 1e-3 in fp32, 2e-2 in
half precision); a failed gate records the ratio and NO time. Without a GPU the Triton kernels can only run in
Triton's CPU interpreter, which says nothing about speed: the gate then runs on tiny shapes in the interpreter
and the Triton rows say "not timed (no GPU)"; the torch rows are timed on CPU.

Throughput: tokens/s = B·T / (median seconds). Achieved TFLOP/s uses model FLOPs of the algorithm (the same
count for every implementation of an op; backward counted as 2× forward, SDPA's as 2.5× forward, FlashAttention's
convention):
- delta-rule chunk form, per token and head with chunk C = 64: 6CK + 4CV + C²/3 + 6KV (forward);
- causal attention: 2·T·D per token and head (forward, half of the T × T score matrix);
- Newton–Schulz on R × C (R ≤ C): steps · (4R²C + 2R³) per matrix (forward).

Writes bench/results/kernels_<device>.{json,md} (device = cuda GPU name slug, or "cpu").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:   # the kernels can only run interpreted here: for the correctness gate, never for timing
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlaslab import build_memory, memorize  # noqa: E402
from atlaslab.kernels import triton as tk  # noqa: E402
from atlaslab.kernels.newton_schulz import newton_schulz as ns_torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GDN = {"memory": {"name": "linear", "init": "zeros"}, "retention": {"name": "decay", "placement": "before_step"}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NOT_TIMED = "not timed (no GPU; the interpreter is no speed measure)"


def rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def timeit(fn, reps: int, warmup: int = 2 if HAS_CUDA else 1) -> float:
    """Median seconds of ``fn()`` (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ FLOP models

def flops_delta(B, T, H, K, V, C=64):
    return B * T * H * (6 * C * K + 4 * C * V + C * C / 3 + 6 * K * V)


def flops_sdpa(B, T, H, D):
    return 2.0 * B * H * T * T * D      # causal: QKᵀ and PV over half the score matrix


def flops_ns(n, R, C, steps=5):
    R, C = min(R, C), max(R, C)
    return n * steps * (4 * R * R * C + 2 * R ** 3)


# ------------------------------------------------------------------------------------------------ problems

def gdn_problem(B, T, H, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g)
    lr = 0.1 + 0.8 * torch.rand(B, T, H, generator=g)
    ret = 0.9 + 0.099 * torch.rand(B, T, H, generator=g)
    do = torch.randn(B, T, H, D, generator=g)
    cast = lambda x: x.to(device=device, dtype=dtype)   # noqa: E731
    return [cast(x) for x in (q, k, v)], {"lr": cast(lr), "retention": cast(ret)}, cast(do)


def gdn_step(parts, mode, inputs, gates, do, backward=True, block_size=64):
    """One forward (+ backward) of the memory; returns (o, grads of q, k, v, lr, retention)."""
    leaves = [x.detach().requires_grad_(backward) for x in inputs]
    gl = {n: x.detach().requires_grad_(backward) for n, x in gates.items()}
    with torch.set_grad_enabled(backward):
        o, _ = memorize(*leaves, parts, gl, mode=mode, chunk_size=1, block_size=block_size)
        if not backward:
            return o, []
        grads = torch.autograd.grad(o, leaves + list(gl.values()), do)
    return o, list(grads)


def gate_gdn(parts, B, T, H, D, dtype, device, block_size):
    """Triton (mode='triton') vs torch chunked on the same call: max RMS-error ratio over o and 5 gradients."""
    inputs, gates, do = gdn_problem(B, T, H, D, dtype, device, seed=1)
    ref = gdn_step(parts, "chunked", [x.float() for x in inputs], {n: x.float() for n, x in gates.items()},
                   do.float(), block_size=64)
    out = gdn_step(parts, "triton", inputs, gates, do, block_size=block_size)
    return max(rms_ratio(a, r) for a, r in zip([out[0], *out[1]], [ref[0], *ref[1]]))


def gate_recurrent(B, T, H, D, dtype, device):
    from atlaslab.kernels.triton.fused_recurrent import fused_recurrent_forward
    from atlaslab.kernels.triton.reference import delta_rule_chunk
    (q, k, v), gates, _ = gdn_problem(B, T, H, D, dtype, device, seed=2)
    o, h = fused_recurrent_forward(q, k, v, gates["lr"], gates["retention"])
    o_r, h_r = delta_rule_chunk(q.float(), k.float(), v.float(), gates["lr"].float(), gates["retention"].float())
    return max(rms_ratio(o, o_r), rms_ratio(h, h_r))


def gate_ns(n, D, dtype, device):
    from atlaslab.kernels.triton.newton_schulz import newton_schulz as ns_triton
    s = torch.randn(n, D, D, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    w = torch.randn(n, D, D, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    a, b = s.clone().requires_grad_(), s.float().clone().requires_grad_()
    ya, yb = ns_triton(a), ns_torch(b)
    (ga,), (gb,) = torch.autograd.grad(ya, a, w), torch.autograd.grad(yb, b, w.float())
    return max(rms_ratio(ya, yb), rms_ratio(ga, gb))


# ------------------------------------------------------------------------------------------------ the run

def row(op, impl, T, args, pass_="fwd+bwd", seconds=None, flops=None, gate=None, note="", tokens=None):
    tokens = args.batch * T if tokens is None else tokens
    r = {"op": op, "impl": impl, "T": T, "B": args.batch, "H": args.heads, "D": args.dim, "dtype": args.dtype,
         "pass": pass_, "seconds": seconds, "tokens_per_s": None, "tflops": None, "gate_ratio": gate, "note": note}
    if seconds:
        r["tokens_per_s"] = tokens / seconds
        r["tflops"] = flops / seconds / 1e12 if flops else None
    return r


def run(args) -> list:
    device = "cuda" if HAS_CUDA else "cpu"
    dtype = DTYPES[args.dtype]
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    B, H, D = args.batch, args.heads, args.dim
    parts = build_memory(GDN, H, D, D).to(device)
    rows = []
    tk.RECURRENT_MAX_T = 0   # memorize(mode="triton") then always takes the chunk kernel (the row it measures)
    can_time_triton = HAS_CUDA and tk.available() and not tk.forced_torch()

    gates = {}
    if not can_time_triton:   # interpreter gate on tiny shapes, recorded once
        why = tk.explain(parts, torch.zeros(1, 1, H, D), 1) if tk.triton_importable() else "triton is not installed"
        if tk.available() and why is None:
            small_parts = build_memory(GDN, 2, 16, 16)
            gates = {"gdn": gate_gdn(small_parts, 1, 21, 2, 16, torch.float32, "cpu", 16),
                     "fused_recurrent": gate_recurrent(1, 9, 2, 16, torch.float32, "cpu"),
                     "newton_schulz": gate_ns(3, 16, torch.float32, "cpu")}
            print(f"[gate, interpreter, tiny shapes] max RMS-error ratios: {gates}")
        else:
            print(f"[gate] Triton kernels not runnable here: {why}")

    for T in args.T:
        print(f"T = {T}", flush=True)
        inputs, g, do = gdn_problem(B, T, H, D, dtype, device)
        fl = flops_delta(B, T, H, D, D)
        # torch chunked engine
        if device == "cpu" and T > args.cpu_max_T:
            rows.append(row("gdn", "torch-chunked", T, args, note=f"skipped on CPU above T = {args.cpu_max_T}"))
        else:
            try:
                s = timeit(lambda: gdn_step(parts, "chunked", inputs, g, do), args.reps)
                rows.append(row("gdn", "torch-chunked", T, args, seconds=s, flops=3 * fl))
            except (RuntimeError, MemoryError) as exc:   # e.g. out of memory
                rows.append(row("gdn", "torch-chunked", T, args, note=f"failed: {str(exc)[:120]}"))
        # torch SDPA (causal), same B, H, D
        if device == "cpu" and T > args.cpu_sdpa_max_T:
            rows.append(row("attention", "torch-sdpa", T, args, note=f"skipped on CPU above T = {args.cpu_sdpa_max_T}"))
        else:
            qs, ks, vs = (x.transpose(1, 2).detach().requires_grad_() for x in inputs)

            def sdpa():
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                torch.autograd.grad(o, (qs, ks, vs), do.transpose(1, 2))
            try:
                s = timeit(sdpa, args.reps)
                rows.append(row("attention", "torch-sdpa", T, args, seconds=s, flops=3.5 * flops_sdpa(B, T, H, D)))
            except (RuntimeError, MemoryError) as exc:
                rows.append(row("attention", "torch-sdpa", T, args, note=f"failed: {str(exc)[:120]}"))
        # Triton chunk (fwd+bwd) and fused_recurrent (fwd)
        for impl, pass_, gate_fn, timed, fl_k in (
                ("triton-chunk", "fwd+bwd", lambda: gate_gdn(parts, B, T, H, D, dtype, device, 64),
                 lambda: gdn_step(parts, "triton", inputs, g, do), 3 * fl),
                ("triton-fused_recurrent", "fwd", lambda: gate_recurrent(B, T, H, D, dtype, device),
                 lambda: __import__("atlaslab.kernels.triton.fused_recurrent", fromlist=["x"]).fused_recurrent_forward(
                     inputs[0], inputs[1], inputs[2], g["lr"], g["retention"]), 4 * B * T * H * D * D)):
            key = "gdn" if impl == "triton-chunk" else "fused_recurrent"
            if not can_time_triton:
                ratio = gates.get(key)
                note = NOT_TIMED
                rows.append(row("gdn", impl, T, args, pass_, gate=ratio, note=note))
                continue
            ratio = gate_fn()
            if not ratio <= tol:
                rows.append(row("gdn", impl, T, args, pass_, gate=ratio,
                                note=f"CORRECTNESS GATE FAILED (ratio {ratio:.2e} > {tol:g}): no speed reported"))
                continue
            s = timeit(timed, args.reps)
            rows.append(row("gdn", impl, T, args, pass_, seconds=s, flops=fl_k, gate=ratio))
        # Newton–Schulz: one D × D matrix per token and head (capped on CPU)
        n = B * T * H if device == "cuda" else min(B * T * H, args.cpu_ns_max)
        s_in = torch.randn(n, D, D, device=device, dtype=dtype)
        w = torch.randn_like(s_in)
        fl_ns = 3 * flops_ns(n, D, D)
        note = "" if n == B * T * H else f"{n} matrices (CPU cap, not B·T·H); tokens/s = matrices/H per s"

        def ns_step(fn, x=s_in):
            x = x.detach().requires_grad_()
            torch.autograd.grad(fn(x), x, w)
        s = timeit(lambda: ns_step(ns_torch), args.reps)
        rows.append(row("newton_schulz", "torch", T, args, seconds=s, flops=fl_ns, note=note, tokens=n / H))
        if not can_time_triton:
            ratio = gates.get("newton_schulz")
            rows.append(row("newton_schulz", "triton-fused", T, args, gate=ratio, note=NOT_TIMED))
        else:
            from atlaslab.kernels.triton.newton_schulz import newton_schulz as ns_triton
            ratio = gate_ns(min(n, 4096), D, dtype, device)
            if not ratio <= tol:
                rows.append(row("newton_schulz", "triton-fused", T, args, gate=ratio,
                                note=f"CORRECTNESS GATE FAILED (ratio {ratio:.2e} > {tol:g}): no speed reported"))
            else:
                s = timeit(lambda: ns_step(ns_triton), args.reps)
                rows.append(row("newton_schulz", "triton-fused", T, args, seconds=s, flops=fl_ns, gate=ratio,
                                note=note, tokens=n / H))
    return rows


def device_slug() -> str:
    if not HAS_CUDA:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def write(rows, args, meta):
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"kernels_{meta['device']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Kernel benchmark on {meta['device_name']}", "",
             f"`{meta['command']}` — torch {meta['torch']}, triton {meta['triton']}, {meta['date']}.",
             f"B = {args.batch}, H = {args.heads}, D = {args.dim}, dtype {args.dtype}; median of {args.reps} runs.", ""]
    if not meta["triton_timed"]:
        lines += ["**Triton kernels were NOT timed: no GPU.** On CPU Triton runs only in its interpreter "
                  "(~1000× slower than torch); its timings would say nothing about the kernels. Their "
                  "correctness gate ran in the interpreter on tiny shapes (B = 1, T ≤ 21, H = 2, D = 16; "
                  "ratios in the gate column); only the torch rows are timed, on CPU (shared cores: indicative).",
                  ""]
    lines += ["| op | impl | T | pass | ms | tokens/s | TFLOP/s | gate ratio | note |",
              "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ms = None if r["seconds"] is None else r["seconds"] * 1e3
        lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['pass']} | {fmt(ms, '.2f')} | "
                     f"{fmt(r['tokens_per_s'], '.3g')} | {fmt(r['tflops'], '.3g')} | {fmt(r['gate_ratio'], '.1e')} | "
                     f"{r['note']} |")
    lines += ["", "FLOP models (same per op for every implementation; backward = 2× forward, SDPA 2.5×): "
              "delta-rule chunk form 6CK + 4CV + C²/3 + 6KV per token·head (C = 64); causal attention 2TD per "
              "token·head; Newton–Schulz 5·(4R²C + 2R³) per matrix. fused_recurrent is forward only (4KV per "
              "token·head)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--quick", action="store_true", help="T = 2048 only")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 10 on GPU, 3 on CPU)")
    p.add_argument("--cpu-max-T", type=int, default=8192, help="CPU: skip the torch chunked engine above this T")
    p.add_argument("--cpu-sdpa-max-T", type=int, default=8192, help="CPU: skip SDPA above this T (T² memory)")
    p.add_argument("--cpu-ns-max", type=int, default=512, help="CPU: cap on Newton–Schulz matrices per call")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    args = p.parse_args()
    if args.quick:
        args.T = [2048]
    args.reps = args.reps or (10 if HAS_CUDA else 3)
    if not HAS_CUDA:
        torch.set_num_threads(args.threads)
    import importlib.util
    triton_version = None
    if importlib.util.find_spec("triton"):
        import triton
        triton_version = triton.__version__
    rows = run(args)
    meta = {"device": device_slug(), "device_name": torch.cuda.get_device_name() if HAS_CUDA else
            f"CPU ({platform.processor() or platform.machine()}, {args.threads} threads)",
            "torch": torch.__version__, "triton": triton_version, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/kernels.py " + " ".join(sys.argv[1:]),
            "triton_timed": any(r["impl"].startswith("triton") and r["seconds"] for r in rows)}
    write(rows, args, meta)


if __name__ == "__main__":
    main()
