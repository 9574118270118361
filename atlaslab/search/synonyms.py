"""Synonymous choices: two values of a search-space parameter that build the same model.

A categorical choice that is a mapping is *merged* into the mapping the config already has at that key, as every
override is (:mod:`atlaslab.models.overrides`): on a layer declared with ``memory: {name: linear, init: zeros}`` the
choice ``{name: linear}`` keeps ``init: zeros``, so the choices ``{name: linear}`` and ``{name: linear, init: zeros}``
are one model there and different models in a layer whose memory learns its initial value. A search that holds
such a pair draws the same model under two labels, and a reader of its report takes the label for the model.

:func:`find_synonyms` checks the points the preflight admitted (:func:`atlaslab.search.admission.preflight`: every
choice of the space in one combination at least): for each point and each categorical parameter whose choices
include a mapping, the model is resolved with every choice in turn (the other parameters as drawn) and choices
whose resolved configs are equal — over the layers the model uses — are reported with a point where they coincide.
The driver refuses such a space before Ray starts unless ``search.synonyms: allow`` (then the report lists them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atlaslab.registry import ConfigError
from atlaslab.search.expand import resolve_model_node, trial_from_params
from atlaslab.search.formatting import fmt_value, short_key
from atlaslab.search.schema import SYNONYM_POLICIES, ExperimentConfig, ParamNode


@dataclass
class Synonym:
    """Choices ``labels`` of parameter ``key`` that resolved to one model at the points ``where`` (each the other
    parameters' values as drawn); ``checked``: how many admitted points the parameter was checked at."""

    key: str
    labels: Tuple[str, ...]
    where: List[Dict[str, Any]] = field(default_factory=list)
    checked: int = 0

    def describe(self) -> str:
        point = self.where[0]
        at = ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in point.items() if k != self.key)
        return (f"the choices {' and '.join(self.labels)} build the same model at {len(self.where)} of the "
                f"{self.checked} admitted points checked (e.g. {at})")

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "labels": list(self.labels), "where": self.where, "checked": self.checked}


def _has_mapping_choice(p: ParamNode) -> bool:
    return p.type == "categorical" and any(isinstance(c, Mapping) for c in p.choices)


def _used_model(exp: ExperimentConfig, params: Mapping[str, Any], vocab_size: Optional[int]) -> Optional[str]:
    """The resolved model of a point, over the mixers its layers use, as canonical JSON (None: it does not
    resolve)."""
    trial = trial_from_params(exp, params, key="synonym-check")
    try:
        _, resolved = resolve_model_node(trial["config"]["model"], vocab_size)
    except ConfigError:
        return None
    model = resolved.to_dict()
    used = set(model.get("layers") or [])
    model["mixers"] = {k: v for k, v in (model.get("mixers") or {}).items() if k in used}
    for k in ("name", "description"):
        model.pop(k, None)
    return json.dumps(model, sort_keys=True, default=str)


def find_synonyms(exp: ExperimentConfig, points: Sequence[Mapping[str, Any]],
                  vocab_size: Optional[int] = None) -> List[Synonym]:
    """The synonymous choices of ``exp``'s space at ``points`` (drawn parameter values, e.g. the preflight's
    admitted trials' ``params``), in the space's order. A parameter that another parameter's condition reads is
    not checked (changing it changes which parameters exist)."""
    read_by_conditions = {k for p in exp.space.values() for k in p.when}
    found: Dict[Tuple[str, Tuple[str, ...]], Synonym] = {}
    checked: Dict[str, int] = {}
    seen = set()
    for point in points:
        sig = json.dumps(point, sort_keys=True, default=str)
        if sig in seen:
            continue
        seen.add(sig)
        for key, p in exp.space.items():
            if key not in point or not _has_mapping_choice(p) or key in read_by_conditions:
                continue
            checked[key] = checked.get(key, 0) + 1
            by_model: Dict[str, List[str]] = {}
            for choice in p.choices:
                model = _used_model(exp, dict(point, **{key: choice}), vocab_size)
                if model is not None:
                    by_model.setdefault(model, []).append(fmt_value(choice))
            for labels in by_model.values():
                if len(labels) > 1:
                    syn = found.setdefault((key, tuple(labels)), Synonym(key, tuple(labels)))
                    syn.where.append(dict(point))
    for syn in found.values():
        syn.checked = checked[syn.key]
    order = list(exp.space)
    return sorted(found.values(), key=lambda s: (order.index(s.key), s.labels))


def synonym_error(syn: Synonym) -> ConfigError:
    """The error that refuses a space with ``syn`` (named by the parameter's key)."""
    return ConfigError(f"search.space.{syn.key}",
                       f"{syn.describe()}: a choice that is a mapping is merged into the mapping the config has "
                       "there, so fields it leaves out keep the config's values. Spell in each choice every field "
                       "that should differ (e.g. init: learned against init: zeros), drop one of them, or set "
                       "search.synonyms: allow to run the space as it is (the report then lists them).",
                       value=list(syn.labels), choices=list(SYNONYM_POLICIES))


__all__ = ["SYNONYM_POLICIES", "Synonym", "find_synonyms", "synonym_error"]
