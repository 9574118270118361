"""Recurrent decoding: each mixer carries its state from one call to the next, so a language model reads a prompt
once (``prefill``) and then advances one token at a time (``step``, ``generate``), each step costing one token's work.

One protocol for every mixer and block, :func:`decode_mixer`:

    y, state = decode_mixer(mixer, x, state)      # x: [B, T, d_model], the next T ≥ 1 tokens; state None: a new sequence

and chained calls equal one ``mixer(x)`` over the concatenated tokens (in float64 to rounding): the state is the
whole of what the forward's causal computation keeps about the past, never an approximation of it.

What each mixer carries (docs/decoding.md):

- memory layer: its :class:`~atlaslab.models.layers.MemoryLayerState` (the memory with its chunk-start anchor, so a
  step in the middle of a training chunk b takes its gradient where the full forward does; the Omega window's last
  c − 1 tokens; momentum; the q/k/v conv caches), through ``forward(x, state, return_state=True)``;
- ``attention``: a :class:`KVCache` of every token's rotated k and v; ``swa``: the same cache cut to the last
  ``window − 1`` tokens (plus an always-visible prefix);
- ``forgetting_attention``: the KV cache and the running sum Σ log f of each cached token (attention form) or the φ*
  slot memory's state (memory form), plus the raw k, v of the last token for the token shifts;
- ``lmm`` / ``mag`` / ``mal``: the memory layer's state and the SWA cache; the persistent tokens P go in with the first
  call, as the forward prepends them;
- ``mac``: the running memory, the memory at the current segment's start (which that segment's reads see), the read
  path's conv cache and the segment's KV cache over [P ‖ h ‖ S];
- ``lact``: the SWA cache; the fast-weight memory as the open chunk started (every query of the chunk reads it);
  the open chunk's fast k, v and gates, written in one memorize call once the chunk is whole (its mean θ is known
  only then).

Decoders are found by the mixer's exact class (a subclass that changes ``forward`` must not inherit a decoder that
no longer matches it): a user mixer opts in with a ``decode(x, state) -> (y, state)`` method or
:func:`register_decoder`.

Tensor key: B batch, T new tokens, n cached tokens, H heads, D head dim, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.engines import MemoryState, initial_state, memorize, read_memory
from atlaslab.models.attention import Attention, SlidingWindowAttention
from atlaslab.models.blocks import LMMBlock, MACBlock, MAGBlock, MALBlock
from atlaslab.models.forgetting_attention import ForgettingAttention, cumulative_bias
from atlaslab.models.lact import LaCTLayer
from atlaslab.models.layers import MemoryLayer

Decoder = Callable[[nn.Module, torch.Tensor, Any], Tuple[torch.Tensor, Any]]
DECODERS: Dict[type, Decoder] = {}


def register_decoder(cls: type) -> Callable[[Decoder], Decoder]:
    """Register ``fn(mixer, x, state) -> (y, state)`` as the decoder of mixers of exactly class ``cls``."""
    def add(fn: Decoder) -> Decoder:
        DECODERS[cls] = fn
        return fn
    return add


def decode_mixer(mixer: nn.Module, x: torch.Tensor, state: Any = None, where: str = "mixer") -> Tuple[torch.Tensor, Any]:
    """Advance ``mixer`` over the next tokens ``x: [B, T, d_model]`` from ``state`` (None: a new sequence).

    Returns ``(y: [B, T, d_model], new_state)``; ``where`` names the mixer in the error a mixer without a decoder
    raises (``NotImplementedError``).
    """
    own = getattr(mixer, "decode", None)
    if callable(own):
        return own(x, state)
    fn = DECODERS.get(type(mixer))
    if fn is None:
        known = sorted(c.__name__ for c in DECODERS)
        raise NotImplementedError(
            f"{where}: {type(mixer).__name__} has no decoder, so the model cannot decode token by token; give it a "
            f"decode(x, state) -> (y, state) method or register one with atlaslab.models.decoding.register_decoder "
            f"(mixers that decode: {', '.join(known)})")
    return fn(mixer, x, state)


# --------------------------------------------------------------------------------------------------
# attention: KV caches
# --------------------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Keys and values an attention layer keeps: ``k, v: [B, H, n, D]`` (k rotated at its position), ``pos: [n]`` the
    cached tokens' positions (shared by the batch rows), ``length`` the tokens consumed so far (the next position)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: int


def _positions(start: int, T: int, device) -> torch.Tensor:
    return torch.arange(start, start + T, device=device)


def _extend(cache: Optional[KVCache], k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """The cache's k, v ``[B, H, n, D]`` and positions followed by the new ``k, v: [B, T, H, D]`` at ``pos: [T]``."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if cache is None:
        return k, v, pos
    return torch.cat([cache.k, k], 2), torch.cat([cache.v, v], 2), torch.cat([cache.pos, pos])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``q: [B, T, H, D]`` over ``k, v: [B, H, n, D]`` with a boolean (True = attend) or additive
    ``bias`` (``[T, n]`` or ``[B, H, T, n]``) → ``o: [B, T, H, D]``."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=bias)
    return o.transpose(1, 2)


