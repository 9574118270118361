"""Benchmark: Triton kernels vs the torch ``chunked`` engine, torch SDPA and fla, forward+backward, correctness-gated.

    python bench/kernels.py --dtype bf16         # issue 6 on a GPU: T ∈ {2K, 8K, 32K}, B = 1, H = 8, D = 64 (< 8 min)
    python bench/kernels.py --dtype bf16 --quick # T ∈ {2K, 8K} on a GPU (< 3 min); T = 512 on CPU
    python bench/kernels.py --T 2048 8192 --heads 4 --dim 128 --dtype bf16
    python bench/kernels.py --dtype fp32 --tf32   # fp32 inputs with TF32 dots (torch's "high" matmul precision)
    python bench/render_results.py bench/results/kernels_cpu.json   # rewrite the .md from the .json only

Rows (each at every T; ``op`` / ``impl``):

- ``gdn`` (Gated DeltaNet: linear memory, ℓ2, decay before the step, b = 1): ``triton-chunk``
  (``memorize(mode="triton")``: the chunk kernel, forward and backward kernels) vs ``torch-chunked``
  (``memorize(mode="chunked")``, the exact torch chunk engine; in bf16 / fp16 it runs in fp32 when the dtype
  has no torch kernel, e.g. the b = 1 engines' triangular solve: the row's dtype and note say so);
  ``triton-fused_recurrent``: the token-by-token kernel, forward only (its use is decoding).
- ``attention`` / ``torch-sdpa``: torch causal scaled-dot-product attention of the same B, H, D (FlashAttention's
  kernel is forced in bf16 / fp16 on CUDA; fp32 takes torch's default backend, which is not FlashAttention).
- ``fla_chunk_gdn`` / ``fla-triton``: fla's ``chunk_gated_delta_rule`` (fla-core's Triton kernel), the same GDN
  problem: fla β = our ``lr`` gate, g = log α (our ``retention`` gate), ``scale = 1`` (bench/peers.py). Optional:
  measured only on CUDA when ``fla`` imports (from the environment, else from bench/.peers, appended to sys.path).
- ``gla``: linear memory, dot bias, channel-wise decay (α per key channel) after the step, b = 1: ``triton`` (the
  chunk kernel's channel-wise family) vs ``torch-chunked``.
- ``omega_c1`` / ``omega_c4``: the GDN spec with an Omega window of c = 1 / c = 4 (ATLAS Eq. 9, γ gates, b = 1):
  ``triton`` (the c = 1 chunk kernel / the window kernel) vs ``torch-chunked``; same shapes.
- ``titans_linear_momentum``: linear memory, momentum GD, decay (after the step), b = 16: ``triton`` (the
  ``chunk_momentum`` kernel) vs ``torch-chunked``.
- ``titans_mlp``: 2-layer residual MLP memory (expansion 4, gelu), momentum GD, decay, b = 16: ``triton``
  (``memorize(mode="triton")``: the ``chunked`` engine with the fused ``mlp_chunk`` step) vs ``torch-chunked``.
- ``omeganet_mlp``: OmegaNet's layout of the same step — 2-layer MLP memory without residual, GD, decay, Omega window
  c = 4 (γ gates), b = 16 — with the identity feature map (ATLAS's φ_2 maps a head of D = 64 to C(66, 2) = 2145
  features, beyond the step's 256): ``triton`` (fused step) vs ``torch-chunked``.
- ``newton_schulz`` (5 quintic steps, one D × D matrix per token and head): ``triton-fused`` vs ``torch``.
- ``gdn_docs``: the GDN spec on ``--docs`` ragged documents (random lengths ≥ 1) totalling T tokens (B = 1):
  ``triton-packed`` (``memorize(mode="triton", cu_seqlens=...)``: one kernel call over all documents) vs
  ``triton-padded`` (the documents right-padded to a ``[N, max T_i]`` batch, what one does without varlen) vs
  ``torch-chunked-loop`` (each document alone on the torch engine: the definition, and both gates' reference).
  tokens/s counts real tokens only.

Correctness gate (fla's "no speed on a red gate"): before a Triton (or fla) row is timed, the same call's outputs and
input gradients (q, k, v and every gate) are compared with the torch reference, in fp32, in this run at the timed
shape (RMS-error ratio ≤ 1e-3 in fp32, 2e-2 in half precision); a failed gate records the ratio and NO time. A
``memorize(mode="triton")`` row is also refused when the dispatch would not pick the row's kernel (it would time
torch). fla's gate compares fla's outputs and gradients with our GDN's (the fp32 torch reference). Without a GPU the
Triton kernels can only run in Triton's CPU interpreter, which says nothing about speed: the gates then run on tiny
shapes in the interpreter (fla's mapping with fla's ``naive_chunk_gated_delta_rule`` when bench/.peers holds it) and
the Triton rows say "not timed (no GPU)"; the torch rows are timed on CPU.

Bounded time: each row's timed repeats stop once ``--row-budget`` seconds are spent (at least 2), and once
``--deadline`` seconds have passed since the start every further row is skipped (noted), so the command always ends.

Targets (issue 6), stated with the measured ratios in the results' "targets" section: (a) ``gdn`` triton-chunk /
fla ≤ 1.3; (b) ``omega_c4`` / ``omega_c1`` (both triton) ≤ 1.5; (c) ``gdn`` triton-chunk / SDPA < 1 at T ≥ 8192
(in bf16 / fp16: FlashAttention); (d) forward+backward throughput (tokens/s, TFLOP/s) vs ``torch-chunked`` and
SDPA (a table; no bound). A target is met when every measured T meets it; "not measured" names the reason.

Throughput: tokens/s = B·T / (median seconds). Achieved TFLOP/s uses model FLOPs of the algorithm (the same count
for every implementation of an op; backward counted as 2× forward, SDPA's as 2.5× forward, FlashAttention's
convention), per token and head, forward:

- delta-rule chunk form with chunk C = 64: 6CK + 4CV + C²/3 + 6KV (gdn, fla, omega_c1);
- Omega window c: c × the delta-rule count (c slot rows per token);
- linear momentum, chunk b (approximate dual form): 8KV + 4b(K + V);
- 2-layer MLP memory, hidden h = 4D, chunk b (approximate): 16Dh + 4b(D + h);
- causal attention: 2·T·D (half of the T × T score matrix);
- Newton–Schulz on R × C (R ≤ C): steps · (4R²C + 2R³) per matrix.

Writes bench/results/kernels_<device>.{json,md} (device = cuda GPU name slug, or "cpu"; ``--out`` another folder).

On the project's H200 device machine (python3 has torch, triton, numpy, PyYAML; not omegaconf or fla): carry the
pure-Python ``omegaconf`` package (copied from the venv's site-packages into a git-excluded folder put on PYTHONPATH)
and bench/.peers (fla-core, for the fla row), then run ``python3 bench/kernels.py --dtype bf16 --out $OUT``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:   # the kernels can only run interpreted here: for the correctness gate, never for timing
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from atlaslab import build_memory, memorize  # noqa: E402
from atlaslab.engines import triton as tk  # noqa: E402
from atlaslab.kernels.newton_schulz import newton_schulz as ns_torch  # noqa: E402

RESULTS = HERE / "results"
PEERS = HERE / ".peers"
FLA_NAIVE = PEERS / "fla" / "ops" / "gated_delta_rule" / "naive.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NOT_TIMED = "not timed (no GPU; the interpreter is no speed measure)"
FLA_IMPL = "fla-triton"

LINEAR0 = {"name": "linear", "init": "zeros"}
BEFORE = {"name": "decay", "placement": "before_step"}
GDN = {"memory": LINEAR0, "retention": BEFORE}


# ------------------------------------------------------------------------------------------------ FLOP models
# forward model FLOPs of the whole call (B, T, H, D); see the module docstring

def flops_delta(B, T, H, K, V, C=64):
    return B * T * H * (6 * C * K + 4 * C * V + C * C / 3 + 6 * K * V)


def flops_omega(c):
    return lambda B, T, H, D: c * flops_delta(B, T, H, D, D)


def flops_momentum(b):
    return lambda B, T, H, D: B * T * H * (8 * D * D + 4 * b * 2 * D)


def flops_mlp(b, expansion=4):
    return lambda B, T, H, D: B * T * H * (16 * D * expansion * D + 4 * b * (D + expansion * D))


def flops_sdpa(B, T, H, D):
    return 2.0 * B * H * T * T * D      # causal: QKᵀ and PV over half the score matrix


def flops_ns(n, R, C, steps=5):
    R, C = min(R, C), max(R, C)
    return n * steps * (4 * R * R * C + 2 * R ** 3)


# ------------------------------------------------------------------------------------------------ the memory cases

@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One memory spec benchmarked as ``memorize(mode="triton")`` vs ``memorize(mode="chunked")``.

    ``kernel``: what the triton mode must run for the row to count (``chunk``, ``chunk_momentum`` or ``mlp_step``);
    ``gates``: name → (low, high) of the uniform gate values fed to ``memorize``; ``flops``: forward model FLOPs.
    """
    name: str
    spec: dict
    chunk_size: int
    kernel: str
    gates: dict
    flops: Callable


