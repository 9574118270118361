"""The documentation site: generated pages are fresh, copied commands and numbers match, the site builds."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen_models():
    spec = importlib.util.spec_from_file_location("gen_models", DOCS / "gen_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gen_paper_map():
    spec = importlib.util.spec_from_file_location("gen_paper_map", DOCS / "gen_paper_map.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bash_blocks(text: str) -> list:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_models_page_is_generated_from_the_presets():
    committed = (DOCS / "models.md").read_text()
    assert committed == _gen_models().render(), \
        "docs/models.md is stale: run `.venv/bin/python docs/gen_models.py` and commit the result"


def test_paper_map_page_is_generated_from_the_yaml():
    committed = (DOCS / "paper-map.md").read_text(encoding="utf-8")
    assert committed == _gen_paper_map().render(), \
        "docs/paper-map.md is stale: run `.venv/bin/python docs/gen_paper_map.py` and commit the result"


def test_paper_map_code_and_engine_paths_resolve():
    """Every `code` / `engines` dotted path of docs/paper_map.yaml imports (longest module prefix + getattr)."""
    problems = _gen_paper_map().path_problems()
    assert not problems, "docs/paper_map.yaml names paths that do not resolve:\n" + "\n".join(problems)


def test_paper_map_test_ids_name_existing_tests():
    """Every `tests` node id names a test function of its file (parsed with ast; a [param] suffix is not checked)."""
    problems = _gen_paper_map().node_id_problems()
    assert not problems, "docs/paper_map.yaml names tests that do not exist:\n" + "\n".join(problems)


def test_paper_map_docs_anchors_exist():
    """Every `docs` link of docs/paper_map.yaml points at a page and an anchor ({#id} or a heading) on it."""
    problems = _gen_paper_map().anchor_problems()
    assert not problems, "docs/paper_map.yaml links to missing pages or anchors:\n" + "\n".join(problems)


def test_paper_map_covers_every_equation_the_code_cites():
    """Each "ATLAS / Titans / Miras Eq.N" cited in atlaslab/ falls inside an equation (group) of the map."""
    gen = _gen_paper_map()
    mapped = {}
    for e in gen.load()["equations"]:
        mapped.setdefault(e["paper"], set()).update(_equation_numbers(e["equation"]))
    cited = re.compile(r"\b(ATLAS|Titans|Miras)(?: App\.[A-Z])? Eqs?\.\s?(\d+(?:\s?[-–,/]\s?\d+)*)")
    missing = []
    for path in sorted((ROOT / "atlaslab").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for paper, numbers in cited.findall(line):
                if not _equation_numbers(numbers) <= mapped.get(paper, set()):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {paper} Eq.{numbers}")
    assert not missing, "equations cited in the code but not in docs/paper_map.yaml:\n" + "\n".join(missing)


def _equation_numbers(text: str) -> set:
    """"Eq.32-33" → {32, 33}; "Eq.10, 56" → {10, 56}; "App.C Eq.32-34" → {32, 33, 34}."""
    text = text.split("Eq.", 1)[-1]
    out = set()
    for part in re.split(r"[,/]", text):
        bounds = [int(x) for x in re.findall(r"\d+", part)]
        if bounds:
            out.update(range(bounds[0], bounds[-1] + 1))
    return out


def test_readme_commands_are_on_the_docs_pages():
    readme = _bash_blocks((ROOT / "README.md").read_text())
    assert len(readme) >= 2
    for page in ("index.md", "getting-started.md"):
        blocks = _bash_blocks((DOCS / page).read_text())
        for cmd in readme[:2]:
            assert cmd in blocks, f"docs/{page} does not show the README command {cmd!r}"


#: Pointers into documents that are not in the repository (spelled in pieces so this file does not match).
OUTSIDE = re.compile("|".join(["ATLAS_" + "FAMILY", "shared/" + "spec", "DESIGN" + r"\.md", "DESIGN" + " §",
                               "ANCHORS" + " §", r"\bspec" + " §"]))


def _stand_alone_files():
    yield from DOCS.rglob("*.md")
    yield from (ROOT / p for p in ("README.md", "mkdocs.yml", "docs/gen_models.py", "docs/gen_paper_map.py",
                                   "docs/gen_tables.py", "docs/gen_runs.py", "docs/gen_recall_vs_state.py",
                                   "docs/paper_map.yaml"))
    for top in ("atlaslab", "experiments", "tests", "bench"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if path.suffix in (".py", ".yaml", ".yml", ".md") and ".peers" not in rel and "results" not in rel:
                yield path


def test_docs_stand_alone():
    """The site, the README, docstrings, comments and presets explain everything themselves: no pointers into
    files outside the repository (they point into docs/ or at the papers' own equations instead)."""
    for path in _stand_alone_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = OUTSIDE.search(line)
            assert m is None, f"{path.relative_to(ROOT)}:{n} points outside the repository ({m.group(0)!r}): {line}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "concepts" / "memory" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "atlaslab.memorize" in api and "LanguageModel" in api


def test_reliability_table_names_existing_tests():
    """Every ``pytest`` command of the fault table (docs/reliability.md) names a test function of its file."""
    import ast
    import re
    text = (ROOT / "docs" / "reliability.md").read_text()
    ids = re.findall(r'`pytest (?:-m slow )?"?(tests/[^`"\s]+?)"?`', text)
    assert len(ids) >= 8, ids
    for node_id in ids:
        path, _, name = node_id.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in names, node_id
