"""ARMT (Rodkin et al. 2024): the write/read and the whole block against direct loops of the paper's equations
(float64, outputs and gradients), chained calls equal one call, memory off = segment-local attention, gradients
cross segments only through the memory, causality, validation paths, the preset."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from atlaslab.memory.associative import EPS, associative_read, associative_write
from atlaslab.models.armt import ARMTBlock, ARMTConfig
from atlaslab.models.attention import Attention, AttentionConfig
from atlaslab.models.presets import build_model, load_preset, tiny_overrides
from atlaslab.registry import ConfigError, resolve_part

from helpers import rms_ratio

F64 = torch.float64
D, B = 16, 2


# ---------------------------------------------------------------------------------------------------
# direct implementations of the paper's equations (loops, no code shared with atlaslab)
# ---------------------------------------------------------------------------------------------------
def dpfp(x: torch.Tensor, nu: int) -> torch.Tensor:
    """DPFP of one vector: φ_{2d(j−1)+i} = r_i r_{(i+j) mod 2d}, r = [relu(x), relu(−x)]."""
    r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)])
    n = r.shape[0]
    return torch.stack([r[i] * r[(i + j) % n] for j in range(1, nu + 1) for i in range(n)])


def write_direct(A, z, phi, v, beta, correction=True):
    """A ← A + Σ_i β_i (v_i − v̄_i) ⊗ φ_i, z ← z + Σ_i γ_i φ_i; every v̄_i, γ_i from the segment-start A, z.

    Layout of this reference: A ``[b][h]: [F, D_v]`` (key-major, as the paper writes v ⊗ φ transposed)."""
    A_new, z_new = A.clone(), z.clone()
    for b in range(phi.shape[0]):
        for i in range(phi.shape[1]):
            for h in range(phi.shape[2]):
                p = phi[b, i, h]
                v_bar = (A[b, h].T @ p) / (z[b, h] @ p + EPS)
                A_new[b, h] = A_new[b, h] + beta[b, i, h] * torch.outer(p, v[b, i, h] - v_bar)
                gamma = (1 - z[b, h] @ p / (p @ p)).clamp(0, 1).detach() if correction else 1.0
                z_new[b, h] = z_new[b, h] + gamma * p
    return A_new, z_new


def read_direct(A, z, phi):
    out = torch.zeros(*phi.shape[:3], A.shape[-1], dtype=phi.dtype)
    for b in range(phi.shape[0]):
        for t in range(phi.shape[1]):
            for h in range(phi.shape[2]):
                p = phi[b, t, h]
                out[b, t, h] = (A[b, h].T @ p) / (z[b, h] @ p + EPS)
    return out


def armt_direct(block: ARMTBlock, x: torch.Tensor) -> torch.Tensor:
    """The ARMT block by loops: per segment, h = [S ‖ M] (M only on complete segments), h += read(h),
    y = causal softmax attention of h (no RoPE here), out = read + y on S; the memory tokens' h + y write A, z."""
    cfg = block.cfg
    C, N, Hm, Dk, Dv = cfg.segment, cfg.memory_tokens, block.memory_heads, block.key_dim, block.value_dim
    H, Dh = block.num_heads, block.head_dim
    fm = block.feature_map
    nu = fm.cfg.nu if fm.cfg.name == "dpfp" else None

    def phi(W, vec, head):
        u = W[head * Dk:(head + 1) * Dk] @ vec
        f = dpfp(u, nu) if nu else F.elu(u) + 1
        return f / f.norm()

    def attend(h):
        n = h.shape[0]
        q, k, v = (getattr(block, f"{p}_proj").weight for p in "qkv")
        out = torch.zeros(n, H * Dh, dtype=h.dtype)
        for t in range(n):
            for a in range(H):
                sl = slice(a * Dh, (a + 1) * Dh)
                s = torch.stack([(q[sl] @ h[t]) @ (k[sl] @ h[j]) / math.sqrt(Dh) for j in range(t + 1)])
                w = torch.softmax(s, 0)
                out[t, sl] = sum(w[j] * (v[sl] @ h[j]) for j in range(t + 1))
        return out @ block.o_proj.weight.T

    Wq, Wk, Wv = block.mem_q.weight, block.mem_k.weight, block.mem_v.weight
    Wb, bb = block.mem_beta.weight, block.mem_beta.bias
    outs = []
    for b in range(x.shape[0]):
        A = [torch.zeros(block.num_features, Dv, dtype=x.dtype) for _ in range(Hm)]
        z = [torch.zeros(block.num_features, dtype=x.dtype) for _ in range(Hm)]
        rows = []
        for s0 in range(0, x.shape[1], C):
            seg = x[b, s0:s0 + C]
            L = seg.shape[0]
            h = torch.cat([seg, block.memory_tokens]) if L == C else seg
            r = torch.stack([torch.cat([(A[a].T @ phi(Wq, h[t], a)) / (z[a] @ phi(Wq, h[t], a) + EPS)
                                        for a in range(Hm)]) for t in range(h.shape[0])])
            hh = h + r
            y = attend(hh)
            rows.append(r[:L] + y[:L])
            if L == C:
                m = hh[L:] + y[L:]
                A0, z0 = [t.clone() for t in A], [t.clone() for t in z]
                for i in range(N):
                    for a in range(Hm):
                        p = phi(Wk, m[i], a)
                        v = Wv[a * Dv:(a + 1) * Dv] @ m[i]
                        beta = torch.sigmoid(Wb[a] @ m[i] + bb[a])
                        v_bar = (A0[a].T @ p) / (z0[a] @ p + EPS)
                        A[a] = A[a] + beta * torch.outer(p, v - v_bar)
                        gamma = (1 - z0[a] @ p / (p @ p)).clamp(0, 1).detach() if cfg.correction else 1.0
                        z[a] = z[a] + gamma * p
        outs.append(torch.cat(rows))
    return torch.stack(outs)


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def make(seed=0, **cfg) -> ARMTBlock:
    """A float64 block with the memory switched on at init (W_v random: the authors' zero init writes nothing)."""
    torch.manual_seed(seed)
    node = {"name": "armt", "num_heads": 2, "segment": 4, "memory_tokens": 2, "memory_heads": 2, **cfg}
    block = ARMTBlock(resolve_part("block", node), D).to(F64)
    if block.cfg.use_memory:
        with torch.no_grad():
            torch.nn.init.normal_(block.mem_v.weight, std=D ** -0.5)
            torch.nn.init.normal_(block.mem_beta.bias, std=1.0)
    return block


