"""Tokenizers, packing and the lm_corpus task over small jsonl / parquet files the tests write."""
import json

import numpy as np
import pytest
import torch
from helpers import Recorder

from atlaslab.models.lm import LanguageModel
from atlaslab.registry import ConfigError
from atlaslab.tasks import build_task, build_tokenizer
from atlaslab.tasks.base import IGNORE_INDEX, Batch, forward_batch
from atlaslab.tasks.lm_corpus import LMCorpus
from atlaslab.tasks.packing import RowPacker, TokenStream
from atlaslab.tasks import tokenizer as tokmod
from atlaslab.train import train

pytest.importorskip("datasets", reason="lm_corpus reads corpora with the datasets library")

WORDS = "the a memory model reads writes keys values state attention token gate decay query".split()


def _documents(n=120, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc{i:03d} " + " ".join(rng.choice(WORDS, int(rng.integers(2, 30)))) + "." for i in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A jsonl and a parquet file of the same documents, a second jsonl for a named validation split, and a
    cache folder for trained tokenizers and datasets' caches."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    with open(root / "train.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i}) + "\n")
    with open(root / "valid.jsonl", "w") as f:
        for d in _documents(20, seed=1):
            f.write(json.dumps({"text": d.replace("doc", "val")}) + "\n")
    import pandas as pd
    pd.DataFrame({"body": docs}).to_parquet(root / "train.parquet")
    return root


def _node(data, **kw):
    node = {"name": "lm_corpus", "path": "json", "data_files": str(data / "train.jsonl"), "seq_len": 32,
            "val_fraction": 0.1, "test_fraction": 0.1, "eval_examples": 0, "cache_dir": str(data / "hf"),
            "tokenizer": {"name": "bpe_local", "vocab_size": 512, "cache_dir": str(data / "tok")}}
    node.update(kw)
    return node


def _tiny_lm(vocab_size, seed=0, memory=True):
    """Attention and a Gated-DeltaNet-style memory layer (short convolution included): both take packed rows."""
    torch.manual_seed(seed)
    return LanguageModel({
        "vocab_size": vocab_size, "d_model": 16, "num_layers": 2 if memory else 1,
        "layers": ["attn", "mem"] if memory else ["attn"],
        "mixers": {"attn": {"name": "attention", "num_heads": 2},
                   "mem": {"name": "memory", "num_heads": 2, "memory": {
                       "memory": {"name": "linear"}, "attentional_bias": {"name": "l2"},
                       "retention": {"name": "decay"}, "feature_map": {"name": "identity"},
                       "inner_optimizer": {"name": "gd", "lr": 1.0}, "window": {"name": "omega", "size": 1},
                       "chunk_size": 1}, "mode": "chunked"}}})


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_and_ends_documents_with_256():
    tok = build_tokenizer("byte")
    ids = tok.encode("héllo")
    assert tok.vocab_size == 257 and tok.eos_id == 256 and max(ids) < 256
    assert tok.decode(ids + [256]) == "héllo"
    assert tok.token_bytes().tolist()[:3] == [1, 1, 1] and tok.token_bytes()[256] == 0


def test_bpe_local_is_deterministic_cached_and_readable_as_hf(tmp_path, monkeypatch):
    a = build_tokenizer({"name": "bpe_local", "vocab_size": 400, "cache_dir": str(tmp_path / "a")})
    b = build_tokenizer({"name": "bpe_local", "vocab_size": 400, "cache_dir": str(tmp_path / "b")})
    assert a.path.read_text() == b.path.read_text()                 # two trainings, the same vocabulary
    assert a.vocab_size == 400 and a.eos_id == 0
    text = "Héllo wörld: def f(x): return x  # ok"
    ids = a.encode(text)
    assert a.decode(ids) == text and len(ids) < len(text.encode())
    assert int(a.token_bytes()[ids].sum()) == len(text.encode("utf-8"))   # exact bytes per token (bpb)

    def no_training(*args, **kw):
        raise AssertionError("retrained although cached")
    monkeypatch.setattr(tokmod, "train_local_bpe", no_training)
    c = build_tokenizer({"name": "bpe_local", "vocab_size": 400, "cache_dir": str(tmp_path / "a")})
    assert c.encode(text) == ids and c.fingerprint == a.fingerprint
    with pytest.raises(AssertionError, match="retrained"):           # another vocabulary size is another file
        build_tokenizer({"name": "bpe_local", "vocab_size": 401, "cache_dir": str(tmp_path / "a")})

    hf = build_tokenizer({"name": "hf", "path": str(a.path)})        # a tokenizer.json file
    assert hf.encode(text) == ids and hf.eos_id == 0 and hf.fingerprint == a.fingerprint
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(a.path.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert build_tokenizer({"name": "hf", "path": str(folder)}).eos_id == 0


def test_tokenizer_errors_name_the_field(tmp_path):
    cases = [({"name": "bpe_locl"}, r"task\.tokenizer\.name: unknown tokenizer 'bpe_locl'.*Did you mean 'bpe_local'"),
             ({"name": "hf"}, r"task\.tokenizer\.path: an hf tokenizer needs path"),
             ({"name": "hf", "path": str(tmp_path / "none.json")}, r"task\.tokenizer\.path: no such file"),
             ({"name": "bpe_local", "vocab_size": 100}, r"task\.tokenizer\.vocab_size: bad value 100"),
             ({"name": "hf", "path": str(tmp_path)}, r"task\.tokenizer\.path: .*(tokenizer\.json|transformers)")]
    for node, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            build_tokenizer(node, "task.tokenizer")
    src = build_tokenizer({"name": "bpe_local", "vocab_size": 300, "cache_dir": str(tmp_path / "c")})
    with pytest.raises(ConfigError, match=r"task\.tokenizer\.eos_token: .*'</zz>'"):
        build_tokenizer({"name": "hf", "path": str(src.path), "eos_token": "</zz>"}, "task.tokenizer")


# --------------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------------
def _random_docs(seed=0, n=30):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, 50, int(rng.integers(1, 25)))) for _ in range(n)]


