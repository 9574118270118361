"""Fast weights that differ per position of a chunk, without (or with) materialising them.

Memories apply their weight matrices through :meth:`Memory.linear` (``z = W h``). Besides a plain tensor
``W: [B, H, out, in]`` (shared by all positions), ``W`` may be

- :class:`PerPosition` — ``[B, H, L, out, in]``, one matrix per position s of the input ``h: [B, H, L, in]``;
- :class:`DualForm` — W_s = Σ_m c_m[s] · Base_m + Σ_i A[s, i] · l_i r_iᵀ, the TTT "dual form": GD and momentum
  updates inside a chunk are sums of per-token rank-1 gradients l_i r_iᵀ (l = back-propagated error at the
  layer output, r = layer input), so W_s h_s = Σ_m c_m[s] Base_m h_s + Σ_i A[s, i] l_i (r_i · h_s) costs no
  per-position matrix at all (TTT §2.5; Titans §3.2).

A :class:`Tape` records every ``(input, output)`` of ``Memory.linear`` during one forward, which is how the
engine obtains the rank-1 factors of all per-token gradients in one backward pass.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

_TAPE: contextvars.ContextVar[Optional["Tape"]] = contextvars.ContextVar("atlaslab_tape", default=None)


@dataclass
class Tape:
    """``{weight name: (h, z)}`` of the last forward through each weight, while active."""

    records: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __enter__(self):
        self._token = _TAPE.set(self)
        return self

    def __exit__(self, *exc):
        _TAPE.reset(self._token)


def current_tape() -> Optional[Tape]:
    return _TAPE.get()


@dataclass
class PerPosition:
    """One matrix per position: ``w: [B, H, L, out, in]``."""

    w: torch.Tensor

    def apply(self, h: torch.Tensor) -> torch.Tensor:   # h: [B, H, L, in] → [B, H, L, out]
        return torch.einsum("bhsoi,bhsi->bhso", self.w, h)


@dataclass
class DualForm:
    """W_s = Σ_m coef_m[s] base_m + Σ_i A[s, i] left_i right_iᵀ for the L positions of a chunk.

    ``bases``: list of (coef ``[B, H, L]``, base ``[B, H, out, in]``); ``A: [B, H, L, n]``;
    ``left: [B, H, n, out]``; ``right: [B, H, n, in]``.
    """

    bases: List[Tuple[torch.Tensor, torch.Tensor]]
    A: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor

    def apply(self, h: torch.Tensor) -> torch.Tensor:   # h: [B, H, L, in] → [B, H, L, out]
        out = (self.A * (h @ self.right.mT)) @ self.left            # Σ_i A[s, i] (r_i · h_s) l_i
        for coef, base in self.bases:
            out = out + coef.unsqueeze(-1) * (h @ base.mT)
        return out

    def at(self, s: int) -> torch.Tensor:
        """The matrix of position ``s`` (``[B, H, out, in]``), materialised."""
        w = (self.left * self.A[:, :, s, :, None]).mT @ self.right
        for coef, base in self.bases:
            w = w + coef[:, :, s, None, None] * base
        return w


def apply_linear(name: str, w, h: torch.Tensor) -> torch.Tensor:
    """z = W h for a shared tensor, :class:`PerPosition` or :class:`DualForm` weight; records to the tape."""
    if isinstance(w, torch.Tensor):
        z = h @ w.mT
    else:
        z = w.apply(h)
    # a compiled region (atlaslab.engines.compiled) never runs under a tape: gradient_factors stays eager, and
    # Dynamo cannot trace a ContextVar
    tape = None if torch.compiler.is_compiling() else _TAPE.get()
    if tape is not None:
        if not z.requires_grad:      # e.g. under no_grad: make z a leaf so ∂pred/∂z exists
            z = z.detach().requires_grad_(True)
        tape.records[name] = (h, z)
    return z
