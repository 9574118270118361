"""Write ``docs/paper-map.md`` (the paper-to-code map) from ``docs/paper_map.yaml``.

    python docs/gen_paper_map.py            # rewrite docs/paper-map.md
    python docs/gen_paper_map.py --check    # exit 1 if the page is stale or a path, test id or anchor is wrong

The YAML lists every numbered equation of ATLAS, Titans and Miras that atlaslab implements, with the code, the
engine paths, the tests and the docs section for each. The page cannot drift from it or from the code:
``tests/docs/test_docs.py`` compares the committed page with :func:`render` and runs :func:`path_problems`,
:func:`node_id_problems` and :func:`anchor_problems` (dotted paths resolve by import + getattr, test ids name a
test function of their file, anchors exist on their page).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE = DOCS / "paper_map.yaml"
OUT = DOCS / "paper-map.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIELDS = {"paper", "equation", "what", "code", "engines", "tests", "docs", "note"}
REQUIRED = FIELDS - {"note"}
ENGINES = {"recurrent": "recurrent", "chunked": "chunked", "triton": "Triton"}
PACKAGE = "atlaslab."


# --------------------------------------------------------------------------------------------------
# the YAML
# --------------------------------------------------------------------------------------------------
def _as_list(value: Any) -> List[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def load(path: Path = SOURCE) -> Dict[str, Any]:
    """The map, checked for shape: known papers and fields, no ``|`` in a table cell, a note where code is null."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    papers, entries = data["papers"], data["equations"]
    for n, e in enumerate(entries):
        where = f"{path.name} entry {n} ({e.get('paper')} {e.get('equation')})"
        if set(e) - FIELDS or REQUIRED - set(e):
            raise ValueError(f"{where}: fields {sorted(e)}; expected {sorted(REQUIRED)} and optionally 'note'")
        if e["paper"] not in papers:
            raise ValueError(f"{where}: unknown paper; known: {', '.join(papers)}")
        if e["code"] is None and not e.get("note"):
            raise ValueError(f"{where}: code is null, so a note must say why it is not implemented")
        if set(e["engines"] or {}) - set(ENGINES):
            raise ValueError(f"{where}: engines keys {sorted(e['engines'])}; known: {', '.join(ENGINES)}")
        for key in ("equation", "what", "note"):
            if "|" in str(e.get(key) or ""):
                raise ValueError(f"{where}: '|' in {key} would split the table cell")
    return data


def code_paths(entry: Dict[str, Any]) -> List[str]:
    """Every dotted path of an entry: its ``code`` and its ``engines``."""
    paths = _as_list(entry["code"])
    for kind in ENGINES:
        paths += _as_list((entry["engines"] or {}).get(kind))
    return paths


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------
def md_escape(text: str) -> str:
    """Prose with equations: φ*, M* are not emphasis and "[P ‖ h ‖ S]" is not a link reference."""
    return text.replace("*", "\\*").replace("[", "\\[").replace("]", "\\]")


def short(path: str) -> str:
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else path


def code_cell(entry: Dict[str, Any]) -> str:
    paths = _as_list(entry["code"])
    return "<br>".join(f"`{short(p)}`" for p in paths) if paths else "not implemented"


def engines_cell(entry: Dict[str, Any]) -> str:
    engines = entry["engines"] or {}
    rows = [f"{label}: " + ", ".join(f"`{short(p)}`" for p in _as_list(engines.get(kind)))
            for kind, label in ENGINES.items() if engines.get(kind)]
    if rows:
        return "<br>".join(rows)
    return "—" if entry["code"] is None else "— (a layer or mixer, no engine)"


def tests_cell(entry: Dict[str, Any]) -> str:
    ids = [t[len("tests/"):] if t.startswith("tests/") else t for t in entry["tests"]]
    return "<br>".join(f"`{t}`" for t in ids) if ids else "—"