def x_batch(T=10, seed=1, requires_grad=False):
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return x.requires_grad_(requires_grad)


def unit_features(shape, seed):
    """Positive unit features, peaked (u⁶) so that keys overlap partly: the second write's γ = 1 − zᵀφ spans
    clipped (0) and interior values."""
    return F.normalize(torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) ** 6, dim=-1)


# ---------------------------------------------------------------------------------------------------
# the defining equations
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("correction", [True, False])
def test_write_and_read_are_the_papers_equations(correction):
    """Two segments' writes from A = 0, z = 0 (the first: v̄ = 0, γ = 1), then a read: outputs and gradients."""
    Hm, Fd, Dv, N = 2, 6, 3, 3
    g = torch.Generator().manual_seed(0)
    leaves = [unit_features((B, N, Hm, Fd), 1), torch.randn(B, N, Hm, Dv, generator=g, dtype=F64),
              torch.rand(B, N, Hm, generator=g, dtype=F64), unit_features((B, N, Hm, Fd), 2),
              torch.randn(B, N, Hm, Dv, generator=g, dtype=F64), torch.rand(B, N, Hm, generator=g, dtype=F64),
              unit_features((B, 5, Hm, Fd), 3)]
    gamma = 1 - torch.einsum("bnhf,bmhf->bmh", leaves[0], leaves[3])          # the second write's γ before clipping
    assert (gamma < 0).any() and ((gamma > 0.1) & (gamma < 0.9)).any()
    results = []
    for impl in ("atlaslab", "direct"):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        A0, z0 = torch.zeros(B, Hm, Dv, Fd, dtype=F64), torch.zeros(B, Hm, Fd, dtype=F64)
        if impl == "atlaslab":
            A, z = associative_write(A0, z0, *xs[:3], correction=correction)
            A, z = associative_write(A, z, *xs[3:6], correction=correction)
            o, A = associative_read(A, z, xs[6]), A.transpose(-1, -2)
        else:
            A, z = write_direct(A0.transpose(-1, -2), z0, *xs[:3], correction=correction)
            A, z = write_direct(A, z, *xs[3:6], correction=correction)
            o = read_direct(A, z, xs[6])
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
        grads = torch.autograd.grad((o * w).sum() + A.square().sum() + z.square().sum(), xs)
        results.append((o, A, z, grads))
    (o, A, z, g_a), (o_d, A_d, z_d, g_d) = results
    assert rms_ratio(o, o_d) < 1e-12 and rms_ratio(A, A_d) < 1e-12 and rms_ratio(z, z_d) < 1e-12
    for a, d in zip(g_a, g_d):
        assert rms_ratio(a, d) < 1e-12
    # the first write: nothing to correct (v̄ = 0), every key new (γ = 1)
    A1, z1 = associative_write(torch.zeros(B, Hm, Dv, Fd, dtype=F64), torch.zeros(B, Hm, Fd, dtype=F64), *leaves[:3])
    assert torch.allclose(A1, torch.einsum("bnh,bnhe,bnhf->bhef", leaves[2], leaves[1], leaves[0]), atol=1e-14)
    assert torch.allclose(z1, leaves[0].sum(1), atol=1e-14)


