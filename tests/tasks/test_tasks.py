"""Tasks: every generator's labels checked by an independent brute-force reader of the sequence,
determinism per seed, disjoint splits, the generic evaluation, MAD's grid and the learnability probe."""
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from atlaslab.registry import ConfigError, get_registry
from atlaslab.tasks import (IGNORE_INDEX, build_task, corpus_splits, decode_bytes, list_tasks, mad_grid, mad_score,
                            resolve_task)
from atlaslab.tasks.babilong import COUNT_WORDS, OBJECTS, World
from atlaslab.tasks.learnability import TARGETS, make_mlp_learner
from atlaslab.tasks.mad import MAD_PROTOCOL, CompressionHead

pytestmark = pytest.mark.usefixtures("one_thread")


TOKEN_TASKS = {
    "mqar": {"vocab_size": 64, "seq_len": 64, "num_kv_pairs": [2, 4, 8], "eval_examples": 24},
    "in_context_recall": {"vocab_size": 16, "seq_len": 64, "eval_examples": 16},
    "noisy_in_context_recall": {"seq_len": 64, "eval_examples": 16, "frac_noise": 0.4},
    "fuzzy_in_context_recall": {"seq_len": 64, "eval_examples": 16},
    "selective_copying": {"seq_len": 64, "num_tokens_to_copy": 8, "eval_examples": 16},
    "compression": {"seq_len": 32, "eval_examples": 16},
    "memorization": {"seq_len": 32, "eval_examples": 16},
    "sniah": {"seq_len": 400, "eval_examples": 10},
    "babilong": {"seq_len": 600, "eval_examples": 12},
    "byte_lm": {"seq_len": 128, "eval_examples": 8},
}


def task_of(name, **kw):
    return build_task({"name": name, **TOKEN_TASKS.get(name, {}), **kw})


def rows(batch):
    return [tuple(r) for r in batch.inputs.tolist()]


# --------------------------------------------------------------------------------------------------
# registry, configs, determinism, splits
# --------------------------------------------------------------------------------------------------
def test_every_task_is_registered_with_a_structured_config():
    names = set(list_tasks())
    assert set(TOKEN_TASKS) | {"learnability"} <= names
    for entry in get_registry("task"):
        cfg = entry.default_config()
        assert cfg.name == entry.name and entry.description


def test_config_errors_name_the_dotted_path():
    with pytest.raises(ConfigError, match=r"task\.num_kv_pairs\.0"):
        resolve_task({"name": "mqar", "seq_len": 16, "num_kv_pairs": [8]})
    with pytest.raises(ConfigError, match=r"task\.varaint.*Did you mean 'variant'"):
        resolve_task({"name": "sniah", "varaint": "word"})
    with pytest.raises(ConfigError, match=r"task\.variant"):
        resolve_task({"name": "sniah", "variant": "needle"})
    with pytest.raises(ConfigError, match=r"Did you mean 'mqar'"):
        resolve_task({"name": "mqr"})


@pytest.mark.parametrize("name", sorted(TOKEN_TASKS))
def test_generation_is_deterministic_shaped_and_in_vocab(name):
    task = task_of(name)
    a = task.batch("train", 3, 6, seed=1)
    b = task_of(name).batch("train", 3, 6, seed=1)           # a fresh instance: no hidden state
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert a.inputs.shape == (6, task.seq_len) and a.inputs.dtype == torch.long
    assert 0 <= a.inputs.min() and a.inputs.max() < task.vocab_size
    scored = a.targets[a.targets != IGNORE_INDEX]
    assert len(scored) > 0 and 0 <= scored.min() and scored.max() < task.vocab_size
    c = task.batch("train", 3, 6, seed=2)
    assert not torch.equal(a.inputs, c.inputs)              # the training seed changes the data
    # evaluation sets do not depend on the evaluation batch size
    e1 = torch.cat([x.inputs for x in task.eval_batches("test", 8, batch_size=3)])
    e2 = next(task.eval_batches("test", 8, batch_size=8)).inputs
    assert torch.equal(e1, e2)


@pytest.mark.parametrize("name", ["mqar", "in_context_recall", "fuzzy_in_context_recall", "selective_copying",
                                  "compression", "memorization", "sniah", "babilong"])
def test_splits_do_not_overlap(name):
    task = task_of(name)
    train = set()
    for step in range(8):
        train.update(rows(task.batch("train", step, 16, seed=0)))
    for split in ("val", "test"):
        held = set(rows(next(task.eval_batches(split, 16, 16))))
        assert not (held & train), f"{name}: {split} examples also in train"
    assert not (set(rows(next(task.eval_batches("val", 16, 16)))) & set(rows(next(task.eval_batches("test", 16, 16)))))