GDN_GATES = {"lr": (0.1, 0.9), "retention": (0.9, 0.999)}
WINDOW_GATES = {**GDN_GATES, "window": (0.5, 1.0)}
MOMENTUM_GATES = {"lr": (0.02, 0.2), "momentum": (0.5, 0.9), "retention": (0.9, 0.999)}
DEEP_WINDOW_GATES = {"lr": (0.02, 0.2), "retention": (0.9, 0.999), "window": (0.5, 1.0)}   # (a deep memory diverges
                                                                                           # at η up to 0.9)
CASES = {c.name: c for c in (
    MemoryCase("gdn", GDN, 1, "chunk", GDN_GATES, lambda B, T, H, D: flops_delta(B, T, H, D, D)),
    MemoryCase("gla", {"memory": LINEAR0, "attentional_bias": "dot",
                       "retention": {"name": "decay", "placement": "after_step", "channel_wise": True}},
               1, "chunk", GDN_GATES, lambda B, T, H, D: flops_delta(B, T, H, D, D)),
    MemoryCase("omega_c1", {**GDN, "window": {"size": 1}}, 1, "chunk", WINDOW_GATES, flops_omega(1)),
    MemoryCase("omega_c4", {**GDN, "window": {"size": 4}}, 1, "chunk", WINDOW_GATES, flops_omega(4)),
    MemoryCase("titans_linear_momentum", {"memory": "linear", "inner_optimizer": "momentum", "retention": "decay"},
               16, "chunk_momentum", MOMENTUM_GATES, flops_momentum(16)),
    MemoryCase("titans_mlp", {"memory": "mlp", "inner_optimizer": "momentum", "retention": "decay"},
               16, "mlp_step", MOMENTUM_GATES, flops_mlp(16)),
    MemoryCase("omeganet_mlp", {"memory": {"name": "mlp", "residual": False}, "retention": "decay",
                                "window": {"size": 4}}, 16, "mlp_step", DEEP_WINDOW_GATES, flops_mlp(16)),
)}


class NotRunnable(Exception):
    """The row's kernel would not run for this call (its message says why): the row is neither gated nor timed."""


@contextlib.contextmanager
def chunk_kernel_only():
    """``memorize(mode="triton")`` takes the chunk kernel at every T (not the token-by-token one at T ≤ 64)."""
    saved, tk.RECURRENT_MAX_T = tk.RECURRENT_MAX_T, 0
    try:
        yield
    finally:
        tk.RECURRENT_MAX_T = saved


def build_parts(case: MemoryCase, H: int, D: int, dtype, device):
    """The case's built memory (seeded learned parameters) in ``dtype`` on ``device``."""
    torch.manual_seed(0)
    return build_memory(case.spec, H, D, D).to(device=device, dtype=dtype)


