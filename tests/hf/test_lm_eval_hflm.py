"""lm-eval's own Hugging Face class (``HFLM``) runs an atlaslab model: its log-likelihoods equal the model's own
log-probabilities of the continuation tokens (byte tokens, float64)."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")     # lm-eval's HFLM imports it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from atlaslab.eval.hf_tokenizer import to_transformers  # noqa: E402
from atlaslab.hf.modeling import AtlaslabForCausalLM, AtlaslabConfig  # noqa: E402
from atlaslab.models.presets import tiny_overrides  # noqa: E402
from atlaslab.tasks.tokenizer import ByteTokenizer  # noqa: E402


def test_byte_tokenizer_converts_to_the_same_ids(tmp_path):
    ours = ByteTokenizer(ByteTokenizer.Config(name="byte"))
    hf = to_transformers(ours)
    text = "héllo, wörld\n\ttabs €"
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf.decode(ours.encode(text)) == text and hf.eos_token_id == 256
    hf.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


@pytest.mark.parametrize("preset", ["gated_deltanet", "titans_mac"])
def test_hflm_loglikelihood_equals_the_models_own_log_probs(preset, one_thread):
    torch.manual_seed(0)
    cfg = AtlaslabConfig.from_preset(preset, tiny_overrides(preset, vocab_size=257), eos_token_id=256,
                                     pad_token_id=256)
    model = AtlaslabForCausalLM(cfg).eval().double()
    ours = ByteTokenizer(ByteTokenizer.Config(name="byte"))
    lm = HFLM(pretrained=model, tokenizer=to_transformers(ours), backend="causal", batch_size=2, device="cpu",
              max_length=64)
    pairs = [("The cat sat", " on the mat"), ("A", "bc"), ("memory ", "is trained while it reads")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        stripped = ctx.rstrip(" ")                     # lm-eval moves the context's trailing spaces
        c, x = ours.encode(stripped), ours.encode(ctx[len(stripped):] + cont)
        ids = torch.tensor([c + x])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, use_cache=False).logits[0, :-1], -1)
        want = logp[len(c) - 1:, :].gather(1, torch.tensor(x)[:, None]).sum().item()
        assert ll == pytest.approx(want, abs=1e-6), (ctx, cont)
        assert greedy == bool((logp[len(c) - 1:].argmax(-1) == torch.tensor(x)).all())


def test_hflm_generate_until_left_pads_and_matches_the_decoder(one_thread):
    torch.manual_seed(0)
    cfg = AtlaslabConfig.from_preset("gated_deltanet", tiny_overrides("gated_deltanet", vocab_size=257),
                                     eos_token_id=256, pad_token_id=256)
    model = AtlaslabForCausalLM(cfg).eval().double()
    ours = ByteTokenizer(ByteTokenizer.Config(name="byte"))
    lm = HFLM(pretrained=model, tokenizer=to_transformers(ours), backend="causal", batch_size=3, device="cpu",
              max_length=64)
    prompts = ["abc", "a much longer prompt", "x"]
    reqs = [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(p, {"until": ["\x00never"], "max_gen_toks": 4, "do_sample": False}))
            for i, p in enumerate(prompts)]
    got = lm.generate_until(reqs)
    for p, text in zip(prompts, got):
        ref = model.model.generate(torch.tensor([ours.encode(p)]), 4, eos_token_id=256)[0, len(p):].tolist()
        ref = [t for t in ref if t != 256]
        assert text == ours.decode(ref), (p, text)
