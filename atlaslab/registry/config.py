"""Validate OmegaConf/YAML nodes against the registered parts' structured configs.

``resolve_part("inner_optimizer", {"name": "muon", "ns_steps": 3}, path="memory.inner_optimizer")``
returns a typed ``Muon.Config`` instance, or raises one :class:`ConfigError` naming the dotted path,
the bad value and the valid choices. Nothing is built and nothing runs before this succeeds.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from atlaslab.registry.errors import ConfigError, join_path
from atlaslab.registry.registry import Entry, PartConfig, get_registry


def to_container(node: Any) -> Any:
    """Plain python containers from an OmegaConf node, a dataclass or a plain value."""
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    return node


def _omegaconf_error(exc: OmegaConfBaseException, path: str, entry: Entry) -> ConfigError:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or ""
    field_path = join_path(path, str(key)) if key else path
    fields = [f.name for f in dataclasses.fields(entry.config) if f.name != "name"]
    if isinstance(exc, ConfigKeyError):
        return ConfigError(field_path, f"{entry.kind} '{entry.name}' has no field '{key}'.",
                           value=str(key), choices=fields)
    if isinstance(exc, ValidationError):
        value = getattr(exc, "value", None)
        msg = str(exc).splitlines()[0]
        return ConfigError(field_path, f"bad value {value!r} for {entry.kind} '{entry.name}' ({msg}).")
    return ConfigError(field_path, str(exc).splitlines()[0])


#: (config class, the node as canonical JSON) → the validated instance. Validating through OmegaConf's structured
#: configs costs about a millisecond a node, and a search resolves the same parts many times over (every size of every
#: candidate, every seed's trial); the key holds the class itself, so a part registered again under its name (a new
#: class) is validated anew. Failures are not kept: an invalid node raises each time, with the path of the call.
_VALIDATED: Dict[Tuple[type, str], Any] = {}
_VALIDATED_MAX = 4096


def _node_key(cls: type, node: Mapping[str, Any]) -> Optional[Tuple[type, str]]:
    try:
        return cls, json.dumps(node, sort_keys=True)
    except (TypeError, ValueError):        # a value JSON cannot spell: validated every time
        return None


def _validated(cls: type, node: Mapping[str, Any], validate) -> Any:
    """``validate()`` (which builds and checks an instance of ``cls`` from ``node``), or a copy of the instance an
    equal node gave before."""
    key = _node_key(cls, node)
    if key is not None and key in _VALIDATED:
        return copy.deepcopy(_VALIDATED[key])
    obj = validate()
    if key is not None:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.pop(next(iter(_VALIDATED)))
        _VALIDATED[key] = copy.deepcopy(obj)
    return obj


def resolve_part(kind: str, node: Any, path: str = "") -> PartConfig:
    """Validate ``node`` (a name, a mapping with ``name``, or a PartConfig) as a part of ``kind``.

    Returns the typed config dataclass with ``name`` set. Raises :class:`ConfigError`.
    """
    registry = get_registry(kind)
    if isinstance(node, PartConfig):
        node = dataclasses.asdict(node)
    node = to_container(node)
    if isinstance(node, str):
        node = {"name": node}
    if not isinstance(node, Mapping):
        raise ConfigError(path, f"expected a {kind} (a mapping with 'name', or a name), got {node!r}.",
                          choices=registry.names())
    node = dict(node)
    name = node.pop("name", None)
    entry = registry.get(name, path=join_path(path, "name"))

    def validate() -> PartConfig:
        try:
            base = OmegaConf.structured(entry.config)
            merged = OmegaConf.merge(base, node)
            cfg = OmegaConf.to_object(merged)
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, path, entry) from None
        cfg.name = entry.name
        try:
            cfg.check()
        except ConfigError as exc:
            raise exc.prefixed(path) from None
        return cfg

    return _validated(entry.config, dict(node, name=entry.name), validate)   # two names may share a class


def build_part(kind: str, node: Any, path: str = "", **context: Any) -> Any:
    """Validate ``node`` and construct the part: ``Entry.cls(cfg, **context)``."""
    cfg = resolve_part(kind, node, path)
    entry = get_registry(kind).get(cfg.name)
    return entry.cls(cfg, **context)


def validate_structured(cls: type, node: Any, path: str = "", what: str = "field") -> Any:
    """Validate ``node`` (mapping / DictConfig / instance) against the dataclass ``cls`` → an instance.

    Unknown keys, ill-typed values and the instance's own ``check()`` raise one :class:`ConfigError` whose
    path is ``path.<key>``; ``what`` names the keys in messages ("training setting", "model field", ...).
    """
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = dataclasses.asdict(node)
    node = to_container(node) or {}
    if not isinstance(node, Mapping):
        raise ConfigError(path, f"expected a mapping, got {node!r}.")
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in node:
        if key not in fields:
            raise ConfigError(join_path(path, str(key)), f"unknown {what} '{key}'.", value=str(key), choices=fields)

    def validate() -> Any:
        try:
            obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(node)))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or ""
            raise ConfigError(join_path(path, str(key)), f"bad value ({str(exc).splitlines()[0]}).") from None
        check = getattr(obj, "check", None)
        if callable(check):
            try:
                check()
            except ConfigError as exc:
                raise exc.prefixed(path) from None
        return obj

    return _validated(cls, dict(node), validate)


def check_choice(field: str, value: Any, choices: Tuple[Any, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices`` (for string enum fields)."""
    if value not in choices:
        raise ConfigError(field, f"bad value {value!r}.", value=value, choices=[str(c) for c in choices])


def check_range(field: str, value: Any, low: Any = None, high: Any = None, what: str = "") -> None:
    """Raise ConfigError unless ``low <= value <= high`` (either bound may be None)."""
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(field, f"bad value {value!r}: {what or 'must lie in'} {bounds}.", value=value)


#: where relative user paths are resolved (the experiment driver sets it for Ray workers, which run in trial folders)
BASE_DIR_ENV = "ATLASLAB_BASE_DIR"


def local_path(path: str) -> str:
    """A user-given file path: ``~`` expanded; a relative one taken from ``$ATLASLAB_BASE_DIR`` (the folder the
    experiment was started from) or else the working folder. URLs (``scheme://``) are returned as they are."""
    if not path or "://" in path:
        return path
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        p = Path(os.environ.get(BASE_DIR_ENV) or os.getcwd()) / p
    return str(p)

