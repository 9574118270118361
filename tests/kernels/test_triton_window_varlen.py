"""Variable-length batches (``cu_seqlens``) on the Omega-window (c > 1) Triton kernels — the chunk kernels
(atlaslab/kernels/window_rule/chunk.py) and the token-by-token kernel (``fused_recurrent_window_rule``) — under
TRITON_INTERPRET=1.

Packed sequences ``[1, total_T, H, ·]`` with lengths [5, 17, 1, 20] and 16-token chunks (partial chunks, a length-1
sequence, sequences over one chunk long): the window slots are gathered by :func:`reference.window_slots` with
``cu_seqlens`` (a slot never reaches across its sequence's start: coefficient 0 there), the kernels run natively
(fla's chunk-index table, one launch per stage) and must equal each sequence run alone through the float64 token
loop :func:`reference.window_rule_recurrent`: outputs, per-sequence final states and the gradients of q, k, v, η,
γ, α and the per-sequence initial states (RMS-error ratio ≤ 1e-3 in float32), c = 2 and 3, ℓ2 and dot bias, both
placements and reads, per-head and channel-wise decay. The token-by-token kernel restarts its state (and, through
the slots, its window) at each sequence start: one launch for all sequences, its backward on the chunk window
kernels. The torch references' ``cu_seqlens`` paths are checked too.

Outputs the kernels allocate are NaN-poisoned (fla's conftest trick). Shapes are tiny (the interpreter is slow).
"""

import pytest
import torch
from helpers import count_launches, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.kernels.window_rule import chunk as win_mod  # noqa: E402
from atlaslab.kernels.window_rule import fused_recurrent as fused_mod  # noqa: E402
from atlaslab.kernels.window_rule.chunk import chunk_window_rule  # noqa: E402
from atlaslab.kernels.window_rule.fused_recurrent import fused_recurrent_window_rule  # noqa: E402
from atlaslab.kernels.window_rule.naive import (window_rule_chunk, window_rule_recurrent,  # noqa: E402
                                                window_slots)

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
LENS = [5, 17, 1, 20]          # 16-token chunks: 1 + 2 + 1 + 2 = 6 chunks, four of them partial
BT = 16
NAMES = ("q", "k", "v", "gamma", "eta", "alpha", "h0")


@pytest.fixture
def launches(monkeypatch):
    """Counts launches per window kernel."""
    return count_launches(monkeypatch, win_mod, lambda name: name.startswith("_win"))


def _cu(lens=LENS):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)


def _inputs(lens=LENS, H=2, K=8, V=8, seed=0, dtype=torch.float32, channel=False):
    T, N = sum(lens), len(lens)
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)  # noqa
    q, k = unit(1, T, H, K), unit(1, T, H, K)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    gam = 0.2 + 0.8 * torch.rand(1, T, H, generator=g, dtype=torch.float64)
    eta = 0.2 + 0.6 * torch.rand(1, T, H, generator=g, dtype=torch.float64)
    a = 0.6 + 0.39 * torch.rand(1, T, H, *((K,) if channel else ()), generator=g, dtype=torch.float64)
    s0 = 0.5 * torch.randn(N, H, V, K, generator=g, dtype=torch.float64)
    return [x.to(device=DEVICE, dtype=dtype) for x in (q, k, v, gam, eta, a, s0)]


def _separately(inputs, cu, c, opts, fn=window_rule_recurrent):
    """Each sequence alone (its own slots, zero before its first token); returns (o, ht) packed like the kernel's."""
    q, k, v, gam, eta, a, s0 = inputs
    b = cu.tolist()
    outs = []
    for n, (s, e) in enumerate(zip(b[:-1], b[1:])):
        xs, vs, gs = window_slots(k[:, s:e], v[:, s:e], gam[:, s:e], c)
        outs.append(fn(q[:, s:e], xs, vs, eta[:, s:e].unsqueeze(2) * gs, a[:, s:e], s0[n:n + 1], **opts))
    return torch.cat([o for o, _ in outs], 1), torch.cat([h for _, h in outs], 0)


def _packed(inputs, cu, c, opts, fn=chunk_window_rule, **kw):
    q, k, v, gam, eta, a, s0 = inputs
    xs, vs, gs = window_slots(k, v, gam, c, cu_seqlens=cu)
    return fn(q, xs, vs, eta.unsqueeze(2) * gs, a, s0, cu_seqlens=cu, **opts, **kw)


def _packed_vs_separate(c, opts, lens=LENS, seed=7, fn=chunk_window_rule, channel=False):
    cu = _cu(lens)
    inputs = _inputs(lens, seed=c, channel=channel)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref = [x.detach().double().requires_grad_() for x in inputs]
    kw = dict(chunk_size=BT * c) if fn is chunk_window_rule else {}
    o, ht = _packed(leaves, cu, c, opts, fn=fn, **kw)
    o_r, ht_r = _separately(ref, cu, c, opts)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o_r.shape, generator=g, dtype=torch.float64).to(DEVICE)
    dht = torch.randn(ht_r.shape, generator=g, dtype=torch.float64).to(DEVICE)
    ((o * do.to(o)).sum() + (ht * dht.to(ht)).sum()).backward()
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    ratios = {"o": rms_ratio(o.double(), o_r), "ht": rms_ratio(ht.double(), ht_r)}
    for n, x, r in zip(NAMES, leaves, ref):
        assert x.grad is not None and torch.isfinite(x.grad).all(), n
        ratios["d" + n] = rms_ratio(x.grad.double(), r.grad)
    return ratios


