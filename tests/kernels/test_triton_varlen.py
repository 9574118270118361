"""Variable-length batches (``cu_seqlens``) on the chunk Triton kernels (atlaslab/kernels/delta_rule/chunk.py), under
TRITON_INTERPRET=1.

Packed sequences ``[1, total_T, H, D]`` with lengths [5, 17, 1, 33] and 16-token chunks (partial chunks, a length-1
sequence, a sequence over two chunks long) run natively — fla's chunk-index table, one launch per stage — and must
equal each sequence run separately through the float64 token loop :func:`reference.delta_rule_recurrent`: outputs,
per-sequence final states and the gradients of q, k, v, β, α and the per-sequence initial states (RMS-error ratio
≤ 1e-3 in float32), for per-head and channel-wise decay, ℓ2 and dot bias, both placements and reads. Every kernel is
launched once per forward / backward (launches counted by wrapping the kernel objects), and the packed kernels equal
the same kernels run sequence by sequence. The chunk tables themselves are checked against a plain loop.

Outputs the kernels allocate are NaN-poisoned (fla's conftest trick). Shapes are tiny (the interpreter is slow).
"""

import pytest
import torch
from helpers import count_launches, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.kernels.delta_rule.naive import delta_rule_recurrent  # noqa: E402
from atlaslab.kernels.delta_rule import chunk as chunk_mod  # noqa: E402
from atlaslab.kernels.delta_rule.chunk import chunk_delta_rule  # noqa: E402
from atlaslab.kernels.utils import prepare_chunk_indices  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
LENS = [5, 17, 1, 33]          # 16-token chunks: 1 + 2 + 1 + 3 = 7 chunks, four of them partial
BT = 16
NAMES = ("q", "k", "v", "beta", "alpha", "h0")


@pytest.fixture
def launches(monkeypatch):
    """Counts launches per chunk kernel."""
    return count_launches(monkeypatch, chunk_mod, lambda name: not name.startswith("_win"))


def _cu(lens=LENS):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)


def _inputs(lens=LENS, H=2, K=8, V=8, seed=0, channel=False, dtype=torch.float32):
    T, N = sum(lens), len(lens)
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    beta = 0.2 + 0.7 * torch.rand(1, T, H, generator=g, dtype=torch.float64)
    a = 0.6 + 0.39 * torch.rand(1, T, H, *((K,) if channel else ()), generator=g, dtype=torch.float64)
    s0 = 0.5 * torch.randn(N, H, V, K, generator=g, dtype=torch.float64)
    return [x.to(device=DEVICE, dtype=dtype) for x in (q, k, v, beta, a, s0)]


def _separately(inputs, cu, opts):
    """Each sequence alone through the float64 token loop; returns (o, ht) packed like the kernel's."""
    q, k, v, beta, a, s0 = inputs
    b = cu.tolist()
    outs = [delta_rule_recurrent(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], a[:, s:e], s0[n:n + 1], **opts)
            for n, (s, e) in enumerate(zip(b[:-1], b[1:]))]
    return torch.cat([o for o, _ in outs], 1), torch.cat([h for _, h in outs], 0)


def _packed_vs_separate(inputs, opts, cu=None, seed=7):
    """chunk_delta_rule on the packed batch (float32) vs every sequence separately (float64): RMS-error ratios of
    the outputs, the final states and every input gradient (the loss reads o and the final states)."""
    cu = _cu() if cu is None else cu
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref = [x.detach().double().requires_grad_() for x in inputs]
    o, ht = chunk_delta_rule(*leaves, cu_seqlens=cu, chunk_size=BT, **opts)
    o_r, ht_r = _separately(ref, cu, opts)
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


