"""Models built above the engines: attention and memory mixers (:mod:`.layers`, :mod:`.attention`), the blocks
that combine them (:mod:`.blocks`; ARMT's segment recurrence, :mod:`.armt`), the language model (:mod:`.lm`) and
the named presets (:mod:`.presets`).

Importing this package registers every built-in mixer and block.
"""
from atlaslab.models import armt, attention, blocks, forgetting_attention, layers, lm  # noqa: F401
from atlaslab.models.presets import build_model, list_presets, load_preset

__all__ = ["build_model", "list_presets", "load_preset"]
