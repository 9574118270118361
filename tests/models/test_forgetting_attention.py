"""Forgetting Attention (FoX): its defining equation against a direct float64 loop, the attention form against
the φ* slot-memory form (outputs and gradients, both engines), packed sequences, the Pro options, the preset."""
from __future__ import annotations

import math

import pytest
import torch

from atlaslab.models.forgetting_attention import ForgettingAttention, ForgettingAttentionConfig, forget_bias
from atlaslab.models.presets import build_model, load_preset
from atlaslab.registry import ConfigError

from helpers import rms_ratio

PRO = dict(output_gate=True, qk_norm=True, output_norm=True, k_shift=True, v_shift=True)


def fox_direct(q, k, v, log_f):
    """o_i = Σ_{j≤i} exp(q_iᵀk_j/√D + D_ij) v_j / Σ_{j≤i} exp(q_iᵀk_j/√D + D_ij), D_ij = Σ_{l=j+1..i} log f_l,
    by explicit loops (``[B, T, H, D]``, ``log_f: [B, T, H]``)."""
    B, T, H, D = q.shape
    out = torch.zeros_like(v)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                scores = []
                for j in range(i + 1):
                    d_ij = sum(log_f[b, l, h] for l in range(j + 1, i + 1)) if j < i else 0.0
                    scores.append(q[b, i, h] @ k[b, j, h] / math.sqrt(D) + d_ij)
                w = torch.softmax(torch.stack(scores), 0)
                out[b, i, h] = (w[:, None] * v[b, :i + 1, h]).sum(0)
    return out


def _mixer(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = ForgettingAttentionConfig(num_heads=2, **kw)
    m = ForgettingAttention(cfg, 16).double()
    with torch.no_grad():                       # a forget gate away from 1/2, so D matters
        m.f_proj.bias.uniform_(-1.0, 3.0)
    return m


def test_forget_bias_attention_is_the_fox_equation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    log_f = torch.nn.functional.logsigmoid(torch.randn(2, 6, 2, generator=g, dtype=torch.float64) + 1.0)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=forget_bias(log_f, None)).transpose(1, 2)
    assert rms_ratio(o, fox_direct(q, k, v, log_f)) < 1e-12
    # with f = 1 it is ordinary causal softmax attention
    o1 = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True).transpose(1, 2)
    assert rms_ratio(o1, fox_direct(q, k, v, torch.zeros_like(log_f))) < 1e-12


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("pro", [False, True])
def test_attention_form_equals_the_slot_memory_form(mode, pro):
    kw = PRO if pro else {}
    fast = _mixer(**kw)
    slow = _mixer(form="memory", mode=mode, chunk_size=3, **kw)
    slow.load_state_dict(fast.state_dict(), strict=False)
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for m in (fast, slow):
        xi = x.clone().requires_grad_(True)
        o = m(xi)
        (o * torch.cos(o)).sum().backward()
        outs.append(o.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert rms_ratio(outs[1], outs[0]) < 1e-10
    for a, b in zip(*grads):
        assert rms_ratio(b, a) < 1e-9


@pytest.mark.parametrize("form", ["attention", "memory"])
def test_packed_sequences_equal_separate_calls(form):
    m = _mixer(form=form, **PRO)
    lengths = [4, 7, 3]
    x = torch.randn(1, sum(lengths), 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    offsets = [0, 4, 11, 14]
    packed = m(x, cu_seqlens=offsets)
    alone = torch.cat([m(x[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], 1)
    assert rms_ratio(packed, alone) < 1e-12


def test_token_shift_is_a_per_head_interpolation_with_the_previous_token():
    m = _mixer(k_shift=True)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    k = m.k_proj(x).view(1, 5, 2, 8)
    a = torch.sigmoid(m.k_shift.proj(x))                                       # [1, 5, 2]
    shifted = m.k_shift(k, x)
    assert torch.allclose(shifted[:, 0], (1 - a[:, 0, :, None]) * k[:, 0])
    assert torch.allclose(shifted[:, 3], a[:, 3, :, None] * k[:, 2] + (1 - a[:, 3, :, None]) * k[:, 3])


def test_presets_build_and_backpropagate():
    for name, extra in (("fox", {}), ("fox_pro", PRO)):
        cfg = load_preset(name, ["d_model=16", "mixers.fox.num_heads=2"])
        assert all(cfg.mixers.fox[k] == v for k, v in extra.items())
        model = build_model(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 12))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bad_fields_name_the_path_and_the_choices():
    with pytest.raises(ConfigError, match=r"form.*attention, memory"):
        load_preset("fox", ["mixers.fox.form=atention"])
    with pytest.raises(ConfigError, match=r"output_gate_act.*sigmoid, swish"):
        load_preset("fox", ["mixers.fox.output_gate_act=tanh"])


def test_preset_forget_gate_reaches_across_a_niah_sequence_at_initialisation():
    """The preset's forget-gate bias (6) keeps the first of 256 tokens in reach of the last at the start of
    training: exp(Σ_{l=1..255} log f_l) ≥ 0.1 for unit-RMS inputs (the pre-norm hidden states). FoX's bias 0 gives
    e^-177 and our earlier 3 gave about e^-14 there, and FoX then stays near guessing on S-NIAH at 256 bytes
    (docs/results/reading-list.md#sniah)."""
    torch.manual_seed(0)
    model = build_model(load_preset("fox"))
    x = torch.randn(4, 256, model.cfg.d_model)
    for layer in model.layers:
        _, _, _, log_f = layer.mixer.project(x)                      # [B, T, H]
        reach = log_f[:, 1:].sum(1).exp()                             # weight of token 0 seen from token 255
        assert reach.min() > 0.1, reach
