"""Independent reference models for bench/learning.py: each an ``nn.Module`` mapping ids ``[B, T]`` → logits ``[B, T, V]``.

None of them uses atlaslab code. All but ``titans_mac`` share one plain LM shell (:class:`RefLM`):

    ids → nn.Embedding (PyTorch default init, N(0, 1)) [+ learned positions] → L × [ x += mixer(LN(x));
    x += GELU-MLP(LN(x)) (4×) ] → LayerNorm → untied nn.Linear head (default init)

Mixers:

- ``softmax_transformer`` (:class:`SoftmaxAttention`): causal multi-head softmax attention with
  ``F.scaled_dot_product_attention``, learned positional embeddings (in the shell), biased q/k/v/out projections.
- ``fla_gated_deltanet`` (:class:`FlaGatedDeltaNetMixer`): fla 0.6's ``GatedDeltaNet`` layer parameterisation
  (q/k/v projections, depthwise causal conv 4 + SiLU on each, ℓ2-normalised q, k, β = σ(b_proj x),
  g = −exp(A_log)·softplus(a_proj x + dt_bias) with A ~ U(0, 16), dt ~ logU[1e-3, 0.1], output
  RMSNorm(o)·swish(g_proj x) (fla's FusedRMSNormGated), o_proj). The recurrence is fla's own plain-PyTorch
  ``naive_chunk_gated_delta_rule`` (``fla/ops/gated_delta_rule/naive.py``, loaded by path by
  ``bench/peers.py:load_fla_naive``).
- ``fla_deltanet`` (:class:`FlaGatedDeltaNetMixer` with ``decay=False``): no decay. The recurrence is fla's
  ``delta_rule_chunkwise`` from ``fla/ops/delta_rule/naive.py`` (same file-by-path loading). Output side as
  fla's ``DeltaNet`` layer defaults: ``use_gate=False`` → plain per-head RMSNorm, no output gate.
- ``titans_neural_memory`` (:class:`TitansMixer`): a depthwise causal conv (kernel 4) and then titans-pytorch's
  ``NeuralMemory`` (its defaults; dim 64, heads 4, dim_head 16, chunk_size 4; ``retrieved, state = mem(x)``).
  chunk_size 1 (its default, the smallest) costs ~12 s per training step at B = 64, T = 64 on one CPU core
  (4096 · 4 per-sample gradients through torch.func.vmap), 4 costs ~1 s, 16 ~0.3 s.
- ``lact`` (:class:`LaCTMixer`): LaCT's language layer (SWA + SwiGLU fast weights trained per chunk with Muon,
  momentum and the weight norm, "apply, then update") re-implemented from its authors' code, which is not a pip
  package (github.com/a1600012888/LaCT, ``lact_llm``), with that code's initialisation of the layer.
- ``titans_mac`` (:class:`TitansMACRef`): titans-pytorch's whole ``MemoryAsContextTransformer`` (not in the shell
  below: MAC is a whole model) at our ``titans_mac`` preset's sizes, 4 long-term memory tokens per segment.

The fla / titans references need the peers installed in bench/.peers (``python bench/peers.py --install``);
:func:`available` says whether a reference can be built (and why not). bench/.peers is appended to
``sys.path`` (after the venv, so it never shadows our packages) only when such a reference is built.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
PEERS = HERE / ".peers"
FLA_GDN_NAIVE = PEERS / "fla" / "ops" / "gated_delta_rule" / "naive.py"
FLA_DELTA_NAIVE = PEERS / "fla" / "ops" / "delta_rule" / "naive.py"
TITANS = PEERS / "titans_pytorch"

REFS = ("softmax_transformer", "fla_gated_deltanet", "fla_deltanet", "titans_neural_memory", "lact", "titans_mac",
        "ours_in_ref_lm", "ref_in_our_lm")
#: entries of REFS that are diagnostic probes, not independent references (not run unless named). With the
#: preset and its reference they make a 2 × 2 of {our mixer, the reference's} × {our LM, the references' LM shell}.
PROBES = ("ours_in_ref_lm", "ref_in_our_lm")
#: which reference each preset is compared with
PRESET_REF = {"transformer": "softmax_transformer", "gated_deltanet": "fla_gated_deltanet",
              "deltanet": "fla_deltanet", "titans": "titans_neural_memory", "lact": "lact",
              "titans_mac": "titans_mac"}


# --------------------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------------------
def _use_peers() -> None:
    """Put bench/.peers on sys.path, after everything else (a peer never shadows a venv package)."""
    if str(PEERS) not in sys.path:
        sys.path.append(str(PEERS))


def _bench_peers():
    """bench/peers.py as a module (for its ``load_fla_naive``)."""
    name = "bench_peers_for_learning"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "peers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def fla_gdn_naive():
    """fla's ``fla/ops/gated_delta_rule/naive.py`` (bench/peers.py's loader; it imports einops from the peers)."""
    _use_peers()
    return _bench_peers().load_fla_naive()


def fla_delta_naive():
    """fla's ``fla/ops/delta_rule/naive.py``, loaded by path as bench/peers.py loads the gated one."""
    _use_peers()
    spec = importlib.util.spec_from_file_location("fla_naive_delta_rule", FLA_DELTA_NAIVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available(name: str) -> Tuple[bool, str]:
    """(can the reference be built here, why not)."""
    if name not in REFS:
        return False, f"unknown reference {name!r} (known: {', '.join(REFS)})"
    need = {"fla_gated_deltanet": [FLA_GDN_NAIVE, PEERS / "einops"],
            "fla_deltanet": [FLA_DELTA_NAIVE, PEERS / "einops"],
            "ref_in_our_lm": [FLA_DELTA_NAIVE, FLA_GDN_NAIVE, PEERS / "einops"],
            "titans_neural_memory": [TITANS, PEERS / "einops", PEERS / "tensordict", PEERS / "assoc_scan"],
            "titans_mac": [TITANS, PEERS / "einops", PEERS / "tensordict", PEERS / "assoc_scan",
                           PEERS / "hyper_connections", PEERS / "axial_positional_embedding"]}
    missing = [str(p.relative_to(HERE.parent)) for p in need.get(name, []) if not p.exists()]
    if missing:
        return False, f"not installed ({', '.join(missing)} missing): run python bench/peers.py --install"
    return True, ""


# --------------------------------------------------------------------------------------------------
# the LM shell
# --------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_model: int, expansion: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_model, expansion * d_model)
        self.fc2 = nn.Linear(expansion * d_model, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x += mixer(LN(x)); x += MLP(LN(x))."""

    def __init__(self, mixer: nn.Module, d_model: int):
        super().__init__()
        self.ln1, self.mixer = nn.LayerNorm(d_model), mixer
        self.ln2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x):
        x = x + self.mixer(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RefLM(nn.Module):
    """ids → embedding (+ learned positions) → blocks → LayerNorm → untied head; PyTorch default inits."""

    def __init__(self, vocab_size: int, d_model: int, mixers, max_len: Optional[int] = None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model) if max_len else None
        self.blocks = nn.ModuleList(Block(m, d_model) for m in mixers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def state_size(self, context: int) -> int:
        """Recurrent-state scalars per sequence after ``context`` tokens, summed over layers (as
        ``LanguageModel.state_size``: memory state + conv caches + KV cache)."""
        return sum(b.mixer.state_size(context) for b in self.blocks)


# --------------------------------------------------------------------------------------------------
# mixers
# --------------------------------------------------------------------------------------------------
class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention (``F.scaled_dot_product_attention``, ``is_causal=True``); with
    ``rope`` q and k are rotated (:func:`_rope`, base 10,000) before the scores, per head ``[B, T, H, D]``."""

    def __init__(self, d_model: int, num_heads: int = 4, rope: bool = False):
        super().__init__()
        self.h, self.rope = num_heads, rope
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).unbind(2)          # [B, T, H, D] each
        if self.rope:
            q, k = _rope(q), _rope(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                             # [B, H, T, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, C))

    def state_size(self, context: int) -> int:
        return 2 * self.qkv.in_features * context          # the KV cache: 2 · d_model per token


class CausalConv(nn.Module):
    """Depthwise causal conv over time (fla's ShortConvolution: nn.Conv1d, groups = channels, left padding
    K − 1, no bias, default init), optionally followed by SiLU."""

    def __init__(self, channels: int, kernel_size: int = 4, silu: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False)
        self.silu = silu

    def forward(self, x):                                    # [B, T, C]
        y = self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return F.silu(y) if self.silu else y

    def state_size(self) -> int:
        return self.conv.in_channels * (self.conv.kernel_size[0] - 1)


def _l2norm(x, eps: float = 1e-6):
    """fla's l2norm_fwd: x · rsqrt(Σx² + eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class FlaGatedDeltaNetMixer(nn.Module):
    """fla 0.6 ``GatedDeltaNet`` layer (``decay=True``) or its no-decay DeltaNet sibling (``decay=False``)
    at small size, the recurrence from fla's naive PyTorch chunk functions.

    ``expand_v``: value head dim = ``expand_v · head_dim`` (2: fla's GatedDeltaNet default; fla's DeltaNet
    layer's default, used by ``fla_deltanet``, is 1). At d_model 64, 4 heads of 16, T = 64, MQAR 4 pairs, seed 0:
    expand_v 2 reaches 90% at step 475, expand_v 1 sits at 25% to step 600 (60% at 600 without the output gate). ``output_gate``: RMSNorm(o) ⊙ swish(g_proj x) (fla GatedDeltaNet
    ``use_gate=True``) or plain RMSNorm(o) (fla DeltaNet ``use_gate=False``). fla's default scale D_k^-0.5
    on q is kept (it cancels in the output RMSNorm up to eps). ``chunk_size``: the naive function's chunk
    (16: the same result as fla's 64 up to float32 rounding, 2.5× faster on CPU at T = 64).
    """

    def __init__(self, d_model: int, num_heads: int = 4, head_dim: Optional[int] = None, expand_v: float = 2.0,
                 conv_size: int = 4, decay: bool = True, output_gate: bool = True, chunk_size: int = 16,
                 norm_eps: float = 1e-5):
        super().__init__()
        H = num_heads
        dk = head_dim or d_model // H
        dv = int(dk * expand_v)
        self.H, self.dk, self.dv, self.decay, self.chunk_size, self.eps = H, dk, dv, decay, chunk_size, norm_eps
        self.q_proj = nn.Linear(d_model, H * dk, bias=False)
        self.k_proj = nn.Linear(d_model, H * dk, bias=False)
        self.v_proj = nn.Linear(d_model, H * dv, bias=False)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        if decay:
            self.a_proj = nn.Linear(d_model, H, bias=False)
            A = torch.empty(H).uniform_(0, 16)
            self.A_log = nn.Parameter(torch.log(A))
            dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))     # softplus⁻¹(dt)
            self.naive = fla_gdn_naive().naive_chunk_gated_delta_rule
        else:
            self.naive = fla_delta_naive().delta_rule_chunkwise
        self.q_conv, self.k_conv, self.v_conv = (CausalConv(c, conv_size) for c in (H * dk, H * dk, H * dv))
        self.g_proj = nn.Linear(d_model, H * dv, bias=False) if output_gate else None
        self.o_norm_weight = nn.Parameter(torch.ones(dv))
        self.o_proj = nn.Linear(H * dv, d_model, bias=False)

    def gates(self, x):
        """β [B, T, H] and the log-decay g [B, T, H] (zeros without decay)."""
        beta = torch.sigmoid(self.b_proj(x))
        if not self.decay:
            return beta, torch.zeros_like(beta)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        return beta, g

    def recurrence(self, q, k, v, beta, g):
        """fla's naive chunk form on [B, T, H, D] inputs → o [B, T, H, D_v]."""
        if self.decay:
            o, _ = self.naive(q, k, v, g, beta, chunk_size=self.chunk_size)
            return o
        # delta_rule_chunkwise: [B, H, T, D] layout, T a multiple of the chunk, fp32, scale D_k^-0.5 inside
        T = q.shape[1]
        c = min(self.chunk_size, T)
        pad = (-T) % c
        q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))
        beta = F.pad(beta.float(), (0, 0, 0, pad)).transpose(1, 2)
        o, _ = self.naive(q, k, v, beta, chunk_size=c)
        return o.transpose(1, 2)[:, :T]

    def forward(self, x):
        B, T, _ = x.shape
        q = _l2norm(self.q_conv(self.q_proj(x)).view(B, T, self.H, self.dk))
        k = _l2norm(self.k_conv(self.k_proj(x)).view(B, T, self.H, self.dk))
        v = self.v_conv(self.v_proj(x)).view(B, T, self.H, self.dv)
        beta, g = self.gates(x)
        o = self.recurrence(q, k, v, beta, g).to(x.dtype)
        o = F.rms_norm(o, (self.dv,), eps=self.eps) * self.o_norm_weight
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x).view(B, T, self.H, self.dv))
        return self.o_proj(o.reshape(B, T, self.H * self.dv))

    def state_size(self, context: int) -> int:
        return self.H * self.dk * self.dv + sum(c.state_size() for c in (self.q_conv, self.k_conv, self.v_conv))


