"""External peers timed like bench/chunked.py: fla's naive chunked Gated DeltaNet and titans-pytorch's NeuralMemory.

    python bench/peers.py --install      # pip install --no-deps the pinned peers into bench/.peers (not the venv)
    python bench/peers.py                # time them (and ours, same shapes) → bench/results/peers_cpu.{json,md}
    python bench/render_results.py bench/results/peers_cpu.json   # rewrite the .md from the .json only

The peers are no dependency of the project: they live in bench/.peers (git-ignored), which only the measuring
subprocesses put on sys.path. fla's package root imports Triton kernels, so only the one file
``fla/ops/gated_delta_rule/naive.py`` is loaded, by path. Each measurement runs in a fresh interpreter with one
torch thread: forward + backward, process CPU seconds, best of 3 after a warm-up (as bench/chunked.py).

Functions for other scripts (each returns a dict; ``{"skipped": reason, "seconds": None}`` when the peer is
not installed or fails): :func:`fla_timing`, :func:`fla_check`, :func:`titans_timing`.
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

HERE = Path(__file__).resolve().parent
PEERS = HERE / ".peers"
RESULTS = HERE / "results"
FLA_NAIVE = PEERS / "fla" / "ops" / "gated_delta_rule" / "naive.py"
#: pinned, all installed with --no-deps (torch is never touched). fla's ops moved to ``fla-core`` (the
#: ``flash-linear-attention`` package holds only layers/models on top of it), so fla-core is what is needed.
PACKAGES = ["fla-core==0.6.0", "einops==0.8.2",
            "titans-pytorch==0.5.5", "assoc-scan==0.0.6", "axial-positional-embedding==0.3.12", "einx==0.4.3",
            "hyper-connections==0.4.11", "rotary-embedding-torch==0.9.1", "tensordict==0.15.3",
            "x-transformers==2.31.10", "pyvers==0.2.3", "frozendict==2.5.1", "loguru==0.7.3",
            "torch-einops-utils==0.2.0"]
GDN_SPEC = {"memory": {"name": "linear", "init": "zeros"}, "retention": {"name": "decay", "placement": "before_step"}}


def install() -> None:
    """pip install the peers into bench/.peers with --no-deps; fail if the venv's package list changed."""
    freeze = [sys.executable, "-m", "pip", "freeze", "--all"]
    before = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(PEERS),
                    *PACKAGES], check=True)
    if subprocess.run(freeze, capture_output=True, text=True, check=True).stdout != before:
        raise RuntimeError("pip changed the venv's packages; the peers must only go to bench/.peers")


