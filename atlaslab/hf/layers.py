"""atlaslab mixers with fla's layer interface, for other people's models.

    layer = MemoryMixer(hidden_size=256, num_heads=4, layer_idx=0, memory={"memory": {"name": "mlp"}, ...})
    o, _, cache = layer(hidden_states, attention_mask=mask, past_key_values=cache, use_cache=True)

Every registered mixer and block has a class here (:data:`MIXER_CLASSES`; :class:`AtlaslabMixer` takes any
registered name, a user's own included), and :meth:`AtlaslabMixer.from_preset` takes the mixer of a preset
(``AtlaslabMixer.from_preset("atlas", hidden_size=256)``). The keyword arguments beyond ``hidden_size``,
``num_heads`` and ``layer_idx`` are the registered config's fields, validated as in a YAML file (a ConfigError names
the bad field and the valid choices). ``torch`` only: ``transformers`` is not needed.

``forward(hidden_states [B, T, hidden_size], attention_mask [B, T] | None, past_key_values | None, use_cache)``
returns ``(o [B, T, hidden_size], None, past_key_values)`` as fla's layers do (the middle slot is fla's attention
weights, never returned here). ``attention_mask`` is a padding mask (1 = token, 0 = pad; left or right padding):
pads are never read into a memory or a KV cache (rows are grouped by length and run unpadded,
:func:`atlaslab.hf.cache.run_grouped`) and their outputs are zero. ``past_key_values`` is a
:class:`~atlaslab.hf.cache.StateCache` that several layers share, each under its ``layer_idx``; the state steps with
the decoders of :mod:`atlaslab.models.decoding`, so chained calls equal one call.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Type

import torch
from omegaconf import OmegaConf
from torch import nn

from atlaslab.hf.cache import CacheEntry, StateCache, run_grouped
from atlaslab.models.decoding import decode_mixer
from atlaslab.models.lm import build_mixer, mixer_kind
from atlaslab.models.presets import load_preset
from atlaslab.registry import ConfigError, resolve_part, to_container


class AtlaslabMixer(nn.Module):
    """A registered atlaslab mixer (or block) as an fla-style layer.

    Args:
        hidden_size: the model width (the mixer's d_model).
        num_heads: the mixer's heads (its config's ``num_heads``; None keeps the config's default).
        layer_idx: this layer's slot in a shared ``past_key_values`` (needed only with a cache).
        mixer: the registered name (``memory``, ``attention``, ``swa``, ``forgetting_attention``, ``lact``, ``lmm``,
            ``mag``, ``mal``, ``mac``, ``armt`` or a user's own); the subclasses fix it.
        **config: the mixer config's other fields (``memory={...}``, ``window=64``, ``conv=False`` …).
    """

    mixer_name: Optional[str] = None

    def __init__(self, hidden_size: int = 64, num_heads: Optional[int] = None, layer_idx: Optional[int] = None,
                 mixer: Optional[str] = None, **config: Any):
        super().__init__()
        name = mixer or self.mixer_name
        if name is None:
            raise ConfigError("mixer", "name the registered mixer to build (e.g. mixer='memory').")
        where = type(self).__name__
        node: Dict[str, Any] = {"name": name, **config}
        if num_heads is not None:
            node["num_heads"] = num_heads
        kind = mixer_kind(name, f"{where}.mixer")
        cfg = resolve_part(kind, node, where)
        if getattr(cfg, "memory_flow", None) == "through_stack":
            raise ConfigError(f"{where}.memory_flow", "through_stack carries memory tokens through a whole "
                              "atlaslab model; a single layer takes per_layer.", value="through_stack",
                              choices=["per_layer"])
        self.hidden_size, self.num_heads, self.layer_idx = hidden_size, getattr(cfg, "num_heads", num_heads), layer_idx
        self.config = cfg
        self.mixer = build_mixer(kind, cfg, hidden_size, where)

    @classmethod
    def from_preset(cls, preset: str, hidden_size: int = 64, num_heads: Optional[int] = None,
                    layer_idx: Optional[int] = None, key: Optional[str] = None, **config: Any) -> "AtlaslabMixer":
        """The mixer ``key`` of ``preset`` (default: its first layer's), with ``config`` fields replaced."""
        node = to_container(load_preset(preset))
        keys = list(node.get("layers") or [])
        key = key or keys[0]
        if key not in node["mixers"]:
            raise ConfigError("key", f"preset {preset!r} has no mixer {key!r}.", value=key,
                              choices=list(node["mixers"]))
        merged = OmegaConf.to_container(OmegaConf.merge(node["mixers"][key], config))
        if num_heads is None:
            num_heads = merged.pop("num_heads", None)
        merged.pop("num_heads", None)
        return AtlaslabMixer(hidden_size, num_heads, layer_idx, mixer=merged.pop("name"), **merged)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[StateCache] = None, use_cache: bool = False,
                output_attentions: bool = False, **kwargs: Any) -> Tuple[torch.Tensor, None, Optional[StateCache]]:
        """``hidden_states: [B, T, hidden_size]`` → ``(o [B, T, hidden_size], None, past_key_values)``
        (module doc)."""
        if output_attentions:
            raise ValueError(f"{type(self).__name__}: output_attentions is not supported")
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        if past_key_values is None and not use_cache and not padded:
            return self.mixer(hidden_states), None, None
        if past_key_values is not None or use_cache:
            if past_key_values is None:
                past_key_values = StateCache()
            entry = past_key_values.entry(self.layer_idx if self.layer_idx is not None else id(self))
        else:
            entry = CacheEntry()                       # padding without a cache: a throwaway one
        o = run_grouped(entry, hidden_states, attention_mask, lambda x, s: decode_mixer(self.mixer, x, s))
        if o is None:
            o = torch.zeros_like(hidden_states)
        return o, None, past_key_values if use_cache or past_key_values is not None else None

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, layer_idx={self.layer_idx}"


def _named(mixer: str, cls_name: str, doc: str) -> Type[AtlaslabMixer]:
    return type(cls_name, (AtlaslabMixer,), {"mixer_name": mixer, "__doc__": doc, "__module__": __name__})


MemoryMixer = _named("memory", "MemoryMixer", "The memory layer (docs/concepts/memory.md#layer-backbone).")
AttentionMixer = _named("attention", "AttentionMixer", "Causal softmax attention with RoPE.")
SlidingWindowMixer = _named("swa", "SlidingWindowMixer", "Sliding-window attention.")
ForgettingAttentionMixer = _named("forgetting_attention", "ForgettingAttentionMixer", "Forgetting attention (FoX).")
LaCTMixer = _named("lact", "LaCTMixer", "LaCT: sliding-window attention with a chunk-wise fast-weight memory.")
LMMMixer = _named("lmm", "LMMMixer", "Titans LMM block.")
MAGMixer = _named("mag", "MAGMixer", "Titans memory-as-a-gate block.")
MALMixer = _named("mal", "MALMixer", "Titans memory-as-a-layer block.")
MACMixer = _named("mac", "MACMixer", "Titans memory-as-context block.")
ARMTMixer = _named("armt", "ARMTMixer", "ARMT: segment attention with an associative memory (per_layer flow).")

#: registered name → its fla-style class
MIXER_CLASSES: Dict[str, Type[AtlaslabMixer]] = {c.mixer_name: c for c in (
    MemoryMixer, AttentionMixer, SlidingWindowMixer, ForgettingAttentionMixer, LaCTMixer, LMMMixer, MAGMixer,
    MALMixer, MACMixer, ARMTMixer)}

__all__ = ["ARMTMixer", "AtlaslabMixer", "AttentionMixer", "ForgettingAttentionMixer", "LMMMixer", "LaCTMixer",
           "MACMixer", "MAGMixer", "MALMixer", "MIXER_CLASSES", "MemoryMixer", "SlidingWindowMixer"]
