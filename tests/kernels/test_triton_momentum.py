"""The momentum chunk kernel (atlaslab/kernels/momentum/chunk.py) against the float64 token loop.

Linear memory + momentum GD at semantic chunk size b ∈ {4, 8} (Titans with a matrix memory):
``memorize(mode="triton")`` on the chunk kernel (Triton forward and backward under TRITON_INTERPRET=1) vs
``memorize(mode="recurrent")`` in float64 — outputs, final memory and momentum, anchor, and the gradients of q, k,
v, the lr / momentum / decay / window gates and the learned initial memory, fla's RMS-error ratio ≤ 1e-3 in fp32 —
with T not a multiple of b, ℓ2 and dot bias, read token and chunk, with and without decay, decay placed after or
before the step (before_step takes every gradient at the decayed anchor P_s M_a); the kernel's torch
reference equals ``mode="chunked"``; the op against that reference (several value blocks, T < b, initial
momentum, both placements); the torch-recompute fallback backward; chained calls (calls ending and starting
mid-chunk, the engine finishing an open chunk on torch) equal one call, outputs, states and gradients; the dispatch.
Kernel allocations are poisoned with NaN, so an unwritten element fails. ``auto`` is pinned to the chunk kernel
(the dispatch may prefer a token-by-token kernel for short calls).
"""
import copy

import pytest
import torch
from helpers import grad_leaves, momentum_data, momentum_parts, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.kernels.momentum import chunk as cm  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty", "chunk_kernel")   # NaN-filled empty buffers (conftest)
H, D = 2, 8
MOM = {"memory": "linear", "inner_optimizer": "momentum"}
BEFORE = {"name": "decay", "placement": "before_step"}


@pytest.fixture
def chunk_kernel(monkeypatch):
    """``memorize(mode="triton")`` takes the chunk kernel at every T: no short-call threshold sends it elsewhere."""
    for name in ("RECURRENT_MAX_T", "MOMENTUM_MID_CHUNK_MAX_T"):
        monkeypatch.setattr(tk, name, 0, raising=False)
CASES = {   # name: (spec, b, T)
    "l2_decay_token_b4": (dict(MOM, retention="decay"), 4, 11),
    "l2_decay_token_b8": (dict(MOM, retention="decay"), 8, 13),
    "l2_decay_chunk_b4": (dict(MOM, retention="decay", read="chunk"), 4, 10),
    "l2_token_b8": (MOM, 8, 11),
    "dot_decay_token_b4": (dict(MOM, attentional_bias="dot", retention="decay"), 4, 9),
    "dot_chunk_b8": (dict(MOM, attentional_bias="dot", read="chunk"), 8, 11),
    "dot_before_step_b4": (dict(MOM, attentional_bias="dot", retention=BEFORE), 4, 7),
    "l2_before_step_token_b4": (dict(MOM, retention=BEFORE), 4, 11),
    "l2_before_step_token_b8": (dict(MOM, retention=BEFORE), 8, 13),
    "l2_before_step_chunk_b4": (dict(MOM, retention=BEFORE, read="chunk"), 4, 10),
    "l2_before_step_chunk_b8": (dict(MOM, retention=BEFORE, read="chunk"), 8, 11),
}


def _parts(spec):
    return momentum_parts(spec, H, D, DEVICE)


def _data(parts, T, seed=0, B=2):
    return momentum_data(parts, T, H, D, seed=seed, B=B)


def _run(parts, data, dtype, mode, b):
    """memorize in ``dtype``; → (o, state, grads of [q, k, v, *gates, *parameters])."""
    parts = copy.deepcopy(parts).to(dtype)
    (q, k, v), gates = data
    q, k, v = (x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v))
    gates = {n: x.to(DEVICE, dtype).requires_grad_() for n, x in gates.items()}
    leaves = [q, k, v, *gates.values(), *parts.parameters()]
    o, state = memorize(q, k, v, parts, gates, mode=mode, chunk_size=b)
    g = torch.Generator().manual_seed(7)
    w_o, w_m, w_s = (torch.randn(x.shape, generator=g, dtype=torch.float64).to(o)
                     for x in (o, state.weights["W"], state.momentum["W"]))
    loss = (o * w_o).sum() + (state.weights["W"] * w_m).sum() + (state.momentum["W"] * w_s).sum()
    return o, state, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("name", list(CASES))
