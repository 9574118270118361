"""LaCT (Zhang et al. 2025, "Test-Time Training Done Right", §3): the memory update and the whole layer against a
direct float64 implementation of the paper's equations written here (explicit SwiGLU gradients, the chunk loop,
LaCT's 5-step Newton–Schulz, per-row renormalisation to the initial norms), on every engine; the chunk-mean
momentum gate; token-by-token decoding at any split; validation; and that the preset learns the learning guard's
tiny MQAR.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_qkv, rms_ratio

from atlaslab import memorize
from atlaslab.memory import build_memory
from atlaslab.models.decoding import LaCTState, decode_mixer
from atlaslab.models.lact import LACT_MEMORY_SPEC, LaCTConfig, LaCTLayer, chunk_mean_momentum
from atlaslab.models.presets import build_model, load_preset
from atlaslab.registry import ConfigError, resolve_part

TOL = 1e-10
MODES = ("recurrent", "chunked", "triton")
#: LaCT's Newton–Schulz schedule, one (a, b, c) per step (typed again here, not imported)
NS_SCHEDULE = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
               (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


# ---------------------------------------------------------------------------------------------------
# the direct implementation
# ---------------------------------------------------------------------------------------------------
def silu_derivative(z):
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def orthogonalise(g):
    """Newton–Schulz with LaCT's schedule: Frobenius-normalise (transposed when tall), five quintic steps."""
    tall = g.shape[-2] > g.shape[-1]
    x = g.mT if tall else g
    x = x / (x.pow(2).sum((-2, -1), keepdim=True).sqrt() + 1e-7)
    for a, b, c in NS_SCHEDULE:
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if tall else x


def lact_direct(w_gate, w_up, w_down, q, k, v, lr, theta, b):
    """LaCT's block-causal update, "apply, then update", for every (sequence, head) at once.

    f(x) = W_down (silu(W_gate x) ⊙ W_up x); per chunk: o = f(q) with the chunk-start weights; the descent direction
    of the chunk loss Σ_i lr_i · (−⟨f(k_i), v_i⟩) by hand; momentum with the chunk's mean θ; W += NS(S); every row
    back to its initial norm. ``w_gate, w_up: [B, H, h, d]``, ``w_down: [B, H, d, h]``, ``q, k, v: [B, T, H, d]``,
    ``lr, theta: [B, T, H]`` (theta None: no momentum).
    """
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    lr = lr.transpose(1, 2)
    W = [w_gate, w_up, w_down]
    norms = [w.pow(2).sum(-1, keepdim=True).sqrt() for w in W]
    S = [torch.zeros_like(w) for w in W]
    T = q.shape[2]
    out = []
    for s in range(0, T, b):
        e = min(s + b, T)
        wg, wu, wd = W
        qi, ki, vi, li = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], lr[:, :, s:e, None]
        out.append((F.silu(qi @ wg.mT) * (qi @ wu.mT)) @ wd.mT)          # apply with the weights before the chunk
        if e - s < b:
            break
        zg, zu = ki @ wg.mT, ki @ wu.mT                                    # [B, H, n, h]
        hidden = F.silu(zg) * zu
        back = vi @ wd                                                     # W_downᵀ v_i
        G = [(back * zu * silu_derivative(zg) * li).mT @ ki,                # −∂/∂W_gate of the chunk loss
             (back * F.silu(zg) * li).mT @ ki,                             # −∂/∂W_up
             (vi * li).mT @ hidden]                                        # −∂/∂W_down
        if theta is not None:
            m = theta.transpose(1, 2)[:, :, s:e].mean(-1)[..., None, None]
            G = [g + m * s_prev for g, s_prev in zip(G, S)]
            S = G
        W = [w + orthogonalise(g) for w, g in zip(W, G)]
        W = [w / w.pow(2).sum(-1, keepdim=True).sqrt() * n for w, n in zip(W, norms)]
    return torch.cat(out, 2).transpose(1, 2)


