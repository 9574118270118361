"""Overrides: the one dotlist parser, the one wildcard rule, and the one way a model config is completed for a task.

Every place that changes a config from the outside goes through here: ``atlaslab train`` and ``atlaslab run``
(their ``key=value`` arguments), ``atlaslab show``, a run config's ``model.overrides`` and an experiment's model
overrides, grid variants and axes (the search expansion).

**Syntax.** An override is a dotlist string ``key.path=value`` (the value parsed as YAML:
``mixers.x.memory.memory={name: linear, init: zeros}``; a leading ``+`` on the key is accepted and ignored) or
an item of a nested mapping (``{d_model: 32, mixers: {atlas: {num_heads: 4}}}``; a mapping with ``name`` is a
part and is set whole).

**Wildcards.** A key segment of a model override may be a shell-style pattern (``mixers.*.num_heads=8``,
``mixers.atl*.memory.chunk_size=4``): it stands for every key of the config, with its defaults filled in, that
matches and has the rest of the path. A wildcard that matches nothing is an error, so a typo cannot silently
change nothing. A key that starts with ``?`` applies *where present*: ``?mixers.*.mode=chunked`` sets ``mode`` on
every mixer that has one and is no error when none has (a Transformer's attention has no engine); ``?d_model=32``
sets ``d_model`` only if the config has it. In YAML, quote such keys (``"?mixers.*.mode": chunked``).

**For a task.** :func:`complete_for_task` gives a model config the task's vocabulary size before the user's
overrides, unless one of them sets ``vocab_size`` itself.

Every error is a :class:`ConfigError` naming the dotted key; an error raised while applying an override of a
list of ``(key, value, source)`` triples carries ``err.source``, the experiment key that set it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from atlaslab.memory.spec import PART_KINDS
from atlaslab.models.lm import mixer_kind, resolve_lm_config
from atlaslab.registry import ConfigError, get_registry, to_container

#: ``(key, value, source)``: the key inside the config, its value, and where it was written (for error messages)
Override = Tuple[str, Any, str]
Overrides = Union[str, Sequence[Any], Mapping[str, Any]]

#: the prefix of a key that applies only where the config has it (see the module docstring)
WHERE_PRESENT = "?"
WILDCARD_CHARS = "*?["


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
def parse_override(item: Any, path: str = "overrides") -> Tuple[str, Any]:
    """``"key.path=value"`` → ``(key, value)``, the value parsed as YAML (kept as the raw string when it is
    not valid YAML)."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(path, f"an override must look like 'key.path=value', got {item!r}.", value=item)
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(path, f"an override needs a key, got {item!r}.", value=item)
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    except (OmegaConfBaseException, yaml.YAMLError):
        value = raw
    return key, value


def override_items(overrides: Any, prefix: str = "", source: str = "overrides") -> List[Override]:
    """Overrides (a dotlist string, a list of strings or of ``[key, value(, source)]``, or a nested / dotted
    mapping) as ``(key, value, source)`` triples, in order. Mappings are descended except where they carry
    ``name`` (a part replaces the node) or are empty."""
    overrides = to_container(overrides)
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [parse_override(overrides, source) + (source,)]
    if isinstance(overrides, (list, tuple)):
        out = []
        for i, item in enumerate(overrides):
            if isinstance(item, (list, tuple)) and len(item) in (2, 3):
                key, value, src = str(item[0]), item[1], item[2] if len(item) == 3 else f"{source}.{i}"
                if isinstance(value, Mapping) and value and "name" not in value:
                    out.extend((k, v, src) for k, v, _ in override_items(value, key, src))
                else:
                    out.append((key, value, src))
            else:
                out.append(parse_override(item, source) + (f"{source}.{i}",))
        return out
    if not isinstance(overrides, Mapping):
        raise ConfigError(source, f"overrides are a list of 'key=value' or a mapping, got {overrides!r}.",
                          value=overrides)
    out = []
    for k, v in overrides.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v and "name" not in v:
            out.extend(override_items(v, key, f"{source}.{k}"))
        else:
            out.append((key, v, f"{source}.{k}"))
    return out


def update_node(cfg: DictConfig, key: str, value: Any, merge: bool = True) -> None:
    """``OmegaConf.update`` of one plain key (no wildcard); a ConfigError naming the key if it cannot be set."""
    try:
        OmegaConf.update(cfg, key, value, merge=merge)
    except OmegaConfBaseException as exc:
        raise ConfigError(key, f"cannot apply override ({str(exc).splitlines()[0]}).", value=value) from None


# --------------------------------------------------------------------------------------------------
# wildcards
# --------------------------------------------------------------------------------------------------
def has_wildcard(key: str) -> bool:
    """Whether ``key`` stands for several keys (a glob character, or the where-present prefix)."""
    return any(c in key for c in WILDCARD_CHARS)


