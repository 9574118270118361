"""Write the local zero-shot tasks of ``experiments/lm_table2_cpu.yaml`` from held-out pydoc text.

    python experiments/lm_tasks/make_pydoc_tasks.py            # (re)write data/*.jsonl and data/MANIFEST.json
    python experiments/lm_tasks/make_pydoc_tasks.py --check    # exit 1 unless the files are what it would write

Every item comes from the **test** split of the shipped ``pydoc`` corpus (:func:`atlaslab.tasks.corpus.corpus_pieces`
with val / test fractions 0.05 / 0.2, those of the experiment's ``lm_corpus`` task and ``bpe_local`` tokenizer): text
that neither the tokenizer nor the language model ever trains on. pydoc repeats short sentences across topics, so
an item is also dropped when its scored text (a passage's last words, a context with its true next sentence) occurs
in the training text. The build is a pure function of that text (no clock, no global RNG), so the
same Python (the same corpus SHA-256, recorded in the manifest) always gives the same bytes.

Three tasks, stand-ins for three kinds of ATLAS Table 2 column (same lm-eval request types and metrics):

``pydoc_ppl``        (like ``wikitext``) every held-out piece scored whole (``loglikelihood_rolling``):
                     ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``.
``pydoc_lastword``   (like ``lambada_openai``) a prose passage ending where a sentence does, whose last word is to
                     be predicted; the word is not a stop word and occurs earlier in the passage, so the context
                     gives it away to a model that reads it (LAMBADA's "needs the broad context", as a rule):
                     ``perplexity`` of the word and ``acc`` (greedy decoding gives the word).
``pydoc_nextsent``   (like ``hellaswag``) a prose sentence and four candidate next sentences: the true one and
                     three from elsewhere in the held-out text (a fixed seed picks them): ``acc`` and ``acc_norm``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from atlaslab.tasks.corpus import corpus_pieces, load_corpus

CORPUS = "pydoc"
VAL_FRACTION, TEST_FRACTION = 0.05, 0.2  # the split of lm_table2_cpu.yaml's task and tokenizer (the same text)
DATA = Path(__file__).resolve().parent / "data"
TASKS = ("pydoc_ppl", "pydoc_lastword", "pydoc_nextsent")
CONTEXT_WORDS = 80                       # at most this many words of context before a last word
TAIL_WORDS = 12                          # a passage whose last 12 words are in the training text is dropped
MIN_CONTEXT_WORDS = 15
DISTRACTORS = 3
SEED = 20250531
STOP_WORDS = frozenset("""a about above after again all also an and any are as at be because been before being
below between both but by can could did do does doing down during each either else every few for from further had
has have having here how if in into is it its itself just may might more most must no nor not now of off on once
only or other our out over own same shall should so some such than that the their them then there these they this
those through to too under until up very was we were what when where whether which while who whom why will with
would yet you your""".split())
_WORD = re.compile(r"^[A-Za-z][a-z]{2,}$")
_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def held_out_pieces() -> Sequence[str]:
    """The corpus' test pieces (see the module docstring)."""
    return corpus_pieces(CORPUS, VAL_FRACTION, TEST_FRACTION)["test"]


def training_text() -> str:
    """The train split's text, whitespace-normalised: what an item must not be found in (pydoc repeats short
    sentences across topics, so a held-out paragraph can still share a sentence with the training text)."""
    return " ".join(" ".join(corpus_pieces(CORPUS, VAL_FRACTION, TEST_FRACTION)["train"]).split())


def lastword_tail(text: str) -> str:
    """The last ``TAIL_WORDS`` words of a passage: its target in the words just before it."""
    return " ".join(text.split()[-TAIL_WORDS:])


def prose_blocks(piece: str) -> List[str]:
    """Runs of consecutive unindented lines of a piece (pydoc's prose; indented lines are grammar and code),
    whitespace-normalised, of at least 8 words; headings (a line underlined with ``*``, ``=``, ``-``) dropped."""
    blocks, cur = [], []
    for line in piece.split("\n") + [""]:
        is_rule = bool(line.strip()) and set(line.strip()) <= set("*=-~^")
        if line.strip() and not line[:1].isspace() and not is_rule:
            cur.append(line.strip())
            continue
        if is_rule and cur:
            cur.pop()                    # the heading above the rule
        if cur:
            blocks.append(" ".join(" ".join(cur).split()))
        cur = []
    return [b for b in blocks if len(b.split()) >= 8]


