"""The hand-written-backward fast paths of the dual form against their autograd references, in float64:

- ``mlp_step.MLPDualStep`` (one chunk's gradient factors and end state of the MLP memory) against
  ``chunked._dual_step`` (``gradient_factors`` + ``_dual_end``): outputs and the gradients of every input — the
  window inputs x and targets v, the coefficient rows (what the gates η, α, θ, γ reach), the anchor weights and
  momenta (so the learned initial memory) and the LayerNorm affine — through the inner update (second order);
- ``mlp_step.MLPDualRead`` against ``chunked._dual_read`` (reads through ``DualForm`` weights);
- ``scan.DualCoefficients`` against ``scan.dual_coefficients_reference``;
- ``torch.autograd.gradcheck`` of each Function on tiny shapes;
- the chunked engine routes the MLP memory to the fast path and keeps the reference elsewhere (the engine-level
  parity of the fast path with the recurrent reference is in test_chunked.py, ``FAST_PATH_SPECS``).
"""
import itertools

import pytest
import torch
from helpers import random_qkv

from atlaslab import memorize
from atlaslab.engines import chunked, mlp_step
from atlaslab.engines.scan import DualCoefficients, dual_coefficients, dual_coefficients_reference
from atlaslab.memory import build_memory

B, H, D, n, b = 2, 2, 3, 5, 4
TOL = 1e-12


def _parts(depth=2, act="gelu", residual=True, layer_norm=False, bias="l2", optimizer="gd", name="mlp"):
    spec = {"memory": {"name": name, "depth": depth, "activation": act, "residual": residual,
                       "layer_norm": layer_norm, "expansion": 2},
            "attentional_bias": bias, "retention": "decay", "inner_optimizer": optimizer, "chunk_size": b}
    torch.manual_seed(0)
    parts = build_memory(spec, H, D, D).double()
    with torch.no_grad():
        for n_, p in parts.named_parameters():      # LN affine off its (1, 0) start so its gradients are exercised
            if n_.startswith("memory.ln_"):
                p.add_(0.3 * torch.randn_like(p))
    return parts


