"""A memory = six registered parts + the training chunk size b + the read granularity (docs/concepts/memory.md).

``resolve_memory_spec(node)`` validates a YAML/dict node into a :class:`MemorySpec` of typed part configs
and checks the combination (e.g. Muon on a vector-valued memory is rejected) before anything is built.
``build_memory(spec, num_heads, key_dim, value_dim)`` constructs the parts as one ``nn.Module``
(:class:`MemoryParts`) so their learnable pieces (polynomial coefficients, initial memory) travel together.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from atlaslab.kernels.utils import READS
from atlaslab.registry import ConfigError, PartConfig, check_choice, get_registry, resolve_part, to_container
from atlaslab.registry.errors import join_path

#: The six component axes of a memory, in the order docs/concepts/memory.md lists them.
PART_KINDS = ("memory", "attentional_bias", "retention", "feature_map", "inner_optimizer", "window")


@dataclass(frozen=True)
class MemorySpec:
    """Typed, validated description of a memory (what ``memorize`` computes): immutable, and valid by construction
    (make one with :func:`resolve_memory_spec`, which validates a node once; a layer config holds the result, and
    the layer, the engines and the kernels take it as it is, without checking it again).

    ``chunk_size`` is the semantic training chunk b: gradients of every token of a chunk are taken at the
    chunk-start state (docs/concepts/memory.md#training-chunk). ``read``: ``token`` reads M_t after token t's
    update (docs/concepts/memory.md#read-after-write); ``chunk`` reads the chunk-start state
    (docs/concepts/memory.md#read-granularity).
    """

    memory: PartConfig
    attentional_bias: PartConfig
    retention: PartConfig
    feature_map: PartConfig
    inner_optimizer: PartConfig
    window: PartConfig
    chunk_size: int = 1
    read: str = "token"

    def to_dict(self) -> dict:
        """Plain nested dict (``{memory: {name: ..., ...}, ..., chunk_size, read}``), valid input again."""
        out = {kind: dataclasses.asdict(getattr(self, kind)) for kind in PART_KINDS}
        out.update(chunk_size=self.chunk_size, read=self.read)
        return out


DEFAULT_PARTS = {
    "memory": "linear",
    "attentional_bias": "l2",
    "retention": "none",
    "feature_map": "identity",
    "inner_optimizer": "gd",
    "window": "omega",
}
SPEC_FIELDS = PART_KINDS + ("chunk_size", "read")


def uses_slot_memory(spec: MemorySpec) -> bool:
    """φ* on a linear memory is computed by the kernel trick (docs/concepts/memory.md#exponential-feature-map)."""
    fm = spec.feature_map
    return fm.name == "exp" and (fm.mode == "kernel" or (fm.mode == "auto" and spec.memory.name == "linear"))


def _check_combination(spec: MemorySpec, path: str) -> None:
    p = lambda *keys: join_path(path, ".".join(keys))  # noqa: E731
    mem_cls = get_registry("memory").get(spec.memory.name).cls
    opt, ret, fm, bias = spec.inner_optimizer, spec.retention, spec.feature_map, spec.attentional_bias
    opt_cls = get_registry("inner_optimizer").get(opt.name).cls
    if getattr(opt_cls, "needs_matrices", False) and not getattr(mem_cls, "matrix_valued", True):
        raise ConfigError(p("inner_optimizer", "name"),
                          f"'{opt.name}' orthogonalises matrices, but memory '{spec.memory.name}' has "
                          f"vector-valued fast weights.", value=opt.name,
                          choices=[n for n in get_registry("inner_optimizer").names() if n != opt.name])
    ret_cls = get_registry("retention").get(ret.name).cls
    if getattr(ret_cls, "projects", False) and (getattr(mem_cls, "zero_init", False)
                                                or getattr(spec.memory, "init", "learned") == "zeros"):
        raise ConfigError(p("retention", "name"),
                          f"'{ret.name}' keeps every row of the memory at its initial norm, but memory "
                          f"'{spec.memory.name}' starts at zero (init: {getattr(spec.memory, 'init', 'learned')}), "
                          "so it would stay zero; use an MLP memory with init: learned.", value=ret.name,
                          choices=[n for n in get_registry("retention").names() if n != ret.name])
    if getattr(opt, "ns_granularity", "token") == "chunk" and spec.read != "chunk":
        raise ConfigError(p("inner_optimizer", "ns_granularity"),
                          "ns_granularity: chunk steps the memory once per chunk with a direction built from the "
                          "whole chunk, so it is causal only with read: chunk; set read: chunk.",
                          value="chunk", choices=["token"])
    if opt.name == "implicit_gd":
        if spec.memory.name != "linear" or bias.name != "l2":
            raise ConfigError(p("inner_optimizer", "name"),
                              "implicit_gd has a closed form only for memory: linear with attentional_bias: l2 "
                              f"(got memory '{spec.memory.name}', bias '{bias.name}').", value=opt.name,
                              choices=["gd", "momentum", "muon", "multi_step_gd"])
    if getattr(ret, "channel_wise", False) and spec.memory.name != "linear":
        raise ConfigError(p("retention", "channel_wise"),
                          "channel-wise retention decays the key channels of a linear memory (GLA's M Diag(α)); "
                          f"memory '{spec.memory.name}' takes a per-head α.", value=True, choices=["false"])
    if fm.name == "exp":
        if fm.mode == "kernel" and spec.memory.name != "linear":
            raise ConfigError(p("feature_map", "mode"), "the exp kernel trick needs memory: linear.",
                              value="kernel", choices=["auto", "taylor"])
        if uses_slot_memory(spec):
            allowed = ("gd", "momentum")
            if opt.name not in allowed:
                raise ConfigError(p("inner_optimizer", "name"),
                                  f"with the exp kernel trick the memory is a sum of written (key, value) slots; "
                                  f"'{opt.name}' does not keep that form.", value=opt.name, choices=allowed)
            if ret.name not in ("none", "decay") or getattr(ret, "channel_wise", False):
                raise ConfigError(p("retention", "name"),
                                  "the exp kernel trick supports only per-head decay or no retention.",
                                  value=ret.name, choices=["none", "decay"])
            if getattr(spec.memory, "init", "zeros") != "zeros":
                raise ConfigError(p("memory", "init"),
                                  "the exp kernel trick represents the memory by its written slots, so the initial "
                                  "memory must be zero; set memory.init: zeros.", value=spec.memory.init,
                                  choices=["zeros"])
        if fm.normalize and (not uses_slot_memory(spec) or bias.name != "dot"):
            raise ConfigError(p("feature_map", "normalize"),
                              "the softmax normaliser is defined for the exp kernel trick with the dot-product bias "
                              "(DeepTransformer → Transformer).", value=True, choices=["false"])


def resolve_memory_spec(node: Any = None, path: str = "memory") -> MemorySpec:
    """Validate a memory node (dict / DictConfig) into a :class:`MemorySpec`; a MemorySpec is valid already and is
    returned as it is."""
    if isinstance(node, MemorySpec):
        return node
    node = to_container(node) or {}
    if not isinstance(node, Mapping):
        raise ConfigError(path, f"expected a mapping with keys {', '.join(SPEC_FIELDS)}, got {node!r}.")
    unknown = [k for k in node if k not in SPEC_FIELDS]
    if unknown:
        raise ConfigError(join_path(path, unknown[0]), f"unknown memory field '{unknown[0]}'.",
                          value=unknown[0], choices=list(SPEC_FIELDS))
    parts = {}
    for kind in PART_KINDS:
        part = node.get(kind, DEFAULT_PARTS[kind])
        if isinstance(part, Mapping) and "name" not in part:   # {size: 3} means the default part with size 3
            part = {"name": DEFAULT_PARTS[kind], **part}
        parts[kind] = resolve_part(kind, part, join_path(path, kind))
    chunk_size = node.get("chunk_size", 1)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ConfigError(join_path(path, "chunk_size"), f"bad value {chunk_size!r}: must be an integer ≥ 1.",
                          value=chunk_size)
    read = node.get("read", "token")
    try:
        check_choice("read", read, READS)
    except ConfigError as exc:
        raise exc.prefixed(path) from None
    spec = MemorySpec(**parts, chunk_size=chunk_size, read=read)
    _check_combination(spec, path)
    return spec


class MemoryParts(nn.Module):
    """The built parts of one memory spec, for ``num_heads`` heads of key dim d_k and value dim d_v.

    Attributes: ``feature_map``, ``memory``, ``attentional_bias``, ``retention``, ``inner_optimizer``,
    ``window`` (modules), ``spec`` (the resolved :class:`MemorySpec`), ``kernel_trick`` (bool).
    """

    def __init__(self, spec: MemorySpec, num_heads: int, key_dim: int, value_dim: int, path: str = "memory"):
        super().__init__()
        self.spec = spec
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim
        self.kernel_trick = uses_slot_memory(spec)

        def cls(kind):
            return get_registry(kind).get(getattr(spec, kind).name).cls

        fm_cls = cls("feature_map")
        try:   # a map that checks itself against the key dim (DPFP's ν) reports at <path>.feature_map
            self.feature_map = (fm_cls(spec.feature_map, key_dim, kernel_trick=self.kernel_trick)
                                if spec.feature_map.name == "exp" else fm_cls(spec.feature_map, key_dim))
        except ConfigError as exc:
            raise exc.prefixed(join_path(path, "feature_map")) from None
        feat = self.feature_map.out_dim
        try:
            self.memory = cls("memory")(spec.memory, feat, value_dim, num_heads)
        except ConfigError as exc:   # the architecture reports its own field; the part sits at <path>.memory
            raise exc.prefixed(join_path(path, "memory")) from None
        if getattr(spec.retention, "channel_wise", False) and feat != key_dim:
            raise ConfigError(join_path(path, "retention.channel_wise"),
                              f"channel-wise α has one gate per head channel ({key_dim}), but the feature map "
                              f"gives {feat} key features.", value=True, choices=["false"])
        self.attentional_bias = cls("attentional_bias")(spec.attentional_bias)
        self.retention = cls("retention")(spec.retention)
        self.inner_optimizer = cls("inner_optimizer")(spec.inner_optimizer)
        self.window = cls("window")(spec.window)

    @property
    def chunk_size(self) -> int:
        return self.spec.chunk_size

    @property
    def read(self) -> str:
        return self.spec.read

    def state_size(self) -> int:
        """Recurrent-state scalars per sequence (fast weights + momentum + dual), zoology's contract.

        The exp kernel trick and the global window keep a growing cache: their state is reported per token
        of context by :meth:`state_size_per_token` and this returns the fixed part only.
        """
        if self.kernel_trick:
            return 0
        n = self.memory.state_size()
        copies = 1 + int(self.inner_optimizer.has_momentum) + int(self.retention.mirror)
        window = self.window.size or 1  # the last c - 1 (k, v, γ) travel in the state
        return n * copies + (window - 1) * self.num_heads * (self.key_dim + self.value_dim + 1)

    def state_size_per_token(self) -> int:
        """Scalars added per token of context (KV-cache-like states; 0 for fixed-size memories)."""
        per = 0
        if self.kernel_trick:
            per += self.num_heads * (self.key_dim + self.value_dim * (1 + int(self.inner_optimizer.has_momentum)))
        if self.window.size is None:
            per += self.num_heads * (self.key_dim + self.value_dim + 1)
        return per


def build_memory(spec: Any, num_heads: int, key_dim: int, value_dim: int, path: str = "memory") -> MemoryParts:
    """Validate ``spec`` (a node or MemorySpec) and build its parts."""
    return MemoryParts(resolve_memory_spec(spec, path), num_heads, key_dim, value_dim, path)