def _attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int], prefix: int) -> torch.Tensor:
    """``[T, n]``: causal by position, within the last ``window`` positions, the first ``prefix`` always visible
    (:func:`atlaslab.models.attention.attention_mask` over absolute positions)."""
    i, j = q_pos[:, None], k_pos[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & ((i - j < window) | (j < prefix))
    return allowed


def decode_attention(attn: Attention, x: torch.Tensor, state: Optional[KVCache], prefix: int = 0):
    """Causal (or sliding-window) attention over the cache and ``x: [B, T, d_model]``, RoPE at the tokens' positions.

    ``prefix``: the first positions stay visible to every query (persistent tokens of MAG/MAL). A sliding window
    keeps only what a later query can see: the prefix and the last ``window − 1`` tokens.
    """
    B, T, _ = x.shape
    start = state.length if state is not None else 0
    pos = _positions(start, T, x.device)
    q, k, v = attn.qkv(x, pos)
    k_all, v_all, pos_all = _extend(state, k, v, pos)
    o = _attend(q, k_all, v_all, _attention_mask(pos, pos_all, attn.window, prefix))
    y = attn.o_proj(o.reshape(B, T, -1))
    length = start + T
    if attn.window is not None:
        keep = (pos_all < prefix) | (pos_all > length - attn.window)
        k_all, v_all, pos_all = k_all[:, :, keep], v_all[:, :, keep], pos_all[keep]
    return y, KVCache(k_all, v_all, pos_all, length)


register_decoder(Attention)(decode_attention)
register_decoder(SlidingWindowAttention)(decode_attention)


# --------------------------------------------------------------------------------------------------
# forgetting attention (FoX)
# --------------------------------------------------------------------------------------------------
@dataclass
class FoXState:
    """Forgetting attention's state after ``length`` tokens.

    kv, log_f: the attention form's KV cache and, per cached token j, c_j = Σ_{l≤j} log f_l (``[B, H, n]``; the score
    bias is c_i − c_j). memory: the memory form's slot-memory state. last_k, last_v: raw k, v projections of the
    last token (``[B, 1, H, D]``), what the token shifts mix into the next one.
    """

    length: int
    kv: Optional[KVCache] = None
    log_f: Optional[torch.Tensor] = None
    memory: Any = None
    last_k: Optional[torch.Tensor] = None
    last_v: Optional[torch.Tensor] = None


@register_decoder(ForgettingAttention)
def decode_forgetting_attention(fox: ForgettingAttention, x: torch.Tensor, state: Optional[FoXState]):
    """FoX over the next tokens: D_ij = c_i − c_j continues the running sum of log f (attention form), or the slot
    memory continues from its state (memory form)."""
    B, T, _ = x.shape
    H, D = fox.num_heads, fox.head_dim
    start = state.length if state is not None else 0
    pos = _positions(start, T, x.device)
    shift_prev = (state.last_k, state.last_v) if state is not None else None
    q, k, v, log_f = fox.project(x, pos, shift_prev=shift_prev)
    new = FoXState(start + T)
    if fox.cfg.form == "attention":
        lf = log_f.to(torch.promote_types(log_f.dtype, torch.float32)).transpose(1, 2)     # [B, H, T], ≥ fp32
        before = state.log_f[..., -1:] if state is not None else lf.new_zeros(B, H, 1)
        c = torch.cat([before, lf], -1).cumsum(-1)[..., 1:]                                # the forward's cumsum, continued
        k_all, v_all, pos_all = _extend(state.kv if state is not None else None, k, v, pos)
        c_all = torch.cat([state.log_f, c], -1) if state is not None else c
        bias = cumulative_bias(c, c_all, pos_all[None, :] <= pos[:, None]).to(q.dtype)
        o = _attend(q, k_all, v_all, bias)
        new.kv, new.log_f = KVCache(k_all, v_all, pos_all, start + T), c_all
    else:
        o, new.memory = memorize(q / math.sqrt(D), k, v, fox.parts, {"retention": log_f.exp()}, mode=fox.cfg.mode,
                                 initial_state=state.memory if state is not None else None)
    if fox.k_shift is not None or fox.v_shift is not None:
        last = x[:, -1:]
        new.last_k, new.last_v = fox.k_proj(last).view(B, 1, H, D), fox.v_proj(last).view(B, 1, H, D)
    return fox.output(o, x), new


# --------------------------------------------------------------------------------------------------
# memory layer and the blocks that prepend persistent tokens
# --------------------------------------------------------------------------------------------------
@register_decoder(MemoryLayer)
def decode_memory_layer(layer: MemoryLayer, x: torch.Tensor, state):
    """The memory layer's own chained calls: ``forward(x, state, return_state=True)``."""
    return layer(x, state, return_state=True)


@dataclass
class BlockState:
    """A memory block's state: its memory layer's state and its sliding-window attention's cache."""

    memory: Any = None
    swa: Optional[KVCache] = None


def _with_persistent(block, x: torch.Tensor, state) -> Tuple[torch.Tensor, int]:
    """P ‖ x on a sequence's first call (the forward's prepend), else x; and how many leading outputs to drop."""
    if state is None and block.persistent is not None:
        return block._prepend(x), block.num_persistent
    return x, 0


@register_decoder(LMMBlock)
def decode_lmm(block: LMMBlock, x: torch.Tensor, state: Optional[BlockState]):
    xt, drop = _with_persistent(block, x, state)
    y, mem = block.memory(xt, state.memory if state is not None else None, return_state=True)
    return y[:, drop:], BlockState(memory=mem)


@register_decoder(MAGBlock)
def decode_mag(block: MAGBlock, x: torch.Tensor, state: Optional[BlockState]):
    """o = norm(SWA*(P‖x)) ⊙ σ(norm(M(P‖x))), both branches continued from their states."""
    xt, drop = _with_persistent(block, x, state)
    state = state or BlockState()
    y, swa = decode_attention(block.swa, xt, state.swa, prefix=block.num_persistent)
    mem = None
    if block.cfg.gate != "none":
        m, mem = block.memory(xt, state.memory, return_state=True)
        if block.cfg.normalize:
            y, m = block.norm_y(y), block.norm_m(m)
        y = y * torch.sigmoid(m)
    return y[:, drop:], BlockState(mem, swa)


@register_decoder(MALBlock)
def decode_mal(block: MALBlock, x: torch.Tensor, state: Optional[BlockState]):
    """o = SWA*(RMSNorm(M(P‖x))), the memory then the SWA continued from their states."""
    xt, drop = _with_persistent(block, x, state)
    state = state or BlockState()
    m, mem = block.memory(xt, state.memory, return_state=True)
    y, swa = decode_attention(block.swa, block.norm(m), state.swa, prefix=block.num_persistent)
    return y[:, drop:], BlockState(mem, swa)


# --------------------------------------------------------------------------------------------------
# memory as context (MAC)
# --------------------------------------------------------------------------------------------------
@dataclass
class MACState:
    """Titans MAC's state after ``length`` tokens (segments of C tokens start at multiples of C).

    memory: the memory written with every y so far; segment_memory: the memory as the current segment started, which
    all of that segment's reads h = M*(q(S)) see; q_cache: the read path's conv cache; kv: the segment's attention
    cache over [P ‖ h ‖ S], ``pos`` holding each entry's index in the segment (−1 for P: always visible) and
    ``length`` the segment's tokens so far.
    """

    length: int = 0
    memory: Any = None
    segment_memory: Any = None
    q_cache: Optional[torch.Tensor] = None
    kv: Optional[KVCache] = None


def _mac_piece(block: MACBlock, s: torch.Tensor, state: MACState) -> torch.Tensor:
    """Advance MAC over ``s: [B, L, d_model]``, tokens j0..j0+L−1 of one segment (``state`` updated in place)."""
    B, L, _ = s.shape
    C, n_p = block.cfg.segment, block.num_persistent
    attn, dev = block.attn, s.device
    j0 = state.length % C
    if j0 == 0:                                        # a segment starts: its reads see the memory as it is now
        state.segment_memory, state.kv = state.memory, None
        if block.persistent is not None:
            p = block.persistent.to(s.dtype).expand(B, -1, -1)
            _, pk, pv = attn.qkv(p, _positions(0, n_p, dev))
            state.kv = KVCache(pk.transpose(1, 2), pv.transpose(1, 2), torch.full((n_p,), -1, device=dev), 0)
    j = _positions(j0, L, dev)                         # within-segment index of each new token
    if block.cfg.read_tokens:
        h, state.q_cache = block.memory.read(s, state.segment_memory, state.q_cache)
        _, hk, hv = attn.qkv(h, n_p + j)
        state.kv = KVCache(*_extend(state.kv, hk, hv, j), j0 + L)
        s_pos = n_p + C + j
    else:
        s_pos = n_p + j
    q, k, v = attn.qkv(s, s_pos)
    k_all, v_all, key_all = _extend(state.kv, k, v, j)
    state.kv = KVCache(k_all, v_all, key_all, j0 + L)
    o = _attend(q, k_all, v_all, key_all[None, :] <= j[:, None])
    y = attn.o_proj(o.reshape(B, L, -1))
    if block.uses_memory:
        m, state.memory = block.memory(s if block.cfg.write == "input" else y, state.memory, return_state=True)
        if block.cfg.gate != "none":
            y = block.norm_y(y) * torch.sigmoid(block.norm_m(m))
    state.length += L
    return y


@register_decoder(MACBlock)
def decode_mac(block: MACBlock, x: torch.Tensor, state: Optional[MACState]):
    """Titans MAC over the next tokens, cut at segment boundaries: per segment, attention over
    [P ‖ M*_{segment start}(q(S)) ‖ S] with the segment's cache, and the memory written with each output
    (or with each input token, ``write="input"``)."""
    old = state or MACState()
    state = MACState(old.length, old.memory, old.segment_memory, old.q_cache, old.kv)
    C, T = block.cfg.segment, x.shape[1]
    outs, t = [], 0
    while t < T:
        L = min(C - state.length % C, T - t)
        outs.append(_mac_piece(block, x[:, t:t + L], state))
        t += L
    return torch.cat(outs, 1), state


# --------------------------------------------------------------------------------------------------
# LaCT: sliding-window attention + the chunk-wise fast-weight memory
# --------------------------------------------------------------------------------------------------
@dataclass
class LaCTState:
    """The LaCT layer's state after ``length`` tokens.

    kv: the SWA cache (k rotated at its position). memory: with :attr:`LaCTLayer.chunk_momentum`, the fast-weight
    memory as the open chunk started, the weights W⁽ⁿ⁾ all its queries read; otherwise (causal per-token gates) the
    running memory, which ``memorize`` continues mid-chunk by itself. pending: the open chunk's tokens not yet
    written (chunk momentum only), ``{"k", "v": [B, n, H, D], "window", "momentum": [B, n, H]}`` with n < b, the
    fast keys and values and each token's own γ_t and θ_t; None when the last chunk is whole.
    """

    length: int
    kv: KVCache
    memory: MemoryState
    pending: Optional[Dict[str, torch.Tensor]] = None


def _lact_memory(layer: LaCTLayer, fq, fk, fv, gates: Dict[str, torch.Tensor], state: Optional[LaCTState]):
    """The fast-weight branch over the next tokens ``fq, fk, fv: [B, T, H, D]`` (``gates``: each token's own γ, θ
    ``[B, T, H]``) → ``(o [B, T, H, D], memory, pending)``.

    With chunk momentum the open chunk's tokens (pending + new) start at a chunk boundary, so the chunks they complete
    are written by ONE memorize call from the chunk-start memory with the forward's gates (each chunk's true mean θ);
    that call also reads their new queries at the chunk-start weights (``read: chunk``). The tokens of a chunk still
    open read the memory after the last whole chunk (:func:`~atlaslab.engines.read_memory`) and wait in ``pending``.
    A partial chunk thus never writes: in the forward as here, its reads see only the chunk-start weights. (Chunk
    momentum comes with ``ns_granularity: chunk``, which the spec allows only with ``read: chunk``.)
    """
    B, T = fq.shape[:2]
    memory = state.memory if state is not None else initial_state(layer.parts, B, fq.dtype, fq.device)
    if not layer.chunk_momentum:                           # causal gates: memorize continues mid-chunk exactly
        o, memory = memorize(fq, fk, fv, layer.parts, gates, mode=layer.cfg.mode, initial_state=memory)
        return o, memory, None
    old = state.pending if state is not None else None
    n0 = old["k"].shape[1] if old is not None else 0
    new = {"k": fk, "v": fv, **gates}
    tokens = {name: torch.cat([old[name], t], 1) for name, t in new.items()} if old is not None else new
    b = layer.spec.chunk_size
    whole = (n0 + T) // b * b                              # tokens of the chunks this call completes
    outs = []
    if whole:
        head = {name: t[:, :whole] for name, t in tokens.items()}
        # the pending tokens' queries were read already: their keys stand in (what they read is dropped)
        q = torch.cat([head["k"][:, :n0], fq[:, :whole - n0]], 1)
        o, memory = memorize(q, head["k"], head["v"], layer.parts, layer.chunk_gates({g: head[g] for g in gates}),
                             mode=layer.cfg.mode, initial_state=memory)
        outs.append(o[:, n0:])
    if whole < n0 + T:
        outs.append(read_memory(layer.parts, memory, fq[:, max(whole - n0, 0):]))
    pending = {name: t[:, whole:] for name, t in tokens.items()} if whole < n0 + T else None
    return torch.cat(outs, 1), memory, pending


@register_decoder(LaCTLayer)
def decode_lact(layer: LaCTLayer, x: torch.Tensor, state: Optional[LaCTState]):
    """LaCT over the next tokens ``x: [B, T, d_model]``: the SWA continued from its cache and the fast-weight branch
    from the chunk-start memory and the open chunk (:func:`_lact_memory`), at the tokens' positions."""
    if state is not None and not isinstance(state, LaCTState):
        raise TypeError(f"lact decoder: state must be None (a new sequence) or the LaCTState a previous call "
                        f"returned, got {type(state).__name__}")
    B, T, _ = x.shape
    start = state.length if state is not None else 0
    pos = _positions(start, T, x.device)
    q, k, v = layer.project(x)
    qa, ka, va = layer.attention_heads(q, k, v, pos)
    k_all, v_all, pos_all = _extend(state.kv if state is not None else None, ka, va, pos)
    o_attn = _attend(qa, k_all, v_all, _attention_mask(pos, pos_all, layer.cfg.window, 0)).reshape(B, T, -1)
    keep = pos_all > start + T - layer.cfg.window           # what a later query still sees: the last window − 1
    kv = KVCache(k_all[:, :, keep], v_all[:, :, keep], pos_all[keep], start + T)
    fq, fk, fv = layer.fast_qkv(q, k, v, pos)
    o, memory, pending = _lact_memory(layer, fq, fk, fv, layer.token_gates(x), state)
    return layer.output(o_attn, o, x), LaCTState(start + T, kv, memory, pending)


# --------------------------------------------------------------------------------------------------
# the language model
# --------------------------------------------------------------------------------------------------
@dataclass
class LMState:
    """A language model's decoding state: one state per layer (what its mixer's decoder returned) for ``batch``
    sequences after ``length`` tokens."""

    layers: List[Any]
    length: int
    batch: int


def _check_ids(ids: torch.Tensor, what: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1 or ids.is_floating_point():
        shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{what}: expected integer token ids [B, T] with T ≥ 1, got {shape}")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, state: Optional[LMState] = None) -> Tuple[torch.Tensor, LMState]:
    """Run ``model`` over ``input_ids: [B, T]`` from ``state`` (None: a new sequence) → ``(logits [B, T, V], state)``."""
    _check_ids(input_ids, "prefill")
    if state is not None and len(state.layers) != len(model.layers):
        raise ValueError(f"prefill: the state has {len(state.layers)} layer states, the model {len(model.layers)} "
                         f"layers (a state from another model?)")
    if state is not None and state.batch != input_ids.shape[0]:
        raise ValueError(f"prefill: the state holds {state.batch} sequences, input_ids has {input_ids.shape[0]}")
    layer_states = state.layers if state is not None else [None] * len(model.layers)
    x = model.embed(input_ids)
    if getattr(model, "armt_stack", None) is not None:       # ARMT through_stack: all layers per segment
        x, new = model.armt_stack(model.layers, x, state.layers if state is not None else None)
    else:
        new = []
        for key, layer, s in zip(model.layer_keys, model.layers, layer_states):
            x, s = layer.decode(x, s, where=f"mixers.{key}")
            new.append(s)
    length = (state.length if state is not None else 0) + input_ids.shape[1]
    return model.head_logits(x), LMState(new, length, input_ids.shape[0])


def step(model, token_ids: torch.Tensor, state: LMState) -> Tuple[torch.Tensor, LMState]:
    """One token per sequence, ``token_ids: [B]``, after ``state`` → ``(logits [B, V], state)``."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        shape = list(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise ValueError(f"step: expected one token id per sequence, [B], got {shape}")
    if state is None:
        raise ValueError("step: needs the state that prefill (or a previous step) returned")
    logits, state = prefill(model, token_ids[:, None], state)
    return logits[:, 0], state


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row of ``logits: [B, V]`` → ``[B]``: the argmax at ``temperature`` 0, else a draw from
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and to the smallest set whose
    probability reaches ``top_p`` (nucleus; the most likely token always stays)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.float() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = z.sort(-1, descending=True)
        probs = sorted_z.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p                       # the more likely tokens already reach top_p
        z = z.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator)[:, 0]


def _check_generate_args(max_new_tokens, temperature, top_k, top_p, eos_token_id, vocab_size) -> None:
    def bad(name, value, need):
        raise ValueError(f"generate: {name} {need}, got {value!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        bad("max_new_tokens", max_new_tokens, "must be an integer ≥ 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        bad("temperature", temperature, "must be a finite number ≥ 0 (0: greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        bad("top_k", top_k, "must be an integer ≥ 1 or None")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        bad("top_p", top_p, "must be in (0, 1] or None")
    if temperature == 0 and (top_k is not None or top_p is not None):
        bad("temperature", temperature, "must be > 0 with top_k / top_p (temperature 0 is greedy)")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < vocab_size):
        bad("eos_token_id", eos_token_id, f"must be a token id in [0, {vocab_size}) or None")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
             eos_token_id: Optional[int] = None) -> torch.Tensor:
    """Continue ``input_ids: [B, T]`` by up to ``max_new_tokens`` tokens → ``[B, T + n]`` (prompt included).

    One prefill of the prompt, then one :func:`step` per token; tokens chosen by :func:`sample`. With ``eos_token_id``
    a sequence that has produced it continues with it, and generation stops once every sequence has (n is then
    smaller than ``max_new_tokens``).
    """
    _check_ids(input_ids, "generate")
    _check_generate_args(max_new_tokens, temperature, top_k, top_p, eos_token_id, model.cfg.vocab_size)
    if max_new_tokens == 0:
        return input_ids
    logits, state = prefill(model, input_ids)
    logits = logits[:, -1]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    out = [input_ids]
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done = done | (token == eos_token_id)
        out.append(token[:, None])
        if i == max_new_tokens - 1 or bool(done.all()):
            break
        logits, state = step(model, token, state)
    return torch.cat(out, 1)


__all__ = ["BlockState", "DECODERS", "FoXState", "KVCache", "LMState", "LaCTState", "MACState", "decode_attention",
           "decode_mixer", "generate", "prefill", "register_decoder", "sample", "step"]
