"""Plain-torch reference of one chunk's step of the 2-layer MLP memory (the deep-memory dual form): the gradient
factors δ1, δ2, a at the chunk-start anchor and the chunk-end weights and momenta, in closed form so that autograd
through it gives the outer loss the second derivatives it needs. Equations: docs/kernels.md#mlp.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from atlaslab.kernels.utils import KERNEL_BIASES

#: activation name → the kernels' constexpr code
ACTIVATIONS = {"gelu": 0, "silu": 1, "relu": 2}
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

Outputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                Optional[torch.Tensor], Optional[torch.Tensor]]


def check_args(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, activation, residual: bool = True,
               bias: str = "l2") -> None:
    """Validate shapes, and that the step computes this activation and bias (three of the memory's σ, two of its
    biases: :data:`ACTIVATIONS`, :data:`~atlaslab.kernels.utils.KERNEL_BIASES`); see :func:`.chunk.mlp_chunk_step`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got '{activation}'")
    if bias not in KERNEL_BIASES:
        raise ValueError(f"bias must be one of {KERNEL_BIASES}, got '{bias}'")
    if x.dim() != 4 or v.dim() != 4 or v.shape[:3] != x.shape[:3]:
        raise ValueError(f"expected x: [B, H, W, D_in], v: [B, H, W, D_out]; got x {list(x.shape)}, "
                         f"v {list(v.shape)}")
    B, H, W, D = x.shape
    DO = v.shape[3]
    if residual and DO != D:
        raise ValueError(f"a residual memory needs D_in == D_out, got x {list(x.shape)}, v {list(v.shape)}")
    if W1.dim() != 4 or tuple(W1.shape[:2]) != (B, H) or W1.shape[3] != D:
        raise ValueError(f"W1: expected [B, H, hidden, D_in] = [{B}, {H}, hidden, {D}], got {list(W1.shape)}")
    hid = W1.shape[2]
    if tuple(W2.shape) != (B, H, DO, hid):
        raise ValueError(f"W2: expected [B, H, D_out, hidden] = {[B, H, DO, hid]}, got {list(W2.shape)}")
    mom = S_e is not None
    if any((z is not None) != mom for z in (S1, S2, Q_e, Th_e)):
        raise ValueError("momentum: give all of S1, S2, Q_e, Th_e, S_e (momentum GD) or none of them (GD)")
    for name, z, want in (("S1", S1, W1.shape), ("S2", S2, W2.shape), ("P_e", P_e, (B, H)), ("Q_e", Q_e, (B, H)),
                          ("Th_e", Th_e, (B, H)), ("A_e", A_e, (B, H, W)), ("S_e", S_e, (B, H, W))):
        if z is not None and tuple(z.shape) != tuple(want):
            raise ValueError(f"{name}: expected {list(want)}, got {list(z.shape)}")


def activation_and_derivative(z: torch.Tensor, activation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """σ(z) and σ'(z) in closed form (so autograd through σ' gives the second derivative the outer loss needs)."""
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _SQRT1_2))
        return z * cdf, cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    if activation == "silu":
        s = torch.sigmoid(z)
        return z * s, s * (1.0 + z * (1.0 - s))
    if activation == "relu":
        return torch.relu(z), (z > 0).to(z.dtype)
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got '{activation}'")


def mlp_chunk_reference(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, *, activation: str = "gelu",
                        residual: bool = True, bias: str = "l2") -> Outputs:
    """The step's equations (docs/kernels.md#mlp) in plain torch (differentiable). Arguments and results as
    :func:`.chunk.mlp_chunk_step`."""
    check_args(x, v, W1, W2, S1, S2, P_e, Q_e, A_e, Th_e, S_e, activation, residual, bias)
    z = x @ W1.mT                                        # z_i = W1 x_i                      [B, H, W, hidden]
    a, da = activation_and_derivative(z, activation)     # a_i = σ(z_i), σ'(z_i)
    if bias == "dot":
        e = -v                                           # e_i = −v_i (ℓ = −⟨M(x), v⟩)       [B, H, W, D_out]
    else:
        pred = a @ W2.mT                                 # W2 a_i
        e = (x + pred if residual else pred) - v         # e_i = [x_i +] W2 a_i − v_i = δ2_i [B, H, W, D_out]
    d1 = (e @ W2) * da                                   # δ1_i = (W2ᵀ e_i) ⊙ σ'(z_i)        [B, H, W, hidden]

    def rank1_sum(row, delta, h):                        # Σ_i row[i] δ_i h_iᵀ
        return (delta * row.unsqueeze(-1)).mT @ h

    def c(s):                                            # [B, H] → [B, H, 1, 1]
        return s[..., None, None]

    W1_e = c(P_e) * W1 + rank1_sum(A_e, d1, x)
    W2_e = c(P_e) * W2 + rank1_sum(A_e, e, a)
    S1_e = S2_e = None
    if S_e is not None:
        W1_e = W1_e + c(Q_e) * S1
        W2_e = W2_e + c(Q_e) * S2
        S1_e = c(Th_e) * S1 + rank1_sum(S_e, d1, x)
        S2_e = c(Th_e) * S2 + rank1_sum(S_e, e, a)
    return d1, e, a, W1_e, W2_e, S1_e, S2_e


