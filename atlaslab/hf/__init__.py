"""atlaslab outside atlaslab: Hugging Face models and fla-style layers (docs/huggingface.md).

- :mod:`.modeling`: :class:`AtlaslabConfig` / :class:`AtlaslabForCausalLM` on transformers' base classes, registered
  with ``AutoConfig`` / ``AutoModelForCausalLM`` (model type ``atlaslab``); needs ``pip install 'atlaslab[hf]'``.
- :mod:`.layers`: every mixer with fla's layer interface, for a user's own torch model (torch only).
- :mod:`.cache`: the recurrent-state cache both use, with exact left padding.

Importing this package loads neither module: names resolve on first use, and :func:`register_with_transformers`
(called by ``import atlaslab``) registers the Auto classes as soon as ``transformers`` is imported, so
``AutoModelForCausalLM.from_pretrained(folder)`` works after ``import atlaslab`` without making every
``import atlaslab`` pay for importing transformers.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_NAMES = {
    "AtlaslabConfig": "atlaslab.hf.modeling", "AtlaslabForCausalLM": "atlaslab.hf.modeling",
    "StateCache": "atlaslab.hf.cache",
    **{name: "atlaslab.hf.layers" for name in (
        "ARMTMixer", "AtlaslabMixer", "AttentionMixer", "ForgettingAttentionMixer", "LMMMixer", "LaCTMixer",
        "MACMixer", "MAGMixer", "MALMixer", "MIXER_CLASSES", "MemoryMixer", "SlidingWindowMixer")},
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'atlaslab.hf' has no attribute {name!r}")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers`` is first imported, it lets the normal finders load it, then
    imports :mod:`atlaslab.hf.modeling` (which registers the Auto classes), and takes itself off the path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            importlib.import_module("atlaslab.hf.modeling")
        spec.loader.exec_module = exec_module
        return spec


def register_with_transformers() -> None:
    """Register the Auto classes now if transformers is loaded, else right after it is (nothing if it is not
    installed)."""
    if "transformers" in sys.modules:
        importlib.import_module("atlaslab.hf.modeling")
    elif importlib.util.find_spec("transformers") is not None and \
            not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


__all__ = sorted(_NAMES) + ["register_with_transformers"]
