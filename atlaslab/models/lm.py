"""The language model: a Llama-style stack whose token mixers come from the registry.

    ids → embedding → L × [ x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x)) ] → RMSNorm → output head

Each layer's mixer is a registered ``mixer`` (``memory``, ``attention``, ``swa``, …) or ``block`` (``lmm``,
``mag``, ``mal``, ``mac``), chosen by a layer pattern that cycles over the layers, so a hybrid is e.g.

    layers: [atlas, atlas, swa]
    mixers:
      atlas: {name: memory, memory: {...}}
      swa:   {name: swa, window: 64}

Embedding and head initialisation (``docs/concepts/language-model.md``): the token embedding starts at unit
scale (``init_std: 1.0``, PyTorch's ``nn.Embedding`` default) and the head is untied, with ``nn.Linear``'s
default init (std (3·d_model)^-1/2, so the first logits have std ≈ 0.6). A pre-norm residual stream carries the token's identity
only in the embedding; the mixers' and MLPs' outputs start at ≈ 0.1–0.25 RMS, so an embedding at GPT-2's
std 0.02 is buried under them and, tied to the head, also gives near-uniform logits (std ≈ 0.16): such a model
stays at the "a value from the context" level on MQAR. ``tie_embeddings: true`` shares the unit-scale
embedding and rescales the logits by ``logit_scale`` (default ``d_model^-1/2``, as T5 does when it ties).

A model config is validated as a whole (:func:`resolve_lm_config`) before anything is built; every error is a
:class:`ConfigError` naming the dotted path (``mixers.atlas.memory.inner_optimizer.name``).

``prefill`` / ``step`` / ``generate`` decode token by token, each layer carrying its mixer's state
(:mod:`atlaslab.models.decoding`, docs/decoding.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from torch import nn

from atlaslab.engines.packed import check_cu_seqlens
from atlaslab.registry import (ConfigError, PartConfig, check_range, get_registry, resolve_part, to_container,
                               validate_structured)
from atlaslab.registry.errors import join_path
from atlaslab.models import armt, attention, blocks, forgetting_attention, lact, layers  # noqa: F401  (register the mixers and blocks)
from atlaslab.models import decoding
from atlaslab.models.layers import RMSNorm

MIXER_KINDS = ("mixer", "block")


@dataclass
class LMConfig:
    """Structured config of :class:`LanguageModel` (a preset file is one of these)."""

    name: str = ""                   # the preset / model name (informational)
    description: str = ""            # one line (``atlaslab list`` shows it)
    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    layers: List[str] = field(default_factory=lambda: ["mixer"])   # pattern of keys of ``mixers``, cycled
    mixers: Dict[str, Any] = field(default_factory=dict)           # key → mixer or block node
    mlp: bool = True                 # SwiGLU MLP after each mixer
    mlp_hidden: Optional[int] = None # default: 8/3 · d_model rounded up to a multiple of 8 (Llama)
    norm_eps: float = 1e-6
    tie_embeddings: bool = False     # share the embedding with the output head
    init_std: float = 1.0            # embedding init (PyTorch's nn.Embedding default; see the module doc)
    head_init_std: Optional[float] = None   # untied head init std; default nn.Linear's ((3·d_model)^-1/2)
    logit_scale: Optional[float] = None     # logits multiplier; default d_model^-1/2 when tied, else 1

    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        h = int(8 * self.d_model / 3)
        return -(-h // 8) * 8


@dataclass
class ResolvedLM:
    """A validated model config: the typed top-level fields and each mixer's (kind, typed config)."""

    config: LMConfig
    mixers: Dict[str, Tuple[str, PartConfig]]
    #: the shared ARMT config when the layers carry memory tokens through the stack (``memory_flow: through_stack``)
    armt_stack: Optional[PartConfig] = None

    def layer_keys(self) -> List[str]:
        pattern = self.config.layers
        return [pattern[i % len(pattern)] for i in range(self.config.num_layers)]

    def to_dict(self) -> dict:
        """The fully resolved config (every default filled in) as plain containers."""
        out = dataclasses.asdict(self.config)
        mixers = {}
        for key, (_, c) in self.mixers.items():
            d = dataclasses.asdict(c)
            if hasattr(c, "memory_spec"):
                d["memory"] = c.memory_spec().to_dict()   # every part's defaults filled in
            mixers[key] = d
        out["mixers"] = mixers
        return out


