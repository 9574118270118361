"""Triton kernels (atlaslab/kernels) against their torch references, under TRITON_INTERPRET=1 on CPU.

Every kernel is compared on tiny shapes in float32 with fla's RMS-error ratio (≤ 1e-3): fused Newton–Schulz
vs the torch reference (outputs and gradients); the token-by-token and chunked delta / Hebbian kernels vs the
token loop (outputs, final state, gradients of every input), over bias × placement × read, with ``cu_seqlens``
equal to separate runs; ``memorize(mode="triton")`` vs ``memorize(mode="recurrent")`` for the presets the kernels
cover; the dispatch switches (``ATLASLAB_FORCE_TORCH``, unsupported specs / dtypes fall back to ``chunked``).
Outputs the kernels allocate are poisoned with NaN (fla's conftest trick), so an unwritten element fails.
The interpreter is ~1000× slower than torch: keep shapes tiny.
"""
import os

import pytest
import torch
from helpers import random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.kernels.newton_schulz import newton_schulz as ns_torch, orthogonalise, select_newton_schulz  # noqa: E402
from atlaslab.kernels.newton_schulz import LACT_COEFFICIENTS  # noqa: E402
from atlaslab.kernels.delta_rule.naive import delta_rule_chunk, delta_rule_recurrent  # noqa: E402
from atlaslab.kernels.delta_rule.chunk import chunk_delta_rule  # noqa: E402
from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule  # noqa: E402
from atlaslab.kernels.newton_schulz.fused import newton_schulz as ns_triton, supports as ns_supports  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)


def _inputs(B, T, H, K, V, seed=0, alpha=True, h0=True, N=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    beta = 0.2 + 0.7 * torch.rand(B, T, H, generator=g)
    a = 0.6 + 0.39 * torch.rand(B, T, H, generator=g) if alpha else None
    s0 = 0.5 * torch.randn(N or B, H, V, K, generator=g) if h0 else None
    return [x.to(DEVICE) if x is not None else None for x in (q, k, v, beta, a, s0)]


def _check_rule(kernel, inputs, opts, grads=True, **kw):
    """Kernel vs the token loop: o, final state, and (with grads) every input's gradient."""
    leaves_k = [x.clone().requires_grad_(grads) if x is not None else None for x in inputs]
    leaves_r = [x.clone().requires_grad_(grads) if x is not None else None for x in inputs]
    o, ht = kernel(*leaves_k, **opts, **kw)
    o_r, ht_r = delta_rule_recurrent(*leaves_r, **opts)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rms_ratio(o, o_r) <= TOL and rms_ratio(ht, ht_r) <= TOL
    if grads:
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(o)
        ((o * w).sum() + ht.square().sum()).backward()
        ((o_r * w).sum() + ht_r.square().sum()).backward()
        for a, r in zip(leaves_k, leaves_r):
            if r is not None:
                assert rms_ratio(a.grad, r.grad) <= TOL


# ---------------------------------------------------------------------------------------------- Newton–Schulz

@pytest.mark.parametrize("shape", [(3, 8, 16), (2, 16, 8), (2, 5, 12), (1, 16, 32), (1, 2, 32, 16)])
def test_newton_schulz_matches_torch(shape):
    s = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert ns_supports(s)
    for steps, shape_factor in ((5, False), (2, True)):
        out = ns_triton(s, steps=steps, shape_factor=shape_factor)
        ref = ns_torch(s.double(), steps=steps, shape_factor=shape_factor)
        assert out.shape == s.shape and out.dtype == s.dtype
        assert rms_ratio(out.double(), ref) <= TOL


def test_newton_schulz_gradient_matches_torch():
    s = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    w = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
    (ns_triton(a) * w).sum().backward()
    (ns_torch(b) * w).sum().backward()
    assert rms_ratio(a.grad, b.grad) <= TOL


def test_newton_schulz_dispatch():
    small = torch.randn(2, 8, 16).to(DEVICE)
    assert select_newton_schulz(small) is not None
    assert rms_ratio(orthogonalise(small), ns_torch(small)) <= TOL
    assert select_newton_schulz(small.double()) is None             # fp64: torch path
    assert not ns_supports(torch.randn(1, 200, 300))                    # too large for one program
    assert select_newton_schulz(torch.randn(1, 200, 300)) is None
    # a per-step schedule (LaCT's) runs the torch reference, which takes it; the kernel takes one (a, b, c)
    scheduled = orthogonalise(small, coefficients=LACT_COEFFICIENTS)
    assert torch.equal(scheduled, ns_torch(small, 5, 1e-7, LACT_COEFFICIENTS))


# ------------------------------------------------------------------------------------- token-by-token kernel

RULES = [("l2", "before_step", "token"), ("l2", "after_step", "token"), ("l2", "before_step", "chunk"),
         ("l2", "after_step", "chunk"), ("dot", "after_step", "token"), ("dot", "before_step", "chunk")]


@pytest.mark.parametrize("bias, placement, read", RULES)
def test_fused_recurrent_matches_token_loop(bias, placement, read):
    opts = dict(bias=bias, placement=placement, read=read)
    _check_rule(fused_recurrent_delta_rule, _inputs(2, 9, 2, 8, 12), opts)


def test_fused_recurrent_without_decay_or_initial_state():
    _check_rule(fused_recurrent_delta_rule, _inputs(1, 5, 1, 16, 8, alpha=False, h0=False),
                dict(bias="l2", placement="before_step", read="token"))


def test_fused_recurrent_cu_seqlens_equals_separate_runs():
    cu = torch.tensor([0, 3, 4, 9, 13], device=DEVICE)
    q, k, v, beta, a, s0 = _inputs(1, 13, 2, 8, 8, seed=3, N=4)
    opts = dict(bias="l2", placement="before_step", read="token")
    o, ht = fused_recurrent_delta_rule(q, k, v, beta, a, s0, cu_seqlens=cu, **opts)
    for n in range(4):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, h_n = fused_recurrent_delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], a[:, sl], s0[n:n + 1], **opts)
        assert rms_ratio(o[:, sl], o_n) <= TOL and rms_ratio(ht[n:n + 1], h_n) <= TOL
    _check_rule(fused_recurrent_delta_rule, [q, k, v, beta, a, s0], dict(opts, cu_seqlens=cu))


