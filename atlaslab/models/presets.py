"""Named models: ``atlaslab/presets/<name>.yaml``, loaded with overrides and built into a language model.

    cfg = load_preset("atlas", ["d_model=32", "mixers.atlas.memory.chunk_size=4"])
    model = build_model(cfg)

A preset file is a model config (:class:`atlaslab.models.lm.LMConfig`): ``vocab_size``, ``d_model``,
``num_layers``, the layer pattern ``layers`` and the named ``mixers``. Overrides are OmegaConf dotlist strings
(``key.path=value``, values parsed as YAML: ``mixers.x.memory.memory={name: linear, init: zeros}``) or a
nested dict, applied in order. Changing a part's ``name`` drops the fields the new part does not have
(``…memory.memory.name=linear`` on an ``mlp`` memory drops ``depth``, ``expansion``, …), and a mapping with a
different ``name`` replaces the node instead of merging into it. A key segment may be a shell-style wildcard
(``mixers.*.num_heads=8``, ``mixers.atl*.memory.chunk_size=4``): it stands for every key of the config, with
its defaults filled in, that matches and has the rest of the path; a wildcard that matches nothing is an error.
The result is validated as a whole; every error is a :class:`ConfigError` naming the dotted path.

The preset folder is ``$ATLASLAB_PRESETS`` when set, else the package data ``atlaslab/presets/`` (read through
:mod:`importlib.resources`, so an installed wheel finds them as an editable checkout does).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fnmatch
import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from atlaslab.models.lm import LanguageModel, ResolvedLM, mixer_kind, resolve_lm_config
from atlaslab.memory.spec import PART_KINDS
from atlaslab.registry import ConfigError, get_registry, to_container

Overrides = Union[Sequence[str], Mapping[str, Any]]


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
# overrides
# --------------------------------------------------------------------------------------------------
def _parse_dotlist_item(item: str) -> Tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError("overrides", f"an override must look like 'key.path=value', got {item!r}.", value=item)
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError("overrides", f"an override needs a key, got {item!r}.", value=item)
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    except OmegaConfBaseException:
        value = raw
    return key, value


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Iterable[Tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and "name" not in v and v:
            yield from _flatten(v, key)
        else:
            yield key, v


def _part_fields(parent_key: str, new_name: Any) -> Optional[set]:
    """Field names of the part that ``parent_key`` will hold once named ``new_name`` (None: unknown)."""
    segments = parent_key.split(".")
    kind = None
    if len(segments) == 2 and segments[0] == "mixers":
        try:
            kind = mixer_kind(new_name, parent_key)
        except ConfigError:
            return None
    elif segments[-1] in PART_KINDS and len(segments) >= 2 and segments[-2] == "memory":
        kind = segments[-1]
    if kind is None:
        return None
    try:
        entry = get_registry(kind).get(new_name, f"{parent_key}.name")
    except ConfigError:
        return None
    return {f.name for f in dataclasses.fields(entry.config)}


def _set(cfg: DictConfig, key: str, value: Any) -> None:
    parent_key, _, leaf = key.rpartition(".")
    existing = OmegaConf.select(cfg, key, default=None)
    if isinstance(value, Mapping) and "name" in value and isinstance(existing, DictConfig) \
            and existing.get("name") != value["name"]:
        OmegaConf.update(cfg, key, dict(value), merge=False)   # a different part: replace the node
        return
    if leaf == "name" and parent_key:
        parent = OmegaConf.select(cfg, parent_key, default=None)
        if isinstance(parent, DictConfig) and parent.get("name") not in (None, value):
            keep = _part_fields(parent_key, value)
            if keep is not None:
                for k in list(parent.keys()):
                    if k != "name" and k not in keep:
                        del parent[k]
    OmegaConf.update(cfg, key, value, merge=True)


WILDCARD_CHARS = "*?["


def has_wildcard(key: str) -> bool:
    return any(c in key for c in WILDCARD_CHARS)


def _glob_keys(node: Any, parts: List[str], prefix: str = "") -> Iterable[str]:
    if not parts:
        yield prefix
        return
    head, rest = parts[0], parts[1:]
    if has_wildcard(head):
        if isinstance(node, Mapping):
            for k in node:
                if fnmatch.fnmatchcase(str(k), head):
                    yield from _glob_keys(node[k], rest, f"{prefix}.{k}" if prefix else str(k))
        return
    key = f"{prefix}.{head}" if prefix else head
    if any(has_wildcard(p) for p in rest):
        if isinstance(node, Mapping) and head in node:
            yield from _glob_keys(node[head], rest, key)
        return
    yield ".".join([key] + rest)


def _exists(node: Any, key: str) -> bool:
    for p in key.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return True


def match_wildcard(resolved: Mapping[str, Any], key: str) -> List[str]:
    """The concrete keys a wildcard ``key`` stands for in ``resolved`` (a resolved model config as a dict,
    defaults filled in): every matching path that exists there, in the config's order."""
    return [k for k in _glob_keys(resolved, key.split(".")) if _exists(resolved, k)]


def changes_structure(key: str, value: Any) -> bool:
    """Whether an override can add, remove or rename nodes (so wildcards must be matched anew after it)."""
    return key.endswith(".name") or key.startswith("layers") or key.count(".") < 2 or \
        (isinstance(value, Mapping) and "name" in value)


def apply_overrides(cfg: DictConfig, overrides: Overrides = ()) -> DictConfig:
    """Apply dotlist strings or a nested dict to ``cfg`` (in place, and returned); wildcard keys are matched
    against the config as it stands when they are applied."""
    if isinstance(overrides, Mapping):
        items = list(_flatten(overrides))
    elif isinstance(overrides, str):
        items = [_parse_dotlist_item(overrides)]
    else:
        items = [_parse_dotlist_item(o) for o in overrides]
    resolved = None           # the config with its defaults, to match wildcards in; renewed after structural changes
    for key, value in items:
        keys = [key]
        if has_wildcard(key):
            if resolved is None:
                resolved = _with_defaults(cfg)
            keys = match_wildcard(resolved, key)
            if not keys:
                raise ConfigError(key, "this wildcard matches no key of the config.", value=value)
        for k in keys:
            try:
                _set(cfg, k, value)
            except OmegaConfBaseException as exc:
                raise ConfigError(k, f"cannot apply override ({str(exc).splitlines()[0]}).", value=value) from None
            if changes_structure(k, value):
                resolved = None
    return cfg


def _with_defaults(cfg: DictConfig) -> Mapping[str, Any]:
    """``cfg`` as a dict with every default filled in; the file's own keys alone while it is not (yet) valid,
    e.g. between two overrides that are only valid together."""
    try:
        return resolve_lm_config(cfg).to_dict()
    except ConfigError:
        return OmegaConf.to_container(cfg)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------
def load_preset(name: str, overrides: Overrides = ()) -> DictConfig:
    """The preset's config with ``overrides`` applied, validated (ConfigError with a dotted path if not)."""
    cfg = OmegaConf.load(preset_path(name))
    if not isinstance(cfg, DictConfig):
        raise ConfigError("preset", f"preset '{name}' is not a mapping.", value=name)
    if not cfg.get("name"):
        cfg.name = Path(name).stem
    apply_overrides(cfg, overrides)
    resolve_lm_config(cfg)
    return cfg


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
           "preset_path", "resolve_model", "tiny_overrides"]
