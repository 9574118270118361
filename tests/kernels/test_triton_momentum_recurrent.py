"""The token-by-token momentum kernel (atlaslab/kernels/momentum/fused_recurrent.py) against the float64 loop.

Linear memory + momentum GD at semantic chunk size b ∈ {1, 4} (Titans with a matrix memory):
``memorize(mode="triton")`` (the token kernel under TRITON_INTERPRET=1, backward by autograd through its
reverse-sweep kernel) vs ``memorize(mode="recurrent")`` in float64 — outputs, final memory, momentum, anchor and Π α,
and the gradients of q, k, v, the lr / momentum / decay / window gates and the learned initial memory, fla's
RMS-error ratio ≤ 1e-3 in fp32 — ℓ2 with both placements, dot bias, read token and chunk, T < b and T not a
multiple of b; the op against its torch reference with a nonzero cached state (momentum, anchor, Π α) entering
mid-chunk and several value blocks; decoding: a prompt of 6 tokens then 5 calls of one token equal one call of 11
(outputs, state, gradients through the chained states); the dispatch. Channel-wise decay
(α_t ∈ [0, 1]^{D_k}, M ← M Diag(α_t) + S, before_step at M_a Diag(P)) the same ways, with one fast-forgetting key
channel (α ≈ 0.05). Kernel allocations are poisoned with NaN.
"""

import pytest
import torch
from helpers import (channel_alpha, grad_leaves, momentum_data, momentum_parts, momentum_run, momentum_state_loss,
                     require_triton, rms_ratio, triton_device)

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.kernels.momentum import chunk as cm  # noqa: E402
from atlaslab.kernels.momentum import fused_recurrent as frm  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
H, D = 2, 8
MOM = {"memory": "linear", "inner_optimizer": "momentum"}
BEFORE = {"name": "decay", "placement": "before_step"}
CW = {"name": "decay", "channel_wise": True}
CW_BEFORE = dict(CW, placement="before_step")
FAST = 0.05     # the kept fraction of the fast-forgetting key channel (channel 0) in the channel-wise cases
CASES = {   # name: (spec, b, T)
    "l2_after_token_b4": (dict(MOM, retention="decay"), 4, 11),
    "l2_before_token_b4": (dict(MOM, retention=BEFORE), 4, 9),
    "l2_after_chunk_b4": (dict(MOM, retention="decay", read="chunk"), 4, 10),
    "l2_before_chunk_b1": (dict(MOM, retention=BEFORE, read="chunk"), 1, 7),
    "l2_before_token_b1": (dict(MOM, retention=BEFORE), 1, 5),
    "l2_token_b1": (MOM, 1, 6),
    "l2_token_b4_T_lt_b": (MOM, 4, 3),
    "dot_decay_token_b4": (dict(MOM, attentional_bias="dot", retention="decay"), 4, 9),
    "dot_chunk_b1": (dict(MOM, attentional_bias="dot", read="chunk"), 1, 5),
    "cw_l2_after_token_b4": (dict(MOM, retention=CW), 4, 11),
    "cw_l2_before_token_b4": (dict(MOM, retention=CW_BEFORE), 4, 9),
    "cw_l2_before_chunk_b4_T_lt_b": (dict(MOM, retention=CW_BEFORE, read="chunk"), 4, 3),
    "cw_l2_after_chunk_b1": (dict(MOM, retention=CW, read="chunk"), 1, 5),
    "cw_l2_before_token_b1": (dict(MOM, retention=CW_BEFORE), 1, 5),
    "cw_dot_before_token_b4": (dict(MOM, attentional_bias="dot", retention=CW_BEFORE), 4, 6),
}


def _parts(spec):
    return momentum_parts(spec, H, D, DEVICE)


