"""bench/compile_sm90.py end to end on a few launches: the chunk kernels (forward and backward, fp32 and fp16 inputs)
recorded under the interpreter compile to sm_90 cubins without a GPU, and the report says what a GPU build would
use: tensor cores for the TF32 dots of half-precision inputs, none for IEEE fp32 dots."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
ROOT = Path(__file__).resolve().parents[2]


def test_chunk_kernel_launches_compile_for_sm90(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compile_sm90.py"), "--tests",
                          "tests/kernels/test_triton_precision.py", "-k", "chunk_kernels_launch", "--production",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    builds = json.loads((tmp_path / "compile_sm90.json").read_text())["builds"]
    names = {b["kernel"] for b in builds}
    assert {f"delta_rule.chunk._chunk_{stage}_kernel" for stage in ("ut", "state", "out", "bwd_dh", "bwd_grad")} <= names
    assert all(b["ok"] and b["registers"] > 0 for b in builds)
    by_precision = {p: {b["tensor_cores"] for b in builds if b["constexprs"].get("PRECISION") == p}
                    for p in ("ieee", "tf32")}
    assert by_precision == {"ieee": {False}, "tf32": {True}}
    report = (tmp_path / "compile_sm90.md").read_text()
    assert f"{len(builds)} compiled, 0 failed" in report
