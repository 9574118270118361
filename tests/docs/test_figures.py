"""Every figure the site shows is redrawn by a test from data committed in the repository (issue 38).

The guard collects each image that a docs page (``docs/**/*.md``) or the README shows, by markdown image syntax
(inline ``![alt](path)`` or by reference ``![alt][ref]``) or by ``<img src=...>``, outside code, and fails on any
that is not in :data:`REDRAWN`: the figures a named test redraws from committed data and compares with the committed
PNG. A figure whose data is not in the repository does not go on the site; a new figure goes on the list together
with its redraw test. :func:`test_the_list_names_what_its_tests_redraw` holds the list to what those tests draw.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.scripts import load_script, same_figure

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

RUN_PAGES = "tests/docs/test_gen_tables.py::test_the_run_pages_figures_redraw_from_their_committed_data"
DISCOVERY = "tests/docs/test_figures.py::test_the_discovery_pareto_figures_redraw_from_their_committed_runs"

#: each figure the site may show (path from the repository root) -> the test that redraws it from committed data
REDRAWN = {
    # docs/gen_runs.py --plots, from docs/results/{quickstart,table6-cpu,lm-table2}/data
    "docs/results/table6-cpu/bar_test_accuracy.png": RUN_PAGES,
    "docs/results/table6-cpu/curves.png": RUN_PAGES,
    "docs/results/table6-cpu/length.png": RUN_PAGES,
    "docs/results/lm-table2/curves.png": RUN_PAGES,
    # docs/gen_recall_vs_state.py, from docs/results/recall-vs-state/runs/*/trials.csv
    "docs/results/recall-vs-state/state.png": RUN_PAGES,
    # docs/gen_discovery.py --plots, from docs/results/discovery/*/data
    "docs/results/discovery/suite_pareto.png": DISCOVERY,
    "docs/results/discovery/suite_from_presets_pareto.png": DISCOVERY,
    "docs/results/discovery/suite_3200_pareto.png": DISCOVERY,
    "docs/results/discovery/suite_seeds_pareto.png": DISCOVERY,
}

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,}).*?^\1\2[`~]*[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.S)   # not across a blank line
_INLINE = re.compile(r"!\[(?:[^\]\\]|\\.)*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
_REFERENCE = re.compile(r"!\[((?:[^\]\\]|\\.)*)\]\[([^\]]*)\]")
_DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)", re.M)
_IMG = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*(?:\"([^\"]*)\"|'([^']*)'|([^\s>]+))", re.I)


def images(text: str) -> list[str]:
    """The image targets a markdown text shows, in order of appearance kind by kind (inline, by reference, <img>);
    images inside fenced code blocks or code spans are text, not images, and are left out."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    found = [m.group(1).strip("<>") for m in _INLINE.finditer(text)]
    defs = {k.strip().lower(): v.strip("<>") for k, v in _DEFINITION.findall(text)}
    for alt, ref in _REFERENCE.findall(text):
        found.append(defs.get((ref or alt).strip().lower(), f"[{ref or alt}] (undefined reference)"))
    found += [next(g for g in m.groups() if g is not None) for m in _IMG.finditer(text)]
    return found


