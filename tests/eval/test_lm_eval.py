"""The lm-eval adapter end to end: a tiny model trained on a corpus the test writes, local lm-eval task YAMLs over
tiny datasets (no network), and every request type checked against a direct computation with the model."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atlaslab.registry import ConfigError
from atlaslab.tasks import build_task
from atlaslab.train import train

pytest.importorskip("datasets")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'atlaslab[eval]')")

from atlaslab.eval import load_trained, resolve_lm_eval, run_lm_eval  # noqa: E402
from atlaslab.eval.harness import AtlaslabLM  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

WORDS = "the a memory model reads writes keys values state attention token gate".split()
CHOICES = [" model", " reads", " gate"]

TASKS = {
    "tiny_cloze": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}]""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: " model"
generation_kwargs: {until: ["."], max_gen_toks: 6}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]""",
}


def _doc(rng, i):
    return f"doc{i:03d} " + " ".join(rng.choice(WORDS, int(rng.integers(4, 30)))) + "."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(root, run folder, train result, task)``: a model trained a few steps; the task YAMLs and their data."""
    root = tmp_path_factory.mktemp("lmeval")
    rng = np.random.default_rng(0)
    with open(root / "train.jsonl", "w") as f:
        for i in range(80):
            f.write(json.dumps({"text": _doc(rng, i)}) + "\n")
    with open(root / "cloze.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"context": f"doc{i:03d} the memory", "choices": CHOICES, "answer": i % 3}) + "\n")
    with open(root / "ppl.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": _doc(rng, 100 + i) * 3}) + "\n")
    (root / "tasks").mkdir()
    for name, body in TASKS.items():
        data = {"tiny_cloze": "cloze", "tiny_ppl": "ppl", "tiny_gen": "cloze"}[name]
        (root / "tasks" / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / data}.jsonl\n"
            f"test_split: test\n{body}\n")
    node = {"name": "lm_corpus", "path": "json", "data_files": str(root / "train.jsonl"), "seq_len": 32,
            "val_fraction": 0.1, "test_fraction": 0.1, "eval_examples": 4, "cache_dir": str(root / "hf"),
            "tokenizer": {"name": "bpe_local", "vocab_size": 384, "cache_dir": str(root / "tok")}}
    task = build_task(node)
    torch.manual_seed(0)
    from atlaslab.models.lm import LanguageModel
    model = LanguageModel({"vocab_size": task.vocab_size, "d_model": 16, "num_layers": 1, "layers": ["a"],
                           "mixers": {"a": {"name": "attention", "num_heads": 2}}})
    result = train(model, task, dict(steps=12, batch_size=4, lr=1e-2, eval_interval=0, seed=0),
                   checkpoint_dir=root / "run")
    return root, root / "run", result, task


def _logp(model, ids):
    """log-probabilities [T, V] of one unpadded sequence."""
    with torch.no_grad():
        return F.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


def _manual_ll(model, tok, context, continuation):
    ctx = tok.encode(context)
    cont = tok.encode(context + continuation)[len(ctx):]
    lp = _logp(model, ctx + cont[:-1])[len(ctx) - 1:]
    target = torch.tensor(cont)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def _manual_rolling(model, tok, text, L):
    """lm-eval's rolling windows written out: disjoint windows of L predictions; the last one reads a full L."""
    t = tok.encode(text)
    full = [tok.eos_id] + t
    total, pos = 0.0, 0
    while pos < len(t):
        end = min(pos + L, len(t))
        first = max(0, end - L)
        lp = _logp(model, full[first:end])
        for k in range(pos, end):                   # full[k] predicts t[k]
            total += float(lp[k - first, t[k]])
        pos = end
    return total


def _req(kind, args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_loglikelihood_matches_one_sequence_at_a_time_in_padded_batches(setup):
    root, run, result, task = setup
    model, tok, info = load_trained(run)
    assert info["name"] == "lm_corpus" and tok.fingerprint == info["tokenizer_sha256"]
    for p, q in zip(model.parameters(), result.model.parameters()):
        assert torch.equal(p, q)                                      # the checkpoint rebuilds the model
    lm = AtlaslabLM(checkpoint=str(run), batch_size=3)
    assert lm.max_length == 32
    pairs = [("doc001 the memory", c) for c in CHOICES] + [("a", " state attention token gate reads"),
                                                           ("doc002 the memory model reads ", "keys")]
    got = lm.loglikelihood([_req("loglikelihood", p) for p in pairs])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        ref_ll, ref_greedy = _manual_ll(model, tok, ctx.rstrip(" "), ctx[len(ctx.rstrip(" ")):] + cont)
        assert math.isclose(ll, ref_ll, rel_tol=1e-5, abs_tol=1e-5) and greedy == ref_greedy
    empty = lm.loglikelihood([_req("loglikelihood", ("", " model reads"))])[0][0]
    ids = tok.encode(" model reads")
    lp = _logp(model, [tok.eos_id] + ids[:-1])
    assert math.isclose(empty, float(lp.gather(1, torch.tensor(ids)[:, None]).sum()), rel_tol=1e-5)


@pytest.mark.parametrize("L", [32, 7])
def test_loglikelihood_rolling_scores_every_token_once(setup, L):
    root, run, result, task = setup
    model, tok, _ = load_trained(run)
    lm = AtlaslabLM(checkpoint=str(run), max_length=L, batch_size=2)
    text = json.loads((root / "ppl.jsonl").read_text().splitlines()[0])["text"]
    assert len(tok.encode(text)) > 2 * L or L == 32
    got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])[0]
    assert math.isclose(got, _manual_rolling(model, tok, text, L), rel_tol=1e-5)


