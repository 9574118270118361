"""How experiment values and keys are written in labels, tables, progress lines and plots.

    short_key("model.mixers.atlas.memory.window.size")   # 'window.size'
    fmt_value({"name": "gd"}), fmt_value(1e-3)            # 'gd', '0.001'
    human_count(1_234_567)                                # '1.23M'
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional


def short_key(key: str) -> str:
    """A readable short name of a dotted key for labels (``…memory.window.size`` → ``window.size``)."""
    parts = key.split(".")
    if parts[0] == "model":
        parts = parts[1:]
        if parts and parts[0] == "mixers" and len(parts) > 2:
            parts = parts[2:]
        if parts and parts[0] == "memory" and len(parts) > 1:
            parts = parts[1:]
    elif parts[0] in ("train", "eval") and len(parts) == 2:
        return parts[1]
    elif parts[0] == "task" and len(parts) == 2:
        return parts[1]
    return ".".join(parts[-2:]) if len(parts) > 2 else ".".join(parts)


def fmt_value(v: Any) -> str:
    """A value as a label: a component node by its name, floats in ``%g``, containers element-wise."""
    if isinstance(v, Mapping):
        if "name" in v and len(v) == 1:
            return str(v["name"])
        return "{" + ", ".join(f"{k}: {fmt_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    return str(v)


def finite_number(v: Any) -> Optional[float]:
    """``v`` as a finite float, else None (booleans, None, text and NaN / inf are not numbers here)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def human_count(n: Any) -> str:
    """A count with a k / M / G suffix (three significant digits); ``?`` when it is not a number."""
    n = finite_number(n)
    if n is None:
        return "?"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n)}"


__all__ = ["finite_number", "fmt_value", "human_count", "short_key"]
