"""Language modelling on a real corpus read with Hugging Face ``datasets``, tokenised and packed into rows.

    task: {name: lm_corpus, path: json, data_files: data/*.jsonl, text_field: text, seq_len: 512,
           tokenizer: {name: bpe_local, vocab_size: 4096}}

Sources (``path``, ``data_files``, ``name``, ``split``: the arguments of ``datasets.load_dataset``): a builder
over local files (``json`` for jsonl, ``parquet``, ``arrow``, ``csv``, ``text``), a folder written by
``save_to_disk``, or a hub name on a machine with network. ``streaming: true`` reads corpora larger than memory
document by document. ``datasets`` is imported only when data is first needed (validation needs none of it).
Or ``corpus:`` a shipped corpus (:mod:`atlaslab.tasks.corpus`: ``pydoc``, ``gensim_lee``, a text file), read with
no file to prepare: its pieces are the documents and its own train / val / test split is the task's, the one
``bpe_local`` trains on (the fractions must then equal the tokenizer's, so neither ever sees held-out text).

Splits: ``val_split`` / ``test_split`` name splits of the dataset (e.g. ``validation``); left empty, a fixed
fraction of the train split's documents is held out instead, chosen by a hash of each document's index (the
same documents for every seed, disjoint from training).

Rows (:mod:`atlaslab.tasks.packing`): documents are tokenised, ended with the tokenizer's EOS, concatenated and
cut into rows of ``seq_len`` tokens. A target never crosses a document (the EOS's target is ignored), and with
``boundaries: packed`` (the default) neither does attention: a batch goes to the model as one packed sequence
with ``cu_seqlens`` (:func:`atlaslab.tasks.base.forward_batch`), so a layer restarts at every document start —
the same logits as running each document piece alone. ``boundaries: mask`` keeps the target masking only, for
models whose blocks cannot take packed sequences (Titans' MAC / MAG / MAL): attention then reads across a
document start, as in the usual concatenate-and-chunk pipelines.

Order and resumption
    In memory (``streaming: false``): the train documents are shuffled once by the task seed, packed, and the
    rows visited in epochs, each a permutation drawn from (task seed, training seed, epoch) — the batch at step
    ``s`` is a pure function of (config, seed, s), so a resumed run sees exactly the rows it had not seen.
    Streaming: documents come in the stream's order, through ``datasets``' shuffle buffer (seeded by the task
    and training seeds, reseeded each epoch), and rows follow one another; the batch at step ``s`` is rows
    ``[s·B, (s+1)·B)`` of that stream. The task keeps a cursor (epoch, documents read, the packer's carried
    tokens) that the training loop stores in its checkpoint (:meth:`LMCorpus.data_state`), so a resumed run
    reads on from there; without one, the stream is replayed from its start up to the step asked for.
    Data-parallel (:meth:`LMCorpus.shard_stream`), rank r of N tokenises and packs only documents i ≡ r (mod N)
    of that stream, and its rows are its shards of the steps' batches: the global batch of a step is the ranks'
    rows side by side, so it depends on N (in memory it does not). Each rank's cursor goes into the checkpoint.

Metrics: ``loss`` (nats per token), ``ppl`` and next-token ``accuracy`` over every scored token, plus ``bpb``
(bits per UTF-8 byte of the predicted tokens) when the tokenizer can say how many bytes each token is (byte,
byte-level BPE), the number to compare across tokenizers.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from atlaslab.registry import ConfigError, check_choice, check_range, local_path, register, resolve_part, to_container
from atlaslab.tasks.base import Batch, Example, Task, TaskConfig, make_rng
from atlaslab.tasks.corpus import corpus_pieces, load_corpus
from atlaslab.tasks.packing import RowPacker, TokenStream
from atlaslab.tasks.tokenizer import build_tokenizer

BUILDERS = ("json", "parquet", "arrow", "csv", "text")
TOKENIZE_BATCH = 512


def _held_out_u(indices: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) for each document index (splitmix64 of the index): the held-out draw."""
    z = (np.asarray(indices, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _local_files(data_files: Any) -> Any:
    """``data_files`` with every file name made absolute (:func:`atlaslab.registry.local_path`)."""
    if data_files is None or isinstance(data_files, str):
        return local_path(data_files) if data_files else data_files
    if isinstance(data_files, dict):
        return {k: _local_files(v) for k, v in data_files.items()}
    return [local_path(str(f)) for f in data_files]


def _files(data_files: Any) -> List[str]:
    """Every file name in a ``data_files`` node (a string, a list, or a mapping split → either)."""
    if data_files is None:
        return []
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _files(v)]
    return [str(f) for f in data_files]


def _is_saved_dataset(path: str) -> bool:
    p = Path(local_path(path))
    return p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file())


