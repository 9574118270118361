"""What every kernel op shares: where Triton can run, block sizes, the fp32 dot precision, packed-sequence tables,
gate logs, and the two torch fall-backs (a whole path when a kernel cannot launch; autograd through an op's torch
reference as its backward).

Written once here so that the ops (``delta_rule``, ``window_rule``, ``momentum``, ``mlp``, ``newton_schulz``) agree
on them; nothing here knows of memories or models (docs/kernels.md).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Callable, Optional, Sequence, Tuple, TypeVar

import torch

# ------------------------------------------------------------------------------------------ where kernels run

#: set to anything but empty / 0 / false / no / off, the torch path is always taken
FORCE_TORCH_ENV = "ATLASLAB_FORCE_TORCH"
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the interpreter's bf16 ``tl.dot`` is wrong, so it takes fp32 / fp16 only
INTERPRETER_DTYPES = (torch.float32, torch.float16)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package imports."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:   # ImportError, or a broken install
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at decoration time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def forced_torch() -> bool:
    """True when ``ATLASLAB_FORCE_TORCH`` asks for the torch path (any value but empty / 0 / false / no)."""
    return os.environ.get(FORCE_TORCH_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def available() -> bool:
    """Triton kernels can run here: triton imports AND (CUDA is available OR the interpreter is on)."""
    return triton_importable() and (torch.cuda.is_available() or interpreting())


def device_ok(x: torch.Tensor) -> Optional[str]:
    """None when a kernel can run on ``x``'s device and dtype, else the reason it cannot."""
    if x.is_cuda:
        if x.dtype not in CUDA_DTYPES:
            return f"dtype {x.dtype} (CUDA kernels take {', '.join(map(str, CUDA_DTYPES))})"
        return None
    if x.device.type == "cpu" and interpreting():
        if x.dtype not in INTERPRETER_DTYPES:
            return f"dtype {x.dtype} under the interpreter (takes float32 / float16)"
        return None
    return f"device {x.device} (needs CUDA, or CPU with TRITON_INTERPRET=1)"


# ------------------------------------------------------------------------------------------ the options kernels take

#: where a decay sits relative to the inner step (docs/concepts/memory.md#retention-placement): ``after_step`` takes
#: the gradient at S_{t−1}, ``before_step`` at the decayed state α_t S_{t−1}. Defined here, the lowest floor that
#: branches on them; the retention part (:mod:`atlaslab.memory.retention`) validates against them and owns the default,
#: and the linear kernels take ``bias``, ``placement`` and ``read`` as required arguments.
AFTER_STEP, BEFORE_STEP = "after_step", "before_step"
PLACEMENTS = (AFTER_STEP, BEFORE_STEP)
#: how a memory is read (docs/concepts/memory.md#read-granularity): ``token`` reads S_t after token t's write,
#: ``chunk`` the chunk-start state; :mod:`atlaslab.memory.spec` validates against them, both in every linear kernel
READS = ("token", "chunk")
#: the attentional biases (registered parts of :mod:`atlaslab.memory.attentional_biases`) the linear and MLP kernels
#: compute: ℓ2 (e = M(k) − v) and dot (e = −v); the engines' dispatch sends a kernel no other
KERNEL_BIASES = ("l2", "dot")


# ------------------------------------------------------------------------------------------ sizes and precision

#: largest head dim (D_k, D_v; the MLP memory's D_in, D_out) any kernel here takes: a program holds whole state
#: rows of up to this many keys (one constant for every op; the engines' dispatch reads it too)
MAX_D = 256


def check_head_dims(op: str, K: int, V: Optional[int] = None) -> None:
    """ValueError when a head dim is over :data:`MAX_D` (``V`` None: an op that splits the values into blocks and
    checks only the keys)."""
    if max(K, V if V is not None else K) > MAX_D:
        dims = f"D_k = {K}" + (f", D_v = {V}" if V is not None else "")
        raise ValueError(f"{op}: head dims {dims} must be ≤ {MAX_D}")


def pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two ≥ ``n`` and ≥ ``floor`` (16 by default: the smallest side ``tl.dot`` takes)."""
    return max(floor, 1 << (int(n) - 1).bit_length())


HALF = (torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype, allow_tf32: Optional[bool] = None) -> str:
    """``"tf32"`` or ``"ieee"``, the input precision of a kernel's fp32 ``tl.dot`` when its inputs are ``dtype``.

    IEEE fp32 dots compile to CUDA-core FMA loops without tensor cores (docs/kernels.md#precision); TF32 keeps the
    precision fp16 inputs have, so half-precision inputs lose nothing by it, and fp32 inputs follow torch's own rule.

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


def upcast(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Half-precision tensors to fp32 (a torch recompute of a kernel's backward runs in ≥ fp32); None stays None."""
    if x is None:
        return None
    return x.float() if x.dtype in HALF else x


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with ``A X = rhs`` for unit lower-triangular ``A [..., n, n]`` (only its strict lower part is read),
    ``rhs [..., n, m]``. torch has no triangular solve for fp16 / bf16 (CPU or CUDA), so half-precision inputs are
    solved in fp32 and the result cast back: the chunk forms' WY systems then run in every dtype the engines take."""
    if A.dtype in HALF or rhs.dtype in HALF:
        out = torch.linalg.solve_triangular(A.float(), rhs.float(), upper=False, unitriangular=True)
        return out.to(torch.promote_types(A.dtype, rhs.dtype))
    return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(A))⁻¹ ``[..., n, n]`` (A's diagonal and upper part are not read), in A's dtype (half
    precision solved in fp32, as :func:`solve_unit_lower`)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    return solve_unit_lower(A, eye)


# ------------------------------------------------------------------------------------------ gates

def log_gate(x: torch.Tensor) -> torch.Tensor:
    """log x, x clamped at the smallest positive normal (so log is finite; no gradient below it)."""
    return x.clamp_min(torch.finfo(x.dtype).tiny).log()


def log_gate_grad(dlog: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`log_gate` at ``x`` for an upstream ``dlog``: dlog / x where x ≥ the smallest positive
    normal, 0 below it (the clamp passes no gradient there)."""
    tiny = torch.finfo(x.dtype).tiny
    return torch.where(x >= tiny, dlog / x.clamp_min(tiny), torch.zeros_like(x))


def log_decay(alpha: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """log α ``[B, T, H]`` or ``[B, T, H, K]`` (0 without retention, shaped as ``like``'s first three axes), α clamped
    at the smallest positive normal (:func:`log_gate`)."""
    if alpha is None:
        return like.new_zeros(like.shape[:3])
    return log_gate(alpha)


# ------------------------------------------------------------------------------------------ packed sequences

def packed_sequences(cu_seqlens: Optional[torch.Tensor], B: int, T: int) -> int:
    """N, the number of sequences: B, or with ``cu_seqlens`` (packed, B = 1) its ``[N + 1]`` non-decreasing offsets
    from 0 to T (an empty sequence is allowed: it passes its state through). ValueError on anything else."""
    if cu_seqlens is None:
        return B
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed sequences (B = 1), got B = {B}")
    cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if cu is None or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be [N + 1] non-decreasing offsets from 0 to T = {T}, "
                         f"got {cu_seqlens.tolist()}")
    return len(cu) - 1


def per_sequence(fn, q, k, v, beta, alpha, initial_state, cu_seqlens, **kw):
    """Run a reference ``fn(q, k, v, beta, alpha, h0, **kw) → (o, h_T)`` on every packed sequence of ``cu_seqlens``
    alone (its own initial state) and concatenate: ``o`` along time, the final states along the sequences."""
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = slice(s, e)
        h0 = initial_state[n:n + 1] if initial_state is not None else None
        o, ht = fn(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], None if alpha is None else alpha[:, sl], h0, **kw)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk tables for packed sequences (``fla/ops/utils/index.py``), host-side.

    Args:
        cu_seqlens: ``[N + 1]`` offsets of N packed sequences.
        chunk_size: BT, the kernels' chunk (a sequence of length T_n has ⌈T_n / BT⌉ chunks, its last one
            possibly partial; chunks never cross a sequence boundary; an empty sequence has none).

    Returns:
        ``chunk_indices [NC, 2]`` int32: (sequence n, chunk index within n) of every chunk of every sequence, in
        order (row = the chunk's global index, the row of the chunk-state tensors), and ``chunk_offsets [N + 1]``
        int32: the global index of each sequence's first chunk (``chunk_offsets[-1]`` = NC).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = (lens + chunk_size - 1) // chunk_size
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    within = torch.arange(seq.numel(), device=counts.device) - offsets[seq]
    return torch.stack([seq, within], 1).to(torch.int32).contiguous(), offsets.to(torch.int32)


class ChunkLayout:
    """Where the chunks are: ``B × ⌈T / BT⌉`` equal sequences (dense), or the chunks of ``cu_seqlens``' packed
    sequences (varlen, B = 1). ``N`` sequences (rows of the initial / final states), ``NC`` chunks in all (rows of
    the chunk-state tensors, the parallel kernels' grid), ``NT`` chunks per sequence (dense only), and the
    arguments the kernels take: ``cu``, ``table`` (chunk indices, parallel kernels), ``offsets`` (sequential)."""

    def __init__(self, B: int, T: int, BT: int, cu_seqlens: Optional[torch.Tensor], like: torch.Tensor):
        self.varlen = cu_seqlens is not None
        self.NT = -(-T // BT)
        if self.varlen:
            self.cu = cu_seqlens.to(device=like.device).contiguous()
            self.table, self.offsets = prepare_chunk_indices(self.cu, BT)
            self.N, self.NC = self.cu.numel() - 1, self.table.shape[0]
        else:
            self.cu = self.table = self.offsets = like      # never read (IS_VARLEN is False)
            self.N, self.NC = B, B * self.NT


# ------------------------------------------------------------------------------------------ torch fall-backs

T = TypeVar("T")
_warned: set = set()


def launch_errors() -> tuple:
    """The exceptions of a kernel that cannot launch on this GPU: Triton's ``OutOfResources`` (none without triton;
    imported here, not at module import, so that importing the kernels' helpers does not import triton)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return ()
    return (OutOfResources,)


def with_torch_fallback(kernels: Callable[[], T], torch_path: Callable[[], T], what: str) -> T:
    """``kernels()``; when a kernel of it cannot launch on this GPU (Triton's ``OutOfResources``), ``torch_path()``.

    Triton compiles a kernel at its first launch and raises ``OutOfResources`` when the build asks for more shared
    memory or registers per block than the chip has (docs/kernels.md#fallback). Rather than fail the training step,
    every place that launches kernels runs them through here; the warning names the path once per process.

    Args:
        kernels: runs the Triton path and returns its result.
        torch_path: computes the same result on the torch path (called only after ``kernels`` failed to launch).
        what: names the path in the warning (once per ``what``).
    """
    try:
        return kernels()
    except launch_errors() as exc:
        if what not in _warned:
            _warned.add(what)
            warnings.warn(f"{what}: a Triton kernel cannot launch on this GPU ({exc}); the torch path computes it "
                          f"instead (bench/results/compile_sm90.md lists the builds over the chip's limits)",
                          RuntimeWarning, stacklevel=2)
        return torch_path()


def reference_backward(reference: Callable, saved: Sequence[Optional[torch.Tensor]], need: Sequence[bool],
                       grads_out: Sequence[Optional[torch.Tensor]], **options) -> list:
    """The gradients of ``saved`` by autograd through ``reference(*saved, **options)``, recomputed in ≥ fp32: the
    torch backward every op keeps beside its kernels (its ``BACKWARD = "torch"`` switch and launch fall-back).

    Args:
        reference: the op's differentiable torch form; returns its outputs as a tuple.
        saved: the op's tensor inputs (None where absent), in ``reference``'s order.
        need: ``ctx.needs_input_grad`` for them.
        grads_out: the gradients of ``reference``'s outputs (None where an output gets none).
        options: the non-tensor arguments of ``reference``.

    Returns:
        One entry per ``saved``: its gradient in its dtype (zeros where it needs one but gets none), else None.
    """
    grads = [None] * len(saved)
    with torch.enable_grad():
        inputs = [upcast(x).detach().requires_grad_(bool(n)) if x is not None else None for x, n in zip(saved, need)]
        outs = reference(*inputs, **options)
        pairs = [(y, g) for y, g in zip(outs, grads_out)
                 if g is not None and y is not None and y.requires_grad]
        leaves = [i for i, (x, n) in enumerate(zip(inputs, need)) if x is not None and n]
        got = (torch.autograd.grad([y for y, _ in pairs], [inputs[i] for i in leaves],
                                   [g.to(y.dtype) for y, g in pairs], allow_unused=True)
               if pairs and leaves else [None] * len(leaves))
    for i, g in zip(leaves, got):
        grads[i] = (torch.zeros_like(saved[i]) if g is None else g).to(saved[i].dtype)
    return grads
