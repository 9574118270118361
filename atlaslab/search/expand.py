"""Expand an experiment into trials and validate every one of them before Ray starts.

A trial is a plain, JSON-ready dict (it travels to Ray workers and into reports)::

    {"key": "t003", "index": 3, "setting": "mqar", "variant": "w/o Muon", "label": "w/o Muon",
     "row": "mqar · w/o Muon", "axes": {...}, "protocol": {"lr": 1e-3, "weight_decay": 0.0}, "seed": 0,
     "params": {dotted key: value},                 # every assignment made for this trial
     "config": {"model": {"preset": "atlas", "overrides": [[key, value, source], ...]},
                "task": {...}, "train": {...}},
     "info": {"num_parameters": …, "state_size": …, "components": {...}},
     "model_config": {...}}                         # the model config validated: what the trial builds

``row`` groups the trials a report line aggregates (seeds: mean ± std; protocol: best). Model overrides
keep their *source* (the experiment key that set them) so a validation error can say which line of the
file is wrong. :func:`validate_trials` builds every distinct model on the meta device (shapes, parameter
count, state size; no memory, no compute) and every task and training config; any problem raises one
:class:`TrialConfigError` naming the trial and the dotted path. A validated trial carries its model config
(``model_config``: the preset with the overrides applied), so a Ray worker builds exactly the model whose
size was recorded, whatever happens to the preset file afterwards (a resume included).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.init as init
from omegaconf import DictConfig

from atlaslab.models.lm import LanguageModel
from atlaslab.models.overrides import Override, override_items
from atlaslab.models.presets import preset_for_task
from atlaslab.registry import ConfigError, to_container
from atlaslab.search.formatting import fmt_value, short_key
from atlaslab.search.schema import ExperimentConfig
from atlaslab.tasks.base import build_task
from atlaslab.train.config import resolve_train_config

@dataclass
class Prepared:
    """A validated experiment: the node (for the run folder), the config and the expanded trials."""

    node: Dict[str, Any]
    exp: ExperimentConfig
    trials: List[Dict[str, Any]]          # grid: every trial; search: one admitted trial per choice of the space
    source: str = ""
    validate_s: float = 0.0
    overrides: List[str] = field(default_factory=list)
    #: trial key → its typed model config (ResolvedLM), what the trial builds without validating it again
    resolved: Dict[str, Any] = field(default_factory=dict)
    #: a search's draws rejected while every choice of its space was checked (``{params, reason}``)
    preflight_rejected: List[Dict[str, Any]] = field(default_factory=list)
    #: a search's synonymous choices (:mod:`atlaslab.search.synonyms`; only with ``search.synonyms: allow``)
    synonyms: List[Dict[str, Any]] = field(default_factory=list)


class TrialConfigError(ConfigError):
    """A ConfigError inside one expanded trial: the message starts with the trial."""

    def __init__(self, trial: str, path: str, reason: str, value: Any = None, choices=None):
        self.trial = trial
        super().__init__(path, reason, value, choices)

    def _format(self) -> str:
        return f"trial {self.trial}: " + super()._format()

    def __reduce__(self):
        return (type(self), (self.trial, self.path, self.reason, self.value, self.choices))

    def prefixed(self, prefix: str) -> "TrialConfigError":  # pragma: no cover - not nested further
        return self

    @classmethod
    def wrap(cls, trial: str, exc: ConfigError, prefix: str = "", source: str = "") -> "TrialConfigError":
        path = exc.path
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        reason = exc.reason + (f" (set by {source})" if source else "")
        return cls(trial, path, reason, exc.value, exc.choices)


# --------------------------------------------------------------------------------------------------
# dotted keys
# --------------------------------------------------------------------------------------------------
def flatten_overrides(node: Any, prefix: str = "", source: str = "model.overrides") -> List[Override]:
    """Model overrides (nested / dotted mapping, or list of ``key=value``) as ``(key, value, source)``
    (:func:`atlaslab.models.overrides.override_items`)."""
    return override_items(node, prefix, source)


def set_dotted(d: Dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = d.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            d[p] = nxt
        d = nxt
    if isinstance(value, Mapping) and isinstance(d.get(parts[-1]), dict) and "name" not in value:
        d[parts[-1]].update(copy.deepcopy(dict(value)))
    else:
        d[parts[-1]] = copy.deepcopy(value)


# --------------------------------------------------------------------------------------------------
# trial configs
# --------------------------------------------------------------------------------------------------
def build_trial_config(exp: ExperimentConfig, setting: str, assignments: Sequence[Tuple[str, Any, str]],
                       seed: int) -> Dict[str, Any]:
    """The run config (model, task, train) of one trial: the experiment's base plus ``assignments``."""
    settings = exp.settings()
    tnode = to_container(settings[setting])
    task = {"name": tnode} if isinstance(tnode, str) else copy.deepcopy(dict(tnode))
    ev = dataclasses.asdict(exp.eval)
    train = copy.deepcopy(dict(to_container(exp.train) or {}))
    preset = exp.model.preset
    model_ovs: List[Override] = flatten_overrides(exp.model.overrides)
    for key, value, src in assignments:
        root, _, rest = key.partition(".")
        if root == "model":
            if rest == "preset":
                preset = value
            elif rest == "overrides":
                model_ovs.extend(flatten_overrides(value, source=src))
            else:
                model_ovs.append((rest, copy.deepcopy(value), src))
        elif root == "task":
            set_dotted(task, rest, value)
        elif root == "tasks":
            s, _, f = rest.partition(".")
            if s == setting:
                set_dotted(task, f, value)
        elif root == "train":
            set_dotted(train, rest, value)
        elif root == "eval":
            ev[rest] = value
    for tkey, ekey in (("eval_interval", "interval"), ("eval_examples", "examples"),
                       ("eval_batch_size", "batch_size"), ("test_lengths", "lengths")):
        train.setdefault(tkey, copy.deepcopy(ev[ekey]))
    train["seed"] = int(seed)
    train["checkpoint_interval"] = 0       # checkpoints at evaluations: the points a trial reports to Tune
    train.setdefault("progress", "never")
    out = {"model": {"preset": preset, "overrides": [list(o) for o in model_ovs]}, "task": task, "train": train}
    if ev.get("lm_eval"):
        out["eval"] = {"lm_eval": copy.deepcopy(ev["lm_eval"])}
    return out