# --------------------------------------------------------------------------------------------- chunk kernel

@pytest.mark.parametrize("bias, placement, read", [("l2", "before_step", "token"), ("l2", "after_step", "chunk"),
                                                   ("dot", "after_step", "token")])
def test_chunk_matches_token_loop(bias, placement, read):
    # T = 21 with 16-token chunks: a full chunk and a ragged one
    _check_rule(chunk_delta_rule, _inputs(1, 21, 2, 8, 12), dict(bias=bias, placement=placement, read=read),
                chunk_size=16)


def test_chunk_short_sequence_without_decay():
    _check_rule(chunk_delta_rule, _inputs(2, 5, 1, 16, 16, alpha=False, h0=False),
                dict(bias="l2", placement="after_step", read="token"), chunk_size=16)


def test_chunk_cu_seqlens_equals_separate_runs():
    cu = torch.tensor([0, 2, 19], device=DEVICE)
    q, k, v, beta, a, s0 = _inputs(1, 19, 1, 8, 8, seed=4, N=2)
    opts = dict(bias="l2", placement="before_step", read="token", chunk_size=16)
    o, ht = chunk_delta_rule(q, k, v, beta, a, s0, cu_seqlens=cu, **opts)
    for n in range(2):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, h_n = chunk_delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], a[:, sl], s0[n:n + 1], **opts)
        assert rms_ratio(o[:, sl], o_n) <= TOL and rms_ratio(ht[n:n + 1], h_n) <= TOL


def test_torch_chunk_reference_equals_token_loop():
    x = [t.double() for t in _inputs(2, 11, 2, 4, 4)]
    for bias, placement, read in RULES:
        o, h = delta_rule_chunk(*x, bias=bias, placement=placement, read=read, chunk_size=4)
        o_r, h_r = delta_rule_recurrent(*x, bias=bias, placement=placement, read=read)
        assert rms_ratio(o, o_r) < 1e-12 and rms_ratio(h, h_r) < 1e-12


# ------------------------------------------------------------------------------- memorize(mode="triton")

H, D = 2, 8
SPECS = {
    "gated_deltanet": {"memory": "linear", "retention": {"name": "decay", "placement": "before_step"}},
    "deltanet_chunk_read": {"memory": "linear", "read": "chunk"},
    "titans_linear_after_step": {"memory": "linear", "retention": "decay"},
    "gla_scalar_dot": {"memory": "linear", "attentional_bias": "dot", "retention": "decay",
                       "feature_map": "elu_plus_one"},
    "deltanet_dpfp": {"memory": "linear", "feature_map": {"name": "dpfp", "nu": 1}},
}


def _parts(spec):
    torch.manual_seed(0)
    parts = build_memory(spec, H, D, D)
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return parts.to(DEVICE)


