"""Omega windows c > 1 on the Triton linear-memory kernels (atlaslab/kernels), under TRITON_INTERPRET=1.

- the torch references (:func:`reference.window_rule_recurrent`, :func:`reference.window_rule_chunk`) equal
  ``memorize(mode="recurrent")`` in float64 (to ~1e-12), every rule, per-head and channel-wise decay;
- ``memorize(mode="triton")`` on the chunk and token-by-token window kernels in float32 against the float64
  ``memorize(mode="recurrent")``: output, final memory and the gradients of q, k, v, η, γ, α and the learned
  initial memory, RMS-error ratio ≤ 1e-3 — c = 2, 3, T not a multiple of the chunk, chained calls (the window's
  start carried in the state's history, gradients through it);
- the window kernels called directly (history slots, initial state, read chunk, channel-wise decay on both
  kernels) against the float64 token loop; channel-wise decay with fast-forgetting channels (α ≈ 0.04–0.05 over a
  32-token chunk: the chunk-local decay e^{g} reaches e^{−90}, so a factorised e^{−g} would overflow fp32) on the
  chunk kernel, forward and Triton backward;
- the window backward kernels equal autograd of the torch chunk form (which ``BACKWARD = "torch"`` selects);
- dispatch: windows up to c = 8 select a kernel, with per-head or channel-wise decay; the global window falls
  back; ``memorize(mode="triton")`` with a channel-wise c = 3 spec runs the kernels (``explain`` is None).

Outputs the kernels allocate are NaN-poisoned (fla's conftest trick). Shapes are tiny (the interpreter is slow).
"""
import pytest
import torch
from helpers import on_device_of, random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.engines.recurrent import initial_state  # noqa: E402
from atlaslab.kernels.window_rule.naive import (MAX_WINDOW, window_rule_chunk, window_rule_recurrent,  # noqa: E402
                                                window_slots)
from atlaslab.kernels.delta_rule import chunk as chunk_mod  # noqa: E402
from atlaslab.kernels.window_rule.chunk import (chunk_window_rule, window_chunk_backward,  # noqa: E402
                                                window_torch_backward)
from atlaslab.kernels.window_rule.fused_recurrent import fused_recurrent_window_rule  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
H, D = 2, 8


def _spec(c, bias="l2", retention="none", read="token"):
    return {"memory": "linear", "window": {"size": c}, "attentional_bias": bias, "retention": retention,
            "read": read}


def _parts(spec, dtype=torch.float32, d=D):
    torch.manual_seed(0)
    parts = build_memory(spec, H, d, d)
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return parts.to(device=DEVICE, dtype=dtype)


def _data(parts, B, T, d=D, seed=0):
    """float64 q, k, v and gates (lr, window, retention when used)."""
    q, k, v = random_qkv(B, T, H, d, seed=seed)
    names = ("lr", "window", "retention") if parts.retention.uses_alpha else ("lr", "window")
    gates = random_gates(B, T, H, seed=seed + 1, names=names, low=0.4, high=0.95,
                         Dk=d if getattr(parts.retention, "channel_wise", False) else None)
    qkv, gates = on_device_of(parts, (q, k, v), gates)
    return list(qkv), gates


# ------------------------------------------------------------------------------------------ torch references

RETENTIONS = ["none", {"name": "decay", "placement": "before_step"}, {"name": "decay", "placement": "after_step"},
              {"name": "decay", "placement": "before_step", "channel_wise": True}]


@pytest.mark.parametrize("c", [2, 3])
@pytest.mark.parametrize("retention", RETENTIONS)
def test_window_references_equal_memorize_recurrent(c, retention):
    for bias in ("l2", "dot"):
        for read in ("token", "chunk"):
            parts = _parts(_spec(c, bias, retention, read), torch.float64, d=4)
            (q, k, v), gates = _data(parts, 2, 7, d=4)
            o_r, s_r = memorize(q, k, v, parts, gates, mode="recurrent", chunk_size=1)
            fm = parts.feature_map
            xs, vs, gs = window_slots(fm(k), v, gates["window"], c)
            alpha = gates.get("retention")
            placement = retention["placement"] if isinstance(retention, dict) else "after_step"
            opts = dict(bias=bias, placement=placement, read=read)
            W0 = initial_state(parts, 2, torch.float64, DEVICE).weights["W"]
            for fn, kw in ((window_rule_recurrent, {}), (window_rule_chunk, dict(chunk_size=3))):
                o, W = fn(fm(q), xs, vs, gates["lr"].unsqueeze(2) * gs, alpha, W0, **opts, **kw)
                assert rms_ratio(o, o_r) < 1e-12 and rms_ratio(W, s_r.weights["W"]) < 1e-12