def test_rows_tile_the_stream_and_no_target_crosses_a_document():
    docs, T, eos = _random_docs(), 8, 99
    stream = TokenStream.from_documents(docs, eos)
    rows = [stream.row(i, T) for i in range(stream.num_rows(T))]
    doc_of = np.repeat(np.arange(len(docs)), [len(d) + 1 for d in docs])
    predicted = []
    for i, r in enumerate(rows):
        pos = i * T + np.arange(T)
        assert np.array_equal(r.inputs, stream.tokens[pos])
        seg = np.searchsorted(r.segments, np.arange(T), side="right") - 1    # the segment of each position
        assert np.array_equal(doc_of[pos], doc_of[pos[r.segments]][seg])    # a segment is one document
        assert len(set(doc_of[pos[r.segments]])) == len(r.segments)          # … and each starts a new one
        for p in range(T):
            if r.targets[p] != IGNORE_INDEX:
                assert doc_of[pos[p] + 1] == doc_of[pos[p]] and r.targets[p] == stream.tokens[pos[p] + 1]
                predicted.append(pos[p] + 1)
            else:
                assert r.inputs[p] == eos and doc_of[pos[p] + 1] != doc_of[pos[p]]
    covered = rows and len(rows) * T + 1
    firsts = set(stream.starts.tolist())
    assert sorted(predicted) == [q for q in range(1, covered) if q not in firsts]   # each once, firsts never


def test_the_row_packer_gives_the_in_memory_rows():
    docs, T = _random_docs(1), 7
    stream = TokenStream.from_documents(docs, 0)
    packer, rows = RowPacker(T, 0), []
    for d in docs:
        packer.push(d)
        if len(rows) == 3:                                   # a saved and restored packer goes on the same
            state = json.loads(json.dumps(packer.state_dict()))
            packer = RowPacker(T, 0)
            packer.load_state_dict(state)
        while packer.ready():
            rows.append(packer.pop())
    assert len(rows) == stream.num_rows(T)
    for i, r in enumerate(rows):
        ref = stream.row(i, T)
        for name in ("inputs", "targets", "segments"):
            assert np.array_equal(getattr(r, name), getattr(ref, name)), (i, name)


def test_a_packed_batch_keeps_every_document_to_itself():
    """The model's logits for a packed batch equal each document piece run alone, and changing one document
    leaves every other position's logits unchanged: no attention, memory or convolution crosses a boundary."""
    docs, T = _random_docs(2, 12), 16
    stream = TokenStream.from_documents(docs, 0)
    batch = Batch.stack([stream.row(i, T) for i in range(3)])
    assert batch.cu_seqlens[0] == 0 and batch.cu_seqlens[-1] == 3 * T and len(batch.cu_seqlens) > 4
    model = _tiny_lm(64).double().eval()
    with torch.no_grad():
        logits = forward_batch(model, batch)
        flat = batch.inputs.reshape(-1)
        cu = batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            alone = model(flat[a:b].view(1, -1))[0]
            assert torch.allclose(logits.reshape(-1, 64)[a:b], alone, atol=1e-10)
        changed = flat.clone()
        a, b = cu[2], cu[3]
        changed[a:b] = (changed[a:b] + 7) % 50 + 1
        again = forward_batch(model, Batch(changed.view(3, T), batch.targets, cu_seqlens=batch.cu_seqlens))
        diff = (again - logits).reshape(-1, 64).abs().amax(-1)
        assert diff[a:b].min() > 0 and diff[:a].max() == 0 and diff[b:].max() == 0
        unpacked = model(batch.inputs)                          # without cu_seqlens the documents do mix
        assert not torch.allclose(unpacked, logits)


