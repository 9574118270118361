"""The deep-memory chunk step (atlaslab/kernels/mlp/chunk.py) against its torch reference and ``chunked``.

2-layer residual MLP memory, ℓ2 bias, GD or momentum: the Triton kernels (under
TRITON_INTERPRET=1) vs :func:`mlp_chunk_reference` in float64 for gelu / silu / relu, several hidden blocks and a
ragged window (fla's RMS-error ratio ≤ 1e-3 in fp32; fp16 inputs ≤ 1e-2); the autograd Function's gradients
(torch-recompute backward) vs the float64 reference for x, v, W1, W2, S1, S2 and every coefficient row, and
``gradcheck`` in float64; the reference equals ``chunked._dual_step`` in float64; the step equals ``_dual_step`` in
float32 on a built spec; the ``chunked`` engine with the step patched in for ``_dual_step`` matches the float64 engine
(outputs, states, all gradients; with and without checkpointing); the dispatch. Kernel allocations are poisoned with
NaN, so an unwritten element fails.

The ATLAS-family memories (``residual: false``, polynomial / Taylor-φ* map so that D_in = C(d + 2, 2) ≠ D_out, ℓ2 or
dot bias, GD or momentum, c = 1, 2, 4): the kernels vs the float64 reference (also at a preset's D_in = 153), the
Function's gradients and gradcheck, the reference and the step vs ``_dual_step`` on built specs, ``memorize(mode=
"triton")`` vs ``memorize(mode="recurrent")`` over two chained calls with partial chunks (outputs, final state, the
gradients of q, k, v, the gates, the initial weights and the polynomial coefficients), and the presets' dispatch.
"""
import copy

import pytest
import torch
from helpers import random_gates, random_qkv, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.engines import chunked, mlp_step  # noqa: E402
from atlaslab.kernels.mlp import chunk as mc  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
ACTS = ("gelu", "silu", "relu")
NAMES = ("x", "v", "W1", "W2", "S1", "S2", "P_e", "Q_e", "A_e", "Th_e", "S_e")
OUTS = ("delta1", "delta2", "a", "W1_e", "W2_e", "S1_e", "S2_e")