# ------------------------------------------------------------------------------------ memorize(mode="triton")

def _run(parts, xs, gates, mode, splits, dtype):
    """memorize over consecutive calls (split points ``splits``); returns (o, state, grads of q, k, v, gates, W0)."""
    q, k, v = (x.to(device=DEVICE, dtype=dtype).requires_grad_() for x in xs)
    g = {n: x.to(device=DEVICE, dtype=dtype).requires_grad_() for n, x in gates.items()}
    p = parts.to(dtype)
    T = q.shape[1]
    bounds = [0, *splits, T]
    outs, state = [], None
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, state = memorize(q[:, s:e], k[:, s:e], v[:, s:e], p, {n: x[:, s:e] for n, x in g.items()}, mode=mode,
                            chunk_size=1, block_size=16, initial_state=state)
        outs.append(o)
    o = torch.cat(outs, 1)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(o)
    leaves = [q, k, v, *g.values(), *p.parameters()]
    grads = torch.autograd.grad((o * w).sum() + state.weights["W"].square().sum(), leaves, allow_unused=True)
    return o, state, grads


def _compare(spec, T, splits, kernel, monkeypatch, B=1):
    parts = _parts(spec, torch.float64)
    xs, gates = _data(parts, B, T)
    monkeypatch.setattr(tk, "RECURRENT_MAX_T", 10 ** 6 if kernel == "fused_recurrent" else 0)
    assert tk.select_kernel(parts.float(), torch.zeros(B, T, H, D, device=DEVICE), 1).kernel == kernel
    o_r, s_r, g_r = _run(parts, xs, gates, "recurrent", [], torch.float64)
    o_t, s_t, g_t = _run(parts, xs, gates, "triton", splits, torch.float32)
    ratios = {"o": rms_ratio(o_t.double(), o_r), "W": rms_ratio(s_t.weights["W"].double(), s_r.weights["W"])}
    names = ["q", "k", "v", *gates, *(n for n, _ in parts.named_parameters())]
    for n, a, r in zip(names, g_t, g_r):
        if r is not None and r.abs().sum() > 0:
            ratios[n] = rms_ratio(a.double(), r)
    assert s_t.position == s_r.position == T
    for n in ("hist_k", "hist_v", "hist_gamma"):
        assert rms_ratio(getattr(s_t, n).double(), getattr(s_r, n)) < 1e-6
    assert max(ratios.values()) <= TOL, ratios
    assert {"q", "k", "v", "lr", "window"} <= set(ratios)
    return ratios


CASES = [(2, "l2", {"name": "decay", "placement": "before_step"}, "token"),
         (3, "l2", {"name": "decay", "placement": "after_step"}, "chunk"),
         (3, "dot", {"name": "decay", "placement": "after_step"}, "token"),
         (2, "l2", "none", "token")]


@pytest.mark.parametrize("c, bias, retention, read", CASES)
def test_memorize_triton_chunk_window_matches_recurrent(c, bias, retention, read, monkeypatch):
    # T = 21: BT = 16 tokens per chunk (c = 2: 32 slot rows; c = 3: 48 of 64), a full chunk and a ragged one
    r = _compare(_spec(c, bias, retention, read), 21, [], "chunk", monkeypatch)
    if retention != "none":
        assert "retention" in r


@pytest.mark.parametrize("c, bias, retention, read", CASES[:3])
def test_memorize_triton_fused_window_matches_recurrent(c, bias, retention, read, monkeypatch):
    _compare(_spec(c, bias, retention, read), 9, [], "fused_recurrent", monkeypatch, B=2)


CW = {"name": "decay", "placement": "before_step", "channel_wise": True}
CW_AFTER = {"name": "decay", "placement": "after_step", "channel_wise": True}


@pytest.mark.parametrize("kernel, bias, retention, read", [("chunk", "l2", CW, "token"),
                                                           ("chunk", "dot", CW_AFTER, "chunk"),
                                                           ("fused_recurrent", "l2", CW_AFTER, "chunk")])
def test_memorize_triton_window_channel_wise_matches_recurrent(kernel, bias, retention, read, monkeypatch):
    # channel-wise decay with c = 3 now runs the kernels (explain is None), forward and backward
    spec = _spec(3, bias, retention, read)
    assert tk.explain(_parts(spec), torch.zeros(1, 4, H, D, device=DEVICE), 1) is None
    r = _compare(spec, 21 if kernel == "chunk" else 9, [], kernel, monkeypatch)
    assert "retention" in r


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_memorize_triton_window_chained_calls(kernel, monkeypatch):
    # calls of 1, 2 and 16 tokens: the window's start (fewer than c − 1 tokens after the first call) comes from the
    # state's history, and the gradients flow through it into the earlier calls' k, v, γ
    spec = _spec(3, "l2", {"name": "decay", "placement": "before_step"})
    _compare(spec, 19, [1, 3], kernel, monkeypatch)


