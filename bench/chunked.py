"""Benchmark: chunk-parallel engine vs the recurrent reference (and SDPA attention), side by side in one run.

    python bench/chunked.py                 # full run (a few minutes on 2 CPU cores)
    python bench/chunked.py --quick         # smaller T grid
    python bench/render_results.py bench/results/chunked_cpu.json   # rewrite the .md from the .json only

Measures forward+backward time (best of repeats; process CPU seconds with one torch thread, so that other
load on a shared machine distorts the ratios less; wall seconds and the load average are recorded too) and
peak extra resident memory (each measurement in a fresh subprocess, ru_maxrss after − before) for
representative specs at T ∈ {256, 1024, 4096}; the chunked-vs-recurrent speed-up where the recurrent
reference is affordable; the fitted exponent of chunked time in T (1K → 4K); chunked vs torch SDPA causal
attention of the same width; and the issue #7 cases at T = 2048 (Titans; Gated DeltaNet at D = 32). Writes bench/results/chunked_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: per-token Newton–Schulz on 153 × 153 matrices costs ~1.7 GFLOP per token here, and its activations for the
#: backward ≈ 0.25 GB per chunk (T = 1024 was killed for memory on 24 GB): cap Atlas's length
MAX_T = {"atlas": 256}

SPECS = {
    "deltanet": {"memory": {"name": "linear", "init": "zeros"}},
    "gated_deltanet": {"memory": {"name": "linear", "init": "zeros"},
                       "retention": {"name": "decay", "placement": "before_step"}},
    "titans": {"memory": "mlp", "retention": "decay", "inner_optimizer": "momentum", "chunk_size": 16},
    "titans_read_chunk": {"memory": "mlp", "retention": "decay", "inner_optimizer": "momentum", "chunk_size": 16,
                          "read": "chunk"},
    "omeganet": {"memory": {"name": "mlp", "residual": False, "expansion": 1}, "feature_map": "polynomial",
                 "retention": "decay", "window": {"size": 4}, "chunk_size": 16},
    "atlas": {"memory": {"name": "mlp", "residual": False, "expansion": 1}, "feature_map": "polynomial",
              "retention": "decay", "inner_optimizer": "muon", "window": {"size": 4}, "chunk_size": 16},
    "atlas_chunk_ns": {"memory": {"name": "mlp", "residual": False, "expansion": 1}, "feature_map": "polynomial",
                       "retention": "decay", "window": {"size": 4}, "chunk_size": 16, "read": "chunk",
                       "inner_optimizer": {"name": "muon", "ns_granularity": "chunk"}},
    "moneta": {"memory": "mlp_ln", "attentional_bias": "lp", "retention": "lq", "chunk_size": 16},
    # φ* kernel trick on a linear memory, normalised: softmax attention as a memory (DeepTransformer → Transformer)
    "softmax_kernel": {"memory": {"name": "linear", "init": "zeros"}, "attentional_bias": "dot",
                       "feature_map": {"name": "exp", "normalize": True}},
}


def measure(case: dict) -> dict:
    """Run one case in this process: seconds (best of the repeats) and the peak RSS added by a forward+backward (MB)."""
    import torch

    from atlaslab import build_memory, memorize

    torch.manual_seed(0)
    torch.set_num_threads(int(case.get("threads", 1)))

    def inputs():
        B, T, H, D = case["B"], case["T"], case["H"], case["D"]
        q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
        qn, kn = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        return q, k, v, qn, kn

    if case["kind"] == "ns":   # Newton–Schulz (5 steps) vs one batched matmul of the same shapes: GFLOP/s
        from atlaslab.kernels.newton_schulz import newton_schulz
        n, r, c = case["N"], case["rows"], case["cols"]
        x = torch.randn(n, r, c)
        small, big = min(r, c), max(r, c)
        ns_flops = 5 * 2 * (2 * small * small * big + small ** 3)   # X Xᵀ, A², (bA + cA²) X per step
        mm_flops = 2 * small * small * big
        out = {}
        for name, fn, flops in (("ns", lambda: newton_schulz(x, 5), ns_flops),
                                ("matmul", lambda: x @ x.mT if r <= c else x.mT @ x, mm_flops)):
            fn()
            t0 = time.process_time()
            reps = 3
            for _ in range(reps):
                fn()
            dt = (time.process_time() - t0) / reps
            out[f"{name}_gflops"] = n * flops / dt / 1e9
        return out

    B, T, H, D = case.get("B"), case.get("T"), case.get("H"), case.get("D")
    if case["kind"] == "sdpa":
        def step():
            q, k, v, qn, kn = inputs()
            o = torch.nn.functional.scaled_dot_product_attention(qn.transpose(1, 2), kn.transpose(1, 2),
                                                                 v.transpose(1, 2), is_causal=True)
            o.sum().backward()
    else:
        parts = build_memory(SPECS[case["spec"]], H, D, D)
        used = []
        if parts.retention.uses_alpha:
            used.append("retention")
        if parts.inner_optimizer.has_momentum:
            used.append("momentum")

        def step():
            q, k, v, qn, kn = inputs()
            g = {"lr": torch.full((B, T, H), 0.1, requires_grad=True)}
            for name in used:
                g[name] = torch.full((B, T, H), 0.9, requires_grad=True)
            o, _ = memorize(qn, kn, v, parts, g, mode=case["mode"], block_size=case.get("block", 64))
            o.sum().backward()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # after imports and model build
    step()                                                  # warm-up (lazy imports, allocator)
    times, walls = [], []
    for _ in range(case.get("repeats", 3)):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        times.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times.sort()
    walls.sort()
    # CPU seconds of this process (one torch thread), best of the repeats: other load on a shared machine only
    # ever adds time (cache and memory-bandwidth contention still do, so load is recorded with the results)
    return {"seconds": times[0], "median_seconds": times[len(times) // 2], "wall_seconds": walls[len(walls) // 2],
            "peak_extra_mb": (peak - base) / 1024.0, "load_average": os.getloadavg()[0]}


def run_case(case: dict, timeout: float) -> dict:
    """Each case in a fresh interpreter so the memory high-water mark is its own."""
    cmd = [sys.executable, __file__, "--case", json.dumps(case)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        return {**case, **json.loads(out.stdout.strip().splitlines()[-1])}
    except subprocess.TimeoutExpired:
        return {**case, "seconds": None, "skipped": f"timeout > {timeout:.0f}s"}
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        return {**case, "seconds": None, "skipped": (lines[-1][:200] if lines else f"exit code {exc.returncode}")}


def fit_exponent(points):
    (t1, s1), (t2, s2) = points[0], points[-1]
    return math.log(s2 / s1) / math.log(t2 / t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per measurement (1 avoids OpenMP contention on a shared machine)")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measure(json.loads(args.case))))
        return

    lengths = [256, 1024] if args.quick else [256, 1024, 4096]
    B, H, D = 2, 4, 16
    th = args.threads
    rows = []
    for spec in SPECS:
        for T in [T for T in lengths if T <= MAX_T.get(spec, T)]:
            case = dict(kind="memory", spec=spec, mode="chunked", B=B, T=T, H=H, D=D, threads=th)
            rows.append(run_case(case, args.timeout))
            print(rows[-1], flush=True)
        # the reference costs seconds per thousand tokens: measure it where it is affordable
        for T in lengths[:1 if spec in MAX_T else 2]:
            rows.append(run_case(dict(kind="memory", spec=spec, mode="recurrent", B=B, T=T, H=H, D=D, repeats=1,
                                      threads=th),
                                 args.timeout))
            print(rows[-1], flush=True)
    for T in lengths:
        rows.append(run_case(dict(kind="sdpa", B=B, T=T, H=H, D=D, threads=th), args.timeout))
        print(rows[-1], flush=True)
    titans_2k = [run_case(dict(kind="memory", spec="titans", mode=m, B=B, T=2048, H=H, D=D,
                               repeats=3 if m == "chunked" else 2,
                               threads=th), args.timeout) for m in ("chunked", "recurrent")]
    gdn_issue = [run_case(dict(kind="memory", spec="gated_deltanet", mode=m, B=2, T=2048, H=4, D=32,
                               repeats=3 if m == "chunked" else 2, threads=th), args.timeout)
                 for m in ("chunked", "recurrent")]
    ns = run_case(dict(kind="ns", N=B * H * 16, rows=153, cols=153, threads=th), args.timeout)
    print(titans_2k, gdn_issue, ns, flush=True)
    report(rows, titans_2k, gdn_issue, lengths, th, ns)


def summarise(rows, lengths) -> dict:
    """Per spec (in the order measured): chunked seconds at each T, the speed-up over the recurrent reference at
    the first two T, the exponent of chunked time in T over the last two measured T, the peak MB at the largest T."""
    def t(spec, mode, T):
        return next((r.get("seconds") for r in rows if r.get("spec") == spec and r.get("mode") == mode
                     and r["T"] == T), None)

    summary = {}
    for spec in dict.fromkeys(r["spec"] for r in rows if r["kind"] == "memory"):
        ch = [t(spec, "chunked", T) for T in lengths]
        ups = []
        for T in lengths[:2]:
            r, c = t(spec, "recurrent", T), t(spec, "chunked", T)
            ups.append(r / c if r and c else None)
        pts = [(T, s) for T, s in zip(lengths, ch) if s]
        peak = next((r.get("peak_extra_mb") for r in rows if r.get("spec") == spec and r.get("mode") == "chunked"
                     and r["T"] == lengths[-1]), None)
        summary[spec] = {"chunked_s": ch, "speedup": ups, "exponent": fit_exponent(pts[-2:]) if len(pts) >= 2 else None,
                         "peak_mb": peak}
    return summary


def render(out: dict) -> str:
    """bench/results/chunked_cpu.md from the raw record of :func:`main` (``chunked_cpu.json``) alone."""
    rows, lengths, ns = out["rows"], out["lengths"], out["ns"]
    fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
    lines = ["# Chunked engine vs recurrent reference (CPU)", "",
             f"Machine: {out['machine']}, {out['cpus']} cores, torch threads {out['threads']}. "
             "Command: `python bench/chunked.py`. B = 2, H = 4, D = 16; forward + backward; process CPU seconds, "
             "best of 3 (recurrent: 1 run; the T = 2048 issue cases: best of 2).", "",
             "| spec | " + " | ".join(f"chunked T={T} (s)" for T in lengths)
             + " | " + " | ".join(f"speed-up T={T}" for T in lengths[:2])
             + " | exponent (last two T) | peak MB at max T |",
             "|---|" + "---|" * (len(lengths) + len(lengths[:2]) + 2)]
    summary = summarise(rows, lengths)
    for spec, m in summary.items():
        lines.append(f"| {spec} | " + " | ".join(fmt(x, "{:.3f}") for x in m["chunked_s"]) + " | "
                     + " | ".join(fmt(x, "{:.1f}×") for x in m["speedup"])
                     + f" | {fmt(m['exponent'], '{:.2f}')} | {fmt(m['peak_mb'], '{:.0f}')} |")
    sd = [next((r.get("seconds") for r in rows if r["kind"] == "sdpa" and r["T"] == T), None) for T in lengths]
    loads = [r["load_average"] for r in rows + out["titans_2048"] + out["gdn_2048_d32"]
             if r.get("load_average") is not None]
    if loads:
        lines += ["", f"1-minute load average during the measurements: {min(loads):.1f}–{max(loads):.1f} "
                      f"(2 cores; above ~1 other processes shared the machine)."]
    lines += ["", "SDPA causal attention, same shapes (s): " + ", ".join(
        f"T={T}: {s:.4f}" for T, s in zip(lengths, sd) if s), ""]
    tc, tr = (r.get("seconds") for r in out["titans_2048"])
    if tc and tr:
        lines.append(f"Titans (MLP, momentum, b = 16, per-token read) at T = 2048: chunked {tc:.2f} s, recurrent "
                     f"{tr:.2f} s → {tr / tc:.1f}× (target ≥ 20×).")
    gc, gr = (r.get("seconds") for r in out["gdn_2048_d32"])
    if gc:
        lines.append(f"Gated DeltaNet (b = 1) at B = 2, T = 2048, H = 4, D = 32: chunked {gc:.3f} s fwd+bwd"
                     + (f", recurrent {gr:.2f} s → {gr / gc:.0f}× (target ≥ 50×)" if gr else "")
                     + ". fla's naive_chunk_gated_delta_rule at the same shape, side by side: "
                       "bench/results/peers_cpu.md (`python bench/peers.py`).")
    if ns.get("ns_gflops"):
        lines.append(f"Newton–Schulz-5 on {ns['N']} matrices of {ns['rows']}×{ns['cols']} (one Atlas chunk's per-token "
                     f"NS for one weight): {ns['ns_gflops']:.1f} GFLOP/s vs a batched matmul of the same shapes "
                     f"{ns['matmul_gflops']:.1f} GFLOP/s → {ns['ns_gflops'] / ns['matmul_gflops']:.0%} (target ≥ 50%).")
    ca, cn = (summary.get(s, {}).get("chunked_s", [None])[0] for s in ("atlas", "atlas_chunk_ns"))
    if ca and cn:
        lines.append(f"Atlas ns_granularity chunk (+ read chunk) vs per-token NS at T = {lengths[0]}, b = 16: "
                     f"{ca / cn:.1f}× faster (target ≥ 10×).")
    return "\n".join(lines) + "\n"


def report(rows, titans_2k, gdn_issue, lengths, threads, ns):
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": threads,
           "lengths": lengths, "rows": rows, "titans_2048": titans_2k, "ns": ns, "gdn_2048_d32": gdn_issue,
           "summary": summarise(rows, lengths)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chunked_cpu.json").write_text(json.dumps(out, indent=1))
    md = render(out)
    (RESULTS / "chunked_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
