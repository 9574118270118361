"""The registered parts of a memory (docs/concepts/memory.md) and, later, layers, blocks and models built from them.

Importing this package registers every built-in part.
"""
from . import attentional_biases, feature_maps, inner_optimizers, memories, retention, windows  # noqa: F401
from . import attention, blocks, layers, lm  # noqa: F401,E402  (mixers, blocks, the language model)
from .memory_spec import MemoryParts, MemorySpec, build_memory, resolve_memory_spec, uses_kernel_trick

__all__ = ["MemoryParts", "MemorySpec", "build_memory", "resolve_memory_spec", "uses_kernel_trick"]