def mixer_kind(name: Any, path: str) -> str:
    """``mixer`` or ``block``: which registry holds ``name`` (ConfigError listing both when neither)."""
    for kind in MIXER_KINDS:
        if isinstance(name, str) and name in get_registry(kind):
            return kind
    if isinstance(name, str) and "." in name:   # a user part from a dotted module path
        for kind in MIXER_KINDS:
            try:
                get_registry(kind).get(name, path)
                return kind
            except ConfigError:
                pass
    choices = [n for k in MIXER_KINDS for n in get_registry(k).names()]
    raise ConfigError(path, f"unknown mixer or block {name!r}.", value=name, choices=choices)


def resolve_lm_config(node: Any, path: str = "") -> ResolvedLM:
    """Validate a model node (dict / DictConfig / LMConfig / ResolvedLM) into a :class:`ResolvedLM`."""
    if isinstance(node, ResolvedLM):
        return node
    if isinstance(node, LMConfig):
        node = dataclasses.asdict(node)
    node = to_container(node) or {}
    if not isinstance(node, Mapping):
        raise ConfigError(path, f"expected a model config mapping, got {node!r}.")
    cfg = validate_structured(LMConfig, node, path, what="model field")
    for f, low in (("vocab_size", 1), ("d_model", 1), ("num_layers", 1)):
        try:
            check_range(f, getattr(cfg, f), low, None)
        except ConfigError as exc:
            raise exc.prefixed(path) from None
    for f in ("init_std", "head_init_std", "logit_scale"):
        value = getattr(cfg, f)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(join_path(path, f), "must be a positive number.", value=value)
    if cfg.mlp_hidden is not None and cfg.mlp_hidden < 1:
        raise ConfigError(join_path(path, "mlp_hidden"), "must be ≥ 1 (or null for the default).",
                          value=cfg.mlp_hidden)
    if not cfg.layers:
        raise ConfigError(join_path(path, "layers"), "the layer pattern is empty.", value=[],
                          choices=list(cfg.mixers))
    mixers: Dict[str, Tuple[str, PartConfig]] = {}
    for i, key in enumerate(cfg.layers):
        if key not in cfg.mixers:
            raise ConfigError(join_path(path, f"layers.{i}"), f"no mixer named '{key}' in mixers.", value=key,
                              choices=list(cfg.mixers))
    for key, mnode in cfg.mixers.items():
        mpath = join_path(path, f"mixers.{key}")
        if isinstance(mnode, str):
            mnode = {"name": mnode}
        if not isinstance(mnode, Mapping):
            raise ConfigError(mpath, f"expected a mixer node (a mapping with 'name'), got {mnode!r}.")
        kind = mixer_kind(mnode.get("name"), join_path(mpath, "name"))
        mixers[key] = (kind, resolve_part(kind, mnode, mpath))
    cfg.mixers = {k: to_container(v) if not isinstance(v, str) else {"name": v} for k, v in cfg.mixers.items()}
    resolved = ResolvedLM(cfg, mixers)
    resolved.armt_stack = armt.stack_config(resolved.layer_keys(), mixers, path)   # the flow spans every layer
    return resolved


