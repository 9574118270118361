"""The one error type every config problem raises.

A researcher who mistypes a YAML key should learn, from one line, *where* the problem is (the dotted
path from the root of the experiment), *what* was wrong (the bad value), and *what would have been
right* (the valid choices, with a close-match suggestion when one exists).
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional, Sequence


def close_matches(value: str, choices: Iterable[str], n: int = 1) -> list[str]:
    """Names in ``choices`` that look like ``value`` (for "did you mean ...?")."""
    return difflib.get_close_matches(str(value), list(choices), n=n, cutoff=0.6)


class ConfigError(ValueError):
    """A configuration is invalid.

    Attributes:
        path: dotted path of the bad field from the config root (``"memory.inner_optimizer.name"``).
        value: the offending value (or ``None`` when a field is missing).
        choices: the valid choices, when the field has a closed set of them.
        reason: one sentence saying what is wrong.
    """

    def __init__(
        self,
        path: str,
        reason: str,
        value: Any = None,
        choices: Optional[Sequence[str]] = None,
    ):
        self.path = path
        self.reason = reason
        self.value = value
        self.choices = list(choices) if choices is not None else None
        super().__init__(self._format())

    def _format(self) -> str:
        msg = f"{self.path or '<root>'}: {self.reason}"
        if self.choices is not None:
            if self.value is not None and isinstance(self.value, str):
                near = close_matches(self.value, self.choices)
                if near:
                    msg += f" Did you mean '{near[0]}'?"
            msg += " Valid choices: " + ", ".join(str(c) for c in self.choices) + "."
        return msg

    def __reduce__(self):
        # picklable with its fields (Ray sends a worker's exception to the process that waits on it)
        return (type(self), (self.path, self.reason, self.value, self.choices))

    def prefixed(self, prefix: str) -> "ConfigError":
        """The same error with ``prefix`` prepended to its path (for nested validation)."""
        if not prefix:
            return self
        path = f"{prefix}.{self.path}" if self.path else prefix
        return ConfigError(path, self.reason, self.value, self.choices)


def join_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