def _materialise_initial_weights(mem: nn.Module) -> None:
    """titans-pytorch quirk: with per_head_learned_parameters (its default) each initial memory weight of a
    ``NeuralMemory`` is a Parameter over repeat(p, '... -> h ...'), an expanded view (stride 0 over heads), which
    in-place optimiser updates (AdamW's decay) refuse. Materialise each as its own tensor (same values)."""
    params = mem.memory_model_parameters
    for i in range(len(params)):
        params[i] = nn.Parameter(params[i].detach().clone())


def neural_memory_state_size(mem: nn.Module) -> int:
    """A ``NeuralMemory``'s state: its memory MLP's weights per head (``memory_model_parameters``, ``[heads, …]``)
    and one momentum buffer of the same size per momentum order."""
    weights = sum(p.numel() for p in mem.memory_model_parameters)
    return weights * (1 + (mem.momentum_order if mem.to_momentum is not None else 0))


class TitansMixer(nn.Module):
    """Depthwise causal conv (kernel 4, no activation; NeuralMemory has none of its own, and MQAR needs the
    key next to its value) → titans-pytorch ``NeuralMemory(dim, heads, dim_head, chunk_size, **memory_kw)`` (all
    else its defaults: MemoryMLP depth 2 × 4 inside LN + residual, momentum, per-token decay, batch_size None);
    ``memory_kw`` are further NeuralMemory constructor options, e.g. ``qk_rmsnorm=True``."""

    def __init__(self, d_model: int, num_heads: int = 4, chunk_size: int = 4, conv_size: int = 4,
                 batch_size: Optional[int] = None, **memory_kw):
        super().__init__()
        _use_peers()
        from titans_pytorch import NeuralMemory
        self.conv = CausalConv(d_model, conv_size, silu=False) if conv_size else None
        self.mem = NeuralMemory(dim=d_model, heads=num_heads, dim_head=d_model // num_heads, chunk_size=chunk_size,
                                batch_size=batch_size, **memory_kw)
        _materialise_initial_weights(self.mem)

    def forward(self, x):
        if self.conv is not None:
            x = self.conv(x)
        retrieved, _ = self.mem(x)
        return retrieved

    def state_size(self, context: int) -> int:
        """The memory MLP's weights per head (its ``memory_model_parameters``, ``[heads, …]``) and one momentum
        buffer of the same size per momentum order, + the conv cache."""
        return neural_memory_state_size(self.mem) + (self.conv.state_size() if self.conv is not None else 0)


