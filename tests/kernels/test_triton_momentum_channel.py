"""Channel-wise decay on the momentum chunk kernel (atlaslab/kernels/momentum/chunk.py), TRITON_INTERPRET=1.

Linear memory + momentum GD at semantic chunk size b ∈ {4, 8} with per-key-channel decay (α_t ∈ [0, 1]^{D_k}, M ← M Diag(α_t) + S, before_step takes the gradient at M_a Diag(P_s)):
``memorize(mode="triton")`` pinned to the chunk kernel vs ``memorize(mode="recurrent")`` in float64 — outputs, final
memory, momentum, anchor and Π α, and the gradients of q, k, v, the lr / momentum / decay / window gates and the
learned initial memory, fla's RMS-error ratio ≤ 1e-3 in fp32 — both placements, ℓ2 and dot, read token and chunk,
T not a multiple of b and T < b, one key channel forgetting fast (α ≈ 0.05); the module's torch reference vs the token
loop; the op vs that reference with a nonzero initial momentum (several value blocks) and with a key channel whose
cumulative decay underflows fp32 within the chunk (b = 32, α ≈ 0.02); the torch-recompute fallback backward; chained
calls (ending and starting mid-chunk) equal one call; packed ``cu_seqlens`` vs each sequence alone (launches
counted); and the dispatch (``auto`` picks ``chunk_momentum`` for long channel-wise calls). Kernel allocations are
NaN-poisoned (conftest).
"""
import copy

import pytest
import torch
from helpers import (channel_alpha, count_launches, grad_leaves, momentum_data, momentum_parts, momentum_run,
                     momentum_state_loss, require_triton, rms_ratio, triton_device)

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.kernels.momentum import chunk as cm  # noqa: E402
from atlaslab.kernels.momentum import fused_recurrent as frm  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
H, D = 2, 8
MOM = {"memory": "linear", "inner_optimizer": "momentum"}
CW = {"name": "decay", "channel_wise": True}
CW_BEFORE = dict(CW, placement="before_step")
FAST = 0.05     # the kept fraction of the fast-forgetting key channel (channel 0)
CASES = {   # name: (spec, b, T)
    "l2_after_token_b4": (dict(MOM, retention=CW), 4, 11),
    "l2_before_token_b8": (dict(MOM, retention=CW_BEFORE), 8, 13),
    "l2_before_chunk_b4": (dict(MOM, retention=CW_BEFORE, read="chunk"), 4, 10),
    "l2_after_chunk_b8": (dict(MOM, retention=CW, read="chunk"), 8, 11),
    "l2_before_token_b8_T_lt_b": (dict(MOM, retention=CW_BEFORE), 8, 5),
    "dot_after_token_b4": (dict(MOM, attentional_bias="dot", retention=CW), 4, 9),
    "dot_before_chunk_b8": (dict(MOM, attentional_bias="dot", retention=CW_BEFORE, read="chunk"), 8, 11),
}


