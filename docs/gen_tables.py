"""Regenerate every generated block of README.md and docs/**/*.md from the data committed in the repository.

    python docs/gen_tables.py --write     # rewrite every block
    python docs/gen_tables.py --check     # exit 1 and list the blocks that differ (what the test runs)
    python docs/gen_tables.py --list      # every block: page, name, generator

A block is the text between two marker lines of a page::

    <!-- generated: quickstart -->

    | variant | test/accuracy | ... |

    <!-- end generated -->

Its content is exactly ``"\\n" + TABLES[name]() + "\\n"`` (the blank lines keep Markdown from reading the table as part
of the HTML comment). The generators are the ``TABLES = {name: function}`` dicts of the modules in :data:`SOURCES`
(files beside this one); each function takes no argument and returns Markdown built from committed files only (a
run's ``trials.csv`` / ``curves.csv``, a benchmark's JSON). A block whose name no module defines, a name two modules
define, or a marker without its end is an error. ``tests/docs/test_gen_tables.py`` runs the check, so a page whose
table no longer matches its data fails the suite; :func:`drift` (the same test) flags numbers in a page's prose that
neither its generated tables nor the bench reports it includes or names hold.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Iterator, List, Tuple

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the modules (files in docs/) whose ``TABLES`` make the generated blocks; a listed file that does not exist yet is
#: skipped, and a block that needs one of its tables then fails as "no generator"
SOURCES = ("gen_runs.py", "gen_recall_vs_state.py", "gen_learning.py", "gen_discovery.py", "gen_reading_list.py")

BLOCK = re.compile(r"<!-- generated: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- end generated -->", re.S)
OPEN = re.compile(r"<!-- generated: ")


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def generators() -> Dict[str, Tuple[str, Callable[[], str]]]:
    """Block name → (source file, function), over :data:`SOURCES`."""
    out: Dict[str, Tuple[str, Callable[[], str]]] = {}
    for src in SOURCES:
        path = DOCS / src
        if not path.is_file():
            continue
        for name, fn in getattr(_load(path), "TABLES", {}).items():
            if name in out:
                raise ValueError(f"generated block {name!r} is defined by both {out[name][0]} and {src}")
            out[name] = (src, fn)
    return out


def pages() -> List[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def blocks(text: str, where: str = "") -> Iterator[re.Match]:
    """The generated blocks of a page; an opening marker without its end is an error."""
    found = list(BLOCK.finditer(text))
    if len(found) != len(OPEN.findall(text)):
        raise ValueError(f"{where}: a `<!-- generated: NAME -->` marker has no `<!-- end generated -->`")
    return iter(found)


def render(text: str, gens: Dict[str, Tuple[str, Callable[[], str]]], where: str = "",
           cache: Dict[str, str] = None) -> str:
    """The page with every block's content regenerated."""
    cache = {} if cache is None else cache
    out, last = [], 0
    for m in blocks(text, where):
        name = m.group("name")
        if name not in gens:
            raise ValueError(f"{where}: no generator for block {name!r} (known: {', '.join(sorted(gens))})")
        if name not in cache:
            cache[name] = "\n" + gens[name][1]().strip("\n") + "\n\n"
        out += [text[last:m.start("body")], cache[name]]
        last = m.end("body")
    return "".join(out) + text[last:]


def stale() -> List[Tuple[Path, str]]:
    """(page, regenerated text) for every page whose blocks differ from what their data gives."""
    gens, cache, out = generators(), {}, []
    for page in pages():
        text = page.read_text()
        if "<!-- generated: " not in text:
            continue
        new = render(text, gens, str(page.relative_to(ROOT)), cache)
        if new != text:
            out.append((page, new))
    return out


# --- drift: numbers in the prose that the generated tables do not hold ---------------------------------------------

#: a result-like number of the prose: three decimals (0.961), or a mean ± spread (108 ± 14, 0.96 ± 0.02)
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)? ± \d+(?:\.\d+)?|\d+\.\d{3})(?!\w|\.\d)")
#: "k/n seeds" as the tables write a count of seeds that reached a threshold
SEEDS = re.compile(r"\b\d+/\d+ seeds\b")
#: a ratio or an interval of ratios as the learning reports write them (0.93×, 0.59–1.62×)
RATIO = re.compile(r"(?<![\w.])(\d+\.\d{2})(?:–(\d+\.\d{2}))?×")
#: a bench report included verbatim into a page (``--8<-- "bench/results/NAME.md"``, or a section of it)
SNIPPET = re.compile(r'^--8<-- "(bench/results/[\w.-]+\.md)(?::[\w-]+)?"[ \t]*$', re.M)
#: a bench results file named in a page (``learning_hard_gdn_cpu``, ``bench/results/learning_cpu.json``)
NAMED = re.compile(r"(?<![\w/])(?:bench/results/)?([a-z0-9]+(?:_[a-z0-9]+)*_(?:cpu|nvidia_h200|sm90))"
                   r"(?:\.md|\.json|\.\{md,json\})?(?!\w)")


