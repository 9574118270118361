"""Byte-level language modelling on a real natural-language corpus with held-out splits.

Tokens are UTF-8 bytes (vocabulary 256; nothing to download, no tokenizer). Training examples are windows
of ``seq_len + 1`` bytes at random offsets of the training text (a pure function of the seeds and the
step); val and test are the held-out text cut into consecutive non-overlapping windows, so every held-out
byte after the first of each window is predicted exactly once. The text and its split come from
:mod:`atlaslab.tasks.corpus`.

Metrics: ``loss`` (nats per byte), ``bpb`` (bits per byte = loss / ln 2), ``ppl`` (per-byte perplexity
e^loss) and next-byte ``accuracy``. Evaluating at another length changes the window length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

from atlaslab.registry import check_range, register
from atlaslab.tasks.base import Example, Task, TaskConfig
from atlaslab.tasks.corpus import corpus_bytes, load_corpus


@dataclass
class TextConfig(TaskConfig):
    corpus: str = "pydoc"            # pydoc | gensim_lee | path to a UTF-8 text file
    val_fraction: float = 0.05
    test_fraction: float = 0.05

    def check(self) -> None:
        super().check()
        check_range("val_fraction", self.val_fraction, 0.001, 0.5)
        check_range("test_fraction", self.test_fraction, 0.001, 0.5)


@register("task", "byte_lm")
class ByteLM(Task):
    """Byte-level language modelling of a shipped natural-language corpus (bits per byte)."""

    @dataclass
    class Config(TextConfig):
        seq_len: int = 256
        eval_examples: int = 0        # 0: the whole held-out split

    primary_metric = "bpb"
    primary_mode = "min"
    report_exact_match = False

    def __init__(self, cfg, **context):
        super().__init__(cfg, **context)
        load_corpus(cfg.corpus)        # fail early (ConfigError) on a missing corpus

    @property
    def vocab_size(self) -> int:
        return 256

    def text(self, split: str) -> bytes:
        c = self.cfg
        return corpus_bytes(c.corpus, split, c.val_fraction, c.test_fraction)

    def info(self) -> Dict[str, Any]:
        out = super().info()
        corpus = load_corpus(self.cfg.corpus)
        out.update(corpus_sha256=corpus.sha256, **{f"{s}_bytes": len(self.text(s)) for s in ("train", "val", "test")})
        return out

    def check_length(self, length: int) -> None:
        super().check_length(length)
        for split in ("train", "val", "test"):
            if len(self.text(split)) < length + 1:
                raise ValueError(f"byte_lm: the {split} text ({len(self.text(split))} bytes) is shorter than "
                                 f"one window of {length + 1} bytes")

    def eval_size(self, split: str, length: int) -> int:
        n_windows = (len(self.text(split)) - 1) // length
        if self.cfg.eval_examples:
            return min(int(self.cfg.eval_examples), n_windows)
        return n_windows

    def generate(self, rng, split, length, index):
        data = self.text(split)
        T = length
        if split == "train":
            start = int(rng.integers(0, len(data) - T))
        else:
            start = index * T
            if start + T + 1 > len(data):
                raise IndexError(f"byte_lm: {split} has only {(len(data) - 1) // T} windows of {T} bytes")
        w = np.frombuffer(data[start:start + T + 1], dtype=np.uint8).astype(np.int64)
        return Example(w[:-1].copy(), w[1:].copy())

    def extra_metrics(self, totals: Dict[str, float]) -> Dict[str, float]:
        nll = totals["nll"] / max(totals["tokens"], 1.0)
        return {"bpb": nll / math.log(2.0), "ppl": math.exp(min(nll, 50.0))}


def decode_bytes(tokens) -> str:
    """Text of a sequence of byte tokens (undecodable bytes replaced)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def encode_text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


__all__ = ["ByteLM", "TextConfig", "decode_bytes", "encode_text"]
