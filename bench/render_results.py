"""Render a bench report ``bench/results/<name>.md`` from its raw data ``<name>.json`` alone: no measurement.

    python bench/render_results.py                        # rewrite every bench/results/*.md that has a .json
    python bench/render_results.py bench/results/peers_cpu.json
    python bench/render_results.py --check                # exit 1, naming each .md that differs from its render

Each bench script owns the one renderer of its kind (the function named in :data:`RENDERERS`), which its own run
calls to write the ``.md``; this module only picks the script by the file name's prefix and loads it.
``tests/test_bench_results_regenerate.py`` renders every committed pair and fails on any difference, so a hand edit
of a report, or a report left stale after its data or its renderer changed, cannot go unnoticed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: (file-name prefix, bench script, its function from the JSON's dict to the markdown), the longest prefix first
RENDERERS = [
    ("learning_", "learning.py", "markdown"),
    ("atlas_cost_", "atlas_cost.py", "render"),
    ("block_size_", "block_size.py", "render"),
    ("chunked_", "chunked.py", "render"),
    ("compile_sm", "compile_sm90.py", "render"),
    ("compiled_", "compiled.py", "render"),
    ("cost_space_", "cost_space.py", "render"),
    ("gdn_vs_fla_", "gdn_vs_fla.py", "render"),
    ("kernels_", "kernels.py", "render"),
    ("peers_", "peers.py", "render"),
    ("search_", "search.py", "render"),
]


def _module(script: str):
    """bench/<script> as the module ``bench_<stem>`` (the name the tests load it under: loaded once)."""
    name = "bench_" + script[:-len(".py")]
    if name not in sys.modules:
        sys.path.insert(0, str(HERE))   # a bench script imports its siblings by name (compiled → cost_space)
        try:
            spec = importlib.util.spec_from_file_location(name, HERE / script)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        finally:
            sys.path.remove(str(HERE))
    return sys.modules[name]


def renderer(path: Path) -> Callable[[dict], str]:
    """The renderer of the results file ``path`` (by its name), or a ValueError naming the known prefixes."""
    for prefix, script, func in RENDERERS:
        if Path(path).name.startswith(prefix):
            return getattr(_module(script), func)
    raise ValueError(f"{Path(path).name}: no bench renders it; known prefixes: {', '.join(p for p, _, _ in RENDERERS)}")


def render(path: Path) -> str:
    """The markdown of ``<name>.md`` rendered from ``path`` (``<name>.json``)."""
    return renderer(path)(json.loads(Path(path).read_text()))


def pairs(folder: Path = RESULTS) -> List[Path]:
    """Every ``<name>.json`` in ``folder`` that has a ``<name>.md`` beside it."""
    return sorted(p for p in Path(folder).glob("*.json") if p.with_suffix(".md").is_file())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", type=Path, help="results files (default: every pair in bench/results)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a .md differs from its render")
    args = ap.parse_args(argv)
    stale = []
    for path in args.json or pairs():
        md, target = render(path), path.with_suffix(".md")
        if args.check:
            if not target.is_file() or target.read_text() != md:
                stale.append(target)
                print(f"differs: {target}")
        elif not target.is_file() or target.read_text() != md:
            target.write_text(md)
            print(f"rewrote {target}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
