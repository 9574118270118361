"""Recurrent decoding (atlaslab/models/decoding.py): prefill and token-by-token steps give the full forward's logits.

Every preset at tiny size (d_model 16, 2 heads, vocabulary 32, one layer) in float64, with the training chunk b = 2,
the SWA window 3 and the MAC segment 3, so the splits below cross chunk, window and segment boundaries: a prefill of
3 tokens (mid-chunk; the window just full), a chained prefill of 3 more (across a chunk start and past the window),
then single steps (across a MAC segment start; beyond the Omega window c = 4 of the presets that use one). The
tolerance is 1e-9 of the largest logit (the decoders reproduce the forward to rounding, ~1e-15).
"""
import functools
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from atlaslab.models import decoding
from atlaslab.models.presets import build_model, list_presets, load_preset, tiny_overrides

PRESETS = list_presets()
B, T, V = 2, 9, 32
PROMPT, NEW = 4, 3
TOL = 1e-9
pytestmark = pytest.mark.usefixtures("one_thread")

#: Configurations the presets do not cover: the other engine, chunk-granular reads and Newton–Schulz, the mirror
#: retention with a window, FoX's memory form and RoPE, the blocks' switches.
VARIANTS = {
    "titans/recurrent": ("titans", "mixers.titans.mode=recurrent"),
    "atlas/read_chunk": ("atlas", "mixers.atlas.memory.read=chunk", "mixers.atlas.memory.inner_optimizer.ns_granularity=chunk"),
    "omeganet/read_chunk": ("omeganet", "mixers.omeganet.memory.read=chunk"),
    "memora/window": ("memora", "mixers.memora.memory.window.size=3"),
    "fox/memory_form": ("fox", "mixers.fox.form=memory"),
    "fox_pro/memory_recurrent": ("fox_pro", "mixers.fox.form=memory", "mixers.fox.mode=recurrent"),
    "fox/rope": ("fox", "mixers.fox.rope=true"),
    "transformer/qk_norm": ("transformer", "mixers.transformer.qk_norm=true"),
    "titans_mac/no_reads": ("titans_mac", "mixers.titans_mac.read_tokens=false"),
    "titans_mac/no_gate_no_persistent": ("titans_mac", "mixers.titans_mac.gate=none",
                                         "mixers.titans_mac.persistent_tokens=0"),
    "titans_mac/write_input": ("titans_mac", "mixers.titans_mac.write=input"),
    "titans_mac/attention_only": ("titans_mac", "mixers.titans_mac.gate=none", "mixers.titans_mac.read_tokens=false"),
    "titans_mag/no_gate": ("titans_mag", "mixers.titans_mag.gate=none"),
    "titans/lmm_block": ("titans", "mixers.titans.name=lmm", "+mixers.titans.persistent_tokens=2"),
}
CASES = {**{p: (p,) for p in PRESETS}, **VARIANTS}


@functools.lru_cache(maxsize=None)
def case(key: str):
    """(model, ids, full-forward logits) of a preset or variant, built once per module."""
    name, *extra = CASES[key]
    torch.manual_seed(0)
    cfg = load_preset(name, tiny_overrides(name, vocab_size=V, num_layers=1, chunk_size=2, window=3, segment=3)
                      + list(extra))
    model = build_model(cfg).to(torch.float64)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    return model, ids, full


def assert_close(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= TOL * scale, f"max abs error {err:.3g} at logit scale {scale:.3g}"


@pytest.mark.parametrize("key", PRESETS)
def test_prefill_equals_forward(key):
    model, ids, full = case(key)
    logits, state = model.prefill(ids)
    assert_close(logits, full)
    assert state.length == T and len(state.layers) == len(model.layers)


@pytest.mark.parametrize("key", list(CASES))
def test_prefill_then_steps_equal_forward(key):
    model, ids, full = case(key)
    a, state = model.prefill(ids[:, :3])
    b, state = model.prefill(ids[:, 3:6], state)
    steps = []
    for t in range(6, T):
        logits, state = model.step(ids[:, t], state)
        steps.append(logits)
    assert_close(torch.cat([a, b, torch.stack(steps, 1)], 1), full)
    assert state.length == T


@pytest.mark.parametrize("key", PRESETS)
def test_greedy_generate_equals_argmax_rollout(key):
    model, ids, _ = case(key)
    want = ids[:, :PROMPT]
    with torch.no_grad():
        for _ in range(NEW):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], 1)
    got = model.generate(ids[:, :PROMPT], NEW)
    assert torch.equal(got, want)


def test_a_hybrid_stack_carries_each_layers_state():
    """Four different mixers in one stack: every layer's state travels in the LMState."""
    torch.manual_seed(0)
    mem = {"memory": {"name": "mlp", "depth": 2, "expansion": 2}, "attentional_bias": {"name": "l2"},
           "retention": {"name": "decay"}, "inner_optimizer": {"name": "momentum", "lr": 0.1},
           "window": {"name": "omega", "size": 2}, "chunk_size": 2}
    model = build_model({"vocab_size": V, "d_model": 16, "num_layers": 4, "layers": ["mem", "swa", "fox", "mac"],
                         "mixers": {"mem": {"name": "memory", "num_heads": 2, "memory": mem},
                                    "swa": {"name": "swa", "num_heads": 2, "window": 3},
                                    "fox": {"name": "forgetting_attention", "num_heads": 2, "k_shift": True},
                                    "mac": {"name": "mac", "num_heads": 2, "segment": 3, "persistent_tokens": 1,
                                            "memory": mem}}}).to(torch.float64)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
    logits, state = model.prefill(ids[:, :2])
    out = [logits]
    for t in range(2, T):
        logits, state = model.step(ids[:, t], state)
        out.append(logits[:, None])
    assert_close(torch.cat(out, 1), full)
    kinds = [type(s).__name__ for s in state.layers]
    assert kinds == ["MemoryLayerState", "KVCache", "FoXState", "MACState"]
    assert state.layers[1].k.shape[2] == 2            # SWA keeps window − 1 tokens
    assert state.layers[2].kv.k.shape[2] == T         # FoX keeps every token


