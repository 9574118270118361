"""Tasks: the workloads every comparison runs on (registry kind ``"task"``).

Token tasks (a model maps tokens ``[B, T]`` to logits ``[B, T, V]``; see :mod:`atlaslab.tasks.base`):

- ``mqar``: Zoology's multi-query associative recall (:mod:`.mqar`);
- ``in_context_recall``, ``noisy_in_context_recall``, ``fuzzy_in_context_recall``, ``selective_copying``,
  ``compression``, ``memorization``: the MAD suite and its difficulty grid (:mod:`.mad`);
- ``sniah``: RULER-style single needle in a haystack, passkey / number / word (:mod:`.niah`);
- ``babilong``: bAbI-like stories in distractor text at growing lengths (:mod:`.babilong`);
- ``byte_lm``: byte-level language modelling of a shipped corpus, bits per byte (:mod:`.byte_lm`);
- ``lm_corpus``: language modelling on a Hugging Face ``datasets`` corpus (local files, hub names, streaming),
  tokenised (registry kind ``"tokenizer"``: ``byte``, ``hf``, ``bpe_local``; :mod:`.tokenizer`) and packed into rows
  that keep document boundaries (:mod:`.lm_corpus`, :mod:`.packing`).

And ``learnability``, the ATLAS §6.4 probe of a memory's online fit (:mod:`.learnability`), which takes a
memory learner instead of a token model.

    from atlaslab.tasks import build_task
    task = build_task({"name": "mqar", "vocab_size": 128, "seq_len": 64, "num_kv_pairs": [4]})
    batch = task.batch("train", step=0, batch_size=64, seed=0)
    metrics = task.evaluate(model, split="test", lengths=[64, 128])
"""
from atlaslab.registry import get_registry
from atlaslab.tasks.base import (IGNORE_INDEX, SPLITS, Batch, Example, Task, TaskConfig, build_task, cross_entropy, make_rng,
                                 resolve_task)
from atlaslab.tasks.babilong import BABILong
from atlaslab.tasks.byte_lm import ByteLM, decode_bytes, encode_text
from atlaslab.tasks.corpus import corpus_splits, load_corpus
from atlaslab.tasks.lm_corpus import LMCorpus
from atlaslab.tasks.packing import RowPacker, TokenStream
from atlaslab.tasks.tokenizer import Tokenizer, build_tokenizer
from atlaslab.tasks.learnability import LearnabilityProbe, MLPMemoryLearner, make_mlp_learner
from atlaslab.tasks.mad import (MAD_PROTOCOL, MAD_SWEEP, MAD_TRAIN, Compression, CompressionHead, FuzzyInContextRecall,
                                InContextRecall, Memorization, NoisyInContextRecall, SelectiveCopying, mad_grid, mad_score,
                                mad_train_steps)
from atlaslab.tasks.mqar import MQAR
from atlaslab.tasks.niah import SNIAH


def list_tasks(pattern: str = "*") -> list:
    """Registered task names matching a wildcard."""
    return get_registry("task").list(pattern)


__all__ = [
    "BABILong", "Batch", "ByteLM", "Compression", "CompressionHead", "Example", "FuzzyInContextRecall",
    "IGNORE_INDEX", "InContextRecall", "LMCorpus", "LearnabilityProbe", "MAD_PROTOCOL", "MAD_SWEEP", "MAD_TRAIN",
    "MLPMemoryLearner", "MQAR", "Memorization", "NoisyInContextRecall", "RowPacker", "SNIAH", "SPLITS",
    "SelectiveCopying", "Task", "TaskConfig", "TokenStream", "Tokenizer", "build_task", "build_tokenizer", "corpus_splits", "cross_entropy", "decode_bytes", "encode_text",
    "list_tasks", "load_corpus", "mad_grid", "mad_score", "mad_train_steps", "make_mlp_learner", "make_rng",
    "resolve_task",
]
