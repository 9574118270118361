"""Models built above the engines: attention and memory mixers (:mod:`.layers`, :mod:`.attention`,
:mod:`.forgetting_attention`, :mod:`.lact`), the blocks that combine them (:mod:`.blocks`; ARMT's segment
recurrence, :mod:`.armt`), the language model (:mod:`.lm`), its token-by-token decoding (:mod:`.decoding`) and
the named presets (:mod:`.presets`).

Importing this package registers every built-in mixer and block.
"""
from atlaslab.models import armt, attention, blocks, forgetting_attention, lact, layers, lm  # noqa: F401
from atlaslab.models.presets import build_model, list_presets, load_preset

__all__ = ["build_model", "list_presets", "load_preset"]