def _glob_keys(node: Any, parts: List[str], prefix: str = "") -> Iterable[str]:
    if not parts:
        yield prefix
        return
    head, rest = parts[0], parts[1:]
    if any(c in head for c in WILDCARD_CHARS):
        if isinstance(node, Mapping):
            for k in node:
                if fnmatch.fnmatchcase(str(k), head):
                    yield from _glob_keys(node[k], rest, f"{prefix}.{k}" if prefix else str(k))
        return
    key = f"{prefix}.{head}" if prefix else head
    if any(c in p for p in rest for c in WILDCARD_CHARS):
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
    """The concrete keys a key stands for in ``resolved`` (a model config as a dict, defaults filled in): every
    matching path that exists there, in the config's order (the where-present prefix is ignored here)."""
    key = key[len(WHERE_PRESENT):] if key.startswith(WHERE_PRESENT) else key
    return [k for k in _glob_keys(resolved, key.split(".")) if _exists(resolved, k)]


def changes_structure(key: str, value: Any) -> bool:
    """Whether an override can add, remove or rename nodes (so wildcards must be matched anew after it)."""
    return key.endswith(".name") or key.startswith("layers") or key.count(".") < 2 or \
        (isinstance(value, Mapping) and "name" in value)


#: config (as canonical JSON) → that config with its defaults, for the configs that resolved. A search sizes each
#: candidate at several head counts from the same overrides, so the config a size wildcard is matched against repeats;
#: parts are only ever added to the registry, so a config that resolved once resolves the same way again.
_DEFAULTS: Dict[str, Mapping[str, Any]] = {}
_DEFAULTS_MAX = 1024


def _with_defaults(cfg: DictConfig) -> Mapping[str, Any]:
    """``cfg`` as a dict with every default filled in (read-only: it may be shared); the file's own keys alone
    while it is not (yet) valid, e.g. between two overrides that are only valid together."""
    raw = OmegaConf.to_container(cfg)
    key = json.dumps(raw, sort_keys=True, default=str)
    if key in _DEFAULTS:
        return _DEFAULTS[key]
    try:
        full = resolve_lm_config(cfg).to_dict()
    except ConfigError:
        return raw
    if len(_DEFAULTS) >= _DEFAULTS_MAX:
        _DEFAULTS.pop(next(iter(_DEFAULTS)))
    _DEFAULTS[key] = full
    return full


# --------------------------------------------------------------------------------------------------
# applying
# --------------------------------------------------------------------------------------------------
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
    """Set one concrete key: a mapping with a different ``name`` replaces the node; renaming a part drops the
    fields the new part does not have."""
    parent_key, _, leaf = key.rpartition(".")
    existing = OmegaConf.select(cfg, key, default=None)
    if isinstance(value, Mapping) and "name" in value and isinstance(existing, DictConfig) \
            and existing.get("name") != value["name"]:
        update_node(cfg, key, dict(value), merge=False)
        return
    if leaf == "name" and parent_key:
        parent = OmegaConf.select(cfg, parent_key, default=None)
        if isinstance(parent, DictConfig) and parent.get("name") not in (None, value):
            keep = _part_fields(parent_key, value)
            if keep is not None:
                for k in list(parent.keys()):
                    if k != "name" and k not in keep:
                        del parent[k]
    update_node(cfg, key, value, merge=True)


def apply_overrides(cfg: DictConfig, overrides: Overrides = (), resolved: Optional[Mapping[str, Any]] = None
                    ) -> DictConfig:
    """Apply ``overrides`` (see :func:`override_items`) to the model config ``cfg``, in order, in place (and
    return it). Wildcard and where-present keys are matched against the config as it stands when they are
    applied (``resolved``: that config with its defaults, when the caller has it already). A ConfigError
    raised for an override carries ``source``, where the override was written."""
    for key, value, src in override_items(overrides):
        keys = [key]
        optional = key.startswith(WHERE_PRESENT)
        if optional or has_wildcard(key):
            if resolved is None:
                resolved = _with_defaults(cfg)
            keys = match_wildcard(resolved, key)
            if not keys and not optional:
                exc = ConfigError(key, f"this wildcard matches no key of the config (write '{WHERE_PRESENT}{key}' "
                                  "to apply it only where present).", value=value)
                exc.source = src
                raise exc
        for k in keys:
            try:
                _set(cfg, k, value)
            except ConfigError as exc:
                exc.source = src
                raise
            if changes_structure(k, value):
                resolved = None
    return cfg


def sets_key(overrides: Overrides, key: str) -> bool:
    """Whether ``overrides`` set ``key`` (by its plain name)."""
    return any(k.lstrip(WHERE_PRESENT) == key for k, _, _ in override_items(overrides))


def complete_for_task(cfg: DictConfig, overrides: Overrides = (), vocab_size: Optional[int] = None,
                      resolved: Optional[Mapping[str, Any]] = None) -> DictConfig:
    """``cfg`` given the task's ``vocab_size`` (unless an override sets it), then ``overrides`` (in place)."""
    items = override_items(overrides)
    if vocab_size is not None and not sets_key(items, "vocab_size"):
        update_node(cfg, "vocab_size", int(vocab_size))
    return apply_overrides(cfg, items, resolved)


__all__ = ["Override", "WHERE_PRESENT", "apply_overrides", "changes_structure", "complete_for_task",
           "has_wildcard", "match_wildcard", "override_items", "parse_override", "sets_key", "update_node"]
