"""atlaslab: search and ablate test-time-memory sequence models (ATLAS, Titans, OmegaNet, Miras, ...).

The documentation site in ``docs/`` explains every part and model (``docs/concepts/memory.md``,
``docs/models.md``); docstrings cite the papers' own equations ("ATLAS Eq.32", "Titans Eq.13", "Miras §5.3")
and point into those pages.

The package is built in floors, each importing only the ones below it:

    registry  →  kernels (GPU kernels)  →  memory (the six parts and their state)  →  engines (``memorize``)
    →  models (layers, blocks, LM, presets)  →  hf (Hugging Face models, fla-style layers)  →  tasks  →  train  →  eval  →  search  →  cli
"""
from atlaslab.memory import MemoryParts, MemorySpec, build_memory, resolve_memory_spec
from atlaslab.engines import memorize
from atlaslab import models  # noqa: F401  (registers the built-in mixers and blocks)
from atlaslab.registry import ConfigError, list_parts, register
from atlaslab.hf import register_with_transformers

register_with_transformers()     # AutoModelForCausalLM knows "atlaslab" once transformers loads (atlaslab.hf)

__version__ = "0.1.0"
__all__ = ["ConfigError", "MemoryParts", "MemorySpec", "build_memory", "list_parts", "memorize", "register",
           "resolve_memory_spec"]
