"""atlaslab: search and ablate test-time-memory sequence models (ATLAS, Titans, OmegaNet, Miras, ...).

The documentation site in ``docs/`` explains every part and model (``docs/concepts/memory.md``,
``docs/models.md``); docstrings cite the papers' own equations ("ATLAS Eq.32", "Titans Eq.13", "Miras §5.3")
and point into those pages.

The package is built in floors, each importing only the ones below it:

    registry  →  kernels (GPU kernels)  →  memory (the six parts and their state)  →  engines (``memorize``)
    →  models (layers, blocks, LM, presets)  →  hf (Hugging Face models, fla-style layers)
    →  tasks  →  train  →  eval  →  search  →  cli

For notebooks (loaded on first use, so ``import atlaslab`` stays light: no Ray, MLflow or pandas)::

    p = atlaslab.prepare("experiments/quickstart.yaml", ["train.steps=100"])   # validates every trial
    summary = atlaslab.run(p, run_dir="runs/quickstart")                         # Ray Tune + MLflow + report
    df = atlaslab.load_results(summary["run_dir"])                               # one row per trial (pandas)
    curves = atlaslab.load_curves(summary["run_dir"])                            # the learning curves

(:func:`atlaslab.search.driver.prepare` / ``run`` / ``resume``, :func:`atlaslab.search.frame.load_results` /
``load_curves``).
"""
from atlaslab.memory import MemoryParts, MemorySpec, build_memory, resolve_memory_spec
from atlaslab.engines import memorize
from atlaslab import models  # noqa: F401  (registers the built-in mixers and blocks)
from atlaslab.registry import ConfigError, list_parts, register
from atlaslab.hf import register_with_transformers

register_with_transformers()     # AutoModelForCausalLM knows "atlaslab" once transformers loads (atlaslab.hf)

__version__ = "0.1.0"
__all__ = ["ConfigError", "MemoryParts", "MemorySpec", "build_memory", "list_parts", "load_curves", "load_results",
           "memorize", "prepare", "register", "resolve_memory_spec", "resume", "run"]

def __getattr__(name):
    """The notebook API, imported on first use (Ray and MLflow for the driver, pandas for the frames)."""
    if name == "run" or name == "prepare" or name == "resume":
        from atlaslab.search import driver
        return getattr(driver, name)
    if name == "load_results" or name == "load_curves":
        from atlaslab.search import frame
        return getattr(frame, name)
    raise AttributeError(f"module 'atlaslab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
