"""bench/kernels.py's correctness gates and its "no speed on a red gate" rule, on tiny CPU shapes (interpreter).

- every memory case's gate (``memorize(mode="triton")`` vs the fp32 ``chunked`` reference) selects the case's kernel,
  passes, and then its row is timed; the token-by-token and Newton–Schulz gates pass;
- a deliberately wrong Triton output (``memorize`` patched to shift o in triton mode) fails the gate: the row
  records the ratio, says so, and the timed step is never called; a NaN output fails too;
- a kernel the dispatch would not pick (``ATLASLAB_FORCE_TORCH``) is neither gated nor timed;
- fla's input mapping (β = lr, g = log α, scale = 1) with fla's naive reference passes, a wrong mapping fails
  (skipped when bench/.peers lacks fla);
- the targets: met / not met / not measured with the reason; the report end to end (gates stubbed).
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import require_triton

tk = require_triton()

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).resolve().parents[2] / "bench"
                                               / "kernels.py")
bk = importlib.util.module_from_spec(_spec)
sys.modules["bench_kernels"] = bk   # before exec: its dataclass looks its module up
_spec.loader.exec_module(bk)

B, T, H, D = bk.TINY.values()
F32 = torch.float32
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and not tk.interpreting(),
                                reason="the CPU interpreter checks (the bench itself gates on a GPU)")


def _args(**kw):
    """The run's options as gated_row / row read them (small budgets)."""
    return argparse.Namespace(**{**dict(batch=B, heads=H, dim=D, dtype="fp32", reps=2, row_budget=0.1,
                                        deadline=600.0, start=time.perf_counter()), **kw})


