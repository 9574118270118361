"""A trained language model back from a training loop's checkpoint, with the tokenizer it trained with.

Used by the lm-eval adapter (:mod:`atlaslab.eval.harness`, ``checkpoint=``) and by :func:`atlaslab.eval.load_trained`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Tuple, Union

import torch

from atlaslab.models.lm import LanguageModel
from atlaslab.registry import ConfigError
from atlaslab.tasks.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from atlaslab.train.loop import CHECKPOINT_NAME


def tokenizer_for(task_info: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a task trained with (from its ``info()``, as a checkpoint stores it): the task's tokenizer
    node, checked against the stored fingerprint; byte tokens for ``byte_lm``."""
    node = task_info.get("tokenizer")
    if node is None:
        if task_info.get("name") == "byte_lm":
            return ByteTokenizer(ByteTokenizer.Config(name="byte"))
        raise ConfigError("tokenizer", f"task {task_info.get('name')!r} has no tokenizer; pass one "
                          "(a tokenizer node or a tokenizer.json path).")
    tok = build_tokenizer(node, "task.tokenizer")
    want = task_info.get("tokenizer_sha256")
    if want and tok.fingerprint != want:
        raise ConfigError("task.tokenizer", "the tokenizer built now differs from the one the model was trained "
                          "with (its vocabulary file changed); pass the original one.", value=str(node))
    return tok


def load_trained(checkpoint: Union[str, Path], tokenizer: Any = None,
                 map_location: Any = "cpu") -> Tuple[torch.nn.Module, Tokenizer, Dict[str, Any]]:
    """``(model in eval mode, tokenizer, task info)`` from a training loop's checkpoint folder (or its
    ``checkpoint.pt``). ``tokenizer``: a tokenizer node / ``tokenizer.json`` path instead of the task's."""
    p = Path(checkpoint).expanduser()
    file = p / CHECKPOINT_NAME if p.is_dir() else p
    if not file.is_file():
        raise ConfigError("checkpoint", f"no {CHECKPOINT_NAME} at {str(checkpoint)!r}.", value=str(checkpoint))
    ckpt = torch.load(file, map_location=map_location, weights_only=True)
    mcfg = ckpt.get("model_config")
    if mcfg is None:
        raise ConfigError("checkpoint", f"{file} holds no model config (it was not an atlaslab language model, or "
                          "was written by an older version).", value=str(file))
    model = LanguageModel(mcfg)
    model.load_state_dict(ckpt["model"])
    model.eval()
    info = dict(ckpt.get("task") or {})
    if tokenizer is None:
        tok = tokenizer_for(info)
    elif isinstance(tokenizer, str) and not tokenizer.startswith("{"):
        tok = build_tokenizer({"name": "byte"} if tokenizer == "byte" else {"name": "hf", "path": tokenizer})
    else:
        tok = build_tokenizer(tokenizer)
    if tok.vocab_size > model.cfg.vocab_size:
        raise ConfigError("tokenizer", f"the tokenizer has {tok.vocab_size} ids, the model {model.cfg.vocab_size}.")
    return model, tok, info