def memory_problem(case: MemoryCase, B, T, H, D, dtype, device, seed=0):
    """Inputs ``[q, k, v]`` (q, k ℓ2-normalised), the gates dict and the output cotangent ``do``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g)
    channel_wise = isinstance(case.spec.get("retention"), dict) and case.spec["retention"].get("channel_wise")
    shape = lambda n: (B, T, H, D) if (n == "retention" and channel_wise) else (B, T, H)   # noqa: E731
    gates = {n: lo + (hi - lo) * torch.rand(*shape(n), generator=g) for n, (lo, hi) in case.gates.items()}
    do = torch.randn(B, T, H, D, generator=g)
    cast = lambda x: x.to(device=device, dtype=dtype)   # noqa: E731
    return [cast(x) for x in (q, k, v)], {n: cast(x) for n, x in gates.items()}, cast(do)


def memory_step(case: MemoryCase, parts, mode, inputs, gates, do, backward=True, block_size=64):
    """One forward (+ backward) of the memory → ``[o, dq, dk, dv, d(each gate)]`` (just ``[o]`` without backward)."""
    leaves = [x.detach().requires_grad_(backward) for x in inputs]
    gl = {n: x.detach().requires_grad_(backward) for n, x in gates.items()}
    with torch.set_grad_enabled(backward), chunk_kernel_only():
        o, _ = memorize(*leaves, parts, gl, mode=mode, chunk_size=case.chunk_size, block_size=block_size)
        if not backward:
            return [o]
        grads = torch.autograd.grad(o, leaves + list(gl.values()), do)
    return [o, *grads]


def triton_reason(case: MemoryCase, parts, q) -> Optional[str]:
    """None when ``memorize(mode="triton")`` runs ``case.kernel`` for this call, else why not."""
    if case.kernel == "mlp_step":
        if tk.select_mlp_step(parts, q) is not None:
            return None
        if tk.forced_torch() or not tk.available():
            return tk.explain(parts, q, case.chunk_size)
        return tk.device_ok(q) or tk.mlp_reason(parts) or "the MLP step was not selected"
    with chunk_kernel_only():
        engine = tk.select_kernel(parts, q, case.chunk_size)
    if engine is None:
        return tk.explain(parts, q, case.chunk_size) or "no kernel selected"
    return None if engine.kernel == case.kernel else f"dispatch picks '{engine.kernel}', not '{case.kernel}'"


def rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def compare(outs, refs) -> float:
    """Max RMS-error ratio over paired tensors (NaN propagates: a NaN ratio fails every gate)."""
    ratios = [rms_ratio(a, r) for a, r in zip(outs, refs, strict=True)]
    return float("nan") if any(r != r for r in ratios) else max(ratios)


def reference_outputs(case: MemoryCase, parts, problem):
    """The fp32 torch ``chunked`` reference of ``problem`` (cast up from the run dtype: the same rounded inputs)."""
    inputs, gates, do = problem
    ref_parts = copy.deepcopy(parts).float()
    return memory_step(case, ref_parts, "chunked", [x.float() for x in inputs],
                       {n: x.float() for n, x in gates.items()}, do.float())


def gate_memory(case: MemoryCase, parts, B, T, H, D, dtype, device) -> float:
    """``memorize(mode="triton")`` in ``dtype`` vs the fp32 ``chunked`` reference, same call: max RMS-error ratio
    over o and every input gradient. Raises :class:`NotRunnable` when the triton mode would not run the kernel."""
    problem = memory_problem(case, B, T, H, D, dtype, device, seed=1)
    why = triton_reason(case, parts, problem[0][0])
    if why is not None:
        raise NotRunnable(f"kernel '{case.kernel}' not selected: {why}")
    return compare(memory_step(case, parts, "triton", *problem), reference_outputs(case, parts, problem))


def document_lengths(T: int, n: int, seed: int = 0) -> list:
    """``n`` document lengths ≥ 1 summing to T (uniform random cut points, seeded): a packed batch's ragged docs."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - 1, generator=g)[:n - 1].add(1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [T])]


def packed_step(parts, lengths, inputs, gates, do, layout: str, backward=True):
    """GDN on ``len(lengths)`` documents, one forward (+ backward) → ``[o, dq, dk, dv, d(each gate)]`` in the packed
    order. ``layout``: ``packed`` (one ``[1, ΣT_i]`` call with ``cu_seqlens``, mode triton), ``padded`` (the docs
    right-padded to ``[N, max T_i]``, one triton call: what is done without varlen support), or ``loop`` (each doc
    alone through the torch ``chunked`` engine: the definition, the gate's reference)."""
    leaves = [x.detach().requires_grad_(backward) for x in inputs]
    gl = {n: x.detach().requires_grad_(backward) for n, x in gates.items()}
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    with torch.set_grad_enabled(backward), chunk_kernel_only():
        if layout == "packed":
            o, _ = memorize(*leaves, parts, gl, mode="triton", chunk_size=1, cu_seqlens=offsets)
        elif layout == "loop":
            o, _ = memorize(*leaves, parts, gl, mode="chunked", chunk_size=1, cu_seqlens=offsets)
        else:
            L = max(lengths)

            def pad(x, value=0.0):   # [1, ΣT, …] → [N, L, …]; what follows a doc's end changes nothing before it
                return torch.stack([torch.nn.functional.pad(x[0, a:b], [0, 0] * (x.dim() - 2) + [0, L - (b - a)],
                                                            value=value)
                                    for a, b in zip(offsets[:-1], offsets[1:])])
            # padded α = 1 (no decay), lr 0 (no write): the padding leaves the final memories as the real tokens left them
            o_pad, _ = memorize(*(pad(x) for x in leaves), parts,
                                {n: pad(x, 1.0 if n == "retention" else 0.0) for n, x in gl.items()},
                                mode="triton", chunk_size=1)
            o = torch.cat([o_pad[i:i + 1, :n] for i, n in enumerate(lengths)], 1)
        if not backward:
            return [o]
        grads = torch.autograd.grad(o, leaves + list(gl.values()), do)
    return [o, *grads]


def gate_packed(parts, T, H, D, docs, dtype, device, layout="packed") -> float:
    """The packed (or padded) GDN call vs each document alone on the fp32 torch engine: max RMS-error ratio over o
    and every input gradient. Raises :class:`NotRunnable` when the triton mode has no native packed kernel."""
    lengths = document_lengths(T, docs, seed=1)
    inputs, gates, do = memory_problem(CASES["gdn"], 1, T, H, D, dtype, device, seed=1)
    why = triton_reason(CASES["gdn"], parts, inputs[0])        # fresh documents: no state, no window history
    if why is None and layout == "packed" and tk._packed_kernel_kind(parts, inputs[0], 1, []) is None:
        why = "the packed dispatch found no native kernel"
    if why is not None:
        raise NotRunnable(f"kernel 'chunk' not selected: {why}")
    ref_parts = copy.deepcopy(parts).float()
    ref = packed_step(ref_parts, lengths, [x.float() for x in inputs], {n: x.float() for n, x in gates.items()},
                      do.float(), "loop")
    return compare(packed_step(parts, lengths, inputs, gates, do, layout), ref)


def gate_recurrent(B, T, H, D, dtype, device):
    """The token-by-token GDN kernel's forward (o, final state) vs the fp32 torch chunk reference."""
    from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_forward
    from atlaslab.kernels.delta_rule.naive import delta_rule_chunk
    (q, k, v), gates, _ = memory_problem(CASES["gdn"], B, T, H, D, dtype, device, seed=2)
    gdn = dict(bias="l2", placement="before_step", read="token")
    o, h = fused_recurrent_forward(q, k, v, gates["lr"], gates["retention"], **gdn)
    o_r, h_r = delta_rule_chunk(q.float(), k.float(), v.float(), gates["lr"].float(), gates["retention"].float(), **gdn)
    return compare([o, h], [o_r, h_r])