@pytest.fixture
def chunk_kernel(monkeypatch):
    """``memorize(mode="triton")`` takes the chunk kernel at every T; → the list its forward calls append to."""
    for name in ("RECURRENT_MAX_T", "MOMENTUM_MID_CHUNK_MAX_T"):
        monkeypatch.setattr(tk, name, 0, raising=False)
    calls = []
    forward = cm.chunk_momentum_forward
    monkeypatch.setattr(cm, "chunk_momentum_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    return calls


def _parts(spec):
    return momentum_parts(spec, H, D, DEVICE)


def _channel_alpha(shape, seed, fast=FAST, dtype=torch.float64):
    """A channel-wise kept fraction ``[B, T, H, D_k]`` in [0.5, 0.95], key channel 0 at ≈ ``fast``."""
    return channel_alpha(shape, seed, fast, dtype)


def _data(parts, T, seed=0, B=2):
    (q, k, v), gates = momentum_data(parts, T, H, D, seed=seed, B=B)
    gates["retention"] = _channel_alpha((B, T, H, D), seed + 2)
    return (q, k, v), gates


_loss = momentum_state_loss


def _leaves(parts, data, dtype):
    return grad_leaves(parts, data, dtype, DEVICE)


def _run(parts, data, dtype, mode, b):
    """memorize in ``dtype``; → (o, state, grads of [q, k, v, *gates, *parameters])."""
    return momentum_run(parts, data, dtype, mode, b, DEVICE)


def _assert_state(s_t, s_r, T):
    for f in ("weights", "momentum", "anchor"):
        assert rms_ratio(getattr(s_t, f)["W"].double(), getattr(s_r, f)["W"]) <= TOL, f
    assert s_t.chunk_alpha.shape == s_r.chunk_alpha.shape == (s_r.weights["W"].shape[0], H, D)
    assert rms_ratio(s_t.chunk_alpha.double(), s_r.chunk_alpha) <= TOL
    assert s_t.position == s_r.position == T


@pytest.mark.parametrize("name", list(CASES))
def test_memorize_triton_channel_wise_matches_recurrent(name, chunk_kernel):
    spec, b, T = CASES[name]
    parts = _parts(spec)
    q = torch.zeros(2, T, H, D, device=DEVICE)
    assert tk.explain(parts, q, b) is None and tk.select_kernel(parts, q, b).kernel == "chunk_momentum"
    data = _data(parts, T)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    o_t, s_t, g_t = _run(parts, data, torch.float32, "triton", b)
    assert chunk_kernel == [1], "the Triton chunk kernel did not run"
    assert o_t.dtype == torch.float32 and rms_ratio(o_t.double(), o_r) <= TOL
    _assert_state(s_t, s_r, T)
    for a, r in zip(g_t, g_r):     # q, k, v, lr, window, momentum, retention [B, T, H, D_k], initial W
        assert a.shape == r.shape and torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


def _op_inputs(B, T, nh, K, V, fast=FAST, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, nh, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, nh, V, generator=g)
    beta, theta = (lo + (1 - lo) * torch.rand(B, T, nh, generator=g) for lo in (0.2, 0.5))
    alpha = _channel_alpha((B, T, nh, K), seed + 1, fast, torch.float32)
    m0, s0 = (0.4 * torch.randn(B, nh, V, K, generator=g) for _ in range(2))
    return [t.to(DEVICE) for t in (q, k, v, beta, theta, alpha, m0, s0)]


def _op_vs_reference(x, opts, **kw):
    """chunk_momentum (fp32, Triton forward and backward) vs momentum_chunk_reference (float64): the four results
    and the gradients of all eight inputs; → the largest RMS-error ratio."""
    leaves = [t.clone().requires_grad_() for t in x]
    refs = [t.double().requires_grad_() for t in x]
    out = cm.chunk_momentum(*leaves, **opts, **kw)
    ref = cm.momentum_chunk_reference(*refs, **opts, **kw)
    w = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(out)]
    g_k = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), leaves)
    g_r = torch.autograd.grad(sum((o * wi.double()).sum() for o, wi in zip(ref, w)), refs)
    worst = 0.0
    for a, r in zip((*out, *g_k), (*ref, *g_r)):
        assert a.shape == r.shape and torch.isfinite(a).all()
        worst = max(worst, rms_ratio(a.double(), r))
    return worst


OP_SHAPES = [   # (B, T, H, D_k, D_v, b, bias, read, placement)
    (1, 21, 2, 8, 12, 8, "l2", "token", "after_step"),      # two full chunks and a ragged one, D_k ≠ D_v
    (1, 21, 2, 8, 12, 8, "l2", "token", "before_step"),
    (1, 13, 1, 128, 48, 4, "l2", "token", "before_step"),   # two value blocks, b = 4, ragged last chunk
    (2, 3, 1, 8, 8, 4, "l2", "chunk", "before_step"),       # T < b
    (1, 13, 1, 16, 8, 4, "dot", "token", "before_step"),
]