# --------------------------------------------------------------------------------------------------
# the task
# --------------------------------------------------------------------------------------------------
def test_jsonl_and_parquet_give_the_same_rows_and_held_out_documents_are_disjoint(data):
    a = build_task(_node(data, tokenizer="byte"))
    b = build_task(_node(data, tokenizer="byte", path="parquet", data_files=str(data / "train.parquet"),
                         text_field="body"))
    assert a.vocab_size == 257
    for split in ("train", "val", "test"):
        assert np.array_equal(a.stream(split).tokens, b.stream(split).tokens)
    names = {s: set(a.tokenizer.decode(a.stream(s).tokens.tolist()).split("doc")[1:]) for s in ("train", "val", "test")}
    ids = {s: {n[:3] for n in v} for s, v in names.items()}
    assert ids["val"] and ids["test"] and not (ids["train"] & ids["val"]) and not (ids["train"] & ids["test"])
    assert len(ids["train"]) + len(ids["val"]) + len(ids["test"]) == 120
    named = build_task(_node(data, tokenizer="byte", data_files={"train": str(data / "train.jsonl"),
                                                               "validation": str(data / "valid.jsonl")},
                             val_split="validation"))
    assert "val" in named.tokenizer.decode(named.stream("val").tokens.tolist())
    assert len({n[:3] for n in named.tokenizer.decode(named.stream("train").tokens.tolist()).split("doc")[1:]}) \
        + len(ids["test"]) == 120                                 # no train document is carved for val


def test_batches_are_pure_functions_of_the_seed_and_step_and_visit_every_row(data):
    task = build_task(_node(data))
    again = build_task(_node(data))
    n = task.num_train_examples()
    assert n > 8
    b0, b1 = task.batch("train", 3, 4, seed=0), again.batch("train", 3, 4, seed=0)
    assert torch.equal(b0.inputs, b1.inputs) and torch.equal(b0.cu_seqlens, b1.cu_seqlens)
    assert not torch.equal(task.batch("train", 3, 4, seed=1).inputs, b0.inputs)
    epoch = torch.cat([task.batch("train", s, 1, seed=0).inputs for s in range(n)])
    rows = torch.stack([torch.from_numpy(task.stream("train").row(i, 32).inputs) for i in range(n)])
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, rows.tolist()))
    masked = build_task(_node(data, boundaries="mask")).batch("train", 3, 4, seed=0)
    assert masked.cu_seqlens is None and torch.equal(masked.targets, b0.targets)


def test_config_errors_are_early_and_name_the_field(data):
    cases = [({"path": ""}, r"task\.path: lm_corpus needs path"),
             ({"data_files": str(data / "nope.jsonl")}, r"task\.data_files: no file matches"),
             ({"data_files": None}, r"task\.data_files: the 'json' builder reads local files"),
             ({"boundaries": "none"}, r"task\.boundaries: bad value 'none'.*packed, mask"),
             ({"val_fraction": 0.0}, r"task\.val_fraction: with no val_split"),
             ({"streaming": True, "eval_examples": 0}, r"task\.eval_examples: a streamed corpus"),
             ({"tokenizer": {"name": "bpe_local", "vocab_size": 9}}, r"task\.tokenizer\.vocab_size: bad value 9"),
             ({"text_fields": "x"}, r"task\.text_fields: .*no field")]
    for kw, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            build_task(_node(data, **kw))
    with pytest.raises(ConfigError, match=r"task\.text_field: the dataset has no column 'body'.*text, id"):
        build_task(_node(data, text_field="body")).batch("train", 0, 2)
    with pytest.raises(ConfigError, match=r"task\.boundaries: .*cannot take packed sequences.*boundaries: mask"):
        lm = LanguageModel({"vocab_size": 512, "d_model": 16, "num_layers": 1, "layers": ["mac"],
                            "mixers": {"mac": {"name": "mac", "segment": 8, "num_heads": 2}}})
        build_task(_node(data)).wrap(lm)


