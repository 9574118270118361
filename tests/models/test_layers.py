"""Memory layer, attention mixers, blocks and the LM: reductions (float64), causality, chaining, gates, state."""
import math

import pytest
import torch

from atlaslab.models.attention import Attention
from atlaslab.models.blocks import LMMBlock, MACBlock, MAGBlock, MALBlock
from atlaslab.models.lm import LanguageModel
from atlaslab.models.presets import build_model, load_preset, tiny_overrides
from atlaslab.registry import ConfigError, resolve_part

D, H, B, T = 16, 2, 2, 10
DH = D // H
F64 = torch.float64

LINEAR_L2 = {"memory": {"name": "linear"}, "attentional_bias": "l2", "chunk_size": 1}
TITANS = {"memory": {"name": "mlp", "expansion": 2}, "inner_optimizer": {"name": "momentum", "lr": 0.1},
          "retention": "decay", "chunk_size": 4}


def make(kind, name, seed=0, **cfg):
    torch.manual_seed(seed)
    part = resolve_part(kind, {"name": name, **cfg})
    from atlaslab.registry import get_registry
    return get_registry(kind).get(name).cls(part, D).to(F64)


def x_batch(seed=1, t=T):
    return torch.randn(B, t, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


def copy_attention(dst: Attention, src: Attention):
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(dst, n).load_state_dict(getattr(src, n).state_dict())


# ---------------------------------------------------------------------------------------------------
# reductions (float64)
# ---------------------------------------------------------------------------------------------------
def test_deeptransformer_with_linear_memory_and_normaliser_is_the_transformer():
    """DeepTransformer(linear memory, φ* kernel trick, normalize) = softmax attention (ATLAS Eq.26)."""
    tiny = ["d_model=16", "vocab_size=32", "num_layers=2"]
    tr = build_model(load_preset("transformer", tiny + ["mixers.transformer.num_heads=2",
                                                        "mixers.transformer.rope=false"])).to(F64)
    p = "mixers.deeptransformer"
    dt = build_model(load_preset("deeptransformer", tiny + [
        f"{p}.num_heads=2", f"{p}.memory.memory={{name: linear, init: zeros}}", f"{p}.memory.feature_map.normalize=true",
        f"{p}.conv=false", f"{p}.silu=false", f"{p}.qk_norm=false", f"{p}.output_norm=false",
        f"{p}.output_gate=false"])).to(F64)
    assert dt.mixers()[0].parts.kernel_trick
    state = {k: v.clone() for k, v in tr.state_dict().items()}
    for k in state:
        if k.endswith("mixer.q_proj.weight"):
            state[k] = state[k] * DH ** -0.5       # the kernel is exp(qᵀk); SDPA scales by 1/√d
    missing, unexpected = dt.load_state_dict(state, strict=False)
    assert not unexpected and all("parts.memory.init_" in k for k in missing), (missing, unexpected)
    ids = torch.randint(0, 32, (B, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = tr(ids), dt(ids)
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_p", [0, 3])
def test_mac_with_one_segment_and_no_memory_is_causal_attention(n_p):
    mac = make("block", "mac", memory=TITANS, num_heads=H, segment=T, read_tokens=False, gate="none",
               persistent_tokens=n_p)
    attn = make("mixer", "attention", num_heads=H)
    copy_attention(attn, mac.attn)
    x = x_batch()
    with torch.no_grad():
        xt = torch.cat([mac.persistent.expand(B, -1, -1), x], 1) if n_p else x
        torch.testing.assert_close(mac(x), attn(xt)[:, n_p:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_p", [0, 2])
def test_mag_with_the_memory_branch_off_is_swa(n_p):
    mag = make("block", "mag", memory=TITANS, num_heads=H, gate="none", persistent_tokens=n_p,
               attention={"window": 3})
    swa = make("mixer", "swa", num_heads=H, window=3)
    copy_attention(swa, mag.swa)
    x = x_batch()
    with torch.no_grad():
        xt = torch.cat([mag.persistent.expand(B, -1, -1), x], 1) if n_p else x
        torch.testing.assert_close(mag(x), swa(xt, prefix=n_p)[:, n_p:], rtol=1e-12, atol=1e-12)
    # the persistent prefix stays visible beyond the window
    if n_p:
        mask = torch.ones(T + n_p, dtype=torch.bool)
        from atlaslab.models.attention import attention_mask
        m = attention_mask(T + n_p, 3, n_p)
        assert m[-1, :n_p].all() and not m[-1, n_p].item() and mask.any()


def test_swa_with_a_window_covering_the_sequence_is_causal_attention():
    swa = make("mixer", "swa", num_heads=H, window=T)
    attn = make("mixer", "attention", num_heads=H)
    copy_attention(attn, swa)
    x = x_batch()
    with torch.no_grad():
        torch.testing.assert_close(swa(x), attn(x), rtol=1e-12, atol=1e-12)
        short = make("mixer", "swa", num_heads=H, window=2)
        copy_attention(short, swa)
        assert not torch.allclose(short(x), attn(x))


def test_rope_is_relative():
    attn = make("mixer", "attention", num_heads=H)
    x = x_batch()
    with torch.no_grad():
        a = attn(x)
        b = attn(x, positions=torch.arange(T) + 7)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# causality and chaining
# ---------------------------------------------------------------------------------------------------
CAUSAL_CASES = [
    ("mixer", "memory", dict(memory=TITANS)),
    ("mixer", "memory", dict(memory={**LINEAR_L2, "window": {"size": 3}, "retention": "decay"})),
    ("mixer", "swa", dict(window=3)),
    ("mixer", "attention", {}),
    ("block", "lmm", dict(memory=TITANS, persistent_tokens=2)),
    ("block", "mag", dict(memory=TITANS, persistent_tokens=2, attention={"window": 3})),
    ("block", "mal", dict(memory=TITANS, persistent_tokens=2, attention={"window": 3})),
    ("block", "mac", dict(memory=TITANS, persistent_tokens=2, segment=4)),
    ("block", "mac", dict(memory=LINEAR_L2, segment=3, read_tokens=True, gate="none")),
    ("block", "mac", dict(memory=TITANS, persistent_tokens=2, segment=4, write="input")),
]


@pytest.mark.parametrize("kind, name, cfg", CAUSAL_CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_outputs_do_not_depend_on_future_tokens(kind, name, cfg):
    mixer = make(kind, name, num_heads=H, **cfg)
    x = x_batch()
    t0 = 5                                     # mid-segment for MAC (segments of 4 and 3)
    x2 = x.clone()
    x2[:, t0:] += torch.randn(B, T - t0, D, dtype=F64)
    with torch.no_grad():
        a, b = mixer(x), mixer(x2)
    torch.testing.assert_close(a[:, :t0], b[:, :t0], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, t0:], b[:, t0:])


@pytest.mark.parametrize("memory", [TITANS, {**LINEAR_L2, "window": {"size": 3}}], ids=["titans", "omega3"])
def test_memory_layer_chained_calls_equal_one_call(memory):
    layer = make("mixer", "memory", num_heads=H, memory=memory)
    x = x_batch(t=12)
    with torch.no_grad():
        full = layer(x)
        y1, s = layer(x[:, :4], return_state=True)
        y2, s = layer(x[:, 4:9], state=s, return_state=True)
        y3 = layer(x[:, 9:], state=s)
    torch.testing.assert_close(torch.cat([y1, y2, y3], 1), full, rtol=1e-10, atol=1e-10)


def test_mac_reads_the_memory_written_by_earlier_segments():
    mac = make("block", "mac", memory=TITANS, num_heads=H, segment=4)
    x = x_batch(t=8)
    x2 = x.clone()
    x2[:, :4] += 1.0
    with torch.no_grad():
        a, b = mac(x), mac(x2)
    assert not torch.allclose(a[:, 4:], b[:, 4:])   # the second segment sees the first through memory


@pytest.mark.parametrize("write", ["output", "input"])
def test_mac_writes_the_memory_with_what_its_write_option_names(write):
    """One segment, no reads: o = RMSNorm(y) ⊙ σ(RMSNorm(M*(z))) with z = y (Titans Eq.24-25) or z = x (input)."""
    mac = make("block", "mac", memory=TITANS, num_heads=H, segment=T, read_tokens=False, write=write)
    x = x_batch()
    with torch.no_grad():
        y = mac.attn(x, mask=mac.segment_mask(T))
        m = mac.memory(x if write == "input" else y)
        torch.testing.assert_close(mac(x), mac.norm_y(y) * torch.sigmoid(mac.norm_m(m)), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# gates and backbone switches
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory, gates", [
    (LINEAR_L2, {"lr"}),
    ({**LINEAR_L2, "retention": "decay"}, {"lr", "retention"}),
    (TITANS, {"lr", "retention", "momentum"}),
    ({**TITANS, "window": {"size": 3}}, {"lr", "retention", "momentum", "window"}),
    ({"memory": "mlp_ln", "attentional_bias": "huber"}, {"lr", "delta"}),
    ({"memory": "linear", "inner_optimizer": {"name": "muon"}, "retention": "kl"}, {"lr", "retention", "momentum"}),
])
def test_only_the_gates_the_spec_uses_are_built(memory, gates):
    layer = make("mixer", "memory", num_heads=H, memory=memory)
    assert set(layer.gate_nets) == gates
    g = layer.gates(x_batch())
    assert set(g) == gates and all(v.shape == (B, T, H) for v in g.values())
    assert ((g["lr"] > 0) & (g["lr"] < 1)).all()
    if "retention" in g:
        assert (g["retention"] > 0.9).float().mean() > 0.9      # α starts near 1 (bias +4)


def test_channel_wise_input_independent_and_constant_gates():
    gla = make("mixer", "memory", num_heads=H,
               memory={"memory": "linear", "attentional_bias": "dot", "retention": {"name": "decay", "channel_wise": True}})
    assert gla.gates(x_batch())["retention"].shape == (B, T, H, DH)
    retnet = make("mixer", "memory", num_heads=H, memory={"memory": "linear", "attentional_bias": "dot", "retention": "decay"},
                  gates={"lr": {"learned": False}, "retention": {"input_dependent": False}})
    g = retnet.gates(x_batch())
    assert set(g) == {"retention"} and torch.allclose(g["retention"], g["retention"][:1, :1].expand_as(g["retention"]))
    const = make("mixer", "memory", num_heads=H, memory={**LINEAR_L2, "retention": "decay"},
                 gates={"retention": {"learned": False, "value": 0.5}, "lr": {"bias": -2.0}})
    g = const.gates(x_batch())
    assert torch.all(g["retention"] == 0.5) and "retention" not in const.gate_nets
    assert torch.allclose(const.gate_nets["lr"].proj.bias, torch.full((H,), -2.0, dtype=F64))


@pytest.mark.parametrize("switches", [{}, {"conv": False}, {"silu": False, "qk_norm": False},
                                      {"head_dim": 4}])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_branches_equal_the_three_branches(switches, packed):
    """q, k, v computed side by side on stacked channels (``_branches``) equal ``_branch`` of each: outputs, new conv
    caches and gradients of x, the caches and every parameter (float64), from given caches and packed."""
    layer = make("mixer", "memory", num_heads=H, memory=LINEAR_L2, **switches)
    x = x_batch().requires_grad_()
    offsets = None
    if packed:
        x, offsets = x_batch(t=2 * T)[:1].requires_grad_(), [0, 7, 2 * T]
    rows = 2 if packed else B
    widths = {n: getattr(layer, f"{n}_proj").out_features for n in "qkv"}
    caches = {n: torch.randn(rows, 3, w, dtype=F64, generator=torch.Generator().manual_seed(i), requires_grad=True)
              for i, (n, w) in enumerate(widths.items())} if layer.cfg.conv else {}
    q, k, v, new = layer._branches(x, caches, offsets)
    ref = [layer._branch(x, n, caches.get(n), offsets) for n in "qkv"]
    for got, (want, want_cache), n in zip((q, k, v), ref, "qkv"):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert (n not in new) == (want_cache is None)
        if want_cache is not None:
            torch.testing.assert_close(new[n], want_cache, rtol=1e-12, atol=1e-14)
    leaves = [x, *caches.values(), *layer.parameters()]
    outs = [q, k, v, *new.values()]
    weights = [torch.randn(o.shape, dtype=F64, generator=torch.Generator().manual_seed(10 + i)) for i, o in enumerate(outs)]

    def grads(tensors):
        return torch.autograd.grad(sum((t * w).sum() for t, w in zip(tensors, weights)), leaves, allow_unused=True)
    ref_outs = [r[0] for r in ref] + [r[1] for r in ref if r[1] is not None]
    for g, g_ref in zip(grads(outs), grads(ref_outs)):
        assert (g is None) == (g_ref is None)
        if g is not None:
            torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("memory,gates", [
    (TITANS, {}),
    ({**TITANS, "attentional_bias": "huber", "window": {"name": "omega", "size": 3}},
     {"lr": {"use_bias": False, "weight_init": "uniform"}, "momentum": {"input_dependent": False}}),
    ({"memory": "linear", "attentional_bias": "dot", "retention": {"name": "decay", "channel_wise": True}},
     {"retention": {"form": "log_decay"}}),
    ({"memory": "linear", "attentional_bias": "l2", "retention": {"name": "decay", "channel_wise": True}}, {}),
])
def test_fused_gates_equal_each_gate_net(memory, gates):
    """The input-dependent gates computed in one projection equal each gate net on its own (float64): values and
    gradients of x and every parameter; sigmoid and softplus (Huber δ) gates, channel-wise α, a gate without bias,
    and the gates that are not fused (log-decay, input-independent) beside them."""
    layer = make("mixer", "memory", num_heads=H, memory=memory, gates=gates)
    x = x_batch().requires_grad_()
    got = layer.gates(x)
    want = {n: net(x) for n, net in layer.gate_nets.items()}
    assert list(got) == list(want)
    leaves = [x, *layer.gate_nets.parameters()]
    w = {n: torch.randn(g.shape, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, (n, g) in enumerate(want.items())}
    g_got = torch.autograd.grad(sum((got[n] * w[n]).sum() for n in w), leaves)
    g_want = torch.autograd.grad(sum((want[n] * w[n]).sum() for n in w), leaves)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_every_backbone_piece_switches_off():
    bare = make("mixer", "memory", num_heads=H, memory=LINEAR_L2, conv=False, silu=False, qk_norm=False,
                output_norm=False, output_gate=False, gates={"lr": {"learned": False}})
    names = {n.split(".")[0] for n, _ in bare.named_parameters()}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "parts"}
    # with every piece off and η = 1 the layer is the plain delta rule on raw projections
    x = x_batch()
    with torch.no_grad():
        q, k, v = (getattr(bare, f"{n}_proj")(x).view(B, T, H, DH) for n in "qkv")
        W = bare.parts.memory.init_W.expand(B, H, DH, DH).clone()
        outs = []
        for t in range(T):
            kt, vt = k[:, t], v[:, t]
            W = W - torch.einsum("bhv,bhk->bhvk", torch.einsum("bhvk,bhk->bhv", W, kt) - vt, kt)
            outs.append(torch.einsum("bhvk,bhk->bhv", W, q[:, t]))
        ref = bare.o_proj(torch.stack(outs, 1).reshape(B, T, D))
        torch.testing.assert_close(bare(x), ref, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# state size and the LM
# ---------------------------------------------------------------------------------------------------
def test_state_sizes():
    lin = make("mixer", "memory", num_heads=H, memory=LINEAR_L2)
    assert lin.state_size() == H * DH * DH + 3 * H * 3 * DH           # fast weights + conv caches (K−1 = 3)
    mom = make("mixer", "memory", num_heads=H, conv=False,
               memory={**LINEAR_L2, "inner_optimizer": "momentum", "window": {"size": 3}})
    assert mom.state_size() == 2 * H * DH * DH + 2 * H * (2 * DH + 1)  # + momentum, + last c−1 (k, v, γ)
    assert make("mixer", "swa", num_heads=H, window=5).state_size(1000) == 5 * 2 * D
    attn = make("mixer", "attention", num_heads=H)
    assert attn.state_size() == 0 and attn.state_size_per_token() == 2 * D and attn.state_size(7) == 14 * D


def test_language_model_accounting():
    cfg = load_preset("titans", tiny_overrides("titans") + ["mlp_hidden=24", "tie_embeddings=true"])
    model = build_model(cfg)
    assert isinstance(model, LanguageModel) and len(model.layers) == 2
    n = sum(p.numel() for p in model.parameters())                   # tied: the embedding appears once
    assert model.num_parameters() == n
    assert model.num_parameters(exclude_embeddings=True) == n - 32 * 16
    assert model.layers[0].mlp.w1.out_features == 24
    assert model.state_size() == sum(m.state_size() for m in model.mixers())
    untied = build_model(load_preset("titans", tiny_overrides("titans") + ["mlp=false"]))   # untied: the default
    assert untied.head is not None and untied.layers[0].mlp is None
    logits = untied(torch.randint(0, 32, (B, 5)))
    assert logits.shape == (B, 5, 32)


@pytest.mark.parametrize("cls", [LMMBlock, MAGBlock, MALBlock, MACBlock])
def test_blocks_shapes_and_persistent_gradients(cls):
    name = {LMMBlock: "lmm", MAGBlock: "mag", MALBlock: "mal", MACBlock: "mac"}[cls]
    block = make("block", name, memory=TITANS, num_heads=H, persistent_tokens=2, segment=4,
                 attention={"window": 3}) if name == "mac" else \
        make("block", name, memory=TITANS, num_heads=H, persistent_tokens=2, attention={"window": 3})
    assert isinstance(block, cls)
    y = block(x_batch())
    assert y.shape == (B, T, D) and torch.isfinite(y).all()
    y.square().mean().backward()
    assert block.persistent.grad is not None and block.persistent.grad.abs().sum() > 0
    assert math.isfinite(block.state_size()) and block.state_size() > 0


def test_embedding_and_head_defaults_give_unit_scale_tokens_and_moderate_logits():
    """The defaults that let a pre-norm LM learn recall (lm module doc): unit-scale embeddings, untied head."""
    torch.manual_seed(0)
    model = build_model(load_preset("transformer", ["vocab_size=128"]))
    assert model.head is not None and model.logit_scale == 1.0
    assert 0.9 < model.embed.weight.std().item() < 1.1
    logits = model(torch.randint(0, 128, (4, 32)))
    assert 0.3 < logits.std().item() < 1.0
    tied = build_model(load_preset("transformer", ["vocab_size=128", "tie_embeddings=true"]))
    assert tied.head is None and tied.logit_scale == pytest.approx(64 ** -0.5)
    assert 0.5 < tied(torch.randint(0, 128, (4, 32))).std().item() < 2.0    # rescaled, not std 8
    with pytest.raises(ConfigError, match="init_std"):
        build_model(load_preset("transformer", ["init_std=0"]))


def test_log_decay_gate_spreads_the_heads_forgetting_rates():
    """form: log_decay is fla's / Mamba2's α = exp(−A·softplus(w·x + b)), A ~ U(0, 16), dt ~ logU[1e-3, 0.1]."""
    torch.manual_seed(0)
    heads = 8
    layer = resolve_part("mixer", {"name": "memory", "num_heads": heads, "memory": {**LINEAR_L2, "retention": "decay"},
                                   "gates": {"retention": {"form": "log_decay"}}})
    from atlaslab.models.layers import MemoryLayer
    net = MemoryLayer(layer, 32).gate_nets["retention"]
    a, dt = net.a_log.exp(), torch.nn.functional.softplus(net.dt_bias)
    assert ((a > 0) & (a <= 16)).all() and ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    alpha = net(torch.zeros(1, 3, 32))                              # x = 0: α = exp(−A·dt) per head
    assert alpha.shape == (1, 3, heads)
    torch.testing.assert_close(alpha[0, 0], torch.exp(-a * dt))
    assert alpha.max() - alpha.min() > 0.3                          # spread, where the sigmoid starts all at 0.98
    g = make("mixer", "memory", num_heads=H, memory={**LINEAR_L2, "retention": {"name": "decay", "channel_wise": True}},
             gates={"retention": {"form": "log_decay"}}).gates(x_batch())["retention"]
    assert g.shape == (B, T, H, DH) and ((g > 0) & (g < 1)).all()


@pytest.mark.parametrize("node, path", [
    ({"gates": {"retention": {"form": "tanh"}}}, "gates.retention.form"),
    ({"gates": {"lr": {"form": "log_decay"}}}, "gates.lr.form"),
    ({"gates": {"retention": {"form": "log_decay", "dt_range": [0.1, 0.01]}}}, "gates.retention.dt_range"),
    ({"output_gate_act": "relu"}, "output_gate_act"),
    ({"gates": {"lr": {"weight_init": "xavier"}}}, "gates.lr.weight_init"),
    ({"gates": {"lr": {"use_bias": False, "input_dependent": False}}}, "gates.lr.use_bias"),
    ({"output_norm_eps": -1e-6}, "output_norm_eps"),
    ({"output_norm_eps": 0.0}, "output_norm_eps"),
])
def test_gate_options_are_validated_with_their_path(node, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")) as err:
        resolve_part("mixer", {"name": "memory", "memory": {**LINEAR_L2, "retention": "decay"}, **node}, "mixers.m")
    assert "mixers.m" in str(err.value)


def test_gate_weight_init_and_bias_options():
    """weight_init: uniform is nn.Linear's U(±d^-1/2) (std (3d)^-1/2, against N(0, 1/d)); use_bias: false leaves no
    bias, so a zero input gives σ(0) = 1/2 exactly (fla's β = σ(b_proj x), b_proj a bias-free nn.Linear)."""
    from atlaslab.models.layers import MemoryLayer
    d = 256
    nets = {}
    for init in ("normal", "uniform"):
        torch.manual_seed(0)
        cfg = resolve_part("mixer", {"name": "memory", "num_heads": 8, "memory": LINEAR_L2,
                                     "gates": {"lr": {"weight_init": init, "use_bias": init == "normal"}}})
        nets[init] = MemoryLayer(cfg, d).gate_nets["lr"]
    w_n, w_u = nets["normal"].proj.weight, nets["uniform"].proj.weight
    assert abs(w_n.std().item() * d ** 0.5 - 1) < 0.05 and abs(w_u.std().item() * (3 * d) ** 0.5 - 1) < 0.05
    assert w_u.abs().max().item() <= d ** -0.5
    assert nets["normal"].proj.bias is not None and nets["uniform"].proj.bias is None
    torch.testing.assert_close(nets["uniform"](torch.zeros(1, 2, d)), torch.full((1, 2, 8), 0.5))


def test_output_norm_eps_damps_weak_reads():
    """RMSNorm(o) = o / sqrt(mean(o²) + ε): a read far above ε comes out at unit RMS whatever its size, one near ε
    stays small; the layer's ε is output_norm_eps."""
    from atlaslab.models.layers import MemoryLayer
    for eps in (1e-6, 1.6e-4):
        cfg = resolve_part("mixer", {"name": "memory", "num_heads": H, "memory": LINEAR_L2, "output_norm_eps": eps})
        norm = MemoryLayer(cfg, 32).out_norm
        assert norm.eps == eps
        D = 32 // H
        strong, weak = torch.full((1, 1, H, D), 1.0), torch.full((1, 1, H, D), 1e-2)
        torch.testing.assert_close(norm(strong), torch.ones_like(strong), rtol=1e-3, atol=0)
        assert torch.allclose(norm(weak).pow(2).mean().sqrt(), torch.tensor((1e-4 / (1e-4 + eps)) ** 0.5))


def test_swish_output_gate():
    x = x_batch()
    layer = make("mixer", "memory", num_heads=H, memory=LINEAR_L2, output_gate_act="swish")
    ref = make("mixer", "memory", num_heads=H, memory=LINEAR_L2)             # same seed → same weights
    o = torch.randn(B, T, H, DH, dtype=F64)
    g = layer.g_proj(x)
    expected = layer.o_proj((layer.out_norm(o).reshape(B, T, -1)) * torch.nn.functional.silu(g))
    torch.testing.assert_close(layer._output(o, x), expected)
    assert not torch.allclose(layer._output(o, x), ref._output(o, x))


def test_mlp_hidden_width_from_the_output_keeps_atlas_eq42_size():
    """φ_2 widens a 16-dim key to 153 features; ATLAS's hidden layer stays 4 × the head dim."""
    from atlaslab.memory.spec import MemoryParts, resolve_memory_spec
    spec = {"memory": {"name": "mlp", "residual": False}, "feature_map": {"name": "polynomial", "degree": 2}}
    wide = MemoryParts(resolve_memory_spec(spec), 1, 16, 16)
    spec["memory"]["hidden_from"] = "output"
    eq42 = MemoryParts(resolve_memory_spec(spec), 1, 16, 16)
    assert wide.memory.shapes()["W1"] == (612, 153) and eq42.memory.shapes()["W1"] == (64, 153)
    assert eq42.memory.shapes()["W2"] == (16, 64)
    with pytest.raises(ConfigError, match="hidden_from"):
        resolve_memory_spec({"memory": {"name": "mlp", "hidden_from": "middle"}})


def test_a_narrower_key_leaves_the_values_at_d_model_over_heads():
    """``head_dim`` sets what the feature map expands (keys and queries); the values keep d_model / heads unless
    ``value_dim`` says otherwise (the LM-scale geometry of docs/concepts/memory.md#lm-scale-geometry)."""
    layer = make("mixer", "memory", num_heads=H, head_dim=4, memory={"feature_map": {"name": "polynomial"}})
    assert (layer.head_dim, layer.value_dim) == (4, DH)
    assert layer.parts.memory.shapes()["W"] == (DH, math.comb(4 + 2, 2))        # φ_2 of a 4-dim key: 15 features
    assert layer.k_proj.out_features == H * 4 and layer.v_proj.out_features == layer.o_proj.in_features == D
    y = layer(x_batch())
    assert y.shape == (B, T, D) and torch.isfinite(y).all()
    assert make("mixer", "memory", num_heads=H, head_dim=4, value_dim=3).value_dim == 3
