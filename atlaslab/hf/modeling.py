"""atlaslab language models as Hugging Face ``transformers`` models: :class:`AtlaslabConfig` and
:class:`AtlaslabForCausalLM`, registered with ``AutoConfig`` / ``AutoModelForCausalLM`` as model type ``atlaslab``.

The config carries the fully resolved atlaslab model config (``LanguageModel``'s, every default filled in) under
``atlaslab``; the causal-LM class wraps a :class:`~atlaslab.models.lm.LanguageModel` as ``.model``, so its weights
are the LanguageModel's (``model.embed.weight``, ``model.layers.0.mixer...``) and ``save_pretrained`` writes them
as safetensors.

``forward(input_ids, attention_mask, past_key_values / cache, use_cache, labels)``:

- no cache and no padding: the LanguageModel's parallel forward (the training path);
- a cache (``use_cache`` or ``past_key_values``): every layer steps its recurrent state with the decoders of
  :mod:`atlaslab.models.decoding` (``LMLayer.decode``), the state kept in a :class:`~atlaslab.hf.cache.StateCache`;
- padding (``attention_mask`` with zeros, left or right): rows are grouped by their number of real tokens and each
  group runs only its real tokens (:func:`~atlaslab.hf.cache.run_grouped`), so no pad ever reaches a memory or a
  KV cache and every row's logits equal that row run alone; pads get zero logits.

``generate`` is GenerationMixin's (greedy, sampling; no beam search: a recurrent state does not reorder here).

Tensor key: B batch, T tokens, V vocabulary.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from atlaslab.hf.cache import StateCache, run_grouped
from atlaslab.models.lm import LanguageModel, resolve_lm_config
from atlaslab.models.presets import load_preset, resolve_model

MODEL_TYPE = "atlaslab"


class AtlaslabConfig(PretrainedConfig):
    """A Hugging Face config holding an atlaslab model config.

    ``atlaslab``: the model config (a dict as :meth:`ResolvedLM.to_dict` writes it; a preset's or any valid one),
    validated and filled in here, so a saved ``config.json`` is the whole model definition. ``vocab_size``,
    ``hidden_size`` and ``num_hidden_layers`` mirror it for tools that read those names.
    """

    model_type = MODEL_TYPE

    def __init__(self, atlaslab: Optional[dict] = None, use_cache: bool = True, **kwargs: Any):
        self.use_cache = use_cache
        resolved = resolve_lm_config(atlaslab if atlaslab is not None else {})
        self.atlaslab = resolved.to_dict()
        c = resolved.config
        kwargs.pop("tie_word_embeddings", None)          # the LanguageModel ties (or not) by itself
        for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
            kwargs.pop(key, None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.vocab_size, self.hidden_size, self.num_hidden_layers = c.vocab_size, c.d_model, c.num_layers

    @classmethod
    def from_preset(cls, name: str, overrides=(), **kwargs: Any) -> "AtlaslabConfig":
        """The config of preset ``name`` with dotlist ``overrides`` (``["d_model=32"]``)."""
        return cls(atlaslab=resolve_model(load_preset(name, overrides)).to_dict(), **kwargs)


class AtlaslabPreTrainedModel(PreTrainedModel):
    config_class = AtlaslabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = True
    _is_stateful = True                 # a recurrent state: no assisted decoding, no cache cropping

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: every atlaslab module initialises its own parameters when it is built."""


class AtlaslabForCausalLM(AtlaslabPreTrainedModel, GenerationMixin):
    """An atlaslab :class:`LanguageModel` behind transformers' causal-LM interface (module doc)."""

    def __init__(self, config: AtlaslabConfig):
        super().__init__(config)
        self.model = LanguageModel(config.atlaslab)
        self.post_init()

    @classmethod
    def from_language_model(cls, lm: LanguageModel, **config_kwargs: Any) -> "AtlaslabForCausalLM":
        """Wrap a built (e.g. trained) LanguageModel; the weights are shared, not copied."""
        out = cls(AtlaslabConfig(atlaslab=lm.resolved.to_dict(), **config_kwargs))
        out.model = lm
        return out

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """transformers' loader, then the non-persistent buffers restored (:meth:`restore_buffers`)."""
        out = super().from_pretrained(*args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        model.restore_buffers()
        return out

    def restore_buffers(self) -> None:
        """Recompute the non-persistent buffers (e.g. the polynomial feature map's monomial indices).

        transformers builds the model on the meta device and leaves buffers that are not in the weights file empty;
        they are functions of the config, so a model built for real on the CPU gives them back. Nothing is built
        when the model has none."""
        names = [name for name, _ in self.named_non_persistent_buffers()]
        if not names:
            return
        with torch.device("cpu"):
            fresh = dict(LanguageModel(self.config.atlaslab).named_buffers())
        for name in names:
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            old = getattr(module, leaf)
            module._buffers[leaf] = fresh[name[len("model."):]].to(device=old.device, dtype=old.dtype)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                    # generate must not make a DynamicCache: the forward makes a StateCache

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[StateCache] = None, past_key_values: Optional[StateCache] = None,
                use_cache: Optional[bool] = None, labels: Optional[torch.LongTensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, return_dict: Optional[bool] = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """``input_ids: [B, T]`` → ``logits [B, T, V]`` (and the ``cache`` when ``use_cache``; the loss of the
        next-token predictions when ``labels: [B, T]`` is given, −100 ignored). ``past_key_values`` is the older
        name of ``cache``. ``position_ids`` and other generate bookkeeping are ignored: each layer knows its
        positions from its own state."""
        if inputs_embeds is not None:
            raise ValueError("AtlaslabForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("AtlaslabForCausalLM.forward needs input_ids [B, T]")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, StateCache):
            raise TypeError(f"cache / past_key_values must be the StateCache an earlier call returned, got "
                            f"{type(cache).__name__}")
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training)
        padded = attention_mask is not None and not bool(attention_mask[:, -input_ids.shape[1]:].bool().all())
        if cache is None and not use_cache and not padded:
            logits = self.model(input_ids)
        else:
            cache = cache if cache is not None else StateCache()
            mask = attention_mask[:, -input_ids.shape[1]:] if attention_mask is not None else None
            logits = run_grouped(cache.entry("model"), input_ids, mask, self._decode)
            if logits is None:
                raise ValueError("attention_mask: no row has a token")
        loss = None
        if labels is not None:
            scored = logits[:, :-1].flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(scored, labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def _decode(self, input_ids: torch.Tensor, layer_states: Optional[list]):
        """Rows ``input_ids: [G, n]`` (all real) from their per-layer states (None: new sequences) →
        ``(logits [G, n, V], per-layer states)``, each layer's decoder stepping its state (LMLayer.decode)."""
        lm = self.model
        x = lm.embed(input_ids)
        if lm.armt_stack is not None:                 # ARMT through_stack: every layer per segment
            x, new = lm.armt_stack(lm.layers, x, layer_states)
        else:
            states = layer_states or [None] * len(lm.layers)
            new = []
            for key, layer, s in zip(lm.layer_keys, lm.layers, states):
                x, s = layer.decode(x, s, where=f"mixers.{key}")
                new.append(s)
        return lm.head_logits(x), new


def register() -> None:
    """Register the config and model with transformers' Auto classes (idempotent)."""
    try:
        AutoConfig.register(MODEL_TYPE, AtlaslabConfig)
    except ValueError:
        pass                            # already registered (by this module, imported before)
    try:
        AutoModelForCausalLM.register(AtlaslabConfig, AtlaslabForCausalLM)
    except ValueError:
        pass


register()

__all__ = ["AtlaslabConfig", "AtlaslabForCausalLM", "AtlaslabPreTrainedModel", "MODEL_TYPE", "register"]
