"""The reference engine's contracts: every part runs, gradients reach everything, batches never mix,
chained calls equal one call, chunk semantics and read granularity behave as the spec defines."""
import itertools

import pytest
import torch
from helpers import random_gates, random_qkv, rms_ratio

from atlaslab import memorize
from atlaslab.memory import build_memory
from atlaslab.memory.spec import DEFAULT_PARTS, PART_KINDS
from atlaslab.registry import get_registry

B, T, H, D = 2, 6, 2, 4


def gates_for(parts, T=T, seed=1, B=B):
    names = ["lr", "window"]
    if parts.retention.uses_alpha:
        names.append("retention")
    if parts.inner_optimizer.has_momentum:
        names.append("momentum")
    g = random_gates(B, T, H, seed=seed, names=[n for n in names if n != "retention"], low=0.3, high=0.8)
    if "retention" in names:
        g.update(random_gates(B, T, H, seed=seed + 1, names=("retention",), low=0.8, high=0.99,
                              Dk=D if parts.retention.channel_wise else None))
    if parts.attentional_bias.uses_delta:
        g["delta"] = random_gates(B, T, H, seed=seed + 2, names=("delta",), low=0.2, high=1.5)["delta"]
    return g


def spec_with(kind, name):
    """A spec that uses part ``name`` of ``kind``, with the other parts made compatible with it."""
    spec = {k: DEFAULT_PARTS[k] for k in PART_KINDS}
    spec[kind] = name
    if kind == "feature_map" and name in ("polynomial", "exp"):
        spec["memory"] = {"name": "mlp", "residual": False}
    if kind == "inner_optimizer" and name == "muon":
        spec["memory"] = "mlp"
    if kind == "memory" and name in ("mlp", "mlp_ln", "gated_mlp"):
        spec["inner_optimizer"] = {"name": "gd", "lr": 0.5}
    if kind == "retention" and name == "weight_norm":     # keeps the initial norms: needs a non-zero initial memory
        spec["memory"] = "mlp"
    return spec


PART_CASES = [(kind, entry.name) for kind in PART_KINDS for entry in get_registry(kind)]


@pytest.mark.parametrize("kind, name", PART_CASES, ids=[f"{k}-{n}" for k, n in PART_CASES])
def test_every_registered_part_runs_forward_and_backward(kind, name):
    parts = build_memory(spec_with(kind, name), H, D, D).double()
    q, k, v = random_qkv(B, T, H, D, requires_grad=True)
    o, state = memorize(q, k, v, parts, gates_for(parts), chunk_size=2)
    assert o.shape == (B, T, H, D) and torch.isfinite(o).all()
    o.square().mean().backward()
    for x in (q, k, v):
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert state.position == T


# specs covering every engine path: deep memories, windows, momentum/Muon, mirrors, kernel trick, chunk reads
SPECS = {
    "deltanet": {"memory": "linear"},
    "gdn": {"memory": "linear", "retention": {"name": "decay", "placement": "before_step"}},
    "gla": {"memory": "linear", "attentional_bias": "dot", "retention": {"name": "decay", "channel_wise": True}},
    "titans": {"memory": "mlp", "retention": "decay", "inner_optimizer": "momentum", "chunk_size": 4},
    "titans_shared_init": {"memory": {"name": "mlp", "init": "shared"}, "retention": "decay",
                           "inner_optimizer": "momentum", "chunk_size": 4},
    "atlas": {"memory": {"name": "mlp", "residual": False, "expansion": 1}, "feature_map": "polynomial",
              "retention": "decay",
              "inner_optimizer": "muon", "window": {"size": 3}, "chunk_size": 4},
    "atlas_pp_chunk": {"memory": "gated_mlp", "retention": "decay", "read": "chunk", "chunk_size": 4,
                       "inner_optimizer": {"name": "muon", "ns_granularity": "chunk"}},
    "moneta": {"memory": "mlp_ln", "attentional_bias": "lp", "retention": "lq", "chunk_size": 4},
    "memora": {"memory": "mlp_ln", "retention": "kl", "chunk_size": 4},
    "yaad": {"memory": "mlp_ln", "attentional_bias": "huber", "retention": "decay", "chunk_size": 4},
    "dot_kernel": {"memory": {"name": "linear", "init": "zeros"}, "feature_map": "exp", "window": {"size": 2},
                   "inner_optimizer": "momentum", "retention": "decay", "chunk_size": 4},
    "softmax": {"memory": {"name": "linear", "init": "zeros"}, "attentional_bias": "dot",
                "feature_map": {"name": "exp", "normalize": True}},
    "global_implicit": {"memory": "linear", "inner_optimizer": "implicit_gd", "window": "global"},
    "token_vs_chunk_read": {"memory": "mlp", "read": "chunk", "chunk_size": 4},
    "weight_norm": {"memory": "mlp", "retention": "weight_norm", "inner_optimizer": "momentum", "chunk_size": 4},
    "lact": {"memory": {"name": "gated_mlp", "expansion": 1, "activation": "silu", "residual": False},
             "attentional_bias": "dot", "retention": "weight_norm", "read": "chunk", "chunk_size": 4,
             "inner_optimizer": {"name": "muon", "lr": 1.0, "ns_granularity": "chunk", "ns_coefficients": "lact"}},
    "dpfp_delta": {"memory": "linear", "feature_map": {"name": "dpfp", "nu": 2}, "retention": "decay"},
}