def _step_inputs(parts, mom: bool, seed=0):
    """Leaves of one chunk step: x, v [B, H, n, D], the coefficient rows, anchor weights / momenta [B, H, ...]."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, low=None):
        t = torch.rand(*shape, generator=g, dtype=torch.float64) if low is not None else \
            torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return (low + (1 - low) * t if low is not None else t).requires_grad_(True)

    shapes = parts.memory.shapes()
    x, v = r(B, H, n, D), r(B, H, n, D)
    W = {k: r(B, H, *s, scale=0.5) for k, s in shapes.items()}
    S = {k: r(B, H, *s, scale=0.3) for k, s in shapes.items()} if mom else None
    P_e, A_e = r(B, H, low=0.5), r(B, H, n, scale=0.3)
    Q_e, Th_e, S_e = (r(B, H, low=0.5), r(B, H, low=0.5), r(B, H, n, scale=0.3)) if mom else (None, None, None)
    return x, v, W, S, P_e, Q_e, A_e, Th_e, S_e


def _leaves(parts, x, v, W, S, *coefs):
    return [x, v, *W.values(), *(S.values() if S else []), *(c for c in coefs if c is not None),
            *(p for p in parts.parameters() if p.requires_grad)]


def _step_loss(factors, new_w, new_s, seed=3):
    """A random linear functional of every output of the step (factors, end weights and momenta)."""
    g = torch.Generator().manual_seed(seed)
    outs = [t for pair in factors.values() for t in pair] + list(new_w.values()) + list((new_s or {}).values())
    return sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in outs)


def _close(a, r):
    if r is None:
        return a is None or a.abs().max() == 0
    return a is not None and (a - r).abs().max() <= TOL * max(1.0, r.abs().max().item())


STEP_CASES = [
    # depth, activation, residual, layer_norm, bias, optimizer
    (2, "gelu", True, True, "l2", "momentum"),      # Titans (mlp_ln)
    (2, "gelu", False, True, "l2", "gd"),           # OmegaNet
    (2, "gelu", False, False, "l2", "gd"),          # ATLAS without Muon
    (2, "silu", True, False, "l2", "momentum"),
    (1, "gelu", True, False, "l2", "gd"),           # TTT-Linear's f_res
    (3, "tanh", False, True, "l2", "momentum"),
    (3, "relu", True, False, "l2", "gd"),
    (2, "silu", False, True, "dot", "momentum"),
    (2, "gelu", True, False, "dot", "gd"),
]


@pytest.mark.parametrize("depth, act, residual, ln, bias, opt", STEP_CASES)
def test_mlp_dual_step_equals_the_autograd_step(depth, act, residual, ln, bias, opt):
    parts = _parts(depth, act, residual, ln, bias, opt)
    assert mlp_step.supports(parts, torch.float64) is None
    mom = opt == "momentum"
    x, v, W, S, P_e, Q_e, A_e, Th_e, S_e = _step_inputs(parts, mom)
    leaves = _leaves(parts, x, v, W, S, P_e, Q_e, A_e, Th_e, S_e)
    results = []
    for step in (chunked._dual_step, mlp_step.dual_step):
        factors, new_w, new_s = step(parts, W, S, x, v, None, P_e, Q_e, A_e, Th_e, S_e)
        grads = torch.autograd.grad(_step_loss(factors, new_w, new_s), leaves, allow_unused=True)
        results.append((factors, new_w, new_s, grads))
    (f_r, w_r, s_r, g_r), (f_f, w_f, s_f, g_f) = results
    assert list(f_f) == list(f_r) == [f"W{i + 1}" for i in range(depth)]
    for name in f_r:
        assert _close(f_f[name][0], f_r[name][0]) and _close(f_f[name][1], f_r[name][1])
        assert _close(w_f[name], w_r[name])
        if mom:
            assert _close(s_f[name], s_r[name])
    assert s_f is None if not mom else True
    for a, r in zip(g_f, g_r):
        assert _close(a, r)
    # the gradients really pass through the inner update (second order): the anchor weights get one
    assert g_r[2].abs().max() > 0


@pytest.mark.parametrize("depth, act, residual, ln, bias, opt", STEP_CASES[:4] + STEP_CASES[5:6])
def test_mlp_dual_read_equals_the_dual_form_read(depth, act, residual, ln, bias, opt):
    parts = _parts(depth, act, residual, ln, bias, opt)
    mom = opt == "momentum"
    g = torch.Generator().manual_seed(5)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_(True)

    shapes = parts.memory.shapes()
    W = {k: r(B, H, *s, scale=0.5) for k, s in shapes.items()}
    S = {k: r(B, H, *s, scale=0.3) for k, s in shapes.items()} if mom else None
    lefts = {k: r(B, H, n, s[0], scale=0.5) for k, s in shapes.items()}
    rights = {k: r(B, H, n, s[1], scale=0.5) for k, s in shapes.items()}
    P, A, xq = r(B, H, b), r(B, H, b, n, scale=0.3), r(B, H, b, D)
    Q = r(B, H, b) if mom else None
    leaves = [xq, P, A, *W.values(), *lefts.values(), *rights.values(), *(S.values() if mom else []),
              *([Q] if mom else []), *parts.parameters()]
    weight = torch.randn(B, H, b, D, generator=g, dtype=torch.float64)
    outs = []
    for read in (chunked._dual_read, lambda *a: mlp_step.dual_read(*a, parts=parts)):
        y = read(parts.memory, W, S, P, Q, A, lefts, rights, xq)
        outs.append((y, torch.autograd.grad((y * weight).sum(), leaves, allow_unused=True)))
    (y_r, g_r), (y_f, g_f) = outs
    assert _close(y_f, y_r)
    for a, r_ in zip(g_f, g_r):
        assert _close(a, r_)


@pytest.mark.parametrize("act, ln, mom", [("gelu", True, True), ("silu", False, False), ("tanh", True, False)])
def test_mlp_dual_step_gradcheck(act, ln, mom):
    """gradcheck of the step's hand-written backward (every output, every differentiable input)."""
    parts = _parts(2, act, not ln, ln, "l2", "momentum" if mom else "gd")
    x, v, W, S, P_e, Q_e, A_e, Th_e, S_e = _step_inputs(parts, mom, seed=1)
    ln_w, ln_b = (parts.memory.ln_weight, parts.memory.ln_bias) if ln else (None, None)
    cfg = mlp_step._cfg(parts, mom)
    ws = [*W.values(), *(S.values() if mom else [])]
    coefs = [P_e, Q_e, A_e, Th_e, S_e]
    inputs = [x, v, *coefs, ln_w, ln_b, *ws]
    idx = [i for i, t in enumerate(inputs) if t is not None]

    def fn(*ts):
        full = list(inputs)
        for i, t in zip(idx, ts):
            full[i] = t
        return mlp_step.MLPDualStep.apply(cfg, *full)

    assert torch.autograd.gradcheck(fn, tuple(inputs[i] for i in idx))


