"""The learning-parity tables of the docs are generated: each ``<!-- generated: NAME -->`` block of a learning page
equals ``docs/gen_learning.py``'s ``TABLES[NAME]()`` rendered from the committed JSON, and each learning report in
bench/results (``learning_*.md``) equals what ``bench/learning.py --render`` writes from its JSON."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "results.md", *sorted((ROOT / "docs" / "results").glob("learning*.md"))]
BLOCK = re.compile(r"<!-- generated: ([\w-]+) -->\n(.*?)\n<!-- end generated -->", re.S)


def _module(name, path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


gen = _module("docs_gen_learning", ROOT / "docs" / "gen_learning.py")


def _blocks():
    return [(page.relative_to(ROOT).as_posix(), name, body) for page in PAGES
            for name, body in BLOCK.findall(page.read_text()) if name in gen.TABLES]


@pytest.mark.parametrize("page, name, body", _blocks(), ids=lambda x: x if isinstance(x, str) and "\n" not in x else "")
def test_block_regenerates_from_the_committed_json(page, name, body):
    assert body.strip("\n") == gen.TABLES[name]().strip("\n"), \
        f"{page}: block {name} differs from docs/gen_learning.py's output (python docs/gen_tables.py --write)"


def test_every_learning_table_is_on_a_page():
    assert {name for _, name, _ in _blocks()} == set(gen.TABLES)


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("learning_*.json")), ids=lambda p: p.name)
def test_bench_report_regenerates_from_its_json(path, tmp_path):
    bl = gen._bench()
    data = json.loads(path.read_text())
    out = tmp_path / path.stem
    (tmp_path / path.name).write_text(json.dumps(data))
    md = bl.render(tmp_path / path.name)
    assert md == path.with_suffix(".md").read_text(), f"{path.name}: python bench/learning.py --render {path}"
    assert out.with_suffix(".md").read_text() == md


def test_verdict_files_use_only_held_out_seeds():
    """The held-out rule, checked on the committed data: tuning and verdict seeds are disjoint, and every
    learning_heldout* file ran on held-out seeds only (verdict files pool them; none may hold a tuning seed), and
    each file the held-out table reads ran on the seeds its row names."""
    bl = gen._bench()
    held_out = set(bl.HELDOUT_SEEDS) | set(bl.FRESH_SEEDS)
    assert not set(bl.TUNING_SEEDS) & held_out and not set(bl.HELDOUT_SEEDS) & set(bl.FRESH_SEEDS)
    assert {tuple(seeds) for _, _, _, seeds in gen.HELDOUT} == {bl.HELDOUT_SEEDS, bl.FRESH_SEEDS}
    for path in (ROOT / "bench" / "results").glob("learning_heldout*.json"):
        data = json.loads(path.read_text())
        assert set(data["seeds"]) <= held_out, path.name
        assert {r["seed"] for r in data["runs"]} <= held_out, path.name
    for _, file, _, seeds in gen.HELDOUT:
        data = gen._load(file)
        assert data is None or sorted(data["seeds"]) == list(seeds), file