def test_rewriting_a_stored_key_moves_its_value_and_not_the_normaliser():
    """The delta rule replaces v for a key already in A; γ = 0 for it, so z does not grow (ARMT §3)."""
    phi = F.normalize(torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]], dtype=F64), dim=-1)        # [1, 1, 1, 4]
    v1, v2 = torch.tensor([[[[1.0, 2.0]]]], dtype=F64), torch.tensor([[[[-3.0, 0.5]]]], dtype=F64)
    one = torch.ones(1, 1, 1, dtype=F64)
    A, z = associative_write(torch.zeros(1, 1, 2, 4, dtype=F64), torch.zeros(1, 1, 4, dtype=F64), phi, v1, one)
    A, z2 = associative_write(A, z, phi, v2, one)
    assert torch.allclose(associative_read(A, z2, phi), v2, atol=1e-4)                  # ε = 1e-5 of the read
    assert torch.equal(z2, z)


@pytest.mark.parametrize("cfg", [dict(), dict(correction=False, feature_map={"name": "elu_plus_one"}),
                                 dict(memory_heads=1, key_dim=3, feature_map={"name": "dpfp", "nu": 2})],
                         ids=["dpfp3", "elu-no-correction", "one-head-key3"])
def test_block_equals_a_direct_loop_of_the_paper(cfg):
    """The whole block (reads before attention, memory tokens, write from their hidden states) vs loops."""
    block = make(rope=False, **cfg)
    x = x_batch(T=10, requires_grad=True)                      # segments 4, 4, 2: the last one writes nothing
    params = [p for p in block.parameters()]
    out, ref = block(x), armt_direct(block, x)
    assert rms_ratio(out, ref) < 1e-12
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    g_out = torch.autograd.grad((out * w).sum(), [x] + params)
    g_ref = torch.autograd.grad((ref * w).sum(), [x] + params)
    for a, r in zip(g_out, g_ref):
        assert rms_ratio(a, r) < 1e-10