def _inputs(B=2, H=2, W=5, D=8, hid=16, momentum=True, seed=0, DO=None):
    """float64 op inputs in :data:`NAMES` order (None for the momentum ones under GD); ``x [B, H, W, D]``,
    ``v [B, H, W, DO]`` (DO = D unless given)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    def u(*shape, low=0.3, high=1.0):
        return low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64)

    DO = DO or D
    x, v = r(B, H, W, D), r(B, H, W, DO)
    W1, W2 = r(B, H, hid, D, scale=0.4), r(B, H, DO, hid, scale=0.4)
    P, A = u(B, H), -u(B, H, W, low=0.05, high=0.5)
    if not momentum:
        return [x, v, W1, W2, None, None, P, None, A, None, None]
    S1, S2 = r(B, H, hid, D, scale=0.2), r(B, H, DO, hid, scale=0.2)
    return [x, v, W1, W2, S1, S2, P, u(B, H), A, u(B, H), -u(B, H, W, low=0.05, high=0.5)]


def _to(inputs, dtype, grad=False):
    return [None if z is None else z.to(DEVICE, dtype).requires_grad_(grad) for z in inputs]


def _probe(outs, seed=7):
    """A random linear functional of every output (the outer loss)."""
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in outs if o is not None)


KERNEL_CASES = [   # (activation, momentum, B, H, W, D, hidden, block_hidden)
    *[(act, True, 2, 2, 5, 8, 16, None) for act in ACTS],
    *[(act, False, 2, 2, 8, 8, 16, None) for act in ACTS],
    ("gelu", True, 1, 2, 7, 12, 48, 16),      # three hidden blocks (the last ragged), D and W not powers of two
    ("silu", False, 1, 1, 19, 8, 40, 32),     # W > 16, two hidden blocks
]


@pytest.mark.parametrize("act, mom, B, H, W, D, hid, bh", KERNEL_CASES)
def test_kernel_matches_reference(act, mom, B, H, W, D, hid, bh):
    """fp32 kernels vs the float64 reference: every output (factors, new weights, new momenta)."""
    ins = _inputs(B, H, W, D, hid, mom)
    ref = mc.mlp_chunk_reference(*ins, activation=act)
    out = mc.mlp_chunk_forward(*_to(ins, torch.float32), activation=act, block_hidden=bh)
    for name, o, r in zip(OUTS, out, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == torch.float32 and o.shape == r.shape and torch.isfinite(o).all(), name
        assert rms_ratio(o.double().cpu(), r) <= TOL, name
    out64 = mc.mlp_chunk_forward(*_to(ins, torch.float64), activation=act, block_hidden=bh)
    for name, o, r in zip(OUTS, out64, ref):
        if r is not None:
            assert rms_ratio(o.cpu(), r) < 1e-12, name


def test_kernel_fp16_inputs():
    """fp16 in (the dispatch takes it): fp32 intermediates, fp16 out, within fp16 rounding of the reference."""
    ins = _inputs(momentum=True, seed=5)
    ref = mc.mlp_chunk_reference(*ins, activation="gelu")
    out = mc.mlp_chunk_forward(*_to(ins, torch.float16), activation="gelu")
    for name, o, r in zip(OUTS, out, ref):
        assert o.dtype == torch.float16 and torch.isfinite(o).all(), name
        assert rms_ratio(o.double().cpu(), r) <= 1e-2, name


def _assert_function_matches_reference(ins, **kw):
    """``mlp_chunk_step`` (fp32 kernels, recompute backward) on float64 inputs ``ins`` vs autograd of the float64
    reference with options ``kw``: every output and every present input's gradient within TOL."""
    ref_leaves = [None if z is None else z.clone().requires_grad_() for z in ins]
    ref = mc.mlp_chunk_reference(*ref_leaves, **kw)
    present = [(n, z) for n, z in zip(NAMES, ref_leaves) if z is not None]
    g_ref = torch.autograd.grad(_probe(ref), [z for _, z in present])
    leaves = _to(ins, torch.float32, grad=True)
    out = mc.mlp_chunk_step(*leaves, **kw)
    for o, r in zip(out, ref):
        if r is not None:
            assert rms_ratio(o.double().cpu(), r.detach()) <= TOL
    got = torch.autograd.grad(_probe(out), [z for z in leaves if z is not None])
    for (name, _), g, r in zip(present, got, g_ref):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert rms_ratio(g.double().cpu(), r) <= TOL, name


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("mom", [True, False])
def test_function_gradients_match_reference(act, mom):
    """The autograd Function (fp32 Triton forward, recompute backward) vs autograd of the float64 reference: the
    outputs and the gradients of x, v, W1, W2, S1, S2 and every coefficient row."""
    _assert_function_matches_reference(_inputs(momentum=mom, seed=1), activation=act)


def test_function_float64_equals_reference_and_gradcheck():
    """In float64 the Function's outputs and gradients are the reference's (to rounding), and gradcheck passes
    (finite differences of the Triton forward against the recompute backward)."""
    ins = _inputs(momentum=True, seed=2)
    ref_leaves = [z.clone().requires_grad_() for z in ins]
    ref = mc.mlp_chunk_reference(*ref_leaves, activation="gelu")
    g_ref = torch.autograd.grad(_probe(ref), ref_leaves)
    leaves = _to(ins, torch.float64, grad=True)
    out = mc.mlp_chunk_step(*leaves, activation="gelu")
    for o, r in zip(out, ref):
        assert rms_ratio(o.cpu(), r.detach()) < 1e-12
    for name, g, r in zip(NAMES, torch.autograd.grad(_probe(out), leaves), g_ref):
        assert rms_ratio(g.cpu(), r) < 1e-12, name

    small = _to(_inputs(B=1, H=1, W=3, D=4, hid=4, momentum=True, seed=3), torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda *z: mc.mlp_chunk_step(*z, activation="silu"), small,
                                    fast_mode=True, atol=1e-6, rtol=1e-5)


