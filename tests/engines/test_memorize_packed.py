"""Packed variable-length batches through ``memorize(..., cu_seqlens=...)`` (atlaslab/engines/packed.py).

The definition: a packed call equals every sequence run alone (its own initial state, chunks counted from its own
first token, a window that never reaches into the sequence before it). Checked for the torch engines on specs that
exercise each piece of state (chunked momentum, mid-chunk ends, Omega windows, channel-wise decay, a deep memory),
for chained packed calls, and — under ``TRITON_INTERPRET=1`` — for ``mode="triton"``, whose kernels run the packed
sequences natively (one kernel call for all of them, counted): outputs, per-sequence final states and the gradients
of q, k, v, the gates and the initial memory against each sequence alone on the float64 ``recurrent`` reference.
"""

import pytest
import torch
from helpers import random_gates, random_qkv, rms_ratio

from atlaslab.memory import build_memory
from atlaslab.engines import initial_state, memorize

LENS = [5, 1, 9]                # a length-1 sequence; with b = 4: partial last chunks
H, D = 2, 4
SPECS = {
    "delta_decay_b4": {"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"},
                       "retention": {"name": "decay"}, "chunk_size": 4},
    "titans_momentum_b4": {"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"},
                           "inner_optimizer": {"name": "momentum", "momentum": 0.8}, "chunk_size": 4},
    "omega_c3_channel": {"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"},
                         "retention": {"name": "decay", "channel_wise": True}, "window": {"size": 3}},
    "mlp_poly_b4": {"memory": {"name": "mlp", "depth": 2, "expansion": 2, "residual": False}, "attentional_bias": {"name": "l2"},
                    "feature_map": {"name": "polynomial", "degree": 2}, "chunk_size": 4},
}


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _data(parts, lens=LENS, seed=0, dtype=torch.float64, requires_grad=False):
    T = sum(lens)
    q, k, v = random_qkv(B=1, T=T, H=H, Dk=D, seed=seed, dtype=dtype, requires_grad=requires_grad)
    names = ["lr"] + (["retention"] if parts.retention.uses_alpha else []) \
        + (["momentum"] if parts.inner_optimizer.has_momentum else []) + (["window"] if parts.window.size != 1 else [])
    gates = random_gates(B=1, T=T, H=H, seed=seed + 1, dtype=dtype, names=names, low=0.5, high=0.95,
                         Dk=D if parts.retention.channel_wise else None)
    if requires_grad:
        gates = {n: g.clone().requires_grad_(True) for n, g in gates.items()}
    return (q, k, v), gates


def _alone(parts, qkv, gates, offsets, mode, states=None, **kw):
    """Every sequence through ``memorize`` on its own → (packed outputs, final states)."""
    outs, finals = [], []
    for i in range(len(offsets) - 1):
        s, e = offsets[i], offsets[i + 1]
        o, st = memorize(*(x[:, s:e] for x in qkv), parts, {n: g[:, s:e] for n, g in gates.items()}, mode=mode,
                         initial_state=None if states is None else states[i], **kw)
        outs.append(o)
        finals.append(st)
    return torch.cat(outs, 1), finals


