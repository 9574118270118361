"""Compile every Triton kernel launch of the test suite for an H100 / H200 (sm_90) on a machine WITHOUT a GPU.

    python bench/compile_sm90.py                      # all tests/kernels/test_triton*.py → bench/results/compile_sm90.{json,md}
    python bench/compile_sm90.py -k window            # a subset (pytest's -k)
    python bench/compile_sm90.py --arch 100           # another NVIDIA target (compute capability × 10)

The Triton tests run under ``TRITON_INTERPRET=1`` on CPU, which checks the kernels' arithmetic but never compiles
them: a kernel can pass every interpreter test and still fail to compile for a GPU (a variable that only one
``if`` branch defines, a ``tl.dot`` shape under 16, an unsupported dtype combination, a reduction the backend
rejects), or compile into something that spills registers to local memory or asks for more shared memory than
the chip has. Triton's compiler itself needs no GPU: the frontend, the NVPTX backend and ``ptxas`` ship with the
wheel. So this script

1. **records** every launch while the Triton tests run in the interpreter (a subprocess running pytest with a
   hook on ``InterpretedFunction.run``): the kernel, every argument's type (a tensor's dtype and 16-byte
   alignment; a scalar's value) and the launch options (``num_warps``, ``num_stages``);
2. **compiles** each distinct launch (deduplicated by Triton's own specialization key) in a second subprocess
   with ``TRITON_INTERPRET=0`` for ``GPUTarget("cuda", arch, 32)``, by Triton's own binder (the specialization,
   constexprs and alignment attributes a real launch on that GPU would use), through to a cubin;
3. **reads** each cubin's resource usage with the bundled ``cuobjdump --dump-resource-usage``: registers per
   thread, local memory (spills / stack) and static shared memory, and Triton's dynamic shared memory; flags a
   kernel whose shared memory exceeds the target's per-block limit (227 KiB on sm_90) or that spills.

What it does not tell: speed, or whether the compiled kernel computes the right numbers on the GPU (the interpreter
checks the arithmetic; `bench/device/check.sh` runs the tests on a real GPU when one is lent). fp64 inputs (the
float64 reference tests feed some kernels fp64) compile like any other dtype here; they are reported like the rest.

Writes ``bench/results/compile_sm<arch>.{json,md}`` (``--out`` another folder). Exit status 1 when a launch fails
to compile, 0 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
#: the project's kernels live here; launches of other modules' kernels (none today) are not recorded
PACKAGE = "atlaslab.kernels"
#: largest dynamic + static shared memory per block, by compute capability × 10 (CUDA programming guide)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}


# ------------------------------------------------------------------------------------- 1. record (interpreter)

def describe(value):
    """A JSON description of one kernel argument, enough to rebuild an argument that specialises the same way."""
    import torch
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"repr": repr(value)}       # e.g. a tl.dtype constexpr: rebuilt by name


class Recorder:
    """Records every launch of a ``PACKAGE`` kernel in the interpreter (then lets it run); also a pytest plugin."""

    def __init__(self, path: Path):
        self.path, self.launches, self.source = path, collections.OrderedDict(), ""

    def install(self):
        from triton.runtime.interpreter import InterpretedFunction
        recorder, run = self, InterpretedFunction.run

        def recording_run(fn_self, *args, grid, warmup, **kwargs):
            fn = fn_self.fn
            if fn.__module__.startswith(PACKAGE):
                entry = {"module": fn.__module__, "name": fn.__name__,
                         "args": [describe(a) for a in args],
                         "kwargs": {k: describe(v) for k, v in kwargs.items()}}
                key = json.dumps(entry, sort_keys=True)
                if key in recorder.launches:
                    recorder.launches[key]["count"] += 1
                else:
                    source = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or recorder.source
                    recorder.launches[key] = {**entry, "count": 1, "test": source}
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run

    def save(self):
        self.path.write_text(json.dumps(list(self.launches.values())))

    def pytest_configure(self, config):
        self.install()


def production_calls(recorder: Recorder, dims) -> None:
    """One forward + backward of each ``bench/kernels.py`` case (and its token-by-token and Newton–Schulz rows) at
    head dims ``dims``, in fp32 and fp16, under the interpreter, so the kernels' block sizes are those a model run
    uses (B = H = 1 and a short T: the constexprs depend on the head dims and the chunk, not on B, H or T)."""
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("bench_kernels", HERE / "kernels.py")
    bench = sys.modules["bench_kernels"] = importlib.util.module_from_spec(spec)   # (dataclasses look it up)
    spec.loader.exec_module(bench)
    for D in dims:
        for dtype in (torch.float32, torch.float16):
            tag = f"D={D} {str(dtype).removeprefix('torch.')}"
            calls = {c.name: (lambda c=c: bench.gate_memory(c, bench.build_parts(c, 1, D, dtype, "cpu"), 1, 2 * 64 + 5,
                                                             1, D, dtype, "cpu")) for c in bench.CASES.values()}
            calls["fused_recurrent"] = lambda: bench.gate_recurrent(1, 7, 1, D, dtype, "cpu")
            calls["newton_schulz"] = lambda: bench.gate_ns(2, D, dtype, "cpu")
            for name, call in calls.items():
                recorder.source = f"production: {name} {tag}"
                try:
                    call()
                except Exception as exc:   # a case the dispatch does not take at this shape: nothing to record
                    print(f"  {recorder.source}: {type(exc).__name__}: {exc}"[:200], flush=True)


def record(pytest_args, path: Path, dims) -> int:
    """Record the launches of the tests (``pytest_args``; None: no tests) and of :func:`production_calls` at
    ``dims`` (in this process: the caller is a subprocess with TRITON_INTERPRET=1)."""
    import pytest
    recorder, rc = Recorder(path), 0
    if pytest_args is not None:
        rc = pytest.main(pytest_args, plugins=[recorder])
    else:
        recorder.install()
    if dims:
        production_calls(recorder, dims)
    recorder.save()
    return rc


# ------------------------------------------------------------------------------------- 2. compile (no interpreter)

def rebuild(desc):
    """An argument that the binder specialises like the recorded one (tensors: small aligned CPU tensors)."""
    import torch
    import triton.language as tl
    if "tensor" in desc:
        t = torch.empty(64, dtype=getattr(torch, desc["tensor"]))
        return t if desc["aligned"] else t[1:]
    if "value" in desc:
        return desc["value"]
    name = desc["repr"].removeprefix("triton.language.")
    return getattr(tl, name)


#: a tensor-core instruction in the PTX (Hopper's warpgroup MMA, or the warp-level mma.sync of earlier chips)
_MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync)\b")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack, static shared and local memory of the cubin's kernel (``cuobjdump --dump-resource-usage``)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = _USAGE.search(text)
    if m is None:
        return {"usage_error": text.strip()[-300:]}
    reg, stack, shared, local = map(int, m.groups())
    return {"registers": reg, "stack": stack, "static_shared": shared, "local": local}


def compile_all(launches, arch: int, precision=None, num_warps=None, num_stages=None) -> list:
    """Compile each distinct launch for ``GPUTarget("cuda", arch, 32)``; one result dict per distinct kernel build.
    ``precision``: replaces every launch's ``PRECISION`` constexpr (``tl.dot``'s input_precision), e.g. "tf32";
    ``num_warps`` / ``num_stages``: replace every launch's (what-ifs for register and shared-memory pressure)."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binders, seen, results = {}, {}, []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        if kernel not in binders:
            binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
        args = [rebuild(d) for d in launch["args"]]
        kwargs = {k: rebuild(d) for k, d in launch["kwargs"].items()}
        if precision is not None and "PRECISION" in kwargs:
            kwargs["PRECISION"] = precision
        if num_warps is not None:
            kwargs["num_warps"] = num_warps
        if num_stages is not None:
            kwargs["num_stages"] = num_stages
        bound, specialization, options = binders[kernel](*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = (launch["module"], launch["name"], repr(specialization), repr(sorted(kwargs.items(), key=str)))
        if key in seen:
            seen[key]["launches"] += launch["count"]
            continue
        const = {kernel.params[p[0]].name: v for p, v in constexprs.items() if len(p) == 1}
        label = f"{launch['module'].removeprefix(PACKAGE + '.')}.{launch['name']}"      # e.g. delta_rule.chunk._…
        result = {"kernel": label, "test": launch["test"],
                  "launches": launch["count"], "num_warps": options.num_warps, "num_stages": options.num_stages,
                  "constexprs": {k: v for k, v in const.items() if not isinstance(v, bool) or v},
                  "dtypes": sorted({d["tensor"] for d in launch["args"] + list(launch["kwargs"].values())
                                    if "tensor" in d})}
        start = time.perf_counter()
        try:
            compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            result.update(ok=True, dynamic_shared=int(compiled.metadata.shared),
                          tensor_cores=bool(_MMA.search(compiled.asm["ptx"])), **resource_usage(compiled.asm["cubin"]))
        except Exception as exc:   # a compile error is the finding: keep its last lines
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            result.update(ok=False, error=f"{type(exc).__name__}: " + " | ".join(lines[-6:])[-900:])
        result["compile_s"] = round(time.perf_counter() - start, 2)
        seen[key] = result
        results.append(result)
        print(f"  {'ok ' if result['ok'] else 'ERR'} {result['kernel']:45s} regs {result.get('registers', '—')!s:>4} "
              f"stack {result.get('stack', '—')!s:>5} smem {result.get('dynamic_shared', '—')!s:>6} "
              f"{'MMA' if result.get('tensor_cores') else 'fma'} "
              f"{result['compile_s']:.1f} s", flush=True)
    return results


# ------------------------------------------------------------------------------------- 3. report

def summarise(results, arch: int) -> dict:
    limit = SHARED_LIMIT.get(arch)
    for r in results:
        flags = []
        if not r["ok"]:
            flags.append("compile error")
        else:
            spill = r.get("local", 0) + r.get("stack", 0)
            if spill > 0:
                flags.append(f"local memory {spill} B/thread (register spills or a stack frame)")
            smem = r.get("dynamic_shared", 0) + r.get("static_shared", 0)
            if limit is not None and smem > limit:
                flags.append(f"shared memory {smem} B > {limit} B per block")
        r["flags"] = flags
    per_kernel = collections.defaultdict(list)
    for r in results:
        per_kernel[r["kernel"]].append(r)
    return per_kernel


def markdown(results, per_kernel, arch: int, command: str, seconds: float, versions: str, date: str) -> str:
    limit = SHARED_LIMIT.get(arch)
    failed = [r for r in results if not r["ok"]]
    ok = [r for r in results if r["ok"]]
    spill = lambda r: r.get("local", 0) + r.get("stack", 0)                      # noqa: E731
    smem = lambda r: r.get("dynamic_shared", 0) + r.get("static_shared", 0)      # noqa: E731
    over = lambda r: limit is not None and smem(r) > limit                        # noqa: E731
    production = [r for r in ok if r["test"].startswith("production:")]
    lines = [f"# Triton kernels compiled for sm_{arch} without a GPU", "",
             f"`{command}` — {versions}, {date}; {seconds:.0f} s in all.", "",
             f"{len(results)} distinct kernel builds (specialisations) of {len(per_kernel)} kernels — every launch of "
             f"the Triton tests under the interpreter, and bench/kernels.py's cases at model head dims ("
             f"{len(production)} builds) — compiled to cubin for `GPUTarget('cuda', {arch}, 32)`: "
             f"**{len(ok)} compiled, {len(failed)} failed**; {sum(spill(r) > 0 for r in ok)} use local memory "
             f"(register spills / a stack frame), {sum(over(r) for r in ok)} ask for more shared memory than a block "
             f"has ({limit} B), {sum(bool(r.get('tensor_cores')) for r in ok)} use tensor-core instructions.", "",
             "Registers, stack and static shared memory from `cuobjdump --dump-resource-usage` of each cubin; dynamic "
             "shared memory from Triton's metadata; tensor cores = a `wgmma` / `mma.sync` instruction in the PTX. "
             "This says nothing about speed or about the numbers a GPU computes (the interpreter tests check the "
             "arithmetic; `bench/device/check.sh` runs the tests on a GPU).", ""]
    if production:
        lines += ["## Model shapes (bench/kernels.py's cases, B = H = 1: the constexprs depend on D and the chunk)", "",
                  "| case | kernel | dot precision | warps | registers | stack B | shared B | tensor cores | flags |",
                  "|---|---|---|---:|---:|---:|---:|---|---|"]
        for r in production:
            flags = "; ".join(f for f in r["flags"] if not f.startswith("local memory")) or ""
            lines.append(f"| {r['test'].removeprefix('production: ')} | {r['kernel']} | "
                         f"{r['constexprs'].get('PRECISION', '—')} | {r['num_warps']} | {r.get('registers', '—')} | "
                         f"{spill(r)} | {smem(r)} | {'yes' if r.get('tensor_cores') else 'no'} | {flags} |")
        lines.append("")
    lines += ["## Every build, per kernel", "",
              "| kernel | builds | failed | max registers | max stack B | max shared B | spilling builds | "
              "over shared limit | tensor-core builds |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in sorted(per_kernel.items()):
        good = [r for r in rs if r["ok"]]
        lines.append(f"| {name} | {len(rs)} | {len(rs) - len(good)} | "
                     f"{max((r.get('registers', 0) for r in good), default=0)} | "
                     f"{max((spill(r) for r in good), default=0)} | {max((smem(r) for r in good), default=0)} | "
                     f"{sum(spill(r) > 0 for r in good)} | {sum(over(r) for r in good)} | "
                     f"{sum(bool(r.get('tensor_cores')) for r in good)} |")
    if failed:
        lines += ["", "## Builds that failed", "",
                  "| kernel | dtypes | constexprs | num_warps | error | a test that launches it |", "|---|---|---|---:|---|---|"]
        for r in failed:
            const = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items())
            lines.append(f"| {r['kernel']} | {', '.join(r['dtypes'])} | {const} | {r['num_warps']} | "
                         f"{r['error'].replace('|', '/')} | `{r['test']}` |")
    return "\n".join(lines) + "\n"


def render(saved: dict) -> str:
    """The markdown report from a results JSON alone (``compile_sm<arch>.json``: arch, command, seconds, versions,
    date and every build); no recording or compiling."""
    results = saved["builds"]
    return markdown(results, summarise(results, saved["arch"]), saved["arch"], saved["command"], saved["seconds"],
                    saved["versions"], saved["date"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100 / H200)")
    p.add_argument("-k", default=None, help="pytest -k expression: record only the matching tests")
    p.add_argument("--tests", nargs="+", default=None, help="test files (default: tests/kernels/test_triton*.py)")
    p.add_argument("--production", type=int, nargs="*", default=[64, 128], metavar="D",
                   help="also record bench/kernels.py's cases at these head dims (default 64 128; none: tests only)")
    p.add_argument("--no-tests", action="store_true", help="record only the --production calls")
    p.add_argument("--precision", default=None, choices=["ieee", "tf32", "tf32x3"],
                   help="compile with this tl.dot input precision instead of the launches' (what-if; default: as run)")
    p.add_argument("--num-warps", type=int, default=None, help="compile every launch with this num_warps (what-if)")
    p.add_argument("--num-stages", type=int, default=None, help="compile every launch with this num_stages (what-if)")
    p.add_argument("--launches", type=Path, default=None,
                   help="reuse launches recorded earlier (a file written by --keep-launches) instead of recording")
    p.add_argument("--keep-launches", type=Path, default=None, help="write the recorded launches to this file")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report-only", type=Path, default=None,
                   help="re-write the markdown report from a results JSON written earlier (no recording or compiling)")
    p.add_argument("--record-only", type=Path, default=None, help=argparse.SUPPRESS)   # subprocess 1
    p.add_argument("--compile-only", type=Path, default=None, help=argparse.SUPPRESS)  # subprocess 2
    args = p.parse_args(argv)

    if args.record_only is not None:
        tests = args.tests or sorted(str(t) for t in (ROOT / "tests" / "kernels").glob("test_triton*.py"))
        pytest_args = None if args.no_tests else ["-q", "-p", "no:cacheprovider", *tests,
                                                   *(["-k", args.k] if args.k else [])]
        return record(pytest_args, args.record_only, args.production)
    if args.compile_only is not None:
        launches = json.loads(args.compile_only.read_text())
        results = compile_all(launches, args.arch, args.precision, args.num_warps, args.num_stages)
        args.compile_only.with_suffix(".out.json").write_text(json.dumps(results))
        return 0

    if args.report_only is not None:
        args.report_only.with_suffix(".md").write_text(render(json.loads(args.report_only.read_text())))
        return 0

    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.json"
        if args.launches is not None:
            launches.write_text(args.launches.read_text())
        else:
            forwarded = [*(["-k", args.k] if args.k else []), *(["--tests", *args.tests] if args.tests else []),
                         "--production", *map(str, args.production), *(["--no-tests"] if args.no_tests else [])]
            print("recording the kernel launches (interpreter) ...", flush=True)
            rc = subprocess.run([sys.executable, __file__, "--record-only", str(launches), *forwarded], cwd=ROOT,
                                env={**env, "TRITON_INTERPRET": "1"}).returncode
            if not launches.exists():
                print(f"recording failed (pytest exit {rc})")
                return 2
            print(f"pytest exit {rc}", flush=True)
            if args.keep_launches is not None:
                args.keep_launches.write_text(launches.read_text())
        n = len(json.loads(launches.read_text()))
        print(f"{n} distinct launches; compiling for sm_{args.arch} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--compile-only", str(launches), "--arch", str(args.arch),
                        *(["--precision", args.precision] if args.precision else []),
                        *(["--num-warps", str(args.num_warps)] if args.num_warps else []),
                        *(["--num-stages", str(args.num_stages)] if args.num_stages else [])],
                       cwd=ROOT, env={**env, "TRITON_INTERPRET": "0"}, check=True)
        results = json.loads(launches.with_suffix(".out.json").read_text())
    import torch
    import triton
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    per_kernel = summarise(results, args.arch)
    command = " ".join(["python bench/compile_sm90.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"compile_sm{args.arch}" + (f"_{args.precision}" if args.precision else "")
                       + (f"_w{args.num_warps}" if args.num_warps else "")
                       + (f"_s{args.num_stages}" if args.num_stages else ""))
    seconds = time.perf_counter() - start
    date = time.strftime("%Y-%m-%d %H:%M")
    head = json.dumps({"arch": args.arch, "versions": versions, "seconds": seconds, "command": command, "date": date})
    builds = ",\n".join(json.dumps(r, sort_keys=True) for r in results)       # one build per line
    stem.with_suffix(".json").write_text(f'{head[:-1]}, "builds": [\n{builds}\n]}}\n')
    stem.with_suffix(".md").write_text(markdown(results, per_kernel, args.arch, command, seconds, versions, date))
    failed = sum(not r["ok"] for r in results)
    print(f"{len(results)} builds, {failed} failed; wrote {stem}.json and {stem}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
