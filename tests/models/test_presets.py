"""Presets: every named model loads, builds, trains one step; the loader's overrides and errors.

The model-level contracts are checked on every preset at tiny size (d_model 16, 2 heads, 1 layer, T = 8):
batch elements never mix, finite forward/backward, one AdamW step lowers the loss on a fixed batch, gradients reach every write-side
parameter of every memory (k/v projections and convs, gate networks, the learned initial memory), and batch
elements never mix.
"""
import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from atlaslab.models.blocks import _Block
from atlaslab.models.layers import MemoryLayer
from atlaslab.models.presets import (apply_overrides, build_model, list_presets, load_preset, preset_path,
                                     tiny_overrides)
from atlaslab.registry import ConfigError

EXPECTED = {
    "atlas", "atlas_pp", "atlas_mag", "atlas_mal", "omeganet", "dla", "swdt", "deeptransformer", "dot", "titans",
    "titans_mac", "titans_mag", "titans_mal", "moneta", "yaad", "memora", "ttt_linear", "ttt_mlp", "deltanet",
    "gated_deltanet", "longhorn", "linear_attention", "retnet", "mamba2", "gla", "swa", "transformer",
}
PRESETS = list_presets()
B, T, V = 2, 8, 32


def tiny_model(name, *extra, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = load_preset(name, tiny_overrides(name, vocab_size=V, num_layers=1) + list(extra))
    return build_model(cfg).to(dtype)


def memory_layers(model):
    for mixer in model.mixers():
        if isinstance(mixer, MemoryLayer):
            yield mixer
        elif isinstance(mixer, _Block):
            yield mixer.memory


def write_side_parameters(layer):
    """Parameters through which the memory is written: k/v projections and convs, gates, initial memory."""
    out = {}
    for n, p in layer.named_parameters():
        if n.startswith(("k_proj", "v_proj", "k_conv", "v_conv", "gate_nets")) or n.startswith("parts.memory.init_"):
            out[n] = p
    return out


def test_every_model_of_the_issue_has_a_preset():
    assert EXPECTED <= set(PRESETS), sorted(EXPECTED - set(PRESETS))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_file_is_documented(name):
    text = preset_path(name).read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header and any(re.search(r"docs/\S+\.md|Eq\.\s?\d|§\s?\d", line) for line in header), \
        "the header must point into docs/ or cite the paper (an equation or section)"
    cfg = OmegaConf.load(preset_path(name))
    assert cfg.name == name and cfg.description


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains(name):
    model = tiny_model(name)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T + 1), generator=gen)

    # batch elements never mix: changing sequence 1 leaves sequence 0's logits unchanged
    other = ids.clone()
    other[1] = torch.randint(0, V, (T + 1,), generator=gen)
    with torch.no_grad():
        a, b = model(ids), model(other)
    assert torch.allclose(a[0], b[0], atol=1e-12, rtol=0)
    assert not torch.allclose(a[1], b[1])

    loss = model.loss(ids)
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(V)) < 0.5   # near-uniform predictions at init
    loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), n

    # gradients reach every write-side parameter of every memory
    for layer in memory_layers(model):
        params = write_side_parameters(layer)
        assert any(n.startswith("k_proj") for n in params) and any(n.startswith("v_proj") for n in params)
        assert any(n.startswith("gate_nets") for n in params) or not layer.gate_nets
        for n, p in params.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {n}"

    # one AdamW step lowers the loss on the same batch
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    opt.step()
    with torch.no_grad():
        after = model.loss(ids)
    assert torch.isfinite(after) and after < loss, (loss.item(), after.item())


# ---------------------------------------------------------------------------------------------------
# the taxonomy decisions (docs/concepts/memory.md#reductions) are what the files say
# ---------------------------------------------------------------------------------------------------
def _spec(name):
    cfg = load_preset(name)
    (mixer,) = cfg.mixers.values()
    return mixer, mixer.get("memory")


def test_taxonomy_decisions():
    _, gdn = _spec("gated_deltanet")
    assert (gdn.memory.name, gdn.attentional_bias.name, gdn.retention.name, gdn.retention.placement,
            gdn.inner_optimizer.name, gdn.chunk_size) == ("linear", "l2", "decay", "before_step", "gd", 1)
    _, tit = _spec("titans")
    assert (tit.memory.name, tit.attentional_bias.name, tit.retention.placement, tit.inner_optimizer.name,
            tit.chunk_size) == ("mlp_ln", "l2", "after_step", "momentum", 16)
    _, atl = _spec("atlas")
    assert (atl.memory.name, atl.memory.residual, atl.feature_map.name, atl.feature_map.degree,
            atl.inner_optimizer.name, atl.retention.name) == ("mlp", False, "polynomial", 2, "muon", "decay")
    assert atl.window.size > 1
    _, dt = _spec("deeptransformer")
    assert (dt.memory.name, dt.feature_map.name, dt.attentional_bias.name) == ("mlp", "exp", "dot")
    assert _spec("transformer")[0].name == "attention" and _spec("swa")[0].name == "swa"
    _, gla = _spec("gla")
    assert gla.retention.channel_wise and gla.attentional_bias.name == "dot"
    _, lh = _spec("longhorn")
    assert lh.inner_optimizer.name == "implicit_gd"
    for hybrid, block in (("titans_mac", "mac"), ("titans_mag", "mag"), ("titans_mal", "mal"),
                          ("atlas_mag", "mag"), ("atlas_mal", "mal")):
        assert _spec(hybrid)[0].name == block


