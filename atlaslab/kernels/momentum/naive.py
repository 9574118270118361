"""Plain-torch references of a linear memory trained by momentum GD at semantic chunk size b (Titans with a matrix
memory): the token loop (:func:`momentum_recurrent_reference`, any b ≥ 1, any start position) and the chunk form
(:func:`momentum_chunk_reference`, the TTT / Titans dual form per chunk) the momentum kernels compute, with the
argument checks both kernels share. The equations are in docs/kernels.md#momentum.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from atlaslab.kernels.utils import BEFORE_STEP, check_head_dims, log_gate, packed_sequences


def check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens=None) -> int:
    """Check the tensors' shapes and the chunk size (see :func:`.chunk.chunk_momentum`; ``bias``, ``read`` and
    ``placement`` are not checked here: they come already valid from the memory's typed spec); → N, the number of
    sequences (B, or the packed sequences of ``cu_seqlens``)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k: [B, T, H, D_k] and v: [B, T, H, D_v]; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    for name, g in (("beta", beta), ("theta", theta), ("alpha", alpha)):
        if g is not None and g.shape != q.shape[:3] and not (name == "alpha" and g.shape == q.shape):
            want = f"{list(q.shape[:3])}" + (f" or (channel-wise) {list(q.shape)}" if name == "alpha" else "")
            raise ValueError(f"{name}: expected {want}, got {list(g.shape)}")
    B, T, H, K = q.shape
    N = packed_sequences(cu_seqlens, B, T)
    want = (N, H, v.shape[-1], K)
    for name, x in (("initial_state", m0), ("initial_momentum", s0)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected [N, H, D_v, D_k] = {list(want)}, got {list(x.shape)}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    return N


# ------------------------------------------------------------------------------------------ torch reference

def momentum_chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                             theta: torch.Tensor, alpha: Optional[torch.Tensor], m0: torch.Tensor,
                             s0: torch.Tensor, *, chunk_size: int, bias: str, read: str,
                             placement: str, cu_seqlens: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk equations (docs/kernels.md#momentum) in plain torch, one chunk at a time (differentiable).

    Args: as :func:`.chunk.chunk_momentum`. Returns ``(o [B, T, H, D_v], M_T, S_T, M_anchor)``, the three states
    ``[N, H, D_v, D_k]``; ``M_anchor`` is the memory at the start of the last chunk (the initial memory for an
    empty sequence). With ``cu_seqlens`` every packed sequence is run alone (its own initial state, its chunks
    from its first token).
    """
    check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, cu_seqlens)
    opts = dict(chunk_size=chunk_size, bias=bias, read=read, placement=placement)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [momentum_chunk_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], theta[:, s:e],
            alpha[:, s:e] if alpha is not None else None, m0[n:n + 1], s0[n:n + 1], **opts)
            for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return tuple(torch.cat([p[i] for p in pieces], 1 if i == 0 else 0) for i in range(4))
    b, T = int(chunk_size), q.shape[1]
    before = placement == BEFORE_STEP and alpha is not None and bias == "l2"
    if alpha is not None and alpha.dim() == 4:
        return _channel_reference(q, k, v, beta, theta, alpha, m0, s0, b, bias, read, before)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))                        # [B, H, T, D]
    lb = beta.transpose(1, 2)
    lt = log_gate(theta).transpose(1, 2)
    la = log_gate(alpha).transpose(1, 2) if alpha is not None else torch.zeros_like(lt)
    M, S, anchor, outs = m0, s0, m0, []
    for t0 in range(0, T, b):
        sl = slice(t0, min(T, t0 + b))
        qc, kc, vc, bc = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], lb[:, :, sl]
        L = qc.shape[2]
        ga, gt = la[:, :, sl].cumsum(-1), lt[:, :, sl].cumsum(-1)               # log P, log Θ
        upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        D_a = (ga.unsqueeze(-1) - ga.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        D_t = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        P, Th = ga.exp(), gt.exp()
        Q = (D_a @ Th.unsqueeze(-1)).squeeze(-1)                                # Q = D_α Θ
        A = -(D_a @ (D_t * bc.unsqueeze(-2)))                                   # A = −D_α D_θ diag(β)
        if bias == "l2":
            u = kc @ M.mT                                                       # M_a k_i
            e = (P.unsqueeze(-1) * u if before else u) - vc                     # e_i = (P_i) M_a k_i − v_i
        else:
            e = -vc
        y = qc @ M.mT
        if read == "token":
            y = P.unsqueeze(-1) * y + Q.unsqueeze(-1) * (qc @ S.mT) + (A * (qc @ kc.mT)) @ e
        outs.append(y)
        anchor = M
        a_end = A[:, :, -1]                                                     # [B, H, L]
        s_end = -D_t[:, :, -1] * bc
        M, S = (P[:, :, -1, None, None] * M + Q[:, :, -1, None, None] * S + (a_end.unsqueeze(-1) * e).mT @ kc,
                Th[:, :, -1, None, None] * S + (s_end.unsqueeze(-1) * e).mT @ kc)
    o = torch.cat(outs, 2).transpose(1, 2) if outs else v.new_zeros(v.shape)
    return o, M, S, anchor


def _channel_reference(q, k, v, beta, theta, alpha, m0, s0, b, bias, read, before):
    """:func:`momentum_chunk_reference` for channel-wise α ``[B, T, H, D_k]`` (one dense batch): the channel-wise
    chunk equations (docs/kernels.md#momentum) with the [b, b, D_k] coefficient C formed pairwise in log space
    (every exponent ≤ 0). Memory O(T·b·D_k) per head (a reference and fallback, not a fast path)."""
    T = q.shape[1]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))                        # [B, H, T, D]
    lb = beta.transpose(1, 2)                                                  # [B, H, T]
    lt = log_gate(theta).transpose(1, 2)
    la = log_gate(alpha).transpose(1, 2)                                      # [B, H, T, K]
    M, S, anchor, outs = m0, s0, m0, []
    for t0 in range(0, T, b):
        sl = slice(t0, min(T, t0 + b))
        qc, kc, vc, bc = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl], lb[:, :, sl]
        L = qc.shape[2]
        ga, gt = la[:, :, sl].cumsum(-2), lt[:, :, sl].cumsum(-1)              # log P [B, H, L, K], log Θ
        upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        D_a = (ga.unsqueeze(-2) - ga.unsqueeze(-3)).masked_fill(upper[:, :, None], float("-inf")).exp()  # [s, r, K]
        D_t = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()             # [r, i]
        P, Th = ga.exp(), gt.exp()
        Q = torch.einsum("bhsrc,bhr->bhsc", D_a, Th)                           # Q_s = Σ_r Θ_r D_α[s, r]
        A = -torch.einsum("bhsrc,bhri->bhsic", D_a, D_t) * bc[:, :, None, :, None]   # A[s, i, c] = −β_i C_s[i, c]
        if bias == "l2":
            e = (kc * P if before else kc) @ M.mT - vc                         # M_a (P_s ⊙ k_s) − v_s
        else:
            e = -vc
        if read == "token":
            W = torch.einsum("bhsic,bhic,bhsc->bhsi", A, kc, qc)               # Σ_c A[s, i, c] k_ic q_sc
            y = (qc * P) @ M.mT + (qc * Q) @ S.mT + W @ e
        else:
            y = qc @ M.mT
        outs.append(y)
        anchor = M
        a_end = A[:, :, -1]                                                     # [B, H, L, K]
        s_end = -D_t[:, :, -1] * bc
        M, S = (M * P[:, :, -1, None, :] + S * Q[:, :, -1, None, :] + e.mT @ (kc * a_end),
                Th[:, :, -1, None, None] * S + (s_end.unsqueeze(-1) * e).mT @ kc)
    o = torch.cat(outs, 2).transpose(1, 2) if outs else v.new_zeros(v.shape)
    return o, M, S, anchor


def check_recurrent_args(q, k, v, beta, theta, alpha, m0, s0, a0, p0, position, chunk_size) -> None:
    """Validate shapes (see :func:`.fused_recurrent.fused_recurrent_momentum`); channel-wise α (``[B, T, H, D_k]``)
    goes with a ``[B, H, D_k]`` Π α."""
    channel = p0.dim() == 3
    check_args(q=q, k=k, v=v, beta=beta, theta=theta, alpha=None if channel else alpha, m0=m0, s0=s0,
               chunk_size=chunk_size)
    if channel and alpha is not None and tuple(alpha.shape) != tuple(q.shape):
        raise ValueError(f"alpha (channel-wise): expected [B, T, H, D_k] = {list(q.shape)}, got {list(alpha.shape)}")
    if tuple(a0.shape) != tuple(m0.shape):
        raise ValueError(f"initial_anchor: expected [B, H, D_v, D_k] = {list(m0.shape)}, got {list(a0.shape)}")
    want = (q.shape[0], q.shape[2]) + ((q.shape[3],) if channel else ())
    if tuple(p0.shape) != want:
        raise ValueError(f"initial_chunk_alpha: expected {'[B, H, D_k]' if channel else '[B, H]'} = {list(want)}, "
                         f"got {list(p0.shape)}")
    if int(position) < 0:
        raise ValueError(f"position must be ≥ 0, got {position}")
    check_head_dims("fused_recurrent_momentum", q.shape[-1], v.shape[-1])


def momentum_recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                                 theta: torch.Tensor, alpha: Optional[torch.Tensor], m0: torch.Tensor,
                                 s0: torch.Tensor, a0: torch.Tensor, p0: torch.Tensor, *, position: int,
                                 chunk_size: int, bias: str, placement: str,
                                 read: str):
    """The token equations (docs/kernels.md#momentum) in plain torch (differentiable).

    Args: as :func:`.fused_recurrent.fused_recurrent_momentum`. Returns ``(o [B, T, H, D_v], M_T, S_T, M_a [B, H, D_v, D_k],
    P [B, H] or, channel-wise, [B, H, D_k])``. Channel-wise α (``[B, T, H, D_k]``) acts on the
    key axis: M ← M Diag(α_t) + S, and ``before_step`` takes the gradient at M_a Diag(P).
    """
    check_recurrent_args(q, k, v, beta, theta, alpha, m0, s0, a0, p0, position, chunk_size)
    b = int(chunk_size)
    before = placement == BEFORE_STEP and alpha is not None
    channel = p0.dim() == 3
    M, S, A, P = m0, s0, a0, p0
    outs = []
    for t in range(q.shape[1]):
        if (int(position) + t) % b == 0:
            A, P = M, torch.ones_like(P)
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]                               # [B, H, D]
        if alpha is not None:
            P = P * alpha[:, t]
        if bias == "l2" and channel:
            e = torch.einsum("bhvk,bhk->bhv", A, P * k_t if before else k_t) - v_t   # (M_a Diag(P)) k_t − v_t
        elif bias == "l2":
            pred = torch.einsum("bhvk,bhk->bhv", A, k_t)
            e = (P.unsqueeze(-1) * pred if before else pred) - v_t
        else:
            e = -v_t
        S = theta[:, t, :, None, None] * S - (beta[:, t, :, None] * e).unsqueeze(-1) * k_t.unsqueeze(-2)
        if alpha is not None:
            M = (alpha[:, t, :, None, :] if channel else alpha[:, t, :, None, None]) * M
        M = M + S
        outs.append(torch.einsum("bhvk,bhk->bhv", M if read == "token" else A, q_t))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, M, S, A, P
