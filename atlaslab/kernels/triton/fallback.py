"""When the GPU cannot launch a Triton kernel: the torch path instead, with one warning.

Triton compiles a kernel at its first launch for the device at hand and raises ``OutOfResources`` when the build
asks for more shared memory (or registers) per block than the chip has. Compiled for sm_90 (``python
bench/compile_sm90.py``, ``bench/results/compile_sm90.md``), every build the tests and the benchmark make now fits
the 227 KiB of shared memory an H100 / H200 block can have, but some did not before they were reworked (the chunk and
window backward kernels at head dim 128 until their value block was halved, ``chunk.value_block``; the Newton–Schulz
backward at 128 × 128, 329 KB, until its staged variant), other shapes and specs are not all compiled, and other GPUs
have less. Rather than fail the
training step, every place that launches kernels runs them through :func:`with_torch_fallback`, whose fallback is
the exact torch path of the same computation (the ``chunked`` engine for a forward, the reference recompute for a
backward); the warning names the kernel path and the resource, once per path and process.
"""
from __future__ import annotations

import warnings
from typing import Callable, TypeVar

try:
    from triton.runtime.errors import OutOfResources
except ImportError:   # no triton: nothing can be out of resources
    class OutOfResources(Exception):
        """Stand-in when triton is absent (never raised)."""

T = TypeVar("T")
_warned: set = set()


def with_torch_fallback(kernels: Callable[[], T], torch_path: Callable[[], T], what: str) -> T:
    """``kernels()``; when a kernel of it cannot launch on this GPU (Triton's ``OutOfResources``), ``torch_path()``.

    Args:
        kernels: runs the Triton path and returns its result.
        torch_path: computes the same result on the torch path (called only after ``kernels`` failed to launch).
        what: names the path in the warning (once per ``what``).
    """
    try:
        return kernels()
    except OutOfResources as exc:
        if what not in _warned:
            _warned.add(what)
            warnings.warn(f"{what}: a Triton kernel cannot launch on this GPU ({exc}); the torch path computes it "
                          f"instead (bench/results/compile_sm90.md lists the builds over the chip's limits)",
                          RuntimeWarning, stacklevel=2)
        return torch_path()