@pytest.mark.parametrize("B, T, nh, K, V, b, bias, read, placement", OP_SHAPES)
def test_op_matches_reference_with_initial_momentum(B, T, nh, K, V, b, bias, read, placement):
    opts = dict(chunk_size=b, bias=bias, read=read, placement=placement)
    assert _op_vs_reference(_op_inputs(B, T, nh, K, V), opts) <= TOL


@pytest.mark.parametrize("placement, read", [("before_step", "token"), ("after_step", "chunk")])
def test_op_fast_forgetting_channel_underflows_within_the_chunk(placement, read):
    """b = 32 with key channel 0 at α ≈ 0.02: Π α over the chunk (≈ 1e-54) underflows fp32, so any e^{−g}
    factorisation would overflow; the kernels form every decay as a product of factors ≤ 1 (or e^{≤ 0})."""
    x = _op_inputs(1, 37, 1, 16, 8, fast=0.02, seed=3)
    assert float(torch.log(x[5][0, :32, 0, 0].double()).sum()) < -100
    opts = dict(chunk_size=32, bias="l2", read=read, placement=placement)
    assert _op_vs_reference(x, opts) <= TOL


@pytest.mark.parametrize("bias, placement, read", [("l2", "after_step", "token"), ("l2", "before_step", "chunk"),
                                                   ("dot", "before_step", "token")])
def test_reference_equals_token_loop(bias, placement, read):
    """:func:`momentum_chunk_reference` with channel-wise α (the kernels' math) equals the token loop
    :func:`.fused_recurrent_momentum.momentum_recurrent_reference` (= ``memorize_recurrent``) in float64."""
    q, k, v, beta, theta, alpha, m0, s0 = (t.double() for t in _op_inputs(2, 11, 2, 8, 6, seed=5))
    opts = dict(chunk_size=4, bias=bias, placement=placement, read=read)
    ref = cm.momentum_chunk_reference(q, k, v, beta, theta, alpha, m0, s0, **opts)
    loop = frm.momentum_recurrent_reference(q, k, v, beta, theta, alpha, m0, s0, m0, torch.ones_like(alpha[:, 0]),
                                            position=0, **opts)
    for a, r in zip(ref, loop[:4]):
        assert rms_ratio(a, r) < 1e-12


def test_torch_fallback_backward_matches_recurrent(chunk_kernel, monkeypatch):
    """``ATLASLAB_MOMENTUM_BACKWARD=torch``: autograd through the recomputed channel-wise torch reference."""
    monkeypatch.setattr(cm, "BACKWARD", "torch")
    spec, b, T = CASES["l2_before_token_b8"]
    parts = _parts(spec)
    data = _data(parts, T, seed=2)
    _, _, g_r = _run(parts, data, torch.float64, "recurrent", b)
    _, _, g_t = _run(parts, data, torch.float32, "triton", b)
    assert chunk_kernel
    for a, r in zip(g_t, g_r):
        assert rms_ratio(a.double(), r) <= TOL


