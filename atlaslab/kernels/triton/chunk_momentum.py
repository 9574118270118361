"""Chunked Triton forward and backward of a LINEAR memory trained by momentum GD at semantic chunk size b > 1 (Titans
with a matrix memory), its plain torch reference, and the ``memorize`` engine that uses them.

Semantics (docs/concepts/memory.md: training chunk, retention placement, inner optimizer; Titans §3.2 Eq.16-18):
memory linear, ℓ2 or dot-product bias, inner optimizer ``momentum``, retention none, per-head scalar decay or
channel-wise decay (per key channel; below) with either placement, Omega window c = 1, read ``token`` or ``chunk``. One head's memory M and momentum S are
``[D_v, D_k]``; per token s of a chunk that starts from the anchor M_a = M_{t'} (and momentum S_a), with step
β_s = η_s γ_s (learning rate × the c = 1 window gate), momentum gate θ_s, kept fraction α_s (1 without retention)
and the chunk-local cumulative product P_s = Π_{τ=t'}^{s} α_τ:

    e_s = M_a k_s − v_s       (ℓ2, after_step: the gradient at M_a)
    e_s = P_s M_a k_s − v_s   (ℓ2, before_step: the gradient at the decayed anchor W_a = P_s M_a)
    e_s = −v_s                (dot, either placement: the gradient does not depend on M)
    S_s = θ_s S_{s−1} − β_s e_s k_sᵀ,      M_s = α_s M_{s−1} + S_s

Unrolled over the chunk (the TTT / Titans dual form; ``_dual_segment`` in ``engines/chunked.py``), with
Θ_s = Π_{τ≤s} θ_τ and the decay matrices D_α[s, r] = Π_{τ=r+1}^{s} α_τ, D_θ[r, i] = Π_{τ=i+1}^{r} θ_τ
(r ≥ i, else 0):

    S_s = Θ_s S_a − Σ_{i≤s} D_θ[s, i] β_i e_i k_iᵀ
    M_s = P_s M_a + Q_s S_a + Σ_{i≤s} A[s, i] e_i k_iᵀ,      Q = D_α Θ,   A = −D_α D_θ diag(β)

(the placement changes only e), so a read needs no per-position matrix:

    read token:  y_s = P_s (M_a q_s) + Q_s (S_a q_s) + Σ_{i≤s} A[s, i] (k_i·q_s) e_i
    read chunk:  y_s = M_a q_s

and the next chunk starts from M_L, S_L (L = the chunk's last real token; the last chunk may be partial).
Decay products are formed in log space as exp(g_s − g_r) on the causal part only (α, θ clamped at the smallest
positive normal, as :func:`.reference.log_decay`, so a gate of exactly 0 gets no gradient), so no ratio overflows.

Channel-wise decay (``retention: {name: decay, channel_wise: true}``; α_t ∈ [0, 1]^{D_k}, gates
``[B, T, H, D_k]``). The definition (``recurrent.py``, as ``fused_recurrent_momentum.py``): P_s = Π_{τ=t'}^{s} α_τ is
a [D_k] vector, e_s = M_a k_s − v_s (after_step) or (M_a Diag(P_s)) k_s − v_s = M_a (P_s ⊙ k_s) − v_s (before_step),
S_s = θ_s S_{s−1} − β_s e_s k_sᵀ (θ stays a per-head scalar) and M_s = M_{s−1} Diag(α_s) + S_s. Unrolling M with
D_α[s, r] = Π_{τ=r+1}^{s} α_τ (now a [D_k] vector, acting on the key axis) gives

    M_s = M_a Diag(P_s) + S_a Diag(Q_s) + Σ_{i≤s} e_i (k_i ⊙ A[s, i, :])ᵀ,
    Q_s = Σ_{r≤s} Θ_r D_α[s, r],     A[s, i, c] = −β_i C_s[i, c],   C_s[i, c] = Σ_{r=i}^{s} D_θ[r, i] D_α[s, r]_c

(S_s as above), so the reads and the chunk-end step become

    read token:  y_s = M_a (P_s ⊙ q_s) + S_a (Q_s ⊙ q_s) + Σ_{i≤s} W[s, i] e_i,   W[s, i] = Σ_c A[s, i, c] k_ic q_sc
    M_L = M_a Diag(P_L) + S_a Diag(Q_L) + Σ_i e_i (k_i ⊙ a_end_i)ᵀ,   a_end_i = A[L, i, :]  (a [D_k] row per token)

— the scalar form with P, Q, a_end per key channel, and W in place of A ⊙ (q kᵀ). Unlike GLA's single decay, the
coefficient of a write inside a chunk is the double sum C (momentum is a second recurrence between the write and
the memory), which does not split into a factor of s times a factor of i: folding Diag(Π α) into k and q (k ⊙ e^{−g},
q ⊙ e^{g}) would need C_s = e^{g_s} ⊙ (F_s − F_{i−1}) Θ_i^{−1} with F_s = Σ_{r≤s} Θ_r e^{−g_r}, whose e^{−g} and Θ^{−1}
overflow fp32 once a channel forgets fast (α = 0.05: e^{−g} > 1e38 after 30 tokens) and whose difference cancels. The
kernels instead carry C over the chunk's rows, C_s = C_{s−1} Diag(α_s) + D_θ[s, :] ⊗ 1 ([b, D_k], every factor ≤ 1,
every exponent ≤ 0), which is exact at any decay (a channel whose Π α underflows simply contributes 0), and form

- a_end = −β ⊙ (D_θᵀ E), E[r, c] = D_α[L, r]_c = e^{g_Lc − g_rc} (r ≤ L) — one ``tl.dot``, no loop;
- Q_s = α_s ⊙ Q_{s−1} + Θ_s and (read token) W[s, :] = −β ⊙ ((C_s ⊙ k) q_s), row by row in ``_mom_cw_coef_kernel``
  (O(b² D_k) per chunk on CUDA cores, W stored as ``[B, T, H, BT]`` like A ⊙ q kᵀ);

and the state / output / reverse-sweep kernels (``CHANNEL`` constexpr) read P, Q, a_end ``[B, T, H, D_k]``:
e = (k ⊙ P) M_aᵀ − v, M ← M Diag(P_L) + S Diag(Q_L) + eᵀ (k ⊙ a_end), y = (q ⊙ P) M_aᵀ + (q ⊙ Q) S_aᵀ + W e.

Channel-wise backward: the state sweep is the scalar one with the per-channel factors (dE = Wᵀ dO + (k ⊙ a_end) dMᵀ
+ s_end ⊙ (k dSᵀ); dM ← dM Diag(P_L) + dOᵀ (q ⊙ P) + [ℓ2] dEᵀ (k [⊙ P]); dS ← dM Diag(Q_L) + Θ_L dS + dOᵀ (q ⊙ Q));
the per-chunk grad kernel forms dq, dk, dv without the W terms and the coefficient gradients dP, dQ, d a_end
(``[B, T, H, D_k]``), dΘ_L, d s_end and G = dO eᵀ (dA[s, i, c] = G[s, i] k_ic q_sc — b × D_k per token, never
stored); then ``_mom_cw_gate_kernel`` maps them to the inputs in the same loops. With Â_s[i, c] = −β_i dA[s, i, c]
and the log-decay rule (a factor e^{x_s − x_r} sends its gradient to the later end with +, the earlier with −, and
d log α_τ = Σ_{s≥τ} dg_s, a reverse cumsum within the chunk):

    forward over s (carrying C_s):  dq_s += Σ_i G[s, i] A[s, i, :] ⊙ k_i,  dk_i += G[s, i] A[s, i, :] ⊙ q_s,
                                    dβ_i −= G[s, i] Σ_c C_s k q_s,  dg_s += q_s ⊙ dq_s^W,  dg_θ,i −= Σ_c Â_s C_s
    reverse over r (carrying B_r = Â_r + B_{r+1} Diag(α_{r+1}) and R_r = dQ_r + α_{r+1} ⊙ R_{r+1}):
                                    dg_r −= Θ_r R_r + Σ_i D_θ[r, i] B_r[i, :],  dg_θ,r += Σ_c (same)
    closed form (dots):             the a_end terms (Â = −β ⊙ d a_end at s = L; its B_r = Â ⊙ E_r), P (dg += dP ⊙ P),
                                    Q (dg += dQ ⊙ Q), Θ_L, s_end = −β D_θ[L, :]

then d log α = revcumsum(dg), d log θ = revcumsum(dg_θ), dα = d log α / α and dθ = d log θ / θ (0 below the
smallest normal, where the forward clamps, as :func:`_log_gate`). No torch autograd and no [b, b, D_k] tensor.

Limits (channel-wise): the loops cost O(b² D_k) per chunk and head in the coefficient and gate kernels on CUDA cores
(b serial steps of [b, D_k] element-wise work; fla's sub-chunked GLA products would put part of this on tensor cores;
not done), on top of the scalar path's work; the gate kernel holds ~4 [BT, BK] fp32 blocks (C, B, k, dk) per
program, the coefficient kernel 2, and the state sweeps' extra [BT, BK] operands (P, Q, k ⊙ a_end) need shared
memory: compiled for sm_90, every channel-wise build at b ≤ 32 (D_k = 64, 128; fp32 and fp16) fits, but at b = 64 and
D_k = 128 ``_mom_bwd_state_kernel`` asks for up to 409 KiB (over the 227 KiB of a block; the scalar kernels' worst at
b = 64 is 241 KiB), so :func:`spec_reason` takes channel-wise decay only at b ≤ ``MAX_CHANNEL_CHUNK`` = 32 (the
value block is halved channel-wise for the same reason; row sub-blocks in the sweeps would lift this, not done); every factor is ≤ 1 so nothing overflows, and a channel whose Π α underflows fp32 inside a
chunk gives exactly the float64 answer's negligible contribution; the torch reference (and the
``ATLASLAB_MOMENTUM_BACKWARD=torch`` fallback through it) forms the [b, b, D_k] coefficient per chunk, O(T·b·D_k)
memory per head — a reference, not a fast path. Tested only under the interpreter.

Variable-length batches (``cu_seqlens [N + 1]``, N sequences packed as ``[1, total_T, H, D]``) run natively, as the
delta-rule chunk kernels do (:mod:`.chunk`, whose chunk tables and ``_chunk_span`` / ``_sequence_span`` jit helpers
are imported here): every sequence is its own call — M, S restart from its own initial state ``[N, H, D_v, D_k]``,
its semantic chunks start at its first token (b-token chunks never cross a sequence boundary; its last one may be
partial) — the per-chunk kernels run over all chunks of all sequences in ONE launch (the table (sequence, chunk
within it) gives each program its rows), the sequential kernels run one program per value block × sequence × head,
and the final states ``M_T, S_T`` and anchors are ``[N, H, D_v, D_k]``. Chunk-state tensors are ``[NC, H, V, K]``
(NC = all chunks). Without ``cu_seqlens`` the same kernels see B equal sequences of T tokens.

Pieces:

- :func:`momentum_chunk_reference`: exactly these equations in plain torch, one chunk at a time (the reference of
  the kernels, and the recompute of their backward);
- Triton forward, three kernels as in fla's chunk ops (``chunk.py``):
  1. ``_mom_coef_kernel`` (one program per chunk × head, all chunks of all sequences in parallel): g_α, g_θ
     (chunk-local cumsums of log α, log θ), D_α, D_θ, A = −D_α (D_θ diag β) by one ``tl.dot``, P, Θ, Q, the
     chunk-end rows a_end = A[L, :] and s_end = −D_θ[L, :] β, and (read token) the intra-chunk read matrix
     A ⊙ (q kᵀ);
  2. ``_mom_state_kernel`` (one program per value block × sequence·head, sequential over its chunks): carries
     (M, S), stores every chunk-start pair, forms e = k M_aᵀ − v (before_step: P ⊙ (k M_aᵀ) − v; one matmul per
     chunk) and steps M ← P_L M + Q_L S + (a_end ⊙ e)ᵀ k,  S ← Θ_L S + (s_end ⊙ e)ᵀ k;
  3. ``_mom_out_kernel`` (value block × chunk × head, parallel):
     y = P ⊙ (q M_aᵀ) + Q ⊙ (q S_aᵀ) + (A ⊙ q kᵀ) e, or q M_aᵀ for read chunk.
  Intermediates are fp32; their dots take :func:`.precision.dot_precision` (TF32 for half-precision inputs).
- backward (:func:`chunk_momentum_backward`; nothing but the inputs is saved by the forward):
  1. stages 1–2 are re-run (coefficients, A, e and the chunk-start states M_a, S_a);
  2. ``_mom_bwd_state_kernel`` (value block × sequence·head, reverse over its chunks) carries dM, dS = ∂L/∂(chunk-end
     M, S) from the final-state gradients (plus the anchor output's at the last chunk start):
     dE = (A ⊙ q kᵀ)ᵀ dO + a_end ⊙ (k dMᵀ) + s_end ⊙ (k dSᵀ);
     dM ← P_L dM + (P ⊙ dO)ᵀ q + [ℓ2] dEᵀ k  (read chunk: dOᵀ q instead of the P term; before_step: (P ⊙ dE)ᵀ k,
     since ∂e_s/∂M_a = P_s k_sᵀ);
     dS ← Q_L dM + Θ_L dS [+ (Q ⊙ dO)ᵀ q, read token];  the last pair is the initial M's and S's gradient;
  3. ``_mom_bwd_grad_kernel`` (chunk × head, parallel, a loop over value blocks): with G = dO eᵀ,
     dq = P ⊙ (dO M_a) + Q ⊙ (dO S_a) + (G ⊙ A) k,  dk = (G ⊙ A)ᵀ q + [ℓ2] dE M_a + a_end ⊙ (e dM) + s_end ⊙ (e dS),
     dv = −dE, and the coefficients' gradients dP, dQ, dΘ_L, d a_end, d s_end, dA = G ⊙ q kᵀ; before_step (ℓ2):
     the dE M_a term of dk is scaled by P and dP gains the e path, dP_s += dE_s · (M_a k_s) = rowsum(k ⊙ dE M_a);
  4. **torch**: autograd through :func:`chunk_coefficients` (stage 1 in torch, all chunks at once, O(T·b) work and
     no memory-sized tensor) maps the coefficients' gradients to dβ, dθ, dα (so dP's e path reaches dα there).
  Channel-wise decay: ``_mom_cw_coef_kernel`` replaces stage 1 (forward and recompute), the other kernels take
  ``CHANNEL``, and ``_mom_cw_gate_kernel`` (chunk × head, parallel) replaces step 4: it adds the W terms to dq, dk
  and forms dβ, dθ, dα itself (see "Channel-wise backward" above).
  ``BACKWARD = "torch"`` (or ``ATLASLAB_MOMENTUM_BACKWARD=torch``) instead recomputes
  :func:`momentum_chunk_reference` (≥ fp32) under ``enable_grad`` and differentiates it with autograd (the
  reference backward, kept as a fallback).
- :func:`memorize_chunk_momentum`: the ``MODES``-signature engine ``memorize(mode="triton")`` dispatches to for
  this spec (:func:`spec_reason`); it updates the :class:`MemoryState` exactly as the torch engines do. A call that
  starts mid-chunk (``state.position % b ≠ 0``) finishes the open chunk on the torch ``chunked`` engine and runs the
  kernels from the next chunk boundary on.

Status: tested only under ``TRITON_INTERPRET=1`` on CPU (``tests/test_triton_momentum.py``: outputs, states and every
input gradient vs the float64 token loop, both placements, RMS-error ratio ~1e-7 in fp32;
``tests/test_triton_momentum_channel.py``: channel-wise decay the same ways — engine vs ``memorize(mode="recurrent")``,
op vs the float64 reference, chained calls, ``cu_seqlens``, a key channel at α ≈ 0.05, and one whose Π α underflows
fp32 within a b = 32 chunk — RMS-error ratio ≤ 2e-6, typically ~2e-7;
``tests/test_triton_momentum_varlen.py``: packed sequences vs each sequence alone, launches counted); nothing has run
on a GPU and nothing is tuned (one config, ``num_warps=4``; the backward grad kernel holds a few [BT, BK] and
[BT, BT] fp32 accumulators per program, which for D_k = 256 may need a smaller value block or split kernels, as fla
does).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import torch

from atlaslab.kernels.triton.chunk import _Layout, prepare_chunk_indices
from atlaslab.kernels.triton.reference import packed_sequences
from atlaslab.kernels.triton.fallback import with_torch_fallback
from atlaslab.kernels.triton.precision import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from atlaslab.kernels.triton.chunk import _chunk_span, _sequence_span

MAX_D = 256
#: largest semantic chunk b the kernels take (the coefficient kernel holds [b, b] blocks in registers)
MAX_CHUNK = 64
#: largest b the dispatch gives the kernels with channel-wise decay: at b = 64 and D_k = 128 the channel-wise state
#: sweeps ask for more shared memory than an sm_90 block has (up to 409 KiB fp32 / 313 KiB fp16 in
#: ``_mom_bwd_state_kernel``); every build at b ≤ 32 fits (``bench/compile_sm90.py``)
MAX_CHANNEL_CHUNK = 32
BIASES = ("l2", "dot")
READS = ("token", "chunk")
PLACEMENTS = ("after_step", "before_step")


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


def _log_gate(x: torch.Tensor) -> torch.Tensor:
    """log x, x clamped at the smallest positive normal (so log is finite; no gradient below it)."""
    return x.clamp_min(torch.finfo(x.dtype).tiny).log()


def _upcast(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if x is None:
        return None
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement="after_step",
               cu_seqlens=None) -> int:
    """Validate shapes and options (see :func:`chunk_momentum`); → N, the number of sequences (B, or the packed
    sequences of ``cu_seqlens``)."""
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
    if bias not in BIASES or read not in READS or placement not in PLACEMENTS:
        raise ValueError(f"bias must be one of {BIASES}, read one of {READS} and placement one of {PLACEMENTS}; "
                         f"got '{bias}', '{read}', '{placement}'")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    return N


# ------------------------------------------------------------------------------------------ torch reference

def momentum_chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                             theta: torch.Tensor, alpha: Optional[torch.Tensor], m0: torch.Tensor,
                             s0: torch.Tensor, *, chunk_size: int, bias: str = "l2", read: str = "token",
                             placement: str = "after_step", cu_seqlens: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's chunk equations in plain torch, one chunk at a time (differentiable).

    Args: as :func:`chunk_momentum`. Returns ``(o [B, T, H, D_v], M_T, S_T, M_anchor)``, the three states
    ``[N, H, D_v, D_k]``; ``M_anchor`` is the memory at the start of the last chunk (the initial memory for an
    empty sequence). With ``cu_seqlens`` every packed sequence is run alone (its own initial state, its chunks
    from its first token).
    """
    check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens)
    opts = dict(chunk_size=chunk_size, bias=bias, read=read, placement=placement)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [momentum_chunk_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], theta[:, s:e],
            alpha[:, s:e] if alpha is not None else None, m0[n:n + 1], s0[n:n + 1], **opts)
            for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return tuple(torch.cat([p[i] for p in pieces], 1 if i == 0 else 0) for i in range(4))
    b, T = int(chunk_size), q.shape[1]
    before = placement == "before_step" and alpha is not None and bias == "l2"
    if alpha is not None and alpha.dim() == 4:
        return _channel_reference(q, k, v, beta, theta, alpha, m0, s0, b, bias, read, before)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))                        # [B, H, T, D]
    lb = beta.transpose(1, 2)
    lt = _log_gate(theta).transpose(1, 2)
    la = _log_gate(alpha).transpose(1, 2) if alpha is not None else torch.zeros_like(lt)
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
    """:func:`momentum_chunk_reference` for channel-wise α ``[B, T, H, D_k]`` (one dense batch): the module
    docstring's channel-wise chunk equations with the [b, b, D_k] coefficient C formed pairwise in log space
    (every exponent ≤ 0). Memory O(T·b·D_k) per head (a reference and fallback, not a fast path)."""
    T = q.shape[1]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))                        # [B, H, T, D]
    lb = beta.transpose(1, 2)                                                  # [B, H, T]
    lt = _log_gate(theta).transpose(1, 2)
    la = _log_gate(alpha).transpose(1, 2)                                      # [B, H, T, K]
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


