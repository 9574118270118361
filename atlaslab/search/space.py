"""Search spaces as Optuna define-by-run functions (conditional parameters included).

``search.space`` maps dotted keys to distributions; a parameter with ``when`` is suggested only when
every condition holds on the values sampled before it (so ``ns_steps`` exists only for Muon)::

    space:
      model.mixers.atlas.memory.inner_optimizer.name: [muon, gd]
      model.mixers.atlas.memory.inner_optimizer.ns_steps:
        {type: int, low: 1, high: 5, when: {model.mixers.atlas.memory.inner_optimizer.name: muon}}

:func:`sample` suggests a point of the space on an Optuna trial (the searcher's ask-and-tell,
:mod:`atlaslab.search.searcher`); categorical choices that are not plain scalars (e.g. component nodes
``{name: gd, lr: 0.1}``) are suggested by label and mapped back.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

from atlaslab.search.formatting import fmt_value
from atlaslab.search.schema import ExperimentConfig, ParamNode

_SCALARS = (type(None), bool, int, float, str)


def choice_labels(p: ParamNode) -> List[Any]:
    """What Optuna sees for a categorical parameter: the choices themselves when scalar, else labels."""
    if all(isinstance(c, _SCALARS) for c in p.choices):
        return list(p.choices)
    labels = [fmt_value(c) for c in p.choices]
    if len(set(labels)) != len(labels):
        labels = [f"{i}:{lab}" for i, lab in enumerate(labels)]
    return labels


def decode(p: ParamNode, raw: Any) -> Any:
    if p.type != "categorical":
        return raw
    labels = choice_labels(p)
    return p.choices[labels.index(raw)]


def condition_holds(p: ParamNode, values: Mapping[str, Any]) -> bool:
    for key, want in p.when.items():
        if key not in values:
            return False
        allowed = want if isinstance(want, list) else [want]
        if values[key] not in allowed:
            return False
    return True


def suggest(trial: Any, key: str, p: ParamNode) -> Any:
    if p.type == "categorical":
        return decode(p, trial.suggest_categorical(key, choice_labels(p)))
    if p.type == "int":
        kw = {"log": p.log}
        if p.step is not None:
            kw["step"] = int(p.step)
        return int(trial.suggest_int(key, int(p.low), int(p.high), **kw))
    kw = {"log": p.log}
    if p.step is not None:
        kw["step"] = float(p.step)
    return float(trial.suggest_float(key, float(p.low), float(p.high), **kw))


def optuna_distributions(space: Mapping[str, ParamNode]) -> Dict[str, Any]:
    """The Optuna distribution of each parameter, as :func:`suggest` asks for it (categoricals by label)."""
    import optuna
    out: Dict[str, Any] = {}
    for key, p in space.items():
        if p.type == "categorical":
            out[key] = optuna.distributions.CategoricalDistribution(choice_labels(p))
        elif p.type == "int":
            out[key] = optuna.distributions.IntDistribution(int(p.low), int(p.high), log=p.log,
                                                            step=int(p.step) if p.step is not None else 1)
        else:
            out[key] = optuna.distributions.FloatDistribution(float(p.low), float(p.high), log=p.log,
                                                              step=float(p.step) if p.step is not None else None)
    return out


def optuna_value(p: ParamNode, value: Any) -> Any:
    """A sampled (decoded) value as Optuna recorded it: a categorical's label, a number as itself."""
    if p.type != "categorical":
        return value
    return choice_labels(p)[p.choices.index(value)]


def sample(space: Mapping[str, ParamNode], trial: Any) -> Dict[str, Any]:
    """Sampled values (dotted key → value) of one Optuna trial; conditional keys only when active."""
    values: Dict[str, Any] = {}
    for key, p in space.items():
        if condition_holds(p, values):
            values[key] = suggest(trial, key, p)
    return values


def decode_params(space: Mapping[str, ParamNode], config: Mapping[str, Any]) -> Dict[str, Any]:
    """The sampled values in a Tune trial config (OptunaSearch puts raw suggestions at the top level)."""
    out = {}
    for key, p in space.items():
        if key in config:
            out[key] = decode(p, config[key])
    return out


def make_sampler(exp: ExperimentConfig):
    import optuna
    s = exp.search
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if s.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=s.seed, population_size=max(4, min(50, exp.num_samples // 4)))
    return optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=min(10, max(2, exp.num_samples // 3)))


def grid_size(space: Mapping[str, ParamNode]) -> Optional[int]:
    """Number of points when every dimension is finite (categorical / int / stepped float), else None."""
    n = 1
    for p in space.values():
        if p.type == "categorical":
            n *= len(p.choices)
        elif p.type == "int" and not p.log:
            n *= (int(p.high) - int(p.low)) // int(p.step or 1) + 1
        elif p.type == "float" and p.step:
            n *= int(math.floor((p.high - p.low) / p.step + 1e-9)) + 1
        else:
            return None
    return n


__all__ = ["choice_labels", "condition_holds", "decode", "decode_params", "grid_size", "make_sampler",
           "optuna_distributions", "optuna_value", "sample", "suggest"]