def _is_prose(sentence: str) -> bool:
    words = sentence.split()
    alpha = sum(bool(re.fullmatch(r"[A-Za-z’'(),;:.!?-]+", w)) for w in words)
    return 5 <= len(words) <= 60 and alpha >= 0.85 * len(words) and not any(c in sentence for c in "=<>{}[]|\\")


def lastword_items(blocks: Sequence[str], train: str) -> List[Dict[str, str]]:
    """LAMBADA-style passages: for each sentence of a prose block with at least ``MIN_CONTEXT_WORDS`` words of the
    block before its last word, that last word is the target when it has 3+ letters, is no stop word and occurs,
    case-folded, in the ``CONTEXT_WORDS`` words before it. ``text`` is those words and the target (without its
    punctuation); whatever followed is cut off. A passage whose tail is in the ``train`` text is dropped."""
    items = []
    for block in blocks:
        words = block.split()
        ends = [i for i, w in enumerate(words) if w[-1:] in ".!?" and (i + 1 == len(words) or words[i + 1][:1].isupper())]
        for i in ends:
            core = words[i].rstrip(".,;:!?")
            if i < MIN_CONTEXT_WORDS or not _WORD.match(core) or core.lower() in STOP_WORDS:
                continue
            context = words[max(0, i - CONTEXT_WORDS):i]
            text = " ".join(context + [core])
            if core.lower() in {w.strip(".,;:!?()’'\"").lower() for w in context} and lastword_tail(text) not in train:
                items.append({"text": text})
    return items


def nextsent_items(blocks: Sequence[str], train: str) -> List[Dict[str, object]]:
    """HellaSwag-style items: each pair of consecutive prose sentences of a block that is not in the ``train`` text
    gives a context (the first) and four endings (the second, and the second sentence of three other pairs chosen
    by a seeded RNG), in an order that RNG draws; ``label`` is the index of the true ending."""
    pairs = []
    for block in blocks:
        sents = [s.strip() for s in _SENT_END.split(block)]
        for a, b in zip(sents, sents[1:]):
            if _is_prose(a) and _is_prose(b) and f"{a} {b}" not in train:
                pairs.append((a, b))
    rng = np.random.default_rng(SEED)
    items = []
    for i, (ctx, true) in enumerate(pairs):
        others = [j for j in range(len(pairs)) if j != i and pairs[j][1] != true]
        picks = [pairs[j][1] for j in rng.choice(others, size=DISTRACTORS, replace=False)]
        order = rng.permutation(DISTRACTORS + 1)
        endings = [([true] + picks)[k] for k in order]
        items.append({"ctx": ctx, "endings": endings, "label": int(np.argmin(order))})
    return items


def build() -> Dict[str, List[dict]]:
    """Task name → its documents (JSON-ready), from the held-out pieces."""
    pieces, train = held_out_pieces(), training_text()
    blocks = [b for p in pieces for b in prose_blocks(p)]
    return {"pydoc_ppl": [{"text": p} for p in pieces],
            "pydoc_lastword": lastword_items(blocks, train),
            "pydoc_nextsent": nextsent_items(blocks, train)}


def render(docs: Dict[str, List[dict]]) -> Dict[str, bytes]:
    """File name → bytes: one jsonl per task and ``MANIFEST.json`` (the corpus hash, counts and file hashes)."""
    files = {f"{name}.jsonl": "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs[name]).encode("utf-8")
             for name in TASKS}
    manifest = {"corpus": CORPUS, "corpus_sha256": load_corpus(CORPUS).sha256,
                "val_fraction": VAL_FRACTION, "test_fraction": TEST_FRACTION, "split": "test",
                "documents": {name: len(docs[name]) for name in TASKS},
                "sha256": {f: hashlib.sha256(b).hexdigest() for f, b in files.items()},
                "command": "python experiments/lm_tasks/make_pydoc_tasks.py"}
    files["MANIFEST.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    return files


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing them")
    ap.add_argument("--out", default=str(DATA), help="folder of the data files (default: data/ beside this script)")
    args = ap.parse_args(list(argv))
    out = Path(args.out)
    files = render(build())
    if args.check:
        stale = [f for f, b in files.items() if not (out / f).is_file() or (out / f).read_bytes() != b]
        print("up to date" if not stale else f"differ: {', '.join(stale)}")
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for f, b in files.items():
        (out / f).write_bytes(b)
    counts = json.loads(files["MANIFEST.json"])["documents"]
    print(f"wrote {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