def _data(parts, T, seed=0, B=2):
    """momentum_data; a channel-wise spec's retention gate ``[B, T, H, D]`` in [0.5, 0.95], channel 0 at ≈ FAST."""
    (q, k, v), gates = momentum_data(parts, T, H, D, seed=seed, B=B)
    if parts.retention.channel_wise:
        gates["retention"] = channel_alpha((B, T, H, D), seed + 2, FAST)
    return (q, k, v), gates


_loss = momentum_state_loss


def _leaves(parts, data, dtype):
    return grad_leaves(parts, data, dtype, DEVICE)


def _run(parts, data, dtype, mode, b):
    """memorize in ``dtype``; → (o, state, grads of [q, k, v, *gates, *parameters])."""
    return momentum_run(parts, data, dtype, mode, b, DEVICE)


def _count_kernel_calls(monkeypatch):
    """→ (positions of the forward kernel's calls, positions of the backward's recomputes)."""
    calls, recomputes = [], []
    forward = frm.fused_recurrent_momentum_forward
    monkeypatch.setattr(frm, "fused_recurrent_momentum_forward", lambda *a, **kw: (
        recomputes if kw.get("store_states") else calls).append(kw["position"]) or forward(*a, **kw))
    return calls, recomputes


def _assert_state(s_t, s_r, T):
    for f in ("weights", "momentum", "anchor"):
        assert rms_ratio(getattr(s_t, f)["W"].double(), getattr(s_r, f)["W"]) <= TOL, f
    assert rms_ratio(s_t.chunk_alpha.double(), s_r.chunk_alpha) <= TOL
    assert torch.equal(s_t.chunk_lr.double(), s_r.chunk_lr)
    assert s_t.position == s_r.position == T
    assert s_t.hist_k.shape == s_r.hist_k.shape and s_t.hist_gamma.shape == s_r.hist_gamma.shape


@pytest.mark.parametrize("name", list(CASES))
def test_memorize_triton_matches_recurrent(name, monkeypatch):
    spec, b, T = CASES[name]
    parts = _parts(spec)
    q = torch.zeros(2, T, H, D, device=DEVICE)
    assert tk.explain(parts, q, b) is None and tk.select_kernel(parts, q, b).kernel == "fused_recurrent_momentum"
    calls, recomputes = _count_kernel_calls(monkeypatch)
    data = _data(parts, T)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    o_t, s_t, g_t = _run(parts, data, torch.float32, "triton", b)
    assert calls == recomputes == [0], "the Triton forward and backward did not run (once each)"
    assert o_t.dtype == torch.float32 and torch.isfinite(o_t).all()
    assert rms_ratio(o_t.double(), o_r) <= TOL
    _assert_state(s_t, s_r, T)
    for a, r in zip(g_t, g_r):     # q, k, v, lr, window, momentum, (retention), initial W
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


OP_SHAPES = [   # (B, T, H, D_k, D_v, b, position, bias, placement, read, decay: True / False / "channel")
    (1, 7, 2, 8, 12, 4, 6, "l2", "before_step", "token", True),    # enters mid-chunk, D_k ≠ D_v
    (1, 5, 1, 128, 40, 3, 1, "l2", "after_step", "chunk", True),   # three value blocks (the last one ragged)
    (1, 6, 1, 64, 80, 4, 3, "l2", "before_step", "token", True),   # 3 | 5 value blocks, each with a share of dP
    (2, 4, 1, 8, 8, 2, 1, "l2", "after_step", "token", False),     # no retention: Π α passes through
    (2, 3, 1, 8, 8, 4, 2, "dot", "before_step", "token", True),    # the call stays inside one chunk
    (1, 7, 2, 8, 12, 4, 6, "l2", "before_step", "token", "channel"),   # channel-wise, enters mid-chunk
    (1, 6, 1, 64, 80, 4, 3, "l2", "before_step", "token", "channel"),  # channel-wise, 5 value blocks share dP
    (1, 5, 1, 128, 40, 3, 1, "l2", "after_step", "chunk", "channel"),  # channel-wise, D_k = 128, 3 value blocks
    (2, 4, 1, 8, 8, 2, 1, "l2", "after_step", "token", "channel_no_alpha"),  # [B, H, D_k] Π α, no gate: passes
]