def resolve_model_node(model_node: Mapping[str, Any], vocab_size: Optional[int] = None):
    """``(DictConfig, ResolvedLM)`` of a trial's model node: its preset completed for the task and its overrides
    (:func:`atlaslab.models.presets.preset_for_task`). Raises ConfigError with the path inside the model config;
    ``err.source`` names the experiment key of the override at fault."""
    overrides = [tuple(o) for o in model_node.get("overrides", [])]
    return preset_for_task(str(model_node.get("preset")), overrides, vocab_size)


def model_config(model_node: Mapping[str, Any], vocab_size: Optional[int] = None) -> DictConfig:
    """The model config (DictConfig) of a trial's model node, validated (see :func:`resolve_model_node`)."""
    return resolve_model_node(model_node, vocab_size)[0]


def components(resolved: Mapping[str, Any]) -> Dict[str, str]:
    """Tags for a resolved model config: the component choice of every mixer (``atlas.inner_optimizer: muon``)."""
    out: Dict[str, str] = {}
    for key, node in (resolved.get("mixers") or {}).items():
        out[f"{key}.mixer"] = str(node.get("name"))
        mem = node.get("memory")
        if isinstance(mem, Mapping):
            for part, pnode in mem.items():
                if isinstance(pnode, Mapping) and "name" in pnode:
                    out[f"{key}.{part}"] = str(pnode["name"])
            for extra in ("chunk_size", "read"):
                if extra in mem:
                    out[f"{key}.{extra}"] = str(mem[extra])
            win = mem.get("window")
            if isinstance(win, Mapping) and "size" in win:
                out[f"{key}.window_size"] = str(win["size"])
            fm = mem.get("feature_map")
            if isinstance(fm, Mapping) and "degree" in fm:
                out[f"{key}.poly_degree"] = str(fm["degree"])
            m = mem.get("memory")
            if isinstance(m, Mapping) and "depth" in m and m.get("name") != "linear":
                out[f"{key}.memory_depth"] = str(m["depth"])
        if "mode" in node:
            out[f"{key}.mode"] = str(node["mode"])
    out["layers"] = ",".join(str(x) for x in resolved.get("layers", []))
    return out


# --------------------------------------------------------------------------------------------------
# expansion
# --------------------------------------------------------------------------------------------------
def _axis_points(exp: ExperimentConfig) -> List[Dict[str, Any]]:
    axes = exp.grid.axes if exp.grid is not None else {}
    if not axes:
        return [{}]
    keys = list(axes)
    if exp.grid.mode == "zip":
        return [dict(zip(keys, vals)) for vals in zip(*[axes[k] for k in keys])]
    return [dict(zip(keys, vals)) for vals in itertools.product(*[axes[k] for k in keys])]


