"""Backward of the chunked Triton delta / Hebbian kernel (atlaslab/kernels/delta_rule/chunk.py), under TRITON_INTERPRET=1.

- the hand-derived torch backward (:func:`reference.delta_rule_chunk_backward`, the plain reference of the backward
  kernels) equals autograd through :func:`reference.delta_rule_chunk` in float64 (to ~1e-12), every rule;
- :func:`chunk_delta_rule` (Triton forward + Triton backward kernels) in float32 against the float64 token loop
  :func:`reference.delta_rule_recurrent`: output, final state and the gradient of every input (q, k, v, β, α and the
  initial state), RMS-error ratio ≤ 1e-3 — over ℓ2 / dot bias × both decay placements × read token / chunk, without
  decay, without an initial state, without a final-state gradient, T not a multiple of the chunk, T < chunk,
  ``cu_seqlens``;
- ``ChunkFunction`` runs the backward kernels (not the torch recompute) unless ``BACKWARD = "torch"``; both agree;
  the token-by-token kernel's backward runs on the same kernels;
- half-precision inputs get gradients in their dtype.

Outputs the kernels allocate are NaN-poisoned (fla's conftest trick). Shapes are tiny (the interpreter is slow).
"""
import pytest
import torch
from helpers import require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.kernels.delta_rule.naive import (delta_rule_chunk, delta_rule_chunk_backward,  # noqa: E402
                                               delta_rule_recurrent)
from atlaslab.kernels.delta_rule import chunk as chunk_mod  # noqa: E402
from atlaslab.kernels.delta_rule.chunk import chunk_backward, chunk_delta_rule  # noqa: E402
from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
RULES = [(b, p, r) for b in ("l2", "dot") for p in ("before_step", "after_step") for r in ("token", "chunk")]


def _inputs(B, T, H, K, V, seed=0, alpha=True, h0=True, N=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = 0.2 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    a = 0.6 + 0.39 * torch.rand(B, T, H, generator=g, dtype=torch.float64) if alpha else None
    s0 = 0.5 * torch.randn(N or B, H, V, K, generator=g, dtype=torch.float64) if h0 else None
    return [x.to(device=DEVICE, dtype=dtype) if x is not None else None for x in (q, k, v, beta, a, s0)]


def _grads_vs_float64(inputs, opts, chunk_size=16, final_grad=True, seed=7):
    """chunk_delta_rule (in the inputs' dtype) vs the float64 token loop; returns {name: RMS-error ratio}."""
    names = ("q", "k", "v", "beta", "alpha", "h0")
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    ref_leaves = [x.detach().double().requires_grad_() if x is not None else None for x in inputs]
    o, ht = chunk_delta_rule(*leaves, chunk_size=chunk_size, **opts)
    o_r, ht_r = delta_rule_recurrent(*ref_leaves, **opts)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o_r.shape, generator=g, dtype=torch.float64).to(o_r.device)
    dht = torch.randn(ht_r.shape, generator=g, dtype=torch.float64).to(ht_r.device)

    def loss(o, ht):
        out = (o * do.to(o)).sum()
        return out + (ht * dht.to(ht)).sum() if final_grad else out

    loss(o, ht).backward()
    loss(o_r, ht_r).backward()
    ratios = {"o": rms_ratio(o.double(), o_r), "ht": rms_ratio(ht.double(), ht_r)}
    for n, a, r in zip(names, leaves, ref_leaves):
        if r is not None:
            assert a.grad is not None and a.grad.dtype == a.dtype and torch.isfinite(a.grad).all(), n
            ratios["d" + n] = rms_ratio(a.grad.double(), r.grad)
    return ratios


