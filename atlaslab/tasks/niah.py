"""Single needle-in-a-haystack (S-NIAH, RULER's ``niah_single_*``; Hsieh et al. 2024), byte-level.

One needle is hidden at a depth of a haystack; the sequence ends with a question and the answer, which
is the only thing scored (teacher-forced, so ``exact_match`` = greedy decoding gets the whole answer):

``passkey`` (PK)
    synthetic-noise haystack ("The grass is green. The sky is blue. …" repeated, as RULER's
    ``niah_single_1``); needle "The pass key is 1234567. Remember it. 1234567 is the pass key."
``number`` (N)
    natural-text haystack (held-out spans of the corpus for val/test); needle "One of the special magic
    numbers for <word> is: 1234567."; the question names the word.
``word`` (W)
    as ``number`` with a word as the value.

Train at ``seq_len`` and evaluate at longer lengths (``evaluate(..., lengths=[...])``). Evaluation sets
spread their needles evenly over ``num_depths`` depths from 0 (start) to 1 (end of the haystack), reported
as slices ``exact_match/depth_<i>``. Text tasks use byte tokens (vocabulary 256).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from atlaslab.registry import check_choice, check_range, register
from atlaslab.tasks.base import IGNORE_INDEX, Example, Task
from atlaslab.tasks.byte_lm import TextConfig
from atlaslab.tasks.corpus import corpus_bytes, corpus_words, load_corpus

VARIANTS = ("passkey", "number", "word")
NOISE = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def fit_haystack(source: bytes, start: int, n: int) -> bytes:
    """``n`` bytes of ``source`` from ``start`` on, wrapping around (with a space) when it runs out."""
    if n <= 0:
        return b""
    src = source if source.endswith((b" ", b"\n")) else source + b" "
    reps = (start + n) // len(src) + 2
    return (src * reps)[start:start + n]


def insert_at_boundary(hay: bytes, pos: int, needle: bytes, lookback: int = 256) -> Tuple[bytes, int]:
    """Insert ``needle`` at the sentence boundary nearest before ``pos`` (within ``lookback`` bytes)."""
    lo = max(0, pos - lookback)
    cut = max(hay.rfind(b". ", lo, pos), hay.rfind(b"\n", lo, pos))
    if cut >= 0:
        pos = cut + (2 if hay[cut:cut + 2] == b". " else 1)
    return hay[:pos] + needle + hay[pos:], pos


class _TextQA(Task):
    """Shared byte-level question-answering layout: context + question + answer, answer scored."""

    report_exact_match = True
    primary_metric = "exact_match"

    @property
    def vocab_size(self) -> int:
        return 256

    def info(self):
        out = super().info()
        out["corpus_sha256"] = load_corpus(self.cfg.corpus).sha256
        return out

    def haystack_source(self, split: str) -> bytes:
        c = self.cfg
        return corpus_bytes(c.corpus, split, c.val_fraction, c.test_fraction)

    def finish(self, context: bytes, question: bytes, answer: bytes, T: int, all_loss: bool) -> Example:
        seq = context + question + answer
        assert len(seq) == T + 1, (len(seq), T)
        s = np.frombuffer(seq, dtype=np.uint8).astype(np.int64)
        inputs = s[:T].copy()
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        a = len(answer)
        targets[T - a:] = s[T + 1 - a:]
        loss_targets = s[1:].copy() if all_loss else None
        return Example(inputs, targets, loss_targets)


@register("task", "sniah")
class SNIAH(_TextQA):
    """RULER-style single needle in a haystack (passkey / number / word), byte tokens."""

    @dataclass
    class Config(TextConfig):
        variant: str = "passkey"     # passkey (PK) | number (N) | word (W)
        seq_len: int = 512
        eval_examples: int = 250
        num_depths: int = 5
        digits: int = 7             # length of numeric values (RULER: 7)
        loss: str = "answer"         # answer: score and train on the answer only | all: train on every byte

        def check(self) -> None:
            super().check()
            check_choice("variant", self.variant, VARIANTS)
            check_choice("loss", self.loss, ("answer", "all"))
            check_range("num_depths", self.num_depths, 1, None)
            check_range("digits", self.digits, 1, 18)

    slice_keys = ("depth",)

    def _parts(self, rng: np.random.Generator) -> Tuple[bytes, bytes, bytes]:
        """(needle, question, answer) of one example."""
        c = self.cfg
        number = str(int(rng.integers(10 ** (c.digits - 1), 10 ** c.digits)))
        if c.variant == "passkey":
            needle = f"The pass key is {number}. Remember it. {number} is the pass key. "
            return needle.encode(), b"\nWhat is the pass key? The pass key is ", number.encode()
        words = corpus_words(c.corpus)
        key = words[int(rng.integers(len(words)))]
        kind = "number" if c.variant == "number" else "word"
        if c.variant == "number":
            value = number
        else:
            value = key
            while value == key:
                value = words[int(rng.integers(len(words)))]
        needle = f"One of the special magic {kind}s for {key} is: {value}. "
        question = (f"\nWhat is the special magic {kind} for {key} mentioned in the provided text? "
                    f"The special magic {kind} for {key} mentioned in the provided text is ")
        return needle.encode(), question.encode(), value.encode()

    def min_length(self) -> int:
        return 240 + (2 * self.cfg.digits if self.cfg.variant != "word" else 40)

    def check_length(self, length: int) -> None:
        if length < self.min_length():
            raise ValueError(f"sniah: length {length} is too short (≥ {self.min_length()} bytes)")

    def generate(self, rng, split, length, index):
        c = self.cfg
        T = length
        needle, question, answer = self._parts(rng)
        n_hay = T + 1 - len(question) - len(answer) - len(needle)
        if n_hay < 8:
            raise ValueError(f"sniah: length {T} leaves no room for a haystack")
        if split == "train":
            depth = float(rng.random())
            bucket = min(int(depth * c.num_depths), c.num_depths - 1)
        else:
            bucket = index % c.num_depths
            depth = bucket / (c.num_depths - 1) if c.num_depths > 1 else 0.5
        if c.variant == "passkey":
            hay = fit_haystack(NOISE, 0, n_hay)
        else:
            src = self.haystack_source(split)
            start = int(rng.integers(0, len(src)))
            nxt = src.find(b". ", start, start + 512)           # begin at a sentence
            hay = fit_haystack(src, nxt + 2 if nxt >= 0 else start, n_hay)
        context, _ = insert_at_boundary(hay, int(round(depth * n_hay)), needle)
        ex = self.finish(context, question, answer, T, c.loss == "all")
        ex.meta["depth"] = bucket
        return ex


__all__ = ["NOISE", "SNIAH", "VARIANTS", "fit_haystack", "insert_at_boundary"]
