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


def phi_direct(block: ARMTBlock, W: torch.Tensor, vec: torch.Tensor, head: int) -> torch.Tensor:
    """The unit feature φ̂ of memory head ``head`` of one hidden vector (DPFP, or elu + 1 when ν is absent)."""
    Dk, fm = block.key_dim, block.feature_map
    u = W[head * Dk:(head + 1) * Dk] @ vec
    f = dpfp(u, fm.cfg.nu) if fm.cfg.name == "dpfp" else F.elu(u) + 1
    return f / f.norm()


def attend_direct(block: ARMTBlock, h: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention (no RoPE) of the block over one segment's rows ``h: [n, d_model]``."""
    H, Dh, n = block.num_heads, block.head_dim, h.shape[0]
    q, k, v = (getattr(block, f"{p}_proj").weight for p in "qkv")
    out = torch.zeros(n, H * Dh, dtype=h.dtype)
    for t in range(n):
        for a in range(H):
            sl = slice(a * Dh, (a + 1) * Dh)
            s = torch.stack([(q[sl] @ h[t]) @ (k[sl] @ h[j]) / math.sqrt(Dh) for j in range(t + 1)])
            w = torch.softmax(s, 0)
            out[t, sl] = sum(w[j] * (v[sl] @ h[j]) for j in range(t + 1))
    return out @ block.o_proj.weight.T


def read_rows_direct(block: ARMTBlock, A, z, h: torch.Tensor) -> torch.Tensor:
    """Aᵀφ̂(W_q h_t) / (zᵀφ̂ + ε) for every row of ``h``, memory heads concatenated (A per head ``[F, D_v]``)."""
    Wq = block.mem_q.weight
    return torch.stack([torch.cat([(A[a].T @ phi_direct(block, Wq, row, a)) / (z[a] @ phi_direct(block, Wq, row, a) + EPS)
                                   for a in range(block.memory_heads)]) for row in h])


def write_rows_direct(block: ARMTBlock, A, z, m: torch.Tensor):
    """The memory tokens' rows ``m`` write A, z (lists over memory heads), every v̄, γ from the segment-start A, z."""
    Wk, Wv, Dv = block.mem_k.weight, block.mem_v.weight, block.value_dim
    Wb, bb = block.mem_beta.weight, block.mem_beta.bias
    A0, z0 = [t.clone() for t in A], [t.clone() for t in z]
    A, z = list(A), list(z)
    for row in m:
        for a in range(block.memory_heads):
            p = phi_direct(block, Wk, row, a)
            v = Wv[a * Dv:(a + 1) * Dv] @ row
            beta = torch.sigmoid(Wb[a] @ row + bb[a])
            v_bar = (A0[a].T @ p) / (z0[a] @ p + EPS)
            A[a] = A[a] + beta * torch.outer(p, v - v_bar)
            gamma = (1 - z0[a] @ p / (p @ p)).clamp(0, 1).detach() if block.cfg.correction else 1.0
            z[a] = z[a] + gamma * p
    return A, z


def empty_memory(block: ARMTBlock, dtype):
    return ([torch.zeros(block.num_features, block.value_dim, dtype=dtype) for _ in range(block.memory_heads)],
            [torch.zeros(block.num_features, dtype=dtype) for _ in range(block.memory_heads)])


def armt_direct(block: ARMTBlock, x: torch.Tensor) -> torch.Tensor:
    """The ARMT block by loops: per segment, h = [S ‖ M] (M only on complete segments), h += read(h),
    y = causal softmax attention of h (no RoPE here), out = read + y on S; the memory tokens' h + y write A, z."""
    C = block.cfg.segment
    outs = []
    for b in range(x.shape[0]):
        A, z = empty_memory(block, x.dtype)
        rows = []
        for s0 in range(0, x.shape[1], C):
            seg = x[b, s0:s0 + C]
            L = seg.shape[0]
            h = torch.cat([seg, block.memory_tokens]) if L == C else seg
            r = read_rows_direct(block, A, z, h)
            y = attend_direct(block, h + r)
            rows.append(r[:L] + y[:L])
            if L == C:
                A, z = write_rows_direct(block, A, z, h[L:] + r[L:] + y[L:])
        outs.append(torch.cat(rows))
    return torch.stack(outs)


def rmsnorm_direct(x: torch.Tensor, norm) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight


def stacked_lm_direct(model, ids: torch.Tensor) -> torch.Tensor:
    """The authors' arrangement by loops: per segment, h = [embed(S) ‖ M]; per layer h += r + y with r the read and
    y the attention of RMSNorm(h) (+ r), h += SwiGLU(RMSNorm(h)), then the memory tokens' h writes that layer's A, z;
    the segment's h after the last layer goes to the final norm and the head."""
    C, M = model.armt_stack.segment, model.armt_stack.memory_tokens
    outs = []
    for b in range(ids.shape[0]):
        memory = [empty_memory(layer.mixer, F64) for layer in model.layers]
        rows = []
        for s0 in range(0, ids.shape[1], C):
            seg = model.embed.weight[ids[b, s0:s0 + C]]
            L = seg.shape[0]
            h = torch.cat([seg, M]) if L == C else seg
            for i, layer in enumerate(model.layers):
                blk, (A, z) = layer.mixer, memory[i]
                u = rmsnorm_direct(h, layer.mixer_norm)
                r = read_rows_direct(blk, A, z, u)
                h = h + r + attend_direct(blk, u + r)
                g = rmsnorm_direct(h, layer.mlp_norm)
                mlp = layer.mlp
                h = h + (F.silu(g @ mlp.w1.weight.T) * (g @ mlp.w3.weight.T)) @ mlp.w2.weight.T
                if L == C:
                    memory[i] = write_rows_direct(blk, A, z, h[L:])
            rows.append(h[:L])
        outs.append(torch.cat(rows))
    x = rmsnorm_direct(torch.stack(outs), model.norm)
    return x @ model.head.weight.T


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


def test_read_floor_bounds_the_runaway_of_a_key_that_z_has_not_seen():
    """A can hold mass along features z has none of: a key that counts as seen (γ = 0) still writes A along all its
    features. Here z = 1.5 e1 makes φ_b = (e1 + e2)/√2 seen (zᵀφ_b = 1.06 ≥ 1), so its write leaves mass on e2 in A
    alone. A query e2 then reads A e2 / ε, and a write with key e2 multiplies that mass by (1 − β/ε): the authors'
    rule. read_floor = 1 reads A e2 / 1, and the write shrinks it by (1 − β)."""
    e1, e2 = torch.eye(3, dtype=F64)[:2]
    phi_b = F.normalize(e1 + e2, dim=0).view(1, 1, 1, 3)
    A0, z0 = torch.zeros(1, 1, 1, 3, dtype=F64), 1.5 * e1.view(1, 1, 3)
    half = torch.full((1, 1, 1), 0.5, dtype=F64)
    A, z = associative_write(A0, z0, phi_b, torch.ones(1, 1, 1, 1, dtype=F64), half)
    assert torch.equal(z, z0) and A[0, 0, 0, 1] > 0.3                  # seen: z unchanged, A has mass on e2
    q = e2.view(1, 1, 1, 3)
    mass = A[0, 0, 0, 1].item()
    torch.testing.assert_close(associative_read(A, z, q).squeeze(), torch.tensor(mass / EPS, dtype=F64))
    torch.testing.assert_close(associative_read(A, z, q, floor=1.0).squeeze(), torch.tensor(mass, dtype=F64))
    zero_v = torch.zeros(1, 1, 1, 1, dtype=F64)
    A_authors, _ = associative_write(A, z, q, zero_v, half)
    A_floor, _ = associative_write(A, z, q, zero_v, half, floor=1.0)
    torch.testing.assert_close(A_authors[0, 0, 0, 1], torch.tensor(mass * (1 - 0.5 / EPS), dtype=F64))
    torch.testing.assert_close(A_floor[0, 0, 0, 1], torch.tensor(mass * 0.5, dtype=F64))
    # a key written in full (zᵀφ ≥ 1) reads as before
    torch.testing.assert_close(associative_read(A, z, phi_b, floor=1.0), associative_read(A, z, phi_b))


def test_read_floor_reaches_the_block_and_is_validated():
    with pytest.raises(ConfigError, match="read_floor"):
        resolve_part("block", {"name": "armt", "read_floor": -1.0}, "mixers.armt")
    block = make(read_floor=1.0)
    h = torch.randn(2, 5, block.d_model, dtype=F64)
    A = torch.randn(2, block.memory_heads, block.value_dim, block.num_features, dtype=F64)
    z = torch.zeros(2, block.memory_heads, block.num_features, dtype=F64)    # nothing seen: the floor decides
    phi = block.features(h, block.mem_q)
    torch.testing.assert_close(block.read(h, A, z), torch.einsum("bhef,bnhf->bnhe", A, phi).reshape(h.shape))


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
# memory_flow: through_stack (the authors' arrangement, in the language model)
# ---------------------------------------------------------------------------------------------------
def stacked_model(seed=0, num_layers=2, **block):
    """A float64 2-layer LM of through_stack ARMT blocks (RoPE off, W_v random so the memory writes at init)."""
    torch.manual_seed(seed)
    node = {"name": "armt", "num_heads": 2, "segment": 4, "memory_tokens": 2, "memory_heads": 2, "rope": False,
            "memory_flow": "through_stack", **block}
    model = build_model({"vocab_size": 11, "d_model": D, "num_layers": num_layers, "layers": ["armt"],
                         "mixers": {"armt": node}}).to(F64)
    with torch.no_grad():
        for blk in model.mixers():
            torch.nn.init.normal_(blk.mem_v.weight, std=D ** -0.5)
            torch.nn.init.normal_(blk.mem_beta.bias, std=1.0)
    return model


def ids_batch(T=10, seed=1):
    return torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(seed))


