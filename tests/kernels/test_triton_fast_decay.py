"""Fast-forgetting heads on the per-head (scalar) decay kernels, under TRITON_INTERPRET=1.

A head whose kept fraction α is small (here α ∈ [0.02, 0.2], or exactly 0 on one token: a saturated sigmoid gate in
bf16) decays below e^−88 within a chunk. The kernels' pairwise decays e^{g_t − g_s} are ≤ 1 on real rows, but a
padded row past a ragged chunk's end loads g = 0 and e^{−g_s} overflowed to inf, which times that row's zeros made
NaN gradients of k, v, β and α for the whole chunk (the c = 1 chunk kernel and its token-by-token kernel, whose
backward is the chunk backward, and the momentum chunk kernel). Checked: ``memorize(mode="triton")`` against
``memorize(mode="recurrent")`` in float64 — outputs, final memory and every input gradient (RMS-error ratio ≤ 1e-3
in fp32).
"""
import copy

import pytest
import torch
from helpers import random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.engines import memorize  # noqa: E402

DEVICE = triton_device(tk)
H, D = 2, 8
pytestmark = pytest.mark.usefixtures("poison_empty")
LINEAR = {"name": "linear"}
CASES = {   # name: (spec, chunk size b, T, the kernel memorize(mode="triton") must pick)
    "gdn_before_chunk": ({"memory": LINEAR, "retention": {"name": "decay", "placement": "before_step"}}, 1, 40,
                         "chunk"),
    "gdn_after_dot_chunk": ({"memory": LINEAR, "attentional_bias": "dot", "retention": "decay"}, 1, 40, "chunk"),
    "gdn_token_kernel": ({"memory": LINEAR, "retention": {"name": "decay", "placement": "before_step"}}, 1, 40,
                         "fused_recurrent"),
    "omega_c2_chunk": ({"memory": LINEAR, "retention": "decay", "window": {"size": 2}}, 1, 40, "chunk"),
    "momentum_b64": ({"memory": LINEAR, "retention": "decay", "inner_optimizer": "momentum"}, 64, 45,
                     "chunk_momentum"),
}


@pytest.fixture
def kernel_choice(monkeypatch):
    """Pin ``auto``'s T threshold: 0 → the chunk kernels at every T, 64 → the token kernel for T ≤ 64."""
    return lambda kind: monkeypatch.setattr(tk, "RECURRENT_MAX_T", 64 if kind == "fused_recurrent" else 0)


def _problem(parts, T, zero_token):
    q, k, v = random_qkv(B=1, T=T, H=H, Dk=D, seed=3)
    names = ["lr", "retention"] + (["momentum"] if parts.inner_optimizer.has_momentum else []) \
        + (["window"] if parts.window.size != 1 else [])
    gates = random_gates(B=1, T=T, H=H, seed=4, names=names, low=0.3, high=0.9)
    gates["retention"] = random_gates(B=1, T=T, H=H, seed=5, names=("retention",), low=0.02, high=0.2)["retention"]
    if zero_token:
        gates["retention"][:, T // 2] = 0.0
    return (q, k, v), gates


def _run(parts, data, dtype, mode, b):
    (q, k, v), gates = data
    parts = copy.deepcopy(parts).to(device=DEVICE, dtype=dtype)
    leaves = [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]
    gl = {n: x.to(DEVICE, dtype).requires_grad_() for n, x in gates.items()}
    o, state = memorize(*leaves, parts, gl, mode=mode, chunk_size=b)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(o)
    loss = (o * w).sum() + state.weights["W"].sum()
    return o, state, dict(zip(["q", "k", "v", *gl], torch.autograd.grad(loss, leaves + list(gl.values()))))


@pytest.mark.parametrize("zero_token", [False, True], ids=["alpha_0.02-0.2", "one_alpha_0"])
@pytest.mark.parametrize("name", list(CASES))
def test_fast_forgetting_head_matches_the_reference(name, zero_token, kernel_choice):
    spec, b, T, kind = CASES[name]
    kernel_choice(kind)
    torch.manual_seed(0)
    parts = build_memory(spec, H, D, D).double()
    engine = tk.select_kernel(parts.float(), torch.zeros(1, T, H, D, device=DEVICE), b)
    assert engine is not None and engine.kernel == kind
    data = _problem(parts, T, zero_token)
    o, state, grads = _run(parts, data, torch.float32, "triton", b)
    o_ref, ref, grads_ref = _run(parts, data, torch.float64, "recurrent", b)
    assert rms_ratio(o.double(), o_ref) <= 1e-3
    assert rms_ratio(state.weights["W"].double(), ref.weights["W"]) <= 1e-3
    for n, g in grads.items():
        assert torch.isfinite(g).all(), n
        if n == "retention" and zero_token:   # α = 0 is clamped to the smallest normal: its own gradient is 0
            t = T // 2
            g, g_ref = torch.cat([g[:, :t], g[:, t + 1:]], 1), torch.cat([grads_ref[n][:, :t], grads_ref[n][:, t + 1:]],
                                                                         1)
        else:
            g_ref = grads_ref[n]
        assert rms_ratio(g.double(), g_ref) <= 1e-3, n