def _assert_ratios(ratios, tol=TOL):
    bad = {n: r for n, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS-error ratios above {tol}: {bad} (all: {ratios})"


def test_prepare_chunk_indices_matches_a_plain_loop():
    cu = torch.tensor([0, 5, 22, 22, 23, 56])             # an empty sequence too: it has no chunk
    table, offsets = prepare_chunk_indices(cu, 16)
    rows = [(n, i) for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
            for i in range(-(-(e - s) // 16))]
    assert table.dtype == torch.int32 and table.tolist() == [list(r) for r in rows]
    assert offsets.tolist() == [0, 1, 3, 3, 4, 7]


@pytest.mark.parametrize("bias, placement, read", [("l2", "before_step", "token"), ("l2", "after_step", "chunk"),
                                                   ("dot", "after_step", "token")])
def test_packed_scalar_decay_equals_separate_float64_runs(bias, placement, read, launches):
    ratios = _packed_vs_separate(_inputs(), dict(bias=bias, placement=placement, read=read))
    _assert_ratios(ratios)
    # one launch per stage: forward (UT, state, output), backward (UT and state recomputed, dS sweep, grads)
    assert launches == {"_chunk_ut_kernel": 2, "_chunk_state_kernel": 2, "_chunk_out_kernel": 1,
                        "_chunk_bwd_dh_kernel": 1, "_chunk_bwd_grad_kernel": 1}, launches


@pytest.mark.parametrize("placement, read", [("before_step", "token"), ("after_step", "chunk")])
def test_packed_channel_wise_decay_equals_separate_float64_runs(placement, read, launches):
    # a sequence of exactly one chunk (16) first: its chunk is full, the next sequence starts a new chunk
    ratios = _packed_vs_separate(_inputs(lens=[16, 1, 19], H=1, seed=1, channel=True),
                                 dict(bias="l2", placement=placement, read=read), cu=_cu([16, 1, 19]))
    _assert_ratios(ratios)
    assert launches == {"_cw_ut_kernel": 2, "_cw_state_kernel": 2, "_cw_out_kernel": 1,
                        "_cw_bwd_dh_kernel": 1, "_cw_bwd_grad_kernel": 1}, launches


def test_packed_kernels_equal_the_same_kernels_sequence_by_sequence():
    # the native varlen path against the dense path of the same kernels, one sequence at a time (no decay, no h0)
    lens = [32, 5, 17]          # whole chunks, then partial ones
    q, k, v, beta, _, _ = _inputs(lens, seed=2)
    cu = _cu(lens)
    opts = dict(bias="l2", placement="before_step", read="token", chunk_size=BT)
    o, ht = chunk_delta_rule(q, k, v, beta, cu_seqlens=cu, **opts)
    b = cu.tolist()
    for n, (s, e) in enumerate(zip(b[:-1], b[1:])):
        o_n, ht_n = chunk_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], **opts)
        assert rms_ratio(o[:, s:e].double(), o_n.double()) <= 1e-6
        assert rms_ratio(ht[n:n + 1].double(), ht_n.double()) <= 1e-6


def test_fused_recurrent_backward_takes_the_native_varlen_path(launches):
    # the token-by-token kernel's backward runs on the chunk backward kernels: with cu_seqlens, still one launch each
    from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule
    x = [t.clone().requires_grad_() for t in _inputs(lens=[3, 1, 6], H=1, seed=3)]
    o, ht = fused_recurrent_delta_rule(*x, cu_seqlens=_cu([3, 1, 6]), bias="l2", placement="after_step", read="token")
    (o.square().sum() + ht.sum()).backward()
    assert launches == {"_chunk_ut_kernel": 1, "_chunk_state_kernel": 1, "_chunk_bwd_dh_kernel": 1,
                        "_chunk_bwd_grad_kernel": 1}, launches
    ref = [t.detach().double().requires_grad_() for t in x]
    o_r, ht_r = _separately(ref, _cu([3, 1, 6]), dict(bias="l2", placement="after_step", read="token"))
    (o_r.square().sum() + ht_r.sum()).backward()
    for n, a, r in zip(NAMES, x, ref):
        assert rms_ratio(a.grad.double(), r.grad) <= TOL, n
