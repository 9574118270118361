"""The data the package reads ships inside it: the presets are package data (``atlaslab/presets/*.yaml``), read
through importlib.resources, and every non-Python file under atlaslab/ is matched by a ``package-data`` glob of
pyproject.toml, so a wheel holds it (.ci/wheel_check.sh builds one and checks from outside the repository)."""
import fnmatch
import importlib.resources
from pathlib import Path

import pytest

from atlaslab.models.presets import list_presets, preset_dir, preset_path

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def test_presets_are_package_data(monkeypatch):
    monkeypatch.delenv("ATLASLAB_PRESETS", raising=False)
    folder = importlib.resources.files("atlaslab") / "presets"
    names = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    assert len(names) >= 31 and list_presets() == names
    assert preset_dir() == Path(str(folder)) == ROOT / "atlaslab" / "presets"
    assert preset_path("atlas").read_text() == (folder / "atlas.yaml").read_text()


def test_presets_folder_can_be_replaced(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text((preset_dir() / "deltanet.yaml").read_text())
    monkeypatch.setenv("ATLASLAB_PRESETS", str(tmp_path))
    assert list_presets() == ["mine"]


def test_every_data_file_of_the_package_is_declared_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["atlaslab"]
    package = ROOT / "atlaslab"
    data = [p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "no package data found"
    missing = [d for d in data if not any(fnmatch.fnmatch(d, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] of pyproject.toml, so not in the wheel: {missing}"