def test_window_slots_never_cross_a_sequence_start():
    c, cu = 3, torch.tensor([0, 2, 3, 7])
    k = torch.arange(7.).reshape(1, 7, 1, 1)
    gam = torch.ones(1, 7, 1)
    xs, _, gs = window_slots(k, k, gam, c, cu_seqlens=cu)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xr, _, gr = window_slots(k[:, s:e], k[:, s:e], gam[:, s:e], c)
        assert torch.equal(gs[:, s:e], gr)
        assert torch.equal(xs[:, s:e] * gs[:, s:e, ..., None], xr * gr[..., None])   # k holds its global index
    with pytest.raises(ValueError, match="history"):
        window_slots(k, k, gam, c, k[:, :1], k[:, :1], gam[:, :1], cu_seqlens=cu)


@pytest.mark.parametrize("c", [2, 3])
def test_window_references_with_cu_seqlens(c):
    cu = _cu()
    x = _inputs(seed=1, dtype=torch.float64)
    opts = dict(bias="l2", placement="after_step", read="chunk")
    o_r, h_r = _separately(x, cu, c, opts)
    for fn, kw in ((window_rule_recurrent, {}), (window_rule_chunk, dict(chunk_size=4))):
        o, h = _packed(x, cu, c, opts, fn=fn, **kw)
        assert rms_ratio(o, o_r) < 1e-12 and rms_ratio(h, h_r) < 1e-12


@pytest.mark.parametrize("c, bias, placement, read", [(2, "l2", "before_step", "token"),
                                                      (3, "l2", "after_step", "chunk"),
                                                      (3, "dot", "after_step", "token")])
def test_packed_window_equals_separate_float64_runs(c, bias, placement, read, launches):
    ratios = _packed_vs_separate(c, dict(bias=bias, placement=placement, read=read))
    bad = {n: r for n, r in ratios.items() if not r <= TOL}
    assert not bad, f"RMS-error ratios above {TOL}: {bad} (all: {ratios})"
    # one launch per stage: forward (UT, state, output), backward (UT and state recomputed, dS sweep, grads)
    ut = {"_win_ut_kernel": 2} if bias == "l2" else {}
    assert launches == {**ut, "_win_state_kernel": 2, "_win_out_kernel": 1, "_win_bwd_dh_kernel": 1,
                        "_win_bwd_grad_kernel": 1}, launches


@pytest.mark.parametrize("c, bias, placement, read", [(2, "l2", "before_step", "chunk"),
                                                      (3, "dot", "after_step", "token")])
def test_packed_window_channel_wise_equals_separate_float64_runs(c, bias, placement, read, launches):
    ratios = _packed_vs_separate(c, dict(bias=bias, placement=placement, read=read), channel=True)
    bad = {n: r for n, r in ratios.items() if not r <= TOL}
    assert not bad, f"RMS-error ratios above {TOL}: {bad} (all: {ratios})"
    ut = {"_win_cw_ut_kernel": 2} if bias == "l2" else {}
    assert launches == {**ut, "_win_cw_state_kernel": 2, "_win_cw_out_kernel": 1, "_win_cw_bwd_dh_kernel": 1,
                        "_win_cw_bwd_grad_kernel": 1}, launches


@pytest.mark.parametrize("c, bias, placement, read, channel", [(3, "l2", "after_step", "chunk", False),
                                                               (2, "dot", "before_step", "token", True)])
def test_packed_fused_window_equals_separate_float64_runs(c, bias, placement, read, channel, launches, monkeypatch):
    # the token-by-token kernel: one launch for all sequences, state and window restarting at each start; its
    # backward runs on the chunk window kernels with the same cu_seqlens
    fused = count_launches(monkeypatch, fused_mod, lambda name: name.startswith("_fused_window"))
    ratios = _packed_vs_separate(c, dict(bias=bias, placement=placement, read=read), fn=fused_recurrent_window_rule,
                                 channel=channel)
    bad = {n: r for n, r in ratios.items() if not r <= TOL}
    assert not bad, f"RMS-error ratios above {TOL}: {bad} (all: {ratios})"
    assert fused == {"_fused_window_kernel": 1}, fused
    assert launches["_win_cw_bwd_grad_kernel" if channel else "_win_bwd_grad_kernel"] == 1, launches


def test_packed_fused_window_chained_and_short_sequences():
    # sequences shorter than the window (1, 2 tokens for c = 3) and a second packed call continuing every sequence
    # from the first call's final states (window_slots with cu_seqlens takes no history, so the second call's
    # windows start at its first token): each call equals its sequences run alone through the float64 token loop
    c, opts = 3, dict(bias="l2", placement="after_step", read="token")
    lens = [1, 2, 9]
    inputs = _inputs(lens, seed=4)
    cu = _cu(lens)
    o1, h1 = _packed(inputs, cu, c, opts, fn=fused_recurrent_window_rule)
    inputs2 = _inputs(lens, seed=5)
    inputs2[-1] = h1
    o2, h2 = _packed(inputs2, cu, c, opts, fn=fused_recurrent_window_rule)
    ref1 = _separately([x.double() for x in inputs], cu, c, opts)
    ref2 = _separately([x.double() for x in inputs2[:-1]] + [ref1[1]], cu, c, opts)
    for x, r in ((o1, ref1[0]), (h1, ref1[1]), (o2, ref2[0]), (h2, ref2[1])):
        assert rms_ratio(x.double(), r) <= TOL