class TitansMACRef(nn.Module):
    """titans-pytorch's whole ``MemoryAsContextTransformer`` (its own embedding, axial positions, hyper-connections
    with 4 residual streams, segmented attention with persistent and long-term memory tokens, a ``NeuralMemory`` in
    every layer, RMSNorm, untied head): ids ``[B, T]`` → logits ``[B, T, V]``. Not in the :class:`RefLM` shell,
    because MAC is a whole model. Sizes as our ``titans_mac`` preset (segments of 16, 4 persistent tokens, 4 heads
    of d_model / 4); 4 long-term memory tokens per segment (its train_mac.py example's count; its constructor's
    default 0 turns the memory read into a residual add, not memory-as-context); everything else its defaults,
    among them the NeuralMemory's: 1 head of d_model, MemoryMLP depth 2 × 4 inside LN + residual, momentum, step
    size ≤ 1, and chunk = segment + long-term tokens = 20 (ours: 4 heads of 16, η ≤ 0.1, per-token updates)."""

    def __init__(self, vocab_size: int, d_model: int = 64, num_layers: int = 2, segment: int = 16,
                 persistent_tokens: int = 4, longterm_tokens: int = 4, num_heads: int = 4):
        super().__init__()
        _use_peers()
        from titans_pytorch import MemoryAsContextTransformer
        self.segment, self.longterm_tokens = segment, longterm_tokens
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.mac = MemoryAsContextTransformer(
            num_tokens=vocab_size, dim=d_model, depth=num_layers, segment_len=segment,
            num_persist_mem_tokens=persistent_tokens, num_longterm_mem_tokens=longterm_tokens,
            dim_head=self.head_dim, heads=num_heads)
        for mem in self.memories():
            _materialise_initial_weights(mem)

    def memories(self):
        return [layer[4] for layer in self.mac.layers if layer[4] is not None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mac(ids)

    def state_size(self, context: int) -> int:
        """Per layer: the memory's weights and momenta (:func:`neural_memory_state_size`) + the KV cache of one
        attention window (segment + long-term tokens), 2·H·D_h per token; persistent tokens are parameters."""
        kv = (self.segment + self.longterm_tokens) * 2 * self.num_heads * self.head_dim
        return sum(neural_memory_state_size(mem) + kv for mem in self.memories())


def _rope(x, base: float = 10000.0):
    """Rotary embedding (half-split pairs, as fla's RotaryEmbedding) of ``x: [B, T, H, D]`` at positions 0 … T − 1."""
    T, D = x.shape[1], x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)
    ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv            # [T, D/2]
    cos, sin = ang.cos()[None, :, None].to(x.dtype), ang.sin()[None, :, None].to(x.dtype)
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def _lact_orthogonalise(g):
    """Newton–Schulz as LaCT's ``zeropower_via_newtonschulz5`` (its five quintic coefficient triples, Frobenius
    normalisation, the wide orientation), in float32 where LaCT runs it in bf16. ``g: [N, r, c]``."""
    tall = g.shape[1] > g.shape[2]
    x = g.transpose(1, 2) if tall else g
    x = x / (x.norm(dim=(1, 2), keepdim=True) + 1e-7)
    for a, b, c in ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)):
        A = x @ x.transpose(1, 2)
        x = a * x + (b * A + c * A @ A) @ x
    return x.transpose(1, 2) if tall else x


