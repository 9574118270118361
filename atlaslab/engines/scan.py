"""Parallel first-order linear recurrences over a block: X_s = a_s X_{s−1} + U_s (decay and momentum scans), and
the Omega window's band of a block.

Titans §3.2 and ATLAS Eq.39 unroll these recurrences inside a chunk; here they are computed with the
decay matrix D[s, r] = Π_{τ=r+1}^{s} a_τ, built in log space from cumulative sums of log a.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import torch
from torch.autograd.function import once_differentiable


def _clamped_cumlog(a: torch.Tensor):
    """``(a clamped at the dtype's tiny, c = cumsum log of it)``: the cumulative log every decay product here uses."""
    a_c = a.clamp_min(torch.finfo(a.dtype).tiny)
    return a_c, a_c.log().cumsum(-1)


def _decay_from_cumlog(c: torch.Tensor) -> torch.Tensor:
    """``c: [..., L]`` cumulative log → ``D: [..., L, L]``, D[s, r] = exp(c_s − c_r) for r ≤ s, exactly 0 above."""
    L = c.shape[-1]
    upper = torch.ones(L, L, dtype=torch.bool, device=c.device).triu(1)
    return (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()


def decay_matrix(a: torch.Tensor) -> torch.Tensor:
    """``a: [..., L]`` (factors in [0, 1]) → ``D: [..., L, L]`` with D[s, r] = Π_{τ=r+1}^{s} a_τ (r ≤ s), else 0.

    Formed as exp(c_s − c_r) of the cumulative log c, with the upper triangle set to −∞ before the exp
    (so it is exactly 0 and never overflows); meant for blocks of moderate length (a training chunk).
    """
    return _decay_from_cumlog(_clamped_cumlog(a)[1])


def cumulative(a: torch.Tensor) -> torch.Tensor:
    """``a: [..., L]`` → Π_{τ≤s} a_τ, via log-space cumsum."""
    return _clamped_cumlog(a)[1].exp()


def dual_coefficients_reference(a: torch.Tensor, theta: Optional[torch.Tensor], write: torch.Tensor):
    """Coefficients of one chunk's GD / momentum updates in the dual form (TTT §2.5 with decay and momentum).

    ``a``, ``theta``: ``[..., L]`` decay and momentum factors (θ None for plain GD); ``write: [..., L, n]``: what
    step r writes of each gradient term i (η_r C[r, i]). With P, Θ the cumulative products and D the decay
    matrices: S_s = Θ_s S₋₁ + Σ_i S_coef[s, i] u_i with S_coef = −D_θ write, and
    M_s = P_s M₋₁ + Q_s S₋₁ + Σ_i A[s, i] u_i with A = D_α S_coef, Q = D_α Θ (momentum) or A = −D_α write (GD).
    Returns ``(P, Q, A, Θ, S_coef)``; Q, Θ, S_coef are None for GD. Plain autograd; :func:`dual_coefficients` is
    the same with a hand-written backward.
    """
    D_a, P = decay_matrix(a), cumulative(a)
    if theta is None:
        return P, None, -(D_a @ write), None, None
    D_t, Th = decay_matrix(theta), cumulative(theta)
    S_coef = -(D_t @ write)
    return P, (D_a @ Th.unsqueeze(-1)).squeeze(-1), D_a @ S_coef, Th, S_coef


def _log_cum(a: torch.Tensor):
    """(clamped a, D, Π) of :func:`decay_matrix` / :func:`cumulative` from one cumulative log."""
    a_c, c = _clamped_cumlog(a)
    return a_c, _decay_from_cumlog(c), c.exp()


def _grad_log_cum(a: torch.Tensor, a_c: torch.Tensor, D: torch.Tensor, Pi: torch.Tensor, gD, gPi) -> torch.Tensor:
    """∂/∂a of ⟨gD, D⟩ + ⟨gΠ, Π⟩ for D[s, r] = exp(c_s − c_r) (r ≤ s), Π = exp(c), c = cumsum log max(a, tiny):
    with E = gD ⊙ D, c̄ = E 1 − Eᵀ 1 + gΠ ⊙ Π; (log a)‾_r = Σ_{s ≥ r} c̄_s; ā = (log a)‾ / a where a ≥ tiny, else 0."""
    gc = None
    if gD is not None:
        E = gD * D
        gc = E.sum(-1) - E.sum(-2)
    if gPi is not None:
        gc = gPi * Pi if gc is None else gc + gPi * Pi
    if gc is None:
        return None
    glog = gc.flip(-1).cumsum(-1).flip(-1)
    return torch.where(a >= torch.finfo(a.dtype).tiny, glog / a_c, 0.0)


class DualCoefficients(torch.autograd.Function):
    """:func:`dual_coefficients_reference` as one autograd node. Backward (shapes ``[..., L]``, ``[..., L, n]``):

    GD: D̄_α = −Ā writeᵀ, w̄rite = −D_αᵀ Ā. Momentum: D̄_α = Ā S_coefᵀ + Q̄ Θᵀ, S̄ = S̄_coef + D_αᵀ Ā,
    Θ̄ = Θ̄_out + D_αᵀ Q̄, D̄_θ = −S̄ writeᵀ, w̄rite = −D_θᵀ S̄; then D̄, P̄ (Θ̄) → ā (θ̄) through the cumulative log
    (:func:`_grad_log_cum`).
    """

    @staticmethod
    def forward(ctx, a, theta, write):
        a_c, D_a, P = _log_cum(a)
        ctx.set_materialize_grads(False)
        if theta is None:
            ctx.save_for_backward(a, a_c, D_a, P, write)
            return P, -(D_a @ write)
        t_c, D_t, Th = _log_cum(theta)
        S_coef = -(D_t @ write)
        ctx.save_for_backward(a, a_c, D_a, P, write, theta, t_c, D_t, Th, S_coef)
        return P, (D_a @ Th.unsqueeze(-1)).squeeze(-1), D_a @ S_coef, Th, S_coef

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        a, a_c, D_a, P, write = saved[:5]
        if len(saved) == 5:
            gP, gA = grads
            gD_a = gw = None
            if gA is not None:
                gD_a = -(gA @ write.mT)
                gw = -(D_a.mT @ gA)
            return _grad_log_cum(a, a_c, D_a, P, gD_a, gP), None, gw
        theta, t_c, D_t, Th, S_coef = saved[5:]
        gP, gQ, gA, gTh, gS = grads
        gD_a = None
        if gA is not None:
            gD_a = gA @ S_coef.mT
            gS = D_a.mT @ gA if gS is None else gS + D_a.mT @ gA
        if gQ is not None:
            outer = gQ.unsqueeze(-1) * Th.unsqueeze(-2)
            gD_a = outer if gD_a is None else gD_a + outer
            back = (D_a.mT @ gQ.unsqueeze(-1)).squeeze(-1)
            gTh = back if gTh is None else gTh + back
        gD_t = gw = None
        if gS is not None:
            gD_t = -(gS @ write.mT)
            gw = -(D_t.mT @ gS)
        return (_grad_log_cum(a, a_c, D_a, P, gD_a, gP), _grad_log_cum(theta, t_c, D_t, Th, gD_t, gTh), gw)


def dual_coefficients(a: torch.Tensor, theta: Optional[torch.Tensor], write: torch.Tensor):
    """:func:`dual_coefficients_reference` (same arguments and results) as one autograd node with a hand-written
    backward (:class:`DualCoefficients`) for float32 / float64; other dtypes take the reference."""
    if write.dtype not in (torch.float32, torch.float64) or a.dtype != write.dtype:
        return dual_coefficients_reference(a, theta, write)
    if theta is None:
        P, A = DualCoefficients.apply(a, None, write)
        return P, None, A, None, None
    return DualCoefficients.apply(a, theta, write)


def linear_scan(x0: torch.Tensor, a: Optional[torch.Tensor], u: torch.Tensor, channel_wise: bool = False):
    """All X_s of X_s = a_s ⊙ X_{s−1} + U_s for s in the block.

    ``x0: [B, H, *W]``; ``u: [B, H, L, *W]``; ``a``: None (a = 1), ``[B, H, L]`` (scalar per step) or, with
    ``channel_wise``, ``[B, H, L, W_last]`` (scales the last weight axis). Returns ``[B, H, L, *W]``.
    """
    L = u.shape[2]
    extra = u.dim() - 3
    if a is None:
        return x0.unsqueeze(2) + u.cumsum(2)
    if channel_wise:
        a_t = a.movedim(-1, 2)                                          # [B, H, K, L]
        D = decay_matrix(a_t)                                           # [B, H, K, s, r]
        P = cumulative(a_t)                                             # [B, H, K, L]
        mixed = torch.einsum("bhksr,bhr...k->bhs...k", D, u)
        return mixed + P.movedim(2, -1).reshape(*P.shape[:2], L, *(1,) * (extra - 1), P.shape[2]) * x0.unsqueeze(2)
    D = decay_matrix(a)                                                 # [B, H, s, r]
    P = cumulative(a).reshape(*a.shape, *(1,) * extra)
    flat = u.reshape(*u.shape[:3], -1)
    mixed = torch.einsum("bhsr,bhrn->bhsn", D, flat).reshape(u.shape)
    return mixed + P * x0.unsqueeze(2)


def scan_weights(x0: Dict[str, torch.Tensor], a: Optional[torch.Tensor], u: Dict[str, torch.Tensor],
                 channel_wise: bool = False) -> Dict[str, torch.Tensor]:
    """:func:`linear_scan` for every fast-weight tensor of a dict."""
    return {n: linear_scan(x0[n], a, u[n], channel_wise) for n in u}


@functools.lru_cache(maxsize=64)
def window_band(h: int, L: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """``[L, h + L]`` bool: chunk token s (ext index h + s) sees ext token e ≤ h + s, within ``window`` if given."""
    s = torch.arange(L, device=device).unsqueeze(1) + h
    e = torch.arange(h + L, device=device).unsqueeze(0)
    band = e <= s
    if window is not None:
        band = band & (e > s - window)
    return band


def window_matrix(h: int, L: int, window: Optional[int], gamma_ext: torch.Tensor) -> torch.Tensor:
    """C ``[B, H, L, h + L]``: C[s, e] = γ_e if ext token e is in the window of chunk token s (ext index h + s)."""
    return gamma_ext.unsqueeze(-2).masked_fill(~window_band(h, L, window, gamma_ext.device), 0.0)
