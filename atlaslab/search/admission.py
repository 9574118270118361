"""What a trial must pass before it may train: validated, and sized to the experiment's state budget.

    adm = Admission(exp)
    trial = adm.admit(trial)          # the trial, sized and validated; or a TrialConfigError saying why not

Without a budget, admitting a trial is validating it (:class:`~atlaslab.search.expand.Validator`: the model built
on the meta device, the task and the training config). With ``budget: {state: S, tolerance: τ, size_by: {…}}``,
every combination of the ``size_by`` values is tried (a cross product, in the order given); the one whose state
``LanguageModel.state_size(seq_len)`` (recurrent-state scalars per sequence after the task's length, KV caches
included) lies within ``|state / S − 1| ≤ τ`` and nearest to ``S`` is kept, and the trial records it
(``info.budget``: the budget, the tolerance, the size chosen). A trial no size brings within the tolerance is
rejected with the states each size reached, so that the reason can be listed in the report.

A search's space is checked before Ray starts by :func:`preflight`: every categorical choice and both ends of every
numeric range must be admitted in at least one combination with the other parameters (tried at random, seeded), so
that a misspelt part name, a bound out of range or a part that never fits the budget is an error at once, while a combination of valid parts that cannot be built together
is left for the searcher to reject and count (:mod:`atlaslab.search.searcher`).
"""
from __future__ import annotations

import copy
import itertools
import json
import random
from typing import Any, Dict, List, Mapping, Optional, Tuple

from atlaslab.models.overrides import WHERE_PRESENT, match_wildcard
from atlaslab.registry import ConfigError
from atlaslab.search.expand import TrialConfigError, Validator, trial_from_params
from atlaslab.search.formatting import fmt_value, short_key
from atlaslab.search.schema import ExperimentConfig, ParamNode
from atlaslab.search.space import choice_labels, decode, sample

_MISSING = object()
#: random completions tried per categorical choice by :func:`preflight` before the choice counts as never admitted
#: (a choice that needs two other choices and a layer pattern that fits the budget, implicit_gd in
#: experiments/discovery_suite_1000.yaml, is admitted by about 1 completion in 12: 24 tries missed it 12 % of the time,
#: 64 miss it 0.4 %; only a choice that keeps failing costs the extra builds)
PREFLIGHT_TRIES = 64


class Admission:
    """Sizes trials to the experiment's budget and validates them (models cached by config, so repeats are free)."""

    def __init__(self, exp: ExperimentConfig):
        self.exp = exp
        self.validator = Validator(exp)

    @property
    def resolved(self) -> Dict[str, Any]:
        """Trial key → the typed model config of the trial as admitted."""
        return self.validator.resolved

    def admit(self, trial: Dict[str, Any]) -> Dict[str, Any]:
        """The trial sized to the budget (a new dict) and validated; raises :class:`TrialConfigError`."""
        budget = self.exp.budget
        if not budget.active:
            return self.validator.validate(trial)
        keys = list(budget.size_by)
        reached: List[Tuple[Dict[str, Any], Optional[int]]] = []
        best, best_dev, first_error = None, None, None
        inert: Dict[Tuple[int, Tuple[Any, ...]], bool] = {}     # (key index, the values before it) → matches nothing
        states: Dict[str, Optional[int]] = {}                    # the sizes' effective values → the state they built
        for values in itertools.product(*(budget.size_by[k] for k in keys)):
            size = dict(zip(keys, values))
            effective = _effective(keys, values, inert)
            if effective in states:                    # differs from a size built already only in inert keys
                reached.append((size, states[effective]))
                continue
            candidate = sized(trial, size)
            try:
                self.validator.validate(candidate)
            except ConfigError as exc:
                if not reached and not _about_size(exc, keys):
                    raise                              # the parts do not go together, at any size: no more builds
                first_error = first_error or exc
                reached.append((size, None))
                continue
            state = int(candidate["info"]["state_size"])
            _learn_inert(keys, values, inert, self.validator.resolved_model(candidate))
            states[_effective(keys, values, inert)] = state
            reached.append((size, state))
            dev = abs(state / budget.state - 1.0)
            if dev <= budget.tolerance + 1e-9 and (best_dev is None or dev < best_dev):   # 1e-9: 2080 / 1600 − 1 > 0.3
                best, best_dev = (candidate, size), dev
        if best is None:
            if all(s is None for _, s in reached) and first_error is not None:
                raise first_error                      # the combination itself cannot be built, at any size
            tried = ", ".join(f"{_size_label(size)} → {'invalid' if s is None else s}" for size, s in reached)
            raise TrialConfigError(trial_id(self.exp, trial), "budget.state",
                                   f"no size brings the state within ±{budget.tolerance:.0%} of {budget.state} "
                                   f"(tried {tried}).", value=budget.state)
        candidate, size = best
        self.validator.validate(candidate)             # its typed config is the one kept (cached: no rebuild)
        candidate["info"]["budget"] = {"state": int(budget.state), "tolerance": float(budget.tolerance),
                                       "size": dict(size)}
        return candidate