def gate_ns(n, D, dtype, device):
    """The fused Newton–Schulz kernel vs the torch reference (fp32): output and input gradient."""
    from atlaslab.kernels.newton_schulz.fused import newton_schulz as ns_triton
    s = torch.randn(n, D, D, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    w = torch.randn(n, D, D, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    a, b = s.clone().requires_grad_(), s.float().clone().requires_grad_()
    ya, yb = ns_triton(a), ns_torch(b)
    (ga,), (gb,) = torch.autograd.grad(ya, a, w), torch.autograd.grad(yb, b, w.float())
    return compare([ya, ga], [yb, gb])


# ------------------------------------------------------------------------------------------------ fla (optional)

def _append_peers() -> None:
    """bench/.peers at the END of sys.path (a peer never shadows an installed package)."""
    if PEERS.is_dir() and str(PEERS) not in sys.path:
        sys.path.append(str(PEERS))


def load_fla_kernel():
    """fla's ``chunk_gated_delta_rule`` (CUDA only) → ``(fn, None)``, or ``(None, reason)`` when it cannot run."""
    if not HAS_CUDA:
        return None, "no GPU (fla's Triton kernel needs CUDA)"
    try:
        if importlib.util.find_spec("fla") is None:
            _append_peers()
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule, None
    except Exception as exc:   # not installed, or a broken / incompatible install: the row stays optional
        where = "" if PEERS.is_dir() else " (fla-core not installed; python bench/peers.py --install)"
        return None, f"fla not importable{where}: {type(exc).__name__}: {str(exc)[:160]}"


def load_fla_naive():
    """fla's ``naive_chunk_gated_delta_rule`` (plain torch, from bench/.peers by file path), or None."""
    if not FLA_NAIVE.exists():
        return None
    _append_peers()   # naive.py imports einops, which bench/.peers holds
    spec = importlib.util.spec_from_file_location("fla_naive_gated_delta_rule", FLA_NAIVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda q, k, v, g, beta, scale: module.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64,
                                                                               scale=scale)


def fla_step(fla_fn, inputs, gates, do, backward=True):
    """fla on our GDN problem (β = lr, g = log α, scale = 1) → ``[o, dq, dk, dv, d lr, d retention]`` like ours."""
    leaves = [x.detach().requires_grad_(backward) for x in inputs]
    lr, alpha = (gates[n].detach().requires_grad_(backward) for n in ("lr", "retention"))
    with torch.set_grad_enabled(backward):
        o = fla_fn(*leaves, alpha.float().log(), lr, scale=1.0)[0]   # g in fp32, as fla's layers pass it
        if not backward:
            return [o]
        grads = torch.autograd.grad(o, leaves + [lr, alpha], do)
    return [o, *grads]


def gate_fla(fla_fn, B, T, H, D, dtype, device) -> float:
    """fla's outputs and gradients vs our GDN (the fp32 torch ``chunked`` reference) on the same call."""
    case = CASES["gdn"]
    problem = memory_problem(case, B, T, H, D, dtype, device, seed=1)
    return compare(fla_step(fla_fn, *problem), reference_outputs(case, build_parts(case, H, D, dtype, device), problem))


# ------------------------------------------------------------------------------------------------ rows

def tolerance(dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 2e-2


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def timeit(fn, reps: int, budget_s: float = float("inf"), warmup: int = 2 if HAS_CUDA else 1):
    """(median seconds, timed repeats) of ``fn()``, synchronised on CUDA: up to ``warmup`` untimed runs
    (compilation; the second is dropped when the first alone took ``budget_s``), then up to ``reps`` timed ones,
    stopping once ``budget_s`` seconds of timed runs are spent (at least 2)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
        sync()
        if time.perf_counter() - t0 > budget_s:
            break
    times = []
    while len(times) < reps and (len(times) < 2 or sum(times) < budget_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def row(op, impl, T, args, pass_="fwd+bwd", seconds=None, flops=None, gate=None, note="", tokens=None,
        reps=None, gate_T=None):
    """One result row; tokens/s and TFLOP/s only when a time was measured."""
    tokens = args.batch * T if tokens is None else tokens
    r = {"op": op, "impl": impl, "T": T, "B": args.batch, "H": args.heads, "D": args.dim, "dtype": args.dtype,
         "pass": pass_, "seconds": seconds, "reps": reps, "tokens_per_s": None, "tflops": None, "gate_ratio": gate,
         "gate_T": gate_T, "note": note}
    if seconds:
        r["tokens_per_s"] = tokens / seconds
        r["tflops"] = flops / seconds / 1e12 if flops else None
    return r


def past_deadline(args) -> Optional[str]:
    """The skip note once ``--deadline`` seconds have passed since the run started, else None."""
    if time.perf_counter() - args.start > args.deadline:
        return f"skipped: --deadline {args.deadline:g} s reached"
    return None


def failure(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {str(exc)[:120]}"


def torch_row(op, impl, T, args, fn, flops, skip: Optional[str] = None, tokens=None, note="", pass_="fwd+bwd"):
    """A torch row: timed (no gate; it is the reference) unless skipped or past the deadline."""
    skip = skip or past_deadline(args)
    if skip:
        return row(op, impl, T, args, pass_, note=skip, tokens=tokens)
    try:
        s, n = timeit(fn, args.reps, args.row_budget)
    except (RuntimeError, MemoryError) as exc:   # e.g. out of memory
        return row(op, impl, T, args, pass_, note=failure(exc), tokens=tokens)
    return row(op, impl, T, args, pass_, seconds=s, flops=flops, note=note, tokens=tokens, reps=n)


def gated_row(op, impl, T, args, gate, time_fn, flops, tol, pass_="fwd+bwd", note="", tokens=None, gate_T=None):
    """A Triton (or fla) row: no speed on a red gate.

    Args:
        gate: a callable returning the gate's RMS-error ratio (run now; it may raise :class:`NotRunnable`), or a
            ratio (or the exception) of a gate run earlier in this run (the CPU interpreter gates), or None.
        time_fn: the step to time, or None when this row cannot be timed here (``note`` says why).
        tol: the gate passes when ratio ≤ tol (a NaN ratio fails).

    Returns:
        the row: a time only when the gate passed and ``time_fn`` is given; a failed gate's ratio and a note.
    """
    skip = past_deadline(args)
    if skip:
        return row(op, impl, T, args, pass_, note=skip, tokens=tokens)
    try:
        ratio = gate() if callable(gate) else gate
        if isinstance(ratio, Exception):   # an earlier gate's failure (the interpreter gates)
            raise ratio
    except NotRunnable as exc:
        return row(op, impl, T, args, pass_, note=f"not timed: {exc}", tokens=tokens)
    except (RuntimeError, MemoryError, ValueError) as exc:
        return row(op, impl, T, args, pass_, note=f"gate {failure(exc)}", tokens=tokens)
    if ratio is None:
        return row(op, impl, T, args, pass_, note=note or "not timed: no gate ran", tokens=tokens)
    if not ratio <= tol:
        return row(op, impl, T, args, pass_, gate=ratio, gate_T=gate_T, tokens=tokens,
                   note=f"CORRECTNESS GATE FAILED (ratio {ratio:.2e} > {tol:g}): no speed reported")
    if time_fn is None:
        return row(op, impl, T, args, pass_, gate=ratio, gate_T=gate_T, note=note, tokens=tokens)
    try:
        s, n = timeit(time_fn, args.reps, args.row_budget)
    except (RuntimeError, MemoryError) as exc:
        return row(op, impl, T, args, pass_, gate=ratio, gate_T=gate_T, note=failure(exc), tokens=tokens)
    return row(op, impl, T, args, pass_, seconds=s, flops=flops, gate=ratio, gate_T=gate_T, note=note,
               tokens=tokens, reps=n)


# ------------------------------------------------------------------------------------------------ the run

TINY = dict(B=1, T=37, H=2, D=16)   # the interpreter gates' shapes (T: two b = 16 chunks and a partial one)


def _outcome(gate: Callable):
    """A gate's ratio, or the exception it raised (kept for the row's note)."""
    try:
        return gate()
    except (NotRunnable, RuntimeError, ValueError) as exc:
        return exc


def interpreter_gates() -> dict:
    """No GPU: every gate once, in fp32 under the Triton interpreter on tiny shapes → {row key: ratio, exception
    or None (fla's naive reference not installed)}."""
    B, T, H, D = TINY.values()
    f32 = torch.float32
    out = {c.name: _outcome(lambda c=c: gate_memory(c, build_parts(c, H, D, f32, "cpu"), B, T, H, D, f32, "cpu"))
           for c in CASES.values()}
    out["fused_recurrent"] = _outcome(lambda: gate_recurrent(B, T, H, D, f32, "cpu"))
    for layout in ("packed", "padded"):
        out[f"gdn_docs_{layout}"] = _outcome(lambda layout=layout: gate_packed(
            build_parts(CASES["gdn"], H, D, f32, "cpu"), T, H, D, 3, f32, "cpu", layout))
    out["newton_schulz"] = _outcome(lambda: gate_ns(3, D, f32, "cpu"))
    naive = load_fla_naive()
    out[FLA_IMPL] = None if naive is None else _outcome(lambda: gate_fla(naive, B, T, H, D, f32, "cpu"))
    return out


def chunked_row(case: MemoryCase, T, args, ctx, parts, problem, flops, skip) -> dict:
    """``torch-chunked`` in the run dtype; when the engine has no kernel for that dtype (torch's triangular solve
    takes no bf16 / fp16), in fp32 instead: the row's dtype and note say so."""
    r = torch_row(case.name, "torch-chunked", T, args, lambda: memory_step(case, parts, "chunked", *problem), flops,
                  skip=skip)
    if r["seconds"] is None and "NotImplementedError" in r["note"] and ctx["dtype"] != torch.float32:
        p32 = copy.deepcopy(parts).float()
        inputs, gates, do = problem
        up = ([x.float() for x in inputs], {n: x.float() for n, x in gates.items()}, do.float())
        r = torch_row(case.name, "torch-chunked", T, args, lambda: memory_step(case, p32, "chunked", *up), flops,
                      note=f"in fp32: {args.dtype} {r['note']}")
        r["dtype"] = "fp32"
    return r


def memory_rows(case: MemoryCase, T, args, ctx) -> list:
    """``torch-chunked`` and the gated ``triton`` row of one memory case at length T."""
    B, H, D, dtype, device = args.batch, args.heads, args.dim, ctx["dtype"], ctx["device"]
    parts = ctx["parts"][case.name]
    problem = memory_problem(case, B, T, H, D, dtype, device)
    fl = 3 * case.flops(B, T, H, D)
    cpu_skip = (f"skipped on CPU above T = {args.cpu_max_T}" if device == "cpu" and T > args.cpu_max_T else None)
    impl = "triton-chunk" if case.name == "gdn" else "triton"
    rows = [chunked_row(case, T, args, ctx, parts, problem, fl, cpu_skip)]
    if ctx["timed"]:
        gT = min(T, args.gate_max_T)
        rows.append(gated_row(case.name, impl, T, args, lambda: gate_memory(case, parts, B, gT, H, D, dtype, device),
                              lambda: memory_step(case, parts, "triton", *problem), fl, ctx["tol"], gate_T=gT))
    else:
        rows.append(gated_row(case.name, impl, T, args, ctx["gates"].get(case.name), None, fl, 1e-3,
                              note=NOT_TIMED if case.name in ctx["gates"] else ctx["why_not"], gate_T=TINY["T"]))
    return rows


def recurrent_row(T, args, ctx) -> dict:
    """The token-by-token GDN kernel, forward only (gated)."""
    from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_forward
    B, H, D, dtype, device = args.batch, args.heads, args.dim, ctx["dtype"], ctx["device"]
    fl = 4 * B * T * H * D * D
    if not ctx["timed"]:
        return gated_row("gdn", "triton-fused_recurrent", T, args, ctx["gates"].get("fused_recurrent"), None, fl,
                         1e-3, "fwd", note=NOT_TIMED if ctx["gates"] else ctx["why_not"], gate_T=TINY["T"])
    (q, k, v), g, _ = memory_problem(CASES["gdn"], B, T, H, D, dtype, device)
    gT = min(T, args.gate_max_T)
    return gated_row("gdn", "triton-fused_recurrent", T, args, lambda: gate_recurrent(B, gT, H, D, dtype, device),
                     lambda: fused_recurrent_forward(q, k, v, g["lr"], g["retention"], bias="l2",
                                                     placement="before_step", read="token"), fl, ctx["tol"], "fwd",
                     gate_T=gT)


def fla_row(T, args, ctx) -> dict:
    """fla's chunk_gated_delta_rule on the GDN problem (gated against our GDN); optional."""
    B, H, D, dtype, device = args.batch, args.heads, args.dim, ctx["dtype"], ctx["device"]
    fl = 3 * flops_delta(B, T, H, D, D)
    fn, why = ctx["fla"]
    if fn is None:
        if "gates" in ctx and ctx["gates"].get(FLA_IMPL) is not None:   # CPU: the mapping, gated with fla's naive
            return gated_row("fla_chunk_gdn", FLA_IMPL, T, args, ctx["gates"][FLA_IMPL], None, fl, 1e-3,
                             gate_T=TINY["T"], note=f"not measured: {why}; gate: the input mapping, vs fla's "
                                                    "naive_chunk_gated_delta_rule (interpreter shapes)")
        return row("fla_chunk_gdn", FLA_IMPL, T, args, note=f"not measured: {why}")
    problem = memory_problem(CASES["gdn"], B, T, H, D, dtype, device)
    gT = min(T, args.gate_max_T)
    return gated_row("fla_chunk_gdn", FLA_IMPL, T, args, lambda: gate_fla(fn, B, gT, H, D, dtype, device),
                     lambda: fla_step(fn, *problem), fl, ctx["tol"], gate_T=gT)


def packed_rows(T, args, ctx) -> list:
    """GDN on ``--docs`` ragged documents totalling T tokens: packed with ``cu_seqlens`` (one kernel call) vs the
    same documents right-padded to a batch (both triton, gated against each document alone), and the torch loop."""
    H, D, dtype, device, n = args.heads, args.dim, ctx["dtype"], ctx["device"], args.docs
    parts = ctx["parts"]["gdn"]
    lengths = document_lengths(T, n)
    inputs, gates, do = memory_problem(CASES["gdn"], 1, T, H, D, dtype, device)
    problem = (lengths, inputs, gates, do)
    fl = 3 * flops_delta(1, T, H, D, D)
    padded_tokens = n * max(lengths)
    note = f"{n} docs, longest {max(lengths)}"
    cpu_skip = (f"skipped on CPU above T = {args.cpu_max_T}" if device == "cpu" and T > args.cpu_max_T else None)
    rows = [torch_row("gdn_docs", "torch-chunked-loop", T, args, lambda: packed_step(parts, *problem, "loop"), fl,
                      skip=cpu_skip, tokens=T, note=note)]
    for layout in ("packed", "padded"):
        impl = f"triton-{layout}"
        if ctx["timed"]:
            gT = min(T, args.gate_max_T)
            rows.append(gated_row("gdn_docs", impl, T, args,
                                  lambda layout=layout: gate_packed(parts, gT, H, D, n, dtype, device, layout),
                                  lambda layout=layout: packed_step(parts, *problem, layout), fl, ctx["tol"],
                                  tokens=T, gate_T=gT,
                                  note=note + (f"; {padded_tokens} padded tokens" if layout == "padded" else "")))
        else:
            rows.append(gated_row("gdn_docs", impl, T, args, ctx["gates"].get(f"gdn_docs_{layout}"), None, fl, 1e-3,
                                  note=NOT_TIMED if ctx["gates"] else ctx["why_not"], gate_T=TINY["T"], tokens=T))
    return rows


def sdpa_row(T, args, ctx) -> dict:
    """torch causal SDPA, forward+backward, FlashAttention's kernel forced in half precision on CUDA."""
    B, H, D, dtype, device = args.batch, args.heads, args.dim, ctx["dtype"], ctx["device"]
    inputs, _, do = memory_problem(CASES["gdn"], B, T, H, D, dtype, device)
    qs, ks, vs = (x.transpose(1, 2).detach().requires_grad_() for x in inputs)
    flash = HAS_CUDA and dtype != torch.float32

    def sdpa():
        with sdpa_backend(flash):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.autograd.grad(o, (qs, ks, vs), do.transpose(1, 2))
    skip = (f"skipped on CPU above T = {args.cpu_sdpa_max_T}" if device == "cpu" and T > args.cpu_sdpa_max_T
            else None)
    note = "FlashAttention backend" if flash else ("default backend (fp32: not FlashAttention)" if HAS_CUDA else "")
    return torch_row("attention", "torch-sdpa", T, args, sdpa, 3.5 * flops_sdpa(B, T, H, D), skip=skip, note=note)


def sdpa_backend(flash: bool):
    """The FlashAttention SDPA backend when ``flash``, else torch's default choice."""
    if not flash:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def ns_rows(T, args, ctx) -> list:
    """Newton–Schulz, one D × D matrix per token and head (capped on CPU): torch and the gated fused kernel."""
    from atlaslab.kernels.newton_schulz.fused import newton_schulz as ns_triton
    B, H, D, dtype, device = args.batch, args.heads, args.dim, ctx["dtype"], ctx["device"]
    n = B * T * H if device == "cuda" else min(B * T * H, args.cpu_ns_max)
    s_in = torch.randn(n, D, D, device=device, dtype=dtype)
    w = torch.randn_like(s_in)
    fl = 3 * flops_ns(n, D, D)
    note = "" if n == B * T * H else f"{n} matrices (CPU cap, not B·T·H); tokens/s = matrices/H per s"

    def step(fn):
        x = s_in.detach().requires_grad_()
        torch.autograd.grad(fn(x), x, w)
    rows = [torch_row("newton_schulz", "torch", T, args, lambda: step(ns_torch), fl, tokens=n / H, note=note)]
    if not ctx["timed"]:
        rows.append(gated_row("newton_schulz", "triton-fused", T, args, ctx["gates"].get("newton_schulz"), None, fl,
                              1e-3, note=NOT_TIMED if ctx["gates"] else ctx["why_not"], tokens=n / H))
    else:
        gn = min(n, 4096)
        rows.append(gated_row("newton_schulz", "triton-fused", T, args, lambda: gate_ns(gn, D, dtype, device),
                              lambda: step(ns_triton), fl, ctx["tol"], note=note, tokens=n / H))
    return rows


def context(args) -> dict:
    """What every row needs: device, dtype, tolerance, built parts, whether Triton is timed (else the
    interpreter gates, or why the kernels cannot run at all), and fla's kernel (or why not)."""
    device = "cuda" if HAS_CUDA else "cpu"
    dtype = DTYPES[args.dtype]
    ctx = {"device": device, "dtype": dtype, "tol": tolerance(dtype),
           "parts": {c.name: build_parts(c, args.heads, args.dim, dtype, device) for c in CASES.values()},
           "timed": HAS_CUDA and tk.available() and not tk.forced_torch(), "gates": {}, "why_not": NOT_TIMED,
           "fla": load_fla_kernel()}
    if not ctx["timed"]:
        if tk.available() and not tk.forced_torch():
            t0 = time.perf_counter()
            ctx["gates"] = interpreter_gates()
            print(f"[gate, interpreter, tiny shapes {TINY}, {time.perf_counter() - t0:.1f} s] max RMS-error ratios: "
                  + ", ".join(f"{k} {v if isinstance(v, Exception) else fmt(v, '.1e')}"
                             for k, v in ctx["gates"].items()), flush=True)
        else:
            ctx["why_not"] = ("not timed: " + ("ATLASLAB_FORCE_TORCH is set" if tk.forced_torch() else
                              "triton is not installed" if not tk.triton_importable() else "Triton cannot run here"))
            print(f"[gate] Triton kernels not runnable here: {ctx['why_not']}")
    return ctx


def run(args) -> list:
    """Every row at every T (in order of T, so a deadline cuts the longest first)."""
    args.start = getattr(args, "start", time.perf_counter())
    ctx = context(args)
    rows = []
    for T in args.T:
        print(f"T = {T} ({time.perf_counter() - args.start:.0f} s in)", flush=True)
        n0 = len(rows)
        rows += memory_rows(CASES["gdn"], T, args, ctx)
        rows.append(recurrent_row(T, args, ctx))
        rows.append(fla_row(T, args, ctx))
        rows.append(sdpa_row(T, args, ctx))
        rows += packed_rows(T, args, ctx)
        for name in ("gla", "omega_c1", "omega_c4", "titans_linear_momentum", "titans_mlp", "omeganet_mlp"):
            rows += memory_rows(CASES[name], T, args, ctx)
        rows += ns_rows(T, args, ctx)
        for r in rows[n0:]:
            print(f"  {r['op']:>24} {r['impl']:>24} {fmt(r['seconds'] and r['seconds'] * 1e3, '10.3f')} ms  "
                  f"gate {fmt(r['gate_ratio'], '.1e')}  {r['note']}", flush=True)
        if HAS_CUDA:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ targets

TARGETS = [   # (key, statement, numerator (op, impl), denominator (op, impl), bound, strict, min T)
    ("a", "Gated-DeltaNet spec within 1.3× of fla's chunk_gated_delta_rule (fwd+bwd time, ours / fla ≤ 1.3)",
     ("gdn", "triton-chunk"), ("fla_chunk_gdn", FLA_IMPL), 1.3, False, 0),
    ("b", "linear-memory Omega kernel with c = 4 within 1.5× of c = 1 (fwd+bwd time, c4 / c1 ≤ 1.5)",
     ("omega_c4", "triton"), ("omega_c1", "triton"), 1.5, False, 0),
    ("c", "faster than FlashAttention (torch SDPA) at T ≥ 8K (fwd+bwd time, gdn triton-chunk / SDPA < 1)",
     ("gdn", "triton-chunk"), ("attention", "torch-sdpa"), 1.0, True, 8192),
]


def _find(rows, T, key):
    return next((r for r in rows if r["T"] == T and (r["op"], r["impl"]) == key), None)


def _why_missing(r) -> str:
    if r is None:
        return "row absent"
    return r["note"] or "no time"


def evaluate_target(rows, Ts, key, text, num, den, bound, strict, min_T) -> dict:
    """One target: the measured ratio at each T (≥ min_T) and its status (met / not met / not measured: why)."""
    per_T, missing = {}, {}
    for T in (t for t in Ts if t >= min_T):
        a, b = _find(rows, T, num), _find(rows, T, den)
        if a and b and a["seconds"] and b["seconds"]:
            per_T[T] = a["seconds"] / b["seconds"]
        else:
            missing[T] = "; ".join(f"{'/'.join(k)}: {_why_missing(r)}" for k, r in ((num, a), (den, b))
                                   if not (r and r["seconds"]))
    ok = [(x < bound) if strict else (x <= bound) for x in per_T.values()]
    if not Ts or not any(t >= min_T for t in Ts):
        status = f"not measured: no T ≥ {min_T} in this run"
    elif not per_T:
        status = "not measured: " + " | ".join(f"T={T}: {why}" for T, why in missing.items())
    else:
        status = "met" if all(ok) else "not met"
        if missing:
            status += " (at measured T; not measured at " + ", ".join(f"T={T}" for T in missing) + ")"
    return {"target": key, "statement": text, "bound": bound, "ratio_by_T": per_T, "status": status,
            "not_measured": missing}


def evaluate_targets(rows, Ts) -> list:
    return [evaluate_target(rows, Ts, *t) for t in TARGETS]


def throughput(rows, Ts) -> list:
    """(d): every fwd+bwd Triton / fla memory row's tokens/s and TFLOP/s, and its speed-up (time ratio) over the
    same op's ``torch-chunked`` row (fla: gdn's) and over SDPA at the same T."""
    def speedup(ref, r):
        return ref["seconds"] / r["seconds"] if (ref and ref["seconds"] and r["seconds"]) else None

    out = []
    for T in Ts:
        sdpa = _find(rows, T, ("attention", "torch-sdpa"))
        for r in rows:
            if r["T"] != T or r["pass"] != "fwd+bwd" or r["impl"] == "torch-chunked" or \
                    r["op"] not in (*CASES, "fla_chunk_gdn"):
                continue
            ref = _find(rows, T, ("gdn" if r["op"] == "fla_chunk_gdn" else r["op"], "torch-chunked"))
            out.append({"op": r["op"], "impl": r["impl"], "T": T, "tokens_per_s": r["tokens_per_s"],
                        "tflops": r["tflops"], "x_vs_torch_chunked": speedup(ref, r), "x_vs_sdpa": speedup(sdpa, r),
                        "dtype": r["dtype"], "torch_chunked_dtype": ref and ref["dtype"]})
    return out


# ------------------------------------------------------------------------------------------------ report

def device_slug() -> str:
    if not HAS_CUDA:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def target_lines(targets) -> list:
    lines = ["## Targets (issue 6)", "", "| target | statement | ratio by T | status |", "|---|---|---|---|"]
    for t in targets:
        ratios = ", ".join(f"T={T}: {x:.2f}×" for T, x in t["ratio_by_T"].items()) or "—"
        lines.append(f"| ({t['target']}) | {t['statement']} | {ratios} | {t['status']} |")
    return lines + ["| (d) | forward+backward throughput (tokens/s, achieved TFLOP/s) vs torch-chunked and SDPA at "
                    "T ∈ {2K, 8K, 32K} | see the throughput table | measured where timed |", ""]


def _dtype_mark(r) -> str:
    """`` (vs fp32)`` when the torch-chunked row ran in fp32 for want of a half-precision kernel."""
    return " (vs fp32)" if r["x_vs_torch_chunked"] and r["torch_chunked_dtype"] not in (None, r["dtype"]) else ""


def throughput_lines(tp) -> list:
    lines = ["## Throughput, forward+backward (× = speed-up: the other row's time / this row's)", "",
             "| op | impl | T | tokens/s | TFLOP/s | × vs torch-chunked | × vs SDPA |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['impl']} | {r['T']} | {fmt(r['tokens_per_s'], '.3g')} | {fmt(r['tflops'], '.3g')} | "
              f"{fmt(r['x_vs_torch_chunked'], '.2f')}{_dtype_mark(r)} | {fmt(r['x_vs_sdpa'], '.2f')} |" for r in tp]
    return lines + [""]


def row_lines(rows) -> list:
    lines = ["## All rows", "",
             "| op | impl | T | pass | ms | reps | tokens/s | TFLOP/s | gate ratio | gate T | note |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ms = None if r["seconds"] is None else r["seconds"] * 1e3
        lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['pass']} | {fmt(ms, '.2f')} | "
                     f"{fmt(r.get('reps'), 'd')} | {fmt(r['tokens_per_s'], '.3g')} | {fmt(r['tflops'], '.3g')} | "
                     f"{fmt(r['gate_ratio'], '.1e')} | {fmt(r.get('gate_T'), 'd')} | {r['note']} |")
    return lines


def write(rows, args, meta) -> Path:
    """``args.out``/kernels_<device>.{json,md}: meta, targets, throughput, every row; → the path stem."""
    out = {"meta": meta, "targets": evaluate_targets(rows, meta["T"]), "throughput": throughput(rows, meta["T"]),
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernels_{meta['device']}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    md = render(out)
    stem.with_suffix(".md").write_text(md)
    print(md, end="")
    print(f"wrote {stem}.json and {stem}.md")
    return stem


def render(out: dict) -> str:
    """``kernels_<device>.md`` from its JSON alone: the rows and the run's settings in ``meta`` (targets and
    throughput are recomputed from the rows). A setting the run did not record (a file written before it was) is
    left out of the header, and a value a row lacks prints as —."""
    meta, rows = out["meta"], out["rows"]
    targets, tp = evaluate_targets(rows, meta["T"]), throughput(rows, meta["T"])
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "fla") if k in meta)
    wall = f"; {meta['wall_s']:.0f} s in all" if "wall_s" in meta else ""
    precision = (f" (float32 matmul precision {meta['float32_matmul_precision']})"
                 if "float32_matmul_precision" in meta else "")
    budget = (f" (fewer once a row's {meta['row_budget']:g} s budget is spent: the reps column)"
              if "row_budget" in meta else "")
    lines = [f"# Kernel benchmark on {meta['device_name']}", "",
             f"`{meta['command']}` — {versions}, {meta['date']}{wall}.",
             f"B = {meta['batch']}, H = {meta['heads']}, D = {meta['dim']}, dtype {meta['dtype']}{precision}; "
             f"median of up to {meta['reps']} runs{budget}.", ""]
    if not meta["triton_timed"]:
        shapes = f" ({meta['gate_shapes']}; ratios in the gate column)" if "gate_shapes" in meta else ""
        lines += ["**Triton kernels were NOT timed: no GPU.** On CPU Triton runs only in its interpreter "
                  "(~1000× slower than torch); its timings would say nothing about the kernels. Their "
                  f"correctness gates ran in the interpreter on tiny shapes{shapes}; "
                  "only the torch rows are timed, on CPU (shared cores: indicative).", ""]
    lines += target_lines(targets) + throughput_lines(tp) + row_lines(rows)
    lines += ["", "Model FLOPs per token·head, forward (backward = 2× forward, SDPA 2.5×): delta-rule chunk form "
              "6CK + 4CV + C²/3 + 6KV (C = 64); Omega window c: c × that; linear momentum 8KV + 4b(K + V); MLP "
              "memory (h = 4D) 16Dh + 4b(D + h); causal attention 2TD; Newton–Schulz 5·(4R²C + 2R³) per matrix; "
              "fused_recurrent forward 4KV. The momentum and MLP counts are approximate models."]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--quick", action="store_true", help="T ∈ {2K, 8K} on a GPU, T = 512 on CPU; tighter budgets")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--tf32", action="store_true",
                   help="torch.set_float32_matmul_precision('high'): fp32 rows use TF32 (torch's matmuls and the "
                        "kernels' dots, kernels/utils.py: dot_precision); half-precision rows always do")
    p.add_argument("--reps", type=int, default=None, help="most timed repeats per row (default 10 on GPU, 3 on CPU)")
    p.add_argument("--row-budget", type=float, default=None,
                   help="seconds of timed repeats per row before stopping (at least 2 repeats; default 3 GPU, 10 CPU)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which every further row is skipped (default 390, --quick 140)")
    p.add_argument("--gate-max-T", type=int, default=1 << 30, help="gate at min(T, this) (default: the timed T)")
    p.add_argument("--cpu-max-T", type=int, default=8192, help="CPU: skip the torch chunked engine above this T")
    p.add_argument("--cpu-sdpa-max-T", type=int, default=8192, help="CPU: skip SDPA above this T (T² memory)")
    p.add_argument("--cpu-ns-max", type=int, default=512, help="CPU: cap on Newton–Schulz matrices per call")
    p.add_argument("--docs", type=int, default=8, help="documents in the packed / padded GDN rows (gdn_docs)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.T = [2048, 8192] if HAS_CUDA else [512]
    args.reps = args.reps or (10 if HAS_CUDA else 3)
    args.row_budget = args.row_budget if args.row_budget is not None else (3.0 if HAS_CUDA else 10.0)
    args.deadline = args.deadline if args.deadline is not None else (140.0 if args.quick else 390.0)
    return args


def main(argv=None) -> None:
    args = parse(argv)
    args.start = time.perf_counter()
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    if not HAS_CUDA:
        torch.set_num_threads(args.threads)
    triton_version = importlib.import_module("triton").__version__ if tk.triton_importable() else None
    rows = run(args)
    fla_version = sys.modules["fla"].__dict__.get("__version__") if "fla" in sys.modules else None
    meta = {"device": device_slug(), "device_name": torch.cuda.get_device_name() if HAS_CUDA else
            f"CPU ({platform.processor() or platform.machine()}, {args.threads} threads)",
            "torch": torch.__version__, "triton": triton_version, "fla": fla_version,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "wall_s": time.perf_counter() - args.start,
            "triton_timed": any(r["impl"].startswith("triton") and r["seconds"] for r in rows),
            "T": args.T, "batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": args.dtype,
            "reps": args.reps, "row_budget": args.row_budget,
            "gate_shapes": ", ".join(f"{k} = {v}" for k, v in TINY.items())}
    write(rows, args, meta)


if __name__ == "__main__":
    main()