def test_corpus_splits_are_disjoint_text():
    sp = corpus_splits("pydoc")
    total = sum(len(t) for t in sp.values())
    assert 0.03 < len(sp["test"]) / total < 0.08 and 0.03 < len(sp["val"]) / total < 0.08
    rng = np.random.default_rng(0)
    for split in ("val", "test"):
        text = sp[split]
        for start in rng.integers(0, len(text) - 200, size=30):
            snippet = text[start:start + 200]
            if len(set(snippet.split())) > 20:               # skip boiler-plate lines that recur everywhere
                assert snippet not in sp["train"]


def test_finite_training_sets_cycle_in_seeded_epochs():
    task = build_task({"name": "memorization", "num_train_examples": 10})
    stream, idx = task.train_indices(0, 25, seed=0)
    assert stream == 0 and sorted(idx[:10]) == list(range(10)) and sorted(idx[10:20]) == list(range(10))
    assert idx != task.train_indices(0, 25, seed=1)[1]
    assert idx[10:20] == task.train_indices(1, 10, seed=0)[1]
    # a batch is the same whether it is reached at step s with batch size b or cut out of a larger batch
    big = task.batch("train", 0, 20, seed=3).inputs
    assert torch.equal(big[10:20], task.batch("train", 1, 10, seed=3).inputs)


# --------------------------------------------------------------------------------------------------
# brute-force readers
# --------------------------------------------------------------------------------------------------
def read_mqar(inputs, n_pairs):
    """Expected targets: at every later occurrence of a key that is a query, the value stored after it."""
    kv = {}
    for i in range(0, 2 * n_pairs, 2):
        assert inputs[i] not in kv, "keys are distinct"
        kv[inputs[i]] = inputs[i + 1]
    return kv