def _assert_states_equal(a, b, tol, chunk_size=1):
    """Equal states; the anchor only mid-chunk (on a chunk boundary the next token replaces it, and engines differ
    in what they leave there)."""
    assert a.position == b.position
    mid_chunk = a.position % chunk_size != 0
    for field in ("weights", "momentum") + (("anchor",) if mid_chunk else ()):
        da, db = getattr(a, field), getattr(b, field)
        if db is None:
            assert da is None
            continue
        for name in db:
            assert rms_ratio(da[name], db[name]) <= tol, (field, name)
    for field in ("hist_k", "hist_v", "hist_gamma", "chunk_alpha"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape, field
        if y.numel():
            assert torch.allclose(x.double(), y.double(), atol=tol, rtol=tol), field


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("name", list(SPECS))
def test_packed_call_equals_each_sequence_alone(name, mode):
    torch.manual_seed(0)
    parts = build_memory(SPECS[name], H, D, D).double()
    offsets = _offsets(LENS)
    qkv, gates = _data(parts)
    o, states = memorize(*qkv, parts, gates, mode=mode, cu_seqlens=offsets)
    o_ref, ref = _alone(parts, qkv, gates, offsets, mode)
    assert len(states) == len(LENS)
    assert rms_ratio(o, o_ref) < 1e-12
    for st, st_ref in zip(states, ref):
        _assert_states_equal(st, st_ref, 1e-12, parts.chunk_size)


@pytest.mark.parametrize("name", ["titans_momentum_b4", "omega_c3_channel"])
def test_chained_packed_calls_continue_each_sequence(name):
    """A second packed call from the first's states equals each sequence's two calls (mid-chunk, window history)."""
    torch.manual_seed(0)
    parts = build_memory(SPECS[name], H, D, D).double()
    first, second = [3, 2, 6], [4, 5, 1]
    qkv1, g1 = _data(parts, first, seed=0)
    qkv2, g2 = _data(parts, second, seed=5)
    _, states = memorize(*qkv1, parts, g1, mode="chunked", cu_seqlens=torch.tensor(_offsets(first)))
    o, states2 = memorize(*qkv2, parts, g2, mode="chunked", cu_seqlens=_offsets(second), initial_state=states)
    _, ref1 = _alone(parts, qkv1, g1, _offsets(first), "recurrent")
    o_ref, ref2 = _alone(parts, qkv2, g2, _offsets(second), "recurrent", states=ref1)
    assert rms_ratio(o, o_ref) < 1e-10
    for st, st_ref in zip(states2, ref2):
        _assert_states_equal(st, st_ref, 1e-10, parts.chunk_size)


def test_a_batched_initial_state_is_split_per_sequence():
    parts = build_memory(SPECS["delta_decay_b4"], H, D, D).double()
    qkv, gates = _data(parts)
    start = initial_state(parts, len(LENS), torch.float64, "cpu")
    start.weights = {"W": torch.randn_like(start.weights["W"])}
    o, _ = memorize(*qkv, parts, gates, mode="chunked", cu_seqlens=_offsets(LENS), initial_state=start)
    from atlaslab.engines import split_state
    o_ref, _ = _alone(parts, qkv, gates, _offsets(LENS), "recurrent", states=split_state(start))
    assert rms_ratio(o, o_ref) < 1e-12


@pytest.mark.parametrize("cu, match", [
    ([0, 5, 14], "offsets from 0 to T = 15"),
    ([0, 5, 5, 15], "rise strictly"),
    ([1, 15], "offsets from 0"),
    (torch.tensor([0.0, 15.0]), "integer tensor"),
])
def test_bad_cu_seqlens_is_refused_with_the_field_named(cu, match):
    parts = build_memory(SPECS["delta_decay_b4"], H, D, D).double()
    qkv, gates = _data(parts, [15])
    with pytest.raises(ValueError, match="cu_seqlens") as err:
        memorize(*qkv, parts, gates, cu_seqlens=cu)
    assert match in str(err.value)


def test_packed_inputs_must_have_batch_one_and_one_state_per_sequence():
    parts = build_memory(SPECS["delta_decay_b4"], H, D, D).double()
    q, k, v = random_qkv(B=2, T=6, H=H, Dk=D)
    with pytest.raises(ValueError, match="batch 1"):
        memorize(q, k, v, parts, cu_seqlens=[0, 2, 6])
    qkv, gates = _data(parts, [2, 4])
    with pytest.raises(ValueError, match="one per sequence"):
        memorize(*qkv, parts, gates, cu_seqlens=[0, 2, 6], initial_state=[initial_state(parts, 1, torch.float64,
                                                                                          "cpu")])


# ---------------------------------------------------------------------------------------------- Triton, natively
TRITON_SPECS = {
    "gdn_c1": {"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"}, "retention": {"name": "decay"}},
    "gla_dot_c1": {"memory": {"name": "linear"}, "attentional_bias": {"name": "dot"},
                   "retention": {"name": "decay", "channel_wise": True}},
    "omega_c2": {"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"}, "retention": {"name": "decay"},
                 "window": {"size": 2}},
    "titans_momentum_b4": SPECS["titans_momentum_b4"],
    "titans_decay_before_b4": {**SPECS["titans_momentum_b4"],
                               "retention": {"name": "decay", "placement": "before_step"}},
    "titans_channel_b4": {**SPECS["titans_momentum_b4"], "retention": {"name": "decay", "channel_wise": True}},
}
#: which kernel module / function a native packed call reaches, per spec and kind
KERNEL_CALLS = {"chunk": ("delta_rule.chunk", "chunk_delta_rule"),
                "fused_recurrent": ("delta_rule.fused_recurrent", "fused_recurrent_delta_rule"),
                "chunk_window": ("window_rule.chunk", "chunk_window_rule"),
                "fused_recurrent_window": ("window_rule.fused_recurrent", "fused_recurrent_window_rule"),
                "chunk_momentum": ("momentum.chunk", "chunk_momentum")}


