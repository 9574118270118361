"""The Hugging Face causal LM: save/load round trips, padded generation against each row alone and the recurrent
decoder, and a state cache carried across forward calls (float64, tiny shapes)."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from atlaslab.hf.cache import StateCache  # noqa: E402
from atlaslab.hf.modeling import AtlaslabConfig, AtlaslabForCausalLM  # noqa: E402
from atlaslab.models.presets import list_presets, load_preset, resolve_model, tiny_overrides  # noqa: E402

VOCAB = 32


def tiny_config(name: str) -> AtlaslabConfig:
    if name == "hybrid":                               # a layer pattern: DeltaNet then sliding-window attention
        node = resolve_model(load_preset("deltanet", tiny_overrides("deltanet"))).to_dict()
        node["mixers"]["swa"] = {"name": "swa", "num_heads": 2, "window": 4}
        node["layers"], node["num_layers"] = ["deltanet", "swa"], 2
        return AtlaslabConfig(atlaslab=node)
    return AtlaslabConfig.from_preset(name, tiny_overrides(name))


def tiny_model(name: str, seed: int = 0) -> AtlaslabForCausalLM:
    torch.manual_seed(seed)
    return AtlaslabForCausalLM(tiny_config(name)).eval().double()


def left_padded(prompts):
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask


CORE = ["deltanet", "atlas", "transformer", "titans_mac", "fox", "lact", "armt"]


@pytest.mark.parametrize("name", [n if n in CORE else pytest.param(n, marks=pytest.mark.slow) for n in list_presets()])
def test_every_preset_saves_and_loads_in_safetensors(name, tmp_path, one_thread):
    torch.manual_seed(0)
    model = AtlaslabForCausalLM(tiny_config(name)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "atlaslab"
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is AtlaslabForCausalLM
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
        assert torch.equal(back(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


@pytest.mark.parametrize("name", ["deltanet", "atlas", "transformer", "hybrid", "titans_mag", "titans_mac"])
def test_padded_greedy_generate_equals_each_row_alone_and_the_decoder(name, one_thread):
    """Linear memory, deep memory, attention, a layer-pattern hybrid and two memory+attention blocks."""
    model = tiny_model(name)
    torch.manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (6, 3, 6, 1)]
    ids, mask = left_padded(prompts)
    n_new = 5
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
    assert out.shape == (4, ids.shape[1] + n_new)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        decoder = model.model.generate(p[None], n_new)          # atlaslab's own recurrent decoder
        assert out[i, ids.shape[1]:].tolist() == alone[0, len(p):].tolist() == decoder[0, len(p):].tolist()


@pytest.mark.parametrize("name", ["deltanet", "atlas", "transformer", "hybrid", "titans_mac"])
def test_padded_forward_logits_equal_each_row_alone(name, one_thread):
    model = tiny_model(name)
    torch.manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (7, 2, 5)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        for use_cache in (False, True):
            logits = model(ids, attention_mask=mask, use_cache=use_cache).logits
            for i, p in enumerate(prompts):
                alone = model(p[None], use_cache=False).logits[0]
                torch.testing.assert_close(logits[i, ids.shape[1] - len(p):], alone, rtol=0, atol=1e-12)
                assert not logits[i, :ids.shape[1] - len(p)].any()       # pads: zero logits


@pytest.mark.parametrize("name", ["deltanet", "atlas", "transformer", "hybrid", "titans_mac", "armt"])
def test_a_cache_carried_across_two_forward_calls_equals_one_call(name, one_thread):
    model = tiny_model(name)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        first = model(ids[:, :6], use_cache=True)
        assert isinstance(first.cache, StateCache) and first.cache.get_seq_length() == 6
        second = model(ids[:, 6:], past_key_values=first.cache)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, rtol=0, atol=1e-12)


def test_a_padded_first_call_then_a_continuation(one_thread):
    """The cache keeps each row's groups: a second call continues every row after its own real tokens."""
    model = tiny_model("deltanet")
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (5, 2)]
    ids, mask = left_padded(prompts)
    more = torch.randint(1, VOCAB, (2, 3))
    with torch.no_grad():
        first = model(ids, attention_mask=mask, use_cache=True)
        second = model(more, attention_mask=torch.ones(2, ids.shape[1] + 3, dtype=torch.long), cache=first.cache)
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, more[i]])[None], use_cache=False).logits[0, -3:]
            torch.testing.assert_close(second.logits[i], alone, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="after the first call"):
            model(more, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), cache=second.cache)


def test_training_forward_gives_the_loss_and_gradients(one_thread):
    model = tiny_model("gated_deltanet").train()
    ids = torch.randint(0, VOCAB, (2, 8))
    out = model(ids, labels=ids)
    assert out.cache is None
    logits = model.model(ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    out.loss.backward()
    assert model.model.embed.weight.grad is not None


def test_bad_inputs_fail_clearly():
    model = tiny_model("deltanet")
    with pytest.raises(ValueError, match="contiguous"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(TypeError, match="StateCache"):
        model(torch.ones(1, 4, dtype=torch.long), past_key_values=((torch.zeros(1),),))
    from atlaslab.registry import ConfigError
    with pytest.raises(ConfigError, match="d_model"):
        AtlaslabConfig(atlaslab={"d_model": 0})


def test_import_atlaslab_is_enough_for_the_auto_classes(tmp_path):
    """A fresh interpreter: ``import atlaslab`` before transformers, then AutoModelForCausalLM finds the model."""
    import subprocess
    import sys
    tiny_model("deltanet").save_pretrained(tmp_path)
    code = ("import atlaslab, sys; assert 'transformers' not in sys.modules; "
            "from transformers import AutoModelForCausalLM; "
            f"print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.stdout.strip().endswith("AtlaslabForCausalLM"), res.stderr[-2000:]
