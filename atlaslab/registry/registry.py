"""Registries of interchangeable parts, one per component kind.

A part is a class registered under a name with a structured-config dataclass (its ``Config``):

    @register("attentional_bias", "huber")
    class Huber(AttentionalBias):
        @dataclass
        class Config(PartConfig):
            delta: float = 1.0

A YAML node ``{name: huber, delta: 0.5}`` is then validated against ``Huber.Config`` (unknown field,
wrong type and bad value errors name the dotted path) and built into a ``Huber``.

Users extend atlaslab from their own module: a name with a dot (``my_pkg.my_parts.cauchy``) imports
``my_pkg.my_parts`` (whose decorators register its parts) and then looks up ``cauchy``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Type

from atlaslab.registry.errors import ConfigError

#: Every component kind atlaslab knows.
KINDS = (
    "memory",
    "attentional_bias",
    "retention",
    "feature_map",
    "inner_optimizer",
    "window",
    "mixer",
    "block",
    "task",
    "tokenizer",
)


@dataclass
class PartConfig:
    """Base of every part's structured config: ``name`` selects the registered part."""

    name: str = ""

    def check(self) -> None:
        """Value checks beyond types; raise :class:`ConfigError` with the field name as path."""


@dataclass
class Entry:
    """One registered part."""

    kind: str
    name: str
    cls: Any
    config: Type[PartConfig]
    description: str

    def default_config(self) -> PartConfig:
        cfg = self.config()
        cfg.name = self.name
        return cfg


def _first_doc_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


class Registry:
    """Name → part for one component kind, with wildcard listing and deprecation shims (timm style)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Entry] = {}
        self._deprecated: Dict[str, str] = {}

    # -- filling ---------------------------------------------------------------------------------
    def add(self, name: str, cls: Any, config: Optional[Type[PartConfig]] = None,
            description: Optional[str] = None) -> Entry:
        config = config if config is not None else getattr(cls, "Config", None)
        if config is None or not dataclasses.is_dataclass(config) or not issubclass(config, PartConfig):
            raise TypeError(
                f"{self.kind} '{name}': a part needs a structured config, a dataclass subclassing PartConfig "
                f"(as a nested class `Config` or passed as config=...)"
            )
        if name in self._entries and self._entries[name].cls is not cls:
            raise ValueError(f"{self.kind} '{name}' is already registered by {self._entries[name].cls!r}")
        entry = Entry(self.kind, name, cls, config, description or _first_doc_line(cls))
        self._entries[name] = entry
        return entry

    def deprecate(self, old: str, new: str) -> None:
        """Keep ``old`` working as an alias of ``new``, with a DeprecationWarning when used."""
        self._deprecated[old] = new

    # -- lookup ----------------------------------------------------------------------------------
    def names(self) -> List[str]:
        return sorted(self._entries)

    def list(self, pattern: str = "*") -> List[str]:
        """Registered names matching a shell-style wildcard (``"l*"`` → ``["l1", "l2", "lp"]``)."""
        return [n for n in self.names() if fnmatch.fnmatch(n, pattern)]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries[n] for n in self.names())

    def get(self, name: str, path: str = "name") -> Entry:
        """The entry for ``name``; dotted names import their module first. Unknown → ConfigError."""
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"a {self.kind} needs a name.", value=name, choices=self.names())
        if name in self._deprecated:
            new = self._deprecated[name]
            warnings.warn(f"{self.kind} '{name}' was renamed to '{new}'", DeprecationWarning, stacklevel=3)
            name = new
        if name in self._entries:
            return self._entries[name]
        if "." in name:
            module, _, short = name.rpartition(".")
            import_user_modules([module], path, f" for {self.kind} '{name}'", value=name)
            for candidate in (name, short):
                if candidate in self._entries:
                    return self._entries[candidate]
            raise ConfigError(path, f"module '{module}' was imported but registers no {self.kind} "
                                    f"named '{short}'.", value=short, choices=self.names())
        raise ConfigError(path, f"unknown {self.kind} '{name}'.", value=name, choices=self.names())


def import_user_modules(names: Iterable[str], path: str = "imports", what: str = "", value: Any = None) -> None:
    """Import the user's modules (an experiment's ``imports``, the module of a dotted part name) so that their
    parts register themselves; an ImportError becomes a ConfigError at ``path``. The one place that does it:
    the driver, every Ray trial and every Ray Train worker call this with the experiment's ``imports``."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(path, f"cannot import module '{name}'{what} ({exc}).",
                              value=name if value is None else value) from None


REGISTRIES: Dict[str, Registry] = {kind: Registry(kind) for kind in KINDS}


def get_registry(kind: str) -> Registry:
    if kind not in REGISTRIES:
        raise ConfigError("kind", f"unknown component kind '{kind}'.", value=kind, choices=list(KINDS))
    return REGISTRIES[kind]


def register(kind: str, name: str, config: Optional[Type[PartConfig]] = None,
             description: Optional[str] = None) -> Callable[[Any], Any]:
    """Class decorator: register a part of ``kind`` under ``name``."""

    def deco(cls: Any) -> Any:
        get_registry(kind).add(name, cls, config, description)
        return cls

    return deco


def list_parts(kind: Optional[str] = None, pattern: str = "*") -> Dict[str, List[str]]:
    """``{kind: [names]}`` of registered parts, filtered by kind and wildcard pattern."""
    kinds: Iterable[str] = [kind] if kind else KINDS
    return {k: get_registry(k).list(pattern) for k in kinds}
