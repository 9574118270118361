"""The reductions of docs/concepts/memory.md#reductions, in float64: each named model is a combination of parts, computed exactly.

Every expected value here is computed independently of the engine (closed forms or hand-written
recurrences of the papers' equations), so a mistake in the engine's composition shows up.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_gates, random_qkv, rms_ratio

from atlaslab import memorize
from atlaslab.memory import build_memory
from atlaslab.memory.feature_maps import polynomial_dim
from atlaslab.kernels.newton_schulz import newton_schulz

B, T, H, D = 2, 9, 2, 4
TOL = 1e-10


def parts(spec, key_dim=D, value_dim=D):
    return build_memory(spec, H, key_dim, value_dim).double()


ZERO_LINEAR = {"name": "linear", "init": "zeros"}


def test_dot_linear_identity_gd_is_causal_linear_attention():
    q, k, v = random_qkv(B, T, H, D)
    eta = random_gates(B, T, H, names=("lr",))["lr"]
    o, state = memorize(q, k, v, parts({"memory": ZERO_LINEAR, "attentional_bias": "dot"}), {"lr": eta})
    scores = torch.einsum("bthd,bshd->bhts", q, k) * torch.tril(torch.ones(T, T, dtype=q.dtype))
    expected = torch.einsum("bhts,bsh,bshv->bthv", scores, eta, v)
    assert rms_ratio(o, expected) < TOL
    assert state.weights["W"].shape == (B, H, D, D)                         # [B, H, D_v, D_k]
    assert rms_ratio(state.weights["W"], torch.einsum("bsh,bshv,bshk->bhvk", eta, v, k)) < TOL


def delta_rule(k, v, q, beta, alpha=None):
    """DeltaNet / Gated DeltaNet: S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ; o_t = S_t q_t."""
    S = torch.zeros(B, H, v.shape[-1], k.shape[-1], dtype=k.dtype)
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    outs = []
    for t in range(k.shape[1]):
        kt, vt, b = k[:, t], v[:, t], beta[:, t, :, None, None]
        a = alpha[:, t, :, None, None] if alpha is not None else 1.0
        S = a * S @ (eye - b * torch.einsum("bhi,bhj->bhij", kt, kt)) + b * torch.einsum("bhi,bhj->bhij", vt, kt)
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


def test_l2_linear_gd_is_deltanet():
    q, k, v = random_qkv(B, T, H, D)
    beta = random_gates(B, T, H, names=("lr",))["lr"]
    o, state = memorize(q, k, v, parts({"memory": ZERO_LINEAR}), {"lr": beta})
    expected, S = delta_rule(k, v, q, beta)
    assert rms_ratio(o, expected) < TOL and rms_ratio(state.weights["W"], S) < TOL


def test_decay_before_step_is_gated_deltanet():
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr", "retention"))
    spec = {"memory": ZERO_LINEAR, "retention": {"name": "decay", "placement": "before_step"}}
    o, _ = memorize(q, k, v, parts(spec), g)
    expected, _ = delta_rule(k, v, q, g["lr"], g["retention"])
    assert rms_ratio(o, expected) < TOL
    # after_step differs (the gradient is taken at the undecayed state), so the placement matters
    o_after, _ = memorize(q, k, v, parts({**spec, "retention": "decay"}), g)
    assert rms_ratio(o_after, expected) > 1e-3


def test_channel_wise_decay_with_dot_bias_is_gla():
    q, k, v = random_qkv(B, T, H, D)
    alpha = random_gates(B, T, H, names=("retention",), Dk=D)["retention"]
    spec = {"memory": ZERO_LINEAR, "attentional_bias": "dot", "retention": {"name": "decay", "channel_wise": True}}
    o, _ = memorize(q, k, v, parts(spec), {"retention": alpha})
    S = torch.zeros(B, H, D, D, dtype=q.dtype)
    outs = []
    for t in range(T):   # GLA: S_t = S_{t−1} Diag(α_t) + v_t k_tᵀ  (ATLAS Tab.1)
        S = S * alpha[:, t, :, None, :] + torch.einsum("bhv,bhk->bhvk", v[:, t], k[:, t])
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


def test_exp_kernel_trick_is_unnormalised_softmax_attention_and_normalised_is_sdpa():
    q, k, v = random_qkv(B, T, H, D)
    spec = {"memory": ZERO_LINEAR, "attentional_bias": "dot", "feature_map": "exp"}
    o, _ = memorize(q, k, v, parts(spec))
    scores = torch.einsum("bthd,bshd->bhts", q, k).exp() * torch.tril(torch.ones(T, T, dtype=q.dtype))
    assert rms_ratio(o, torch.einsum("bhts,bshv->bthv", scores, v)) < TOL

    spec["feature_map"] = {"name": "exp", "normalize": True}
    qs = q * 3.0   # unnormalised queries: SDPA scales by 1/√d, so feed q/√d to the memory
    o, _ = memorize(qs / math.sqrt(D), k, v, parts(spec))
    ref = F.scaled_dot_product_attention(qs.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert rms_ratio(o, ref.transpose(1, 2)) < TOL


def test_exp_taylor_on_deep_memory_is_the_truncated_polynomial():
    q, k, v = random_qkv(B, 4, H, D)
    mem = {"name": "mlp", "residual": False}
    opt = {"name": "gd", "lr": 0.1}
    a = parts({"memory": mem, "feature_map": {"name": "exp", "degree": 2}, "inner_optimizer": opt}, D, D)
    b = parts({"memory": mem, "feature_map": {"name": "polynomial", "degree": 2, "learnable": False},
               "inner_optimizer": opt}, D, D)
    b.load_state_dict(a.state_dict(), strict=False)
    assert a.feature_map.out_dim == polynomial_dim(D, 2)
    assert rms_ratio(memorize(q, k, v, a)[0], memorize(q, k, v, b)[0]) < TOL


def mlp_apply(W, x):
    """The residual MLP memory x + W2 gelu(W1 x), written independently of the engine."""
    return x + torch.einsum("bhoi,bhi->bho", W["W2"], F.gelu(torch.einsum("bhoi,bhi->bho", W["W1"], x)))


def titans_reference(parts_, q, k, v, g):
    """Titans LMM (Eq.13-14): S_t = θ_t S_{t−1} − η_t ∇ℓ(M_{t−1}; k_t, v_t); M_t = α_t M_{t−1} + S_t."""
    W = {n: w.clone() for n, w in parts_.memory.initial_weights(B).items()}
    S = {n: torch.zeros_like(w) for n, w in W.items()}
    outs = []
    for t in range(T):
        Wg = {n: w.detach().requires_grad_(True) for n, w in W.items()}
        loss = 0.5 * ((mlp_apply(Wg, k[:, t]) - v[:, t]) ** 2).sum()
        grads = dict(zip(Wg, torch.autograd.grad(loss, list(Wg.values()))))
        bc = lambda x: x[:, t, :, None, None]  # noqa: E731
        S = {n: bc(g["momentum"]) * S[n] - bc(g["lr"]) * grads[n] for n in W}
        W = {n: bc(g["retention"]) * W[n] + S[n] for n in W}
        outs.append(mlp_apply(W, q[:, t]))
    return torch.stack(outs, 1)


def test_titans_is_omega_c1_with_momentum():
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr", "retention", "momentum"))
    p = parts({"memory": "mlp", "retention": "decay", "inner_optimizer": "momentum", "window": {"size": 1}})
    o, _ = memorize(q, k, v, p, g)
    assert rms_ratio(o, titans_reference(p, q, k, v, g)) < TOL


def test_atlas_with_identity_newton_schulz_is_omeganet_with_momentum():
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("retention", "momentum", "window"))
    base = {"memory": {"name": "mlp", "residual": False}, "feature_map": "polynomial", "retention": "decay",
            "window": {"name": "omega", "size": 3}, "chunk_size": 2}
    atlas = parts({**base, "inner_optimizer": {"name": "muon", "lr": 0.3}}, D, D)
    atlas.inner_optimizer.orthogonalise = lambda s: s       # "NS replaced by the identity"
    omeganet_m = parts({**base, "inner_optimizer": {"name": "momentum", "lr": 0.3}}, D, D)
    omeganet_m.load_state_dict(atlas.state_dict())
    # with a constant η: S^muon = θS + g, U = −ηS  ⇔  S^mom = θS − ηg = −η S^muon
    a, _ = memorize(q, k, v, atlas, g)
    b, _ = memorize(q, k, v, omeganet_m, g)
    assert rms_ratio(a, b) < TOL
    real, _ = memorize(q, k, v, parts({**base, "inner_optimizer": {"name": "muon", "lr": 0.3}}, D, D), g)
    assert torch.isfinite(real).all()


def test_omega_window_matches_closed_form_for_linear_memory():
    """OmegaNet linear closed form with chunks (ATLAS Eq.11/16, window spill as in docs/concepts/memory.md#window-spill):
    M_t = α_t M_{t−1} − η_t Σ_{i=t−c+1}^{t} γ_i (M_{t'} k_i − v_i) k_iᵀ."""
    c, b = 3, 4
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr", "retention", "window"))
    p = parts({"memory": "linear", "retention": "decay", "window": {"size": c}, "chunk_size": b})
    torch.nn.init.normal_(p.memory.init_W)
    o, _ = memorize(q, k, v, p, g)
    M = p.memory.initial_weights(B)["W"].clone()
    outs = []
    for t in range(T):
        if t % b == 0:
            anchor = M
        grad = sum(g["window"][:, i, :, None, None] * torch.einsum(
            "bhv,bhk->bhvk", torch.einsum("bhvk,bhk->bhv", anchor, k[:, i]) - v[:, i], k[:, i])
            for i in range(max(0, t - c + 1), t + 1))
        M = g["retention"][:, t, :, None, None] * M - g["lr"][:, t, :, None, None] * grad
        outs.append(torch.einsum("bhvk,bhk->bhv", M, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


def test_global_window_solves_the_running_least_squares_with_many_steps():
    # with c = ∞ and implicit GD at a large step, the memory approaches the least-squares fit of all pairs
    q, k, v = random_qkv(1, 12, 1, 4, normalise=False)
    p = build_memory({"memory": ZERO_LINEAR, "inner_optimizer": {"name": "implicit_gd", "lr": 1e6},
                      "window": "global"}, 1, 4, 4).double()
    _, state = memorize(q, k, v, p)
    K, V = k[0, :, 0], v[0, :, 0]
    lstsq = torch.linalg.lstsq(K, V).solution.T
    assert rms_ratio(state.weights["W"][0, 0], lstsq) < 1e-4


def test_implicit_gd_is_longhorn():
    q, k, v = random_qkv(B, T, H, D, normalise=False)
    beta = random_gates(B, T, H, names=("lr",))["lr"]
    o, _ = memorize(q, k, v, parts({"memory": ZERO_LINEAR, "inner_optimizer": "implicit_gd"}), {"lr": beta})
    eps = beta / (1 + beta * (k * k).sum(-1))   # Longhorn: ε = β / (1 + β kᵀk), then the delta rule
    expected, _ = delta_rule(k, v, q, eps)
    assert rms_ratio(o, expected) < TOL


def test_multi_step_gd_takes_successive_steps():
    q, k, v = random_qkv(B, T, H, D)
    p = parts({"memory": ZERO_LINEAR, "inner_optimizer": {"name": "multi_step_gd", "steps": 3, "lr": 0.4}})
    o, _ = memorize(q, k, v, p)
    eye = torch.eye(D, dtype=q.dtype)
    S = torch.zeros(B, H, D, D, dtype=q.dtype)
    outs = []
    for t in range(T):   # three delta-rule steps on the same token (DeltaProduct-style)
        kk = torch.einsum("bhi,bhj->bhij", k[:, t], k[:, t])
        for _ in range(3):
            S = S @ (eye - 0.4 * kk) + 0.4 * torch.einsum("bhi,bhj->bhij", v[:, t], k[:, t])
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


def test_polynomial_kernel_identity():
    fm = build_memory({"memory": {"name": "mlp", "residual": False}, "feature_map": {"name": "polynomial",
                                                                                     "degree": 3}}, 1, 5, 5)
    fm = fm.feature_map.double()
    with torch.no_grad():
        fm.rho.copy_(torch.tensor([0.3, -1.0, 0.5, 2.0], dtype=torch.float64))
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    a = fm.coefficients()
    expected = sum(a[i] * (x * y).sum(-1) ** i for i in range(4))
    assert fm(x).shape[-1] == polynomial_dim(5, 3) == math.comb(8, 3)
    assert rms_ratio((fm(x) * fm(y)).sum(-1), expected) < TOL
    # default coefficients are the Taylor coefficients of exp: 1/i!
    fresh = build_memory({"memory": {"name": "mlp", "residual": False}, "feature_map": "polynomial"}, 1, 5, 5)
    assert torch.allclose(fresh.feature_map.coefficients(), torch.tensor([1.0, 1.0, 0.5]))


def test_newton_schulz_is_near_orthogonal_for_well_conditioned_input():
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(8, 6, 6, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(8, 6, 6, generator=g, dtype=torch.float64))
    s = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    X = newton_schulz(U @ torch.diag_embed(s.expand(8, 6)) @ V.mT, steps=5)
    sv = torch.linalg.svdvals(X)
    assert sv.min() > 0.6 and sv.max() < 1.25           # Muon's quintic lands in ≈ [0.7, 1.2]
    core = U.mT @ X @ V                                  # NS is an odd polynomial of S: same singular vectors
    off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-10
    assert rms_ratio(X, U @ V.mT) < 0.25                 # and near the polar factor U Vᵀ
    wide = newton_schulz(torch.randn(3, 4, 9, generator=g, dtype=torch.float64) + 0.0, steps=8)
    assert wide.shape == (3, 4, 9)
    assert (torch.linalg.svdvals(wide) > 0.5).all()
    tall = newton_schulz(torch.randn(2, 9, 4, generator=g, dtype=torch.float64), steps=8)
    assert (torch.linalg.svdvals(tall) > 0.5).all()


def test_moneta_lq_retention_b1_is_the_exact_rule():
    """Moneta (Miras Eq.24-25) with linear memory: A_t = α_t A_{t−1} − η_t ∇ℓ_p(W_{t−1}); W_t = A_t/‖A_t‖_q^{q−2}."""
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr", "retention"))
    spec = {"memory": "linear", "attentional_bias": {"name": "lp", "p": 3, "smooth": False},
            "retention": {"name": "lq", "q": 4, "eps": 0.0}}
    p = parts(spec)
    torch.nn.init.normal_(p.memory.init_W)
    o, _ = memorize(q, k, v, p, g)
    A = p.memory.initial_weights(B)["W"].clone()
    norm = lambda A: A / (A.abs().pow(4).sum((-1, -2), keepdim=True)).pow(0.25).pow(2)  # noqa: E731
    W = norm(A)
    outs = []
    for t in range(T):
        r = torch.einsum("bhvk,bhk->bhv", W, k[:, t]) - v[:, t]
        grad = torch.einsum("bhv,bhk->bhvk", r.sign() * r.abs() ** 2, k[:, t])
        A = g["retention"][:, t, :, None, None] * A - g["lr"][:, t, :, None, None] * grad
        W = norm(A)
        outs.append(torch.einsum("bhvk,bhk->bhv", W, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


def test_memora_kl_retention_b1_is_softmax_of_decayed_log_weights():
    """Memora (Miras Eq.27): W_t = Softmax(α_t log W_{t−1} − η_t ∇ℓ2(W_{t−1})) per row."""
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr", "retention"))
    p = parts({"memory": "linear", "retention": "kl"})
    torch.nn.init.normal_(p.memory.init_W)
    o, _ = memorize(q, k, v, p, g)
    W = torch.softmax(p.memory.initial_weights(B)["W"], -1)
    outs = []
    for t in range(T):
        grad = torch.einsum("bhv,bhk->bhvk", torch.einsum("bhvk,bhk->bhv", W, k[:, t]) - v[:, t], k[:, t])
        W = torch.softmax(g["retention"][:, t, :, None, None] * W.log() - g["lr"][:, t, :, None, None] * grad, -1)
        outs.append(torch.einsum("bhvk,bhk->bhv", W, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


@pytest.mark.parametrize("name, psi", [
    ("sigmoid", torch.sigmoid),
    ("elastic_net", lambda a: a.sign() * (a.abs() - 0.05).clamp_min(0)),
])
def test_other_mirror_retentions_b1(name, psi):
    q, k, v = random_qkv(B, T, H, D)
    g = random_gates(B, T, H, names=("lr",))
    ret = {"name": name, **({"threshold": 0.05} if name == "elastic_net" else {})}
    p = parts({"memory": "linear", "retention": ret})
    torch.nn.init.normal_(p.memory.init_W)
    o, _ = memorize(q, k, v, p, g)
    A = p.memory.initial_weights(B)["W"].clone()
    W = psi(A)
    outs = []
    for t in range(T):
        grad = torch.einsum("bhv,bhk->bhvk", torch.einsum("bhvk,bhk->bhv", W, k[:, t]) - v[:, t], k[:, t])
        A = A - g["lr"][:, t, :, None, None] * grad
        W = psi(A)
        outs.append(torch.einsum("bhvk,bhk->bhv", W, q[:, t]))
    assert rms_ratio(o, torch.stack(outs, 1)) < TOL


def test_ttt_linear_batch_gd_half_step_zero_init_is_linear_attention_within_a_chunk():
    """TTT Thm.1: linear f, batch GD (all gradients at W_0 = 0), η = ½ … gives linear attention.

    With ℓ2 = ½‖Wk − v‖² (docs/concepts/memory.md#loss-scaling) the write of a step is η v kᵀ at W = 0; here every token of the single chunk
    is written at W_0 = 0, so with η = 1 the reads are exactly causal linear attention.
    """
    q, k, v = random_qkv(1, 6, H, D)
    o, _ = memorize(q, k, v, build_memory({"memory": ZERO_LINEAR, "chunk_size": 6}, H, D, D).double())
    scores = torch.einsum("bthd,bshd->bhts", q, k) * torch.tril(torch.ones(6, 6, dtype=q.dtype))
    assert rms_ratio(o, torch.einsum("bhts,bshv->bthv", scores, v)) < TOL
