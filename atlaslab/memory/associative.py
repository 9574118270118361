"""ARMT's associative memory: a matrix A and a normaliser z, written by a corrected delta rule and read normalised.

Rodkin et al. 2024, "Associative Recurrent Memory Transformer" (arXiv 2407.04841), §3; docs/concepts/memory.md#armt.
Per layer and memory head, a segment's N memory tokens write (k_i, v_i, β_i) with features φ_i = φ(k_i):

    v̄_i = A φ_i / (zᵀφ_i + ε)                        the value A already associates with k_i
    γ_i = clip(1 − zᵀφ_i / ‖φ_i‖², 0, 1)               how new k_i is to z (``correction: false``: γ_i = 1)
    A ← A + Σ_i β_i (v_i − v̄_i) φ_iᵀ,    z ← z + Σ_i γ_i φ_i

and every token of the next segment reads o = A φ(q) / (zᵀφ(q) + ε). All N writes of a segment see the
segment-start A, z (one parallel step). γ is a constant of the outer gradient, and ε = 1e-5, as in the authors'
code. From A = 0, z = 0 the first segment reads 0 and writes β v φᵀ with γ = 1, the paper's first segment.

``read_floor`` f ≥ 0 (0: the authors' rule) reads A φ / max(zᵀφ + ε, f) instead, in both places. It bounds a
runaway the authors' rule allows: A takes mass along every key's features but z only along new keys' (γ = 0
once a key counts as seen), so a query can meet zᵀφ ≈ 0 where Aφ ≠ 0 and read Aφ / ε. When that query is also
a key, its write corrects A by β Aφ / (zᵀφ + ε), a gain β / (zᵀφ + ε) on A's component along φ (unit features):
above 2 the correction overshoots and grows with every segment. f = 1 keeps the gain at most β < 1, and leaves
the read of any key written in full (zᵀφ ≥ 1) as it was.

Tensor key: b batch, n tokens, h memory heads, f features, e value channels.
A ``[b, h, e, f]`` (the family's ``[D_v, D_k]`` layout), z ``[b, h, f]``.
"""
from __future__ import annotations

from typing import Tuple

import torch

#: ε of the normalised read and of the previous-association estimate v̄.
EPS = 1e-5


def associative_read(A: torch.Tensor, z: torch.Tensor, phi: torch.Tensor, eps: float = EPS,
                     floor: float = 0.0) -> torch.Tensor:
    """o = A φ / max(zᵀφ + ε, floor) for ``phi: [b, n, h, f]`` → ``[b, n, h, e]`` (ARMT's read; floor 0: the
    authors' A φ / (zᵀφ + ε))."""
    num = torch.einsum("bhef,bnhf->bnhe", A, phi)
    den = torch.einsum("bhf,bnhf->bnh", z, phi) + eps
    if floor > 0:
        den = den.clamp_min(floor)
    return num / den.unsqueeze(-1)


def associative_write(A: torch.Tensor, z: torch.Tensor, phi: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                      correction: bool = True, eps: float = EPS,
                      floor: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One segment's write of N tokens (``phi: [b, n, h, f]``, ``v: [b, n, h, e]``, ``beta: [b, n, h]``) → new A, z.

    A ← A + Σ_i β_i (v_i − v̄_i) φ_iᵀ with v̄_i read (with ``floor``) from the segment-start A, z;
    z ← z + Σ_i γ_i φ_i.
    """
    v_bar = associative_read(A, z, phi, eps, floor)
    A = A + torch.einsum("bnh,bnhe,bnhf->bhef", beta, v - v_bar, phi)
    if correction:
        seen = torch.einsum("bhf,bnhf->bnh", z, phi) / phi.square().sum(-1).clamp_min(torch.finfo(phi.dtype).tiny)
        gamma = (1.0 - seen).clamp(0.0, 1.0).detach()
    else:
        gamma = torch.ones_like(beta)
    z = z + torch.einsum("bnh,bnhf->bhf", gamma, phi)
    return A, z


__all__ = ["EPS", "associative_read", "associative_write"]