@pytest.mark.parametrize("ln, mom", [(True, True), (False, False)])
def test_mlp_dual_read_gradcheck(ln, mom):
    parts = _parts(2, "gelu", not ln, ln, "l2", "momentum" if mom else "gd")
    g = torch.Generator().manual_seed(9)
    shapes = list(parts.memory.shapes().values())

    def r(*shape):
        return (0.5 * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_(True)

    ts = [r(B, H, *s) for s in shapes] + ([r(B, H, *s) for s in shapes] if mom else []) + \
        [r(B, H, n, s[0]) for s in shapes] + [r(B, H, n, s[1]) for s in shapes]
    ln_w, ln_b = (parts.memory.ln_weight, parts.memory.ln_bias) if ln else (None, None)
    inputs = [r(B, H, b, D), r(B, H, b), r(B, H, b) if mom else None, r(B, H, b, n), ln_w, ln_b, *ts]
    idx = [i for i, t in enumerate(inputs) if t is not None]
    cfg = mlp_step._cfg(parts, mom)

    def fn(*xs):
        full = list(inputs)
        for i, t in zip(idx, xs):
            full[i] = t
        return mlp_step.MLPDualRead.apply(cfg, *full)

    assert torch.autograd.gradcheck(fn, tuple(inputs[i] for i in idx))


@pytest.mark.parametrize("mom", [False, True])
def test_dual_coefficients_equal_the_reference(mom):
    g = torch.Generator().manual_seed(2)
    a = 0.5 + 0.5 * torch.rand(B, H, 3, b, generator=g, dtype=torch.float64)
    a[0, 0, 1, 2] = 0.0                        # a factor of exactly 0 (clamped to tiny in the log: zero gradient)
    a.requires_grad_(True)
    theta = (0.5 + 0.5 * torch.rand(B, H, 3, b, generator=g, dtype=torch.float64)).requires_grad_(True) \
        if mom else None
    write = torch.randn(B, H, 3, b, n, generator=g, dtype=torch.float64, requires_grad=True)
    leaves = [t for t in (a, theta, write) if t is not None]
    res = []
    for fn in (dual_coefficients_reference, dual_coefficients):
        outs = fn(a, theta, write)
        assert (outs[1] is None) == (not mom) and (outs[3] is None) == (not mom)
        live = [t for t in outs if t is not None]
        w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=t.dtype)
             for i, t in enumerate(live)]
        res.append((live, torch.autograd.grad(sum((t * u).sum() for t, u in zip(live, w)), leaves)))
    (o_r, g_r), (o_f, g_f) = res
    for x, y in itertools.chain(zip(o_f, o_r), zip(g_f, g_r)):
        assert torch.isfinite(x).all() and _close(x, y)
    assert g_f[0][0, 0, 1, 2] == 0


def test_dual_coefficients_gradcheck():
    g = torch.Generator().manual_seed(4)
    a = (0.5 + 0.5 * torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    th = (0.5 + 0.5 * torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a_, w_: DualCoefficients.apply(a_, None, w_), (a, w))
    assert torch.autograd.gradcheck(lambda a_, t_, w_: DualCoefficients.apply(a_, t_, w_), (a, th, w))


def _graph_nodes(t):
    seen, stack = set(), [t.grad_fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        stack.extend(nx for nx, _ in f.next_functions)
    return {type(f).__name__ for f in seen}


@pytest.mark.parametrize("spec, fast", [
    ({"memory": "mlp_ln", "inner_optimizer": "momentum", "retention": "decay"}, True),
    ({"memory": {"name": "mlp", "residual": False, "layer_norm": True}, "feature_map": "polynomial",
      "window": {"size": 3}, "retention": "decay"}, True),
    ({"memory": "mlp", "attentional_bias": "huber", "retention": "decay"}, False),   # bias not covered
    ({"memory": "gated_mlp", "retention": "decay"}, False),                          # memory not covered
])
def test_chunked_engine_routes_to_the_fast_path_only_where_it_applies(spec, fast):
    parts = build_memory({**spec, "chunk_size": 4}, H, D, D).double()
    assert (mlp_step.supports(parts, torch.float64) is None) == fast
    q, k, v = random_qkv(B, 9, H, D, requires_grad=True)
    gates = {"lr": torch.full((B, 9, H), 0.3, dtype=torch.float64),
             "retention": torch.full((B, 9, H), 0.9, dtype=torch.float64)}
    if parts.attentional_bias.uses_delta:
        gates["delta"] = torch.ones(B, 9, H, dtype=torch.float64)
    if parts.inner_optimizer.has_momentum:
        gates["momentum"] = torch.full((B, 9, H), 0.8, dtype=torch.float64)
    gates = {k_: g.requires_grad_(True) for k_, g in gates.items()}
    o, _ = memorize(q, k, v, parts, gates, mode="chunked")
    nodes = _graph_nodes(o)
    assert ("MLPDualStepBackward" in nodes and "MLPDualReadBackward" in nodes) == fast
    assert "DualCoefficientsBackward" in nodes
    # half precision keeps the reference
    assert mlp_step.supports(parts, torch.bfloat16) is not None