def _target(page: Path, src: str) -> str:
    """``src`` as a path from the repository root when it is a local file, else as written (a URL, data:)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", src, re.I) or src.startswith("//"):
        return src
    path = (page.parent / src.split("#")[0].split("?")[0]).resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def shown() -> list[tuple[str, str]]:
    """(page, image) for every image that a docs page or the README shows, both as paths from the repository root."""
    pages = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    return [(page.relative_to(ROOT).as_posix(), _target(page, src))
            for page in pages for src in images(page.read_text(encoding="utf-8"))]


def test_every_figure_the_site_shows_is_redrawn_by_a_test_from_committed_data():
    found = shown()
    assert found, "no image found on any page: the collector is broken"
    unchecked = [f"{page}: {image}" for page, image in found if image not in REDRAWN]
    assert not unchecked, ("images that no test redraws from committed data (draw them with a script from committed "
                           "data and add a redraw test and a REDRAWN entry, or take them off the page):\n"
                           + "\n".join(unchecked))
    missing = [f"{page}: {image}" for page, image in found if not (ROOT / image).is_file()]
    assert not missing, "images shown but not committed:\n" + "\n".join(missing)


def test_the_image_collector_finds_every_syntax_and_skips_code():
    page = "\n".join([
        "# P", "", "![inline](a/one.png) and ![titled](<a/two.png> \"a title\")", "",
        "![by reference][fig] and ![Shortcut][]", "", "[fig]: a/three.png", "[shortcut]: <a/four.png>", "",
        "<p><IMG alt=x SRC='a/five.png'></p> <img src=a/six.png>", "",
        "```markdown", "![in a fence](a/no1.png)", "```", "", "`![in a span](a/no2.png)`", "",
        "![an undefined reference][nowhere]", "![remote](https://example.org/x.png)", "[a link](a/no3.png)",
    ])
    assert images(page) == ["a/one.png", "a/two.png", "https://example.org/x.png", "a/three.png", "a/four.png",
                            "[nowhere] (undefined reference)", "a/five.png", "a/six.png"]
    assert _target(DOCS / "results" / "p.md", "p/x.png#frag") == "docs/results/p/x.png"
    assert _target(ROOT / "README.md", "docs/x.png") == "docs/x.png"


def test_the_guard_fails_on_a_figure_no_test_redraws(tmp_path, monkeypatch):
    page = DOCS / "results" / "reading-list.md"
    planted = page.read_text(encoding="utf-8") + "\n![curves](reading-list/curves-1600-armt.png)\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text",
                        lambda self, *a, **k: planted if self == page else original(self, *a, **k))
    assert ("docs/results/reading-list.md", "docs/results/reading-list/curves-1600-armt.png") in shown()
    with pytest.raises(AssertionError, match=r"docs/results/reading-list\.md: docs/results/reading-list/curves"):
        test_every_figure_the_site_shows_is_redrawn_by_a_test_from_committed_data()


def _defined_tests(path: Path) -> set:
    return {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}


def test_the_list_names_what_its_tests_redraw():
    """:data:`REDRAWN` holds no figure its test does not redraw, and misses none that the test redraws: the run pages'
    test redraws every PNG of docs/gen_runs.py's PLOTS folders and gen_recall_vs_state.py's state plot; the discovery
    test redraws gen_discovery.py's four Pareto figures. Each named test exists."""
    for test in set(REDRAWN.values()):
        file, name = test.split("::")
        assert name in _defined_tests(ROOT / file), f"{test} does not exist"
    gr, grv, gd = (load_script(f"docs/{name}.py") for name in ("gen_runs", "gen_recall_vs_state", "gen_discovery"))
    rel = lambda p: Path(p).resolve().relative_to(ROOT).as_posix()  # noqa: E731
    run_pages = {rel(p) for name in gr.PLOTS for p in (DOCS / "results" / name).glob("*.png")} | {rel(grv.OUT)}
    assert {p for p, t in REDRAWN.items() if t == RUN_PAGES} == run_pages
    assert {p for p, t in REDRAWN.items() if t == DISCOVERY} == {rel(f) for f in _discovery_figures(gd)}


def _discovery_figures(gd):
    """docs/gen_discovery.py --plots: each figure with the search and presets' runs it is drawn from."""
    return {gd.FIGURE: ("suite_search", "suite_presets"), gd.FIGURE2: ("suite_from_presets", "suite_presets"),
            gd.FIGURE3: ("suite_3200", "suite_presets_3200"), gd.FIGURE4: ("suite_seeds", "suite_presets_3200_s01")}


def test_the_discovery_pareto_figures_redraw_from_their_committed_runs(tmp_path):
    """The discovery page's four Pareto figures (``python docs/gen_discovery.py --plots``) are drawn from the
    committed runs in docs/results/discovery/*/data: each is redrawn here and equals the committed PNG."""
    gd = load_script("docs/gen_discovery.py")
    for figure, (run, presets) in _discovery_figures(gd).items():
        assert not gd._missing(run), f"{run}'s committed data is missing"
        drawn = gd.plot_suite_pareto(tmp_path / figure.name, run, presets)
        assert drawn is not None and same_figure(drawn, figure), f"{figure} differs from its redraw"