def _parts(act="gelu", optimizer="momentum", D=8, expansion=2.0, **extra):
    torch.manual_seed(0)
    spec = {"memory": {"name": "mlp", "activation": act, "expansion": expansion}, "inner_optimizer": optimizer,
            "retention": "decay", "chunk_size": 8, **extra}
    parts = build_memory(spec, 2, D, D)
    for p in parts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return parts


def _step_args(parts, dtype, mom=True, W=8, seed=4):
    ins = _inputs(B=2, H=2, W=W, D=parts.key_dim, hid=parts.memory.hidden, momentum=mom, seed=seed)
    x, v, W1, W2, S1, S2, P, Q, A, Th, S = (None if z is None else z.to(DEVICE, dtype) for z in ins)
    momentum = {"W1": S1, "W2": S2} if mom else None
    return parts, {"W1": W1, "W2": W2}, momentum, x, v, None, P, Q, A, Th, S


@pytest.mark.parametrize("act", ACTS)
def test_reference_equals_dual_step_float64(act):
    """The reference's math is ``gradient_factors`` + ``_dual_step`` (float64, to rounding)."""
    parts = _parts(act).double()
    args = _step_args(parts, torch.float64)
    factors, weights, momentum = chunked._dual_step(*args)
    _, W, S, x, v, _, P, Q, A, Th, Se = args
    d1, d2, a, W1_e, W2_e, S1_e, S2_e = mc.mlp_chunk_reference(x, v, W["W1"], W["W2"], S["W1"], S["W2"], P, Q, A,
                                                               Th, Se, activation=act)
    for got, want in ((d1, factors["W1"][0]), (d2, factors["W2"][0]), (a, factors["W2"][1]),
                      (W1_e, weights["W1"]), (W2_e, weights["W2"]), (S1_e, momentum["W1"]), (S2_e, momentum["W2"])):
        assert rms_ratio(got, want) < 1e-12


@pytest.mark.parametrize("act, optimizer", [(a, "momentum") for a in ACTS] + [("gelu", "gd")])
def test_step_matches_dual_step(act, optimizer):
    """``mlp_dual_step`` (the Triton step) and ``chunked._dual_step`` give the same factors and states in float32
    for ``build_memory({"memory": "mlp", "inner_optimizer": ..., "retention": "decay", "chunk_size": 8})``."""
    parts = _parts(act, optimizer).to(DEVICE)
    mom = optimizer == "momentum"
    args = _step_args(parts, torch.float32, mom=mom)
    x = args[3]
    step = tk.select_mlp_step(parts, x)
    assert step is tk.mlp_dual_step
    f_t, w_t, m_t = step(*args)
    f_r, w_r, m_r = chunked._dual_step(*args)
    assert list(f_t) == list(f_r) == ["W1", "W2"]
    for n in f_r:
        for got, want in zip(f_t[n], f_r[n]):
            assert got.shape == want.shape and rms_ratio(got.double(), want.double()) < 1e-5, n
        assert rms_ratio(w_t[n].double(), w_r[n].double()) < 1e-5, n
    assert f_t["W1"][1] is x
    if mom:
        for n in m_r:
            assert rms_ratio(m_t[n].double(), m_r[n].double()) < 1e-5, n
    else:
        assert m_t is None and m_r is None


