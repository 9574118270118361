"""Natural-language text that needs no network, split into disjoint train / val / test text.

Sources (``corpus:`` in a task config):

``pydoc`` (default)
    The Python Language Reference topics that every CPython installation ships in the standard library
    (``pydoc_data.topics``, ~465 KB of English prose with some code, © PSF, PSF licence). Nothing to
    install or download. Its text changes a little between Python versions, so the corpus' SHA-256
    (:attr:`Corpus.sha256`) is part of every text task's :meth:`info` — compare numbers only across equal
    hashes.
``gensim_lee``
    ``lee_background.cor`` (~360 KB of news prose, one document per line) from gensim's test data, if
    ``gensim`` is installed (``pip install gensim``; not a dependency of atlaslab).
a file path
    Any UTF-8 text file; blank lines separate documents.

Splitting: paragraphs that repeat an earlier one are dropped (pydoc's topics quote whole sections of each
other); the text is cut into pieces of whole paragraphs (about :data:`PIECE_BYTES` each; a piece never
spans two documents); the pieces are ordered by a fixed hash and dealt to test, then val, until each holds
its fraction of the bytes; the rest is train. The split depends only on the text and the fractions, never
on a seed, so every run sees the same held-out text, and no byte of held-out text is in the training text.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from atlaslab.registry import ConfigError

PIECE_BYTES = 4096
BUILTIN = ("pydoc", "gensim_lee")


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: Tuple[str, ...]
    sha256: str

    @property
    def num_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)


def _pydoc_documents() -> List[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - stripped Python builds
        raise ConfigError("corpus", f"this Python has no pydoc_data ({exc}); use corpus: gensim_lee or a file "
                          "path.", value="pydoc", choices=list(BUILTIN)) from None
    return [topics[k] for k in sorted(topics)]


def _gensim_lee_documents() -> List[str]:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("corpus", "corpus 'gensim_lee' needs gensim (pip install gensim).", value="gensim_lee",
                          choices=list(BUILTIN))
    for root in spec.submodule_search_locations:
        path = Path(root) / "test" / "test_data" / "lee_background.cor"
        if path.is_file():
            return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                    if line.strip()]
    raise ConfigError("corpus", "gensim is installed but lee_background.cor was not found in its test data.",
                      value="gensim_lee")


def _file_documents(path: str) -> List[str]:
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise ConfigError("corpus", f"no such corpus file {path!r}.", value=path, choices=list(BUILTIN))
    text = p.read_text(encoding="utf-8", errors="replace")
    return [d for d in re.split(r"\n\s*\n", text) if d.strip()]


@functools.lru_cache(maxsize=8)
def load_corpus(name: str = "pydoc") -> Corpus:
    """The corpus ``name`` (``pydoc``, ``gensim_lee`` or a path to a UTF-8 text file)."""
    if name == "pydoc":
        docs = _pydoc_documents()
    elif name == "gensim_lee":
        docs = _gensim_lee_documents()
    else:
        docs = _file_documents(name)
    docs = [d.replace("\r\n", "\n") for d in docs if d.strip()]
    if not docs:
        raise ConfigError("corpus", f"corpus {name!r} is empty.", value=name)
    h = hashlib.sha256("\x00".join(docs).encode("utf-8")).hexdigest()
    return Corpus(name, tuple(docs), h)


def _pieces(doc: str, size: int, seen: set) -> List[str]:
    """Consecutive paragraphs of ``doc`` grouped into pieces of about ``size`` characters; a paragraph
    already ``seen`` (pydoc's topics repeat whole sections of one another) is dropped."""
    paras = []
    for p in re.split(r"(?<=\n)\n+", doc):
        key = " ".join(p.split())
        if key and key not in seen:
            seen.add(key)
            paras.append(p)
    out, cur = [], ""
    for p in paras:
        if cur and len(cur) + len(p) > size:
            out.append(cur)
            cur = ""
        cur += p if p.endswith("\n") else p + "\n"
    if cur.strip():
        out.append(cur)
    return out


@functools.lru_cache(maxsize=16)
def corpus_pieces(name: str = "pydoc", val_fraction: float = 0.05,
                  test_fraction: float = 0.05) -> Dict[str, Tuple[str, ...]]:
    """``{"train": pieces, "val": pieces, "test": pieces}``: the corpus' pieces (whole paragraphs, about
    :data:`PIECE_BYTES` each) of each split, in corpus order (see module doc); documents for a corpus task."""
    corpus = load_corpus(name)
    pieces: List[Tuple[int, int, str]] = []
    seen: set = set()
    for d, doc in enumerate(corpus.documents):
        for j, piece in enumerate(_pieces(doc, PIECE_BYTES, seen)):
            pieces.append((d, j, piece))
    total = sum(len(p[2]) for p in pieces)
    order = sorted(range(len(pieces)),
                   key=lambda i: hashlib.sha256(f"{pieces[i][0]}:{pieces[i][1]}:{pieces[i][2][:80]}".encode())
                   .hexdigest())
    assign: Dict[int, str] = {}
    budget = [("test", test_fraction * total), ("val", val_fraction * total)]
    it = iter(order)
    for split, want in budget:
        have = 0
        while have < want:
            i = next(it, None)
            if i is None:
                break
            assign[i] = split
            have += len(pieces[i][2])
    for i in it:
        assign[i] = "train"
    out = {s: tuple(pieces[i][2] for i in range(len(pieces)) if assign.get(i, "train") == s)
           for s in ("train", "val", "test")}
    for s, split_pieces in out.items():
        if not split_pieces:
            raise ConfigError("corpus", f"corpus {name!r} is too small to give a non-empty {s} split.", value=name)
    return out


@functools.lru_cache(maxsize=16)
def corpus_splits(name: str = "pydoc", val_fraction: float = 0.05, test_fraction: float = 0.05) -> Dict[str, str]:
    """``{"train": text, "val": text, "test": text}``: disjoint text of the corpus (see module doc)."""
    return {s: "\n".join(p) for s, p in corpus_pieces(name, val_fraction, test_fraction).items()}


@functools.lru_cache(maxsize=16)
def corpus_bytes(name: str, split: str, val_fraction: float = 0.05, test_fraction: float = 0.05) -> bytes:
    """The UTF-8 bytes of one split (cached)."""
    return corpus_splits(name, val_fraction, test_fraction)[split].encode("utf-8")


@functools.lru_cache(maxsize=16)
def corpus_sentences(name: str, split: str, val_fraction: float = 0.05, test_fraction: float = 0.05) -> Tuple[str, ...]:
    """Sentence-like chunks of one split: whitespace-normalised, each ending in '.', '?' or '!'."""
    text = re.sub(r"\s+", " ", corpus_splits(name, val_fraction, test_fraction)[split])
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    return tuple(s for s in sents if 3 <= len(s) <= 400 and s.isascii())


@functools.lru_cache(maxsize=8)
def corpus_words(name: str = "pydoc") -> Tuple[str, ...]:
    """Distinct lower-case alphabetic words (4-10 letters) of the whole corpus, sorted."""
    words = set()
    for doc in load_corpus(name).documents:
        words.update(w.lower() for w in re.findall(r"\b[A-Za-z]{4,10}\b", doc))
    return tuple(sorted(words))


__all__ = ["BUILTIN", "Corpus", "corpus_bytes", "corpus_pieces", "corpus_sentences", "corpus_splits", "corpus_words", "load_corpus"]
