"""fla-style layers: every mixer builds with hidden_size / num_heads / layer_idx, chained cached calls equal one call,
padded rows equal each row alone, and a user's own torch model with an atlaslab memory layer trains (float64)."""
import pytest
import torch

from atlaslab.hf.cache import StateCache
from atlaslab.hf.layers import MIXER_CLASSES, AtlaslabMixer, MemoryMixer
from atlaslab.registry import ConfigError

SMALL = {                       # tiny settings per mixer (the rest: the config's defaults)
    "memory": {}, "attention": {}, "swa": {"window": 4}, "forgetting_attention": {},
    "lact": {"window": 4, "memory": {"chunk_size": 4}}, "lmm": {}, "mag": {"attention": {"window": 4}},
    "mal": {"attention": {"window": 4}}, "mac": {"segment": 4}, "armt": {"segment": 4, "memory_tokens": 2},
}


def build(name, **kw):
    torch.manual_seed(0)
    return MIXER_CLASSES[name](hidden_size=16, num_heads=2, layer_idx=0, **SMALL[name], **kw).double().eval()


def test_every_registered_mixer_and_block_has_a_class():
    from atlaslab.registry import get_registry
    assert set(MIXER_CLASSES) == set(get_registry("mixer").names()) | set(get_registry("block").names())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_chained_cached_calls_equal_one_call(name, one_thread):
    layer = build(name)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    whole, none, cache = layer(x)
    assert none is None and cache is None
    a, _, cache = layer(x[:, :5], use_cache=True)
    b, _, cache = layer(x[:, 5:], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length(0) == 9
    torch.testing.assert_close(torch.cat([a, b], 1), whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["memory", "attention", "mac"])
def test_left_padding_never_reaches_the_state(name, one_thread):
    layer = build(name)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    x_pad = x.clone()
    x_pad[0, :3] = 1e3                                   # whatever the pads hold changes nothing
    o, _, _ = layer(x_pad, attention_mask=mask)
    torch.testing.assert_close(o[0, 3:], layer(x[:1, 3:])[0][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(o[1], layer(x[1:])[0][0], rtol=0, atol=1e-10)
    assert not o[0, :3].any()


def test_two_layers_share_one_cache_by_layer_idx(one_thread):
    torch.manual_seed(0)
    l0 = MemoryMixer(hidden_size=16, num_heads=2, layer_idx=0).double()
    l1 = AtlaslabMixer.from_preset("gated_deltanet", hidden_size=16, num_heads=2, layer_idx=1).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    whole = l1(l0(x)[0])[0]
    cache = StateCache()
    parts = []
    for piece in (x[:, :4], x[:, 4:]):
        h, _, cache = l0(piece, past_key_values=cache, use_cache=True)
        h, _, cache = l1(h, past_key_values=cache, use_cache=True)
        parts.append(h)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-10)
    assert set(cache.entries) == {0, 1}


def test_bad_fields_fail_with_the_field_and_choices():
    with pytest.raises(ConfigError, match="window"):
        MemoryMixer(hidden_size=16, num_heads=2, memory={"window": {"name": "nope"}})
    with pytest.raises(ConfigError, match="unknown mixer"):
        AtlaslabMixer(hidden_size=16, mixer="nope")


def test_the_docs_example_trains_a_users_model_with_an_atlaslab_memory_layer(one_thread):
    """docs/layer_example.py (included in docs/huggingface.md): the loss of copying the previous token falls."""
    import runpy
    from pathlib import Path
    example = runpy.run_path(str(Path(__file__).resolve().parents[2] / "docs" / "layer_example.py"))
    model, losses = example["train"](steps=40)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    ids = torch.randint(0, 16, (2, 10))
    with torch.no_grad():
        full, _ = model(ids)
        first, cache = model(ids[:, :6], use_cache=True)
        rest, _ = model(ids[:, 6:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)