def _engine_run(parts, data, dtype, b, step=None, monkeypatch=None, checkpoint=False):
    """memorize(mode="chunked") in ``dtype`` (with ``step`` patched in for ``_dual_step``) → (o, state, grads)."""
    parts = copy.deepcopy(parts).to(DEVICE, dtype)
    (q, k, v), gates = data
    q, k, v = (z.to(DEVICE, dtype).requires_grad_() for z in (q, k, v))
    gates = {n: z.to(DEVICE, dtype).requires_grad_() for n, z in gates.items()}
    leaves = [q, k, v, *gates.values(), *parts.parameters()]
    if step is not None:   # in place of the torch step (the autograd reference and mlp_step's hand-written one)
        monkeypatch.setattr(chunked, "_dual_step", step)
        monkeypatch.setattr(mlp_step, "dual_step", step)
    o, state = memorize(q, k, v, parts, gates, mode="chunked", chunk_size=b, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum()
    for z in (*state.weights.values(), *state.momentum.values()):
        loss = loss + (z * torch.randn(z.shape, generator=g, dtype=torch.float64).to(z)).sum()
    return o, state, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("act, checkpoint", [("gelu", False), ("relu", True)])
def test_chunked_engine_with_triton_step(act, checkpoint, monkeypatch):
    """``chunked._dual_aligned`` with the Triton step in place of ``_dual_step`` (fp32) vs the float64 engine:
    outputs, final weights and momenta, and the gradients of q, k, v, every gate and the learned initial weights.
    T = 13 at b = 8: a full chunk and a ragged one; with activation checkpointing the step is re-run in backward."""
    parts, b, T = _parts(act), 8, 13
    q, k, v = random_qkv(2, T, 2, 8, seed=5)
    gates = random_gates(2, T, 2, seed=6, names=("lr", "window", "momentum", "retention"), low=0.5, high=0.95)
    data = ((q, k, v), gates)
    o_r, s_r, g_r = _engine_run(parts, data, torch.float64, b)
    calls = []

    def step(*args):
        calls.append(1)
        return tk.mlp_dual_step(*args)

    o_t, s_t, g_t = _engine_run(parts, data, torch.float32, b, step, monkeypatch, checkpoint)
    assert len(calls) == (4 if checkpoint else 2), "the Triton step did not run once per chunk (twice: checkpoint)"
    assert rms_ratio(o_t.double(), o_r) <= TOL
    for n in ("W1", "W2"):
        assert rms_ratio(s_t.weights[n].double(), s_r.weights[n]) <= TOL
        assert rms_ratio(s_t.momentum[n].double(), s_r.momentum[n]) <= TOL
    for a, r in zip(g_t, g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL


def test_select_mlp_step(monkeypatch):
    """Chosen for the supported spec on fp32 tensors; None for other dtypes, specs and ATLASLAB_FORCE_TORCH."""
    x = torch.zeros(2, 8, 2, 8, device=DEVICE)
    assert tk.select_mlp_step(_parts(), x) is tk.mlp_dual_step
    assert tk.select_mlp_step(_parts("silu", "gd"), x) is tk.mlp_dual_step
    if DEVICE == "cpu":
        assert tk.select_mlp_step(_parts(), x.double()) is None          # the interpreter takes fp32 / fp16
    torch.manual_seed(0)
    unsupported = {
        "tanh": {"memory": {"name": "mlp", "activation": "tanh"}},
        "depth 3": {"memory": {"name": "mlp", "depth": 3}},
        "layer norm": {"memory": "mlp_ln"},
        "linear": {"memory": "linear"},
        "huber": {"memory": "mlp", "attentional_bias": "huber"},
        "muon": {"memory": "mlp", "inner_optimizer": "muon"},
    }
    for why, spec in unsupported.items():
        parts = build_memory(dict(spec, retention="decay"), 2, 8, 8)
        assert tk.mlp_reason(parts) is not None, why
        assert tk.select_mlp_step(parts, x) is None, why
    weight_norm = build_memory({"memory": "mlp", "retention": "weight_norm"}, 2, 8, 8)   # LaCT's projection
    assert "projecting" in tk.mlp_reason(weight_norm) and tk.select_mlp_step(weight_norm, x) is None
    monkeypatch.setenv(tk.FORCE_TORCH_ENV, "1")
    assert tk.select_mlp_step(_parts(), x) is None


def test_step_falls_back_beyond_kernel_limits(monkeypatch):
    """A window longer than the kernels take runs ``chunked._dual_step`` inside the step (same results)."""
    monkeypatch.setattr(mc, "MAX_W", 4)
    parts = _parts()
    args = _step_args(parts, torch.float32, W=6)
    f_t, w_t, _ = tk.mlp_dual_step(*args)
    f_r, w_r, _ = chunked._dual_step(*args)
    assert torch.equal(w_t["W1"], w_r["W1"]) and torch.equal(f_t["W1"][0], f_r["W1"][0])


def test_memorize_triton_mode_uses_the_fused_step(monkeypatch):
    """``memorize(mode="triton")`` on a deep-memory spec falls back to ``chunked`` with the fused step wired in."""
    parts = _parts("gelu")
    q, k, v = random_qkv(2, 11, 2, 8, seed=3)
    gates = random_gates(2, 11, 2, seed=4, names=("lr", "window", "momentum", "retention"), low=0.5, high=0.95)
    calls, fused = [], tk.mlp_dual_step

    def counted(*args):
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(tk, "mlp_dual_step", counted)
    p32 = copy.deepcopy(parts).float()
    p32 = p32.to(DEVICE)
    args = (q.to(DEVICE, torch.float32), k.to(DEVICE, torch.float32), v.to(DEVICE, torch.float32), p32,
            {n: g.to(DEVICE, torch.float32) for n, g in gates.items()})
    o_t, s_t = memorize(*args, mode="triton", chunk_size=4)
    o_c, s_c = memorize(*args, mode="chunked", chunk_size=4)
    assert len(calls) == 3                                   # 11 tokens at b = 4: three chunks
    assert rms_ratio(o_t.double(), o_c.double()) <= TOL
    assert rms_ratio(s_t.weights["W1"].double(), s_c.weights["W1"].double()) <= TOL


# ------------------------------------------------------------------ residual off, D_in ≠ D_out, the dot bias

GENERAL_CASES = [   # (activation, momentum, residual, bias, B, H, W, D_in, D_out, hidden, block_hidden)
    ("gelu", True, False, "l2", 2, 2, 11, 15, 4, 8, None),       # OmegaNet-like: c = 4, b = 8 window (W = 11)
    ("silu", False, False, "l2", 1, 2, 20, 15, 6, 40, 16),       # three hidden blocks (the last ragged), W > 16
    ("gelu", False, False, "dot", 2, 2, 8, 15, 4, 8, None),      # DLA-like (c = 1)
    ("relu", True, False, "dot", 1, 2, 11, 10, 5, 24, 16),       # dot with momentum, two hidden blocks
    ("gelu", True, True, "dot", 1, 2, 7, 8, 8, 16, None),        # residual dot (the residual changes nothing)
    ("gelu", False, False, "l2", 1, 1, 19, 153, 16, 40, None),   # a preset's D_in = C(18, 2): BD_in = 256, BHID 32
]


@pytest.mark.parametrize("act, mom, res, bias, B, H, W, D, DO, hid, bh", GENERAL_CASES)
def test_general_kernel_matches_reference(act, mom, res, bias, B, H, W, D, DO, hid, bh):
    """fp32 (and fp64) kernels vs the float64 reference for residual off / D_in ≠ D_out / the dot bias."""
    ins = _inputs(B, H, W, D, hid, mom, seed=11, DO=DO)
    kw = dict(activation=act, residual=res, bias=bias)
    ref = mc.mlp_chunk_reference(*ins, **kw)
    if bias == "dot":
        assert torch.equal(ref[1], -ins[1])
    out = mc.mlp_chunk_forward(*_to(ins, torch.float32), block_hidden=bh, **kw)
    for name, o, r in zip(OUTS, out, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == torch.float32 and o.shape == r.shape and torch.isfinite(o).all(), name
        assert rms_ratio(o.double().cpu(), r) <= TOL, name
    out64 = mc.mlp_chunk_forward(*_to(ins, torch.float64), block_hidden=bh, **kw)
    for name, o, r in zip(OUTS, out64, ref):
        if r is not None:
            assert rms_ratio(o.cpu(), r) < 1e-12, name


def test_residual_needs_equal_dims():
    ins = _inputs(B=1, H=1, W=4, D=6, hid=8, momentum=False, DO=4)
    with pytest.raises(ValueError, match="residual"):
        mc.mlp_chunk_reference(*ins, residual=True)
    with pytest.raises(ValueError, match="bias"):
        mc.mlp_chunk_reference(*ins, residual=False, bias="huber")


@pytest.mark.parametrize("bias, mom", [("l2", True), ("dot", False), ("dot", True)])
def test_general_function_gradients_match_reference(bias, mom):
    """The autograd Function (residual off, D_in = 15 ≠ D_out = 4) vs autograd of the float64 reference: outputs and
    the gradients of x, v, W1, W2, S1, S2 and every coefficient row."""
    _assert_function_matches_reference(_inputs(B=2, H=2, W=11, D=15, hid=8, momentum=mom, seed=12, DO=4),
                                       activation="gelu", residual=False, bias=bias)


@pytest.mark.parametrize("bias", ["l2", "dot"])
def test_general_gradcheck(bias):
    """gradcheck in float64 of the Triton forward against the recompute backward (residual off, D_in ≠ D_out)."""
    small = _to(_inputs(B=1, H=1, W=3, D=5, hid=4, momentum=True, seed=13, DO=3), torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda *z: mc.mlp_chunk_step(*z, activation="gelu", residual=False, bias=bias),
                                    small, fast_mode=True, atol=1e-6, rtol=1e-5)


def _deep_parts(bias="l2", optimizer="gd", c=4, feature_map="polynomial", retention="decay", d=4, hidden=8,
                act="gelu", b=8, lr=0.2):
    """An ATLAS-family memory: ``mlp`` depth 2, residual off, polynomial (or Taylor φ*) map, d = 4 → D_in = 15;
    ``lr``: the inner step (η = lr · the lr gate; lr alone without one). A step ≳ 0.5 makes it diverge."""
    torch.manual_seed(0)
    fm = {"name": "polynomial", "degree": 2} if feature_map == "polynomial" else {"name": "exp", "mode": "auto",
                                                                                 "degree": 2}
    spec = {"memory": {"name": "mlp", "depth": 2, "residual": False, "activation": act,
                       "expansion": hidden / ((d + 1) * (d + 2) / 2)},
            "attentional_bias": bias, "feature_map": fm, "inner_optimizer": {"name": optimizer, "lr": lr},
            "retention": retention,
            "window": {"name": "omega", "size": c}, "chunk_size": b}
    parts = build_memory(spec, 2, d, d)
    assert parts.memory.in_dim == (d + 1) * (d + 2) // 2 and parts.memory.hidden == hidden
    for name, p in parts.named_parameters():
        if name.startswith("memory."):
            torch.nn.init.normal_(p, std=0.3)
    return parts


def _deep_step_args(parts, dtype, mom, W, seed=14):
    ins = _inputs(B=2, H=2, W=W, D=parts.memory.in_dim, hid=parts.memory.hidden, momentum=mom, seed=seed,
                  DO=parts.value_dim)
    x, v, W1, W2, S1, S2, P, Q, A, Th, S = (None if z is None else z.to(DEVICE, dtype) for z in ins)
    return parts, {"W1": W1, "W2": W2}, ({"W1": S1, "W2": S2} if mom else None), x, v, None, P, Q, A, Th, S


STEP_CASES = [("l2", "gd", 4), ("l2", "momentum", 4), ("dot", "gd", 1), ("dot", "momentum", 4)]


@pytest.mark.parametrize("bias, optimizer, c", STEP_CASES)
def test_general_step_matches_dual_step(bias, optimizer, c):
    """The reference equals ``gradient_factors`` + ``_dual_step`` in float64, and ``mlp_dual_step`` (the kernels)
    equals ``_dual_step`` in float32, for the built ATLAS-family memory (W = c − 1 + b window tokens)."""
    mom = optimizer == "momentum"
    parts = _deep_parts(bias, optimizer, c).to(DEVICE)
    W = c - 1 + 8
    args64 = _deep_step_args(parts.double(), torch.float64, mom, W)
    f_r, w_r, m_r = chunked._dual_step(*args64)
    _, Wt, St, x, v, _, P, Q, A, Th, Se = args64
    ref = mc.mlp_chunk_reference(x, v, Wt["W1"], Wt["W2"], St["W1"] if mom else None, St["W2"] if mom else None,
                                 P, Q, A, Th, Se, activation="gelu", residual=False, bias=bias)
    want = (f_r["W1"][0], f_r["W2"][0], f_r["W2"][1], w_r["W1"], w_r["W2"], *((m_r["W1"], m_r["W2"]) if mom
                                                                               else (None, None)))
    for name, got, w in zip(OUTS, ref, want):
        assert (got is None) == (w is None), name
        if w is not None:
            assert rms_ratio(got, w) < 1e-12, name

    parts = parts.float()
    args = _deep_step_args(parts, torch.float32, mom, W)
    assert tk.select_mlp_step(parts, args[3]) is tk.mlp_dual_step
    f_t, w_t, m_t = tk.mlp_dual_step(*args)
    f_r, w_r, m_r = chunked._dual_step(*args)
    assert list(f_t) == list(f_r) == ["W1", "W2"]
    for n in f_r:
        for got, w in zip(f_t[n], f_r[n]):
            assert got.shape == w.shape and rms_ratio(got.double(), w.double()) < 1e-5, n
        assert rms_ratio(w_t[n].double(), w_r[n].double()) < 1e-5, n
        if mom:
            assert rms_ratio(m_t[n].double(), m_r[n].double()) < 1e-5, n
    assert m_t is None if not mom else True


E2E_CASES = {   # name: (bias, optimizer, c, feature map, retention, gates, lr)
    "omeganet": ("l2", "gd", 4, "polynomial", "decay", ("lr", "window", "retention"), 0.2),
    "dla": ("dot", "gd", 1, "polynomial", "decay", ("lr", "window", "retention"), 0.2),
    "swdt": ("dot", "gd", 4, "exp", "decay", ("lr", "window", "retention"), 0.2),
    "deeptransformer": ("dot", "gd", 1, "exp", "none", ("window",), 0.2),    # constant η (no lr gate)
    "dot": ("l2", "gd", 4, "exp", "none", ("window",), 0.05),
    "momentum": ("l2", "momentum", 2, "polynomial", "decay", ("lr", "window", "momentum", "retention"), 0.2),
}


def _memorize_run(parts, data, dtype, mode, b, calls_of=(11, 9)):
    """``memorize`` in ``dtype`` over two chained calls (T = 11 + 9: the first ends mid-chunk, the second starts
    there) → (o, final state, gradients of q, k, v, every gate and every parameter of ``parts``)."""
    parts = copy.deepcopy(parts).to(DEVICE, dtype)
    (q, k, v), gates = data
    q, k, v = (z.to(DEVICE, dtype).requires_grad_() for z in (q, k, v))
    gates = {n: z.to(DEVICE, dtype).requires_grad_() for n, z in gates.items()}
    leaves = [q, k, v, *gates.values(), *parts.parameters()]
    outs, state, t0 = [], None, 0
    for T in calls_of:
        piece = [z[:, t0:t0 + T] for z in (q, k, v)]
        o, state = memorize(*piece, parts, {n: g[:, t0:t0 + T] for n, g in gates.items()}, mode=mode,
                            chunk_size=b, initial_state=state)
        outs.append(o)
        t0 += T
    o = torch.cat(outs, 1)
    g = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum()
    finals = [*state.weights.values(), *(state.momentum or {}).values()]
    for z in finals:
        loss = loss + (z * torch.randn(z.shape, generator=g, dtype=torch.float64).to(z)).sum()
    return o, finals, torch.autograd.grad(loss, leaves), [n for n, _ in parts.named_parameters()]


@pytest.mark.parametrize("name", list(E2E_CASES))
def test_memorize_triton_atlas_family_matches_recurrent(name, monkeypatch):
    """``memorize(mode="triton")`` (fp32; the fused step in ``chunked``'s dual form) vs ``memorize(mode="recurrent")``
    (float64 token loop) for an ATLAS-family memory (residual off, D_in = 15 ≠ D_out = 4, hidden 8), b = 8, T = 11 +
    9 in two chained calls (partial chunks at both ends, the second call continuing from the first's state):
    outputs, final weights (and momenta) and the gradients of q, k, v, every gate, the learned initial W1, W2 and
    the polynomial coefficients."""
    bias, optimizer, c, fm, retention, gate_names, lr = E2E_CASES[name]
    parts = _deep_parts(bias, optimizer, c, fm, retention, lr=lr)
    q, k, v = random_qkv(2, 20, 2, 4, seed=15)
    gates = random_gates(2, 20, 2, seed=16, names=gate_names, low=0.5, high=0.95)
    data = ((q, k, v), gates)
    calls, fused = [], tk.mlp_dual_step

    def counted(*args):
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(tk, "mlp_dual_step", counted)
    o_t, s_t, g_t, names = _memorize_run(parts, data, torch.float32, "triton", 8)
    assert len(calls) == 3, "the fused step did not run once per aligned chunk (8 + 3 tokens, then 4 after the join)"
    o_r, s_r, g_r, _ = _memorize_run(parts, data, torch.float64, "recurrent", 8)
    assert rms_ratio(o_t.double(), o_r) <= TOL
    for a, r in zip(s_t, s_r):
        assert rms_ratio(a.double(), r) <= TOL
    labels = ["q", "k", "v", *gate_names, *names]
    assert "memory.init_W1" in labels and (fm != "polynomial" or "feature_map.rho" in labels), labels
    for label, a, r in zip(labels, g_t, g_r):
        assert torch.isfinite(a).all() and rms_ratio(a.double(), r) <= TOL, label


PRESETS_ON_STEP = ("dla",)
# LayerNorm on the memory's read (tests/models/test_memory_stability.py) is not in the fused step yet: these run the
# chunked torch engine under mode: triton, and say why
PRESETS_OFF_STEP = ("omeganet", "swdt", "deeptransformer", "dot")


def test_presets_select_the_fused_step():
    """The ATLAS-family presets now get the fused step: their memory parts, built as the layer does,
    pass :func:`spec_reason`, and ``select_mlp_step`` returns the step for fp32 inputs."""
    from atlaslab.models.presets import load_preset
    for preset in PRESETS_ON_STEP:
        cfg = load_preset(preset)
        (m,) = cfg.mixers.values()
        H = m.num_heads
        D = cfg.d_model // H
        parts = build_memory(m.memory, H, D, D)
        assert tk.mlp_reason(parts) is None, (preset, tk.mlp_reason(parts))
        assert chunked.uses_dual_form(parts, None) and parts.window.size is not None, preset
        q = torch.zeros(1, 8, H, D, device=DEVICE)
        assert tk.select_mlp_step(parts, q) is tk.mlp_dual_step, preset
    for preset in PRESETS_OFF_STEP:
        cfg = load_preset(preset)
        (m,) = cfg.mixers.values()
        parts = build_memory(m.memory, m.num_heads, cfg.d_model // m.num_heads, cfg.d_model // m.num_heads)
        assert "layer norm" in (tk.mlp_reason(parts) or ""), (preset, tk.mlp_reason(parts))