def test_mqar_labels_by_brute_force():
    task = task_of("mqar", power_a=0.01)
    V = task.vocab_size
    for split in ("train", "test"):
        batch = task.batch(split, 0, 24) if split == "train" else next(task.eval_batches(split, 24, 24))
        for x, y, n in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.meta["kv"].tolist()):
            kv = read_mqar(x, n)
            assert all(1 <= k < V // 2 for k in kv) and all(V // 2 <= v < V for v in kv.values())
            queried = []
            for t in range(2 * n, len(x)):
                if y[t] != IGNORE_INDEX:
                    assert x[t] in kv and y[t] == kv[x[t]] and (t - 2 * n) % 2 == 0
                    queried.append(x[t])
            assert sorted(queried) == sorted(kv), "every key is queried exactly once"
            assert all(v == IGNORE_INDEX for v in y[:2 * n])
    # evaluation sets are balanced over the pair counts; the power law favours short gaps
    ev = next(task.eval_batches("test", 24, 24))
    assert sorted(ev.meta["kv"].tolist()) == sorted([2, 4, 8] * 8)
    gaps = []
    for x, y, n in zip(ev.inputs.tolist(), ev.targets.tolist(), ev.meta["kv"].tolist()):
        gaps += [(t - 2 * n) // 2 / ((len(x) - 2 * n) // 2) for t in range(len(x)) if y[t] != IGNORE_INDEX]
    assert np.mean(gaps) < 0.4


def read_recall(x, y, ns, noise, multi_query):
    """Walk the pairs; check every scored position against the map built from the sequence."""
    seen, T = {}, len(x)
    end = T if multi_query else T - 2
    for t in range(0, end, 2):
        k, v = x[t], x[t + 1] if t + 1 < T else None
        if noise and ns <= k < ns + noise:
            assert ns <= v < ns + noise and y[t] == IGNORE_INDEX and y[t + 1] == IGNORE_INDEX
            continue
        assert k < ns // 2 and (v is None or ns // 2 <= v < ns)
        if k in seen:
            assert (v is None or v == seen[k]) and (y[t] == seen[k] if multi_query else y[t] == IGNORE_INDEX)
        else:
            assert y[t] == IGNORE_INDEX
            seen[k] = v
    if not multi_query:                     # … copy-prefix, probe key (target: its value)
        assert x[T - 2] == ns + noise and x[T - 1] in seen and y[T - 1] == seen[x[T - 1]]
    assert y[T - 2 if multi_query else T - 1] != IGNORE_INDEX      # the final probe is scored


@pytest.mark.parametrize("name,kw", [("in_context_recall", {}), ("in_context_recall", {"multi_query": False}),
                                     ("noisy_in_context_recall", {})])
def test_in_context_recall_labels_by_brute_force(name, kw):
    task = task_of(name, **kw)
    c = task.cfg
    ns = c.vocab_size - (0 if c.multi_query else 1) - c.noise_vocab_size
    for split in ("train", "test"):
        batch = task.batch(split, 0, 12)
        for x, y in zip(batch.inputs.tolist(), batch.targets.tolist()):
            read_recall(x, y, ns, c.noise_vocab_size, c.multi_query)
    # MAD trains the recall tasks on every next token; evaluation scores the answers only
    tr = task.batch("train", 0, 4)
    assert torch.equal(tr.train_targets[:, :-1], tr.inputs[:, 1:])
    assert task.batch("test", 0, 4).loss_targets is None


def test_fuzzy_recall_probe_by_brute_force():
    task = task_of("fuzzy_in_context_recall")
    K = task.cfg.k_motif_size
    for x, y in zip(*[b.tolist() for b in (lambda b: (b.inputs, b.targets))(next(task.eval_batches("test", 16, 16)))]):
        x = list(x)
        scored = [t for t in range(len(x)) if y[t] != IGNORE_INDEX]
        # the final answer: the scored run at the end; its key is the K tokens before it (eval keys have size K)
        run = [scored[-1]]
        while len(run) < len(scored) and scored[-len(run) - 1] == run[0] - 1:
            run.insert(0, scored[-len(run) - 1])
        value = tuple(y[t] for t in run)
        key = tuple(x[run[0] - K + 1:run[0] + 1])
        body = x[:run[0] - K + 1]
        found = any(tuple(body[i:i + K]) == key and tuple(body[i + K:i + K + len(value)]) == value
                    for i in range(len(body)))
        assert found, "the probed key-value pair appears earlier in the sequence"


def test_selective_copying_labels_by_brute_force():
    task = task_of("selective_copying")
    V, n = task.vocab_size, task.cfg.num_tokens_to_copy
    for x, y in zip(task.batch("train", 0, 8).inputs.tolist(), task.batch("train", 0, 8).targets.tolist()):
        T = len(x)
        assert x[T - n - 1] == V - 1 and all(t == V - 2 for t in x[T - n:])
        content = [t for t in x[:T - n - 1] if t != V - 2]
        assert content == y[T - n:] and all(t == IGNORE_INDEX for t in y[:T - n])


def test_compression_and_its_decoder_head():
    task = task_of("compression", frac_noise=0.2, noise_vocab_size=2)
    V = task.vocab_size
    b = task.batch("train", 0, 8)
    for x, y in zip(b.inputs.tolist(), b.targets.tolist()):
        assert x[-1] == V - 1 and y[-1] == V - 1
        for a, t in zip(x[:-1], y[:-1]):
            assert (t == a and a < V - 3) or (t == IGNORE_INDEX and a >= V - 3)
    model = nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, 8))
    head = task.wrap(model)
    assert isinstance(head, CompressionHead) and task.wrap(model) is head and task.wrap(head) is head
    assert head(b.inputs).shape == (8, task.seq_len, V)
    m = task.evaluate(model, n_examples=8, batch_size=8)       # the raw model is evaluated through its head
    assert 0 <= m["accuracy"] <= 1


def test_memorization_uses_one_fixed_map_from_the_task_seed():
    task = task_of("memorization")
    V = task.vocab_size
    kv = {}
    for split in ("train", "test"):
        b = task.batch(split, 0, 8)
        for x, y in zip(b.inputs.tolist(), b.targets.tolist()):
            assert all(t == V - 1 for t in x[1::2]) and all(t == IGNORE_INDEX for t in y[0::2])
            for k, v in zip(x[0::2], y[1::2]):
                assert kv.setdefault(k, v) == v
    assert len(set(kv.values())) == len(kv)                    # a bijection
    assert task_of("memorization").kv_map == task.kv_map
    assert task_of("memorization", seed=1).kv_map != task.kv_map