# ------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _mom_coef_kernel(q, k, beta, lth, la, p_out, qc_out, th_out, aend_out, send_out, aq_out, a_out,
                         cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, HAS_ALPHA: tl.constexpr, READ_TOKEN: tl.constexpr,
                         STORE_A: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
        """Stage 1, per chunk (program: global chunk × head): P, Θ, Q = D_α Θ, A = −D_α D_θ diag(β),
        a_end = A[L, :], s_end = −D_θ[L, :] β as ``[B, T, H]`` rows, and (read token) A ⊙ (q kᵀ) as rows
        ``[B, T, H, BT]``."""
        i_c = tl.program_id(0)            # all chunks of all sequences in one launch
        i_h = tl.program_id(1)
        i_t, bos, T = _chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)   # T: its sequence's length
        o_i = tl.arange(0, BT)
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        b_gt = tl.cumsum(tl.load(lth + rows, mask=m_t, other=0.0).to(tl.float32), axis=0)
        if HAS_ALPHA:
            b_ga = tl.cumsum(tl.load(la + rows, mask=m_t, other=0.0).to(tl.float32), axis=0)
        else:
            b_ga = tl.zeros([BT], dtype=tl.float32)
        causal = o_i[:, None] >= o_i[None, :]
        D_a = tl.where(causal, tl.exp(tl.where(causal, b_ga[:, None] - b_ga[None, :], 0.0)), 0.0)
        D_t = tl.where(causal, tl.exp(tl.where(causal, b_gt[:, None] - b_gt[None, :], 0.0)), 0.0)
        A = -tl.dot(D_a, D_t * b_beta[None, :], input_precision=PRECISION)
        b_th = tl.exp(b_gt)
        b_qc = tl.sum(D_a * b_th[None, :], axis=1)
        last = tl.minimum(T - i_t * b, b) - 1
        sel = o_i == last
        a_end = tl.sum(tl.where(sel[:, None], A, 0.0), axis=0)
        s_end = -tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0) * b_beta
        tl.store(p_out + rows, tl.exp(b_ga), mask=m_t)
        tl.store(qc_out + rows, b_qc, mask=m_t)
        tl.store(th_out + rows, b_th, mask=m_t)
        tl.store(aend_out + rows, a_end, mask=m_t)
        tl.store(send_out + rows, s_end, mask=m_t)
        if STORE_A:     # A's rows, [B, T, H, BT], for the backward
            tl.store(a_out + rows[:, None] * BT + o_i[None, :], A, mask=m_t[:, None])
        if READ_TOKEN:
            o_k = tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
            tl.store(aq_out + rows[:, None] * BT + o_i[None, :], A * qk, mask=m_t[:, None])

    @triton.jit
    def _cw_rows(x, s, o_i):
        """x[s] of a [BT] vector (s a runtime index)."""
        return tl.sum(tl.where(o_i == s, x, 0.0), axis=0)

    @triton.jit
    def _cw_theta_row(b_gt, s, o_i):
        """Row s of D_θ: [D_θ[s, i]]_i = e^{gt_s − gt_i} for i ≤ s, else 0 (exponent ≤ 0), and Θ_s = e^{gt_s}."""
        gt_s = _cw_rows(b_gt, s, o_i)
        return tl.where(o_i <= s, tl.exp(tl.minimum(gt_s - b_gt, 0.0)), 0.0), tl.exp(gt_s)

    @triton.jit
    def _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K: tl.constexpr, PRECISION: tl.constexpr):
        """The channel-wise chunk coefficients both the forward and the backward form in registers: β, g_θ (cumsum
        of log θ), g (cumsum of log α, [BT, BK]), D_θ, E[r, c] = D_α[L, r, c] = e^{g_Lc − g_rc} (r ≤ L, else 0;
        exponent ≤ 0), C_L = D_θᵀ E (C at the chunk's last row) and the one-hot row L."""
        b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        b_gt = tl.cumsum(tl.load(lth + rows, mask=m_t, other=0.0), axis=0)
        b_g = tl.cumsum(tl.load(la + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0), axis=0)
        causal = o_i[:, None] >= o_i[None, :]
        D_t = tl.where(causal, tl.exp(tl.minimum(tl.where(causal, b_gt[:, None] - b_gt[None, :], 0.0), 0.0)), 0.0)
        sel = o_i == n - 1
        g_l = tl.sum(tl.where(sel[:, None], b_g, 0.0), axis=0)
        E = tl.where(m_tk, tl.exp(tl.minimum(g_l[None, :] - b_g, 0.0)), 0.0)
        C_l = tl.dot(tl.trans(D_t), E, input_precision=PRECISION)
        return b_beta, b_gt, b_g, D_t, E, C_l, sel

    @triton.jit
    def _mom_cw_coef_kernel(q, k, beta, lth, la, p_out, qc_out, th_out, aend_out, send_out, aq_out,
                            cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Stage 1, channel-wise (program: global chunk × head): P = e^g, Θ, s_end = −β D_θ[L, :] as before;
        a_end = −β ⊙ C_L ``[B, T, H, K]`` by one ``tl.dot``; then a loop over the chunk's rows s carries
        C_s = C_{s−1} Diag(α_s) + D_θ[s, :] ⊗ 1 ([BT, BK]; every factor ≤ 1) and Q_s = α_s ⊙ Q_{s−1} + Θ_s,
        storing Q ``[B, T, H, K]`` and (read token) the read row W[s, :] = −β ⊙ ((C_s ⊙ k) q_s) ``[B, T, H, BT]``."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = _chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        n = tl.minimum(T - i_t * b, b)                    # real tokens of this chunk (L = n − 1)
        m_t = o_i < n
        rows = (bos + i_t * b + o_i) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        b_beta, b_gt, b_g, D_t, E, C_l, sel = _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K,
                                                             PRECISION)
        tl.store(p_out + rows[:, None] * K + o_k[None, :], tl.exp(b_g), mask=m_tk)
        tl.store(th_out + rows, tl.exp(b_gt), mask=m_t)
        tl.store(send_out + rows, -tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0) * b_beta, mask=m_t)
        tl.store(aend_out + rows[:, None] * K + o_k[None, :], -b_beta[:, None] * C_l, mask=m_tk)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_C = tl.zeros([BT, BK], dtype=tl.float32)
        b_Q = tl.zeros([BK], dtype=tl.float32)
        for s in range(0, n):
            row = (bos + i_t * b + s) * H + i_h
            b_a = tl.exp(tl.load(la + row * K + o_k, mask=m_k, other=0.0))       # α_s
            d_row, th_s = _cw_theta_row(b_gt, s, o_i)
            b_C = b_C * b_a[None, :] + d_row[:, None]
            b_Q = b_Q * b_a + th_s
            tl.store(qc_out + row * K + o_k, b_Q, mask=m_k)
            if READ_TOKEN:
                b_qs = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                tl.store(aq_out + row * BT + o_i, -b_beta * tl.sum(b_C * b_k * b_qs[None, :], axis=1),
                         mask=o_i < BT)

    @triton.jit
    def _mom_state_kernel(k, v, p, qc, th, aend, send, m0, s0, e_out, hm, hs, mt, st, cu_seqlens, chunk_offsets,
                          T, b, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, IS_L2: tl.constexpr, BEFORE: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Stage 2, sequential over one sequence's chunks (program: value block × sequence·head): store (M_a, S_a)
        ``[NC, H, V, K]``, e = k M_aᵀ − v (ℓ2; before_step: P ⊙ (k M_aᵀ) − v) or −v (dot), then
        M ← P_L M + Q_L S + (a_end ⊙ e)ᵀ k and S ← Θ_L S + (s_end ⊙ e)ᵀ k; the last (M, S) → ``mt, st [N, H, V, K]``.
        ``CHANNEL`` (p, qc, aend ``[B, T, H, K]``): e = (k ⊙ P) M_aᵀ − v (before_step),
        M ← M Diag(P_L) + S Diag(Q_L) + eᵀ (k ⊙ a_end)."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)           # sequence × head (rows of the initial / final states)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = _sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        NT = (T + b - 1) // b             # chunks of b tokens (the helper counts BT-token ones)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        b_M = tl.load(m0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        b_S = tl.load(s0 + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for i_t in range(0, NT):
            h_base = ((boc + i_t) * H + i_h) * V * K
            tl.store(hm + h_base + h_offs, b_M, mask=m_h)
            tl.store(hs + h_base + h_offs, b_S, mask=m_h)
            o_t = i_t * b + o_i
            m_t = (o_i < b) & (o_t < T)
            rows = (bos + o_t) * H + i_h
            m_tv = m_t[:, None] & m_v[None, :]
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            last = tl.minimum(T - i_t * b, b) - 1
            r_last = (bos + i_t * b + last) * H + i_h
            if CHANNEL:
                m_tk = m_t[:, None] & m_k[None, :]
                if IS_L2:
                    if BEFORE:  # the gradient at M_a Diag(P_s): e_s = M_a (P_s ⊙ k_s) − v_s
                        b_kp = b_k * tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                    else:
                        b_kp = b_k
                    b_e = tl.dot(b_kp, tl.trans(b_M), input_precision=PRECISION) - b_v
                else:
                    b_e = -b_v
                tl.store(e_out + rows[:, None] * V + o_v[None, :], b_e, mask=m_tv)
                # M ← M Diag(P_L) + S Diag(Q_L) + eᵀ (k ⊙ a_end)
                p_l = tl.load(p + r_last * K + o_k, mask=m_k, other=0.0)
                q_l = tl.load(qc + r_last * K + o_k, mask=m_k, other=0.0)
                t_l = tl.load(th + r_last)
                b_ka = b_k * tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_se = tl.load(send + rows, mask=m_t, other=0.0)
                new_M = b_M * p_l[None, :] + b_S * q_l[None, :] \
                    + tl.dot(tl.trans(b_e), b_ka, input_precision=PRECISION)
                b_S = t_l * b_S + tl.dot(tl.trans(b_e * b_se[:, None]), b_k, input_precision=PRECISION)
            else:
                if IS_L2:
                    b_e = tl.dot(b_k, tl.trans(b_M), input_precision=PRECISION)
                    if BEFORE:      # the gradient at the decayed anchor P_s M_a
                        b_pe = tl.load(p + rows, mask=m_t, other=0.0)
                        b_e = b_pe[:, None] * b_e
                    b_e = b_e - b_v
                else:
                    b_e = -b_v
                tl.store(e_out + rows[:, None] * V + o_v[None, :], b_e, mask=m_tv)
                p_l = tl.load(p + r_last)
                q_l = tl.load(qc + r_last)
                t_l = tl.load(th + r_last)
                b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
                b_se = tl.load(send + rows, mask=m_t, other=0.0)
                new_M = p_l * b_M + q_l * b_S + tl.dot(tl.trans(b_e * b_ae[:, None]), b_k,
                                                       input_precision=PRECISION)
                b_S = t_l * b_S + tl.dot(tl.trans(b_e * b_se[:, None]), b_k, input_precision=PRECISION)
            b_M = new_M
        tl.store(mt + i_bh.to(tl.int64) * V * K + h_offs, b_M, mask=m_h)
        tl.store(st + i_bh.to(tl.int64) * V * K + h_offs, b_S, mask=m_h)

    @triton.jit
    def _mom_out_kernel(q, p, qc, aq, e, hm, hs, o, cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                        CHANNEL: tl.constexpr = False):
        """Stage 3, per chunk (value block × global chunk × head): y = P ⊙ (q M_aᵀ) + Q ⊙ (q S_aᵀ) + (A ⊙ q kᵀ) e
        (read token); q M_aᵀ (read chunk). ``CHANNEL``: y = (q ⊙ P) M_aᵀ + (q ⊙ Q) S_aᵀ + W e (``aq`` holds W)."""
        i_v = tl.program_id(0)
        i_c = tl.program_id(1)
        i_h = tl.program_id(2)
        i_t, bos, T = _chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        h_offs = (i_c.to(tl.int64) * H + i_h) * V * K + o_v[:, None] * K + o_k[None, :]
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_M = tl.load(hm + h_offs, mask=m_h, other=0.0)
        if CHANNEL:
            if READ_TOKEN:
                m_tk = m_t[:, None] & m_k[None, :]
                b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
                b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
                b_o = tl.dot(b_q * b_p, tl.trans(b_M), input_precision=PRECISION) \
                    + tl.dot(b_q * b_qc, tl.trans(b_S), input_precision=PRECISION) \
                    + tl.dot(b_aq, b_e, input_precision=PRECISION)
            else:
                b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
        else:
            b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
            if READ_TOKEN:
                b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
                b_p = tl.load(p + rows, mask=m_t, other=0.0)
                b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
                b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
                b_o = b_p[:, None] * b_o + b_qc[:, None] * tl.dot(b_q, tl.trans(b_S), input_precision=PRECISION) \
                    + tl.dot(b_aq, b_e, input_precision=PRECISION)
        tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)

    @triton.jit
    def _mom_bwd_state_kernel(q, k, do, aq, p, qc, th, aend, send, dmt, dst, dma, de_out, dhm, dhs, dm0, ds0,
                              cu_seqlens, chunk_offsets, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                              HAS_DMT: tl.constexpr, HAS_DST: tl.constexpr, HAS_DMA: tl.constexpr,
                              IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Backward stage 2, reverse over one sequence's chunks (value block × sequence·head). dM, dS = ∂L/∂(chunk-end
        M, S): dE = (A ⊙ q kᵀ)ᵀ dO + a_end ⊙ (k dMᵀ) + s_end ⊙ (k dSᵀ);
        dM ← P_L dM + (P ⊙ dO)ᵀ q + [ℓ2] dEᵀ k (before_step: (P ⊙ dE)ᵀ k)   (read chunk: dOᵀ q);
        dS ← Q_L dM + Θ_L dS + (Q ⊙ dO)ᵀ q.  ``CHANNEL``: dE = Wᵀ dO + (k ⊙ a_end) dMᵀ + s_end ⊙ (k dSᵀ);
        dM ← dM Diag(P_L) + dOᵀ (q ⊙ P) + [ℓ2] dEᵀ (k [⊙ P, before_step]);  dS ← dM Diag(Q_L) + Θ_L dS + dOᵀ (q ⊙ Q)."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_n = i_bh // H
        i_h = i_bh % H
        bos, T, NT, boc = _sequence_span(cu_seqlens, chunk_offsets, i_n, T, NT, BT, IS_VARLEN)
        NT = (T + b - 1) // b
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_v[:, None] & m_k[None, :]
        h_offs = o_v[:, None] * K + o_k[None, :]
        b_dM = tl.zeros([BV, BK], dtype=tl.float32)
        b_dS = tl.zeros([BV, BK], dtype=tl.float32)
        if HAS_DMT:
            b_dM += tl.load(dmt + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        if HAS_DST:
            b_dS += tl.load(dst + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        for j in range(0, NT):
            i_t = NT - 1 - j
            h_base = ((boc + i_t) * H + i_h) * V * K
            tl.store(dhm + h_base + h_offs, b_dM, mask=m_h)
            tl.store(dhs + h_base + h_offs, b_dS, mask=m_h)
            o_t = i_t * b + o_i
            m_t = (o_i < b) & (o_t < T)
            rows = (bos + o_t) * H + i_h
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_se = tl.load(send + rows, mask=m_t, other=0.0)
            last = tl.minimum(T - i_t * b, b) - 1
            r_last = (bos + i_t * b + last) * H + i_h
            t_l = tl.load(th + r_last)
            if CHANNEL:
                b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                p_l = tl.load(p + r_last * K + o_k, mask=m_k, other=0.0)
                q_l = tl.load(qc + r_last * K + o_k, mask=m_k, other=0.0)
                b_ka = b_k * tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                b_de = tl.dot(b_ka, tl.trans(b_dM), input_precision=PRECISION) \
                    + b_se[:, None] * tl.dot(b_k, tl.trans(b_dS), input_precision=PRECISION)
                if READ_TOKEN:
                    b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                    b_de += tl.dot(tl.trans(b_aq), b_do, input_precision=PRECISION)
                    b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                    new_dM = b_dM * p_l[None, :] + tl.dot(tl.trans(b_do), b_q * b_p, input_precision=PRECISION)
                    b_dS = b_dM * q_l[None, :] + t_l * b_dS \
                        + tl.dot(tl.trans(b_do), b_q * b_qc, input_precision=PRECISION)
                else:
                    new_dM = b_dM * p_l[None, :] + tl.dot(tl.trans(b_do), b_q, input_precision=PRECISION)
                    b_dS = b_dM * q_l[None, :] + t_l * b_dS
                if IS_L2:
                    if BEFORE:  # ∂e_s / ∂M_a = (P_s ⊙ k_s)ᵀ
                        new_dM += tl.dot(tl.trans(b_de), b_k * b_p, input_precision=PRECISION)
                    else:
                        new_dM += tl.dot(tl.trans(b_de), b_k, input_precision=PRECISION)
            else:
                b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
                b_p = tl.load(p + rows, mask=m_t, other=0.0)
                p_l = tl.load(p + r_last)
                q_l = tl.load(qc + r_last)
                b_de = b_ae[:, None] * tl.dot(b_k, tl.trans(b_dM), input_precision=PRECISION) \
                    + b_se[:, None] * tl.dot(b_k, tl.trans(b_dS), input_precision=PRECISION)
                if READ_TOKEN:
                    b_aq = tl.load(aq + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                    b_de += tl.dot(tl.trans(b_aq), b_do, input_precision=PRECISION)
                    b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
                    new_dM = p_l * b_dM + tl.dot(tl.trans(b_do * b_p[:, None]), b_q, input_precision=PRECISION)
                    b_dS = q_l * b_dM + t_l * b_dS \
                        + tl.dot(tl.trans(b_do * b_qc[:, None]), b_q, input_precision=PRECISION)
                else:
                    new_dM = p_l * b_dM + tl.dot(tl.trans(b_do), b_q, input_precision=PRECISION)
                    b_dS = q_l * b_dM + t_l * b_dS
                if IS_L2:
                    if BEFORE:      # ∂e_s / ∂M_a = P_s k_sᵀ
                        new_dM += tl.dot(tl.trans(b_de * b_p[:, None]), b_k, input_precision=PRECISION)
                    else:
                        new_dM += tl.dot(tl.trans(b_de), b_k, input_precision=PRECISION)
            b_dM = new_dM
            tl.store(de_out + rows[:, None] * V + o_v[None, :], b_de, mask=m_tv)
            if HAS_DMA:         # the anchor output is the start state of the last chunk
                if j == 0:
                    b_dM += tl.load(dma + i_bh.to(tl.int64) * V * K + h_offs, mask=m_h, other=0.0).to(tl.float32)
        tl.store(dm0 + i_bh.to(tl.int64) * V * K + h_offs, b_dM, mask=m_h)
        tl.store(ds0 + i_bh.to(tl.int64) * V * K + h_offs, b_dS, mask=m_h)

    @triton.jit
    def _mom_bwd_grad_kernel(q, k, do, a, p, qc, aend, send, e, de, hm, hs, dhm, dhs, dq, dk, dv, dp, dqc, dth,
                             dae, dse, da, cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             IS_L2: tl.constexpr, BEFORE: tl.constexpr, READ_TOKEN: tl.constexpr,
                             IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CHANNEL: tl.constexpr = False):
        """Backward stage 3, per global chunk × head (a loop over value blocks), from M_a, S_a (chunk start) and
        dM, dS (chunk end): G = dO eᵀ; dq = P ⊙ (dO M_a) + Q ⊙ (dO S_a) + (G ⊙ A) k (read chunk: dO M_a);
        dk = (G ⊙ A)ᵀ q + [ℓ2] dE M_a (before_step: P ⊙ (dE M_a)) + a_end ⊙ (e dM) + s_end ⊙ (e dS); dv = −dE; and
        the coefficients' grads dP = rowsum(dO ⊙ q M_aᵀ) (+⟨dM, M_a⟩ at L; before_step: + rowsum(k ⊙ dE M_a)),
        dQ = rowsum(dO ⊙ q S_aᵀ) (+⟨dM, S_a⟩ at L), dΘ = ⟨dS, S_a⟩ at L, d a_end = rowsum(k ⊙ e dM),
        d s_end = rowsum(k ⊙ e dS), dA = G ⊙ q kᵀ (read token).  ``CHANNEL`` (P, Q, a_end and their gradients
        ``[B, T, H, K]``): dq = P ⊙ (dO M_a) + Q ⊙ (dO S_a), dk = [ℓ2] (c ⊙) dE M_a + a_end ⊙ (e dM) + s_end ⊙ (e dS)
        (the intra-chunk W terms are added by ``_mom_cw_gate_kernel``), dP = q ⊙ (dO M_a) (+ Σ_v dM ⊙ M_a at L;
        before_step: + k ⊙ (dE M_a)), dQ = q ⊙ (dO S_a) (+ Σ_v dM ⊙ S_a at L), d a_end = k ⊙ (e dM), and G itself
        into ``da``."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = _chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_t = i_t * b + o_i
        m_t = (o_i < b) & (o_t < T)
        rows = (bos + o_t) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if CHANNEL:     # per key channel: [BT, BK] coefficients and gradients
            b_p = tl.load(p + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_qc = tl.load(qc + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_ae = tl.load(aend + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_p = tl.load(p + rows, mask=m_t, other=0.0)
            b_qc = tl.load(qc + rows, mask=m_t, other=0.0)
            b_ae = tl.load(aend + rows, mask=m_t, other=0.0)
        b_se = tl.load(send + rows, mask=m_t, other=0.0)
        last = tl.minimum(T - i_t * b, b) - 1
        h_base = (i_c.to(tl.int64) * H + i_h) * V * K
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_G = tl.zeros([BT, BT], dtype=tl.float32)
        if CHANNEL:
            b_dp = tl.zeros([BT, BK], dtype=tl.float32)
            b_dqc = tl.zeros([BT, BK], dtype=tl.float32)
            b_dae = tl.zeros([BT, BK], dtype=tl.float32)
        else:
            b_dp = tl.zeros([BT], dtype=tl.float32)
            b_dqc = tl.zeros([BT], dtype=tl.float32)
            b_dae = tl.zeros([BT], dtype=tl.float32)
        b_dse = tl.zeros([BT], dtype=tl.float32)
        b_mm = tl.zeros([BV, BK], dtype=tl.float32)        # dM ⊙ M_a, dM ⊙ S_a, dS ⊙ S_a: summed at the end
        b_ms = tl.zeros([BV, BK], dtype=tl.float32)
        b_ss = tl.zeros([BV, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_h = m_v[:, None] & m_k[None, :]
            h_offs = h_base + o_v[:, None] * K + o_k[None, :]
            b_M = tl.load(hm + h_offs, mask=m_h, other=0.0)
            b_S = tl.load(hs + h_offs, mask=m_h, other=0.0)
            b_dM = tl.load(dhm + h_offs, mask=m_h, other=0.0)
            b_dS = tl.load(dhs + h_offs, mask=m_h, other=0.0)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_e = tl.load(e + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            b_de = tl.load(de + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            tl.store(dv + rows[:, None] * V + o_v[None, :], (-b_de).to(dv.dtype.element_ty), mask=m_tv)
            b_doM = tl.dot(b_do, b_M, input_precision=PRECISION)
            if READ_TOKEN:
                b_doS = tl.dot(b_do, b_S, input_precision=PRECISION)
                if CHANNEL:
                    b_dq += b_p * b_doM + b_qc * b_doS
                    b_dp += b_q * b_doM
                    b_dqc += b_q * b_doS
                else:
                    b_dq += b_p[:, None] * b_doM + b_qc[:, None] * b_doS
                    b_dp += tl.sum(b_q * b_doM, axis=1)
                    b_dqc += tl.sum(b_q * b_doS, axis=1)
                b_G += tl.dot(b_do, tl.trans(b_e), input_precision=PRECISION)
            else:
                b_dq += b_doM
            if IS_L2:
                b_deM = tl.dot(b_de, b_M, input_precision=PRECISION)
                if BEFORE:      # e_s = P_s M_a k_s − v_s: dk_s = P_s M_aᵀ dE_s, dP_s += dE_s · M_a k_s
                    if CHANNEL:     # e_s = M_a (P_s ⊙ k_s) − v_s
                        b_dk += b_p * b_deM
                        b_dp += b_k * b_deM
                    else:
                        b_dk += b_p[:, None] * b_deM
                        b_dp += tl.sum(b_k * b_deM, axis=1)
                else:
                    b_dk += b_deM
            b_eM = tl.dot(b_e, b_dM, input_precision=PRECISION)
            b_eS = tl.dot(b_e, b_dS, input_precision=PRECISION)
            if CHANNEL:
                b_dk += b_ae * b_eM + b_se[:, None] * b_eS
                b_dae += b_k * b_eM
            else:
                b_dk += b_ae[:, None] * b_eM + b_se[:, None] * b_eS
                b_dae += tl.sum(b_k * b_eM, axis=1)
            b_dse += tl.sum(b_k * b_eS, axis=1)
            b_mm += b_dM * b_M
            b_ms += b_dM * b_S
            b_ss += b_dS * b_S
        if READ_TOKEN:
            if CHANNEL:     # the W terms need the per-channel C_s: the gate kernel takes G from here
                tl.store(da + rows[:, None] * BT + o_i[None, :], b_G, mask=m_t[:, None])
            else:
                b_A = tl.load(a + rows[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
                b_W = b_G * b_A
                b_dq += tl.dot(b_W, b_k, input_precision=PRECISION)
                b_dk += tl.dot(tl.trans(b_W), b_q, input_precision=PRECISION)
                causal = (o_i[:, None] >= o_i[None, :]) & m_t[None, :]
                qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
                tl.store(da + rows[:, None] * BT + o_i[None, :], tl.where(causal, b_G * qk, 0.0),
                         mask=m_t[:, None])
        sel = o_i == last
        if CHANNEL:     # Σ_v dM ⊙ M_a, Σ_v dM ⊙ S_a per key channel
            b_dp += tl.where(sel[:, None], tl.sum(b_mm, axis=0)[None, :], 0.0)
            b_dqc += tl.where(sel[:, None], tl.sum(b_ms, axis=0)[None, :], 0.0)
        else:
            b_dp += tl.where(sel, tl.sum(tl.sum(b_mm, axis=1), axis=0), 0.0)
            b_dqc += tl.where(sel, tl.sum(tl.sum(b_ms, axis=1), axis=0), 0.0)
        b_dth = tl.where(sel, tl.sum(tl.sum(b_ss, axis=1), axis=0), 0.0)
        tl.store(dq + rows[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + rows[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if CHANNEL:
            tl.store(dp + rows[:, None] * K + o_k[None, :], b_dp, mask=m_tk)
            tl.store(dqc + rows[:, None] * K + o_k[None, :], b_dqc, mask=m_tk)
        else:
            tl.store(dp + rows, b_dp, mask=m_t)
            tl.store(dqc + rows, b_dqc, mask=m_t)
        tl.store(dth + rows, b_dth, mask=m_t)
        if CHANNEL:
            tl.store(dae + rows[:, None] * K + o_k[None, :], b_dae, mask=m_tk)
        else:
            tl.store(dae + rows, b_dae, mask=m_t)
        tl.store(dse + rows, b_dse, mask=m_t)

    @triton.jit
    def _mom_cw_gate_kernel(q, k, beta, lth, la, qc, gm, dp, dqc, dth, dae, dse, dq, dk, dbeta, dla, dlth,
                            cu_seqlens, chunk_indices, T, b, NT, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, READ_TOKEN: tl.constexpr, IS_VARLEN: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Backward stage 4, channel-wise (program: global chunk × head): from G = dO eᵀ (``gm``, read token) and
        the coefficient gradients dP, dQ, d a_end ``[B, T, H, K]``, dΘ_L, d s_end ``[B, T, H]`` of
        ``_mom_bwd_grad_kernel``, adds the intra-chunk W terms to dq, dk and forms dβ, d log α ``[B, T, H, K]`` and
        d log θ ``[B, T, H]`` (module docstring, "channel-wise backward"): a forward loop over s carrying C_s and a
        reverse loop over r carrying B_r = Â_r + B_{r+1} Diag(α_{r+1}) and R_r = dQ_r + α_{r+1} ⊙ R_{r+1}, then
        reverse cumsums of the log-decay gradients within the chunk."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_t, bos, T = _chunk_span(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        n = tl.minimum(T - i_t * b, b)
        m_t = o_i < n
        rows = (bos + i_t * b + o_i) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        t_offs = rows[:, None] * K + o_k[None, :]
        b_beta, b_gt, b_g, D_t, E, C_l, sel = _cw_chunk_head(beta, lth, la, rows, m_t, m_tk, o_i, o_k, n, K,
                                                             PRECISION)
        b_th = tl.exp(b_gt)
        b_P = tl.where(m_tk, tl.exp(b_g), 0.0)
        b_dae = tl.load(dae + t_offs, mask=m_tk, other=0.0)
        b_dse = tl.load(dse + rows, mask=m_t, other=0.0)
        b_dth = tl.load(dth + rows, mask=m_t, other=0.0)          # dΘ_L at row L, 0 elsewhere
        b_sl = tl.sum(tl.where(sel[:, None], D_t, 0.0), axis=0)     # D_θ[L, :]
        b_se = -b_beta * b_sl
        # P_s = e^{g_s}, Q_s (the '+' end of their log-decays), Θ_L = e^{gt_L}, s_end = −β e^{gt_L − gt}
        b_dg = tl.load(dp + t_offs, mask=m_tk, other=0.0) * b_P \
            + tl.load(dqc + t_offs, mask=m_tk, other=0.0) * tl.load(qc + t_offs, mask=m_tk, other=0.0)
        b_dgt = b_dth * b_th + tl.where(sel, tl.sum(b_dse * b_se, axis=0), 0.0) - b_dse * b_se
        b_db = -b_dse * b_sl
        # a_end = −β ⊙ C_L, C_L = D_θᵀ E: Â = −β ⊙ d a_end; X = Â ⊙ C_L; the '−' ends Σ_i D_θ[r, i] Â_i ⊙ E_r
        b_ah = -b_beta[:, None] * b_dae
        b_X = b_ah * C_l
        b_dg += tl.where(sel[:, None], tl.sum(b_X, axis=0)[None, :], 0.0)
        b_dgt -= tl.sum(b_X, axis=1)
        b_db -= tl.sum(b_dae * C_l, axis=1)
        b_Y = E * tl.dot(D_t, b_ah, input_precision=PRECISION)
        b_dg -= b_Y
        b_dgt += tl.sum(b_Y, axis=1)
        b_k = tl.load(k + t_offs, mask=m_tk, other=0.0).to(tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        if READ_TOKEN:      # W[s, i] = −β_i Σ_c C_s[i, c] k_ic q_sc
            b_C = tl.zeros([BT, BK], dtype=tl.float32)
            for s in range(0, n):
                row = (bos + i_t * b + s) * H + i_h
                b_a = tl.exp(tl.load(la + row * K + o_k, mask=m_k, other=0.0))
                d_row, th_s = _cw_theta_row(b_gt, s, o_i)
                b_C = b_C * b_a[None, :] + d_row[:, None]
                b_qs = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_gr = tl.load(gm + row * BT + o_i, mask=o_i <= s, other=0.0)      # G[s, i], i ≤ s
                b_u = -b_beta * b_gr
                b_KC = b_k * b_C
                dq_s = tl.sum(b_u[:, None] * b_KC, axis=0)                       # Σ_i G A[s, i, :] ⊙ k_i
                w_s = tl.sum(b_KC * b_qs[None, :], axis=1)                        # Σ_c C_s k q_s
                b_dk += b_u[:, None] * b_C * b_qs[None, :]
                b_db -= b_gr * w_s
                b_dgt -= b_u * w_s
                b_dg = tl.where((o_i == s)[:, None], b_dg + (b_qs * dq_s)[None, :], b_dg)
                tl.store(dq + row * K + o_k, tl.load(dq + row * K + o_k, mask=m_k, other=0.0) + dq_s, mask=m_k)
        b_B = tl.zeros([BT, BK], dtype=tl.float32)
        b_R = tl.zeros([BK], dtype=tl.float32)
        for j in range(0, n):
            r = n - 1 - j
            row = (bos + i_t * b + r) * H + i_h
            b_an = tl.exp(tl.load(la + (row + H) * K + o_k, mask=m_k & (o_k < K * (n - 1 - r)),
                                    other=0.0))                                 # α_{r+1} (r < L)
            d_row, th_r = _cw_theta_row(b_gt, r, o_i)
            b_R = tl.load(dqc + row * K + o_k, mask=m_k, other=0.0) + b_an * b_R
            dgm = th_r * b_R
            dgt_r = tl.sum(dgm, axis=0)
            if READ_TOKEN:
                b_qr = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_u = -b_beta * tl.load(gm + row * BT + o_i, mask=o_i <= r, other=0.0)
                b_B = b_B * b_an[None, :] + b_u[:, None] * b_k * b_qr[None, :]
                b_YB = d_row[:, None] * b_B
                dgm += tl.sum(b_YB, axis=0)
                dgt_r += tl.sum(tl.sum(b_YB, axis=1), axis=0)
            b_dg = tl.where((o_i == r)[:, None], b_dg - dgm[None, :], b_dg)
            b_dgt = tl.where(o_i == r, b_dgt + dgt_r, b_dgt)
        tl.store(dla + t_offs, tl.cumsum(b_dg, axis=0, reverse=True), mask=m_tk)
        tl.store(dlth + rows, tl.cumsum(b_dgt, axis=0, reverse=True), mask=m_t)
        tl.store(dbeta + rows, b_db, mask=m_t)
        if READ_TOKEN:
            tl.store(dk + t_offs, tl.load(dk + t_offs, mask=m_tk, other=0.0) + b_dk, mask=m_tk)


def _channel(alpha) -> bool:
    """Whether α is channel-wise (``[B, T, H, D_k]``, one kept fraction per key channel)."""
    return alpha is not None and alpha.dim() == 4


def _before(placement: str, alpha, bias: str) -> bool:
    """Whether e carries the before_step factor P (ℓ2 with decay placed before the step)."""
    return placement == "before_step" and alpha is not None and bias == "l2"


def _forward_stages(q, k, v, beta, theta, alpha, m0, s0, *, b: int, bias: str, read: str, prec: str,
                    placement: str = "after_step", cu_seqlens=None, store_a: bool = False) -> dict:
    """Stages 1–2 on contiguous inputs → fp32 ``p, qc, th, aend, send [B, T, H]``, ``aq`` / ``a [B, T, H, BT]``
    (read token / ``store_a``), ``e [B, T, H, V]``, ``hm, hs [NC, H, V, K]`` (chunk-start M, S of every chunk of
    every sequence), ``mt, st [N, H, V, K]`` and the chunk ``layout`` (:class:`.chunk._Layout` over b-token chunks:
    B dense sequences of T tokens, or the packed sequences of ``cu_seqlens``). One launch per stage either way."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT, BK, BVV = _pow2(b), _pow2(K), _pow2(V)
    # two [BV, BK] fp32 states live in the state kernels; channel-wise, their [BT, BK] coefficient blocks (P, Q,
    # k ⊙ a_end) take the room of half of them (sm_90 shared memory at b = 64, bench/compile_sm90.py)
    BV = min(BVV, max(16, (2048 if _channel(alpha) else 4096) // BK))
    lay = _Layout(B, T, b, cu_seqlens, q)     # the chunk table counts b-token chunks
    lth = _log_gate(theta.float()).contiguous()
    la = _log_gate(alpha.float()).contiguous() if alpha is not None else None
    f32 = {"dtype": torch.float32, "device": q.device}
    channel = _channel(alpha)
    st = {name: torch.empty(B, T, H, *((K,) if channel and name in ("p", "qc", "aend") else ()), **f32)
          for name in ("p", "qc", "th", "aend", "send")}
    token = read == "token"
    st["aq"] = torch.empty(B, T, H, BT, **f32) if token else None
    st["a"] = torch.empty(B, T, H, BT, **f32) if store_a and not channel else None
    dummy = st["p"]
    if channel:
        _mom_cw_coef_kernel[(lay.NC, H)](q, k, beta, lth, la, st["p"], st["qc"], st["th"], st["aend"], st["send"],
                                         st["aq"] if token else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                         BT=BT, BK=BK, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec,
                                         num_warps=4)
    else:
        _mom_coef_kernel[(lay.NC, H)](q, k, beta, lth, la if la is not None else lth, st["p"], st["qc"], st["th"],
                                      st["aend"], st["send"], st["aq"] if token else dummy,
                                      st["a"] if store_a else dummy, lay.cu, lay.table, T, b, lay.NT, H=H, K=K,
                                      BT=BT, BK=BK, HAS_ALPHA=la is not None, READ_TOKEN=token, STORE_A=store_a,
                                      IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
    st["la"], st["lth"] = la, lth
    st["e"] = torch.empty(B, T, H, V, **f32)
    for name in ("hm", "hs"):
        st[name] = torch.empty(lay.NC, H, V, K, **f32)
    for name in ("mt", "st"):
        st[name] = torch.empty(lay.N, H, V, K, **f32)
    _mom_state_kernel[(triton.cdiv(V, BV), lay.N * H)](
        k, v, st["p"], st["qc"], st["th"], st["aend"], st["send"], m0, s0, st["e"], st["hm"], st["hs"], st["mt"],
        st["st"], lay.cu, lay.offsets, T, b, lay.NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, IS_L2=bias == "l2",
        BEFORE=_before(placement, alpha, bias), IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4,
        **({"CHANNEL": True} if channel else {}))
    st["sizes"] = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV)
    st["channel"] = {"CHANNEL": True} if channel else {}    # launched only when set: the scalar builds unchanged
    st["layout"] = lay
    return st


def _last_chunks(lay) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per sequence: the global index of its last chunk (the anchor's row of ``hm``), and (varlen) which
    sequences are empty (no chunk: the anchor is the initial memory), else None."""
    if not lay.varlen:
        idx = torch.arange(lay.N, device=lay.cu.device) * lay.NT + lay.NT - 1
        return idx, None
    off = lay.offsets.long()
    empty = off[1:] == off[:-1]
    return (off[1:] - 1).clamp_min(0), (empty if bool(empty.any()) else None)


def _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens):
    check_args(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens)
    K, V, b = q.shape[-1], v.shape[-1], int(chunk_size)
    if max(K, V) > MAX_D or b > MAX_CHUNK or q.shape[1] == 0:
        raise ValueError(f"chunk_momentum (triton): needs D_k, D_v ≤ {MAX_D}, b ≤ {MAX_CHUNK} and T ≥ 1; "
                         f"got D_k = {K}, D_v = {V}, b = {b}, T = {q.shape[1]}")
    return [x.contiguous() if x is not None else None for x in (q, k, v, beta, theta, alpha, m0, s0)]


def chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, *, chunk_size: int, bias: str = "l2",
                           read: str = "token", placement: str = "after_step", cu_seqlens=None,
                           allow_tf32: Optional[bool] = None):
    """The three forward kernels, no autograd; arguments and results as :func:`chunk_momentum`. One launch per
    stage, with or without ``cu_seqlens``."""
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read,
                                                   placement, cu_seqlens)
    T = q.shape[1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens)
    sz, lay = st["sizes"], st["layout"]
    o = torch.empty_like(v)
    token = read == "token"
    _mom_out_kernel[(triton.cdiv(sz["V"], sz["BV"]), lay.NC, sz["H"])](
        q, st["p"], st["qc"], st["aq"] if token else st["p"], st["e"], st["hm"], st["hs"], o, lay.cu, lay.table, T,
        b, lay.NT, **sz, READ_TOKEN=token, IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    idx, empty = _last_chunks(lay)
    anchor = st["hm"][idx]
    if empty is not None:
        anchor = torch.where(empty[:, None, None, None], m0.float(), anchor)
    out_dtype = m0.dtype
    return o, st["mt"].to(out_dtype), st["st"].to(out_dtype), anchor.to(out_dtype)


def _chunk_rows(B: int, T: int, b: int, cu_seqlens, device):
    """Every b-token chunk's token rows in the flattened ``[B·T]`` order: ``rows [NC, b]`` (clamped in range),
    ``valid [NC, b]`` and ``count [NC]`` (real tokens per chunk), chunks in the kernels' order (B dense sequences
    of T tokens, or the packed sequences of ``cu_seqlens``, each chunked from its first token)."""
    cu = (torch.arange(B + 1, device=device) * T if cu_seqlens is None
          else cu_seqlens.to(device=device, dtype=torch.long))
    table, _ = prepare_chunk_indices(cu, b)
    seq, within = table[:, 0].long(), table[:, 1].long()
    start = cu[seq] + within * b
    count = torch.clamp(cu[seq + 1] - start, max=b)
    j = torch.arange(b, device=device)
    valid = j[None, :] < count[:, None]
    rows = (start[:, None] + j[None, :]).clamp(max=B * T - 1)
    return rows, valid, count


def chunk_coefficients(beta: torch.Tensor, theta: torch.Tensor, alpha: Optional[torch.Tensor], chunk_size: int,
                       cu_seqlens: Optional[torch.Tensor] = None):
    """Stage 1 in torch, all chunks at once (differentiable; the backward maps the coefficients' gradients to
    β, θ, α through it): per token ``P, Q, Θ, a_end, s_end: [B, T, H]`` and ``A: [B, T, H, b]`` (row s of its
    chunk's A; a_end / s_end are indexed by the column i, as in the kernels). With ``cu_seqlens`` (B = 1) the
    chunks restart at every sequence start."""
    B, T, H = beta.shape
    b = int(chunk_size)
    rows, valid, count = _chunk_rows(B, T, b, cu_seqlens, beta.device)
    NC = rows.shape[0]

    def chunks(x):      # [B, T, H] → [H, NC, b], padded with 0 (β = 0; log-gate 0 = factor 1)
        x = x.reshape(B * T, H)[rows]                 # [NC, b, H]
        return torch.where(valid.unsqueeze(-1), x, torch.zeros_like(x)).permute(2, 0, 1)

    def tokens(x):      # [H, NC, b, ...] → [B, T, H, ...]
        x = x.movedim(0, 2)                           # [NC, b, H, ...]
        return x[valid].reshape(B, T, H, *x.shape[3:])

    lb = chunks(beta)
    gt = chunks(_log_gate(theta)).cumsum(-1)
    ga = chunks(_log_gate(alpha)).cumsum(-1) if alpha is not None else torch.zeros_like(gt)
    upper = torch.ones(b, b, dtype=torch.bool, device=beta.device).triu(1)
    D_a = (ga.unsqueeze(-1) - ga.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    D_t = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    P, Th = ga.exp(), gt.exp()
    Q = (D_a @ Th.unsqueeze(-1)).squeeze(-1)
    A = -(D_a @ (D_t * lb.unsqueeze(-2)))
    n = torch.arange(NC, device=beta.device)
    last = count - 1
    a_end = A[:, n, last]                                                       # [H, NC, b]
    s_end = -D_t[:, n, last] * lb
    return tokens(P), tokens(Q), tokens(Th), tokens(a_end), tokens(s_end), tokens(A)


def chunk_momentum_backward(q, k, v, beta, theta, alpha, m0, s0, do, dmt, dst, dma, *, chunk_size: int,
                            bias: str = "l2", read: str = "token", placement: str = "after_step", cu_seqlens=None,
                            allow_tf32: Optional[bool] = None):
    """Gradients of :func:`chunk_momentum_forward` → ``(dq, dk, dv, dβ, dθ, dα, dM_0, dS_0)`` (dα None without α;
    dM_0, dS_0 ``[N, H, D_v, D_k]``).

    Stages 1–2 are re-run (coefficients, e, chunk-start states), ``_mom_bwd_state_kernel`` sweeps the chunks in
    reverse for the chunk-end state gradients and dE, ``_mom_bwd_grad_kernel`` forms dq, dk, dv and the
    coefficients' gradients per chunk in parallel, and autograd through :func:`chunk_coefficients` (torch, no
    memory-sized tensor) maps those to dβ, dθ, dα. With ``cu_seqlens`` every stage is still one launch.
    """
    q, k, v, beta, theta, alpha, m0, s0 = _prepare(q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read,
                                                   placement, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    b = int(chunk_size)
    prec = dot_precision(q.dtype, allow_tf32)
    token = read == "token"
    do = do.contiguous()
    st = _forward_stages(q, k, v, beta, theta, alpha, m0, s0, b=b, bias=bias, read=read, prec=prec,
                         placement=placement, cu_seqlens=cu_seqlens, store_a=token)
    sz, lay = st["sizes"], st["layout"]
    f32 = {"dtype": torch.float32, "device": q.device}
    dhm, dhs = (torch.empty(lay.NC, H, V, K, **f32) for _ in range(2))
    de = torch.empty(B, T, H, V, **f32)
    dm0, ds0 = (torch.empty(lay.N, H, V, K, **f32) for _ in range(2))
    dummy = st["p"]
    channel = _channel(alpha)
    meta = dict(sz, IS_L2=bias == "l2", BEFORE=_before(placement, alpha, bias), READ_TOKEN=token,
                IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4, **st["channel"])
    _mom_bwd_state_kernel[(triton.cdiv(V, sz["BV"]), lay.N * H)](
        q, k, do, st["aq"] if token else dummy, st["p"], st["qc"], st["th"], st["aend"], st["send"],
        *(x.contiguous() if x is not None else dummy for x in (dmt, dst, dma)), de, dhm, dhs, dm0, ds0, lay.cu,
        lay.offsets, T, b, lay.NT, HAS_DMT=dmt is not None, HAS_DST=dst is not None, HAS_DMA=dma is not None,
        **meta)
    if dma is not None:             # an empty sequence's anchor is its initial memory
        _, empty = _last_chunks(lay)
        if empty is not None:
            dm0 = dm0 + torch.where(empty[:, None, None, None], dma.float(), torch.zeros_like(dm0))
    dq = torch.empty(B, T, H, K, **f32)
    dk = torch.empty(B, T, H, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    kc = (K,) if channel else ()
    dp, dqc, dae = (torch.empty(B, T, H, *kc, **f32) for _ in range(3))
    dth, dse = (torch.empty(B, T, H, **f32) for _ in range(2))
    da = torch.empty(B, T, H, sz["BT"], **f32) if token else None       # dA (scalar decay) or G (channel-wise)
    _mom_bwd_grad_kernel[(lay.NC, H)](
        q, k, do, st["a"] if token and not channel else dummy, st["p"], st["qc"], st["aend"], st["send"], st["e"],
        de, st["hm"], st["hs"], dhm, dhs, dq, dk, dv, dp, dqc, dth, dae, dse, da if token else dummy, lay.cu,
        lay.table, T, b, lay.NT, **meta)
    if channel:
        dbeta, dlth = (torch.empty(B, T, H, **f32) for _ in range(2))
        dla = torch.empty(B, T, H, K, **f32)
        _mom_cw_gate_kernel[(lay.NC, H)](
            q, k, beta, st["lth"], st["la"], st["qc"], da if token else dummy, dp, dqc, dth, dae, dse, dq, dk, dbeta,
            dla, dlth, lay.cu, lay.table, T, b, lay.NT, H=H, K=K, BT=sz["BT"], BK=sz["BK"], READ_TOKEN=token,
            IS_VARLEN=lay.varlen, PRECISION=prec, num_warps=4)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype),
                _from_log_grad(dlth, theta), _from_log_grad(dla, alpha), dm0.to(m0.dtype), ds0.to(s0.dtype))
    with torch.enable_grad():
        gates = [x.detach().float().requires_grad_(True) if x is not None else None for x in (beta, theta, alpha)]
        coef = chunk_coefficients(*gates, b, cu_seqlens=cu_seqlens)
        grads_out = [dp, dqc, dth, dae, dse] + ([da[..., :b]] if token else [])
        pairs = [(c, g) for c, g in zip(coef, grads_out) if c.requires_grad]   # P is constant without α
        leaves = [g for g in gates if g is not None]
        dgates = torch.autograd.grad([c for c, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    dgates = [torch.zeros_like(g) if d is None else d for g, d in zip(leaves, dgates)]
    dbeta, dtheta = dgates[0].to(beta.dtype), dgates[1].to(theta.dtype)
    dalpha = dgates[2].to(alpha.dtype) if alpha is not None else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta, dtheta, dalpha, dm0.to(m0.dtype),
            ds0.to(s0.dtype))


def _from_log_grad(dlog: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """∂L/∂x from ∂L/∂ log x, with log x = log max(x, tiny) as :func:`_log_gate` (no gradient below tiny)."""
    xf = x.float()
    tiny = torch.finfo(xf.dtype).tiny
    return torch.where(xf >= tiny, dlog / xf.clamp_min(tiny), torch.zeros_like(dlog)).to(x.dtype)


#: Which backward :class:`ChunkMomentumFunction` uses: ``"triton"`` (the backward kernels + autograd through
#: :func:`chunk_coefficients`) or ``"torch"`` (autograd through :func:`momentum_chunk_reference`, recomputed).
#: ``ATLASLAB_MOMENTUM_BACKWARD`` sets the default.
BACKWARD = os.environ.get("ATLASLAB_MOMENTUM_BACKWARD", "triton").strip().lower()


class ChunkMomentumFunction(torch.autograd.Function):
    """Triton forward (:func:`chunk_momentum_forward`); backward on the backward kernels
    (:func:`chunk_momentum_backward`), or, with ``BACKWARD == "torch"``, autograd of
    :func:`momentum_chunk_reference` recomputed (≥ fp32) under ``enable_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, beta, theta, alpha, m0, s0, chunk_size, bias, read, placement, cu_seqlens,
                allow_tf32):
        ctx.save_for_backward(q, k, v, beta, theta, alpha, m0, s0)
        ctx.opts = {"chunk_size": chunk_size, "bias": bias, "read": read, "placement": placement,
                    "cu_seqlens": cu_seqlens}
        ctx.allow_tf32 = allow_tf32
        return chunk_momentum_forward(q, k, v, beta, theta, alpha, m0, s0, allow_tf32=allow_tf32, **ctx.opts)

    @staticmethod
    def backward(ctx, do, dmt, dst, dma):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:8]
        if not any(need):
            return (None,) * 14
        def torch_path():
            return _torch_backward(saved, need, (do, dmt, dst, dma), ctx.opts)

        def kernels():
            grads = chunk_momentum_backward(*saved, do, dmt, dst, dma, allow_tf32=ctx.allow_tf32, **ctx.opts)
            return [g if n else None for g, n in zip(grads, need)]
        grads = (torch_path() if BACKWARD == "torch"
                 else with_torch_fallback(kernels, torch_path, "momentum chunk backward"))
        return (*grads, None, None, None, None, None, None)


def _torch_backward(saved, need, grads_out, opts):
    """The reference backward: autograd of :func:`momentum_chunk_reference`, recomputed (≥ fp32)."""
    grads = [None] * 8
    with torch.enable_grad():
        inputs = [_upcast(x).detach().requires_grad_(n) if x is not None else None for x, n in zip(saved, need)]
        outs = momentum_chunk_reference(*inputs, **opts)
        leaves = [i for i, (x, n) in enumerate(zip(inputs, need)) if x is not None and n]
        pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in leaves],
                                  [g.to(o.dtype) for o, g in pairs], allow_unused=True)
    for i, g in zip(leaves, got):
        grads[i] = (torch.zeros_like(saved[i]) if g is None else g).to(saved[i].dtype)
    return grads


def chunk_momentum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, theta: torch.Tensor,
                   alpha: Optional[torch.Tensor], initial_state: torch.Tensor, initial_momentum: torch.Tensor, *,
                   chunk_size: int, bias: str = "l2", read: str = "token", placement: str = "after_step",
                   cu_seqlens: Optional[torch.Tensor] = None, allow_tf32: Optional[bool] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear memory + momentum GD at semantic chunk size b (module docstring), Triton forward and backward.

    Args:
        q, k: ``[B, T, H, D_k]`` (feature map already applied); v: ``[B, T, H, D_v]`` (D_k, D_v ≤ 256).
        beta: ``[B, T, H]`` step β_t = η_t γ_t.
        theta: ``[B, T, H]`` momentum gate θ_t.
        alpha: ``[B, T, H]`` per-head kept fraction α_t, ``[B, T, H, D_k]`` channel-wise (per key channel,
            M ← M Diag(α_t) + S; before_step takes the gradient at M_a Diag(P_s)), or None.
        initial_state, initial_momentum: M and S before the first token, ``[N, H, D_v, D_k]`` (N = B, or the
            number of packed sequences); every sequence starts at a chunk boundary.
        chunk_size: the semantic chunk b (2 ≤ b ≤ 64 on the kernels; it changes the result).
        bias: ``l2`` or ``dot``; read: ``token`` or ``chunk``.
        placement: ``after_step`` (gradients at M_a) or ``before_step`` (at P_s M_a; the same for ``dot``).
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed as B = 1, or None. Run natively (one launch per
            stage over all chunks of all sequences); each sequence is its own call (states and semantic chunks
            restart at its first token; an empty sequence returns its initial states).
        allow_tf32: True / False: fp32 dots in TF32 / IEEE; None: :func:`.precision.dot_precision` chooses.

    Returns:
        ``o: [B, T, H, D_v]``, the final memory M_T and momentum S_T, and the memory at the start of the last chunk
        (the ``MemoryState`` anchor), each ``[N, H, D_v, D_k]``.
    """
    return ChunkMomentumFunction.apply(q, k, v, beta, theta, alpha, initial_state, initial_momentum,
                                       int(chunk_size), bias, read, placement, cu_seqlens, allow_tf32)


# ------------------------------------------------------------------------------------------ dispatch + engine

def linear_momentum_reason(parts, channel_wise_ok: bool = False) -> Optional[str]:
    """None when ``parts`` is a spec the momentum kernels (this chunk kernel and the token-by-token one in
    ``fused_recurrent_momentum.py``) compute exactly, semantic chunk aside, else the first reason they do not:
    linear memory, ℓ2 or dot bias, momentum GD, no retention, per-head scalar decay or (``channel_wise_ok``, which
    both kernels now pass) channel-wise decay, either placement, Omega window c = 1, read token or chunk,
    head dims ≤ MAX_D."""
    s, ret = parts.spec, parts.retention
    bias = s.attentional_bias.name
    checks = [
        (s.memory.name == "linear", f"memory '{s.memory.name}' (momentum kernels: linear)"),
        (not parts.kernel_trick, "the exp kernel trick"),
        (bias in BIASES, f"attentional bias '{bias}' (momentum kernels: l2, dot)"),
        (s.inner_optimizer.name == "momentum", f"inner optimizer '{s.inner_optimizer.name}' (momentum)"),
        (s.retention.name in ("none", "decay"), f"retention '{s.retention.name}' (none, decay)"),
        (channel_wise_ok or not getattr(ret, "channel_wise", False),
         "channel-wise decay (momentum chunk kernel: per-head scalar)"),
        (parts.window.size == 1, f"window size {parts.window.size} (c = 1)"),
        (parts.read in READS, f"read '{parts.read}'"),
        (max(parts.feature_map.out_dim, parts.value_dim) <= MAX_D, f"head dims > {MAX_D}"),
    ]
    return next((why for ok, why in checks if not ok), None)


def spec_reason(parts, chunk_size: int) -> Optional[str]:
    """None when the momentum chunk kernel computes ``parts`` at semantic chunk ``chunk_size`` exactly, else why not:
    :func:`linear_momentum_reason` with channel-wise decay allowed, and 2 ≤ b ≤ MAX_CHUNK (before_step with the ℓ2
    bias takes the gradients at P_s M_a, channel-wise at M_a Diag(P_s)); channel-wise decay only at b ≤
    MAX_CHANNEL_CHUNK (sm_90 shared memory; the token kernel takes larger b)."""
    if not 2 <= chunk_size <= MAX_CHUNK:
        return f"chunk_size b = {chunk_size} (momentum chunk kernel: 2 ≤ b ≤ {MAX_CHUNK})"
    why = linear_momentum_reason(parts, channel_wise_ok=True)
    if why is None and getattr(parts.retention, "channel_wise", False) and chunk_size > MAX_CHANNEL_CHUNK:
        why = (f"chunk_size b = {chunk_size} with channel-wise decay (momentum chunk kernel: b ≤ {MAX_CHANNEL_CHUNK}, "
               f"sm_90 shared memory)")
    return why


def memorize_chunk_momentum(q, k, v, parts, gates, chunk_size, state, block_size: int = 64, **engine_options):
    """``MODES``-signature engine: ``q, k: [B, T, H, D_k]``, ``v: [B, T, H, D_v]`` → ``([B, T, H, D_v], state)``.

    Updates weights, momentum, anchor, ``chunk_alpha`` (Π α over the last chunk), ``chunk_lr``, the (empty, c = 1)
    window history and ``position`` exactly as the torch engines. A call that starts mid-chunk runs its first
    piece (up to the next chunk boundary) on the torch ``chunked`` engine (``engine_options`` go there), then the
    kernels. ``block_size`` is unused (the kernels' block is the semantic chunk b).
    """
    from atlaslab.engines.chunked import memorize_chunked
    from atlaslab.memory.state import keep_history, with_history
    from atlaslab.memory.state import split_time

    b, T = int(chunk_size), q.shape[1]
    if T == 0:
        return memorize_chunked(q, k, v, parts, gates, b, state, block_size=block_size, **engine_options)
    outputs = []
    if state.position % b:
        n0 = min(T, b - state.position % b)
        (q0, k0, v0, g0), (q, k, v, gates) = split_time([n0, T - n0], q, k, v, gates)
        y, state = memorize_chunked(q0, k0, v0, parts, g0, b, state, block_size=block_size, **engine_options)
        outputs.append(y)
        if q.shape[1] == 0:
            return y, state
    state = dataclasses.replace(state)
    T = q.shape[1]
    fm, ret = parts.feature_map, parts.retention
    alpha = gates.retention if (ret.uses_alpha and gates.retention is not None) else None
    beta = gates.lr * gates.window                    # c = 1: the window gate scales the step
    o, M, S, anchor = chunk_momentum(fm(q), fm(k), v, beta, gates.momentum, alpha, state.weights["W"],
                                     state.momentum["W"], chunk_size=b, bias=parts.spec.attentional_bias.name,
                                     read=parts.read, placement=ret.placement)
    state.weights, state.momentum, state.anchor = {"W": M}, {"W": S}, {"W": anchor}
    last = T - (-(-T // b) - 1) * b                  # real tokens of the last chunk
    if alpha is not None:
        state.chunk_alpha = alpha[:, T - last:].prod(1)
    else:
        state.chunk_alpha = torch.ones_like(state.chunk_alpha)
    state.chunk_lr = torch.zeros_like(state.chunk_lr)
    keep_history(state, parts.window.history(), *with_history(state, k, v, gates))
    state.position += T
    outputs.append(o)
    return torch.cat(outputs, 1), state


memorize_chunk_momentum.kernel = "chunk_momentum"

__all__ = ["ChunkMomentumFunction", "chunk_momentum", "chunk_momentum_forward", "memorize_chunk_momentum",
           "momentum_chunk_reference", "spec_reason"]
