"""Variable-length batches (``cu_seqlens``) on the momentum chunk kernel (atlaslab/kernels/momentum/chunk.py),
under TRITON_INTERPRET=1.

Packed sequences ``[1, total_T, H, D]`` of awkward lengths for the semantic chunk b (1, b − 1, b, b + 3, 2b + 1, an
empty one) run natively — the chunk-index table of :mod:`.chunk`, one launch per stage — and every sequence is its own
call (M and S restart from its own initial state, its chunks start at its first token). They must equal each sequence
run alone: through the float64 reference :func:`momentum_chunk_reference` for ℓ2 / dot, read token / chunk, decay
after / before the step and no decay, and through ``memorize(mode="recurrent")`` (the token loop) for before_step —
outputs, per-sequence final memory, momentum and anchor ``[N, H, D_v, D_k]``, and the gradients of q, k, v, β, θ, α
and the per-sequence initial memory and momentum (RMS-error ratio ≤ 1e-3 in fp32). Every kernel is launched once per
forward / backward (launches counted); the packed kernels equal the dense kernels run sequence by sequence.

Kernel allocations are NaN-poisoned (conftest). Shapes are tiny (the interpreter is slow).
"""
import dataclasses

import pytest
import torch
from helpers import count_launches, require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab import memorize  # noqa: E402
from atlaslab.memory import build_memory  # noqa: E402
from atlaslab.engines import initial_state  # noqa: E402
from atlaslab.kernels.momentum import chunk as cm  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)
NAMES = ("q", "k", "v", "beta", "theta", "alpha", "m0", "s0")
#: every stage once per forward; the backward re-runs stages 1-2, then its two kernels
LAUNCHES = {"_mom_coef_kernel": 2, "_mom_state_kernel": 2, "_mom_out_kernel": 1, "_mom_bwd_state_kernel": 1,
            "_mom_bwd_grad_kernel": 1}


@pytest.fixture
def launches(monkeypatch):
    """Counts launches per momentum kernel."""
    return count_launches(monkeypatch, cm, lambda name: name.startswith("_mom"))


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)


def _inputs(lens, H=2, K=8, V=8, seed=0, decay=True):
    """fp32 packed q, k, v [1, T, H, ·], β, θ, α [1, T, H] (α None without decay) and m0, s0 [N, H, V, K]."""
    T, N = sum(lens), len(lens)
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    beta, theta, alpha = (lo + (0.95 - lo) * torch.rand(1, T, H, generator=g, dtype=torch.float64)
                          for lo in (0.2, 0.5, 0.6))
    m0, s0 = (0.4 * torch.randn(N, H, V, K, generator=g, dtype=torch.float64) for _ in range(2))
    x = [q, k, v, beta, theta, alpha if decay else None, m0, s0]
    return [t.to(device=DEVICE, dtype=torch.float32) if t is not None else None for t in x]


def _reference_per_sequence(x, cu, opts):
    """Each sequence alone (B = 1, no cu_seqlens) through the float64 reference, packed like the kernel's results."""
    q, k, v, beta, theta, alpha, m0, s0 = x
    bounds = cu.tolist()
    outs = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e == s:          # an empty sequence: no output, its states stay the initial ones
            outs.append((v[:, s:e], m0[n:n + 1], s0[n:n + 1], m0[n:n + 1]))
            continue
        outs.append(cm.momentum_chunk_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], theta[:, s:e], alpha[:, s:e] if alpha is not None else None,
            m0[n:n + 1], s0[n:n + 1], **opts))
    return tuple(torch.cat([o[i] for o in outs], 1 if i == 0 else 0) for i in range(4))


def _recurrent_per_sequence(x, cu, opts):
    """Each sequence alone through ``memorize(mode="recurrent")`` (float64 token loop) from its own initial memory and
    momentum: → packed (o, M_T, S_T, anchor)."""
    q, k, v, beta, theta, alpha, m0, s0 = x
    H, V, K = m0.shape[1:]
    retention = {"name": "decay", "placement": opts["placement"]} if alpha is not None else "none"
    spec = {"memory": "linear", "inner_optimizer": "momentum", "attentional_bias": opts["bias"],
            "retention": retention, "read": opts["read"]}
    parts = build_memory(spec, H, K, V).double().to(DEVICE)
    bounds = cu.tolist()
    outs = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        st = initial_state(parts, 1, torch.float64, q.device)
        st = dataclasses.replace(st, weights={"W": m0[n:n + 1]}, anchor={"W": m0[n:n + 1]},
                                 momentum={"W": s0[n:n + 1]})
        gates = {"lr": beta[:, s:e], "momentum": theta[:, s:e]}
        if alpha is not None:
            gates["retention"] = alpha[:, s:e]
        o, st = memorize(q[:, s:e], k[:, s:e], v[:, s:e], parts, gates, mode="recurrent",
                         chunk_size=opts["chunk_size"], initial_state=st)
        outs.append((o, st.weights["W"], st.momentum["W"], st.anchor["W"]))
    return tuple(torch.cat([o[i] for o in outs], 1 if i == 0 else 0) for i in range(4))