def protocol_points(exp: ExperimentConfig) -> List[Dict[str, Any]]:
    """The (lr, weight decay) points of the protocol mini-grid (``[{}]`` without a protocol)."""
    p = exp.protocol
    if not p.active:
        return [{}]
    lrs = p.lr or [None]
    wds = p.weight_decay or [None]
    out = []
    for lr, wd in itertools.product(lrs, wds):
        pt = {}
        if lr is not None:
            pt["lr"] = lr
        if wd is not None:
            pt["weight_decay"] = wd
        out.append(pt)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:40] or "trial"


def row_label(variant: str, axes: Mapping[str, Any]) -> str:
    parts = [] if variant in ("", "base") and axes else [variant]
    parts += [f"{short_key(k)}={fmt_value(v)}" for k, v in axes.items()]
    return " · ".join(parts) or "base"


def _excluded(exp: ExperimentConfig, variant: str, axes: Mapping[str, Any], seed: int) -> bool:
    """Whether a ``grid.exclude`` entry matches this variant × axis point × seed (all of the entry's keys equal)."""
    point = dict(axes, variant=variant, seed=seed)
    return any(all(k in point and point[k] == v for k, v in entry.items()) for entry in exp.grid.exclude)


def expand_grid(exp: ExperimentConfig) -> List[Dict[str, Any]]:
    """Every trial of a grid experiment: settings × variants × axes × protocol × seeds (in that order), less the
    points ``grid.exclude`` names (a variant, axis values and/or a seed)."""
    assert exp.grid is not None
    variants = exp.grid.variants or {"base": {}}
    trials = []
    for setting in exp.settings():
        for vname, vnode in variants.items():
            for axes in _axis_points(exp):
                for proto in protocol_points(exp):
                    for seed in exp.seeds:
                        if _excluded(exp, vname, axes, seed):
                            continue
                        assignments = [(k, v, f"grid.variants.{vname}.{k}") for k, v in (vnode or {}).items()]
                        assignments += [(k, v, f"grid.axes.{k}") for k, v in axes.items()]
                        assignments += [(f"train.{k}", v, f"protocol.{k}") for k, v in proto.items()]
                        label = row_label(vname, axes)
                        row = f"{setting} · {label}" if len(exp.settings()) > 1 else label
                        params = {k: v for k, v, _ in assignments}
                        i = len(trials)
                        trials.append({
                            "key": f"t{i:03d}", "index": i, "setting": setting, "variant": vname,
                            "label": label, "row": row, "axes": dict(axes), "protocol": dict(proto),
                            "seed": int(seed), "params": params,
                            "config": build_trial_config(exp, setting, assignments, seed),
                        })
    return trials


def trial_from_params(exp: ExperimentConfig, params: Mapping[str, Any], key: str, index: int = 0,
                      setting: Optional[str] = None, seed: Optional[int] = None) -> Dict[str, Any]:
    """A search trial from sampled ``params`` (dotted key → value) on ``setting`` (default: the first) and ``seed``
    (default: the experiment's first)."""
    setting = next(iter(exp.settings())) if setting is None else setting
    seed = int(exp.seeds[0] if seed is None else seed)
    assignments = [(k, v, f"search.space.{k}") for k, v in params.items()]
    label = ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in params.items())
    return {"key": key, "index": index, "setting": setting, "variant": key, "label": label or key, "row": key,
            "axes": dict(params), "protocol": {}, "seed": seed, "params": dict(params),
            "config": build_trial_config(exp, setting, assignments, seed)}