# ---------------------------------------------------------------------------------------------------
# recurrence, memory off, gradients, causality
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [(4, 8), (3, 6, 7), tuple(range(1, 13))], ids=["at-segments", "mid", "tokens"])
def test_chained_calls_equal_one_call(splits):
    block = make()
    x = x_batch(T=13, requires_grad=True)
    full, full_state = block(x, return_state=True)
    pieces, state = [], None
    for lo, hi in zip((0,) + splits, splits + (13,)):
        y, state = block(x[:, lo:hi], state=state, return_state=True)
        pieces.append(y)
    chained = torch.cat(pieces, 1)
    assert rms_ratio(chained, full) < 1e-12
    assert rms_ratio(state.A, full_state.A) < 1e-12 and rms_ratio(state.z, full_state.z) < 1e-12
    assert torch.equal(state.pending, full_state.pending) and state.pending.shape[1] == 13 % 4
    w = torch.randn(full.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    (g_full,) = torch.autograd.grad((full * w).sum(), x)
    (g_chain,) = torch.autograd.grad((chained * w).sum(), x)
    assert rms_ratio(g_chain, g_full) < 1e-12                 # the state carries the graph between calls


def test_memory_off_is_segment_local_attention():
    """use_memory: false = causal attention under a block-diagonal segment mask (RoPE on, global positions)."""
    C, T = 4, 10
    block = make(use_memory=False, segment=C)
    assert not [n for n, _ in block.named_parameters() if n.startswith(("mem_", "memory_tokens"))]
    attn = Attention(AttentionConfig(name="attention", num_heads=2), D).to(F64)
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(attn, n).load_state_dict(getattr(block, n).state_dict())
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i) & (i // C == j // C)
    x = x_batch(T=T)
    assert rms_ratio(block(x), attn(x, mask=mask)) < 1e-12
    assert rms_ratio(make(segment=C)(x), attn(x, mask=mask)) > 1e-3      # with the memory on it differs


@pytest.mark.parametrize("use_memory", [True, False])
def test_gradients_cross_segments_only_through_the_memory(use_memory):
    block = make(use_memory=use_memory)
    x = x_batch(T=12, requires_grad=True)
    y = block(x)
    (g,) = torch.autograd.grad(y[:, 8:].square().sum(), x, retain_graph=True)    # the loss of segment 3 only
    earlier = g[:, :8].abs().sum()
    assert (earlier > 0) if use_memory else (earlier == 0)
    if use_memory:                                             # and it reaches every memory parameter
        y[:, 8:].square().sum().backward()
        for n, p in block.named_parameters():
            if n.startswith(("mem_", "memory_tokens")):
                assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_outputs_do_not_depend_on_future_tokens():
    block = make()
    x = x_batch(T=10)
    x2 = x.clone()
    x2[:, 5:] += torch.randn(B, 5, D, dtype=F64)               # from mid-segment 2 on
    with torch.no_grad():
        a, b = block(x), block(x2)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_the_next_segment_reads_what_the_previous_wrote():
    block = make()
    x = x_batch(T=8)
    x2 = x.clone()
    x2[:, :4] += 1.0
    with torch.no_grad():
        a, b = block(x), block(x2)
        off = make(use_memory=False)
        c, d = off(x), off(x2)
    assert not torch.allclose(a[:, 4:], b[:, 4:])
    torch.testing.assert_close(c[:, 4:], d[:, 4:], rtol=0, atol=0)


def test_state_size_counts_A_z_and_one_segment_of_kv():
    block = make(memory_heads=2, feature_map={"name": "dpfp", "nu": 3})      # key dim 8 → 48 features
    assert block.num_features == 48
    assert block.state_size() == 2 * 48 * (8 + 1) + 4 * 2 * 2 * 8
    assert make(use_memory=False).state_size() == 4 * 2 * 2 * 8
    s = block.initial_state(3)
    assert s.A.shape == (3, 2, 8, 48) and s.z.shape == (3, 2, 48) and s.pending.shape == (3, 0, D)


# ---------------------------------------------------------------------------------------------------
# validation and the preset
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, path", [
    ("mixers.armt.segment=0", "mixers.armt.segment"),
    ("mixers.armt.memory_tokens=0", "mixers.armt.memory_tokens"),
    ("mixers.armt.memroy_tokens=4", "mixers.armt.memroy_tokens"),
    ("mixers.armt.feature_map={name: identity}", "mixers.armt.feature_map.name"),
    ("mixers.armt.feature_map={name: dpfpp}", "mixers.armt.feature_map.name"),
    ("mixers.armt.feature_map.nu=0", "mixers.armt.feature_map.nu"),
    ("mixers.armt.feature_map.nu=200", "mixers.armt.feature_map.nu"),
    ("mixers.armt.key_dim=1", "mixers.armt.feature_map.nu"),          # ν = 3 > 2·1 − 1, known at build time
    ("mixers.armt.memory_heads=3", "mixers.armt.memory_heads"),        # 64 is not divisible by 3
    ("mixers.armt.mode=triton", "mixers.armt.mode"),                  # no engines: the memory is computed directly
])
def test_validation_errors_name_the_dotted_path(override, path):
    with pytest.raises(ConfigError) as info:
        build_model(load_preset("armt", [override]))
    assert info.value.path == path, str(info.value)


def test_identity_feature_map_error_lists_the_nonnegative_maps():
    with pytest.raises(ConfigError) as info:
        ARMTConfig(name="armt", feature_map={"name": "identity"}).check()
    assert "dpfp" in info.value.choices and "elu_plus_one" in info.value.choices


def test_preset_builds_trains_a_step_and_refuses_packed_batches():
    torch.manual_seed(0)
    model = build_model(load_preset("armt", tiny_overrides("armt", num_layers=2))).to(F64)
    (mixer,) = {type(m) for m in model.mixers()}
    assert mixer is ARMTBlock and model.mixers()[0].cfg.segment == 4
    ids = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(1))
    loss = model.loss(ids)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.optim.AdamW(model.parameters(), lr=3e-3).step()
    with torch.no_grad():
        assert model.loss(ids) < loss
    with pytest.raises(ValueError, match="mixers.armt"):
        model(ids[:1], cu_seqlens=[0, 5, 11])