def _packed_vs_separate(x, cu, opts, separately=_reference_per_sequence, seed=7):
    """chunk_momentum on the packed batch (fp32) vs every sequence alone (float64): RMS-error ratios of the four
    results and of every input's gradient (the loss reads the output, final memory, momentum and anchor)."""
    leaves = [t.clone().requires_grad_() if t is not None else None for t in x]
    refs = [t.detach().double().requires_grad_() if t is not None else None for t in x]
    out = cm.chunk_momentum(*leaves, cu_seqlens=cu, **opts)
    ref = separately(refs, cu, opts)
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(DEVICE) for r in ref]
    sum((o * wi.to(o)).sum() for o, wi in zip(out, w)).backward()
    sum((r * wi).sum() for r, wi in zip(ref, w)).backward()
    ratios = {}
    for name, a, r in zip(("o", "M_T", "S_T", "anchor"), out, ref):
        assert a.shape == r.shape and torch.isfinite(a).all(), name
        ratios[name] = rms_ratio(a.double(), r)
    for name, a, r in zip(NAMES, leaves, refs):
        if a is None:
            continue
        assert a.grad is not None and torch.isfinite(a.grad).all(), name
        ratios["d" + name] = rms_ratio(a.grad.double(), r.grad)
    return ratios


def _assert_ratios(ratios, tol=TOL):
    bad = {n: r for n, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS-error ratios above {tol}: {bad} (all: {ratios})"


CASES = [   # (b, lengths, bias, read, placement, decay)
    (4, [1, 3, 7, 4, 9], "l2", "token", "before_step", True),    # 1, b − 1, b + 3, b, 2b + 1
    (4, [1, 3, 7, 4, 9], "l2", "token", "after_step", True),
    (8, [8, 1, 11, 7], "l2", "chunk", "before_step", True),      # b, 1, b + 3, b − 1
    (4, [6, 0, 2, 5], "dot", "token", "after_step", True),       # an empty sequence
    (8, [3, 12, 1], "l2", "token", "after_step", False),         # no decay (P = 1)
]


@pytest.mark.parametrize("b, lens, bias, read, placement, decay", CASES)
def test_packed_equals_each_sequence_through_the_float64_reference(b, lens, bias, read, placement, decay, launches):
    opts = dict(chunk_size=b, bias=bias, read=read, placement=placement)
    ratios = _packed_vs_separate(_inputs(lens, seed=b + len(lens), decay=decay), _cu(lens), opts)
    _assert_ratios(ratios)
    assert dict(launches) == LAUNCHES, launches     # one launch per stage for all sequences


@pytest.mark.parametrize("b, lens, read", [(4, [1, 3, 7, 4, 9], "token"), (4, [1, 3, 7, 4, 9], "chunk"),
                                           (8, [1, 7, 11, 8], "token")])
def test_packed_before_step_equals_each_sequence_through_the_token_loop(b, lens, read, launches):
    """Against ``memorize(mode="recurrent")`` per sequence, from nonzero initial memories AND momenta (so their
    gradients, and those of η = β, θ, α, are checked against the token loop itself)."""
    opts = dict(chunk_size=b, bias="l2", read=read, placement="before_step")
    ratios = _packed_vs_separate(_inputs(lens, H=1, seed=11), _cu(lens), opts, separately=_recurrent_per_sequence)
    _assert_ratios(ratios)
    assert dict(launches) == LAUNCHES, launches


def test_packed_kernels_equal_the_dense_kernels_sequence_by_sequence():
    lens = [9, 2, 4]
    x = _inputs(lens, seed=3)
    q, k, v, beta, theta, alpha, m0, s0 = x
    cu = _cu(lens)
    opts = dict(chunk_size=4, bias="l2", read="token", placement="before_step")
    out = cm.chunk_momentum_forward(*x, cu_seqlens=cu, **opts)
    bounds = cu.tolist()
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        dense = cm.chunk_momentum_forward(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], theta[:, s:e],
                                          alpha[:, s:e], m0[n:n + 1], s0[n:n + 1], **opts)
        assert rms_ratio(out[0][:, s:e].double(), dense[0].double()) <= 1e-6
        for a, d in zip(out[1:], dense[1:]):
            assert rms_ratio(a[n:n + 1].double(), d.double()) <= 1e-6


def test_chunk_coefficients_restart_at_every_sequence():
    """The torch stage 1 (the gates' backward) chunks each packed sequence from its first token."""
    lens = [5, 1, 6]
    _, _, _, beta, theta, alpha, _, _ = _inputs(lens, seed=4)
    packed = cm.chunk_coefficients(beta, theta, alpha, 4, cu_seqlens=_cu(lens))
    bounds = _cu(lens).tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        alone = cm.chunk_coefficients(beta[:, s:e], theta[:, s:e], alpha[:, s:e], 4)
        for a, r in zip(packed, alone):
            assert torch.equal(a[:, s:e], r)


def test_cu_seqlens_argument_checks():
    x = _inputs([3, 4])
    opts = dict(chunk_size=4, bias="l2", placement="after_step", read="token")
    with pytest.raises(ValueError, match="B = 1"):
        cm.chunk_momentum(*[torch.cat([t, t]) for t in x[:6]], *x[6:], cu_seqlens=_cu([3, 4]), **opts)
    with pytest.raises(ValueError, match="offsets"):
        cm.chunk_momentum(*x, cu_seqlens=_cu([3, 3]), **opts)
    with pytest.raises(ValueError, match="initial_state"):
        cm.chunk_momentum(*x, cu_seqlens=_cu([3, 2, 2]), **opts)
