"""GPU kernels (Triton) for the engines' fast path, each beside the plain torch reference it is tested against.

Nothing here knows of memories or models: the kernels take tensors and return tensors. The Triton engine
(:mod:`atlaslab.engines`, ``mode: triton``) picks a kernel for a memory spec, or falls back to the chunked torch
engine (docs/engines.md).
"""
