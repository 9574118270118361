"""Every preset's memory stays bounded where the outer loop drives its gates (open gates, large values).

Training the LMM on MQAR pushes the momentum gate θ toward 1 (0.995 was seen), the step gate η to its ceiling and
the values to ‖v‖ ≈ 2.5–3. With a plain residual MLP memory M(x) = x + W2 σ(W1 x), the inner loss is quartic in
the fast weights, so its gradient grows like ‖W‖³: once a step overshoots, the next (taken at the larger weights)
overshoots more, and the weights go to inf within one sequence (at every chunk size, b = 1 included; the chunked
engine and the recurrent reference agree). LayerNorm on the memory's branch, M(x) = x + LN(W2 σ(W1 x)), bounds the
prediction and makes the branch's gradient shrink as its weights grow, so the same gates stay finite.

The same holds without the residual: OmegaNet's M(x) = W2 σ(W1 φ(x)) read 4.5e34 inside one training sequence at
step 86 of MQAR with 16 heads of 4 (then NaN); the DeepTransformers (deeptransformer, dot, swdt) likewise. Their
presets read LN(W2 σ(W1 φ(x))). The test over every preset asks for no amplification: a read is never larger than
the sum of the norms of every value written.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslab import memorize
from atlaslab.memory import build_memory
from atlaslab.models.layers import MemoryLayer
from atlaslab.models.lm import LanguageModel
from atlaslab.models.presets import build_model, list_presets, load_preset

PRESETS = ("titans", "titans_mac", "titans_mag", "titans_mal")


def _memory_node(preset):
    cfg = load_preset(preset)
    (mixer,) = cfg.mixers.values()
    return cfg, mixer


def _adversarial_inputs(B, T, H, D, v_norm=2.5, theta=0.995):
    """Keys / queries as the layer makes them (ℓ2-normalised SiLU outputs, all in one orthant, so correlated),
    values of norm ``v_norm``, η at its ceiling (gate 1), θ = ``theta``, no decay (α = 1)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (F.silu(torch.randn(B, T, H, D, generator=g)) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = v_norm * F.normalize(v, dim=-1)
    ones = torch.ones(B, T, H)
    return q, k, v, {"lr": ones, "momentum": theta * ones, "retention": ones}


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["preset_b", "b1"])
@pytest.mark.parametrize("preset", PRESETS)
def test_memory_stays_finite_at_saturated_gates(preset, chunk_size):
    cfg, mixer = _memory_node(preset)
    H = mixer.num_heads
    D = cfg.d_model // H
    parts = build_memory(mixer.memory, H, D, D)
    q, k, v, gates = _adversarial_inputs(4, 128, H, D)
    with torch.no_grad():
        o, state = memorize(q, k, v, parts, gates, mode="chunked", chunk_size=chunk_size)
    for name, w in state.weights.items():
        assert torch.isfinite(w).all(), f"{preset}: fast weight {name} is not finite"
    assert torch.isfinite(o).all(), f"{preset}: memory read is not finite"
    # x + LN(·) with the initial affine reads at most ‖q‖ + √D per head
    assert o.norm(dim=-1).max() <= 1 + math.sqrt(D) + 1e-3, o.norm(dim=-1).max()


def test_titans_model_forward_finite_with_saturated_gates():
    """The whole model (conv, SiLU, ℓ2 norm, gates), its gates and value scale (‖v‖ ≈ 2.3) set where training took
    them, on 128 tokens."""
    cfg = load_preset("titans", ["vocab_size=64"])
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    with torch.no_grad():
        for layer in model.mixers():
            nets = layer.gate_nets
            nets["lr"].proj.bias.fill_(8.0)                              # η → its ceiling
            nets["momentum"].proj.bias.fill_(math.log(0.995 / 0.005))    # θ → 0.995
            nets["retention"].proj.bias.fill_(8.0)                       # α → 1
            layer.v_proj.weight.mul_(3.0)                                # larger values
        ids = torch.randint(0, 64, (4, 128), generator=torch.Generator().manual_seed(0))
        logits = model(ids)
    assert torch.isfinite(logits).all()


def _memory_layer(preset):
    torch.manual_seed(0)
    model = build_model(load_preset(preset, ["vocab_size=32", "num_layers=1"])).to(torch.float64)
    return next((m for m in model.modules() if isinstance(m, MemoryLayer)), None)


MEMORY_PRESETS = [p for p in list_presets() if _memory_layer(p) is not None]


@pytest.mark.parametrize("preset", MEMORY_PRESETS)
def test_no_preset_memory_amplifies_its_values(preset):
    """Unit keys and queries, values of norm 4, every gate at 1 (θ at 0.995), 64 tokens, the preset's own engine
    settings: every read is finite and at most Σ_t ‖v_t‖ (what an unnormalised linear memory can reach)."""
    layer = _memory_layer(preset)
    parts = layer.parts
    H, Dk, Dv = parts.num_heads, parts.key_dim, parts.value_dim
    B, T = 1, 64
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = 4.0 * F.normalize(torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64), dim=-1)
    x = torch.randn(B, T, layer.d_model, generator=g, dtype=torch.float64)
    gates = {n: (0.995 if n == "momentum" else 1.0) * torch.ones_like(t, dtype=torch.float64)
             for n, t in layer.gates(x).items()}
    with torch.no_grad():
        o, _ = memorize(q, k, v, parts, gates, mode="recurrent")
    assert torch.isfinite(o).all(), f"{preset}: memory read is not finite"
    bound = v.norm(dim=-1).sum(1).max()
    assert o.norm(dim=-1).max() <= bound, f"{preset}: read {o.norm(dim=-1).max():.3g} > Σ‖v‖ = {bound:.3g}"
