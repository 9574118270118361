"""Packed documents (``cu_seqlens``) through the layers and the LM: each document exactly as if it ran alone.

The short conv restarts at every document (and continues each from its own cache), the memory layer gives every
document its own memory, attention and SWA attend within a document with RoPE restarted, and the LM's logits on a
packed row equal each document's logits alone (float64): outputs, per-document states and parameter gradients.
"""
import pytest
import torch

from atlaslab.models.layers import ShortConv
from atlaslab.models.presets import build_model
from atlaslab.registry import get_registry, resolve_part

D, F64 = 16, torch.float64
LENS = [3, 1, 7, 5]
OFFSETS = [0, 3, 4, 11, 16]
GDN = {"name": "memory", "num_heads": 2, "memory": {"memory": {"name": "linear"}, "attentional_bias": "l2",
                                                    "retention": "decay"}}
ATLAS_LIKE = {"name": "memory", "num_heads": 2,
              "memory": {"memory": {"name": "linear"}, "attentional_bias": "l2", "window": {"size": 3},
                         "feature_map": {"name": "polynomial", "degree": 2}, "chunk_size": 4,
                         "inner_optimizer": {"name": "muon", "momentum": 0.9}}}


def _mixer(node, seed=0):
    torch.manual_seed(seed)
    return get_registry("mixer").get(node["name"]).cls(resolve_part("mixer", node), D).to(F64)


def _pieces(x, offsets=OFFSETS):
    return [x[:, s:e] for s, e in zip(offsets[:-1], offsets[1:])]


def _x(T=16, seed=1):
    return torch.randn(1, T, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("with_cache", [False, True])
def test_short_conv_restarts_at_every_sequence(with_cache):
    torch.manual_seed(0)
    conv = ShortConv(D, 4).to(F64)
    x = _x()
    caches = torch.randn(len(LENS), 3, D, dtype=F64) if with_cache else None
    y, new = conv(x, caches, cu_seqlens=OFFSETS)
    for i, xi in enumerate(_pieces(x)):
        yi, ci = conv(xi, caches[i:i + 1] if with_cache else None)
        s, e = OFFSETS[i], OFFSETS[i + 1]
        assert torch.allclose(y[:, s:e], yi, atol=1e-13)
        assert torch.allclose(new[i:i + 1], ci, atol=1e-13)      # a length-1 sequence keeps 2 cached inputs


@pytest.mark.parametrize("node", [GDN, ATLAS_LIKE, {"name": "attention", "num_heads": 2},
                                  {"name": "swa", "num_heads": 2, "window": 3}],
                         ids=["gdn", "atlas_like", "attention", "swa"])
def test_packed_mixer_equals_each_document_alone(node):
    mixer = _mixer(node)
    x = _x().requires_grad_(True)
    y = mixer(x, cu_seqlens=torch.tensor(OFFSETS))
    alone = torch.cat([mixer(xi) for xi in _pieces(x)], 1)
    assert torch.allclose(y, alone, atol=1e-12)
    w = torch.randn_like(y)
    g = torch.autograd.grad((y * w).sum(), [x] + list(mixer.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad((alone * w).sum(), [x] + list(mixer.parameters()), allow_unused=True)
    for a, b in zip(g, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, atol=1e-11)


def test_packed_memory_layer_states_continue_each_document():
    """Two packed calls (states carried per document) equal each document's two calls."""
    layer = _mixer(ATLAS_LIKE)
    first, second = [2, 5], [6, 3]
    x1, x2 = _x(7, seed=2), _x(9, seed=3)
    off1, off2 = [0, 2, 7], [0, 6, 9]
    _, states = layer(x1, cu_seqlens=off1, return_state=True)
    y, states2 = layer(x2, states, return_state=True, cu_seqlens=off2)
    for i in range(2):
        _, si = layer(_pieces(x1, off1)[i], return_state=True)
        yi, si2 = layer(_pieces(x2, off2)[i], si, return_state=True)
        assert torch.allclose(y[:, off2[i]:off2[i + 1]], yi, atol=1e-12)
        assert torch.allclose(states2[i].memory.weights["W"], si2.memory.weights["W"], atol=1e-12)
        assert states2[i].memory.position == first[i] + second[i]
        for n in ("q", "k", "v"):
            assert torch.allclose(states2[i].conv[n], si2.conv[n], atol=1e-13)


def test_packed_lm_logits_equal_each_document_alone():
    model = build_model({"vocab_size": 32, "d_model": D, "num_layers": 3, "layers": ["gdn", "attn", "swa"],
                         "mixers": {"gdn": GDN, "attn": {"name": "attention", "num_heads": 2},
                                    "swa": {"name": "swa", "num_heads": 2, "window": 4}}}).to(F64)
    ids = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids, cu_seqlens=OFFSETS)
    alone = torch.cat([model(p) for p in _pieces(ids)], 1)
    assert torch.allclose(logits, alone, atol=1e-11)
    targets = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(1))
    loss = model.loss(ids, targets, cu_seqlens=OFFSETS)
    assert loss.isfinite()
    with pytest.raises(ValueError, match="pass targets"):
        model.loss(ids, cu_seqlens=OFFSETS)


def test_a_block_refuses_packed_sequences_naming_the_mixer():
    model = build_model({"vocab_size": 32, "d_model": D, "num_layers": 2, "layers": ["gdn", "mag"],
                         "mixers": {"gdn": GDN, "mag": {"name": "mag", "num_heads": 2,
                                                        "memory": GDN["memory"]}}})
    ids = torch.randint(0, 32, (1, 16))
    with pytest.raises(ValueError, match=r"mixers\.mag: 'mag' does not take packed sequences"):
        model(ids, cu_seqlens=OFFSETS)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids.expand(2, -1), cu_seqlens=OFFSETS)


def test_packed_prefill_then_batched_decoding():
    """Prefill three prompts of different lengths in one packed call, stack their states, decode the three as a
    batch one token at a time: equals each sequence's own prefill and decoding."""
    layer = _mixer(GDN)
    off = [0, 4, 5, 11]
    x = _x(11, seed=4)
    steps = torch.randn(3, 3, D, generator=torch.Generator().manual_seed(5), dtype=F64)   # [N, 3 tokens, d]
    _, states = layer(x, cu_seqlens=off, return_state=True)
    batch = layer.stack_states(states)
    ys = []
    for t in range(3):
        y, batch = layer(steps[:, t:t + 1], batch, return_state=True)
        ys.append(y)
    y = torch.cat(ys, 1)                                                   # [N, 3, d]
    for i in range(3):
        _, si = layer(_pieces(x, off)[i], return_state=True)
        yi = layer(steps[i:i + 1], si)
        assert torch.allclose(y[i:i + 1], yi, atol=1e-12)


def test_states_that_cannot_stack_say_why():
    layer = _mixer(ATLAS_LIKE)                                            # b = 4, window c = 3
    x = _x(7, seed=2)
    _, states = layer(x, cu_seqlens=[0, 2, 7], return_state=True)        # positions 2 and 5: mod 4 differ
    with pytest.raises(ValueError, match="position mod b"):
        layer.stack_states(states)
    _, states = layer(x[:, :6], cu_seqlens=[0, 1, 6], return_state=True)  # positions 1, 5: window histories 1, 2
    with pytest.raises(ValueError, match="'hist_k' differs in shape"):
        layer.stack_states(states)