class Killed(Exception):
    pass


@pytest.mark.parametrize("streaming", [False, True], ids=["in_memory", "streaming"])
def test_a_resumed_run_sees_exactly_the_rows_it_had_not_seen(data, tmp_path, streaming, monkeypatch):
    """bpe_local end to end through the training loop: N steps, against N/2 + a kill + a resume of the rest."""
    node = _node(data, streaming=streaming, eval_examples=4, shuffle_buffer=16)
    cfg = dict(steps=8, batch_size=3, lr=1e-2, eval_interval=4, log_interval=1, checkpoint_interval=4, seed=1)
    ref_model = Recorder(_tiny_lm(512, memory=False))
    ref = train(ref_model, build_task(node), cfg)
    assert ref.metrics["train/loss"] < np.log(512) and {"test/loss", "test/ppl", "test/bpb"} <= set(ref.metrics)

    def kill_at_6(metrics, step):
        if step >= 6:
            raise Killed()
    first = Recorder(_tiny_lm(512, memory=False))
    with pytest.raises(Killed):
        train(first, build_task(node), cfg, callback=kill_at_6, checkpoint_dir=tmp_path)
    starts = []
    texts = LMCorpus._texts
    monkeypatch.setattr(LMCorpus, "_texts", lambda self, ds, start=0: (starts.append(start), texts(self, ds, start))[1])
    second = Recorder(_tiny_lm(512, seed=5, memory=False))
    res = train(second, build_task(node), cfg, checkpoint_dir=tmp_path)
    assert res.resumed_from == 4 and len(first.seen) == 6 and len(second.seen) == 4
    for (x, cx), (y, cy) in zip(ref_model.seen, first.seen[:4] + second.seen):
        assert torch.equal(x, y) and torch.equal(cx, cy)
    assert res.metrics == ref.metrics
    if streaming:                              # the cursor was restored, not the stream replayed from its start
        assert starts and starts[0] > 0


def test_relative_paths_are_taken_from_the_experiment_folder(data, tmp_path, monkeypatch):
    """Ray workers run in their trial folders; the driver's folder (ATLASLAB_BASE_DIR) anchors relative paths."""
    monkeypatch.chdir(tmp_path)
    node = _node(data, data_files="train.jsonl", tokenizer="byte", cache_dir="hf")
    with pytest.raises(ConfigError, match=r"task\.data_files: no file matches"):
        build_task(node)
    monkeypatch.setenv("ATLASLAB_BASE_DIR", str(data))
    task = build_task(node)
    assert task.num_train_examples() > 0 and task.stream("train").num_documents > 80


def test_a_shipped_corpus_is_read_with_its_own_split_the_one_bpe_local_trains_on(data):
    """corpus: pydoc — documents are the corpus' pieces, each split the corpus' own (the tokenizer's held-out
    text is the task's); other sources, streaming and fractions other than the tokenizer's are refused."""
    from atlaslab.tasks.corpus import corpus_pieces, load_corpus
    tok = {"name": "bpe_local", "vocab_size": 512, "val_fraction": 0.05, "test_fraction": 0.2,
           "cache_dir": str(data / "tok")}
    node = {"name": "lm_corpus", "corpus": "pydoc", "seq_len": 64, "val_fraction": 0.05, "test_fraction": 0.2,
            "eval_examples": 0, "tokenizer": tok, "shuffle": False}
    task = build_task(node)
    pieces = corpus_pieces("pydoc", 0.05, 0.2)
    for split in ("train", "val", "test"):
        want = TokenStream.from_documents(task.tokenizer.encode_batch(list(pieces[split])), task.tokenizer.eos_id)
        assert np.array_equal(task.stream(split).tokens, want.tokens), split
    assert task.info()["corpus_sha256"] == load_corpus("pydoc").sha256
    cases = [({"path": "json"}, r"task\.path: corpus: 'pydoc' is the source.*drop path"),
             ({"val_split": "validation"}, r"task\.val_split: .*drop val_split"),
             ({"streaming": True}, r"task\.streaming: a shipped corpus is read in memory"),
             ({"test_fraction": 0.1}, r"task\.test_fraction: .*set test_fraction equal to tokenizer\.test_fraction \(0\.2\)"),
             ({"corpus": "no_such.txt"}, r"task\.corpus: no such corpus file")]
    for kw, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            build_task({**node, **kw})
