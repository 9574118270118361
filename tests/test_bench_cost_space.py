"""bench/cost_space.py: the committed page is what its committed raw data renders to; a worker measures a step,
counts its FLOPs and runs a trial; the baseline package unpacks from git with its presets."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_cost_space", ROOT / "bench" / "cost_space.py")
cs = importlib.util.module_from_spec(_spec)
sys.modules["bench_cost_space"] = cs
_spec.loader.exec_module(cs)


def test_committed_results_regenerate():
    raw = json.loads((ROOT / "bench" / "results" / "cost_space_cpu.json").read_text())
    assert (ROOT / "bench" / "results" / "cost_space_cpu.md").read_text() == cs.render(raw)


def test_worker_measures_a_step_flops_and_a_trial():
    w = cs.Worker()
    req = {"size": "small", "preset": "transformer", "overrides": []}
    assert w.step(req)["seconds"] > 0
    f = w.flops(req)
    assert f["flops"] > 0 and f["state"] > 0 and f["params"] > 0
    assert w.trial({**req, "steps": 2})["seconds"] > 0


def test_every_row_builds():
    """Each part choice of the space is a valid override of its preset (a ConfigError would be a silent gap)."""
    from atlaslab.models.presets import load_preset
    for size in cs.SIZES.values():
        for _, label, preset, overrides in cs.ROWS:
            load_preset(preset, size["overrides"] + overrides)


def test_baseline_unpacks_with_presets(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    cs.unpack("HEAD", tmp_path)
    assert (tmp_path / "atlaslab" / "__init__.py").exists()
    # the presets travel with the package (atlaslab/presets) or, for a ref before 2026-12-06, experiments/presets
    assert ((tmp_path / "atlaslab" / "presets" / "atlas.yaml").exists()
            or (tmp_path / "experiments" / "presets" / "atlas.yaml").exists())
