"""Unit checks of individual parts against their defining formulas."""
import pytest
import torch

from atlaslab.memory import build_memory
from atlaslab.registry import ConfigError, build_part

EXACT_BIASES = [
    {"name": "l2"},
    {"name": "dot"},
    {"name": "lp", "p": 3.0, "smooth": False},
    {"name": "lp", "p": 1.5, "smooth": False},
    {"name": "l1", "smooth": False},
    {"name": "huber", "variant": "norm", "smooth": False},
    {"name": "huber", "variant": "coordinate", "smooth": False},
    {"name": "value_shift", "shift": 0.3, "smooth": False},
]


@pytest.mark.parametrize("node", EXACT_BIASES, ids=lambda n: "-".join(str(v) for v in n.values()))
def test_output_grad_is_the_gradient_of_the_loss(node):
    """∂ℓ/∂pred by autograd equals the bias's error signal (the loss scaling of docs/concepts/memory.md#loss-scaling)."""
    bias = build_part("attentional_bias", node)
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(5, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)
    delta = 0.5 + torch.rand(5, 3, generator=g, dtype=torch.float64)
    loss = bias.loss(pred, target, delta)
    assert loss.shape == (5, 3)
    (auto,) = torch.autograd.grad(loss.sum(), pred)
    assert torch.allclose(bias.output_grad(pred, target, delta), auto, atol=1e-12)


def test_yaad_mixture_switches_between_l2_and_scaled_l1():
    bias = build_part("attentional_bias", {"name": "huber", "smooth": False})
    pred = torch.tensor([[0.1, -0.2], [3.0, -4.0]], dtype=torch.float64)
    target = torch.zeros_like(pred)
    delta = torch.tensor([1.0, 2.0], dtype=torch.float64)
    e = bias.output_grad(pred, target, delta)
    assert torch.equal(e[0], pred[0])                                      # ‖r‖ ≤ δ: ℓ2 gradient
    assert torch.equal(e[1], torch.tensor([2.0, -2.0], dtype=torch.float64))  # else δ·Sign(r)


def test_smooth_surrogates_approach_the_exact_gradients_away_from_zero():
    exact = build_part("attentional_bias", {"name": "lp", "p": 3.0, "smooth": False})
    smooth = build_part("attentional_bias", {"name": "lp", "p": 3.0, "sharpness": 50.0})
    pred = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    target = torch.zeros_like(pred)
    assert torch.allclose(exact.output_grad(pred, target), smooth.output_grad(pred, target), rtol=1e-4)
    l1 = build_part("attentional_bias", "l1")   # tanh(αx) is smooth through zero
    assert torch.equal(l1.output_grad(torch.zeros(1, 2), torch.zeros(1, 2)), torch.zeros(1, 2))


def test_memory_shapes_and_learned_initial_weights():
    p = build_memory({"memory": {"name": "mlp", "depth": 3, "expansion": 2}}, 2, 4, 4)
    assert p.memory.shapes() == {"W1": (8, 4), "W2": (8, 8), "W3": (4, 8)}
    assert {n for n, _ in p.named_parameters()} == {"memory.init_W1", "memory.init_W2", "memory.init_W3"}
    w = p.memory.initial_weights(3)
    assert w["W1"].shape == (3, 2, 8, 4)
    p = build_memory({"memory": {"name": "linear", "init": "zeros"}}, 2, 4, 4)
    assert list(p.parameters()) == []
    p = build_memory({"memory": "gated_mlp"}, 2, 4, 4)
    assert p.memory.shapes() == {"W1": (4, 16), "W2": (16, 4), "W3": (16, 4)}
    p = build_memory({"memory": "mlp_ln"}, 2, 4, 4)
    assert {"memory.ln_weight", "memory.ln_bias"} <= {n for n, _ in p.named_parameters()}


def test_shared_initial_weights_are_one_learned_value_that_every_head_trains():
    """``init: shared``: one ``[1, ...]`` parameter per fast-weight matrix, expanded over the heads; its gradient is
    the sum of the per-head gradients of the same model with that value copied into every head."""
    torch.manual_seed(0)
    shared = build_memory({"memory": {"name": "mlp", "expansion": 2, "init": "shared"}}, 3, 4, 4).double()
    per_head = build_memory({"memory": {"name": "mlp", "expansion": 2}}, 3, 4, 4).double()
    assert shared.memory.init_W1.shape == (1, 8, 4) and per_head.memory.init_W1.shape == (3, 8, 4)
    assert sum(p.numel() for p in per_head.parameters()) == 3 * sum(p.numel() for p in shared.parameters())
    with torch.no_grad():
        for n, p in per_head.named_parameters():
            p.copy_(dict(shared.named_parameters())[n].expand_as(p))
    w = shared.memory.initial_weights(2)
    assert w["W1"].shape == (2, 3, 8, 4) and torch.equal(w["W1"][:, 0], w["W1"][:, 2])
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    shared.memory(w, x).pow(2).sum().backward()
    per_head.memory(per_head.memory.initial_weights(2), x).pow(2).sum().backward()
    for n, p in shared.named_parameters():
        expected = dict(per_head.named_parameters())[n].grad.sum(0, keepdim=True)
        assert expected.abs().sum() > 0 and torch.allclose(p.grad, expected), n
    with pytest.raises(ConfigError, match="learned, shared, zeros"):
        build_memory({"memory": {"name": "mlp", "init": "per_head"}}, 3, 4, 4)


