"""A Triton kernel that cannot launch on the GPU at hand (Triton's OutOfResources: e.g. the chunk backward kernels at
head dim 128 ask for more shared memory than an H200 block has, bench/results/compile_sm90.md) falls back to the
exact torch path with one warning, forward and backward, instead of failing the step (atlaslab/kernels/utils.py: with_torch_fallback).
The launch failure is simulated: the named kernel raises OutOfResources when launched."""
import pytest
import torch

from helpers import random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from triton.runtime.errors import OutOfResources  # noqa: E402

from atlaslab import build_memory, memorize  # noqa: E402
from atlaslab.kernels.newton_schulz import newton_schulz as ns_torch  # noqa: E402
from atlaslab.kernels.delta_rule import chunk as chunk_mod  # noqa: E402
from atlaslab.kernels import utils as fallback  # noqa: E402
from atlaslab.kernels.newton_schulz import fused as ns_mod  # noqa: E402

DEVICE = triton_device(tk)
H, D, T = 2, 8, 21
GDN = {"memory": {"name": "linear", "init": "zeros"}, "retention": {"name": "decay", "placement": "before_step"}}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fallback, "_warned", set())


def cannot_launch(monkeypatch, module, name):
    """``module.name`` raises OutOfResources at launch (as Triton does when a build exceeds the chip's limits)."""
    class Unlaunchable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(300_000, 232_448, "shared memory")
            return launch
    monkeypatch.setattr(module, name, Unlaunchable())


def _step(mode, parts):
    (q, k, v), gates = random_qkv(1, T, H, D, seed=3, dtype=torch.float32), random_gates(
        1, T, H, seed=4, names=("lr", "retention"), dtype=torch.float32, low=0.3, high=0.95)
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    gl = {n: g.to(DEVICE).requires_grad_() for n, g in gates.items()}
    o, state = memorize(*leaves, parts, gl, mode=mode, chunk_size=1)
    grads = torch.autograd.grad((o * o).sum() + state.weights["W"].sum(), leaves + list(gl.values()))
    return [o, state.weights["W"], *grads]


@pytest.mark.parametrize("kernel", ["_chunk_bwd_grad_kernel", "_chunk_ut_kernel"])
def test_chunk_kernel_that_cannot_launch_falls_back_to_torch(monkeypatch, kernel):
    parts = build_memory(GDN, H, D, D).to(DEVICE)
    monkeypatch.setattr(tk, "RECURRENT_MAX_T", 0)           # the chunk kernel at every T
    reference = _step("chunked", parts)
    cannot_launch(monkeypatch, chunk_mod, kernel)
    with pytest.warns(RuntimeWarning, match="cannot launch on this GPU") as record:
        got = _step("triton", parts)
        _step("triton", parts)                              # a second step: no second warning
    assert len(record) == 1
    assert max(rms_ratio(a.double(), b.double()) for a, b in zip(got, reference)) <= 1e-5


def test_newton_schulz_kernels_that_cannot_launch_fall_back(monkeypatch):
    s = torch.randn(3, 8, 16, device=DEVICE)
    w = torch.randn(3, 8, 16, device=DEVICE)
    a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
    cannot_launch(monkeypatch, ns_mod, "_ns_bwd_kernel")    # the forward runs, its backward cannot
    with pytest.warns(RuntimeWarning, match="newton_schulz backward"):
        (ga,) = torch.autograd.grad(ns_mod.newton_schulz(a), a, w)
    (gb,) = torch.autograd.grad(ns_torch(b), b, w)
    assert rms_ratio(ga, gb) <= 1e-5
    cannot_launch(monkeypatch, ns_mod, "_ns_kernel")        # now the forward cannot either
    with pytest.warns(RuntimeWarning, match="newton_schulz:"):
        y = ns_mod.newton_schulz(s)
    assert torch.equal(y, ns_torch(s))