class Step:
    """A timed step that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def _gated(case, parts, step):
    t = T if case.chunk_size > 1 else 20   # b = 16: two chunks and a partial one; b = 1: one 64-token block
    return bk.gated_row(case.name, "triton", t, _args(), lambda: bk.gate_memory(case, parts, B, t, H, D, F32, "cpu"),
                        step, 1.0, 1e-3)


@pytest.mark.parametrize("name", list(bk.CASES))
def test_memory_gate_passes_then_times_and_wrong_output_fails(name, monkeypatch):
    case = bk.CASES[name]
    parts = bk.build_parts(case, H, D, F32, "cpu")
    assert bk.triton_reason(case, parts, torch.zeros(B, T, H, D)) is None   # the row's own kernel runs
    step = Step()
    r = _gated(case, parts, step)
    assert r["gate_ratio"] <= 1e-3 and r["seconds"] is not None and step.calls >= 2, r

    memorize = bk.memorize

    def wrong(*a, mode, **kw):   # the triton mode's output, shifted (computed by chunked: the interpreter is slow)
        o, state = memorize(*a, mode="chunked", **kw)
        return (o + 0.1 if mode == "triton" else o), state
    monkeypatch.setattr(bk, "memorize", wrong)
    step = Step()
    r = _gated(case, parts, step)
    assert r["gate_ratio"] > 1e-3 and "GATE FAILED" in r["note"], r
    assert r["seconds"] is None and r["tokens_per_s"] is None and r["tflops"] is None and step.calls == 0


def test_recurrent_and_newton_schulz_gates_pass():
    assert bk.gate_recurrent(B, T, H, D, F32, "cpu") <= 1e-3
    assert bk.gate_ns(3, D, F32, "cpu") <= 1e-3


def test_nan_or_recorded_failure_is_a_red_gate():
    x = torch.ones(3)
    assert bk.compare([x * float("nan")], [x]) != bk.compare([x * float("nan")], [x])   # NaN
    for gate in (float("nan"), lambda: float("nan"), 0.5, RuntimeError("boom")):
        step = Step()
        r = bk.gated_row("gdn", "triton-chunk", T, _args(), gate, step, 1.0, 1e-3)
        assert r["seconds"] is None and step.calls == 0, r


def test_kernel_not_selected_is_neither_gated_nor_timed(monkeypatch):
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    case = bk.CASES["gdn"]
    step = Step()
    r = _gated(case, bk.build_parts(case, H, D, F32, "cpu"), step)
    assert r["seconds"] is None and r["gate_ratio"] is None and "not selected" in r["note"] and step.calls == 0


def test_past_deadline_skips_the_row():
    step = Step()
    r = bk.gated_row("gdn", "triton-chunk", T, _args(deadline=0.0, start=time.perf_counter() - 1), 1e-7, step, 1.0,
                     1e-3)
    assert r["seconds"] is None and "deadline" in r["note"] and step.calls == 0


def test_fla_mapping_gate_with_fla_naive(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))   # load_fla_naive appends bench/.peers: undone afterwards
    naive = bk.load_fla_naive()
    if naive is None:
        assert os.environ.get("ATLASLAB_REQUIRE_PEERS") != "1", "ATLASLAB_REQUIRE_PEERS=1 but bench/.peers holds no fla"
        pytest.skip("bench/.peers holds no fla (python bench/peers.py --install)")
    assert bk.gate_fla(naive, B, T, H, D, F32, "cpu") <= 1e-3
    no_log = lambda q, k, v, g, beta, scale: naive(q, k, v, g.exp(), beta, scale)   # noqa: E731  g = α, not log α
    assert not bk.gate_fla(no_log, B, T, H, D, F32, "cpu") <= 1e-3


def _rows(seconds):
    """gdn triton / fla / SDPA rows at T = 2048 and 8192 with the given {(op, impl, T): seconds}."""
    keys = [("gdn", "triton-chunk"), ("fla_chunk_gdn", bk.FLA_IMPL), ("attention", "torch-sdpa"),
            ("omega_c4", "triton"), ("omega_c1", "triton")]
    return [bk.row(op, impl, t, _args(), seconds=seconds.get((op, impl, t)), note="" if seconds.get((op, impl, t))
                   else "not measured: fla not importable") for op, impl in keys for t in (2048, 8192)]


def test_targets_met_not_met_not_measured():
    s = {("gdn", "triton-chunk", 2048): 1.2, ("gdn", "triton-chunk", 8192): 2.0,
         ("attention", "torch-sdpa", 2048): 1.0, ("attention", "torch-sdpa", 8192): 4.0,
         ("omega_c4", "triton", 2048): 2.0, ("omega_c1", "triton", 2048): 1.0,
         ("omega_c4", "triton", 8192): 1.0, ("omega_c1", "triton", 8192): 1.0}
    a, b, c = bk.evaluate_targets(_rows(s), [2048, 8192])
    assert a["status"].startswith("not measured") and "fla not importable" in a["status"]
    assert b["status"] == "not met" and b["ratio_by_T"] == {2048: 2.0, 8192: 1.0}
    assert c["status"] == "met" and c["ratio_by_T"] == {8192: 0.5}   # T ≥ 8K only
    c_short = bk.evaluate_targets(_rows(s), [2048])[2]
    assert c_short["status"].startswith("not measured: no T ≥ 8192")


def test_report_end_to_end_with_stubbed_gates(monkeypatch, tmp_path):
    """main() on CPU at T = 64 (gates stubbed: gdn's red): the red row has no time; the report has the targets."""
    gates = {name: 1e-7 for name in bk.CASES} | {"fused_recurrent": 1e-7, "newton_schulz": 1e-7, bk.FLA_IMPL: None}
    monkeypatch.setattr(bk, "interpreter_gates", lambda: {**gates, "gdn": 0.5})
    monkeypatch.setattr(bk, "HAS_CUDA", False)
    bk.main(["--T", "64", "--heads", "2", "--dim", "8", "--reps", "1", "--cpu-ns-max", "4", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    assert [t["target"] for t in data["targets"]] == ["a", "b", "c"]
    gdn = next(r for r in data["rows"] if (r["op"], r["impl"]) == ("gdn", "triton-chunk"))
    assert gdn["seconds"] is None and "GATE FAILED" in gdn["note"]
    assert all(r["seconds"] for r in data["rows"] if r["impl"] in ("torch-chunked", "torch-sdpa", "torch"))
    md = (tmp_path / "kernels_cpu.md").read_text()
    assert "## Targets (issue 6)" in md and "not measured" in md


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_document_rows_gate_against_each_document_alone(layout, monkeypatch):
    """The gdn_docs gates (packed with cu_seqlens / right-padded, both triton) pass against each document alone on
    the torch engine; a wrong native packed output fails the packed gate."""
    parts = bk.build_parts(bk.CASES["gdn"], H, D, F32, "cpu")
    lengths = bk.document_lengths(T, 3, seed=1)
    assert sum(lengths) == T and min(lengths) >= 1 and len(lengths) == 3
    assert bk.gate_packed(parts, T, H, D, 3, F32, "cpu", layout) <= 1e-3
    if layout == "packed":
        real = tk._run_packed
        monkeypatch.setattr(tk, "_run_packed", lambda *a, **kw: (lambda o, s: (o.roll(1, 1), s))(*real(*a, **kw)))
        assert bk.gate_packed(parts, T, H, D, 3, F32, "cpu", layout) > 1e-3
