"""Named models: ``atlaslab/presets/<name>.yaml``, loaded with overrides and built into a language model.

    cfg = load_preset("atlas", ["d_model=32", "mixers.atlas.memory.chunk_size=4"])
    model = build_model(cfg)

A preset file is a model config (:class:`atlaslab.models.lm.LMConfig`): ``vocab_size``, ``d_model``,
``num_layers``, the layer pattern ``layers`` and the named ``mixers``. Overrides are OmegaConf dotlist strings
(``key.path=value``, values parsed as YAML: ``mixers.x.memory.memory={name: linear, init: zeros}``) or a
nested dict, applied in order. Changing a part's ``name`` drops the fields the new part does not have
(``…memory.memory.name=linear`` on an ``mlp`` memory drops ``depth``, ``expansion``, …), and a mapping with a
different ``name`` replaces the node instead of merging into it. A key segment may be a shell-style wildcard
(``mixers.*.num_heads=8``); a wildcard that matches nothing is an error unless the key starts with ``?``
(*where present*: ``?mixers.*.mode=chunked``). The rules live in :mod:`atlaslab.models.overrides`.
The result is validated as a whole; every error is a :class:`ConfigError` naming the dotted path.

The preset folder is ``$ATLASLAB_PRESETS`` when set, else the package data ``atlaslab/presets/`` (read through
:mod:`importlib.resources`, so an installed wheel finds them as an editable checkout does).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf

from atlaslab.models.lm import LanguageModel, ResolvedLM, resolve_lm_config
from atlaslab.models.overrides import Overrides, apply_overrides, complete_for_task, has_wildcard, override_items
from atlaslab.registry import ConfigError, to_container


def preset_dir() -> Path:
    env = os.environ.get("ATLASLAB_PRESETS")
    if env:
        return Path(env)
    return _packaged_presets()


@functools.lru_cache(maxsize=None)
def _packaged_presets() -> Path:
    """The presets shipped inside the package (``atlaslab/presets/*.yaml``, package data of the wheel)."""
    folder = importlib.resources.files("atlaslab").joinpath("presets")
    if isinstance(folder, Path):
        return folder
    # a zipped install: extract the folder once for this process (as_file of a folder needs Python 3.12)
    return _EXTRACTED.enter_context(importlib.resources.as_file(folder))


_EXTRACTED = contextlib.ExitStack()
atexit.register(_EXTRACTED.close)


def list_presets() -> List[str]:
    """Names of the preset files (sorted)."""
    d = preset_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name`` (or ``name`` itself when it is a path to a YAML file)."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    path = preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("preset", f"unknown preset '{name}' (looked in {preset_dir()}).", value=name,
                          choices=list_presets())
    return path


def preset_description(name: str) -> str:
    """The preset's ``description`` field (one line)."""
    try:
        data = yaml.safe_load(preset_path(name).read_text()) or {}
    except Exception:  # pragma: no cover - unreadable preset
        return ""
    return str(data.get("description", "")) if isinstance(data, dict) else ""


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------
def _preset_file(name: str) -> DictConfig:
    """The preset's YAML as a DictConfig (``name`` filled in from the file name), not yet validated."""
    cfg = OmegaConf.load(preset_path(name))
    if not isinstance(cfg, DictConfig):
        raise ConfigError("preset", f"preset '{name}' is not a mapping.", value=name)
    if not cfg.get("name"):
        cfg.name = Path(name).stem
    return cfg


def load_preset(name: str, overrides: Overrides = ()) -> DictConfig:
    """The preset's config with ``overrides`` applied (:mod:`atlaslab.models.overrides`), validated
    (ConfigError with a dotted path if not)."""
    cfg = apply_overrides(_preset_file(name), overrides)
    resolve_lm_config(cfg)
    return cfg


@functools.lru_cache(maxsize=64)
def _preset_resolved(path: str) -> Optional[Dict[str, Any]]:
    """A preset file's config with its defaults (to match wildcards in; None when the file alone is invalid)."""
    try:
        return resolve_lm_config(OmegaConf.load(path)).to_dict()
    except ConfigError:
        return None


def preset_for_task(preset: str, overrides: Overrides = (), vocab_size: Optional[int] = None,
                    ) -> Tuple[DictConfig, ResolvedLM]:
    """``(config, resolved config)`` of preset ``preset`` completed for a task: the task's ``vocab_size`` unless an
    override sets it, then ``overrides`` (:func:`atlaslab.models.overrides.complete_for_task`), validated once.

    A ConfigError has the path inside the model config; ``err.source`` names where the override at fault was
    written (for a list of ``(key, value, source)``), ``model.preset`` for an unknown preset."""
    items = override_items(overrides)
    try:
        path = preset_path(str(preset))
    except ConfigError as exc:
        exc.source = "model.preset"
        raise
    cfg = _preset_file(str(preset))
    # wildcards are matched against the preset with its defaults: resolved once per preset file, and only for them
    wild = any(has_wildcard(k) for k, _, _ in items)
    complete_for_task(cfg, items, vocab_size, _preset_resolved(str(path)) if wild else None)
    try:
        resolved = resolve_lm_config(cfg)
    except ConfigError as exc:
        best = ""          # the override whose key is the longest prefix of the error path is the culprit
        for key, _, src in items:
            if (exc.path == key or exc.path.startswith(key + ".")) and len(key) > len(best):
                best, exc.source = key, src
        if not best and "." in exc.path:     # else one that created the node the error is in
            parent = exc.path.rpartition(".")[0] + "."
            for key, _, src in items:
                if key.startswith(parent):
                    exc.source = f"{src}; preset '{preset}' has no such node"
                    break
        raise
    return cfg, resolved


def resolve_model(cfg: Any) -> ResolvedLM:
    """Validate a model config (preset name, DictConfig, dict, LMConfig) with every default filled in."""
    if isinstance(cfg, str):
        cfg = load_preset(cfg)
    return resolve_lm_config(cfg)


def build_model(cfg: Any, overrides: Overrides = ()) -> LanguageModel:
    """Build the :class:`LanguageModel` of a config (or of a preset name, with ``overrides``)."""
    if isinstance(cfg, str):
        cfg = load_preset(cfg, overrides)
    elif overrides:
        cfg = apply_overrides(OmegaConf.create(to_container(cfg)), overrides)
    return LanguageModel(cfg)


def tiny_overrides(cfg: Any, d_model: int = 16, num_heads: int = 2, vocab_size: int = 32,
                   num_layers: Optional[int] = None, chunk_size: Optional[int] = 4, window: int = 4,
                   segment: int = 4) -> List[str]:
    """Dotlist overrides that shrink a model config (or preset name) for CPU tests and smoke runs.

    Sets the width, vocabulary and heads, the memories' training chunk b (only where it is > ``chunk_size``;
    ``None`` leaves b alone), the SWA windows and the MAC and ARMT segment sizes.
    """
    if isinstance(cfg, str):
        cfg = load_preset(cfg)
    cfg = to_container(cfg)
    out = [f"d_model={d_model}", f"vocab_size={vocab_size}"]
    if num_layers is not None:
        out.append(f"num_layers={num_layers}")
    for key, node in cfg.get("mixers", {}).items():
        p = f"mixers.{key}"
        name = node.get("name")
        out.append(f"{p}.num_heads={num_heads}")
        if node.get("head_dim") is not None:
            out.append(f"{p}.head_dim=null")
        if "memory" in node and chunk_size is not None and node["memory"].get("chunk_size", 1) > chunk_size:
            out.append(f"{p}.memory.chunk_size={chunk_size}")
        if name in ("swa", "lact"):
            out.append(f"{p}.window={window}")
        if name in ("mag", "mal"):
            out.append(f"{p}.attention.window={window}")
            out.append(f"{p}.attention.num_heads=null")
        if name == "mac":
            out.append(f"{p}.segment={segment}")
            out.append(f"{p}.attention.num_heads=null")
        if name == "armt":
            out.append(f"{p}.segment={segment}")
    return out


__all__ = ["apply_overrides", "build_model", "list_presets", "load_preset", "preset_description", "preset_dir",
           "preset_for_task", "preset_path", "resolve_model", "tiny_overrides"]