def read_needle(text):
    """The answer RULER's question asks for, found in the haystack by regular expressions."""
    m = re.search(r"What is the pass key\? The pass key is $", text)
    if m:
        return re.search(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", text).group(1)
    kind, key = re.search(r"What is the special magic (number|word) for (\w+) mentioned", text).groups()
    return re.search(rf"One of the special magic {kind}s for {key} is: (\w+)\.", text).group(1)


@pytest.mark.parametrize("variant", ["passkey", "number", "word"])
def test_sniah_labels_by_brute_force(variant):
    task = task_of("sniah", variant=variant)
    for split, length in (("train", 400), ("test", 400), ("test", 900)):
        b = next(task.eval_batches(split, 5, 5, length=length)) if split != "train" else task.batch("train", 0, 5)
        assert b.inputs.shape[1] == length
        for x, y in zip(b.inputs.tolist(), b.targets.tolist()):
            text = decode_bytes(x)
            answer = decode_bytes([t for t in y if t != IGNORE_INDEX])
            # the scored bytes end the sequence: text + answer[-1] is the whole sequence
            assert all(t != IGNORE_INDEX for t in y[len(y) - len(answer):])
            assert read_needle(text[:len(text) - len(answer) + 1]) == answer
    depths = next(task.eval_batches("test", 10, 10)).meta["depth"].tolist()
    assert sorted(depths) == sorted(list(range(5)) * 2)


FACT = re.compile(r"(Mary|John|Daniel|Sandra) (moved to|went to|journeyed to|travelled to|went back to|picked up|got|"
                  r"grabbed|took|dropped|discarded|put down|left) the (\w+)\.")


def read_babi(text):
    """Simulate the facts found in the text and answer its question."""
    world = World()
    for actor, verb, thing in FACT.findall(text):
        if verb in ("picked up", "got", "grabbed", "took"):
            world.holder[thing], world.lies[thing] = actor, None
        elif verb in ("dropped", "discarded", "put down", "left"):
            world.holder[thing], world.lies[thing] = None, world.at.get(actor)
        else:
            world.at[actor] = thing
    q = re.search(r"Question: (.*) Answer: $", text).group(1)
    if m := re.fullmatch(r"Where is the (\w+)\?", q):
        assert m.group(1) in OBJECTS
        return world.where_object(m.group(1))
    if m := re.fullmatch(r"Where is (\w+)\?", q):
        return world.at[m.group(1)]
    m = re.fullmatch(r"How many objects is (\w+) carrying\?", q)
    return COUNT_WORDS[world.carrying(m.group(1))]


def test_babilong_labels_by_brute_force_at_growing_lengths():
    task = task_of("babilong")
    seen = set()
    for length in (600, 1500):
        b = next(task.eval_batches("test", 12, 12, length=length))
        assert b.inputs.shape[1] == length
        for x, y, qa in zip(b.inputs.tolist(), b.targets.tolist(), b.meta["task"].tolist()):
            answer = decode_bytes([t for t in y if t != IGNORE_INDEX])
            text = decode_bytes(x)[:length - len(answer) + 1]
            assert read_babi(text) == answer
            seen.add(qa)
    assert seen == {0, 1, 2}


def test_byte_lm_windows_are_corpus_text():
    task = task_of("byte_lm")
    for split in ("train", "test"):
        data = task.text(split)
        b = task.batch(split, 0, 4)
        assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
        for x, y in zip(b.inputs.tolist(), b.targets.tolist()):
            assert bytes(x + y[-1:]) in data
    assert task.eval_size("test", 128) == min(8, (len(task.text("test")) - 1) // 128)
    info = task.info()
    assert len(info["corpus_sha256"]) == 64 and info["train_bytes"] > 300_000


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------
class MQAROracle(nn.Module):
    """Answers MQAR by reading the sequence (the brute-force reader as a model)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        B, T = ids.shape
        out = torch.zeros(B, T, self.vocab)
        for b, x in enumerate(ids.tolist()):
            first = {}
            for t in range(0, T - 1):
                if x[t] < self.vocab // 2 and x[t] not in first and t % 2 == 0 and t < T // 2:
                    first[x[t]] = x[t + 1]
                if x[t] in first and t >= 2:
                    out[b, t, first[x[t]]] = 10.0
        return out + self.dummy


def test_evaluate_metrics_slices_and_lengths():
    task = task_of("mqar", random_non_queries=False)
    m = task.evaluate(MQAROracle(task.vocab_size), split="test")
    assert m["accuracy"] == 1.0 and m["exact_match"] == 1.0
    assert {"accuracy/kv_2", "accuracy/kv_4", "accuracy/kv_8", "exact_match/kv_8"} <= set(m)
    long = task.evaluate(MQAROracle(task.vocab_size), split="test", lengths=[64, 128])
    assert long["len_128/accuracy"] == 1.0 and "len_64/accuracy/kv_8" in long
    uniform = nn.Module()
    uniform.forward = lambda ids: torch.zeros(*ids.shape, task.vocab_size)
    u = task.evaluate(uniform, split="val", n_examples=6, batch_size=4)
    assert math.isclose(u["loss"], math.log(task.vocab_size), rel_tol=1e-6) and u["accuracy"] <= 1 / 32
    with pytest.raises(ValueError):
        task.evaluate(uniform, lengths=[6])                   # no pair count fits 6 tokens


def test_accuracy_by_position_span():
    """``eval_position_span``: accuracy/pos_<a>_<b> equals a brute-force count over the test batches, for a
    model right only before position 24 (so the span 16-32 is partly right), at T and at a longer length."""
    task = task_of("mqar", random_non_queries=False, eval_position_span=16)
    oracle = MQAROracle(task.vocab_size)
    early = nn.Module()
    early.forward = lambda ids: oracle(ids) * (torch.arange(ids.shape[1]) < 24).view(1, -1, 1)
    for length, prefix in ((None, ""), (128, "len_128/")):
        m = task.evaluate(early, split="test", lengths=None if length is None else [length])
        right, total = {}, {}
        for batch in task.eval_batches("test", None, 64, length):
            pred = early(batch.inputs).argmax(-1)
            for b, t in (batch.targets != IGNORE_INDEX).nonzero().tolist():
                a = 16 * (t // 16)
                total[a] = total.get(a, 0) + 1
                right[a] = right.get(a, 0) + int(pred[b, t] == batch.targets[b, t])
        spans = {k for k in m if "/pos_" in k}
        assert spans == {f"{prefix}accuracy/pos_{a}_{a + 16}" for a in total}
        for a in total:
            assert m[f"{prefix}accuracy/pos_{a}_{a + 16}"] == pytest.approx(right[a] / total[a])
        assert m[f"{prefix}accuracy/pos_0_16"] == 1.0 and 0 < m[f"{prefix}accuracy/pos_16_32"] < 1
        assert max(a for a in total) >= 32 and m[f"{prefix}accuracy/pos_32_48"] == 0.0
    assert not any("/pos_" in k for k in task_of("mqar").evaluate(oracle, split="test"))     # off by default
    with pytest.raises(ConfigError, match="eval_position_span"):
        task_of("mqar", eval_position_span=-1)


def test_byte_lm_reports_bits_per_byte():
    task = task_of("byte_lm")
    uniform = nn.Module()
    uniform.forward = lambda ids: torch.zeros(*ids.shape, 256)
    m = task.evaluate(uniform, split="val")
    assert math.isclose(m["bpb"], 8.0, rel_tol=1e-6) and math.isclose(m["ppl"], 256.0, rel_tol=1e-5)
    assert "exact_match" not in m


# --------------------------------------------------------------------------------------------------
# MAD protocol and the learnability probe
# --------------------------------------------------------------------------------------------------
def test_mad_grid_is_baseline_plus_one_change_at_a_time():
    grid = mad_grid()
    expected = sum(1 + sum(len(v) for v in p["changes"].values()) for p in MAD_PROTOCOL.values())
    assert len(grid) == expected and len({g["setting"] for g in grid}) == expected
    for g in grid:
        resolve_task(g["task"])                                # every setting is a valid task config
    icr = [g for g in grid if g["setting"].startswith("in_context_recall/")]
    assert icr[0]["task"] == {"name": "in_context_recall", **MAD_PROTOCOL["in_context_recall"]["baseline"]}
    assert sum(g["task"]["seq_len"] != 128 for g in icr) == 3
    recs = [{"setting": "a/baseline", "accuracy": 0.5}, {"setting": "a/baseline", "accuracy": 0.9},
            {"setting": "a/x_1", "accuracy": 0.7}, {"setting": "b/baseline", "accuracy": 0.2}]
    s = mad_score(recs)
    assert math.isclose(s["a"], 0.8) and math.isclose(s["mad_score"], 0.5)


def test_learnability_probe_streams_and_an_online_mlp_fits():
    probe = build_task({"name": "learnability", "dim": 16, "num_pairs": 200, "window": 8, "rank": 2})
    for t in TARGETS:
        i, o = probe.stream(t)
        assert i.shape == o.shape == (200, 16) and torch.isfinite(o).all()
        assert torch.equal(o, probe.stream(t)[1])                       # deterministic
    curve = probe.run(make_mlp_learner(depth=2, lr=3e-3)(16), "low_rank")
    assert curve[-20:].mean() < 0.5 * curve[:20].mean()                # the memory learns online
    out = probe.evaluate(make_mlp_learner(depth=2, expansion=1, lr=3e-3), targets=["swa_mlp"])
    assert set(out) == {"rel_loss/swa_mlp", "online_rel_loss/swa_mlp", "rel_loss"}
    assert out["rel_loss"] == out["rel_loss/swa_mlp"] and np.isfinite(out["rel_loss"])