def test_memorize_triton_window_channel_wise_chained_calls(monkeypatch):
    # the chained calls of the test above with channel-wise decay, c = 2, on the chunk kernel
    _compare(_spec(2, "l2", CW_AFTER, "chunk"), 19, [1, 3], "chunk", monkeypatch)


# ------------------------------------------------------------------------------------------ kernels directly

def _direct(fn, c, alpha_shape, opts, T=9, seed=3, fast=False, **kw):
    """``fn`` on window slots with a history and an initial state, float32, against the float64 token loop: output,
    final state and the gradients of q, k, v, the history, γ, η, α and the initial state. ``fast``: two key
    channels forget fast (α ∈ [0.04, 0.05]), the others α ∈ [0.05, 0.99] (channel-wise ``alpha_shape`` only)."""
    g = torch.Generator().manual_seed(seed)
    B, K, V, h = 1, 8, 12, c - 1
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)  # noqa
    q, k, hk = unit(B, T, H, K), unit(B, T, H, K), unit(B, h, H, K)
    v, hv = torch.randn(B, T, H, V, generator=g, dtype=torch.float64), torch.randn(B, h, H, V, generator=g,
                                                                                  dtype=torch.float64)
    gam, hg = torch.rand(B, T, H, generator=g, dtype=torch.float64), torch.rand(B, h, H, generator=g,
                                                                               dtype=torch.float64)
    eta = 0.2 + 0.6 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    a = 0.6 + 0.39 * torch.rand(B, T, H, *alpha_shape, generator=g, dtype=torch.float64)
    if fast:
        a = 0.05 + 0.94 * torch.rand(B, T, H, *alpha_shape, generator=g, dtype=torch.float64)
        a[..., :2] = 0.04 + 0.01 * torch.rand(B, T, H, 2, generator=g, dtype=torch.float64)
        # within each 32-token chunk (the full one and the ragged one) the fast channels' cumulative decay passes
        # e^{−88.7} (fp32's largest e^{x} is e^{88.7}): a factorised e^{g_t} e^{−g_s} would overflow, and so would
        # an exponent left unmasked on the ragged chunk's padded rows
        assert max(a[:, i:i + 32].log().cumsum(1).min() for i in (0, 32)) < -88.8
    s0 = 0.5 * torch.randn(B, H, V, K, generator=g, dtype=torch.float64)
    ref = [x.requires_grad_() for x in (q, k, v, hk, hv, hg, gam, eta, a, s0)]
    fast = [x.detach().float().to(DEVICE).requires_grad_() for x in ref]
    res = []
    for leaves, f, fkw in ((fast, fn, kw), (ref, window_rule_recurrent, {})):
        q_, k_, v_, hk_, hv_, hg_, gam_, eta_, a_, s0_ = leaves
        xs, vs, gs = window_slots(k_, v_, gam_, c, hk_, hv_, hg_)
        o, ht = f(q_, xs, vs, eta_.unsqueeze(2) * gs, a_, s0_, **opts, **fkw)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(o)
        ((o * w).sum() + ht.square().sum()).backward()
        res.append((o, ht))
    ratios = {"o": rms_ratio(res[0][0].double().cpu(), res[1][0]), "ht": rms_ratio(res[0][1].double().cpu(), res[1][1])}
    for n, x, r in zip(("q", "k", "v", "hk", "hv", "hg", "gam", "eta", "a", "s0"), fast, ref):
        assert x.grad is not None and torch.isfinite(x.grad).all(), n
        ratios[n] = rms_ratio(x.grad.double().cpu(), r.grad)
    assert max(ratios.values()) <= TOL, ratios
    return ratios


@pytest.mark.parametrize("c, opts", [(2, dict(bias="l2", placement="after_step", read="chunk")),
                                     (3, dict(bias="dot", placement="before_step", read="chunk"))])
def test_chunk_window_kernel_with_history(c, opts):
    _direct(chunk_window_rule, c, (), opts, T=18, chunk_size=16 * c)


@pytest.mark.parametrize("c", [2, 3])
def test_fused_window_kernel_channel_wise(c):
    _direct(fused_recurrent_window_rule, c, (8,), dict(bias="l2", placement="before_step", read="token"))


@pytest.mark.parametrize("c, opts", [(3, dict(bias="l2", placement="after_step", read="chunk")),
                                     (3, dict(bias="dot", placement="after_step", read="token"))])
