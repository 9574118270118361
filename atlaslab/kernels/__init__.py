"""GPU kernels (Triton), one folder per operation as in fla's ``fla/ops``: ``delta_rule``, ``window_rule``,
``momentum``, ``mlp``, ``newton_schulz``, each with its plain torch reference (``naive.py``) beside its kernels, and
the helpers they share in :mod:`.utils`.

Nothing here knows of memories or models: the kernels take tensors and return tensors. The Triton engine
(:mod:`atlaslab.engines.triton`, ``mode: triton``) picks a kernel for a memory spec, or falls back to the chunked
torch engine (docs/kernels.md).
"""