def docs_cell(entry: Dict[str, Any]) -> str:
    links = []
    for ref in _as_list(entry["docs"]):
        page, _, anchor = ref.partition("#")
        name = Path(page).stem
        label = f"{name}: {anchor.replace('-', ' ').replace('_', ' ')}" if anchor else name
        links.append(f"[{label}]({ref})")
    return "<br>".join(links)


def render(data: Optional[Dict[str, Any]] = None) -> str:
    data = load() if data is None else data
    papers, entries = data["papers"], data["equations"]
    counts = {p: sum(e["paper"] == p for e in entries) for p in papers}
    missing = {p: sum(e["paper"] == p and e["code"] is None for e in entries) for p in papers}
    lines = [
        "# Paper-to-code map",
        "",
        "<!-- generated by docs/gen_paper_map.py from docs/paper_map.yaml; do not edit -->",
        "",
        "atlaslab builds its memories from the equations of three papers. This page lists, for every numbered",
        "equation (or group of equations) that the code implements, the class or function that implements it,",
        "the engine paths that compute it, the tests that check it and the section of these docs that explains it.",
        "Equations are numbered as in the papers' arXiv v1; the formulas are written in atlaslab's notation",
        "([notation](concepts/memory.md#notation): α_t is the fraction of memory *kept*, η_t the inner learning rate,",
        "θ_t the momentum decay), which renames some of the papers' gates.",
        "",
        "- **code**: dotted paths inside the `atlaslab` package (the prefix `atlaslab.` is left out).",
        "- **engines**: where `memorize` computes the equation. `recurrent` is the token-by-token reference,",
        "  `chunked` the chunk-parallel torch engine (the default), Triton the GPU kernels that",
        "  `memorize(mode=\"triton\")` picks when they take the spec ([Engines](engines.md)). Every faster path is",
        "  tested against the reference.",
        "- **tests**: pytest node ids under `tests/`. An id in brackets names one parametrisation of the test.",
        "",
        "The page is generated from `docs/paper_map.yaml` (`python docs/gen_paper_map.py`). A test fails when the",
        "page is stale, a dotted path does not import, a test id names no test, or a docs link has no anchor.",
        "",
        "| paper | equations mapped | not implemented |",
        "|---|---|---|",
    ]
    lines += [f"| [{p}](#{p.lower()}) | {counts[p]} | {missing[p]} |" for p in papers]
    for paper, meta in papers.items():
        rows = [e for e in entries if e["paper"] == paper]
        lines += [
            "",
            f"## {paper} {{#{paper.lower()}}}",
            "",
            f"{meta['authors']}, \"{md_escape(meta['title'])}\", arXiv {meta['arxiv']} "
            f"(<https://arxiv.org/abs/{meta['arxiv']}>).",
            "",
            "| equation | what | code | engines | tests | docs |",
            "|---|---|---|---|---|---|",
        ]
        for e in rows:
            lines.append(f"| {e['equation']} | {md_escape(e['what'])} | {code_cell(e)} | {engines_cell(e)} | "
                         f"{tests_cell(e)} | {docs_cell(e)} |")
        notes = [e for e in rows if e.get("note")]
        if notes:
            lines += ["", "Notes:", ""]
            lines += [f"- **{e['equation']}**: {md_escape(e['note'])}" for e in notes]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------------------
def _triton_missing() -> bool:
    return importlib.util.find_spec("triton") is None


def _ast_names(tree: ast.AST, names: List[str]) -> bool:
    """True when ``names`` (``[Class, method]`` or ``[function]``) are defined in ``tree``, nested in order."""
    body = getattr(tree, "body", [])
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == names[0]:
            return len(names) == 1 or _ast_names(node, names[1:])
        if isinstance(node, ast.Assign) and len(names) == 1 and any(
                isinstance(t, ast.Name) and t.id == names[0] for t in node.targets):
            return True
        if isinstance(node, ast.ImportFrom) and len(names) == 1 and any(   # a package's re-export
                (a.asname or a.name) == names[0] for a in node.names):
            return True
    return False


