"""Triton kernels for the hot paths of atlaslab (see dispatch in this package)."""