def rope_direct(x, base=10000.0):
    """RoPE on ``x: [B, T, H, D]``, pairs (j, j + D/2) rotated by t · base^(−2j/D)."""
    T, D = x.shape[1], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-2 * torch.arange(D // 2, dtype=x.dtype) / D)
    c, s = angle.cos()[None, :, None], angle.sin()[None, :, None]
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def rms(x, weight, eps=1e-6):
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def layer_direct(layer, x):
    """The LaCT layer from its parameters: shared q, k, v; SWA; the fast-weight branch; sum; output projection."""
    c, d = layer.cfg, x.shape[-1]
    B, T, _ = x.shape
    q, k, v = (x @ layer.qkv.weight.T).split(d, -1)
    if c.qk_norm:
        q, k = rms(q, layer.q_norm.weight), rms(k, layer.k_norm.weight)
    Ha, Ht = c.num_heads, c.ttt_heads
    heads = lambda t, n: t.reshape(B, T, n, d // n)   # noqa: E731
    # sliding-window attention, written out
    qa, ka, va = heads(q, Ha), heads(k, Ha), heads(v, Ha)
    if c.rope:
        qa, ka = rope_direct(qa), rope_direct(ka)
    scores = torch.einsum("bihd,bjhd->bhij", qa, ka) / math.sqrt(d // Ha)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    scores = scores.masked_fill(~((j <= i) & (i - j < c.window)), float("-inf"))
    o_attn = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), va).reshape(B, T, d)
    # the fast-weight branch
    fq = q * layer.qk_scale[0] + layer.qk_offset[0]
    fk = k * layer.qk_scale[1] + layer.qk_offset[1]
    fq, fk, fv = F.silu(fq), F.silu(fk), F.silu(v)
    fq, fk = (t / t.pow(2).sum(-1, keepdim=True).sqrt() for t in (heads(fq, Ht), heads(fk, Ht)))
    fq, fk = (heads(rope_direct(heads(t.reshape(B, T, d), Ha)).reshape(B, T, d), Ht) for t in (fq, fk))
    lr = F.softplus(x @ layer.lr_proj.weight.T + layer.lr_proj.bias)
    theta = torch.sigmoid(x @ layer.momentum_proj.weight.T + layer.momentum_proj.bias)
    w0 = layer.parts.memory.initial_weights(B)
    o = lact_direct(w0["W2"], w0["W3"], w0["W1"], fq, fk, heads(fv, Ht), lr, theta, layer.spec.chunk_size)
    o = rms(o, layer.out_norm.weight) * F.silu(x @ layer.scale_proj.weight.T + layer.scale_proj.bias)[..., None]
    return (o_attn + o.reshape(B, T, d)) @ layer.o_proj.weight.T


# ---------------------------------------------------------------------------------------------------
# the update rule
# ---------------------------------------------------------------------------------------------------
def lact_parts(H, D, b):
    torch.manual_seed(0)
    parts = build_memory(dict(LACT_MEMORY_SPEC, chunk_size=b), H, D, D).double()
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return parts


def gradients(out, leaves):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), leaves)


