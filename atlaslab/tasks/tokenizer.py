"""Tokenizers for language modelling (registry kind ``"tokenizer"``): text → token ids, with an end-of-document id.

    tok = build_tokenizer({"name": "bpe_local", "vocab_size": 1024})
    ids = tok.encode_batch(["first document", "second"])    # [[…], […]] (no EOS: the task appends it)
    tok.eos_id, tok.vocab_size, tok.decode(ids[0])

``byte``
    UTF-8 bytes (ids 0–255) plus an end-of-document id 256: vocabulary 257, nothing to load.
``hf``
    Any local Hugging Face tokenizer: a ``tokenizer.json`` file or a directory holding one (read with the
    ``tokenizers`` library), or a directory that only ``transformers.AutoTokenizer`` reads (``transformers`` is
    optional and imported only then). Nothing is downloaded.
``bpe_local``
    A byte-level BPE trained with ``tokenizers`` on the train split of a shipped corpus
    (:mod:`atlaslab.tasks.corpus`, ``pydoc`` by default; held-out text never shapes the vocabulary), in well
    under a second for 1–4 K merges. The result is cached as JSON under ``cache_dir`` (default
    ``$ATLASLAB_CACHE/tokenizers``, else ``~/.cache/atlaslab/tokenizers``) in a file named by a hash of everything
    that determines it (corpus SHA-256, split fractions, vocabulary size, minimum frequency, ``tokenizers``
    version), so every run with the same settings reads the same vocabulary.

Every tokenizer has a :attr:`Tokenizer.fingerprint` (SHA-256 of its definition) that a task puts in its
``info()``, so a checkpoint cannot be resumed, or evaluated, with another vocabulary.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

import numpy as np

from atlaslab.registry import ConfigError, PartConfig, check_range, get_registry, local_path, register, resolve_part
from atlaslab.tasks.corpus import corpus_splits, load_corpus

#: end-of-text tokens looked for (in this order) when an ``hf`` tokenizer's EOS is not named
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
BPE_EOS = "<|endoftext|>"


class Tokenizer:
    """Base of the registered tokenizers: ``vocab_size``, ``eos_id``, ``encode_batch``, ``decode``."""

    Config = PartConfig
    vocab_size: int
    eos_id: int

    def __init__(self, cfg: PartConfig, **context: Any):
        self.cfg = cfg

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text (no special tokens added)."""
        raise NotImplementedError

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (the EOS id and ids outside the vocabulary are dropped)."""
        raise NotImplementedError

    def token_bytes(self) -> Optional[np.ndarray]:
        """``[vocab_size]`` int64: the UTF-8 bytes each id stands for (0 for special ids), when exact — for
        bits per byte; None when the tokenizer cannot say (a non-byte-level ``hf`` tokenizer)."""
        return None

    @property
    def fingerprint(self) -> str:
        raise NotImplementedError

    def info(self) -> dict:
        return {"name": self.cfg.name, "vocab_size": int(self.vocab_size), "eos_id": int(self.eos_id),
                "fingerprint": self.fingerprint}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


@register("tokenizer", "byte")
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0–255 and an end-of-document id 256 (vocabulary 257)."""

    @dataclass
    class Config(PartConfig):
        pass

    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts):
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self):
        out = np.ones(self.vocab_size, dtype=np.int64)
        out[self.eos_id] = 0
        return out

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(b"atlaslab-byte-257").hexdigest()


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte → the byte."""
    from tokenizers import pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()   # the 256 characters, in no particular order
    # GPT-2's table: printable Latin-1 bytes map to themselves, the rest to U+0100 + n, in byte order
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    if set(table) != set(alphabet):  # pragma: no cover - a tokenizers release with another alphabet
        raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
    return table


class _TokenizersBackend(Tokenizer):
    """A ``tokenizers.Tokenizer`` (``self.tok``) with a named EOS."""

    tok: Any

    def _setup(self, tok: Any, eos_token: str, path: str, definition: str) -> None:
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        eos = tok.token_to_id(eos_token) if eos_token else None
        if eos is None:
            raise ConfigError(path, f"the tokenizer has no token {eos_token!r} to end documents with; name one "
                              "it has (e.g. eos_token: '</s>').", value=eos_token)
        self.eos_id = int(eos)
        self._fingerprint = hashlib.sha256(definition.encode("utf-8")).hexdigest()

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) != self.eos_id]
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self):
        if type(self.tok.decoder).__name__ != "ByteLevel":
            return None
        table = _byte_decoder()
        out = np.zeros(self.vocab_size, dtype=np.int64)
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if piece is None or piece in special:
                continue
            if not all(ch in table for ch in piece):
                return None
            out[i] = len(piece)
        return out

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _eos_from_config(directory: Path) -> str:
    """The ``eos_token`` a ``tokenizer_config.json`` / ``special_tokens_map.json`` beside the tokenizer names."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        tok = _read_json(directory / name).get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tok:
            return tok
    return ""