class SwiGLU(nn.Module):
    """Llama MLP: W_2(silu(W_1 x) ⊙ W_3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LMLayer(nn.Module):
    """x += mixer(RMSNorm(x)); x += MLP(RMSNorm(x))."""

    def __init__(self, mixer: nn.Module, d_model: int, hidden: Optional[int], eps: float):
        super().__init__()
        self.mixer_norm = RMSNorm(d_model, eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(d_model, eps) if hidden else None
        self.mlp = SwiGLU(d_model, hidden) if hidden else None

    def forward(self, x, cu_seqlens=None):
        """``x: [B, T, d_model]``; ``cu_seqlens``: packed sequences (``[1, ΣT_i, d_model]``), passed to the mixer."""
        if cu_seqlens is None:
            x = x + self.mixer(self.mixer_norm(x))
        else:
            x = x + self.mixer(self.mixer_norm(x), cu_seqlens=cu_seqlens)
        return self._mlp(x)

    def decode(self, x, state=None, where: str = "mixer"):
        """The next tokens ``x: [B, T, d_model]`` from the mixer's decoding ``state`` → ``(x, state)``
        (:func:`atlaslab.models.decoding.decode_mixer`)."""
        y, state = decoding.decode_mixer(self.mixer, self.mixer_norm(x), state, where)
        return self._mlp(x + y), state

    def _mlp(self, x):
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))


def build_mixer(kind: str, cfg: PartConfig, d_model: int, path: str = "") -> nn.Module:
    """Construct a resolved mixer/block; construction-time ConfigErrors get ``path`` prefixed."""
    entry = get_registry(kind).get(cfg.name)
    try:
        return entry.cls(cfg, d_model)
    except ConfigError as exc:
        raise exc.prefixed(path) from None


class LanguageModel(nn.Module):
    """Llama-style LM over registered mixers. ``forward(ids: [B, T]) -> logits [B, T, vocab]``."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.resolved = resolve_lm_config(cfg)
        c = self.resolved.config
        self.cfg = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        nn.init.normal_(self.embed.weight, std=c.init_std)
        self.layer_keys = self.resolved.layer_keys()
        self.layers = nn.ModuleList()
        for key in self.layer_keys:
            kind, mcfg = self.resolved.mixers[key]
            mixer = build_mixer(kind, mcfg, c.d_model, f"mixers.{key}")
            self.layers.append(LMLayer(mixer, c.d_model, c.hidden() if c.mlp else None, c.norm_eps))
        stack = self.resolved.armt_stack
        #: ARMT's authors' flow: one segment-major loop over all layers (None: the layers run one after another)
        self.armt_stack = armt.ARMTStack(stack.memory_tokens, stack.segment, c.d_model) if stack else None
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        if c.tie_embeddings:
            self.head = None
        else:
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
            if c.head_init_std is not None:
                nn.init.normal_(self.head.weight, std=c.head_init_std)
        default_scale = c.d_model ** -0.5 if c.tie_embeddings else 1.0
        self.logit_scale = c.logit_scale if c.logit_scale is not None else default_scale

    def forward(self, input_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """``input_ids: [B, T]`` → logits ``[B, T, vocab]``.

        ``cu_seqlens``: packed documents (``input_ids: [1, ΣT_i]``, offsets ``[N + 1]`` = ``[0, T_0, T_0 + T_1, …]``,
        fla's convention): every layer treats each document as its own sequence (memories start fresh, convs
        and attention never look across a document start, RoPE restarts), so the logits equal each document run
        alone, without padding. Every mixer must take packed batches (``takes_packed``); the blocks do not yet.
        """
        if cu_seqlens is not None:
            self._check_packed(input_ids, cu_seqlens)
        x = self.embed(input_ids)
        if self.armt_stack is not None:
            return self.head_logits(self.armt_stack(self.layers, x)[0])
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.head_logits(x)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output ``x: [B, T, d_model]`` → logits ``[B, T, vocab]`` (final norm, head, scale)."""
        x = self.norm(x)
        w = self.embed.weight if self.head is None else self.head.weight
        logits = x @ w.to(x.dtype).t()
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    # -- decoding (atlaslab.models.decoding) ----------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, state: Optional[decoding.LMState] = None):
        """Read ``input_ids: [B, T]`` and keep every layer's state: ``(logits [B, T, vocab], state)``.

        The logits equal ``forward(input_ids)``; given the ``state`` of an earlier call, the tokens continue that
        sequence (chained prefills equal one). Runs under ``torch.no_grad()``.
        """
        return decoding.prefill(self, input_ids, state)

    def step(self, token_ids: torch.Tensor, state: decoding.LMState):
        """Advance by one token per sequence, ``token_ids: [B]``: ``(logits [B, vocab], state)``, the logits
        ``forward`` gives at that position of the whole sequence."""
        return decoding.step(self, token_ids, state)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Optional[torch.Generator] = None, eos_token_id: Optional[int] = None) -> torch.Tensor:
        """Continue ``input_ids: [B, T]`` by up to ``max_new_tokens`` tokens → ``[B, T + n]``, prompt included.

        ``temperature`` 0 is greedy (argmax); above 0 tokens are drawn from softmax(logits / temperature), optionally
        limited to the ``top_k`` most likely and to the nucleus of probability ``top_p``, with ``generator`` for
        reproducible draws. A sequence that emits ``eos_token_id`` continues with it; generation stops early once
        every sequence has. One prefill, then one step per token, under ``torch.no_grad()``.
        """
        return decoding.generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, generator, eos_token_id)

    def _check_packed(self, input_ids: torch.Tensor, cu_seqlens) -> None:
        """Refuse packed inputs early, naming the mixer that cannot take them."""
        if input_ids.dim() != 2:
            raise ValueError(f"LanguageModel: input_ids must be [B, T], got {list(input_ids.shape)}")
        check_cu_seqlens(cu_seqlens, *input_ids.shape)
        for key, layer in zip(self.layer_keys, self.layers):
            if not getattr(layer.mixer, "takes_packed", False):
                takes = sorted({k for k, lay in zip(self.layer_keys, self.layers)
                                if getattr(lay.mixer, "takes_packed", False)})
                raise ValueError(f"mixers.{key}: '{self.resolved.mixers[key][1].name}' does not take packed "
                                 f"sequences (cu_seqlens); mixers of this model that do: {takes or 'none'} "
                                 f"(memory, attention, swa)")

    def loss(self, input_ids: torch.Tensor, targets: Optional[torch.Tensor] = None,
             cu_seqlens=None) -> torch.Tensor:
        """Mean next-token cross-entropy: predict ``targets`` (default: ``input_ids`` shifted by one).

        With ``cu_seqlens`` (packed documents) give ``targets`` explicitly: a shift of the packed row would ask
        each document's last token to predict the next document's first.
        """
        if targets is None:
            if cu_seqlens is not None:
                raise ValueError("LanguageModel.loss: with cu_seqlens, pass targets (each document's own next tokens)")
            input_ids, targets = input_ids[:, :-1], input_ids[:, 1:]
        logits = self(input_ids, cu_seqlens=cu_seqlens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # -- accounting ---------------------------------------------------------------------------------
    def mixers(self) -> List[nn.Module]:
        return [layer.mixer for layer in self.layers]

    def state_size_per_token(self) -> int:
        """Recurrent-state scalars added per context token, summed over layers (KV caches)."""
        return sum(m.state_size_per_token() for m in self.mixers())

    def state_size(self, context: Optional[int] = None) -> int:
        """Recurrent-state scalars per sequence after ``context`` tokens, summed over layers (zoology's
        ``state_size``). ``context=None`` gives the fixed part only (see :meth:`state_size_per_token`)."""
        return sum(m.state_size(context) for m in self.mixers())

    def num_parameters(self, exclude_embeddings: bool = False, trainable_only: bool = True) -> int:
        """Number of (unique; tied embeddings counted once) parameters."""
        seen, n = set(), 0
        for p in self.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            n += p.numel()
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n


def build_lm(cfg: Any) -> LanguageModel:
    return LanguageModel(cfg)


__all__ = ["LMConfig", "LMLayer", "LanguageModel", "ResolvedLM", "SwiGLU", "build_lm", "build_mixer", "mixer_kind",
           "resolve_lm_config"]