def test_through_stack_equals_a_direct_loop_of_the_authors_arrangement():
    """One set of memory tokens from the embedding up, each layer writing from its output after the MLP."""
    model = stacked_model()
    assert [n for n, _ in model.named_parameters() if "memory_tokens" in n] == ["armt_stack.memory_tokens"]
    ids = ids_batch(T=10)                                     # segments 4, 4, 2: the last one writes nothing
    params = list(model.parameters())
    out, ref = model(ids), stacked_lm_direct(model, ids)
    assert rms_ratio(out, ref) < 1e-12
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    for a, r in zip(torch.autograd.grad((out * w).sum(), params), torch.autograd.grad((ref * w).sum(), params)):
        assert rms_ratio(a, r) < 1e-10


def test_through_stack_differs_from_per_layer_tokens_above_the_first_layer():
    """With the same weights, per-layer memory tokens equal to the stack's give the same first-layer write but not
    the same model: above layer 1 the carried tokens have read the segment (and the write comes after the MLP)."""
    stacked = stacked_model()
    per_layer = build_model({**stacked.resolved.to_dict(), "mixers": {"armt": {
        **{k: v for k, v in stacked.resolved.to_dict()["mixers"]["armt"].items()}, "memory_flow": "per_layer"}}}).to(F64)
    state = {k: v for k, v in stacked.state_dict().items() if not k.startswith("armt_stack")}
    for i in range(2):
        state[f"layers.{i}.mixer.memory_tokens"] = stacked.armt_stack.memory_tokens.detach()
    per_layer.load_state_dict(state)
    ids = ids_batch(T=8)
    with torch.no_grad():
        a, b = stacked(ids), per_layer(ids)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-12)   # segment 1 reads an empty memory
    assert rms_ratio(a[:, 4:], b[:, 4:]) > 1e-3


