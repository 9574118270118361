"""``triton`` and ``triton.language`` (``tl``) when triton imports, both None otherwise: the one guarded import of the
kernel modules, which define their ``@triton.jit`` bodies under ``if triton is not None:`` (the package imports
without triton; callers check :func:`atlaslab.kernels.utils.available`)."""
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None