class LaCTMixer(nn.Module):
    """The LaCT language layer as its authors' code builds it (``LaCTSWIGLULayer`` and
    ``block_causal_lact_swiglu`` of github.com/a1600012888/LaCT, lact_llm), re-implemented here in plain PyTorch.

    qkv (no bias) → [optional RMSNorm of q, k] → RoPE → sliding-window causal SDPA; the fast q, k: per-channel
    scale and offset; q, k, v: SiLU; q, k: ℓ2 per fast-weight head, then the same RoPE in the attention head layout.
    Fast weights per head W0, W2: [h, d] (std d^-1/2), W1: [d, h] (std h^-1/2), f(x) = W1 (silu(W0 x) ⊙ W2 x).
    Three per-token step sizes per head, softplus(lr_proj x + softplus⁻¹(0.001)); momentum σ(m_proj x) averaged
    over the chunk. Per chunk: read with the chunk-start weights, then the summed dot-product ascent direction
    (each token × its step), momentum, Newton–Schulz (``use_muon``), W += ΔW, every row back to its initial norm;
    the last chunk is read only. Output: RMSNorm per head (affine) ⊙ silu(ttt_scale_proj x), added to the attention
    output, o_proj. Every nn.Linear of the layer is initialised as the authors' ``_init_weights``: N(0, 0.006²),
    zero bias (so the TTT branch starts near zero, silu(≈ 0)). Defaults are its LaCTSWIGLUConfig's except
    ``use_muon`` (the config's default is False; the paper's language models use Muon).
    """

    def __init__(self, d_model: int, num_heads: int = 4, fw_heads: int = 2, chunk_size: int = 16,
                 window: int = 16, use_muon: bool = True, use_momentum: bool = True, qk_norm: bool = False,
                 init_std: float = 0.006, base_lr: float = 1e-3, rope_base: float = 10000.0):
        super().__init__()
        self.H, self.hd = num_heads, d_model // num_heads
        self.F, self.fd = fw_heads, d_model // fw_heads
        self.chunk, self.window, self.use_muon, self.rope_base = chunk_size, window, use_muon, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.q_norm = nn.RMSNorm(d_model, eps=1e-6) if qk_norm else None
        self.k_norm = nn.RMSNorm(d_model, eps=1e-6) if qk_norm else None
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        d = self.fd
        self.w0 = nn.Parameter(torch.randn(fw_heads, d, d) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(fw_heads, d, d) / math.sqrt(d))
        self.w1 = nn.Parameter(torch.randn(fw_heads, d, d) / math.sqrt(d))
        self.lr_proj = nn.Linear(d_model, 3 * fw_heads)
        self.base_lr_inv = base_lr + math.log(-math.expm1(-base_lr))
        self.qk_scale = nn.Parameter(torch.ones(2, d_model))
        self.qk_offset = nn.Parameter(torch.zeros(2, d_model))
        self.ttt_scale_proj = nn.Linear(d_model, fw_heads)
        self.ttt_norm = nn.RMSNorm(d, eps=1e-6)
        self.momentum_proj = nn.Linear(d_model, fw_heads) if use_momentum else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def _heads(self, x, n):                                  # [B, T, n·d] → [B·n, T, d]
        B, T, C = x.shape
        return x.view(B, T, n, C // n).transpose(1, 2).reshape(B * n, T, C // n)

    def _swa(self, q, k, v):
        B, T, C = q.shape
        q, k, v = (t.view(B, T, self.H, self.hd) for t in (q, k, v))
        q, k = _rope(q, self.rope_base), _rope(k, self.rope_base)
        i = torch.arange(T, device=q.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=allowed)
        return o.transpose(1, 2).reshape(B, T, C)

    def _ttt(self, w0, w1, w2, q, k, v, lr0, lr1, lr2, momentum):
        """Block-causal "apply, then update" over chunks; ``q, k, v: [N, T, d]``, lrs / momentum ``[N, T, 1]``."""
        norms = [w.norm(dim=2, keepdim=True) for w in (w0, w1, w2)]
        mom = [torch.zeros_like(w) for w in (w0, w1, w2)] if momentum is not None else None
        T, b = q.shape[1], self.chunk
        outs = []
        for s in range(0, T, b):
            e = min(s + b, T)
            qi = q[:, s:e].transpose(1, 2)                                   # [N, d, n]
            outs.append(torch.bmm(w1, F.silu(torch.bmm(w0, qi)) * torch.bmm(w2, qi)).transpose(1, 2))
            if e == T:
                break                                                        # the last chunk is read, not written
            ki, vi = k[:, s:e].transpose(1, 2), v[:, s:e].transpose(1, 2)   # [N, d, n]
            gate, up = torch.bmm(w0, ki), torch.bmm(w2, ki)
            hidden = F.silu(gate) * up
            dhidden = torch.bmm(w1.transpose(1, 2), vi)
            sig = torch.sigmoid(gate)
            dgate = dhidden * up * sig * (1 + gate * (1 - sig))             # through silu
            dup = dhidden * F.silu(gate)
            d1 = torch.bmm(vi, (hidden * lr1[:, s:e].transpose(1, 2)).transpose(1, 2))
            d0 = torch.bmm(dgate, ki.transpose(1, 2) * lr0[:, s:e])
            d2 = torch.bmm(dup, ki.transpose(1, 2) * lr2[:, s:e])
            deltas = [d0, d1, d2]
            if mom is not None:
                m = momentum[:, s:e].mean(1, keepdim=True)                   # [N, 1, 1]
                deltas = [dw + m * prev for dw, prev in zip(deltas, mom)]
                mom = deltas
            if self.use_muon:
                deltas = [_lact_orthogonalise(dw) for dw in deltas]
            w0, w1, w2 = (w + dw for w, dw in zip((w0, w1, w2), deltas))
            w0, w1, w2 = (w / (w.norm(dim=2, keepdim=True) + 1e-5) * n for w, n in zip((w0, w1, w2), norms))
        return torch.cat(outs, 1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self._swa(q, k, v)
        fq, fk = q * self.qk_scale[0] + self.qk_offset[0], k * self.qk_scale[1] + self.qk_offset[1]
        fq, fk, fv = F.silu(fq), F.silu(fk), F.silu(v)
        fq, fk = (self._heads(t, self.F) for t in (fq, fk))
        fq, fk = (t / (t.norm(dim=-1, keepdim=True) + 1e-5) for t in (fq, fk))
        fq, fk = (_rope(t.view(B, self.F, T, self.fd).transpose(1, 2).reshape(B, T, self.H, self.hd),
                        self.rope_base).reshape(B, T, C) for t in (fq, fk))   # rotated in the attention head layout
        fq, fk, fv = (self._heads(t, self.F) for t in (fq, fk, fv))
        lr = F.softplus(self.lr_proj(x) + self.base_lr_inv)                  # [B, T, 3·F]
        lr0, lr1, lr2 = self._heads(lr, self.F).chunk(3, dim=-1)             # [B·F, T, 1] each
        momentum = None
        if self.momentum_proj is not None:
            momentum = self._heads(torch.sigmoid(self.momentum_proj(x)), self.F)
        w0, w1, w2 = (w.repeat(B, 1, 1) for w in (self.w0, self.w1, self.w2))
        y = self._ttt(w0, w1, w2, fq, fk, fv, lr0, lr1, lr2, momentum)      # [B·F, T, d]
        y = self.ttt_norm(y).view(B, self.F, T, self.fd)
        y = y * F.silu(self.ttt_scale_proj(x)).transpose(1, 2).unsqueeze(-1)
        return self.o_proj(o + y.transpose(1, 2).reshape(B, T, C))

    def state_size(self, context: int) -> int:
        """Fast weights (+ momentum) and the window's KV cache, as ``LaCTLayer.state_size``."""
        fast = sum(w.numel() for w in (self.w0, self.w1, self.w2))
        return fast * (2 if self.momentum_proj is not None else 1) + self.window * 2 * self.qkv.in_features


# --------------------------------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------------------------------
DESCRIPTIONS = {
    "softmax_transformer": "pre-LN Transformer, causal softmax SDPA, 4 heads, GELU MLP 4×, default inits, untied "
                           "head; positions per the run's options (learned: an nn.Embedding at PyTorch's N(0, 1) "
                           "init, the runs before 2026-12-06; learned_small: N(0, 0.02²); rope)",
    "fla_gated_deltanet": "fla 0.6 GatedDeltaNet layer (4 heads, head_dim 16, expand_v 2 (fla's default), conv4+SiLU, "
                          "ℓ2 q/k, β=σ, g=−exp(A_log)·softplus(a+dt_bias), "
                          "RMSNorm⊙swish gate) in a pre-LN LM; recurrence fla naive_chunk_gated_delta_rule "
                          "(chunk 16)",
    "fla_deltanet": "fla DeltaNet layer (GDN layer without decay; 4 heads of 16, expand_v 1, RMSNorm, no output "
                    "gate, as fla DeltaNet's defaults) in a pre-LN LM; recurrence fla delta_rule_chunkwise (chunk 16)",
    "titans_neural_memory": "causal depthwise conv4 → titans-pytorch NeuralMemory(heads 4, dim_head 16, chunk_size 4, "
                            "else defaults) in a pre-LN LM",
    "lact": "LaCT's language layer re-implemented from its authors' code (SWA + SwiGLU fast weights, 2 heads of 32, "
            "Muon, momentum, weight norm, apply-then-update; chunk = window = T/4, see the run's options; its "
            "N(0, 0.006²) Linear init) in a pre-LN LM",
    "ours_in_ref_lm": "probe, not a reference: an atlaslab preset's mixers (see the run's options) in the references' "
                      "LM shell (LayerNorm, GELU MLP 4×, default inits, untied head with bias, no positions), to "
                      "tell a gap of the mixer from one of the language model around it",
    "ref_in_our_lm": "probe, not a reference: an atlaslab preset's language model (RMSNorm, SwiGLU MLP, its embedding "
                     "and head; see the run's options) with every mixer replaced by its fla reference's layer "
                     "(fla_deltanet or fla_gated_deltanet, built as those references build it)",
    "titans_mac": "titans-pytorch MemoryAsContextTransformer (segments of 16, 4 persistent + 4 long-term memory "
                  "tokens, 4 heads of 16, NeuralMemory (1 head of 64, chunk 20) in every layer, 4 hyper-connection "
                  "streams, else defaults); "
                  "its own embedding, axial positions and RMSNorm head",
}


#: the softmax reference's positions: ``learned`` (an nn.Embedding, PyTorch's N(0, 1) init), ``learned_small``
#: (the same, N(0, 0.02²) as GPT-2), ``rope`` (rotary q/k in every layer, no position embedding)
SOFTMAX_POSITIONS = ("learned", "learned_small", "rope")


#: fla's DeltaNet layer as the ``fla_deltanet`` reference builds it: the GDN layer without decay, output gate or
#: value expansion (fla DeltaNet's defaults)
FLA_DELTANET_KW = {"decay": False, "output_gate": False, "expand_v": 1.0}


def preset_lm(preset: str, vocab_size: int, d_model: int, num_layers: int) -> nn.Module:
    """An atlaslab preset's LanguageModel at this size, built and initialised as the bench builds it."""
    from atlaslab.models.presets import build_model, load_preset
    return build_model(load_preset(preset, [f"vocab_size={vocab_size}", f"d_model={d_model}",
                                            f"num_layers={num_layers}"]))


def preset_mixers(preset: str, vocab_size: int, d_model: int, num_layers: int):
    """The mixers of an atlaslab preset at this size, as its language model builds and initialises them."""
    return [layer.mixer for layer in preset_lm(preset, vocab_size, d_model, num_layers).layers]


def fla_mixer_in_our_lm(preset: str, vocab_size: int, d_model: int, num_layers: int, **mixer_kw) -> nn.Module:
    """The preset's LanguageModel, built and initialised as the bench builds it, with each layer's mixer replaced
    by the layer of the preset's fla reference (``fla_deltanet``: no decay, no output gate, expand_v 1;
    ``fla_gated_deltanet``: ``mixer_kw``, e.g. expand_v)."""
    ref = PRESET_REF.get(preset)
    if ref not in ("fla_deltanet", "fla_gated_deltanet"):
        raise ValueError(f"ref_in_our_lm: preset {preset!r} has no fla reference (deltanet, gated_deltanet do)")
    if ref == "fla_deltanet":
        mixer_kw = FLA_DELTANET_KW
    model = preset_lm(preset, vocab_size, d_model, num_layers)
    for layer in model.layers:
        layer.mixer = FlaGatedDeltaNetMixer(d_model, **mixer_kw)
    return model


def build_ref(name: str, vocab_size: int, d_model: int = 64, num_layers: int = 2, max_len: int = 256,
              **kw) -> nn.Module:
    """The reference LM ``name`` (see :data:`REFS`); ``kw`` go to its mixer. Raises RuntimeError when its
    peer is not installed."""
    ok, why = available(name)
    if not ok:
        raise RuntimeError(f"{name}: {why}")
    if name == "softmax_transformer":
        kw = dict(kw)
        positions = kw.pop("positions", "learned")
        if positions not in SOFTMAX_POSITIONS:
            raise ValueError(f"softmax_transformer: positions={positions!r}; valid: {', '.join(SOFTMAX_POSITIONS)}")
        model = RefLM(vocab_size, d_model, [SoftmaxAttention(d_model, rope=positions == "rope", **kw)
                                            for _ in range(num_layers)],
                      max_len=max_len if positions.startswith("learned") else None)
        if positions == "learned_small":
            nn.init.normal_(model.pos.weight, std=0.02)     # GPT-2's position init
        return model
    if name == "fla_gated_deltanet":
        return RefLM(vocab_size, d_model, [FlaGatedDeltaNetMixer(d_model, **kw) for _ in range(num_layers)])
    if name == "fla_deltanet":
        kw = {**FLA_DELTANET_KW, **kw}
        return RefLM(vocab_size, d_model, [FlaGatedDeltaNetMixer(d_model, **kw) for _ in range(num_layers)])
    if name == "lact":
        return RefLM(vocab_size, d_model, [LaCTMixer(d_model, **kw) for _ in range(num_layers)])
    if name == "titans_mac":
        return TitansMACRef(vocab_size, d_model, num_layers, **kw)
    if name == "ours_in_ref_lm":
        return RefLM(vocab_size, d_model, preset_mixers(kw.get("preset", "deltanet"), vocab_size, d_model, num_layers))
    if name == "ref_in_our_lm":
        kw = dict(kw)
        return fla_mixer_in_our_lm(kw.pop("preset", "deltanet"), vocab_size, d_model, num_layers, **kw)
    return RefLM(vocab_size, d_model, [TitansMixer(d_model, **kw) for _ in range(num_layers)])


def ref_info() -> Dict[str, str]:
    return dict(DESCRIPTIONS)


__all__ = ["PRESET_REF", "PROBES", "REFS", "RefLM", "available", "build_ref", "fla_delta_naive", "fla_gdn_naive", "ref_info"]
