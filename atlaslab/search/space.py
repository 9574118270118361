"""Search spaces as Optuna define-by-run functions (conditional parameters included).

``search.space`` maps dotted keys to distributions; a parameter with ``when`` is suggested only when
every condition holds on the values sampled before it (so ``ns_steps`` exists only for Muon)::

    space:
      model.mixers.atlas.memory.inner_optimizer.name: [muon, gd]
      model.mixers.atlas.memory.inner_optimizer.ns_steps:
        {type: int, low: 1, high: 5, when: {model.mixers.atlas.memory.inner_optimizer.name: muon}}

:func:`define_by_run` returns the function ``OptunaSearch(space=fn)`` calls with an Optuna trial (nested
``tune.choice`` does not survive OptunaSearch). Categorical choices that are not plain
scalars (e.g. component nodes ``{name: gd, lr: 0.1}``) are suggested by label and mapped back.
:func:`corner_points` lists the configs validation builds before Ray starts: a covering set in which every
categorical choice appears, with numbers at their low and then their high ends (conditions respected).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional

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


class DefineByRun:
    """The define-by-run function for ``OptunaSearch(space=fn)``: suggests only, computes nothing.
    A class rather than a closure: OptunaSearch pickles itself into Tune's experiment checkpoint."""

    def __init__(self, space: Mapping[str, ParamNode]):
        self.space = dict(space)

    def __call__(self, trial: Any) -> None:
        sample(self.space, trial)


def define_by_run(space: Mapping[str, ParamNode]) -> Callable[[Any], None]:
    return DefineByRun(space)


def decode_params(space: Mapping[str, ParamNode], config: Mapping[str, Any]) -> Dict[str, Any]:
    """The sampled values in a Tune trial config (OptunaSearch puts raw suggestions at the top level)."""
    out = {}
    for key, p in space.items():
        if key in config:
            out[key] = decode(p, config[key])
    return out


class _Fixed:
    """A stand-in Optuna trial that returns predetermined values (for enumerating corner points)."""

    def __init__(self, picks: Mapping[str, Any]):
        self.picks = picks

    def suggest_categorical(self, key, choices):
        return self.picks.get(key, choices[0])

    def suggest_int(self, key, low, high, step=1, log=False):
        return self.picks.get(key, low)

    def suggest_float(self, key, low, high, step=None, log=False):
        return self.picks.get(key, low)


def corner_points(space: Mapping[str, ParamNode], limit: int = 64) -> List[Dict[str, Any]]:
    """A small covering set of reachable configs: every categorical choice appears, numbers at their low end
    in the first half and at their high end in the second; conditions are respected (so a conditional
    parameter appears whenever its condition is met by one of the rows)."""
    cats = [len(choice_labels(p)) for p in space.values() if p.type == "categorical"]
    n = max(cats, default=1)
    out: List[Dict[str, Any]] = []
    seen = set()
    for i in range(2 * n):
        end = "low" if i < n else "high"
        picks: Dict[str, Any] = {}
        for j, (key, p) in enumerate(space.items()):
            if p.type == "categorical":
                labels = choice_labels(p)
                picks[key] = labels[(i + j) % len(labels)]
            elif p.type == "int":
                picks[key] = int(p.low) if end == "low" else int(p.high)
            else:
                picks[key] = float(p.low) if end == "low" else float(p.high)
        vals = sample(space, _Fixed(picks))
        sig = repr(sorted(vals.items(), key=lambda kv: kv[0]))
        if sig not in seen:
            seen.add(sig)
            out.append(vals)
        if len(out) >= limit:
            break
    return out


def make_sampler(exp: ExperimentConfig):
    import optuna
    s = exp.search
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
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


__all__ = ["choice_labels", "condition_holds", "corner_points", "decode", "decode_params", "define_by_run",
           "grid_size", "make_sampler", "sample", "suggest"]