def _learn_inert(keys: List[str], values: Tuple[Any, ...], inert: Dict[Tuple[int, Tuple[Any, ...]], bool],
                 resolved: Mapping[str, Any]) -> None:
    """Record which where-present size keys (``model.?mixers.*.memory.memory.expansion``) matched nothing in the
    model a size built (``resolved``: its config with defaults): such a key was a no-op, and stays one for every value
    it takes after the same earlier values (whether it matches depends on the config before it is applied, not on its
    own value), so those sizes build the same model and need no build of their own."""
    for i, key in enumerate(keys):
        rest = key.split(".", 1)[1] if "." in key else key
        if rest.startswith(WHERE_PRESENT):
            inert.setdefault((i, tuple(values[:i])), not match_wildcard(resolved, rest))


def _effective(keys: List[str], values: Tuple[Any, ...], inert: Mapping[Tuple[int, Tuple[Any, ...]], bool]) -> str:
    """The size's values with every key known to be inert (after the same earlier values) left out, as a key."""
    return json.dumps([None if inert.get((i, tuple(values[:i]))) else v for i, v in enumerate(values)],
                      sort_keys=True, default=str)


def _about_size(exc: ConfigError, keys) -> bool:
    """Whether an error may depend on the size being tried: its path or reason names a field the budget sizes
    (``num_heads``, ``expansion``, …); an error that does not (implicit_gd without the l2 bias) holds at every size."""
    text = f"{exc.path} {exc.reason} {getattr(exc, 'source', '')}"
    return any(k.rsplit(".", 1)[-1] in text for k in keys)


def sized(trial: Mapping[str, Any], size: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``trial`` with the model overrides of ``size`` (``model.<path>`` → value) appended and recorded in
    its params (a search trial's label names them)."""
    out = copy.deepcopy(dict(trial))
    overrides = out["config"]["model"].setdefault("overrides", [])
    for key, value in size.items():
        overrides.append([key.split(".", 1)[1], copy.deepcopy(value), f"budget.size_by.{key}"])
        out["params"] = dict(out.get("params") or {}, **{key: value})
    if out.get("variant") == out.get("key"):          # a search trial: its label lists what was set
        out["label"] = ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in out["params"].items())
    return out


def trial_id(exp: ExperimentConfig, trial: Mapping[str, Any]) -> str:
    """How an error names a trial (as :meth:`Validator.validate` does)."""
    seed = f", seed {trial['seed']}" if len(exp.seeds) > 1 else ""
    return f"{trial['key']} ({trial['label']}{seed})"


def _size_label(size: Mapping[str, Any]) -> str:
    return ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in size.items())