def built(name):
    torch.manual_seed(0)
    parts = build_memory(SPECS[name], H, D, D).double()
    for n, p in parts.named_parameters():   # move learned initial memories off zero so every path is exercised
        if n.startswith("memory.init_"):
            torch.nn.init.normal_(p, std=0.3)
    return parts


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("b", [1, 4])
def test_two_chained_calls_equal_one_call(name, b):
    parts = built(name)
    T_ = 7                                       # not a multiple of b
    q, k, v = random_qkv(B, T_, H, D)
    g = gates_for(parts, T=T_)
    full, full_state = memorize(q, k, v, parts, g, chunk_size=b)
    for split in (3, 5):
        first, state = memorize(q[:, :split], k[:, :split], v[:, :split], parts,
                                {n: x[:, :split] for n, x in g.items()}, chunk_size=b)
        second, state = memorize(q[:, split:], k[:, split:], v[:, split:], parts,
                                 {n: x[:, split:] for n, x in g.items()}, chunk_size=b, initial_state=state)
        assert rms_ratio(torch.cat([first, second], 1), full) < 1e-12
        if full_state.weights is not None:
            for n in full_state.weights:
                assert rms_ratio(state.weights[n], full_state.weights[n]) < 1e-12


@pytest.mark.parametrize("name", list(SPECS))
def test_gradients_reach_inputs_gates_and_learnable_pieces(name):
    parts = built(name)
    q, k, v = random_qkv(B, T, H, D, requires_grad=True)
    g = {n: x.clone().requires_grad_(True) for n, x in gates_for(parts).items()}
    o, _ = memorize(q, k, v, parts, g)
    (o * torch.randn_like(o)).sum().backward()
    for label, x in [("q", q), ("k", k), ("v", v)] + [(f"gate {n}", x) for n, x in g.items()]:
        assert x.grad is not None and x.grad.abs().sum() > 0, f"{name}: no gradient reaches {label}"
    for n, p in parts.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient reaches {n}"


@pytest.mark.parametrize("name", ["titans", "atlas", "moneta", "dot_kernel", "softmax", "gla"])
def test_batch_elements_are_independent(name):
    parts = built(name)
    q, k, v = random_qkv(3, T, H, D)
    g = gates_for(parts, B=3)
    o, _ = memorize(q, k, v, parts, g)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[1] = torch.randn_like(k2[1])
    v2[1] = torch.randn_like(v2[1])
    o2, _ = memorize(q2, k2, v2, parts, g)
    assert torch.equal(o[0], o2[0]) and torch.equal(o[2], o2[2])
    assert not torch.allclose(o[1], o2[1])


def test_read_chunk_never_sees_the_current_chunk():
    parts = built("atlas_pp_chunk")
    q, k, v = random_qkv(1, 8, H, D)
    o, _ = memorize(q, k, v, parts)
    k2, v2 = k.clone(), v.clone()
    k2[:, 5], v2[:, 5] = -k2[:, 5], 2 * v2[:, 5]      # change a token of the second chunk [4, 8)
    o2, _ = memorize(q, k2, v2, parts)
    assert torch.equal(o[:, :8], o2[:, :8])          # no read in chunks 0 and 1 sees token 5
    q3 = torch.cat([q, q[:, :1]], 1)
    o3, _ = memorize(q3, torch.cat([k2, k[:, :1]], 1), torch.cat([v2, v[:, :1]], 1), parts)
    o4, _ = memorize(q3, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), parts)
    assert not torch.allclose(o3[:, 8], o4[:, 8])     # ... but the next chunk does


def test_token_read_sees_its_own_write_and_chunk_read_does_not():
    tok = build_memory({"memory": {"name": "linear", "init": "zeros"}}, H, D, D).double()
    q, k, v = random_qkv(1, 1, H, D)
    o, _ = memorize(q, k, v, tok)
    assert o.abs().sum() > 0                          # y_1 = M_1 q_1 includes (k_1, v_1)  (read after write)
    o, _ = memorize(q, k, v, tok, chunk_size=1)
    chunk = build_memory({"memory": {"name": "linear", "init": "zeros"}, "read": "chunk"}, H, D, D).double()
    o, _ = memorize(q, k, v, chunk)
    assert o.abs().sum() == 0