def _sections(text: str) -> List[str]:
    """The page cut at its level-1 and level-2 headings (outside code fences)."""
    out, cur, fence = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,2} ", line) and cur:
            out.append("\n".join(cur))
            cur = []
        cur.append(line)
    out.append("\n".join(cur))
    return out


def _prose(section: str) -> str:
    """A section without its generated blocks, code fences, inline code and HTML comments."""
    s = BLOCK.sub("", section)
    s = re.sub(r"```.*?```", "", s, flags=re.S)
    s = re.sub(r"`[^`\n]*`", "", s)
    return re.sub(r"<!--.*?-->", "", s, flags=re.S)


def sources(section: str) -> List[Path]:
    """The bench reports a section includes (``--8<--``) or names (a ``bench/results`` file's stem), that exist."""
    out = [ROOT / m.group(1) for m in SNIPPET.finditer(section)]
    for m in NAMED.finditer(section):
        path = ROOT / "bench" / "results" / f"{m.group(1)}.md"
        if path.is_file() and path not in out:
            out.append(path)
    return [p for p in out if p.is_file()]


def drift(text: str) -> List[str]:
    """Numbers in a page's prose that neither a generated block of the same section nor a bench report it cites holds.

    The rule, for every section (level-1 or level-2 heading to the next) that holds a generated block or includes a
    bench report (``--8<-- "bench/results/NAME.md"``, rendered from its JSON): each three-decimal number (an
    accuracy, a loss), each ``a ± b``, each ``k/n seeds`` and each ratio ``r×`` or interval ``a–b×`` written in the
    section's prose must occur, as text (a ratio ``r×`` also as a table cell ``| r |`` of a column of ratios), in one
    of the section's blocks or in a bench report that the section includes or names (``learning_hard_gdn_cpu``, ``bench/results/learning_cpu.json``: its ``.md``). A number quoted
    from another page's data belongs in that page's section, or in a generated block of this one. A section with
    neither a block nor an included report is not checked."""
    problems = []
    for sec in _sections(text):
        blocks = " ".join(m.group("body") for m in BLOCK.finditer(sec))
        if not blocks and not SNIPPET.search(sec):
            continue
        tables = " ".join([blocks] + [p.read_text() for p in sources(sec)])
        title = sec.splitlines()[0] if sec else ""
        prose = _prose(SNIPPET.sub("", sec))
        for pat in (NUMBER, SEEDS, RATIO):
            for m in pat.finditer(prose):
                found = m.group(0) in tables or (pat is RATIO and m.group(2) is None        # a speed-up column
                                                  and re.search(rf"\| {re.escape(m.group(1))} [|(]", tables))
                if not found:
                    problems.append(f"{title!r}: {m.group(0)!r} is in neither the section's generated tables nor "
                                    "a bench report it includes or names")
    return problems


def drift_all() -> List[str]:
    out = []
    for page in pages():
        text = page.read_text()
        if "<!-- generated: " in text or SNIPPET.search(text):
            out += [f"{page.relative_to(ROOT)}: {p}" for p in drift(text)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="rewrite every generated block")
    g.add_argument("--check", action="store_true", help="exit 1 if a block differs from its data, or drifts")
    g.add_argument("--list", action="store_true", help="list the blocks")
    args = ap.parse_args()
    if args.list:
        gens = generators()
        for page in pages():
            for m in blocks(page.read_text(), str(page)):
                src = gens.get(m.group("name"), ("(none)",))[0]
                print(f"{page.relative_to(ROOT)}: {m.group('name')} ← {src}")
        return 0
    todo = stale()
    if args.write:
        for page, new in todo:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    for page, _ in todo:
        print(f"stale: {page.relative_to(ROOT)} (python docs/gen_tables.py --write)")
    problems = drift_all()
    for p in problems:
        print(f"drift: {p}")
    return 1 if todo or problems else 0


if __name__ == "__main__":
    sys.exit(main())