# ---------------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------------
def test_dotlist_and_dict_overrides():
    cfg = load_preset("titans", ["d_model=32", "mixers.titans.memory.chunk_size=4", "layers=[titans, titans]"])
    assert cfg.d_model == 32 and cfg.mixers.titans.memory.chunk_size == 4 and list(cfg.layers) == ["titans"] * 2
    cfg2 = load_preset("titans", {"d_model": 32, "mixers": {"titans": {"memory": {"chunk_size": 4}}}})
    assert cfg2.d_model == 32 and cfg2.mixers.titans.memory.chunk_size == 4
    assert cfg2.mixers.titans.memory.memory.depth == 2          # a dict merges, it does not replace


def test_wildcard_overrides_match_every_key_that_has_the_path():
    """``mixers.*.x`` on a preset (``atlaslab train``/``show``, not only sweeps) sets x in every mixer that has
    it, defaults included (``layer_norm`` is not in the omeganet file); a wildcard that matches nothing is an
    error naming the key."""
    cfg = load_preset("titans_mag", ["mixers.*.num_heads=2", "mixers.*.memory.memory.layer_norm=false"])
    assert cfg.mixers.titans_mag.num_heads == 2 and cfg.mixers.titans_mag.memory.memory.layer_norm is False
    cfg = load_preset("omeganet", {"mixers.*.memory.memory.layer_norm": False, "mixers.omega*.num_heads": 8})
    assert cfg.mixers.omeganet.memory.memory.layer_norm is False and cfg.mixers.omeganet.num_heads == 8
    cfg = load_preset("atlas", ["mixers.*.memory.inner_optimizer.ns_granularity=chunk",   # valid only with the next
                                "mixers.*.memory.read=chunk"])
    assert cfg.mixers.atlas.memory.read == "chunk"
    with pytest.raises(ConfigError) as info:
        load_preset("transformer", ["mixers.*.memory.chunk_size=4"])
    assert info.value.path == "mixers.*.memory.chunk_size" and "matches no key" in str(info.value)


def test_changing_a_part_name_drops_its_fields():
    cfg = load_preset("atlas", ["mixers.atlas.memory.memory.name=linear", "mixers.atlas.memory.inner_optimizer.name=gd"])
    assert dict(cfg.mixers.atlas.memory.memory) == {"name": "linear"}
    assert set(cfg.mixers.atlas.memory.inner_optimizer) == {"name", "lr"}      # momentum/ns_steps dropped
    cfg = load_preset("titans", ["mixers.titans.memory.memory={name: linear, init: zeros}"])
    assert dict(cfg.mixers.titans.memory.memory) == {"name": "linear", "init": "zeros"}
    cfg = load_preset("titans", ["mixers.titans.name=mag", "mixers.titans.attention.window=8"])
    assert cfg.mixers.titans.name == "mag" and cfg.mixers.titans.attention.window == 8
    cfg = load_preset("transformer", ["mixers.transformer.name=swa"])
    assert build_model(cfg).mixers()[0].window == 64


def test_hybrid_layer_pattern():
    cfg = load_preset("atlas", tiny_overrides("atlas") + [
        "num_layers=3", "layers=[atlas, atlas, swa]", "mixers.swa={name: swa, num_heads: 2, window: 4}"])
    model = build_model(cfg)
    kinds = [type(m).__name__ for m in model.mixers()]
    assert kinds == ["MemoryLayer", "MemoryLayer", "SlidingWindowAttention"]
    assert model.state_size() == 2 * model.mixers()[0].state_size() + 4 * 2 * 16


@pytest.mark.parametrize("overrides, path", [
    (["mixers.atlas.memory.inner_optimizer.name=muom"], "mixers.atlas.memory.inner_optimizer.name"),
    (["mixers.atlas.memory.memory.residual=true"], "mixers.atlas.memory.memory.residual"),
    (["mixers.atlas.convv=false"], "mixers.atlas.convv"),
    (["mixers.atlas.gates.lr.learnd=false"], "mixers.atlas.gates.lr.learnd"),
    (["mixers.atlas.name=memroy"], "mixers.atlas.name"),
    (["mixers.atlas.mode=fast"], "mixers.atlas.mode"),
    (["layers=[atlas, nope]"], "layers.1"),
    (["d_modle=3"], "d_modle"),
    (["num_layers=0"], "num_layers"),
])
def test_validation_errors_name_the_dotted_path(overrides, path):
    with pytest.raises(ConfigError) as info:
        build_model(load_preset("atlas", overrides))
    assert info.value.path == path, str(info.value)


def test_unknown_preset_and_bad_override():
    with pytest.raises(ConfigError) as info:
        load_preset("atlaz")
    assert "atlas" in str(info.value)            # close-match suggestion
    with pytest.raises(ConfigError):
        load_preset("atlas", ["d_model"])


def test_apply_overrides_on_a_plain_config_and_build_by_name():
    cfg = OmegaConf.create({"d_model": 16, "vocab_size": 8, "layers": ["a"], "mixers": {"a": {"name": "swa"}}})
    apply_overrides(cfg, ["mixers.a.window=2", "mixers.a.num_heads=2"])
    model = build_model(cfg)
    assert model.mixers()[0].window == 2
    assert build_model("swa", ["d_model=16", "mixers.swa.num_heads=2"]).cfg.d_model == 16