def load_fla_naive():
    """fla's naive.py as a stand-alone module (nothing else of fla is imported)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fla_naive_gated_delta_rule", FLA_NAIVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(step, repeats: int = 3) -> dict:
    """Warm-up, then the best (min; other load only ever adds time) and the median process-CPU seconds of
    ``repeats`` steps, the median wall seconds, and the peak RSS added."""
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    times, walls = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        times.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": min(times), "median_seconds": sorted(times)[repeats // 2],
            "wall_seconds": sorted(walls)[repeats // 2], "peak_extra_mb": (peak - base) / 1024.0}


def _measure_fla(case: dict) -> dict:
    """naive_chunk_gated_delta_rule with our bench's gates (β = η = 0.1, g = log α = log 0.9): fwd+bwd, and
    ``forward_seconds``, the forward alone under no_grad."""
    import torch
    naive = load_fla_naive().naive_chunk_gated_delta_rule
    B, T, H, D = case["B"], case["T"], case["H"], case["D"]

    def step(backward=True):
        q, k, v = (torch.randn(B, T, H, D, requires_grad=backward) for _ in range(3))
        beta = torch.full((B, T, H), 0.1, requires_grad=backward)
        g = torch.full((B, T, H), math.log(0.9), requires_grad=backward)
        with torch.set_grad_enabled(backward):
            o, _ = naive(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), v,
                         g, beta, chunk_size=case["chunk_size"], scale=1.0)
        if backward:
            o.sum().backward()

    return {**_timed(step), "forward_seconds": _timed(lambda: step(backward=False))["seconds"]}


def _measure_titans(case: dict) -> dict:
    """NeuralMemory fwd+bwd on x: [B, T, H·D] (its own q/k/v, gate and output projections included)."""
    import torch
    from titans_pytorch import NeuralMemory
    B, T, H, D = case["B"], case["T"], case["H"], case["D"]
    mem = NeuralMemory(dim=H * D, heads=H, dim_head=D, chunk_size=case["chunk_size"],
                       batch_size=case["batch_size"])

    def step():
        out, _ = mem(torch.randn(B, T, H * D, requires_grad=True))
        out.sum().backward()

    return _timed(step)


def _check_fla(case: dict) -> dict:
    """Ours (Gated DeltaNet, b = 1) in float64 vs fla's naive chunk and recurrent references, outputs and grads.

    Mapping: fla β = our η (``lr`` gate), fla g = log α (``retention`` gate), ``scale=1.0`` (fla scales q by
    D^-0.5 by default). fla casts its inputs to float32 inside, so agreement is to float32 rounding.
    """
    import torch

    from atlaslab import build_memory, memorize
    fla = load_fla_naive()
    B, T, H, D, b = case["B"], case["T"], case["H"], case["D"], case["chunk_size"]
    dt = torch.float64
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, T, H, D, dtype=dt, generator=gen) for _ in range(3)]
    leaves += [torch.rand(B, T, H, dtype=dt, generator=gen) * 0.9 + 0.05,     # η = β ∈ (0.05, 0.95)
               torch.rand(B, T, H, dtype=dt, generator=gen) * 0.5 + 0.5]      # α ∈ (0.5, 1)
    weight = torch.randn(B, T, H, D, dtype=dt, generator=gen)
    parts = build_memory(GDN_SPEC, H, D, D)

    def run(fn):
        xs = [x.clone().requires_grad_() for x in leaves]
        q, k, v, eta, alpha = xs
        o = fn(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), v, eta, alpha)
        (o.to(dt) * weight).sum().backward()
        return o.detach().to(dt), [x.grad for x in xs]

    ours = {m: run(lambda q, k, v, eta, alpha, m=m: memorize(q, k, v, parts, {"lr": eta, "retention": alpha},
                                                              mode=m, chunk_size=1)[0])
            for m in ("recurrent", "chunked")}
    peers = {"naive_chunk": lambda q, k, v, eta, alpha, s=1.0: fla.naive_chunk_gated_delta_rule(
                 q, k, v, alpha.log(), eta, chunk_size=b, scale=s)[0],
             "naive_recurrent": lambda q, k, v, eta, alpha: fla.naive_recurrent_gated_delta_rule(
                 q, k, v, eta, alpha.log(), scale=1.0)[0]}
    out = {"max_abs_diff": {}}
    for pname, fn in peers.items():
        o_p, g_p = run(fn)
        for m, (o, g) in ours.items():
            out["max_abs_diff"][f"{pname} vs ours {m}"] = {
                "output": (o - o_p).abs().max().item(),
                "grads": max((a - c).abs().max().item() for a, c in zip(g, g_p))}
    o_default, _ = run(lambda q, k, v, eta, alpha: peers["naive_chunk"](q, k, v, eta, alpha, s=None))
    o = ours["recurrent"][0]
    out["default_scale"] = {"fla_default vs ours": (o - o_default).abs().max().item(),
                            "fla_default vs ours * D^-0.5": (o * D ** -0.5 - o_default).abs().max().item()}
    out["passed"] = all(max(d.values()) < case["tol"] for d in out["max_abs_diff"].values())
    return out


MEASURES = {"fla": _measure_fla, "titans": _measure_titans, "fla_check": _check_fla}


def _run(case: dict, timeout: float) -> dict:
    """One case in a fresh interpreter with bench/.peers on sys.path; a failure becomes ``skipped``."""
    needed = FLA_NAIVE if case["kind"].startswith("fla") else PEERS / "titans_pytorch"
    if not needed.exists():
        return {**case, "seconds": None, "skipped": "not installed: run python bench/peers.py --install"}
    try:
        out = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                             text=True, timeout=timeout, check=True)
        return {**case, **json.loads(out.stdout.strip().splitlines()[-1])}
    except subprocess.TimeoutExpired:
        return {**case, "seconds": None, "skipped": f"timeout > {timeout:.0f}s"}
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        return {**case, "seconds": None, "skipped": lines[-1][:200] if lines else f"exit code {exc.returncode}"}


def fla_timing(B=2, T=2048, H=4, D=32, chunk_size=64, timeout=600.0) -> dict:
    """fla ``naive_chunk_gated_delta_rule`` fwd+bwd: {"seconds", "wall_seconds", "peak_extra_mb", + the case}."""
    return _run(dict(kind="fla", B=B, T=T, H=H, D=D, chunk_size=chunk_size), timeout)


def fla_check(B=2, T=100, H=3, D=8, chunk_size=64, tol=1e-5, timeout=600.0) -> dict:
    """Ours vs fla in float64 (T not a multiple of the chunk, so fla's padding is exercised): "passed",
    "max_abs_diff" {pair: {"output", "grads"}}, "default_scale" (what fla's default q scaling does)."""
    return _run(dict(kind="fla_check", B=B, T=T, H=H, D=D, chunk_size=chunk_size, tol=tol), timeout)


def titans_timing(T, B=2, H=4, D=16, chunk_size=16, batch_size=16, timeout=600.0) -> dict:
    """titans-pytorch ``NeuralMemory(dim=H·D, heads=H, dim_head=D, chunk_size, batch_size)`` fwd+bwd.

    ``batch_size=16`` (= chunk_size) refreshes the weights after every chunk, so each chunk's gradient is taken
    at that chunk's start weights, as in ours; ``batch_size=None`` (its default) takes every chunk's gradient
    at the initial weights (one parallel pass: cheaper, a different model).
    """
    return _run(dict(kind="titans", B=B, T=T, H=H, D=D, chunk_size=chunk_size, batch_size=batch_size), timeout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--install", action="store_true")
    ap.add_argument("--quick", action="store_true", help="titans at T ∈ {256, 1024} only")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.case:
        import torch
        torch.set_num_threads(1)
        torch.manual_seed(0)
        sys.path.append(str(PEERS))   # after the venv: a peer never shadows our packages
        case = json.loads(args.case)
        print(json.dumps(MEASURES[case["kind"]](case)))
        return
    if args.install:
        install()
        return

    from chunked import run_case  # ours, measured by bench/chunked.py itself
    lengths = [256, 1024] if args.quick else [256, 1024, 2048]
    check = fla_check(timeout=args.timeout)
    gdn = {"fla": fla_timing(timeout=args.timeout),
           "ours": run_case(dict(kind="memory", spec="gated_deltanet", mode="chunked", B=2, T=2048, H=4, D=32,
                                 threads=1), args.timeout)}
    titans = []
    for T in lengths:
        titans.append({"T": T, "peer_batch16": titans_timing(T, timeout=args.timeout),
                       "peer_default": titans_timing(T, batch_size=None, timeout=args.timeout),
                       **{key: run_case(dict(kind="memory", spec=spec, mode="chunked", B=2, T=T, H=4, D=16,
                                             threads=1), args.timeout)
                          for key, spec in (("ours", "titans"), ("ours_read_chunk", "titans_read_chunk"))}})
        print(titans[-1], flush=True)
    report(check, gdn, titans)


def report(check: dict, gdn: dict, titans: list) -> None:
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "fla_check": check,
           "gdn_2048_d32": gdn, "titans": titans}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peers_cpu.json").write_text(json.dumps(out, indent=1))
    md = render(out)
    (RESULTS / "peers_cpu.md").write_text(md)
    print(md)


def render(out: dict) -> str:
    """bench/results/peers_cpu.md from the raw record of :func:`report` (``peers_cpu.json``) alone."""
    check, gdn, titans = out["fla_check"], out["gdn_2048_d32"], out["titans"]
    fmt = lambda r: "—" if r.get("seconds") is None else f"{r['seconds']:.3f}"
    why = lambda r: f" ({r['skipped']})" if r.get("skipped") else ""
    lines = ["# External peers (CPU)", "",
             (f"Machine: {out['machine']}, {out['cpus']} cores, torch threads 1. "
              "Command: `python bench/peers.py` (after `python bench/peers.py --install`). Forward + backward, "
              "process CPU seconds, best of 3 after a warm-up, each in a fresh subprocess."), "",
             "## Gated DeltaNet, B = 2, T = 2048, H = 4, D = 32 (ours: b = 1, block 64; fla: chunk 64)", "",
             f"- fla `naive_chunk_gated_delta_rule` (fla-core 0.6.0): {fmt(gdn['fla'])} s{why(gdn['fla'])}"
             + (f" (forward alone, no_grad: {gdn['fla']['forward_seconds']:.3f} s)" if gdn["fla"].get("seconds") else ""),
             f"- ours `gated_deltanet`, chunked: {fmt(gdn['ours'])} s{why(gdn['ours'])}", ""]
    if check.get("skipped"):
        lines.append(f"Numerical check: skipped ({check['skipped']}).")
    else:
        lines.append(f"Numerical check (float64 inputs, B={check['B']}, T={check['T']}, H={check['H']}, "
                     f"D={check['D']}, fla chunk {check['chunk_size']}; fla β = η, g = log α, scale = 1): "
                     f"{'passed' if check['passed'] else 'FAILED'} at tolerance {check['tol']:g}.")
        lines += [f"- {pair}: output {d['output']:.1e}, grads {d['grads']:.1e}"
                  for pair, d in check["max_abs_diff"].items()]
        ds = check["default_scale"]
        lines.append(f"- with fla's default scale (D^-0.5): vs ours {ds['fla_default vs ours']:.2e}, "
                     f"vs ours × D^-0.5 {ds['fla_default vs ours * D^-0.5']:.1e}")
    lines += ["", "## Titans: MLP depth 2 ×4, momentum, decay, chunk 16; B = 2, H = 4, D = 16 (dim 64)", "",
              "| T | ours, per-token read (s) | ours, read: chunk (s) | titans-pytorch batch_size 16 (s) "
              "| titans-pytorch default (s) | peer b16 / ours token | peer b16 / ours chunk |",
              "|---|---|---|---|---|---|---|"]

    def ratio(a, b):
        return f"{a['seconds'] / b['seconds']:.2f}×" if a.get("seconds") and b.get("seconds") else "—"

    lines += [f"| {r['T']} | {fmt(r['ours'])} | {fmt(r['ours_read_chunk'])} | {fmt(r['peer_batch16'])}"
              f"{why(r['peer_batch16'])} | {fmt(r['peer_default'])}{why(r['peer_default'])} | "
              f"{ratio(r['peer_batch16'], r['ours'])} | {ratio(r['peer_batch16'], r['ours_read_chunk'])} |"
              for r in titans]
    lines += ["", "Issue #7 targets vs the matched peer (batch_size 16): ours with read: chunk ≥ 2× faster; ours "
              "with the per-token read (which the peer does not offer) within 1.5× of it (ratio ≥ 0.67×)."]
    lines += ["", ("titans-pytorch 0.5.5: `NeuralMemory(dim=64, heads=4, dim_head=16, chunk_size=16, batch_size=16 | None)`,"
              " default MemoryMLP (depth 2, expansion 4, GELU) inside x + LN(f(x)), momentum on, per-chunk decay. "
              "It differs from ours: its gradient, momentum and decay steps are per chunk (the chunk's η-weighted "
              "gradient sum), where ours steps per token with chunk-start gradients; it reads at chunk granularity "
              "(token t reads the weights after the first ⌊(t+1)/16⌋ chunks: the previous chunk's, the chunk's own "
              "for its last token), ours per token; its "
              "gates and q/k/v/output projections, RMSNorms and retrieve gate are inside the timing (ours gets "
              "projected q, k, v and constant gates); its MLP has a LayerNorm (ours: x + f(x)); loss mean over D. "
              "batch_size 16 refreshes the weights after each chunk (gradients at chunk-start weights, as ours); "
              "its default (None) takes every chunk's gradient at the initial weights: one parallel pass, a "
              "different model.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