def _triton():
    from helpers import require_triton
    return require_triton()


@pytest.mark.parametrize("name, kind", [(n, k) for n in TRITON_SPECS for k in ("fused_recurrent", "chunk")
                                         if k == "chunk" or not n.startswith("titans")])   # momentum: chunk only
def test_triton_runs_packed_sequences_natively(name, kind, monkeypatch, poison_empty):
    """(Packed momentum calls run natively on the chunk kernel only; short ones loop per sequence.)"""
    tk = _triton()
    import importlib
    spec = TRITON_SPECS[name]
    momentum = name.startswith("titans")
    window = "window" in spec
    monkeypatch.setattr(tk, "RECURRENT_MAX_T", 64 if kind == "fused_recurrent" else 4)
    key = "chunk_momentum" if momentum else kind + ("_window" if window else "")
    module_name, fn_name = KERNEL_CALLS[key]
    module = importlib.import_module(f"atlaslab.kernels.{module_name}")
    calls = []
    real = getattr(module, fn_name)

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, fn_name, spy)

    torch.manual_seed(0)
    parts64 = build_memory(spec, H, D, D).double()
    for p in parts64.parameters():
        torch.nn.init.normal_(p, std=0.3)
    parts32 = build_memory(spec, H, D, D)
    parts32.load_state_dict({n: p.float() for n, p in parts64.state_dict().items()})
    lens = [6, 1, 11]
    offsets = _offsets(lens)
    qkv64, g64 = _data(parts64, lens, requires_grad=True)
    qkv32 = [x.detach().float().requires_grad_(True) for x in qkv64]
    g32 = {n: g.detach().float().requires_grad_(True) for n, g in g64.items()}

    o, states = memorize(*qkv32, parts32, g32, mode="triton", cu_seqlens=offsets)
    assert len(calls) == 1 and calls[0].tolist() == offsets        # one kernel call for all sequences
    o_ref, ref = _alone(parts64, qkv64, g64, offsets, "recurrent")
    assert rms_ratio(o.double(), o_ref) <= 1e-3
    for st, st_ref in zip(states, ref):
        _assert_states_equal(st, st_ref, 1e-3, parts64.chunk_size)

    w = torch.randn_like(o_ref)
    final_w = sum(s.weights["W"].sum() for s in ref)
    loss_ref = (o_ref * w).sum() + final_w
    loss = (o.double() * w).sum() + sum(s.weights["W"].double().sum() for s in states)
    inputs64 = list(qkv64) + list(g64.values()) + list(parts64.parameters())
    inputs32 = list(qkv32) + list(g32.values()) + list(parts32.parameters())
    grads_ref = torch.autograd.grad(loss_ref, inputs64, allow_unused=True)
    grads = torch.autograd.grad(loss, inputs32, allow_unused=True)
    for i, (gr, gk) in enumerate(zip(grads_ref, grads)):
        if gr is None:
            continue
        assert gk is not None, i
        assert rms_ratio(gk.double(), gr) <= 1e-3, i


def test_triton_window_with_history_loops_per_sequence(monkeypatch, poison_empty):
    """A packed window call whose sequences carry history cannot be gathered natively: it runs each sequence alone
    (and still equals the reference)."""
    tk = _triton()
    parts = build_memory(TRITON_SPECS["omega_c2"], H, D, D)
    first, second = [3, 4], [2, 5]
    qkv1, g1 = _data(parts, first, dtype=torch.float32)
    qkv2, g2 = _data(parts, second, seed=3, dtype=torch.float32)
    _, states = memorize(*qkv1, parts, g1, mode="triton", cu_seqlens=_offsets(first))
    assert all(s.hist_k.shape[1] == 1 for s in states)
    assert tk._packed_kernel_kind(parts, qkv2[0], 1, states) is None
    o, _ = memorize(*qkv2, parts, g2, mode="triton", cu_seqlens=_offsets(second), initial_state=states)
    _, ref1 = _alone(parts, qkv1, g1, _offsets(first), "recurrent")
    o_ref, _ = _alone(parts, qkv2, g2, _offsets(second), "recurrent", states=ref1)
    assert rms_ratio(o, o_ref) <= 1e-3