def test_gated_mlp_is_atlas_pp_equation_43():
    p = build_memory({"memory": "gated_mlp"}, 1, 3, 3).double().memory
    w = {n: t.double() for n, t in p.initial_weights(1).items()}
    x = torch.randn(1, 1, 5, 3, dtype=torch.float64)
    expected = x + torch.einsum("oi,bhni->bhno", w["W1"][0, 0], torch.nn.functional.gelu(
        torch.einsum("oi,bhni->bhno", w["W2"][0, 0], x)) * torch.einsum("oi,bhni->bhno", w["W3"][0, 0], x))
    assert torch.allclose(p(w, x), expected)


def test_retention_maps():
    a = torch.tensor([[[[0.5, -2.0], [1.0, 0.0]]]], dtype=torch.float64)
    lq = build_part("retention", {"name": "lq", "q": 4.0, "eps": 0.0})
    norm4 = a.abs().pow(4).sum().pow(0.25)
    assert torch.allclose(lq.map(a), a / norm4 ** 2)
    kl = build_part("retention", {"name": "kl", "scale": 2.0})
    assert torch.allclose(kl.map(a).sum(-1), torch.full((1, 1, 2), 2.0, dtype=torch.float64))
    en = build_part("retention", {"name": "elastic_net", "threshold": 0.75})
    assert torch.equal(en.map(a), torch.tensor([[[[0.0, -1.25], [0.25, 0.0]]]], dtype=torch.float64))


def test_weight_norm_rescales_every_row_to_its_chunk_start_norm():
    """LaCT's weight norm: W_r · ‖W_{t', r}‖ / ‖W_r‖ per row (``axis: column``: per column; a vector as a whole)."""
    g = torch.Generator().manual_seed(0)
    start = {"W": torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64),
             "w": torch.randn(2, 3, 5, generator=g, dtype=torch.float64)}
    moved = {n: w + torch.randn(w.shape, generator=g, dtype=torch.float64) for n, w in start.items()}
    rows = build_part("retention", {"name": "weight_norm"}).project_chunk(moved, start)
    for i in range(4):
        r = moved["W"][:, :, i]
        assert torch.allclose(rows["W"][:, :, i], r / r.norm(dim=-1, keepdim=True)
                              * start["W"][:, :, i].norm(dim=-1, keepdim=True))
    assert torch.allclose(rows["w"], moved["w"] / moved["w"].norm(dim=-1, keepdim=True)
                          * start["w"].norm(dim=-1, keepdim=True))
    cols = build_part("retention", {"name": "weight_norm", "axis": "column"}).project_chunk(moved, start)
    assert torch.allclose(cols["W"].norm(dim=-2), start["W"].norm(dim=-2))
    assert not torch.allclose(cols["W"].norm(dim=-1), start["W"].norm(dim=-1))


@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 3, 9, 4), (6, 6)], ids=["wide", "tall-4d", "square-2d"])
def test_newton_schulz_fused_gemms_match_the_equations_in_outputs_and_gradients(shape):
    """The GEMM-fused Newton–Schulz (baddbmm) computes the equations as written (newton_schulz_plain): outputs and
    gradients in float64, wide, tall (transposed) and unbatched matrices, with the shape factor and a schedule."""
    from atlaslab.kernels.newton_schulz.naive import LACT_COEFFICIENTS, newton_schulz, newton_schulz_plain
    torch.manual_seed(0)
    s = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*shape, dtype=torch.float64)
    for kw in ({}, {"shape_factor": True}, {"coefficients": LACT_COEFFICIENTS}):
        fast, plain = newton_schulz(s, 5, **kw), newton_schulz_plain(s, 5, **kw)
        g_fast, = torch.autograd.grad((fast * w).sum(), s)
        g_plain, = torch.autograd.grad((plain * w).sum(), s)
        assert fast.shape == s.shape
        torch.testing.assert_close(fast, plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_fast, g_plain, rtol=1e-10, atol=1e-10)


def test_newton_schulz_takes_a_per_step_schedule():
    """A schedule uses triple i at step i (checked on wide and tall matrices against the iteration written out)."""
    from atlaslab.kernels.newton_schulz import LACT_COEFFICIENTS, MUON_COEFFICIENTS, newton_schulz
    s = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = s / (s.pow(2).sum((-2, -1), keepdim=True).sqrt() + 1e-7)
    for a, b, c in LACT_COEFFICIENTS:
        x = a * x + (b * (x @ x.mT) + c * (x @ x.mT) @ (x @ x.mT)) @ x
    assert torch.allclose(newton_schulz(s, 5, 1e-7, LACT_COEFFICIENTS), x, atol=1e-12)
    assert torch.allclose(newton_schulz(s.mT, 5, 1e-7, LACT_COEFFICIENTS), x.mT, atol=1e-12)
    assert not torch.allclose(newton_schulz(s, 5, 1e-7, MUON_COEFFICIENTS), x, atol=1e-3)
    with pytest.raises(ValueError, match="schedule of 5"):
        newton_schulz(s, 3, 1e-7, LACT_COEFFICIENTS)