def _assert_ratios(ratios, tol=TOL):
    bad = {n: r for n, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS-error ratios above {tol}: {bad} (all: {ratios})"


# --------------------------------------------------------------------------- the torch backward reference

@pytest.mark.parametrize("alpha, h0", [(True, True), (False, False)])
def test_reference_backward_equals_autograd(alpha, h0):
    x = _inputs(2, 11, 2, 4, 5, alpha=alpha, h0=h0, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for bias, placement, read in RULES:
        opts = dict(bias=bias, placement=placement, read=read, chunk_size=4)
        leaves = [t.clone().requires_grad_() if t is not None else None for t in x]
        o, ht = delta_rule_chunk(*leaves, **opts)
        do = torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)
        dht = torch.randn(ht.shape, generator=g, dtype=ht.dtype).to(ht.device)
        auto = torch.autograd.grad([o, ht], [t for t in leaves if t is not None], [do, dht])
        mine = [m for m in delta_rule_chunk_backward(*x, do, dht, **opts) if m is not None]
        assert len(mine) == len(auto)
        for a, m in zip(auto, mine):
            assert rms_ratio(m, a) < 1e-12


def test_reference_backward_cu_seqlens_equals_autograd():
    cu = torch.tensor([0, 3, 4, 13])
    x = _inputs(1, 13, 2, 4, 4, seed=2, N=3, dtype=torch.float64)
    opts = dict(bias="l2", placement="after_step", read="chunk", cu_seqlens=cu, chunk_size=4)
    leaves = [t.clone().requires_grad_() for t in x]
    o, ht = delta_rule_chunk(*leaves, **opts)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    auto = torch.autograd.grad([o, ht], leaves, [do, dht])
    for a, m in zip(auto, delta_rule_chunk_backward(*x, do, dht, **opts)):
        assert rms_ratio(m, a) < 1e-12


# -------------------------------------------------------------------------------- the Triton backward

@pytest.mark.parametrize("bias, placement, read", RULES)
def test_chunk_backward_matches_float64_token_loop(bias, placement, read):
    # T = 37 with 16-token chunks: two full chunks and a ragged one; scalar decay and an initial state
    _assert_ratios(_grads_vs_float64(_inputs(2, 37, 2, 8, 12), dict(bias=bias, placement=placement, read=read)))


@pytest.mark.parametrize("bias, read", [("l2", "token"), ("dot", "chunk")])
def test_chunk_backward_without_decay_or_initial_state(bias, read):
    _assert_ratios(_grads_vs_float64(_inputs(2, 37, 1, 16, 8, seed=1, alpha=False, h0=False),
                                     dict(bias=bias, placement="before_step", read=read)))


def test_chunk_backward_without_final_state_gradient_and_short_sequence():
    # T = 5 < chunk; the loss reads o only (dht is None in the backward)
    _assert_ratios(_grads_vs_float64(_inputs(1, 5, 2, 8, 16, seed=2), dict(bias="l2", placement="before_step",
                                                                             read="token"), final_grad=False))


def test_chunk_backward_cu_seqlens():
    cu = torch.tensor([0, 5, 6, 30], device=DEVICE)
    opts = dict(bias="l2", placement="before_step", read="token", cu_seqlens=cu)
    _assert_ratios(_grads_vs_float64(_inputs(1, 30, 2, 8, 8, seed=4, N=3), opts))


def test_chunk_backward_kernel_equals_torch_reference_backward():
    # the Triton backward directly against its plain reference (float64), including dh0 with no dht
    x = _inputs(1, 21, 1, 8, 16, seed=5)
    do = torch.randn(1, 21, 1, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    opts = dict(bias="l2", placement="after_step", read="chunk", chunk_size=16)
    tri = chunk_backward(*x, do, None, **opts)
    ref = delta_rule_chunk_backward(*[t.double() for t in x], do.double(), None, **opts)
    for a, r in zip(tri, ref):
        assert a.dtype == torch.float32 and rms_ratio(a.double(), r) <= TOL


def test_chunk_function_uses_backward_kernels_and_torch_fallback_agrees(monkeypatch):
    x = _inputs(1, 19, 1, 8, 8, seed=8)
    opts = dict(bias="l2", placement="before_step", read="token", chunk_size=16)

    def grads():
        leaves = [t.clone().requires_grad_() for t in x]
        o, ht = chunk_delta_rule(*leaves, **opts)
        (o.square().sum() + ht.sum()).backward()
        return [t.grad for t in leaves]

    def boom(*a, **kw):
        raise AssertionError("the torch recompute ran")

    monkeypatch.setattr(chunk_mod, "_torch_backward", boom)
    g_kernel = grads()                                   # the default backward never calls the recompute
    monkeypatch.undo()
    monkeypatch.setattr(chunk_mod, "BACKWARD", "torch")
    monkeypatch.setattr(chunk_mod, "chunk_backward", boom)
    g_torch = grads()
    for a, b in zip(g_kernel, g_torch):
        assert rms_ratio(a, b) <= TOL


def test_fused_recurrent_backward_on_chunk_kernels_and_torch_fallback_agree(monkeypatch):
    x = _inputs(1, 7, 2, 8, 8, seed=10)
    opts = dict(bias="l2", placement="after_step", read="chunk")

    def grads():
        leaves = [t.clone().requires_grad_() for t in x]
        o, ht = fused_recurrent_delta_rule(*leaves, **opts)
        (o.square().sum() + ht.sum()).backward()
        return [t.grad for t in leaves]

    calls = []
    monkeypatch.setattr(chunk_mod, "chunk_backward", lambda *a, **kw: calls.append(1) or chunk_backward(*a, **kw))
    g_kernel = grads()
    assert calls                                          # the chunk backward kernels ran
    monkeypatch.setattr(chunk_mod, "BACKWARD", "torch")
    g_torch = grads()
    assert len(calls) == 1
    for a, b in zip(g_kernel, g_torch):
        assert rms_ratio(a, b) <= TOL


def test_chunk_backward_half_precision_dtypes():
    x = _inputs(1, 18, 1, 16, 16, seed=9, dtype=torch.float16)
    leaves = [t.clone().requires_grad_() for t in x]
    o, ht = chunk_delta_rule(*leaves, bias="l2", placement="before_step", read="token", chunk_size=16)
    (o.float().square().sum() + ht.float().sum()).backward()
    ref = [t.double().requires_grad_() for t in x]
    o_r, ht_r = delta_rule_recurrent(*ref, bias="l2", placement="before_step", read="token")
    (o_r.square().sum() + ht_r.sum()).backward()
    for a, r in zip(leaves, ref):
        assert a.grad.dtype == torch.float16 and rms_ratio(a.grad.double(), r.grad) <= 2e-2


@pytest.mark.parametrize("bias", ["l2", "dot"])
def test_several_value_blocks_at_head_dim_128(bias):
    """D_k = 128: the state and backward kernels split D_v = 80 into value blocks of BV = 32 (chunk.value_block,
    sized so their sm_90 builds fit an H100 / H200 block's shared memory), two full and one ragged."""
    assert chunk_mod.value_block(128, 128) == 32
    _assert_ratios(_grads_vs_float64(_inputs(1, 21, 1, 128, 80, seed=6),
                                     dict(bias=bias, placement="before_step", read="token")))