def test_batch_rows_decode_independently():
    model, ids, _ = case("titans_mag")
    both = model.generate(ids[:, :PROMPT], NEW)
    for row in range(B):
        assert torch.equal(model.generate(ids[row:row + 1, :PROMPT], NEW), both[row:row + 1])


def test_sampling_is_reproducible_and_reduces_to_greedy():
    model, ids, _ = case("deltanet")
    prompt = ids[:, :PROMPT]
    greedy = model.generate(prompt, NEW)
    draw = [model.generate(prompt, 6, temperature=1.5, generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])
    assert torch.equal(model.generate(prompt, NEW, temperature=2.0, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, NEW, temperature=2.0, top_p=1e-6), greedy)


def test_top_k_and_top_p_keep_the_likely_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log().expand(500, -1)
    gen = torch.Generator().manual_seed(0)
    nucleus = decoding.sample(logits, 1.0, top_p=0.7, generator=gen)   # {0, 1} reach 0.8 ≥ 0.7; 0 alone does not
    assert set(nucleus.tolist()) == {0, 1}
    top2 = decoding.sample(logits, 1.0, top_k=2, generator=gen)
    assert set(top2.tolist()) == {0, 1}
    assert set(decoding.sample(logits, 1.0, generator=gen).tolist()) == {0, 1, 2}


def test_eos_repeats_and_stops_generation():
    model, ids, _ = case("transformer")
    prompt = ids[:, :PROMPT]
    greedy = model.generate(prompt, 6)
    eos = int(greedy[0, PROMPT])                       # row 0's first new token, which row 1 never produces
    assert eos not in greedy[1, PROMPT:].tolist()
    out = model.generate(prompt, 6, eos_token_id=eos)
    assert out.shape == greedy.shape
    assert (out[0, PROMPT:] == eos).all() and torch.equal(out[1], greedy[1])
    stop = greedy[1, PROMPT:].tolist()
    ends = stop.index(stop[1]) + 1                     # row 1 alone stops at its (first) token equal to its second
    assert torch.equal(model.generate(prompt[1:], 6, eos_token_id=stop[1]), greedy[1:, :PROMPT + ends])


class _Shift(nn.Module):
    """A user mixer that decodes through its own method: y_t = x_{t−1} (state: the last token)."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    def decode(self, x, state):
        prev = state if state is not None else torch.zeros_like(x[:, :1])
        return torch.cat([prev, x[:, :-1]], 1), x[:, -1:]


def test_a_user_mixer_decodes_through_its_decode_method():
    _, ids, _ = case("transformer")
    model = build_model(load_preset("transformer", tiny_overrides("transformer", vocab_size=V, num_layers=1)))
    model = model.to(torch.float64)
    model.layers[0].mixer = _Shift()
    with torch.no_grad():
        full = model(ids)
    logits, state = model.prefill(ids[:, :5])
    last, state = model.step(ids[:, 5], state)
    assert_close(torch.cat([logits, last[:, None]], 1), full[:, :6])
    assert torch.equal(state.layers[0], model.layers[0].mixer_norm(model.embed(ids[:, 5:6])))


def test_a_mixer_without_decoder_is_refused_by_name():
    model = build_model(load_preset("transformer", tiny_overrides("transformer", vocab_size=V, num_layers=1)))
    model.layers[0].mixer = nn.Identity()
    with pytest.raises(NotImplementedError, match=r"mixers\.transformer: Identity has no decoder"):
        model.prefill(torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 0.0, "top_k": 5}, "temperature"),
    ({"temperature": 1.0, "top_k": 0}, "top_k"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"eos_token_id": V}, "eos_token_id"),
])
def test_bad_generate_arguments_are_refused(kwargs, match):
    model, ids, _ = case("transformer")
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        model.generate(ids[:, :PROMPT], **kwargs)


def test_bad_ids_and_states_are_refused():
    model, ids, _ = case("transformer")
    with pytest.raises(ValueError, match=r"prefill: expected integer token ids \[B, T\]"):
        model.prefill(ids[0])
    with pytest.raises(ValueError, match=r"step: expected one token id per sequence"):
        model.step(ids[:, :2], model.prefill(ids)[1])
    with pytest.raises(ValueError, match="step: needs the state"):
        model.step(ids[:, 0], None)
    _, state = model.prefill(ids)
    with pytest.raises(ValueError, match="the state holds 2 sequences, input_ids has 1"):
        model.prefill(ids[:1], state)
    state.layers.append(None)
    with pytest.raises(ValueError, match="layer states"):
        model.prefill(ids, state)


def test_the_docs_example_runs(capsys):
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "docs" / "decoding_example.py"))
    assert len(capsys.readouterr().out.splitlines()) == 4     # two rows of 16 tokens, greedy then sampled