@register("task", "lm_corpus")
class LMCorpus(Task):
    """Language modelling on a Hugging Face ``datasets`` corpus, packed rows with document boundaries."""

    @dataclass
    class Config(TaskConfig):
        seq_len: int = 512
        eval_examples: int = 512      # rows in each of val / test (0: every row; not with streaming)
        path: str = ""                # json | parquet | arrow | csv | text | a save_to_disk folder | a hub name
        data_files: Any = None        # file(s) (globs), or {split: file(s)}
        name: str = ""                # the dataset's configuration name
        split: str = "train"          # the split trained on
        text_field: str = "text"
        val_split: str = ""           # a split of the dataset; "": val_fraction of the train split's documents
        test_split: str = ""          # likewise with test_fraction
        val_fraction: float = 0.01
        test_fraction: float = 0.01
        tokenizer: Any = field(default_factory=lambda: {"name": "bpe_local"})
        boundaries: str = "packed"    # packed (cu_seqlens: attention restarts per document) | mask (targets only)
        shuffle: bool = True          # train documents in an order from the seeds
        streaming: bool = False       # read documents one by one (corpora larger than memory)
        shuffle_buffer: int = 10000   # streaming: documents in the shuffle buffer
        max_documents: int = 0        # 0: all; else only the first N documents of each source split
        cache_dir: str = ""           # datasets' cache ("": its default)
        corpus: str = ""              # a shipped corpus (pydoc | gensim_lee | a text file) instead of path

        def check(self) -> None:
            super().check()
            if self.corpus:
                self._check_corpus()
            elif not self.path:
                raise ConfigError("path", "lm_corpus needs path: a builder over local files (with data_files), "
                                  "a save_to_disk folder or a hub name; or corpus: a shipped corpus.",
                                  choices=list(BUILDERS) + ["corpus: pydoc"])
            files = _files(_local_files(to_container(self.data_files)))
            if self.path in BUILDERS and not files:
                raise ConfigError("data_files", f"the '{self.path}' builder reads local files: give data_files.")
            for i, f in enumerate(files):
                if not glob.glob(f) and "://" not in f:
                    raise ConfigError("data_files", f"no file matches {f!r}.", value=f)
            check_choice("boundaries", self.boundaries, ("packed", "mask"))
            for name in ("val", "test"):
                frac = getattr(self, f"{name}_fraction")
                check_range(f"{name}_fraction", frac, 0.0, 0.5)
                if not getattr(self, f"{name}_split") and frac <= 0:
                    raise ConfigError(f"{name}_fraction", f"with no {name}_split, {name}_fraction of the train "
                                      "documents must be > 0.", value=frac)
            if self.val_fraction + self.test_fraction >= 1:
                raise ConfigError("val_fraction", "val_fraction + test_fraction must be < 1.", value=self.val_fraction)
            check_range("shuffle_buffer", self.shuffle_buffer, 1, None)
            check_range("max_documents", self.max_documents, 0, None)
            if self.streaming and self.eval_examples == 0:
                raise ConfigError("eval_examples", "a streamed corpus needs a number of evaluation rows (> 0).",
                                  value=0)
            tok = resolve_part("tokenizer", self.tokenizer, "tokenizer")
            if self.corpus and tok.name == "bpe_local" and tok.corpus == self.corpus:
                for name in ("val_fraction", "test_fraction"):
                    if getattr(tok, name) != getattr(self, name):
                        raise ConfigError(name, f"the corpus' split must be the one the bpe_local tokenizer trains "
                                          f"on, or held-out text shapes the vocabulary: set {name} equal to "
                                          f"tokenizer.{name} ({getattr(tok, name)}).", value=getattr(self, name))

        def _check_corpus(self) -> None:
            """A shipped corpus: no dataset arguments beside it; its split is the task's (in memory)."""
            for name, empty in (("path", ""), ("data_files", None), ("val_split", ""), ("test_split", "")):
                if getattr(self, name) != empty:
                    raise ConfigError(name, f"corpus: {self.corpus!r} is the source and brings its own split; "
                                      f"drop {name}.", value=getattr(self, name))
            if self.streaming:
                raise ConfigError("streaming", "a shipped corpus is read in memory.", value=True)
            load_corpus(self.corpus)     # an unknown name or a missing file: ConfigError at 'corpus'

    primary_metric = "loss"
    primary_mode = "min"
    report_exact_match = False

    def __init__(self, cfg, **context):
        super().__init__(cfg, **context)
        self.tokenizer = build_tokenizer(cfg.tokenizer, "tokenizer")
        self._streams: Dict[str, TokenStream] = {}        # in memory: split → packed token stream
        self._eval_rows: Dict[tuple, List[Example]] = {}  # streaming: (split, length) → the evaluation rows
        self._cursor: Optional[Dict[str, Any]] = None     # streaming: where the train rows stand
        self._saved: Optional[Dict[str, Any]] = None      # streaming: a cursor restored from a checkpoint
        self._rows: Optional[Iterator[Example]] = None
        self._shard = (0, 1)                              # streaming, data-parallel: (rank, ranks)
        tb = self.tokenizer.token_bytes()
        self._token_bytes = None if tb is None else torch.from_numpy(tb)

    # -- description --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def info(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self.cfg)
        out.update(vocab_size=self.vocab_size, eos_id=int(self.tokenizer.eos_id),
                   tokenizer_sha256=self.tokenizer.fingerprint)
        if self.cfg.corpus:              # its text changes a little between Python versions (pydoc)
            out["corpus_sha256"] = load_corpus(self.cfg.corpus).sha256
        return out

    # -- sources ------------------------------------------------------------------------------------
    def _source_split(self, split: str) -> tuple:
        """``(dataset split, carved)``: where ``split``'s documents come from, and whether they are the held-out
        fraction of the train split (else the whole dataset split, less what other splits carve from it)."""
        c = self.cfg
        if split == "train" or c.corpus:
            return (split if c.corpus else c.split), False
        own = getattr(c, f"{split}_split")
        return (own, False) if own else (c.split, True)

    def _assign(self, indices: np.ndarray) -> np.ndarray:
        """The split ('train' / 'val' / 'test') of each document index of the train split."""
        c = self.cfg
        u = _held_out_u(indices)
        out = np.full(len(u), "train", dtype=object)
        test_f = 0.0 if c.test_split else c.test_fraction
        val_f = 0.0 if c.val_split else c.val_fraction
        out[u < test_f + val_f] = "val"
        out[u < test_f] = "test"
        return out

    def _load(self, split_name: str, streaming: bool):
        """The dataset split (``datasets.Dataset``, or ``IterableDataset`` when streaming)."""
        c = self.cfg
        try:
            import datasets
        except ImportError:
            raise ConfigError("task.path", "lm_corpus needs the datasets library (pip install 'atlaslab[data]').",
                              value=c.path) from None
        if c.corpus:                     # a shipped corpus: its pieces of this split, in corpus order
            docs = list(corpus_pieces(c.corpus, c.val_fraction, c.test_fraction)[split_name])
            return datasets.Dataset.from_dict({c.text_field: docs[:c.max_documents or None]})
        try:
            if _is_saved_dataset(c.path):
                ds = datasets.load_from_disk(local_path(c.path))
                if isinstance(ds, datasets.DatasetDict):
                    if split_name not in ds:
                        raise ConfigError("task.split", f"{c.path!r} has no split {split_name!r}.",
                                          value=split_name, choices=list(ds))
                    ds = ds[split_name]
                return ds.to_iterable_dataset() if streaming else ds
            path = local_path(c.path) if Path(local_path(c.path)).exists() else c.path   # a local folder, or a name
            ds = datasets.load_dataset(path, name=c.name or None, data_files=_local_files(to_container(c.data_files)),
                                       split=split_name, streaming=streaming,
                                       cache_dir=local_path(c.cache_dir) if c.cache_dir else None)
        except ConfigError:
            raise
        except (ValueError, KeyError) as exc:
            if "split" in str(exc).lower():
                raise ConfigError("task.split", f"cannot load split {split_name!r} of {c.path!r} ({exc}).",
                                  value=split_name) from None
            raise ConfigError("task.path", f"cannot load {c.path!r} ({exc}).", value=c.path) from None
        except Exception as exc:
            raise ConfigError("task.path", f"cannot load {c.path!r} ({type(exc).__name__}: {exc}).",
                              value=c.path) from None
        if c.max_documents:
            ds = ds.take(c.max_documents) if streaming else ds.select(range(min(c.max_documents, len(ds))))
        return ds

    def _check_field(self, columns) -> None:
        if columns is not None and self.cfg.text_field not in columns:
            raise ConfigError("task.text_field", f"the dataset has no column {self.cfg.text_field!r}.",
                              value=self.cfg.text_field, choices=list(columns))

    def _texts(self, ds, start: int = 0) -> Iterator[str]:
        """The text of each document of a (streamed) dataset, from document ``start`` on."""
        field_ = self.cfg.text_field
        it = iter(ds)
        first = next(it, None)
        if first is None:
            return
        self._check_field(list(first))
        for ex in itertools.islice(itertools.chain([first], it), start, None):
            yield str(ex[field_] or "")

    def _tokenize(self, texts) -> Iterator[tuple]:
        """``(n, ids)`` for each non-blank text, tokenised in batches; ``n``: texts read up to and including it."""
        it, n = iter(texts), 0
        while True:
            chunk = list(itertools.islice(it, TOKENIZE_BATCH))
            if not chunk:
                return
            kept = [(n + j + 1, t) for j, t in enumerate(chunk) if t.strip()]
            n += len(chunk)
            if kept:
                yield from zip([k for k, _ in kept], self.tokenizer.encode_batch([t for _, t in kept]))

    # -- in memory ----------------------------------------------------------------------------------
    def stream(self, split: str) -> TokenStream:
        """The packed token stream of ``split`` (loaded and tokenised once; in memory only)."""
        if self.cfg.streaming:
            raise RuntimeError("lm_corpus: a streamed corpus has no in-memory token stream")
        if split not in self._streams:
            self._streams[split] = self._build_stream(split)
        return self._streams[split]

    def _build_stream(self, split: str) -> TokenStream:
        c = self.cfg
        name, carved = self._source_split(split)
        ds = self._load(name, streaming=False)
        self._check_field(ds.column_names)
        texts = ds[c.text_field] if len(ds) else []
        keep = np.arange(len(texts))
        if (split == "train" and not c.corpus) or carved:   # a shipped corpus' train split is all train
            keep = keep[self._assign(keep) == split]
        if split == "train" and c.shuffle:
            keep = keep[make_rng(0x5EED, c.seed).permutation(len(keep))]
        docs = (ids for _, ids in self._tokenize(str(texts[int(i)] or "") for i in keep))
        out = TokenStream.from_documents(docs, self.tokenizer.eos_id)
        if out.num_rows(2) == 0:
            raise ConfigError("task", f"lm_corpus: the {split} split of {c.corpus or c.path!r} has no text (documents: "
                              f"{len(keep)}); check text_field, the split names and the held-out fractions.")
        return out

    # -- streaming ----------------------------------------------------------------------------------
    def _stream_source(self, split: str, epoch: int = 0, seed: int = 0):
        """The streamed documents of ``split``: carved, and for train shuffled by (task seed, seed, epoch)."""
        c = self.cfg
        name, carved = self._source_split(split)
        ds = self._load(name, streaming=True)
        if split == "train" or carved:
            ds = ds.filter(lambda _ex, i: self._assign(np.asarray([i]))[0] == split, with_indices=True)
        if split == "train" and c.shuffle:
            ds = ds.shuffle(seed=int(make_rng(0x5EED, c.seed, seed).integers(0, 2 ** 31)), buffer_size=c.shuffle_buffer)
            ds.set_epoch(epoch)
        return ds

    def _stream_eval_rows(self, split: str, length: int) -> List[Example]:
        key = (split, int(length))
        if key not in self._eval_rows:
            packer = RowPacker(length, self.tokenizer.eos_id)
            rows: List[Example] = []
            want = int(self.cfg.eval_examples)
            for _, doc in self._tokenize(self._texts(self._stream_source(split))):
                packer.push(doc)
                while packer.ready() and len(rows) < want:
                    rows.append(packer.pop())
                if len(rows) >= want:
                    break
            self._eval_rows[key] = rows
        return self._eval_rows[key]

    def _train_row_iter(self, cursor: Dict[str, Any]) -> Iterator[Example]:
        """Train rows from ``cursor`` on (updated in place as rows are produced), epoch after epoch."""
        packer = RowPacker(self.seq_len, self.tokenizer.eos_id)
        packer.load_state_dict(cursor.get("packer"))
        while True:
            produced = False
            start = cursor["docs"]
            texts = self._own_texts(self._texts(self._stream_source("train", cursor["epoch"], cursor["seed"]), start),
                                    start)
            for n, doc in self._tokenize(texts):
                packer.push(doc)
                cursor["docs"] = start + n
                while packer.ready():
                    produced = True
                    row = packer.pop()
                    cursor["row"] += 1
                    cursor["packer"] = packer.state_dict()
                    yield row
            if not produced and start == 0:
                raise ConfigError("task", f"lm_corpus: the streamed train split of {self.cfg.path!r} gives no row "
                                  f"of {self.seq_len} tokens.")
            cursor.update(epoch=cursor["epoch"] + 1, docs=0)

    def _own_texts(self, texts: Iterator[str], start: int) -> Iterator[str]:
        """This rank's documents of the stream (from document ``start``): document i belongs to rank i mod N; the
        others pass as blank texts, which the tokeniser skips, so every rank's cursor counts the same documents."""
        rank, world = self._shard
        if world == 1:
            return texts
        return (t if (start + j) % world == rank else "" for j, t in enumerate(texts))

    def shard_stream(self, rank: int, world: int) -> bool:
        """Streaming: each of ``world`` ranks reads the stream but tokenises and packs only its own documents
        (document i is rank i mod ``world``'s), its rows its shard of every step; the cursor is per rank. In
        memory: False (every rank holds the whole token stream, and a step's batch is a function of the step)."""
        if not self.cfg.streaming:
            return False
        self._shard = (int(rank), int(world))
        self._cursor = self._rows = None
        return True

    def _stream_train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        first = int(step) * int(batch_size)
        cur = self._cursor
        if cur is None or cur["seed"] != int(seed) or cur["row"] > first:
            saved = self._saved
            if saved is not None and saved["seed"] == int(seed) and saved["row"] <= first:
                cur = {**saved, "packer": dict(saved["packer"])}
            else:
                cur = {"seed": int(seed), "epoch": 0, "docs": 0, "row": 0, "packer": None}
            self._cursor, self._rows = cur, None
        if self._rows is None:
            self._rows = self._train_row_iter(cur)
        while cur["row"] < first:            # replay up to the step (a cursor behind it, or none)
            next(self._rows)
        return Batch.stack([self._finish(next(self._rows)) for _ in range(int(batch_size))])

    def data_state(self) -> Optional[Dict[str, Any]]:
        """The streaming cursor (JSON-ready; None in memory, where batches are pure functions of the step).
        The training loop saves it with its checkpoint and hands it back through :meth:`load_data_state`."""
        if not self.cfg.streaming or self._cursor is None:
            return None
        c = self._cursor
        return {"seed": c["seed"], "epoch": c["epoch"], "docs": c["docs"], "row": c["row"],
                "packer": c["packer"] or {"buffer": [], "starts": []}, "shard": list(self._shard)}

    def load_data_state(self, state: Optional[Dict[str, Any]]) -> None:
        if state:
            shard = tuple(state.get("shard", (0, 1)))
            if shard != self._shard:
                raise ConfigError("resources.workers_per_trial", f"the checkpoint's stream cursor is rank {shard[0]} "
                                  f"of {shard[1]}'s (each rank reads its own documents), this process is rank "
                                  f"{self._shard[0]} of {self._shard[1]}: resume with the same number of workers.",
                                  value=self._shard[1])
            self._saved = dict(state)

    # -- the Task interface -------------------------------------------------------------------------
    def _finish(self, ex: Example) -> Example:
        if self.cfg.boundaries == "mask":
            ex.segments = None
        return ex

    def num_train_examples(self) -> Optional[int]:
        return None if self.cfg.streaming else self.stream("train").num_rows(self.seq_len)

    def eval_size(self, split: str, length: int) -> int:
        if self.cfg.streaming:
            return len(self._stream_eval_rows(split, length))
        n = self.stream(split).num_rows(length)
        return min(n, int(self.cfg.eval_examples)) if self.cfg.eval_examples else n

    def example(self, split: str, index: int, length: Optional[int] = None, stream: int = 0) -> Example:
        length = self.seq_len if length is None else int(length)
        if self.cfg.streaming:
            if split == "train":
                raise RuntimeError("lm_corpus: streamed train rows come in order, through batch()")
            rows = self._stream_eval_rows(split, length)
            if index >= len(rows):
                raise IndexError(f"lm_corpus: {split} has {len(rows)} rows of {length} tokens")
            return self._finish(dataclasses.replace(rows[index]))
        return self._finish(self.stream(split).row(int(index), length))

    def batch(self, split: str, step: int, batch_size: int, seed: int = 0, length: Optional[int] = None) -> Batch:
        if self.cfg.streaming and split == "train":
            if length is not None and int(length) != self.seq_len:
                raise ValueError(f"lm_corpus: streamed train rows have seq_len {self.seq_len}, not {length}")
            return self._stream_train_batch(step, batch_size, seed)
        return super().batch(split, step, batch_size, seed, length)

    def wrap(self, model):
        if self.cfg.boundaries == "packed" and hasattr(model, "layers") and hasattr(model, "layer_keys"):
            cannot = [k for k, lay in zip(model.layer_keys, model.layers)
                      if not getattr(lay.mixer, "takes_packed", False)]
            if cannot:
                raise ConfigError("task.boundaries", f"boundaries: packed runs each document as its own sequence, "
                                  f"and mixers {sorted(set(cannot))} cannot take packed sequences; use "
                                  "boundaries: mask (targets never cross a document, attention does).",
                                  value="packed", choices=["packed", "mask"])
        return model

    def extra_totals(self, batch: Batch, mask: torch.Tensor) -> Dict[str, float]:
        if self._token_bytes is None:
            return {}
        tb = self._token_bytes.to(batch.targets.device)
        return {"bytes": float(tb[batch.targets.clamp_min(0)][mask].sum().item())}

    def extra_metrics(self, totals: Dict[str, float]) -> Dict[str, float]:
        nll = totals["nll"] / max(totals["tokens"], 1.0)
        out = {"ppl": math.exp(min(nll, 50.0))}
        if "bytes" in totals and totals["bytes"] > 0:
            out["bpb"] = totals["nll"] / math.log(2.0) / totals["bytes"]
        return out


__all__ = ["LMCorpus"]
