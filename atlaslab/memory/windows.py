"""The Omega rule's window: which past tokens enter each step's inner loss (ATLAS §3.2, Eq.8-9).

See docs/concepts/memory.md#window.

At token t the memory minimises Σ_{i=t−c+1}^{t} γ_i ℓ(M; φ(k_i), v_i). c = 1 is online learning (Delta rule,
Titans), c > 1 a sliding window (OmegaNet, ATLAS), c = ∞ the global objective (Mesa-layer style).
γ_i ∈ [0, 1] is the input-dependent ``window`` gate of token i (a function of the remembered token,
docs/concepts/memory.md#gates); absent, γ = 1. Windows that reach back past the chunk start use those tokens'
gradients at the current chunk-start state (docs/concepts/memory.md#window-spill), and across chained calls the
last c − 1 tokens travel in the state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


from atlaslab.memory.part import Part
from atlaslab.registry import PartConfig, check_range, register


class Window(Part):
    """Base: ``size`` is c, or ``None`` for the global window."""

    @property
    def size(self) -> Optional[int]:
        raise NotImplementedError

    def history(self) -> Optional[int]:
        """How many past tokens the state must carry (c − 1; None = all)."""
        return None if self.size is None else self.size - 1


@register("window", "omega")
class OmegaWindow(Window):
    """Sliding Omega window of size c ≥ 1 with γ gates (ATLAS Eq.9; c = 1 is the online rule)."""

    @dataclass
    class Config(PartConfig):
        size: int = 1

        def check(self) -> None:
            check_range("size", self.size, 1, None)

    @property
    def size(self):
        return self.cfg.size


@register("window", "global")
class GlobalWindow(Window):
    """c = ∞: every past token stays in the inner objective (ATLAS Eq.7, the global objective; the Mesa layer,
    ATLAS Eq.14, solves it exactly)."""

    @dataclass
    class Config(PartConfig):
        pass

    @property
    def size(self):
        return None
