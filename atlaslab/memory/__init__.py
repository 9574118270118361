"""A memory as six registered parts (docs/concepts/memory.md): the architecture, the attentional bias, the
retention, the feature map, the inner optimizer and the window, plus the state they act on.

This floor knows nothing of engines or models: the engines (:mod:`atlaslab.engines`) consume
:class:`MemoryParts`, and the layers (:mod:`atlaslab.models`) build them. Importing this package registers
every built-in part.
"""
from atlaslab.memory import (architectures, attentional_biases, feature_maps, inner_optimizers,  # noqa: F401
                             retention, windows)
from atlaslab.memory.spec import MemoryParts, MemorySpec, build_memory, resolve_memory_spec, uses_slot_memory

__all__ = ["MemoryParts", "MemorySpec", "build_memory", "resolve_memory_spec", "uses_slot_memory"]