def test_chunk_window_kernel_channel_wise(c, opts):
    # T = 21 tokens, BT = 16 per chunk (c = 3: 48 of 64 slot rows): a full chunk and a ragged one, history slots
    _direct(chunk_window_rule, c, (8,), opts, T=21, chunk_size=16 * c)


@pytest.mark.parametrize("c, opts", [(2, dict(bias="l2", placement="after_step", read="token")),
                                     (3, dict(bias="l2", placement="before_step", read="chunk"))])
def test_chunk_window_kernel_channel_wise_fast_forgetting(c, opts):
    # a 32-token chunk (c = 3: 96 of 128 slot rows) and a ragged one of 30 tokens; two channels at α ≈ 0.04–0.05
    # decay to e^{g} < e^{−90} within each: the pairwise decays must be formed as e^{a − b ≤ 0}, never e^{a} e^{−b}
    _direct(chunk_window_rule, c, (8,), opts, T=62, fast=True, chunk_size=32 * c)


def test_chunk_window_kernel_rejects_large_windows():
    q = torch.zeros(1, 4, 1, 8, device=DEVICE)
    big = torch.zeros(1, 4, MAX_WINDOW + 1, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        chunk_window_rule(q, big, big, big[..., 0], bias="l2", placement="before_step", read="token")


@pytest.mark.parametrize("c, opts, decay, h0", [
    (3, dict(bias="l2", placement="after_step", read="chunk"), True, False),
    (2, dict(bias="dot", placement="before_step", read="token"), False, True)])
def test_window_backward_kernels_equal_torch_recompute(c, opts, decay, h0, monkeypatch):
    g = torch.Generator().manual_seed(11)
    B, T, K, V = 1, 18, 8, 12
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    xs = torch.nn.functional.normalize(torch.randn(B, T, c, H, K, generator=g), dim=-1)
    vs = torch.randn(B, T, c, H, V, generator=g)
    coef = 0.1 + 0.5 * torch.rand(B, T, c, H, generator=g)
    a = 0.6 + 0.39 * torch.rand(B, T, H, generator=g) if decay else None
    s0 = 0.5 * torch.randn(B, H, V, K, generator=g) if h0 else None
    do, dht = torch.randn(B, T, H, V, generator=g), torch.randn(B, H, V, K, generator=g)
    saved = [x.to(DEVICE) if x is not None else None for x in (q, xs, vs, coef, a, s0)]
    kern = window_chunk_backward(*saved, do.to(DEVICE), dht.to(DEVICE), chunk_size=16 * c, **opts)
    ref = window_torch_backward([x.double() if x is not None else None for x in saved], [True] * 6,
                                do.to(DEVICE).double(), dht.to(DEVICE).double(), opts, 16)
    for x, r in zip(kern, ref):
        assert (x is None) == (r is None)
        if r is not None:
            assert rms_ratio(x.double().cpu(), r.cpu()) <= TOL
    # the autograd Function runs the kernels unless BACKWARD == "torch"; both agree
    leaves = [x.clone().requires_grad_() if x is not None else None for x in saved]
    grads = []
    for mode in ("triton", "torch"):
        monkeypatch.setattr(chunk_mod, "BACKWARD", mode)
        o, ht = chunk_window_rule(*leaves, chunk_size=16 * c, **opts)
        grads.append(torch.autograd.grad((o * do.to(o)).sum() + (ht * dht.to(ht)).sum(),
                                         [x for x in leaves if x is not None]))
    for x, r in zip(*grads):
        assert rms_ratio(x.double(), r.double()) <= TOL


# -------------------------------------------------------------------------------------------------- dispatch

def test_window_dispatch():
    q = torch.zeros(1, 4, H, D, device=DEVICE)
    for c in (2, 3, MAX_WINDOW):
        assert tk.spec_reason(_parts(_spec(c)), 1) is None and tk.select_kernel(_parts(_spec(c)), q, 1) is not None
    cw = {"name": "decay", "placement": "after_step", "channel_wise": True}
    for c in (1, 2, 3, MAX_WINDOW):                # channel-wise decay: every window the kernels take
        assert tk.explain(_parts(_spec(c, retention=cw)), q, 1) is None
        assert tk.select_kernel(_parts(_spec(c, retention=cw)), q, 1) is not None
    for spec in (_spec(MAX_WINDOW + 1), _spec(MAX_WINDOW + 1, retention=cw), {"memory": "linear", "window": "global"}):
        assert tk.select_kernel(_parts(spec), q, 1) is None and tk.spec_reason(_parts(spec), 1)