def _resolve_by_source(parts: List[str]) -> Optional[str]:
    """Without triton installed: the longest prefix of ``parts`` that is a module file of the repository defines
    the rest (read with ast, not imported)."""
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                rest = parts[i:]
                if not rest or _ast_names(ast.parse(f.read_text(encoding="utf-8")), rest):
                    return None
                return f"{'.'.join(rest)} is not defined in {f.relative_to(ROOT)}"
    return f"no module file for {'.'.join(parts)}"


def resolve(path: str) -> Optional[str]:
    """None when ``path`` resolves: the longest importable module prefix, then getattr for the rest. Else why not."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name == module:               # not a module: try a shorter prefix
                continue
            if err.name and err.name.split(".")[0] == "triton" and _triton_missing():
                return _resolve_by_source(parts)
            return f"importing {module} failed: {err}"
        except Exception as err:                 # noqa: BLE001 - any import failure is a broken path
            return f"importing {module} failed: {type(err).__name__}: {err}"
        for name in parts[i:]:
            if not hasattr(obj, name):
                return f"{'.'.join(parts[:i])} has no attribute path {'.'.join(parts[i:])}"
            obj = getattr(obj, name)
        return None
    return "no importable module prefix"


def _entries(data: Optional[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
    yield from (load() if data is None else data)["equations"]


def _label(e: Dict[str, Any]) -> str:
    return f"{e['paper']} {e['equation']}"


def path_problems(data: Optional[Dict[str, Any]] = None) -> List[str]:
    """Every ``code`` / ``engines`` dotted path that does not resolve."""
    out = []
    for e in _entries(data):
        for path in code_paths(e):
            why = resolve(path)
            if why:
                out.append(f"{_label(e)}: {path}: {why}")
    return out


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def node_id_problems(data: Optional[Dict[str, Any]] = None) -> List[str]:
    """Every ``tests`` node id whose file does not exist or defines no such test (``[param]`` is not checked)."""
    out, trees = [], {}
    for e in _entries(data):
        for node in e["tests"]:
            file, *names = node.split("[", 1)[0].split("::")
            f = ROOT / file
            if not names or not f.is_file() or not file.startswith("tests/"):
                out.append(f"{_label(e)}: {node}: no test file {file} (ids are tests/FILE.py::function)")
                continue
            if f not in trees:
                trees[f] = _parse(f)
            if not names[-1].startswith("test") or not _ast_names(trees[f], names):
                out.append(f"{_label(e)}: {node}: {file} defines no test {'::'.join(names)}")
    return out


def slug(heading: str) -> str:
    """Python-Markdown's default heading id (toc's slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set:
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        found.update(re.findall(r"\{#([\w-]+)\}", line))
        m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if m and "{#" not in m.group(1):
            found.add(slug(m.group(1)))
    return found


def anchor_problems(data: Optional[Dict[str, Any]] = None) -> List[str]:
    """Every ``docs`` reference whose page is missing or has no such anchor."""
    out, cache = [], {}
    for e in _entries(data):
        for ref in _as_list(e["docs"]):
            page, _, anchor = ref.partition("#")
            f = DOCS / page
            if not f.is_file():
                out.append(f"{_label(e)}: {ref}: no page docs/{page}")
                continue
            if f not in cache:
                cache[f] = anchors(f)
            if anchor and anchor not in cache[f]:
                out.append(f"{_label(e)}: {ref}: docs/{page} has no anchor #{anchor}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/paper-map.md differs from the output or a path, test id or anchor is wrong")
    args = ap.parse_args(argv)
    data = load()
    text = render(data)
    if args.check:
        problems = path_problems(data) + node_id_problems(data) + anchor_problems(data)
        if not (OUT.is_file() and OUT.read_text(encoding="utf-8") == text):
            problems.insert(0, "docs/paper-map.md is stale: run python docs/gen_paper_map.py")
        print("\n".join(problems) if problems else "docs/paper-map.md is up to date")
        return 1 if problems else 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