@pytest.mark.parametrize("splits", [(4, 8), (3, 6, 7), tuple(range(1, 13))], ids=["at-segments", "mid", "tokens"])
def test_through_stack_chained_prefills_and_steps_equal_one_forward(splits):
    model = stacked_model()
    ids = ids_batch(T=13)
    with torch.no_grad():
        full = model(ids)
    pieces, state = [], None
    for lo, hi in zip((0,) + splits, splits + (13,)):
        logits, state = model.prefill(ids[:, lo:hi], state)
        pieces.append(logits)
    assert rms_ratio(torch.cat(pieces, 1), full) < 1e-12
    assert state.length == 13 and all(s.pending.shape[1] == 13 % 4 for s in state.layers)
    _, state = model.prefill(ids[:, :12])
    logits, _ = model.step(ids[:, 12], state)
    assert rms_ratio(logits, full[:, 12]) < 1e-12


def test_through_stack_is_causal_and_trains_its_memory_tokens():
    model = stacked_model()
    ids = ids_batch(T=12)
    ids2 = ids.clone()
    ids2[:, 6:] = (ids2[:, 6:] + 1) % 11
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :6], model(ids2)[:, :6], rtol=0, atol=1e-12)
    model(ids)[:, 8:].square().sum().backward()               # segment 3's outputs reach the memory tokens
    assert model.armt_stack.memory_tokens.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="through_stack"):
        model.mixers()[0](torch.zeros(1, 4, D, dtype=F64))


@pytest.mark.parametrize("mixers, layers, path", [
    ({"a": {"name": "armt", "memory_flow": "through_stack"}, "b": {"name": "attention"}}, ["a", "b"], "mixers.b.name"),
    ({"a": {"name": "armt", "memory_flow": "through_stack"}, "b": {"name": "armt"}}, ["a", "b"],
     "mixers.b.memory_flow"),
    ({"a": {"name": "armt", "memory_flow": "through_stack"},
      "b": {"name": "armt", "memory_flow": "through_stack", "segment": 8}}, ["a", "b"], "mixers.b.segment"),
    ({"a": {"name": "armt", "memory_flow": "through_stack", "use_memory": False}}, ["a"], "mixers.a.memory_flow"),
    ({"a": {"name": "armt", "memory_flow": "up"}}, ["a"], "mixers.a.memory_flow"),
], ids=["other-mixer", "per-layer-armt", "segment", "memory-off", "unknown"])
def test_through_stack_validation_names_the_field(mixers, layers, path):
    with pytest.raises(ConfigError) as info:
        build_model({"d_model": 16, "num_layers": 2, "layers": layers, "mixers": mixers})
    assert info.value.path == path, str(info.value)


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
    # per-layer memory tokens: the authors' through-the-stack flow diverged once on S-NIAH (docs/results/reading-list.md)
    assert model.armt_stack is None and model.mixers()[0].cfg.memory_flow == "per_layer"
    ids = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(1))
    loss = model.loss(ids)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.optim.AdamW(model.parameters(), lr=3e-3).step()
    with torch.no_grad():
        assert model.loss(ids) < loss
    with pytest.raises(ValueError, match="mixers.armt"):
        model(ids[:1], cu_seqlens=[0, 5, 11])
