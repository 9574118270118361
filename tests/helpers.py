"""Shared helpers for the tests (importable as `helpers` since pytest puts tests/ on sys.path)."""
import collections

import torch


def rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS(a − b) / RMS(b): fla's relative error measure for comparing a fast path with a reference (``a`` is moved
    to ``b``'s device, so a GPU result compares with a CPU reference)."""
    a = a.to(b.device)
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def random_qkv(B=2, T=7, H=2, Dk=4, Dv=None, seed=0, dtype=torch.float64, normalise=True, requires_grad=False):
    """q, k: [B, T, H, Dk] (ℓ2-normalised like the layer does), v: [B, T, H, Dv]."""
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or Dk
    q = torch.randn(B, T, H, Dk, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, Dk, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    if normalise:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    if requires_grad:
        q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    return q, k, v


def random_gates(B=2, T=7, H=2, seed=1, dtype=torch.float64, names=("lr",), low=0.2, high=0.9, Dk=None):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names:
        shape = (B, T, H, Dk) if (n == "retention" and Dk) else (B, T, H)
        out[n] = low + (high - low) * torch.rand(*shape, generator=g, dtype=dtype)
    return out


def require_triton():
    """``atlaslab.engines.triton`` (the Triton engine: dispatch, spec checks, where kernels run) for a Triton test
    module; skips the module when its kernels cannot run here."""
    import pytest
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels are not tested")
    from atlaslab.engines import triton as tk
    if not tk.available():
        pytest.skip("Triton kernels cannot run here (no CUDA device and TRITON_INTERPRET is not 1)",
                    allow_module_level=True)
    return tk


def triton_device(tk) -> str:
    """Where the Triton tests put their tensors: the GPU when kernels compile for it, else the interpreter's CPU."""
    return "cuda" if torch.cuda.is_available() and not tk.interpreting() else "cpu"


def count_launches(monkeypatch, module, keep) -> collections.Counter:
    """Count launches of ``module``'s Triton kernels whose names ``keep(name)`` accepts: ``kernel[grid](...)`` goes
    through the wrapper's ``__getitem__``. Returns the live counter (kernel name → launches)."""
    counts = collections.Counter()

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            counts[self.name] += 1
            return self.kernel[grid]

    for name in dir(module):
        if name.endswith("_kernel") and keep(name):
            monkeypatch.setattr(module, name, Counted(name, getattr(module, name)))
    return counts


def momentum_parts(spec, H, D, device):
    """A momentum-trained memory built from ``spec`` (heads ``H``, dims ``D``) with every learnable piece drawn at
    std 0.3 (a non-zero initial memory), seeded, on ``device``."""
    from atlaslab.memory import build_memory
    torch.manual_seed(0)
    parts = build_memory(spec, H, D, D)
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return parts.to(device)


def momentum_data(parts, T, H, D, seed=0, B=2):
    """float64 q, k, v ``[B, T, H, D]`` and the gates a momentum spec reads (lr, window, momentum, and retention when
    the spec decays), in [0.5, 0.95]."""
    q, k, v = random_qkv(B, T, H, D, seed=seed)
    names = ("lr", "window", "momentum") + (("retention",) if parts.retention.uses_alpha else ())
    gates = random_gates(B, T, H, seed=seed + 1, names=names, low=0.5, high=0.95)
    return on_device_of(parts, (q, k, v), gates)


def on_device_of(parts, qkv, gates):
    """``(q, k, v)`` and the gates moved to the device of ``parts``' parameters (CPU when it has none)."""
    device = next((p.device for p in parts.parameters()), torch.device("cpu"))
    return tuple(x.to(device) for x in qkv), {n: x.to(device) for n, x in gates.items()}


def channel_alpha(shape, seed, fast, dtype=torch.float64):
    """A channel-wise kept fraction α ``[..., D_k]`` in [0.5, 0.95], key channel 0 at ≈ ``fast`` (fast forgetting)."""
    g = torch.Generator().manual_seed(seed)
    alpha = 0.5 + 0.45 * torch.rand(*shape, generator=g, dtype=dtype)
    alpha[..., 0] = fast * (1 + 0.2 * torch.rand(*shape[:-1], generator=g, dtype=dtype))
    return alpha


def momentum_state_loss(o, state):
    """A fixed random functional of a momentum memory's output and whole final state (memory, momentum, anchor,
    Π α), so one backward reaches every input through every part of the state."""
    g = torch.Generator().manual_seed(7)
    terms = [o, state.weights["W"], state.momentum["W"], state.anchor["W"], state.chunk_alpha]
    return sum((x * torch.randn(x.shape, generator=g, dtype=torch.float64).to(x)).sum() for x in terms)


def grad_leaves(parts, data, dtype, device):
    """``data = ((q, k, v), gates)`` cast to ``dtype`` on ``device`` as leaves → ``((q, k, v), gates, leaves)``,
    leaves = [q, k, v, *gates, *parts.parameters()]."""
    (q, k, v), gates = data
    q, k, v = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
    gates = {n: x.to(device, dtype).requires_grad_() for n, x in gates.items()}
    return (q, k, v), gates, [q, k, v, *gates.values(), *parts.parameters()]


def momentum_run(parts, data, dtype, mode, b, device):
    """``memorize`` of a copy of ``parts`` in ``dtype`` → (o, state, grads of :func:`momentum_state_loss` w.r.t.
    [q, k, v, *gates, *parameters])."""
    import copy
    from atlaslab.engines import memorize
    parts = copy.deepcopy(parts).to(dtype)
    (q, k, v), gates, leaves = grad_leaves(parts, data, dtype, device)
    o, state = memorize(q, k, v, parts, gates, mode=mode, chunk_size=b)
    return o, state, torch.autograd.grad(momentum_state_loss(o, state), leaves)


class Recorder(torch.nn.Module):
    """A model that records the training inputs it is given: ``seen`` holds ``(ids, cu_seqlens)`` per call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, ids, cu_seqlens=None):
        if self.training:
            self.seen.append((ids.clone(), None if cu_seqlens is None else cu_seqlens.clone()))
        return self.model(ids, cu_seqlens=cu_seqlens)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a torch.distributed group of test processes)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