@pytest.mark.parametrize("backward", ["triton", "torch"])
@pytest.mark.parametrize("B, T, nh, K, V, b, pos, bias, placement, read, decay", OP_SHAPES)
def test_op_matches_reference_with_cached_state(B, T, nh, K, V, b, pos, bias, placement, read, decay, backward,
                                                monkeypatch):
    """:func:`fused_recurrent_momentum` vs :func:`momentum_recurrent_reference` in float64 from a nonzero cached state
    (M, S, anchor, Π α at ``position``): all five outputs and the gradients of every input, on the reverse-sweep
    kernel and on the torch-recompute fallback (``ATLASLAB_MOMENTUM_BACKWARD=torch``)."""
    monkeypatch.setattr(frm, "BACKWARD", backward)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, nh, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, nh, V, generator=g)
    channel = decay in ("channel", "channel_no_alpha")
    pc = (K,) if channel else ()
    beta, theta = (lo + (1 - lo) * torch.rand(B, T, nh, generator=g) for lo in (0.2, 0.5))
    alpha = 0.6 + 0.4 * torch.rand(B, T, nh, *pc, generator=g)
    if channel:
        alpha[..., 0] = FAST
    m0, s0, a0 = (0.4 * torch.randn(B, nh, V, K, generator=g) for _ in range(3))
    p0 = 0.5 + 0.5 * torch.rand(B, nh, *pc, generator=g)
    x = [t.to(DEVICE) if t is not None else None
         for t in (q, k, v, beta, theta, alpha if decay in (True, "channel") else None, m0, s0, a0, p0)]
    leaves = [t.clone().requires_grad_() if t is not None else None for t in x]
    refs = [t.double().requires_grad_() if t is not None else None for t in x]
    opts = dict(position=pos, chunk_size=b, bias=bias, placement=placement, read=read)
    out = frm.fused_recurrent_momentum(*leaves, **opts)
    ref = frm.momentum_recurrent_reference(*refs, **opts)
    for a, r in zip(out, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL
    w = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(out)]
    live = [t for t in leaves if t is not None]
    live_r = [t for t in refs if t is not None]
    g_k = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), live)
    g_r = torch.autograd.grad(sum((o * wi.double()).sum() for o, wi in zip(ref, w)), live_r, allow_unused=True)
    for a, r, x in zip(g_k, g_r, live_r):   # an unused input (Π α before a chunk start) has zero gradient
        r = torch.zeros_like(x) if r is None else r
        assert torch.isfinite(a).all() and (rms_ratio(a.double(), r) <= TOL if r.any() else not a.any())


@pytest.mark.parametrize("spec", [dict(MOM, retention=BEFORE), dict(MOM, retention="decay", read="chunk"),
                                  dict(MOM, retention=CW_BEFORE)],
                         ids=["l2_before_token", "l2_after_chunk", "cw_l2_before_token"])