@pytest.mark.parametrize("spec, b, pieces", [
    (dict(MOM, retention=CW_BEFORE), 4, [6, 1, 6]),                 # ends mid-chunk | inside one chunk | mid-chunk
    (dict(MOM, retention=CW, read="chunk"), 8, [8, 3, 10]),         # on a boundary | ends mid-chunk | ...
])
def test_chained_calls_equal_one_call(spec, b, pieces, chunk_kernel):
    """Calls continuing from the previous call's state (the engine finishes an open chunk on torch, then runs the
    chunk kernel) equal one float64 token loop: outputs, state, and the gradients through the chained states."""
    parts = _parts(spec)
    T = sum(pieces)
    data = _data(parts, T, seed=5, B=1)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    f32 = copy.deepcopy(parts).float()
    (q, k, v), gates, leaves = _leaves(f32, data, torch.float32)
    state, outs, s = None, [], 0
    for n in pieces:
        o, state = memorize(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], f32,
                            {g: x[:, s:s + n] for g, x in gates.items()}, mode="triton", chunk_size=b,
                            initial_state=state)
        outs.append(o)
        s += n
    reach = [n > -sum(pieces[:i]) % b for i, n in enumerate(pieces)]   # calls that pass the end of their chunk
    assert len(chunk_kernel) == sum(reach) >= 2, "the chunk kernel did not run"
    o = torch.cat(outs, 1)
    assert rms_ratio(o.double(), o_r) <= TOL
    _assert_state(state, s_r, T)
    for a, r in zip(torch.autograd.grad(_loss(o, state), leaves), g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


#: every stage once per forward; the backward re-runs stages 1-2, then its three kernels
LAUNCHES = {"_mom_cw_coef_kernel": 2, "_mom_state_kernel": 2, "_mom_out_kernel": 1, "_mom_bwd_state_kernel": 1,
            "_mom_bwd_grad_kernel": 1, "_mom_cw_gate_kernel": 1}


@pytest.mark.parametrize("b, lens, bias, read, placement", [
    (4, [1, 3, 7, 4, 9], "l2", "token", "before_step"),     # 1, b − 1, b + 3, b, 2b + 1
    (8, [8, 0, 11, 7], "l2", "chunk", "after_step"),        # an empty sequence
    (4, [6, 2, 5], "dot", "token", "after_step"),
])
def test_packed_equals_each_sequence_alone(b, lens, bias, read, placement, monkeypatch):
    """Packed ``cu_seqlens`` (one launch per stage for all sequences) vs each sequence alone through the float64
    reference: outputs, per-sequence final states and anchor, and the gradients of every input."""
    launches = count_launches(monkeypatch, cm, lambda name: name.startswith("_mom"))
    x = _op_inputs(1, sum(lens), 2, 8, 8, seed=b + len(lens))
    x[6:] = [0.4 * torch.randn(len(lens), 2, 8, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
             for _ in range(2)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)
    opts = dict(chunk_size=b, bias=bias, read=read, placement=placement)
    assert _op_vs_reference(x, opts, cu_seqlens=cu) <= TOL      # the reference runs every sequence alone
    assert dict(launches) == LAUNCHES, launches


def test_dispatch():
    short, mid, long_ = (torch.zeros(1, T, H, D, device=DEVICE) for T in (8, 100, 200))

    def kernel(p, x, b, **kw):
        engine = tk.select_kernel(p, x, b, **kw)
        return engine.kernel if engine is not None else None

    for spec in (dict(MOM, retention=CW), dict(MOM, retention=CW_BEFORE, read="chunk"),
                 dict(MOM, attentional_bias="dot", retention=CW_BEFORE)):
        p = _parts(spec)
        assert tk.chunk_momentum_reason(p, 4) is None and tk.fused_recurrent_momentum_reason(p, 4) is None and tk.spec_reason(p, 4) is None
        assert kernel(p, long_, 4) == "chunk_momentum"                       # long: the chunk kernel
        assert kernel(p, long_, 4, position=6) == "chunk_momentum"           # mid-chunk but long
        assert kernel(p, short, 4, mode="chunk") == "chunk_momentum"
        assert kernel(p, short, 4) == "fused_recurrent_momentum"             # T ≤ RECURRENT_MAX_T
        assert kernel(p, mid, 4, position=6) == "fused_recurrent_momentum"   # mid-chunk, T ≤ 128
        assert kernel(p, long_, 4, mode="fused_recurrent") == "fused_recurrent_momentum"
        assert kernel(p, long_, 1) == "fused_recurrent_momentum" and kernel(p, long_, 1, mode="chunk") is None
        assert "chunk_size" in tk.chunk_momentum_reason(p, cm.MAX_CHUNK + 1)
        b = cm.MAX_CHANNEL_CHUNK                                             # sm_90 shared memory: b ≤ 32
        assert kernel(p, long_, b) == "chunk_momentum" and "channel-wise" in tk.chunk_momentum_reason(p, 2 * b)
        assert kernel(p, long_, 2 * b) == "fused_recurrent_momentum" and kernel(p, long_, 2 * b, mode="chunk") is None
    p = _parts(dict(MOM, retention=CW, window={"size": 3}))
    assert tk.chunk_momentum_reason(p, 4) and kernel(p, long_, 4) is None
