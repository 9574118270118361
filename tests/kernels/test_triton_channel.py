"""Channel-wise (per key channel, GLA-style) decay in the Triton kernels, under TRITON_INTERPRET=1.

S_t = S_{t−1} Diag(α_t) (+ the ℓ2 / dot write, both placements); α: ``[B, T, H, D_k]``.

- torch: the chunk form (:func:`reference.delta_rule_chunk`) equals the token loop in float64, and its hand-derived
  backward (:func:`reference.delta_rule_chunk_backward`) equals autograd; with all channels equal it reduces to the
  per-head scalar decay;
- Triton: the chunk kernel (forward + backward kernels) and the token-by-token kernel in float32 vs the float64 token
  loop (outputs, final state, every input gradient, RMS-error ratio ≤ 1e-3), incl. ``cu_seqlens``;
- ``memorize(mode="triton")`` with a channel-wise spec dispatches to the kernels and matches ``recurrent``.

Shapes are tiny: the channel-wise kernels form the intra-chunk decays pairwise in a loop (slow in the interpreter).
"""
import pytest
import torch
from helpers import random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.kernels.delta_rule.naive import (delta_rule_chunk, delta_rule_chunk_backward,  # noqa: E402
                                               delta_rule_recurrent)
from atlaslab.kernels.delta_rule.chunk import chunk_delta_rule  # noqa: E402
from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
RULES = [(b, p, r) for b in ("l2", "dot") for p in ("before_step", "after_step") for r in ("token", "chunk")]


