"""The declared dependencies (pyproject.toml) match the imports of the package.

Read with :mod:`ast` from atlaslab/ (nothing imported): every third-party module it imports belongs to a declared
distribution (mapped with ``importlib.metadata.packages_distributions``); one imported at the top of a module,
outside ``try``, is a core dependency; one behind a guard (``try``, or inside a function) may sit in an extra; and
every core dependency is imported somewhere. Triton is an extra, never core: the torch engines run without it.
"""
import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")           # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "atlaslab"
#: distributions a module needs only at run time through another's API (none is imported by name)
RUNTIME_ONLY: set = set()
#: modules of an extra: their top-level imports are optional because nothing imports them but from inside a
#: function (tests/test_layout.py DEFERRED)
OPTIONAL_MODULES = {"atlaslab/eval/harness.py": "eval", "atlaslab/hf/modeling.py": "hf",
                    "atlaslab/search/export.py": "hf"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9._-]+)", req).group(1))


def declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {name: {requirement_name(r) for r in reqs if not requirement_name(r) == "atlaslab"}
              for name, reqs in project.get("optional-dependencies", {}).items()}
    return core, extras


def third_party_imports():
    """``{top-level module: [(file:line, guarded)]}`` of every import of a module outside atlaslab and the stdlib."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = set()
        optional_module = str(path.relative_to(ROOT)) in OPTIONAL_MODULES
        for node in ast.walk(tree):
            if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body if isinstance(node, ast.Try) else [node]
                guarded.update(id(n) for b in body for n in ast.walk(b) if n is not node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "atlaslab" or top in sys.stdlib_module_names:
                    continue
                found.setdefault(top, []).append((f"{path.relative_to(ROOT)}:{node.lineno}",
                                                  optional_module or id(node) in guarded))
    return found


def distributions(module: str):
    dists = md.packages_distributions().get(module)
    return {canonical(d) for d in dists} if dists else {canonical(module)}


def test_every_import_is_declared_and_unguarded_ones_are_core():
    core, extras = declared()
    optional = set().union(*extras.values())
    bad = []
    for module, sites in sorted(third_party_imports().items()):
        dists = distributions(module)
        unguarded = [s for s, g in sites if not g]
        if unguarded and not dists & core:
            bad.append(f"{module} ({'/'.join(sorted(dists))}) is imported unguarded at {unguarded[0]} but is not a "
                       "core dependency")
        elif not dists & (core | optional):
            bad.append(f"{module} ({'/'.join(sorted(dists))}) is imported at {sites[0][0]} but declared nowhere")
    assert not bad, "\n".join(bad)


def test_every_core_dependency_is_imported():
    core, _ = declared()
    imported = set().union(*(distributions(m) for m in third_party_imports()))
    assert not (core - imported - RUNTIME_ONLY), f"declared but never imported: {sorted(core - imported)}"


def test_triton_is_an_extra_and_every_triton_import_is_guarded():
    core, extras = declared()
    assert "triton" not in core and "triton" in extras["triton"]
    sites = third_party_imports()["triton"]
    assert sites and all(g for _, g in sites), [s for s, g in sites if not g]


def test_ray_mlflow_optuna_have_an_upper_bound_at_the_next_major():
    from packaging.requirements import Requirement
    reqs = {requirement_name(r): Requirement(r) for r in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name in ("ray", "mlflow", "optuna"):
        spec = {s.operator: s.version for s in reqs[name].specifier}
        assert "<" in spec and re.fullmatch(r"\d+", spec["<"]), f"{name}: {reqs[name]} (want <N, N a major version)"
        assert int(spec[">="].split(".")[0]) < int(spec["<"]) and int(md.version(name).split(".")[0]) < int(spec["<"])


def test_the_optional_modules_are_imported_only_from_functions():
    """What OPTIONAL_MODULES relies on: nothing but another optional module imports them at the top of a module."""
    for path in OPTIONAL_MODULES:
        module = path[:-3].replace("/", ".")
        for other in PACKAGE.rglob("*.py"):
            if str(other.relative_to(ROOT)) in OPTIONAL_MODULES:
                continue
            tree = ast.parse(other.read_text())
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module and (node.module == module or any(
                        f"{node.module}.{a.name}" == module for a in node.names)):
                    pytest.fail(f"{other.relative_to(ROOT)}:{node.lineno} imports {module} at the top")
                if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
                    pytest.fail(f"{other.relative_to(ROOT)}:{node.lineno} imports {module} at the top")
