"""An atlaslab tokenizer as a ``transformers`` fast tokenizer, so an exported model folder carries the tokenizer it
trained with and Hugging Face tools (``AutoTokenizer``, lm-eval's ``HFLM``) encode text to the same ids.

- ``byte``: a byte-level BPE with no merges whose vocabulary maps GPT-2's byte alphabet to ids 0–255 in byte order,
  plus ``<|endoftext|>`` at 256: ``encode`` gives the UTF-8 bytes, as :class:`~atlaslab.tasks.tokenizer.ByteTokenizer`.
- ``hf`` / ``bpe_local``: their own ``tokenizers.Tokenizer``, copied.

``transformers`` is imported only by :func:`to_transformers`.
"""
from __future__ import annotations

from typing import Any

from atlaslab.registry import ConfigError
from atlaslab.tasks.tokenizer import BPE_EOS, ByteTokenizer, Tokenizer, _byte_decoder


def byte_backend():
    """The ``tokenizers.Tokenizer`` whose ids are UTF-8 bytes (0–255) and ``<|endoftext|>`` (256)."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers
    vocab = {char: byte for char, byte in _byte_decoder().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BPE_EOS, special=True)])
    if backend.token_to_id(BPE_EOS) != ByteTokenizer.eos_id:     # pragma: no cover - vocabulary layout changed
        raise RuntimeError("the byte tokenizer's end-of-text token did not land on id 256")
    return backend


def to_transformers(tok: Tokenizer) -> Any:
    """``tok`` as a ``transformers.PreTrainedTokenizerFast`` (EOS = pad = the atlaslab tokenizer's EOS)."""
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast
    if isinstance(tok, ByteTokenizer):
        backend = byte_backend()
    elif getattr(tok, "tok", None) is not None:
        backend = Backend.from_str(tok.tok.to_str())
    else:
        raise ConfigError("tokenizer", f"cannot convert the {type(tok).__name__} to a transformers tokenizer "
                          "(byte, hf with a tokenizer.json and bpe_local can).", value=type(tok).__name__)
    eos = backend.id_to_token(tok.eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos)


__all__ = ["byte_backend", "to_transformers"]
