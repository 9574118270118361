"""The input precision of the kernels' ``tl.dot`` on fp32 operands (every kernel keeps fp32 intermediates).

``tl.dot`` on fp32 operands with ``input_precision="ieee"`` compiles to CUDA-core FMA loops, not tensor cores: compiled
for sm_90 (``python bench/compile_sm90.py``) at D = 64 every chunk kernel then has no tensor-core instruction and
spills 3–25 KB of registers per thread to local memory, in fp16 / bf16 runs too (their operands are upcast to fp32);
with ``"tf32"`` the same kernels use the tensor cores and spill nothing or little. TF32 keeps a 10-bit mantissa (unit
roundoff 2⁻¹¹ ≈ 4.9e-4), which is the precision of fp16 inputs and finer than bf16's (2⁻⁸ ≈ 3.9e-3), so for
half-precision inputs it loses nothing the inputs had. For fp32 inputs torch's own rule decides, as for its matmuls:
TF32 only when ``torch.set_float32_matmul_precision("high" | "medium")`` (or ``allow_tf32=True``) asks for it.
fp64 (the float64 tests) is always IEEE: TF32 does not apply to it.
"""
from __future__ import annotations

from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype, allow_tf32: Optional[bool] = None) -> str:
    """``"tf32"`` or ``"ieee"`` for the fp32 dots of a kernel whose inputs are ``dtype``.

    Args:
        dtype: the dtype of the kernel's inputs (q, k, v or S), before any upcast.
        allow_tf32: True / False force TF32 / IEEE (fp64 stays IEEE); None (default) chooses: TF32 for fp16 / bf16
            inputs, and for fp32 inputs when ``torch.get_float32_matmul_precision()`` is not ``"highest"``.
    """
    if dtype == torch.float64:
        return "ieee"
    if allow_tf32 is not None:
        return "tf32" if allow_tf32 else "ieee"
    if dtype in HALF or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"