def test_generate_until_is_greedy_and_stops_at_the_stop_string(setup):
    root, run, result, task = setup
    model, tok, _ = load_trained(run)
    lm = AtlaslabLM(checkpoint=str(run))
    contexts = ["doc003 the memory", "doc004 keys"]
    got = lm.generate_until([_req("generate_until", (c, {"until": ["."], "max_gen_toks": 6})) for c in contexts])
    for c, text in zip(contexts, got):
        ids = tok.encode(c)
        new = []
        for _ in range(6):                                      # plain argmax decoding, no early stop
            nxt = int(_logp(model, ids + new)[-1].argmax())
            if nxt == tok.eos_id:
                break
            new.append(nxt)
        assert text == tok.decode(new).split(".")[0]

    class WithGenerate(torch.nn.Module):                          # a model with generate() is decoded by it
        def __init__(self, inner):
            super().__init__()
            self.inner, self.cfg, self.calls = inner, inner.cfg, 0

        def forward(self, ids):
            return self.inner(ids)

        def generate(self, ids, max_new_tokens):
            self.calls += 1
            return torch.cat([ids, torch.tensor([tok.encode(" gate. model")])], 1)
    wrapped = WithGenerate(model)
    out = AtlaslabLM(model=wrapped, tokenizer=tok).generate_until([_req("generate_until", ("x", {"until": ["."]}))])
    assert out == [" gate"] and wrapped.calls == 1


def test_run_lm_eval_on_local_tasks_reports_metrics_that_match_the_model(setup):
    root, run, result, task = setup
    model, tok, _ = load_trained(run)
    cfg = {"tasks": list(TASKS), "include_path": str(root / "tasks"), "builtin_tasks": False, "batch_size": 4}
    metrics = run_lm_eval(model, tok, cfg, max_length=32)
    assert set(metrics) >= {"lm_eval/tiny_cloze/acc", "lm_eval/tiny_ppl/bits_per_byte", "lm_eval/tiny_gen/exact_match"}
    docs = [json.loads(line) for line in (root / "cloze.jsonl").read_text().splitlines()]
    acc = np.mean([int(np.argmax([_manual_ll(model, tok, d["context"], c)[0] for c in d["choices"]]) == d["answer"])
                   for d in docs])
    assert metrics["lm_eval/tiny_cloze/acc"] == pytest.approx(acc)
    texts = [json.loads(line)["text"] for line in (root / "ppl.jsonl").read_text().splitlines()]
    bpb = -sum(_manual_rolling(model, tok, t, 32) for t in texts) / sum(len(t.encode()) for t in texts) / math.log(2)
    assert metrics["lm_eval/tiny_ppl/bits_per_byte"] == pytest.approx(bpb, rel=1e-5)

    from atlaslab.search.build import lm_eval_after_training
    assert lm_eval_after_training(result, task, None) == {}
    after = lm_eval_after_training(result, task, {**cfg, "tasks": ["tiny_cloze"]})
    assert after == {"lm_eval/tiny_cloze/acc": metrics["lm_eval/tiny_cloze/acc"]}