def _inputs(B, T, H, K, V, seed=0, h0=True, N=None, dtype=torch.float32, low=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = 0.2 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    a = low + (0.99 - low) * torch.rand(B, T, H, K, generator=g, dtype=torch.float64)
    s0 = 0.5 * torch.randn(N or B, H, V, K, generator=g, dtype=torch.float64) if h0 else None
    return [x.to(device=DEVICE, dtype=dtype) if x is not None else None for x in (q, k, v, beta, a, s0)]


def _ratios(kernel, inputs, opts, **kw):
    """``kernel`` (in the inputs' dtype) vs the float64 token loop: {name: RMS-error ratio}, o, ht and grads."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    ref = [x.detach().double().requires_grad_() if x is not None else None for x in inputs]
    o, ht = kernel(*leaves, **opts, **kw)
    o_r, ht_r = delta_rule_recurrent(*ref, **opts)
    g = torch.Generator().manual_seed(11)
    do = torch.randn(o_r.shape, generator=g, dtype=torch.float64).to(o_r.device)
    dht = torch.randn(ht_r.shape, generator=g, dtype=torch.float64).to(ht_r.device)
    ((o * do.to(o)).sum() + (ht * dht.to(ht)).sum()).backward()
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    out = {"o": rms_ratio(o.double(), o_r), "ht": rms_ratio(ht.double(), ht_r)}
    for n, a, r in zip(("q", "k", "v", "beta", "alpha", "h0"), leaves, ref):
        if r is not None:
            assert a.grad is not None and torch.isfinite(a.grad).all(), n
            out["d" + n] = rms_ratio(a.grad.double(), r.grad)
    return out


def _assert_ratios(ratios, tol=TOL):
    bad = {n: r for n, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS-error ratios above {tol}: {bad} (all: {ratios})"


# ----------------------------------------------------------------------------------------------- torch

def test_reference_channel_wise_chunk_and_backward():
    x = _inputs(2, 11, 2, 4, 5, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for bias, placement, read in RULES:
        opts = dict(bias=bias, placement=placement, read=read)
        leaves = [t.clone().requires_grad_() for t in x]
        o, ht = delta_rule_chunk(*leaves, chunk_size=4, **opts)
        o_r, ht_r = delta_rule_recurrent(*x, **opts)
        assert rms_ratio(o, o_r) < 1e-12 and rms_ratio(ht, ht_r) < 1e-12
        do = torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)
        dht = torch.randn(ht.shape, generator=g, dtype=ht.dtype).to(ht.device)
        auto = torch.autograd.grad([o, ht], leaves, [do, dht])
        for a, m in zip(auto, delta_rule_chunk_backward(*x, do, dht, chunk_size=4, **opts)):
            assert rms_ratio(m, a) < 1e-12
        # equal channels: the per-head scalar decay
        a1 = x[4][..., :1]
        o_s, ht_s = delta_rule_chunk(*x[:4], a1[..., 0], x[5], chunk_size=4, **opts)
        o_c, ht_c = delta_rule_chunk(*x[:4], a1.expand_as(x[4]), x[5], chunk_size=4, **opts)
        assert rms_ratio(o_c, o_s) < 1e-12 and rms_ratio(ht_c, ht_s) < 1e-12


# ---------------------------------------------------------------------------------------------- Triton

@pytest.mark.parametrize("bias, placement, read", [("l2", "before_step", "token"), ("l2", "after_step", "chunk"),
                                                   ("dot", "after_step", "token")])
def test_chunk_channel_wise_matches_float64_token_loop(bias, placement, read):
    # T = 21 with 16-token chunks (a ragged chunk); strong decay (α down to 0.05) exercises the pairwise exponents
    _assert_ratios(_ratios(chunk_delta_rule, _inputs(1, 21, 2, 8, 12, low=0.05),
                           dict(bias=bias, placement=placement, read=read), chunk_size=16))


def test_chunk_channel_wise_short_sequence_without_initial_state():
    # T = 5 < chunk, zero initial state (no dh0)
    _assert_ratios(_ratios(chunk_delta_rule, _inputs(2, 5, 1, 8, 16, seed=6, h0=False),
                           dict(bias="l2", placement="after_step", read="token"), chunk_size=16))


def test_chunk_channel_wise_cu_seqlens():
    cu = torch.tensor([0, 3, 20], device=DEVICE)
    _assert_ratios(_ratios(chunk_delta_rule, _inputs(1, 20, 1, 16, 8, seed=2, N=2),
                           dict(bias="l2", placement="before_step", read="chunk", cu_seqlens=cu), chunk_size=16))


@pytest.mark.parametrize("placement, read", [("before_step", "token"), ("after_step", "chunk")])
def test_fused_recurrent_channel_wise_matches_float64_token_loop(placement, read):
    _assert_ratios(_ratios(fused_recurrent_delta_rule, _inputs(2, 9, 2, 8, 12, seed=3),
                           dict(bias="l2", placement=placement, read=read)))


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
def test_memorize_triton_channel_wise_matches_recurrent(kernel, monkeypatch):
    H, D, T = 2, 8, 9 if kernel == "fused_recurrent" else 18
    torch.manual_seed(0)
    parts = build_memory({"memory": "linear", "attentional_bias": "l2",
                          "retention": {"name": "decay", "placement": "before_step", "channel_wise": True}}, H, D, D)
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    parts = parts.to(DEVICE)
    monkeypatch.setattr(tk, "RECURRENT_MAX_T", 64 if kernel == "fused_recurrent" else 0)
    assert tk.spec_reason(parts, 1) is None
    assert tk.select_kernel(parts, torch.zeros(1, T, H, D, device=DEVICE), 1).kernel == kernel
    q, k, v = (x.to(DEVICE) for x in random_qkv(1, T, H, D, seed=4, dtype=torch.float32, requires_grad=True))
    gates = {n: x.to(DEVICE).requires_grad_() for n, x in
             random_gates(1, T, H, seed=5, names=("lr", "retention"), dtype=torch.float32, low=0.5, high=0.95,
                          Dk=D).items()}
    assert gates["retention"].shape == (1, T, H, D)
    leaves = [q, k, v, *gates.values()]
    res = []
    for mode in ("recurrent", "triton"):
        o, state = memorize(q, k, v, parts, gates, mode=mode, chunk_size=1, block_size=16)
        grads = torch.autograd.grad(o.square().sum() + state.weights["W"].sum(), leaves)
        res.append((o, state.weights["W"], grads))
    (o_r, W_r, g_r), (o_t, W_t, g_t) = res
    assert rms_ratio(o_t, o_r) <= TOL and rms_ratio(W_t, W_r) <= TOL
    for a, r in zip(g_t, g_r):
        assert rms_ratio(a, r) <= TOL


@pytest.mark.parametrize("bias", ["l2", "dot"])
def test_fast_forgetting_channels_in_a_ragged_last_chunk(bias):
    """Two channels keep α = 0.04 (log-decay ≈ −3.2 a token, Σ over a chunk far below fp32's exp range) and the last
    chunk is partial: the padded rows' decay exponents must never reach exp (they once gave inf · 0 = NaN in dk, dv,
    dβ, dα of the backward kernel)."""
    q, k, v, beta, a, s0 = _inputs(1, 62, 1, 8, 8, seed=5)
    a[..., :2] = 0.04
    r = _ratios(chunk_delta_rule, (q, k, v, beta, a, s0),
                dict(bias=bias, placement="before_step", read="token"), chunk_size=32)
    assert max(r.values()) <= TOL, r
