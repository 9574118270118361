"""lm-eval's loader for the pydoc tasks of this folder (``custom_dataset: !function pydoc_loader.load``).

It reads ``data/<task_name>.jsonl`` beside this file, whatever folder lm-eval runs in (a Ray trial works in its
own), and refuses data built from another Python's pydoc text: there the corpus' train / test split differs, so
the items could be text the model trained on. ``python experiments/lm_tasks/make_pydoc_tasks.py`` rebuilds them.
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def load(task_name: str, **_metadata):
    """``DatasetDict({"test": …})`` of one task's shipped documents."""
    import datasets
    from atlaslab.tasks.corpus import load_corpus

    manifest = json.loads((DATA / "MANIFEST.json").read_text(encoding="utf-8"))
    have = load_corpus(manifest["corpus"]).sha256
    if have != manifest["corpus_sha256"]:
        raise RuntimeError(f"{task_name}: experiments/lm_tasks/data was built from another {manifest['corpus']} corpus "
                           f"(SHA-256 {manifest['corpus_sha256'][:12]}…, this Python's is {have[:12]}…), so its items "
                           f"may be text this Python's split trains on; rebuild them with `{manifest['command']}`.")
    with open(DATA / f"{task_name}.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