def test_memorize_triton_momentum_matches_recurrent(name, monkeypatch):
    spec, b, T = CASES[name]
    parts = _parts(spec)
    q = torch.zeros(2, T, H, D, device=DEVICE)
    assert tk.explain(parts, q, b) is None and tk.select_kernel(parts, q, b).kernel == "chunk_momentum"
    calls = []
    forward = cm.chunk_momentum_forward
    monkeypatch.setattr(cm, "chunk_momentum_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    data = _data(parts, T)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    o_t, s_t, g_t = _run(parts, data, torch.float32, "triton", b)
    assert calls, "the Triton kernel did not run"
    assert o_t.dtype == torch.float32 and torch.isfinite(o_t).all()
    assert rms_ratio(o_t.double(), o_r) <= TOL
    for f in ("weights", "momentum", "anchor"):
        assert rms_ratio(getattr(s_t, f)["W"].double(), getattr(s_r, f)["W"]) <= TOL, f
    assert s_t.position == s_r.position == T
    assert rms_ratio(s_t.chunk_alpha.double(), s_r.chunk_alpha) <= TOL
    assert s_t.hist_k.shape == s_r.hist_k.shape and s_t.hist_gamma.shape == s_r.hist_gamma.shape
    for a, r in zip(g_t, g_r):     # q, k, v, lr, window, momentum, (retention), initial W
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_chunked_engine(name):
    """:func:`momentum_chunk_reference` (the kernels' math) equals ``mode="chunked"`` in float64."""
    spec, b, T = CASES[name]
    parts = _parts(spec).double()
    (q, k, v), gates = _data(parts, T, seed=3)
    o_c, s_c = memorize(q, k, v, parts, gates, mode="chunked", chunk_size=b)
    fm, w0 = parts.feature_map, parts.memory.initial_weights(2)["W"]
    o, M, S, anchor = cm.momentum_chunk_reference(
        fm(q), fm(k), v, gates["lr"] * gates["window"], gates["momentum"], gates.get("retention"), w0,
        torch.zeros_like(w0), chunk_size=b, bias=parts.spec.attentional_bias.name, read=parts.read,
        placement=parts.retention.placement)
    assert rms_ratio(o, o_c) < 1e-12
    assert rms_ratio(M, s_c.weights["W"]) < 1e-12 and rms_ratio(S, s_c.momentum["W"]) < 1e-12
    assert rms_ratio(anchor, s_c.anchor["W"]) < 1e-12


OP_SHAPES = [   # (B, T, H, D_k, D_v, b, bias, read, placement)
    (1, 21, 2, 8, 12, 8, "l2", "token", "after_step"),     # two full chunks and a ragged one, D_k ≠ D_v
    (1, 21, 2, 8, 12, 8, "dot", "chunk", "after_step"),
    (1, 8, 1, 128, 48, 8, "l2", "token", "after_step"),    # two value blocks in the state kernels (second ragged)
    (2, 3, 1, 8, 8, 4, "l2", "chunk", "after_step"),       # T < b
    (1, 21, 2, 8, 12, 8, "l2", "token", "before_step"),
    (1, 13, 1, 128, 48, 4, "l2", "token", "before_step"),  # two value blocks, b = 4, ragged last chunk
    (2, 3, 1, 8, 8, 4, "l2", "chunk", "before_step"),      # T < b
]


@pytest.mark.parametrize("B, T, nh, K, V, b, bias, read, placement", OP_SHAPES)
def test_op_matches_reference_with_initial_momentum(B, T, nh, K, V, b, bias, read, placement):
    """:func:`chunk_momentum` (Triton forward and backward) vs :func:`momentum_chunk_reference` in float64, with a
    nonzero initial momentum: all four outputs and the gradients of all eight inputs."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, nh, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, nh, V, generator=g)
    beta, theta, alpha = (lo + (1 - lo) * torch.rand(B, T, nh, generator=g) for lo in (0.2, 0.5, 0.6))
    m0, s0 = (0.4 * torch.randn(B, nh, V, K, generator=g) for _ in range(2))
    x = [t.to(DEVICE) for t in (q, k, v, beta, theta, alpha, m0, s0)]
    leaves = [t.clone().requires_grad_() for t in x]
    refs = [t.double().requires_grad_() for t in x]
    opts = dict(chunk_size=b, bias=bias, read=read, placement=placement)
    out = cm.chunk_momentum(*leaves, **opts)
    ref = cm.momentum_chunk_reference(*refs, **opts)
    w = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(out)]
    for a, r in zip(out, ref):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL
    g_k = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), leaves)
    g_r = torch.autograd.grad(sum((o * wi.double()).sum() for o, wi in zip(ref, w)), refs)
    for a, r in zip(g_k, g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


def test_torch_fallback_backward_matches_recurrent(monkeypatch):
    """``ATLASLAB_MOMENTUM_BACKWARD=torch``: autograd through the recomputed torch reference, the same bar."""
    monkeypatch.setattr(cm, "BACKWARD", "torch")
    spec, b, T = CASES["l2_decay_token_b4"]
    parts = _parts(spec)
    data = _data(parts, T, seed=2)
    _, _, g_r = _run(parts, data, torch.float64, "recurrent", b)
    _, _, g_t = _run(parts, data, torch.float32, "triton", b)
    for a, r in zip(g_t, g_r):
        assert rms_ratio(a.double(), r) <= TOL


@pytest.mark.parametrize("spec, b, pieces", [
    (dict(MOM, retention="decay"), 4, [6, 1, 6]),       # ends mid-chunk | inside one chunk | starts mid-chunk
    (dict(MOM, retention=BEFORE), 4, [6, 1, 6]),
    (dict(MOM, retention=BEFORE, read="chunk"), 8, [8, 3, 10]),   # starts on a boundary | ends mid-chunk | ...
])
def test_chained_calls_equal_one_call(spec, b, pieces, monkeypatch):
    """Calls that end and start mid-chunk (the second finishes the open chunk on torch, then runs the kernel) equal
    one float64 token loop: outputs, final memory, momentum and anchor, and the gradients of q, k, v, the gates and
    the learned initial memory through the chained states."""
    calls = []
    forward = cm.chunk_momentum_forward
    monkeypatch.setattr(cm, "chunk_momentum_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    parts = _parts(spec)
    T = sum(pieces)
    data = _data(parts, T, seed=5, B=1)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    f32 = copy.deepcopy(parts).float()
    (q, k, v), gates, leaves = grad_leaves(f32, data, torch.float32, DEVICE)
    state, outs, s = None, [], 0
    for n in pieces:
        o, state = memorize(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], f32,
                            {g: x[:, s:s + n] for g, x in gates.items()}, mode="triton", chunk_size=b,
                            initial_state=state)
        outs.append(o)
        s += n
    # the kernel runs in every call that goes past the end of the chunk it starts in
    reach = [n > -sum(pieces[:i]) % b for i, n in enumerate(pieces)]
    assert len(calls) == sum(reach) >= 2, "the chunk kernel did not run"
    o = torch.cat(outs, 1)
    assert rms_ratio(o.double(), o_r) <= TOL and state.position == T
    for f in ("weights", "momentum", "anchor"):
        assert rms_ratio(getattr(state, f)["W"].double(), getattr(s_r, f)["W"]) <= TOL, f
    assert rms_ratio(state.chunk_alpha.double(), s_r.chunk_alpha) <= TOL
    g = torch.Generator().manual_seed(7)     # the same loss weights as _run
    w_o, w_m, w_s = (torch.randn(x.shape, generator=g, dtype=torch.float64).to(o)
                     for x in (o, state.weights["W"], state.momentum["W"]))
    loss = (o * w_o).sum() + (state.weights["W"] * w_m).sum() + (state.momentum["W"] * w_s).sum()
    for a, r in zip(torch.autograd.grad(loss, leaves), g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


def test_dispatch(monkeypatch):
    q = torch.zeros(1, 8, H, D, device=DEVICE)
    for spec in (dict(MOM, retention="decay"), dict(MOM, retention=BEFORE), dict(MOM, retention=BEFORE, read="chunk")):
        parts = _parts(spec)
        assert tk.chunk_momentum_reason(parts, 4) is None
        assert tk.select_kernel(parts, q, 4).kernel == "chunk_momentum"
        assert tk.select_kernel(parts, q, 4, mode="chunk").kernel == "chunk_momentum"
    parts = _parts(dict(MOM, retention="decay"))
    assert tk.select_kernel(parts, q.double(), 4) is None                    # fp64 stays on torch
    for b in (1, cm.MAX_CHUNK + 1):
        assert tk.select_kernel(parts, q, b, mode="chunk") is None and "chunk_size" in tk.chunk_momentum_reason(parts, b)
    for spec in (dict(MOM, window={"size": 3}), dict(MOM, memory="mlp"),
                 {"memory": "linear", "inner_optimizer": "muon"}):
        p = _parts(spec)
        assert tk.select_kernel(p, q, 4, mode="chunk") is None and tk.chunk_momentum_reason(p, 4)
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    assert tk.select_kernel(parts, q, 4) is None