@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "no_momentum"])
@pytest.mark.parametrize("mode", MODES)
def test_memory_is_the_lact_update(mode, momentum):
    """memorize with LaCT's parts and gates equals the direct chunk loop: outputs and every gradient, float64."""
    B, T, H, D, b = 2, 14, 2, 4, 4                   # T not a multiple of b: a partial last chunk
    parts = lact_parts(H, D, b)
    q, k, v = random_qkv(B, T, H, D, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    lr = (0.2 + torch.rand(B, T, H, generator=g, dtype=torch.float64)).requires_grad_(True)
    theta = torch.rand(B, T, H, generator=g, dtype=torch.float64).requires_grad_(True)
    gates = {"window": lr, "momentum": chunk_mean_momentum(theta if momentum else torch.zeros_like(theta), b)}
    o, state = memorize(q, k, v, parts, gates, mode=mode)
    w0 = parts.memory.initial_weights(B)
    ref = lact_direct(w0["W2"], w0["W3"], w0["W1"], q, k, v, lr, theta if momentum else None, b)
    assert rms_ratio(o, ref) < TOL
    leaves = [q, k, v, lr, *parts.parameters()] + ([theta] if momentum else [])
    for got, want in zip(gradients(o, leaves), gradients(ref, leaves)):
        assert rms_ratio(got, want) < TOL
    for name, w in state.weights.items():      # after 3 whole chunks every row is back at its initial norm
        assert torch.allclose(w.norm(dim=-1), w0[name].norm(dim=-1), rtol=1e-12, atol=0)


def test_chunk_mean_momentum_puts_the_mean_on_each_chunks_first_token():
    theta = torch.tensor([0.2, 0.4, 0.6, 0.8, 0.1, 0.3, 0.5], dtype=torch.float64)[None, :, None]
    got = chunk_mean_momentum(theta, 3)[0, :, 0]
    assert torch.allclose(got, torch.tensor([0.4, 1, 1, 0.4, 1, 1, 0.5], dtype=torch.float64))
    # the scan it feeds: Π θ = the chunk mean and every token of the chunk kept at weight 1
    one_chunk = chunk_mean_momentum(theta[:, :3], 3)
    assert torch.isclose(one_chunk.prod(), theta[:, :3].mean())


# ---------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------
def lact_layer(mode="chunked", **extra):
    cfg = resolve_part("mixer", {"name": "lact", "num_heads": 4, "ttt_heads": 2, "window": 5, "mode": mode,
                                 "memory": dict(LACT_MEMORY_SPEC, chunk_size=4), **extra})
    torch.manual_seed(0)
    layer = LaCTLayer(cfg, 16).double()
    with torch.no_grad():
        for n, p in layer.named_parameters():   # move the norms, affines and initial weights off their defaults
            if n.startswith(("qk_scale", "out_norm", "q_norm", "k_norm")):
                p.add_(0.3 * torch.randn_like(p))
            elif n.startswith(("qk_offset", "parts.memory.init_")):
                p.copy_(0.5 * torch.randn_like(p))
    return layer


@pytest.mark.parametrize("mode", MODES)
def test_layer_is_swa_plus_the_lact_branch(mode):
    """The layer equals the direct implementation (shared q, k, v; SWA; scale/offset, SiLU, ℓ2, RoPE; the chunk
    update; per-head RMSNorm ⊙ silu scale; sum; W_O): outputs and the gradients of the input and every parameter."""
    layer = lact_layer(mode, qk_norm=True)
    x = torch.randn(2, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, ref = layer(x), layer_direct(layer, x)
    assert rms_ratio(y, ref) < TOL
    leaves = [x, *layer.parameters()]
    for got, want in zip(gradients(y, leaves), gradients(ref, leaves)):
        assert rms_ratio(got, want) < TOL


def test_layer_branches_both_matter_and_the_memory_learns_across_chunks():
    """The fast-weight read of chunk 1 depends on chunk 0's keys and values (the update), not on its queries."""
    layer = lact_layer()
    x = torch.randn(1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fq, fk, fv = layer.fast_qkv(*(layer.qkv(x).chunk(3, -1)))
    gates = layer.gates(x)
    o, _ = memorize(fq, fk, fv, layer.parts, gates)
    fk2, fv2 = fk.clone(), fv.clone()
    fk2[:, :4] = torch.randn_like(fk2[:, :4])
    fv2[:, :4] = torch.randn_like(fv2[:, :4])
    o2, _ = memorize(fq, fk2, fv2, layer.parts, gates)
    assert torch.equal(o[:, :4], o2[:, :4])              # chunk 0 reads the initial weights (apply, then update)
    assert not torch.allclose(o[:, 4:], o2[:, 4:])       # chunk 1 reads what chunk 0 wrote


def test_state_size_counts_fast_weights_momentum_and_the_window_cache():
    layer = lact_layer()
    fast = 2 * 3 * 8 * 8                                # 2 heads × (W1, W2, W3) of 8 × 8
    assert layer.state_size() == 2 * fast + 5 * 2 * 16   # + momentum; SWA keeps window × (k, v) × d_model
    assert layer.state_size_per_token() == 0


# ---------------------------------------------------------------------------------------------------
# decoding: chained calls equal one forward
# ---------------------------------------------------------------------------------------------------
#: splits of T = 13 tokens (chunk 4: chunks 0–3, 4–7, 8–11 and a partial 12; window 3): mid-chunk prefills that
#: complete one or two chunks at once, single steps across every chunk and window boundary, chunk-aligned pieces
SPLITS = {"3+6+steps": (3, 6, 1, 1, 1, 1), "steps": (1,) * 13, "5+8": (5, 8), "aligned": (4, 4, 4, 1),
          "2+7+4": (2, 7, 4), "whole": (13,)}
#: chunk-mean θ (the preset's), on the recurrent engine, a constant θ, per-token gates (Muon's Newton–Schulz per
#: token: memorize continues mid-chunk itself) with each read: the two decoding paths and the layer's switches
DECODE_VARIANTS = {
    "preset": {},
    "recurrent": {"mode": "recurrent"},
    "qk_norm_no_rope": {"qk_norm": True, "rope": False, "ttt_rope": False, "output_scale": False},
    "constant_momentum": {"momentum_gate": False},
    "ns_token_read_chunk": {"memory": dict(LACT_MEMORY_SPEC, chunk_size=4, inner_optimizer=dict(
        LACT_MEMORY_SPEC["inner_optimizer"], ns_granularity="token"))},
    "ns_token_read_token": {"memory": dict(LACT_MEMORY_SPEC, chunk_size=4, read="token", inner_optimizer=dict(
        LACT_MEMORY_SPEC["inner_optimizer"], ns_granularity="token"))},
}


def decode_in_pieces(layer, x, sizes):
    """Chained :func:`decode_mixer` calls over pieces of ``x`` of the given sizes → (outputs, final state)."""
    state, outs, t = None, [], 0
    for n in sizes:
        y, state = decode_mixer(layer, x[:, t:t + n], state)
        outs.append(y)
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_decoding_equals_the_forward_at_any_split(variant, split, one_thread):
    """Prefills and steps that stop mid-chunk equal one forward, float64: each chunk is written once it is whole,
    with its true mean θ, and every query of a chunk reads the chunk-start weights."""
    layer = lact_layer(window=3, **DECODE_VARIANTS[variant])
    x = torch.randn(2, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = layer(x)
        got, state = decode_in_pieces(layer, x, SPLITS[split])
    assert rms_ratio(got, full) < TOL
    assert state.length == 13 and state.kv.k.shape[2] == 2            # the SWA keeps window − 1 tokens
    if layer.chunk_momentum:                                           # three whole chunks written, token 12 waits
        assert state.memory.position == 12 and state.pending["k"].shape[1] == 1
    else:
        assert state.memory.position == 13 and state.pending is None


def test_decoding_gradients_equal_the_forwards(one_thread):
    """Chained calls keep the graph: gradients of the input and every parameter equal the forward's, float64."""
    layer = lact_layer(window=3)
    x = torch.randn(1, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    leaves = [x, *layer.parameters()]
    got, _ = decode_in_pieces(layer, x, SPLITS["3+6+steps"])
    for g, want in zip(gradients(got, leaves), gradients(layer(x), leaves)):
        assert rms_ratio(g, want) < TOL


def test_a_partial_chunk_does_not_change_the_forward(one_thread):
    """Every prefix's forward equals the prefix of the full forward: a last partial chunk (whose mean θ averages only
    its own tokens) is never written, so its tokens read what they read in the longer sequence."""
    layer = lact_layer(window=3)
    x = torch.randn(1, 13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = layer(x)
        for t in range(1, 13):
            assert rms_ratio(layer(x[:, :t]), full[:, :t]) < TOL, t


def test_decoding_refuses_a_foreign_state():
    layer = lact_layer()
    x = torch.randn(1, 2, 16, dtype=torch.float64)
    _, state = decode_mixer(layer, x)
    assert isinstance(state, LaCTState)
    with pytest.raises(TypeError, match="lact decoder: state must be None .* or the LaCTState"):
        decode_mixer(layer, x, state.memory)


def test_packed_sequences_are_refused_by_name():
    """The layer takes no packed batches: the model says so, naming the mixer, before anything runs."""
    model = build_model(load_preset("lact", ["d_model=16", "vocab_size=32", "mixers.lact.window=3"]))
    with pytest.raises(ValueError, match=r"mixers\.lact: 'lact' does not take packed sequences"):
        model(torch.zeros(1, 6, dtype=torch.long), cu_seqlens=[0, 2, 6])


@pytest.mark.parametrize("override, path", [
    ("mixers.lact.mode=fast", "mixers.lact.mode"),
    ("mixers.lact.memory.retention.axis=rows", "mixers.lact.memory.retention.axis"),
    ("mixers.lact.memory.inner_optimizer.ns_coefficients=lakt", "mixers.lact.memory.inner_optimizer.ns_coefficients"),
    ("mixers.lact.memory.inner_optimizer.ns_steps=3", "mixers.lact.memory.inner_optimizer.ns_steps"),
    ("mixers.lact.memory.read=token", "mixers.lact.memory.inner_optimizer.ns_granularity"),
    ("mixers.lact.memory.memory={name: linear}", "mixers.lact.memory.retention.name"),
    ("mixers.lact.memory.memory.init=zeros", "mixers.lact.memory.retention.name"),
])
def test_bad_configs_name_the_dotted_path(override, path):
    with pytest.raises(ConfigError) as err:
        load_preset("lact", [override])
    assert err.value.path == path


@pytest.mark.parametrize("overrides, why", [
    (["mixers.lact.ttt_heads=3"], "not divisible by ttt_heads"),
    (["mixers.lact.ttt_heads=8"], "whole attention heads"),
])
def test_head_layouts_are_checked_when_built(overrides, why):
    with pytest.raises(ConfigError) as err:
        build_model(load_preset("lact", overrides))
    assert err.value.path == "mixers.lact.ttt_heads" and why in str(err.value)


def test_default_config_is_the_papers_composition():
    cfg = LaCTConfig(name="lact")
    cfg.check()
    spec = cfg.memory_spec()
    assert (spec.memory.name, spec.attentional_bias.name, spec.retention.name, spec.inner_optimizer.name) == \
        ("gated_mlp", "dot", "weight_norm", "muon")
    assert spec.read == "chunk" and spec.inner_optimizer.ns_granularity == "chunk" and spec.chunk_size == 2048
    preset = load_preset("lact").mixers.lact
    assert preset.memory.chunk_size == preset.window == 256          # chunk paired with the SWA window


# ---------------------------------------------------------------------------------------------------
# it learns
# ---------------------------------------------------------------------------------------------------
TASK = {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 128}


def train_tiny(overrides, threshold=None, steps=400):
    """The lact preset at d_model 32 on the learning guard's tiny MQAR (seed 0); returns the best val accuracy."""
    from atlaslab.train.loop import train
    torch.manual_seed(0)
    model = build_model(load_preset("lact", ["vocab_size=32", "d_model=32", *overrides]))
    cfg = {"steps": steps, "batch_size": 32, "lr": 1e-2, "schedule": "constant", "warmup_steps": 10,
           "weight_decay": 0.0, "eval_interval": 25, "early_stop_threshold": threshold or 2.0, "final_eval": False,
           "progress": "never"}
    result = train(model, TASK, cfg)
    return result.best["value"]


@pytest.mark.slow
def test_preset_learns_tiny_mqar(one_thread):
    """Chunks of 8 and a window of 8. Measured: 0.93 validation accuracy by step 350 (seed 0)."""
    assert train_tiny(["mixers.lact.memory.chunk_size=8", "mixers.lact.window=8"], threshold=0.85) >= 0.85


@pytest.mark.slow
def test_fast_weight_updates_carry_the_recall(one_thread):
    """2 layers, chunks of 4, a window of 2 (the window misses most pairs). Measured over 400 steps: 0.53 with the
    updates, 0.21 with them off (η = 0: every chunk reads the initial fast weights)."""
    small = ["num_layers=2", "mixers.lact.memory.chunk_size=4", "mixers.lact.window=2"]
    on = train_tiny(small)
    off = train_tiny(small + ["mixers.lact.memory.inner_optimizer.lr=0.0"])
    assert on > off + 0.15, (on, off)