def test_decoding_one_token_per_call_equals_one_call(spec, monkeypatch):
    """A prompt of 6 tokens, then 5 calls of one token (b = 4: calls start mid-chunk and at chunk starts), each on the
    token kernel from the previous call's state, equal one float64 recurrent call of 11: outputs, state, and the
    gradients of every input through the chained states."""
    b, T, prompt = 4, 11, 6
    parts = _parts(spec)
    data = _data(parts, T, seed=5, B=1)
    o_r, s_r, g_r = _run(parts, data, torch.float64, "recurrent", b)
    calls, recomputes = _count_kernel_calls(monkeypatch)
    positions, select = [], tk.select_kernel
    monkeypatch.setattr(tk, "select_kernel", lambda *a, **kw: positions.append(kw.get("position")) or select(*a, **kw))
    (q, k, v), gates, leaves = _leaves(parts, data, torch.float32)
    state, outs = None, []
    for s, e in [(0, prompt)] + [(t, t + 1) for t in range(prompt, T)]:
        o, state = memorize(q[:, s:e], k[:, s:e], v[:, s:e], parts, {n: x[:, s:e] for n, x in gates.items()},
                            mode="triton", chunk_size=b, initial_state=state)
        outs.append(o)
    assert positions == calls == [0] + list(range(prompt, T))    # memorize_triton passes the state's position
    o_t = torch.cat(outs, 1)
    assert rms_ratio(o_t.double(), o_r) <= TOL
    _assert_state(state, s_r, T)
    g_t = torch.autograd.grad(_loss(o_t, state), leaves)
    assert sorted(recomputes) == calls                          # every call's backward on the Triton kernel
    for a, r in zip(g_t, g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


def test_dispatch(monkeypatch):
    parts = _parts(dict(MOM, retention="decay"))
    short, mid, long_ = (torch.zeros(1, T, H, D, device=DEVICE) for T in (8, 100, 200))

    def kernel(p, x, b, **kw):
        engine = tk.select_kernel(p, x, b, **kw)
        return engine.kernel if engine is not None else None

    assert kernel(parts, short, 4) == "fused_recurrent_momentum"                 # T ≤ RECURRENT_MAX_T
    assert kernel(parts, long_, 4) == "chunk_momentum"
    assert kernel(parts, mid, 4, position=6) == "fused_recurrent_momentum"       # mid-chunk, T ≤ 128
    assert kernel(parts, mid, 4, position=8) == "chunk_momentum"                 # aligned
    assert kernel(parts, long_, 4, position=6) == "chunk_momentum"               # mid-chunk but long
    assert kernel(parts, long_, 4, mode="fused_recurrent") == "fused_recurrent_momentum"
    assert kernel(parts, short, 4, mode="chunk") == "chunk_momentum"
    assert tk.spec_reason(parts, 1) is None and tk.fused_recurrent_momentum_reason(parts, 1) is None   # b = 1: the token kernel only
    assert kernel(parts, long_, 1) == "fused_recurrent_momentum" and kernel(parts, short, 1, mode="chunk") is None
    before = _parts(dict(MOM, retention=BEFORE))
    assert kernel(before, short, 4) == "fused_recurrent_momentum"
    assert kernel(before, long_, 4) == ("chunk_momentum" if tk.chunk_momentum_reason(before, 4) is None
                                        else "fused_recurrent_momentum")
    for spec in (dict(MOM, retention=CW), dict(MOM, retention=CW_BEFORE, read="chunk")):   # channel-wise decay:
        p = _parts(spec)                                       # the same rule as per-head decay (chunk kernel b ≤ 32)
        assert tk.fused_recurrent_momentum_reason(p, 4) is None and tk.spec_reason(p, 4) is None and tk.chunk_momentum_reason(p, 4) is None
        for x, b, kw in ((short, 4, {}), (long_, 1, {}), (mid, 4, dict(position=6)),
                         (short, 4, dict(mode="fused_recurrent"))):
            assert kernel(p, x, b, **kw) == "fused_recurrent_momentum"
        assert kernel(p, long_, 4) == kernel(p, long_, 4, position=6) == kernel(p, long_, 4, mode="chunk") \
            == "chunk_momentum"
        assert kernel(p, long_, 64) == "fused_recurrent_momentum"             # channel-wise chunk kernel: b ≤ 32
    for spec in (dict(MOM, window={"size": 3}), dict(MOM, memory="mlp"),
                 {"memory": "linear", "inner_optimizer": "muon"}):
        p = _parts(spec)
        assert kernel(p, short, 4) is None and tk.spec_reason(p, 4) and tk.fused_recurrent_momentum_reason(p, 4)
    assert kernel(parts, short.double(), 4) is None                               # fp64 stays on torch
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    assert kernel(parts, short, 4) is None