@register("tokenizer", "hf")
class HFTokenizer(_TokenizersBackend):
    """Any local Hugging Face tokenizer (``tokenizer.json`` via ``tokenizers``; else ``transformers``)."""

    @dataclass
    class Config(PartConfig):
        path: str = ""              # a tokenizer.json file, or a directory with one (or one AutoTokenizer reads)
        eos_token: str = ""         # "": the tokenizer config's eos_token, else the first of EOS_CANDIDATES it has
        backend: str = "auto"       # auto | tokenizers | transformers

        def check(self) -> None:
            if not self.path:
                raise ConfigError("path", "an hf tokenizer needs path: a tokenizer.json file or a directory.")
            if self.backend not in ("auto", "tokenizers", "transformers"):
                raise ConfigError("backend", f"bad value {self.backend!r}.", value=self.backend,
                                  choices=["auto", "tokenizers", "transformers"])
            if not Path(local_path(self.path)).exists():
                raise ConfigError("path", f"no such file or directory {self.path!r}.", value=self.path)

    def __init__(self, cfg, **context):
        super().__init__(cfg, **context)
        p = Path(local_path(cfg.path))
        file = p if p.is_file() else p / "tokenizer.json"
        if cfg.backend == "transformers" or (cfg.backend == "auto" and not file.is_file()):
            self._load_transformers(p)
            return
        if not file.is_file():
            raise ConfigError("path", f"no tokenizer.json at {cfg.path!r}.", value=cfg.path)
        from tokenizers import Tokenizer as HFTok
        try:
            tok = HFTok.from_file(str(file))
        except Exception as exc:
            raise ConfigError("path", f"cannot read {file} as a tokenizers JSON ({exc}).", value=cfg.path) from None
        eos = cfg.eos_token or _eos_from_config(file.parent) or next(
            (c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None), "")
        if not eos:
            raise ConfigError("eos_token", f"{file} names no end-of-text token and has none of "
                              f"{', '.join(EOS_CANDIDATES)}; set eos_token.", choices=list(EOS_CANDIDATES))
        self._setup(tok, eos, "eos_token", file.read_text(encoding="utf-8"))

    def _load_transformers(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("path", f"{str(directory)!r} has no tokenizer.json; reading it needs transformers "
                              "(pip install transformers).", value=str(directory)) from None
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:
            raise ConfigError("path", f"transformers cannot load a tokenizer from {str(directory)!r} ({exc}).",
                              value=str(directory)) from None
        backend = getattr(hf, "backend_tokenizer", None)
        eos = self.cfg.eos_token or (hf.eos_token or "")
        if backend is not None:     # a fast tokenizer: its tokenizers object does the work
            self._setup(backend, eos, "eos_token", backend.to_str())
            return
        self._hf = hf               # a slow (Python) tokenizer
        self.vocab_size = int(len(hf))
        eos_id = hf.convert_tokens_to_ids(eos) if eos else None
        if eos_id is None or eos_id == hf.unk_token_id:
            raise ConfigError("eos_token", f"the tokenizer at {str(directory)!r} has no end-of-text token "
                              f"{eos!r}; set eos_token.", value=eos)
        self.eos_id = int(eos_id)
        vocab = json.dumps(sorted(hf.get_vocab().items()))
        self._fingerprint = hashlib.sha256(vocab.encode("utf-8")).hexdigest()
        self.tok = None

    def encode_batch(self, texts):
        if self.tok is None:
            return [self._hf.encode(t, add_special_tokens=False) for t in texts]
        return super().encode_batch(texts)

    def decode(self, ids):
        if self.tok is None:
            return self._hf.decode([int(i) for i in ids if int(i) != self.eos_id])
        return super().decode(ids)

    def token_bytes(self):
        return None if self.tok is None else super().token_bytes()


def cache_root() -> Path:
    """Where trained tokenizers are kept: ``$ATLASLAB_CACHE/tokenizers`` or ``~/.cache/atlaslab/tokenizers``."""
    base = os.environ.get("ATLASLAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "atlaslab")
    return Path(base) / "tokenizers"


def train_local_bpe(corpus: str, vocab_size: int, min_frequency: int = 2, val_fraction: float = 0.05,
                    test_fraction: float = 0.05) -> Any:
    """A byte-level BPE (GPT-2's pre-tokenisation, ``<|endoftext|>`` = id 0) trained on the train split of
    ``corpus`` (:func:`atlaslab.tasks.corpus.corpus_splits`): a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    text = corpus_splits(corpus, val_fraction, test_fraction)["train"]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BPE_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(paragraphs, trainer)
    return tok


@register("tokenizer", "bpe_local")
class LocalBPETokenizer(_TokenizersBackend):
    """A byte-level BPE trained on a shipped corpus in seconds and cached on disk (no download)."""

    @dataclass
    class Config(PartConfig):
        vocab_size: int = 2048       # ids, <|endoftext|> (0) and the 256 bytes included
        corpus: str = "pydoc"        # pydoc | gensim_lee | a UTF-8 text file (atlaslab.tasks.corpus)
        min_frequency: int = 2       # a pair merges only if it occurs this often
        val_fraction: float = 0.05   # the corpus' held-out text (never trained on), as byte_lm splits it
        test_fraction: float = 0.05
        cache_dir: str = ""          # "": $ATLASLAB_CACHE/tokenizers or ~/.cache/atlaslab/tokenizers

        def check(self) -> None:
            check_range("vocab_size", self.vocab_size, 258, 1 << 20)
            check_range("min_frequency", self.min_frequency, 1, None)
            check_range("val_fraction", self.val_fraction, 0.001, 0.5)
            check_range("test_fraction", self.test_fraction, 0.001, 0.5)

    def __init__(self, cfg, **context):
        super().__init__(cfg, **context)
        import tokenizers
        from tokenizers import Tokenizer as HFTok
        corpus = load_corpus(cfg.corpus)
        key = json.dumps({"corpus_sha256": corpus.sha256, "vocab_size": cfg.vocab_size,
                          "min_frequency": cfg.min_frequency, "val_fraction": cfg.val_fraction,
                          "test_fraction": cfg.test_fraction, "tokenizers": tokenizers.__version__}, sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        root = Path(local_path(cfg.cache_dir)) if cfg.cache_dir else cache_root()
        self.path = root / f"bpe_{Path(cfg.corpus).stem}_{cfg.vocab_size}_{digest}.json"
        if self.path.is_file():
            tok = HFTok.from_file(str(self.path))
        else:
            tok = train_local_bpe(cfg.corpus, cfg.vocab_size, cfg.min_frequency, cfg.val_fraction, cfg.test_fraction)
            root.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            tmp.write_text(tok.to_str(), encoding="utf-8")
            os.replace(tmp, self.path)              # concurrent trainers write the same bytes; last one wins
        self._setup(tok, BPE_EOS, "vocab_size", self.path.read_text(encoding="utf-8"))


def build_tokenizer(node: Any, path: str = "tokenizer") -> Tokenizer:
    """Validate a tokenizer node (``byte``, ``{name: hf, path: …}``, ``{name: bpe_local, vocab_size: …}``) and
    build it; errors are ConfigErrors naming the dotted path."""
    if isinstance(node, Tokenizer):
        return node
    cfg = resolve_part("tokenizer", node, path)
    try:
        return get_registry("tokenizer").get(cfg.name).cls(cfg)
    except ConfigError as exc:
        raise exc.prefixed(path) from None


__all__ = ["BPE_EOS", "ByteTokenizer", "EOS_CANDIDATES", "HFTokenizer", "LocalBPETokenizer", "Tokenizer",
           "build_tokenizer", "cache_root", "train_local_bpe"]
