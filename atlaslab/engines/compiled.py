"""Opt-in ``torch.compile`` of the chunked engine's per-chunk work (``compile: true`` beside ``mode: chunked``).

Inductor fuses the many small element-wise operations of a chunk (decay ratios, masks, coefficient products) into
generated kernels: C++ on a CPU (it needs a C++ compiler and the Python headers), Triton on a GPU. Only pure tensor
functions are compiled: the linear rules' block forms (:func:`atlaslab.engines.linear_delta.block_forms`), the dual
form's coefficients, chunk-end states and reads (:mod:`atlaslab.engines.chunked`). The inner gradients
(``gradient_factors``: a memory forward and a create-graph backward) stay eager, because AOTAutograd cannot
differentiate a compiled graph twice, and the outer loss differentiates through them.

Shapes are static (``dynamic=False``): each new input shape compiles anew, so a model trained at one shape compiles
once per distinct memory spec and shape; the first step pays for it (docs/engines.md#compiled).
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from typing import Callable, Dict

import torch

_COMPILED: Dict[Callable, Callable] = {}
_CHECKED: set = set()


def check_toolchain(device: torch.device) -> None:
    """Raise a RuntimeError naming what is missing when Inductor cannot build kernels for ``device``."""
    if device.type in _CHECKED:
        return
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "g++")   # Inductor's default: $CXX, else g++ (torch._inductor.config.cpp.cxx)
        if shutil.which(cxx) is None:
            raise RuntimeError(
                f"compile: true needs a C++ compiler for Inductor's CPU backend: '{cxx}' (g++ by default, or the "
                "compiler $CXX names) was not found. Install g++ (e.g. apt-get install g++) or set compile: false.")
        include = sysconfig.get_paths().get("include", "")
        if not os.path.exists(os.path.join(include, "Python.h")):
            raise RuntimeError(
                f"compile: true needs the Python development headers for Inductor's CPU kernels (Python.h under "
                f"{include!r} for {sys.executable}); install them (e.g. apt-get install python3-dev) or set "
                "compile: false.")
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise RuntimeError("compile: true on a GPU needs triton (Inductor's GPU backend); install atlaslab[triton] "
                               "or set compile: false.") from None
    _CHECKED.add(device.type)


def compiled(fn: Callable, device: torch.device) -> Callable:
    """``torch.compile(fn, dynamic=False)``, built once per function, after checking the toolchain for ``device``."""
    check_toolchain(device)
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def maybe_compiled(fn: Callable, compile: bool, device: torch.device) -> Callable:
    """``fn`` itself (eager, the default) or its compiled version."""
    return compiled(fn, device) if compile else fn


__all__ = ["check_toolchain", "compiled", "maybe_compiled"]