def test_the_eval_node_is_validated_before_anything_runs(setup):
    root = setup[0]
    from atlaslab.search.expand import build_trial_config
    from atlaslab.search.schema import validate_experiment
    local = {"include_path": str(root / "tasks"), "builtin_tasks": False}
    base = {"model": "transformer", "task": {"name": "mqar"}}
    cases = [({"tasks": []}, r"eval\.lm_eval\.tasks: name at least one"),
             ({"tasks": ["tiny_cloze"], "limt": 3}, r"eval\.lm_eval\.limt: "),
             ({"tasks": ["tiny_cloze"], "limit": 0}, r"eval\.lm_eval\.limit: must be a positive number"),
             ({"tasks": ["tiny_clozz"], **local}, r"eval\.lm_eval\.tasks\.0: lm-eval knows no task 'tiny_clozz'.*"
                                                  r"Did you mean 'tiny_cloze'"),
             ({"tasks": ["tiny_cloze"], "include_path": str(root / "none")}, r"eval\.lm_eval\.include_path: no such"),
             ({"tasks": ["tiny_cloze"], "builtin_tasks": False}, r"eval\.lm_eval\.builtin_tasks: .*include_path")]
    for node, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            validate_experiment({**base, "eval": {"lm_eval": node}})
    exp = validate_experiment({**base, "eval": {"interval": 5, "lm_eval": {"tasks": ["tiny_cloze"], "limit": 2, **local}}})
    trial = build_trial_config(exp, "mqar", [], seed=0)
    assert trial["eval"]["lm_eval"]["tasks"] == ["tiny_cloze"] and trial["eval"]["lm_eval"]["limit"] == 2
    assert "eval" not in build_trial_config(validate_experiment(base), "mqar", [], seed=0)
    with pytest.raises(ConfigError, match=r"checkpoint: no checkpoint\.pt"):
        load_trained(root / "nowhere")
    with pytest.raises(ConfigError, match=r"model_args: .*checkpoint="):
        AtlaslabLM()


def test_the_lm_eval_command_line_takes_model_atlaslab(setup, tmp_path):
    """``python -m atlaslab.eval run --model atlaslab …``: lm-eval's own CLI (indexing its 14 K tasks: ~10 s)."""
    root, run = setup[0], setup[1]
    out = subprocess.run([sys.executable, "-m", "atlaslab.eval", "run", "--model", "atlaslab", "--model_args",
                          f"checkpoint={run}", "--tasks", "tiny_cloze", "--include_path", str(root / "tasks"),
                          "--output_path", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tiny_cloze" in out.stdout and "acc" in out.stdout


def test_lm_evals_own_hf_class_gives_the_adapters_metrics(setup):
    """lm-eval's HFLM on the same model (as AtlaslabForCausalLM) and tokenizer (converted) reports the adapter's
    metrics on every request type: what would let the adapter go once transformers is a dependency of [eval]."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from atlaslab.eval.hf_tokenizer import to_transformers
    from atlaslab.eval.lm_eval import lm_eval_metrics, task_manager
    from atlaslab.hf.modeling import AtlaslabForCausalLM
    root, run, _, _ = setup
    model, tok, _ = load_trained(run)
    cfg = {"tasks": list(TASKS), "include_path": str(root / "tasks"), "builtin_tasks": False, "batch_size": 4}
    ours = run_lm_eval(model, tok, cfg, max_length=32)
    hf_tok = to_transformers(tok)
    assert hf_tok("the memory reads", add_special_tokens=False)["input_ids"] == tok.encode("the memory reads")
    lm = HFLM(pretrained=AtlaslabForCausalLM.from_language_model(model).eval(), tokenizer=hf_tok, backend="causal",
              batch_size=4, max_length=32, device="cpu")
    res = simple_evaluate(model=lm, tasks=list(TASKS), task_manager=task_manager(str(root / "tasks"), False),
                          bootstrap_iters=0, log_samples=False, random_seed=0, numpy_random_seed=0,
                          torch_random_seed=0, fewshot_random_seed=0)
    theirs = lm_eval_metrics(res)
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        assert theirs[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


def test_the_lm_eval_command_line_runs_an_exported_model_as_model_hf(setup, tmp_path):
    """An exported folder (weights + converted tokenizer) through ``--model hf``: lm-eval's own class loads it with
    AutoModelForCausalLM (``python -m atlaslab.eval`` imports atlaslab, which registers the model type) and scores
    what the adapter scores."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from atlaslab.eval.hf_tokenizer import to_transformers
    from atlaslab.hf.modeling import AtlaslabForCausalLM
    root, run = setup[0], setup[1]
    model, tok, _ = load_trained(run)
    folder = tmp_path / "model"
    AtlaslabForCausalLM.from_language_model(model).save_pretrained(folder)
    to_transformers(tok).save_pretrained(folder)
    out = subprocess.run([sys.executable, "-m", "atlaslab.eval", "run", "--model", "hf", "--model_args",
                          f"pretrained={folder},dtype=float32,max_length=32", "--device", "cpu",
                          "--tasks", "tiny_cloze",
                          "--include_path", str(root / "tasks"), "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    want = run_lm_eval(model, tok, {"tasks": ["tiny_cloze"], "include_path": str(root / "tasks"),
                                    "builtin_tasks": False}, max_length=32)
    assert result["results"]["tiny_cloze"]["acc,none"] == pytest.approx(want["lm_eval/tiny_cloze/acc"])