def _memorize_all(parts, T, modes, seed=0, **kw):
    q, k, v = (x.to(DEVICE) for x in random_qkv(2, T, H, D, seed=seed, dtype=torch.float32, requires_grad=True))
    names = ("lr", "window", "retention") if parts.retention.uses_alpha else ("lr", "window")
    gates = {n: x.to(DEVICE).requires_grad_() for n, x in
             random_gates(2, T, H, seed=seed + 1, names=names, dtype=torch.float32, low=0.5, high=0.95).items()}
    leaves = [q, k, v, *gates.values(), *parts.parameters()]
    out = []
    for mode in modes:
        o, state = memorize(q, k, v, parts, gates, mode=mode, chunk_size=1, **kw)
        grads = torch.autograd.grad(o.square().sum() + state.weights["W"].sum(), leaves, allow_unused=True)
        out.append((o, state, grads))
    return out


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("name", list(SPECS))
def test_memorize_triton_matches_recurrent(name, kernel, monkeypatch):
    parts = _parts(SPECS[name])
    T = 9 if kernel == "fused_recurrent" else 19
    monkeypatch.setattr(tk, "RECURRENT_MAX_T", 64 if kernel == "fused_recurrent" else 0)
    q = torch.zeros(2, T, H, D, device=DEVICE)
    assert tk.select_kernel(parts, q, 1).kernel == kernel
    (o_r, s_r, g_r), (o_t, s_t, g_t) = _memorize_all(parts, T, ("recurrent", "triton"), block_size=16)
    assert rms_ratio(o_t, o_r) <= TOL
    assert rms_ratio(s_t.weights["W"], s_r.weights["W"]) <= TOL
    assert s_t.position == s_r.position == T and s_t.hist_k.shape == s_r.hist_k.shape
    for a, r in zip(g_t, g_r):
        if r is not None and r.abs().sum() > 0:
            assert rms_ratio(a, r) <= TOL


def test_memorize_triton_chained_calls_equal_one_call():
    parts = _parts(SPECS["gated_deltanet"])
    q, k, v = (x.to(DEVICE) for x in random_qkv(1, 8, H, D, dtype=torch.float32))
    g = {n: x.to(DEVICE) for n, x in random_gates(1, 8, H, names=("lr", "retention"), dtype=torch.float32).items()}
    full, s_full = memorize(q, k, v, parts, g, mode="recurrent", chunk_size=1)
    o1, s1 = memorize(q[:, :5], k[:, :5], v[:, :5], parts, {n: x[:, :5] for n, x in g.items()}, mode="triton",
                      chunk_size=1)
    o2, s2 = memorize(q[:, 5:], k[:, 5:], v[:, 5:], parts, {n: x[:, 5:] for n, x in g.items()}, mode="triton",
                      chunk_size=1, initial_state=s1)
    assert rms_ratio(torch.cat([o1, o2], 1), full) <= TOL
    assert rms_ratio(s2.weights["W"], s_full.weights["W"]) <= TOL and s2.position == 8


# --------------------------------------------------------------------------------------------------- dispatch

def test_available_and_switches(monkeypatch):
    parts = _parts(SPECS["gated_deltanet"])
    q = torch.zeros(1, 4, H, D, device=DEVICE)
    assert tk.available() and tk.triton_importable()
    assert tk.select_kernel(parts, q, 1) is not None and tk.explain(parts, q, 1) is None
    long_q = torch.zeros(1, tk.RECURRENT_MAX_T + 1, H, D, device=DEVICE)
    assert tk.select_kernel(parts, q, 1).kernel == "fused_recurrent"       # short calls (decoding)
    assert tk.select_kernel(parts, long_q, 1).kernel == "chunk"
    assert tk.select_kernel(parts, q, 1, mode="chunked").kernel == "chunk"
    assert tk.select_kernel(parts, long_q, 1, mode="recurrent").kernel == "fused_recurrent"
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    assert tk.forced_torch() and tk.select_kernel(parts, q, 1) is None
    assert tk.FORCE_TORCH_ENV in tk.explain(parts, q, 1)
    assert select_newton_schulz(torch.randn(2, 8, 16, device=DEVICE)) is None
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "0")
    assert not tk.forced_torch()
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not tk.available() and tk.select_kernel(parts, q, 1) is None


def test_force_torch_and_unsupported_specs_fall_back_to_chunked(monkeypatch):
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    parts = _parts(SPECS["gated_deltanet"])
    (o_c, s_c, _), (o_t, s_t, _) = _memorize_all(parts, 6, ("chunked", "triton"))
    assert torch.equal(o_c, o_t) and torch.equal(s_c.weights["W"], s_t.weights["W"])
    monkeypatch.delenv(tk.FORCE_TORCH_ENV)
    q = torch.zeros(1, 4, H, D, device=DEVICE)
    for spec, b in (({"memory": "mlp"}, 1), ({"memory": "linear", "window": "global"}, 1),
                    ({"memory": "linear", "inner_optimizer": "momentum", "window": {"size": 2}}, 1),
                    ({"memory": "linear"}, 4)):
        assert tk.select_kernel(_parts(spec), q, b) is None and tk.spec_reason(_parts(spec), b)
    assert tk.select_kernel(parts, q.double(), 1) is None               # fp64 stays on torch
    unsupported = _parts({"memory": "linear", "window": "global"})
    (o_c, _, _), (o_t, _, _) = _memorize_all(unsupported, 5, ("chunked", "triton"))
    assert torch.equal(o_c, o_t)
    with pytest.raises(ValueError, match="unknown mode"):
        tk.select_kernel(parts, q, 1, mode="bogus")


def test_interpreter_env_was_set_before_kernels():
    # conftest sets TRITON_INTERPRET=1 before any kernel is decorated; on CPU the kernels must be interpreted
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