class _Pick:
    """A stand-in Optuna trial: ``fixed`` values where given, uniform random choices elsewhere (seeded)."""

    def __init__(self, rng: random.Random, fixed: Mapping[str, Any]):
        self.rng, self.fixed = rng, fixed

    def suggest_categorical(self, key, choices):
        return self.fixed.get(key, self.rng.choice(list(choices)))

    def suggest_int(self, key, low, high, step=1, log=False):
        return self.fixed.get(key, self.rng.randrange(int(low), int(high) + 1, int(step or 1)))

    def suggest_float(self, key, low, high, step=None, log=False):
        return self.fixed.get(key, self.rng.uniform(float(low), float(high)))


def draw(space: Mapping[str, ParamNode], rng: random.Random, fixed: Mapping[str, Any] = ()) -> Dict[str, Any]:
    """One point of the space drawn at random (conditions respected), with ``fixed`` labels where given."""
    return sample(space, _Pick(rng, dict(fixed)))


def preflight(adm: Admission, seed: int = 0, tries: int = PREFLIGHT_TRIES) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``(admitted, rejected)``: for every categorical choice of the search space and both ends of every numeric
    range, a trial admitted with that value (random completions, at most ``tries`` each), and the draws rejected on
    the way (``{params, reason}``). With several task settings a draw counts as admitted only when it is admitted on
    every setting (as the searcher admits a candidate), and ``admitted`` holds its trial on each.

    Raises the last :class:`ConfigError` of a value that no completion admitted: a misspelt part, a value of the
    wrong type, a bound out of range, or a part that never fits the budget is an error before Ray starts. A
    conditional parameter is only tried where its condition holds."""
    exp = adm.exp
    settings = list(exp.settings())
    rng = random.Random(seed)
    admitted: List[Dict[str, Any]] = []
    rejected: List[Dict[str, Any]] = []
    outcome: Dict[str, Any] = {}          # a drawn point's signature → its admitted trial or its ConfigError
    targets = []           # (key, value as suggested): every categorical choice and both ends of every range
    for key, p in exp.space.items():
        if p.type == "categorical":
            targets += [(key, label) for label in choice_labels(p)]
        else:
            cast = int if p.type == "int" else float
            targets += [(key, cast(p.low)), (key, cast(p.high))]
    for key, label in targets or [("", None)]:
        if key and any(_suggested(exp.space[key], t["params"].get(key, _MISSING)) == label for t in admitted):
            continue                      # an earlier admitted trial already has this value
        last: Optional[ConfigError] = None
        for _ in range(tries):
            params = draw(exp.space, rng, {key: label} if key else {})
            if key and key not in params:      # its condition did not hold in this draw
                continue
            sig = repr(sorted(params.items(), key=lambda kv: kv[0]))
            if sig not in outcome:
                name = f"preflight{len(outcome):03d}"
                trials = [trial_from_params(exp, params, key=f"{name}-{s}" if len(settings) > 1 else name,
                                            index=len(outcome), setting=s) for s in settings]
                try:
                    outcome[sig] = [adm.admit(t) for t in trials]     # a draw is admitted on every setting
                    admitted.extend(outcome[sig])
                except ConfigError as exc:
                    outcome[sig] = exc
                    rejected.append({"params": dict(params), "reason": str(exc)})
            if not isinstance(outcome[sig], ConfigError):
                break
            last = outcome[sig]
        else:
            if last is None:
                raise ConfigError(f"search.space.{key}", f"the value {label!r} was never reachable (its condition "
                                  f"never held in {tries} draws).", value=label)
            where = f"search.space.{key}" if key else "search.space"
            what = f"with {key}={label!r} " if key else ""
            raise ConfigError(where, f"no combination {what}could be trained ({tries} draws); the last reason: "
                              f"{last}", value=label) from None
    return admitted, rejected


def _suggested(p: ParamNode, value: Any) -> Any:
    """``value`` as Optuna suggested it: a categorical's label, a number as itself."""
    if p.type != "categorical":
        return value
    labels = choice_labels(p)
    for lab in labels:
        if decode(p, lab) == value:
            return lab
    return None


__all__ = ["Admission", "PREFLIGHT_TRIES", "draw", "preflight", "sized", "trial_id"]
