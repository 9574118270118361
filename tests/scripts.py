"""Load one of the repository's scripts (docs/gen_*.py, bench/*.py), which are not a package, as a module; compare a
figure a test redrew with the committed one."""
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


def same_figure(drawn: Path, committed: Path) -> bool:
    """Byte for byte when this matplotlib drew the committed PNG (it records its version), else the same image size."""
    import matplotlib
    from PIL import Image
    with Image.open(committed) as c, Image.open(drawn) as d:
        if c.info.get("Software", "").startswith(f"Matplotlib version{matplotlib.__version__},"):
            return drawn.read_bytes() == committed.read_bytes()
        return c.size == d.size
