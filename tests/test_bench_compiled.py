"""bench/compiled.py: the committed page is what its committed raw data renders to, and every row is a valid
``compile: true`` model config."""
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_compiled", ROOT / "bench" / "compiled.py")
bc = importlib.util.module_from_spec(_spec)
sys.modules["bench_compiled"] = bc
_spec.loader.exec_module(bc)


def test_committed_results_regenerate():
    runs = sorted((ROOT / "bench" / "results").glob("compiled*_cpu.json"))
    assert runs
    for path in runs:
        assert path.with_suffix(".md").read_text() == bc.render(json.loads(path.read_text())), path.name


def test_every_row_builds_with_compile_on():
    from atlaslab.models.presets import load_preset
    for size in bc.SIZES.values():
        for _, preset, overrides in bc.ROWS:
            cfg = load_preset(preset, size["overrides"] + overrides + ["mixers.*.compile=true"])
            assert all(m.compile for m in cfg.mixers.values())