def test_chunk_size_is_semantic_gradients_at_chunk_start():
    """b = T: every gradient at M_0, so M_T = M_0 − Σ_t η_t (M_0 k_t − v_t) k_tᵀ (Titans Eq.16, TTT §2.4)."""
    parts = built("deltanet")
    q, k, v = random_qkv(B, T, H, D)
    eta = random_gates(B, T, H, names=("lr",))["lr"]
    _, state = memorize(q, k, v, parts, {"lr": eta}, chunk_size=T)
    M0 = parts.memory.initial_weights(B)["W"]
    err = torch.einsum("bhvk,bthk->bthv", M0, k) - v
    assert rms_ratio(state.weights["W"], M0 - torch.einsum("bth,bthv,bthk->bhvk", eta, err, k)) < 1e-12
    _, online = memorize(q, k, v, parts, {"lr": eta}, chunk_size=1)
    assert rms_ratio(online.weights["W"], state.weights["W"]) > 1e-3


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_mirror_map_is_applied_at_chunk_ends(b):
    """Inside a chunk W moves linearly; after each chunk's last token W = Ψ(A) (Miras §5.4)."""
    parts = built("moneta")
    q, k, v = random_qkv(1, 6, H, D)
    _, state = memorize(q, k, v, parts, chunk_size=b)
    psi = parts.retention.psi(state.dual)
    at_boundary = 6 % b == 0
    for n in psi:
        assert torch.allclose(psi[n], state.weights[n]) == at_boundary


def test_chunk_granular_muon_steps_once_per_chunk():
    parts = built("atlas_pp_chunk")
    q, k, v = random_qkv(1, 6, H, D)
    _, s3 = memorize(q[:, :3], k[:, :3], v[:, :3], parts)
    init = parts.memory.initial_weights(1)
    assert all(torch.equal(s3.weights[n], init[n]) for n in init)      # no step before the chunk ends
    _, s4 = memorize(q[:, :4], k[:, :4], v[:, :4], parts)
    assert not torch.equal(s4.weights["W1"], init["W1"])


def test_window_gate_zero_prunes_a_token():
    parts = built("atlas")
    q, k, v = random_qkv(1, T, H, D)
    g = gates_for(parts, B=1)
    g["window"][:, 2] = 0.0                           # γ = 0: token 2 never enters any inner loss
    o, _ = memorize(q, k, v, parts, g)
    k2, v2 = k.clone(), v.clone()
    k2[:, 2], v2[:, 2] = torch.randn_like(k2[:, 2]), torch.randn_like(v2[:, 2])
    o2, _ = memorize(q, k2, v2, parts, g)
    assert rms_ratio(o2, o) < 1e-12


def test_gate_errors_are_clear():
    parts = built("deltanet")
    q, k, v = random_qkv(B, T, H, D)
    with pytest.raises(ValueError, match="gates.retention: given, but retention 'none'"):
        memorize(q, k, v, parts, {"retention": torch.ones(B, T, H, dtype=q.dtype)})
    with pytest.raises(ValueError, match=r"gates.lr: expected shape \[2, 6, 2\]"):
        memorize(q, k, v, parts, {"lr": torch.ones(B, T, dtype=q.dtype)})
    with pytest.raises(ValueError, match="unknown gate 'beta'"):
        memorize(q, k, v, parts, {"beta": torch.ones(B, T, H, dtype=q.dtype)})
    with pytest.raises(ValueError, match="unknown mode 'chunkd'"):
        memorize(q, k, v, parts, mode="chunkd")
    with pytest.raises(ValueError, match=r"q, k: \[B, T, H, D_k\]"):
        memorize(q[0], k, v, parts)


def test_memorize_accepts_a_plain_config():
    q, k, v = random_qkv(B, T, H, D, dtype=torch.float32)
    o, state = memorize(q, k, v, {"memory": "linear", "retention": "decay"})
    assert o.shape == (B, T, H, D) and state.weights["W"].shape == (B, H, D, D)


def test_state_size_counts_fast_weights_momentum_and_window():
    p = build_memory(SPECS["titans"], H, D, D)
    hidden = 4 * D
    assert p.state_size() == 2 * H * (hidden * D + D * hidden)          # weights + momentum
    p = build_memory({"memory": "linear", "window": {"size": 3}}, H, D, D)
    assert p.state_size() == H * D * D + 2 * H * (D + D + 1)
    p = build_memory(SPECS["softmax"], H, D, D)
    assert p.state_size() == 0 and p.state_size_per_token() == H * (2 * D)


def test_all_gd_combinations_of_biases_and_memories_run():
    for mem, bias in itertools.product(["linear", "diagonal", "mlp", "mlp_ln", "gated_mlp"],
                                       ["dot", "l2", "lp", "l1", "huber", "value_shift"]):
        parts = build_memory({"memory": mem, "attentional_bias": bias, "inner_optimizer": {"lr": 0.3}},
                             H, D, D).double()
        q, k, v = random_qkv(1, 3, H, D)
        o, _ = memorize(q, k, v, parts, chunk_size=2)
        assert torch.isfinite(o).all(), (mem, bias)
