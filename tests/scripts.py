"""Load one of the repository's scripts (docs/gen_*.py, bench/*.py), which are not a package, as a module."""
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The module of ``ROOT / relative`` (e.g. ``"docs/gen_discovery.py"``), executed afresh."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
