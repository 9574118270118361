"""The package's floors (``atlaslab/__init__.py``): every module imports only its own floor and the ones below,
there are no import cycles, and an import inside a function is there only to defer an optional heavy dependency.

Read from the source with :mod:`ast` (nothing is imported), so a violation names the file, the line and the import.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "atlaslab"

FLOORS = ["registry", "kernels", "memory", "engines", "models", "hf", "tasks", "train", "eval", "search", "cli"]

# (module, imported module) → why the import waits until a function runs
DEFERRED = {
    ("atlaslab.cli", "atlaslab.models"): "`atlaslab --help` and the argument parser load no torch",
    ("atlaslab.cli", "atlaslab.models.presets"): "`atlaslab --help` and the argument parser load no torch",
    ("atlaslab.cli", "atlaslab.train.cli"): "a subcommand loads its floor only when it runs",
    ("atlaslab.cli", "atlaslab.search.cli"): "ray and mlflow load only for run / resume / report",
    ("atlaslab.cli", "atlaslab.search.ui"): "mlflow loads only for ui",
    ("atlaslab", "atlaslab.search.driver"): "`import atlaslab` loads no Ray or MLflow (atlaslab.run / prepare / resume)",
    ("atlaslab", "atlaslab.search.frame"): "`import atlaslab` loads no pandas (atlaslab.load_results / load_curves)",
    ("atlaslab.cli", "atlaslab.search.train_tracking"): "mlflow loads only when `atlaslab train` runs",
    ("atlaslab.cli", "atlaslab.search.export"): "transformers (atlaslab[hf]) loads only for export",
    ("atlaslab.cli", "atlaslab.search.preset_export"): "torch and the search floor load only for export-preset",
    ("atlaslab.search.driver", "atlaslab.search.progress"): "ray.tune (a Tune callback)",
    ("atlaslab.search.driver", "atlaslab.search.searcher"): "ray.tune (a Tune searcher)",
    ("atlaslab.search.driver", "atlaslab.search.schedulers"): "ray.tune (a Tune scheduler)",
    ("atlaslab.eval.lm_eval", "atlaslab.eval.harness"): "lm_eval, an optional extra",
    ("atlaslab.kernels.newton_schulz", "atlaslab.kernels.newton_schulz.fused"): "triton",
}
DEFERRED_PREFIXES = {
    ("atlaslab.engines.triton", "atlaslab.kernels."): "triton: the kernels load when mode='triton' runs",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor(module: str) -> int:
    """The floor index of ``atlaslab.<floor>...``; the modules beside ``cli.py`` (``demo``, ``__main__``) are on the
    cli floor, the package itself above every floor."""
    parts = module.split(".")
    if len(parts) < 2:
        return len(FLOORS)
    return FLOORS.index(parts[1]) if parts[1] in FLOORS else FLOORS.index("cli")


def imports(path: Path):
    """``(line, imported module, inside a function)`` of every import of atlaslab code in ``path``."""
    tree = ast.parse(path.read_text())
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("atlaslab"):
            names = [f"{node.module}.{a.name}" for a in node.names]     # a submodule or a name: see resolve()
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("atlaslab")]
        for name in names:
            yield node.lineno, name, id(node) in in_function


def modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(target: str, known) -> str:
    """``from atlaslab.x import y`` (read as ``atlaslab.x.y``) names a submodule or a name inside ``atlaslab.x``:
    the module it loads."""
    return target if target in known else target.rsplit(".", 1)[0]


def test_the_floors_are_the_packages_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FLOORS) - {"cli"}
    assert {p.stem for p in PACKAGE.glob("*.py")} <= {"__init__", "__main__", "cli", "demo"}


def test_every_import_goes_down_or_stays_on_its_floor():
    known = modules()
    bad = []
    for mod, path in known.items():
        if mod == "atlaslab":
            continue                                   # the package's facade re-exports from the floors
        for line, target, _ in imports(path):
            target = resolve(target, known)
            if floor(target) > floor(mod):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} (floor "
                           f"{FLOORS[floor(target)] if floor(target) < len(FLOORS) else 'atlaslab'} above "
                           f"{FLOORS[floor(mod)] if floor(mod) < len(FLOORS) else mod})")
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_only_defer_optional_heavy_dependencies():
    known = modules()
    bad = []
    for mod, path in known.items():
        for line, target, deferred in imports(path):
            target = resolve(target, known)
            if not deferred or (mod, target) in DEFERRED:
                continue
            if any(mod == m and target.startswith(pre) for m, pre in DEFERRED_PREFIXES):
                continue
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} inside a function")
    assert not bad, "\n".join(bad) + "\n(import at the top, or list the reason in DEFERRED)"
    for (mod, target), _ in DEFERRED.items():             # the list stays what the code does
        assert any(resolve(t, known) == target and d for _, t, d in imports(known[mod])), (mod, target)


def test_no_import_cycles():
    """Over every import (top-level and deferred): a cycle would mean two modules that need each other."""
    known = modules()
    graph = {m: set() for m in known}
    for mod, path in known.items():
        for _, target, _ in imports(path):
            target = resolve(target, known)
            if target != mod:
                graph[mod].add(target)
    seen, on_path, cycles = set(), [], []

    def visit(m):
        seen.add(m)
        on_path.append(m)
        for n in sorted(graph[m]):
            if n in on_path:
                cycles.append(on_path[on_path.index(n):] + [n])
            elif n not in seen:
                visit(n)
        on_path.pop()

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert not cycles, "\n".join(" → ".join(c) for c in cycles)