def trial_hash(trial: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(trial["config"], sort_keys=True, default=str).encode()).hexdigest()[:8]


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _no_init():
    """Skip ``torch.nn.init`` fills while building on the meta device (values do not exist there, and the
    meta ``normal_`` would import torch._dynamo, seconds of start-up)."""
    names = ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "orthogonal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(init, n) for n in names if hasattr(init, n)}
    try:
        for n in saved:
            setattr(init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def meta_model(cfg: Any) -> LanguageModel:
    """The model of a (resolved) model config built on the meta device, for its shapes, parameter count and state
    size (no memory, no compute); a part that cannot be built there is built for real."""
    try:
        with torch.device("meta"), _no_init():
            return LanguageModel(cfg)
    except ConfigError:
        raise
    except Exception:
        return LanguageModel(cfg)


class Validator:
    """Validates trial configs; caches models by config so repeats (seeds, lr/wd) cost nothing."""

    def __init__(self, exp: ExperimentConfig):
        self.exp = exp
        self._models: Dict[str, Dict[str, Any]] = {}
        self._tasks: Dict[str, Any] = {}
        #: trial key → the trial's typed model config (:class:`~atlaslab.models.lm.ResolvedLM`), resolved once here
        self.resolved: Dict[str, Any] = {}

    def task(self, trial: Mapping[str, Any]):
        node = trial["config"]["task"]
        k = json.dumps(node, sort_keys=True, default=str)
        if k not in self._tasks:
            path = f"tasks.{trial['setting']}" if self.exp.tasks else "task"
            self._tasks[k] = build_task(node, path)
        return self._tasks[k]

    def model_info(self, model_node: Mapping[str, Any], task) -> Dict[str, Any]:
        k = json.dumps([model_node, task.vocab_size, task.seq_len], sort_keys=True, default=str)
        if k in self._models:
            return self._models[k]
        cfg, resolved_cfg = resolve_model_node(model_node, task.vocab_size)
        model = meta_model(resolved_cfg)
        resolved = model.resolved.to_dict()
        info = {
            "num_parameters": int(model.num_parameters()),
            "num_parameters_non_embedding": int(model.num_parameters(exclude_embeddings=True)),
            "state_size": int(model.state_size(task.seq_len)),
            "state_size_fixed": int(model.state_size()),
            "state_size_per_token": int(model.state_size_per_token()),
            "preset": str(model_node.get("preset")),
            "components": components(resolved),
            "resolved_model": resolved,
            "model_config": to_container(cfg),
            "typed": model.resolved,
        }
        self._models[k] = info
        return info

    def resolved_model(self, trial: Mapping[str, Any]) -> Dict[str, Any]:
        """The validated trial's model config with every default filled in (a dict; read-only, it is shared)."""
        task = self.task(trial)
        return self.model_info(trial["config"]["model"], task)["resolved_model"]

    def validate(self, trial: Dict[str, Any]) -> Dict[str, Any]:
        tid = f"{trial['key']} ({trial['label']}" + (f", seed {trial['seed']}" if len(self.exp.seeds) > 1 else "") + ")"
        cfg = trial["config"]
        try:
            task = self.task(trial)
        except ConfigError as exc:
            raise TrialConfigError.wrap(tid, exc) from None
        try:
            tcfg = resolve_train_config(cfg["train"], "train")
        except ConfigError as exc:
            raise TrialConfigError.wrap(tid, exc) from None
        try:
            tcfg.check_workers(self.exp.resources.workers_per_trial)
        except ConfigError as exc:
            raise TrialConfigError.wrap(tid, exc) from None
        split, _, name = self.exp.metric.partition("/")
        valid_splits = [tcfg.eval_split, tcfg.test_split, "train"]
        if split not in valid_splits:
            raise TrialConfigError(tid, "metric", f"split '{split}' is never reported.", value=split,
                                   choices=[f"{s}/{name}" for s in valid_splits])
        if self.exp.kind == "search" or self.exp.scheduler.name != "none":
            if split != tcfg.eval_split:
                raise TrialConfigError(tid, "metric", f"a scheduler or searcher needs an evaluation metric "
                                       f"({tcfg.eval_split}/…), got '{self.exp.metric}'.", value=self.exp.metric,
                                       choices=[f"{tcfg.eval_split}/{name}"])
        try:
            info = self.model_info(cfg["model"], task)
        except ConfigError as exc:
            raise TrialConfigError.wrap(tid, exc, "model", getattr(exc, "source", "")) from None
        trial["info"] = {k: v for k, v in info.items() if k not in ("resolved_model", "model_config", "typed")}
        trial["model_config"] = copy.deepcopy(info["model_config"])
        self.resolved[trial["key"]] = info["typed"]
        trial["info"]["task"] = task.info()
        trial["info"]["train"] = tcfg.to_dict()
        return trial


def validate_trials(exp: ExperimentConfig, trials: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    v = Validator(exp)
    for t in trials:
        v.validate(t)
    return trials


__all__ = ["Prepared", "TrialConfigError", "Validator", "build_trial_config", "components", "expand_grid",
           "flatten_overrides", "meta_model", "model_config", "protocol_points", "row_label", "trial_from_params",
           "trial_hash", "validate_trials"]
