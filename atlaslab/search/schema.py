"""The experiment file: one YAML that declares an ablation grid or a search, validated before anything runs.

    name: quickstart
    model:                                   # the base model: a preset plus overrides
      preset: atlas
      overrides: {d_model: 32, "?mixers.*.mode": chunked}    # mapping or dotlist; '*' matches every mixer,
                                             # '?' where present (atlaslab.models.overrides)
    task: {name: mqar, vocab_size: 64, seq_len: 32, num_kv_pairs: [4]}   # or tasks: {setting: node, ...}
    eval: {interval: 50, examples: 256, lengths: [32, 64]}               # → train.eval_interval, …
                                             # + lm_eval: {tasks: [...], limit: 100}: lm-eval after training
    train: {steps: 300, batch_size: 32, lr: 3e-3}                        # atlaslab.train.TrainConfig
    seeds: [0, 1]
    grid:                                    # an ablation …
      mode: cross                            # cross | zip (of the axes)
      variants:                              # named rows, each a set of dotted overrides
        ATLAS: {}
        "w/o Muon": {model.mixers.atlas.memory.inner_optimizer: {name: gd, lr: 0.1}}
        Titans: {model.preset: titans}
      axes: {model.mixers.atlas.memory.window.size: [1, 4]}
      exclude:                               # points of variants × axes × seeds not to run (every key must match)
        - {variant: Titans, model.mixers.atlas.memory.window.size: 1}
        - {variant: Titans, seed: 1}
      baseline: ATLAS
    protocol: {lr: [1e-4, 1e-3], weight_decay: [0.0, 0.1]}   # MAD: best over the mini-grid per row
    search:                                  # … or a search (never both)
      sampler: tpe                           # tpe | random
      space:
        train.lr: {type: float, low: 1e-4, high: 1e-2, log: true}
        model.mixers.atlas.memory.inner_optimizer.name: [muon, gd]
        model.mixers.atlas.memory.inner_optimizer.ns_steps:
          {type: int, low: 1, high: 5, when: {model.mixers.atlas.memory.inner_optimizer.name: muon}}
      score: {combine: mean, weights: {mqar: 1}}   # with tasks: {...}: each draw trained on every setting, told the
                                                   # weighted mean (or the worst) of their metric (search.fitness)
    num_samples: 16                          # configs a search draws
    scheduler: {name: asha, grace_period: 50, reduction_factor: 3}
    metric: val/accuracy                     # what the scheduler / searcher / "best" looks at
    mode: max
    max_concurrent: 2
    max_failures: 1                          # Ray retries of a trial that raised
    resources: {cpus_per_trial: 1, gpus_per_trial: 0, workers_per_trial: 1}   # >1: Ray Train workers (DDP)
    tracking: {uri: null, experiment: null}  # MLflow (default: sqlite mlflow.db beside the run folder)
    report:
      metrics: [test/accuracy]
      averages: {Avg: [lm_eval/piqa/acc, lm_eval/arc_easy/acc]}    # a column: each trial's mean of these
      labels: {lm_eval/piqa/acc: PIQA}                              # column headers

Dotted keys (grid axes, variants, search space) address the trial config: ``model.preset``,
``model.<path>`` (a preset override, e.g. ``model.mixers.atlas.memory.window.size``; ``*`` matches every mixer
that has the field), ``task.<field>`` (``tasks.<setting>.<field>`` for one setting), ``train.<field>`` and
``eval.<field>``. :func:`load_experiment` validates the file's structure (unknown key → ConfigError naming
the dotted path and the valid keys); :mod:`atlaslab.search.expand` then validates every expanded trial.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

import atlaslab.tasks  # noqa: F401  (registers the tasks, whose names a missing task lists)
from atlaslab.eval.lm_eval import LMEvalConfig, resolve_lm_eval
from atlaslab.models.overrides import parse_override, update_node
from atlaslab.models.presets import list_presets
from atlaslab.registry import (
                               ConfigError,
                               check_choice,
                               check_range,
                               get_registry,
                               import_user_modules,
                               to_container,
                               validate_structured,
                               )

#: roots a dotted key may start with
KEY_ROOTS = ("model", "task", "tasks", "train", "eval")
SAMPLERS = ("tpe", "random", "nsga2")
#: what a search objective may name besides the metrics a trial reports (recorded from the validated model and the
#: trial's own clock and step count): recurrent-state scalars per sequence, parameters, seconds per training step, and
#: the training steps the trial ran (``steps_trained``: with ``train.early_stop_threshold``, the evaluation at which it
#: reached the threshold, else its whole budget; how fast a candidate learns a setting)
MODEL_OBJECTIVES = ("state_size", "num_parameters", "step_time_s", "steps_trained")
#: ``candidate_asha``: a search's candidates compared by their score at each rung, their settings in lockstep
#: (:class:`atlaslab.search.schedulers.CandidateASHA`)
SCHEDULERS = ("none", "asha", "candidate_asha")
#: how a search with several task settings combines their ``metric`` into one score (:mod:`atlaslab.search.fitness`)
SCORE_COMBINE = ("mean", "worst")
PARAM_TYPES = ("float", "int", "categorical")


def _structured(cls: type, node: Any, path: str) -> Any:
    """Validate a mapping against dataclass ``cls`` (unknown key / bad type → ConfigError at ``path``)."""
    return validate_structured(cls, node, path, what="key")


@dataclass
class ModelNode:
    """The base model: a preset (name or YAML path) and overrides applied to every trial."""

    preset: str = "atlas"
    overrides: Any = field(default_factory=dict)   # mapping (nested or dotted keys) or a list of "k=v"


@dataclass
class EvalNode:
    """How trials are evaluated (mapped onto the training loop's settings)."""

    interval: int = 100         # → train.eval_interval (steps between evaluations; each is a Tune report)
    examples: int = 0           # → train.eval_examples (0: the task's default)
    batch_size: int = 0         # → train.eval_batch_size
    lengths: List[int] = field(default_factory=list)   # → train.test_lengths (accuracy vs length)
    lm_eval: Optional[LMEvalConfig] = None   # lm-eval tasks run after training (atlaslab.eval.lm_eval)

    def check(self) -> None:
        check_range("interval", self.interval, 0, None)
        check_range("examples", self.examples, 0, None)
        check_range("batch_size", self.batch_size, 0, None)
        for i, L in enumerate(self.lengths):
            check_range(f"lengths.{i}", L, 2, None)
        if self.lm_eval is not None:
            try:
                self.lm_eval.check()
            except ConfigError as exc:
                raise exc.prefixed("lm_eval") from None


@dataclass
class GridNode:
    mode: str = "cross"                                  # cross | zip (of the axes)
    axes: Dict[str, Any] = field(default_factory=dict)   # dotted key → list of values
    variants: Dict[str, Any] = field(default_factory=dict)   # name → {dotted key: value}
    exclude: List[Dict[str, Any]] = field(default_factory=list)  # [{variant: name, <axis key>: value, seed: s}, ...]
    baseline: Optional[str] = None                       # the row deltas are measured against

    def check(self) -> None:
        check_choice("mode", self.mode, ("cross", "zip"))


@dataclass
class ProtocolNode:
    """MAD's protocol: every setting is trained for each (lr, weight decay); the best one is reported."""

    lr: List[float] = field(default_factory=list)
    weight_decay: List[float] = field(default_factory=list)

    def check(self) -> None:
        for i, v in enumerate(self.lr):
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"lr.{i}", f"bad value {v!r}: must be a positive number.", value=v)
        for i, v in enumerate(self.weight_decay):
            check_range(f"weight_decay.{i}", v, 0.0, None)

    @property
    def active(self) -> bool:
        return bool(self.lr or self.weight_decay)


@dataclass
class ParamNode:
    """One search dimension (Optuna distribution), optionally conditional (``when``)."""

    type: str = "float"                      # float | int | categorical
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: List[Any] = field(default_factory=list)
    when: Dict[str, Any] = field(default_factory=dict)   # {dotted key: value or [values]}: sample only then

    def check(self) -> None:
        check_choice("type", self.type, PARAM_TYPES)
        if self.type == "categorical":
            if not self.choices:
                raise ConfigError("choices", "a categorical parameter needs at least one choice.", value=[])
            return
        for name in ("low", "high"):
            if getattr(self, name) is None:
                raise ConfigError(name, f"a {self.type} parameter needs '{name}'.")
        if self.type == "int":
            for name in ("low", "high"):
                v = getattr(self, name)
                if float(v) != int(v):
                    raise ConfigError(name, f"an int parameter needs an integer bound, got {v!r}.", value=v)
        if not self.low <= self.high:
            raise ConfigError("high", f"must be ≥ low ({self.low}), got {self.high!r}.", value=self.high)
        if self.log and self.low <= 0:
            raise ConfigError("low", f"a log-scale parameter needs low > 0, got {self.low!r}.", value=self.low)
        if self.log and self.step is not None:
            raise ConfigError("step", "Optuna does not take a step on a log scale.", value=self.step)


@dataclass
class ScoreNode:
    """A search's fitness over several task settings: each candidate is trained on every setting and told to the
    sampler as one score of the settings' ``metric`` (:mod:`atlaslab.search.fitness`).

    ``combine: mean`` is the weighted mean Σ_s w_s·m_s / Σ_s w_s (``weights``: setting → w_s > 0, default 1 each);
    ``combine: worst`` is the setting the candidate does worst on (the lowest ``metric`` when ``mode`` is max)."""

    combine: str = "mean"              # mean | worst
    weights: Dict[str, float] = field(default_factory=dict)   # setting → weight (mean only; default: 1 each)

    def check(self) -> None:
        check_choice("combine", self.combine, SCORE_COMBINE)
        if self.weights and self.combine != "mean":
            raise ConfigError("weights", f"weights apply to combine: mean, not {self.combine!r}.",
                              value=dict(self.weights), choices=["mean"])
        for name, w in self.weights.items():
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
                raise ConfigError(f"weights.{name}", f"a weight is a positive number, got {w!r}.", value=w)

    def check_settings(self, settings: Sequence[str]) -> None:
        """Every weighted setting is one of the experiment's (path relative to ``search.score``)."""
        for name in self.weights:
            if name not in settings:
                raise ConfigError(f"weights.{name}", f"no setting '{name}' in tasks.", value=name,
                                  choices=list(settings))


#: ``search.synonyms``: refuse a space with synonymous choices (the default), or run it and list them in the report
SYNONYM_POLICIES = ("error", "allow")


@dataclass
class SearchNode:
    space: Dict[str, Any] = field(default_factory=dict)   # dotted key → ParamNode (or a list: categorical)
    sampler: str = "tpe"               # tpe | random | nsga2 (NSGA-II: multi-objective)
    seed: int = 0
    #: further objectives after the experiment's ``metric``, each "<name>:min|max" (a reported metric, or one of
    #: MODEL_OBJECTIVES): the search is then multi-objective and the report draws its Pareto front
    objectives: List[str] = field(default_factory=list)
    #: draws in a row the searcher may reject (a combination that cannot be built, or cannot be sized to the
    #: budget) before it stops drawing: the search then ends with the trials it has
    max_rejections: int = 200
    #: with several task settings: how the settings' ``metric`` combine into the score the sampler is told
    score: ScoreNode = field(default_factory=ScoreNode)
    #: points of the space the sampler evaluates first, in order (Optuna's ``enqueue_trial``): each maps some
    #: of ``space``'s keys to a value the parameter can take; the keys it leaves out are sampled as usual. Use it
    #: to start a search from what is known to work (the presets' points), so the sampler's model begins there.
    enqueue: List[Dict[str, Any]] = field(default_factory=list)
    #: two choices of a parameter that build the same model (a mapping choice merged into the config's mapping,
    #: :mod:`atlaslab.search.synonyms`): ``error`` refuses the space before Ray starts; ``allow`` runs it and the
    #: report lists them
    synonyms: str = "error"

    def check(self) -> None:
        check_choice("sampler", self.sampler, SAMPLERS)
        check_choice("synonyms", self.synonyms, SYNONYM_POLICIES)
        try:
            self.score.check()
        except ConfigError as exc:
            raise exc.prefixed("score") from None
        check_range("max_rejections", self.max_rejections, 1, None)
        for i, obj in enumerate(self.objectives):
            name, _, mode = str(obj).rpartition(":")
            if not name or mode not in ("min", "max"):
                raise ConfigError(f"objectives.{i}", f"an objective is '<metric>:min' or '<metric>:max' (e.g. "
                                  f"state_size:min, step_time_s:min), got {obj!r}.", value=obj,
                                  choices=[f"{m}:min" for m in MODEL_OBJECTIVES])
            if name not in MODEL_OBJECTIVES and "/" not in name:
                raise ConfigError(f"objectives.{i}", f"'{name}' is neither a reported metric ('<split>/<name>') nor "
                                  f"one of the model's own measures.", value=name, choices=list(MODEL_OBJECTIVES))

    def objective_pairs(self, metric: str, mode: str) -> List[tuple]:
        """``[(metric, mode), …]``: the experiment's metric first, then :attr:`objectives`."""
        return [(metric, mode)] + [tuple(str(o).rsplit(":", 1)) for o in self.objectives]


@dataclass
class BudgetNode:
    """A recurrent-state budget every trial is sized to: of the values of the ``size_by`` keys (tried as a
    cross product), the one whose state (scalars per sequence after the task's ``seq_len`` tokens, KV caches
    included; ``LanguageModel.state_size``) lies within ``tolerance`` of ``state`` and nearest to it is chosen; a
    trial that no size brings within the tolerance is rejected with the states it could reach."""

    state: int = 0                      # scalars per sequence (0: no budget)
    tolerance: float = 0.1              # |state / budget − 1| ≤ tolerance
    size_by: Dict[str, List[Any]] = field(default_factory=dict)   # model.<path> → the values to try, in order

    @property
    def active(self) -> bool:
        return self.state > 0

    def check(self) -> None:
        check_range("state", self.state, 0, None)
        if not 0 <= self.tolerance < 1:
            raise ConfigError("tolerance", f"must be in [0, 1), got {self.tolerance!r}.", value=self.tolerance)
        if self.active and not self.size_by:
            raise ConfigError("size_by", "a state budget needs at least one model key to size by, e.g. "
                              "{model.mixers.*.num_heads: [1, 2, 4, 8, 16]}.", value={})
        for key, values in self.size_by.items():
            if not str(key).startswith("model.") or str(key) == "model.preset":
                raise ConfigError(f"size_by.{key}", "a budget sizes the model: the key is model.<path> (e.g. "
                                  "model.mixers.*.num_heads, model.d_model).", value=str(key))
            if not isinstance(values, list) or not values:
                raise ConfigError(f"size_by.{key}", f"a non-empty list of values to try, got {values!r}.",
                                  value=values)


@dataclass
class SchedulerNode:
    name: str = "none"                 # none | asha | candidate_asha (a search's candidates, settings in lockstep)
    grace_period: int = 0              # steps before ASHA may stop a trial (0: the first evaluation)
    reduction_factor: float = 3.0
    max_t: int = 0                     # 0: train.steps
    brackets: int = 1

    def check(self) -> None:
        check_choice("name", self.name, SCHEDULERS)
        check_range("grace_period", self.grace_period, 0, None)
        if not self.reduction_factor > 1:
            raise ConfigError("reduction_factor", "must be > 1.", value=self.reduction_factor)
        check_range("max_t", self.max_t, 0, None)
        check_range("brackets", self.brackets, 1, None)
        if self.name == "candidate_asha" and self.brackets != 1:
            raise ConfigError("brackets", "candidate_asha has one bracket (its rungs are grace_period × "
                              f"reduction_factor^k steps), got {self.brackets}.", value=self.brackets, choices=["1"])

    def check_kind(self, kind: str) -> None:
        """``candidate_asha`` compares a search's candidates: a grid has none."""
        if self.name == "candidate_asha" and kind != "search":
            raise ConfigError("name", "candidate_asha compares the candidates of a search (search:); a grid has "
                              "none: use asha or none.", value=self.name, choices=["none", "asha"])


@dataclass
class ResourcesNode:
    """What one trial takes. With ``workers_per_trial: N > 1`` the trial trains on N Ray Train workers (one
    data-parallel process each) that share its CPUs evenly and have one GPU each (``gpus_per_trial`` 0 or N)."""

    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    workers_per_trial: int = 1

    def check(self) -> None:
        if not self.cpus_per_trial > 0:
            raise ConfigError("cpus_per_trial", "must be > 0.", value=self.cpus_per_trial)
        check_range("gpus_per_trial", self.gpus_per_trial, 0.0, None)
        check_range("workers_per_trial", self.workers_per_trial, 1, None)
        n = self.workers_per_trial
        if n > 1 and self.gpus_per_trial not in (0, n):
            raise ConfigError("gpus_per_trial", f"a trial on {n} workers takes one GPU per worker: "
                              f"gpus_per_trial must be 0 or {n} (workers_per_trial), got {self.gpus_per_trial!r}.",
                              value=self.gpus_per_trial, choices=["0", str(n)])


@dataclass
class TrackingNode:
    uri: Optional[str] = None          # MLflow URI (default: $MLFLOW_TRACKING_URI, else mlflow.db beside the run)
    experiment: Optional[str] = None   # MLflow experiment name (default: the experiment's name)
    enabled: bool = True


@dataclass
class ReportNode:
    metrics: List[str] = field(default_factory=list)   # table columns (default: metric + test/<same>)
    curve_metric: str = ""             # learning curves (default: metric)
    length_metric: str = "accuracy"    # accuracy vs eval length: test/len_<L>/<length_metric>
    plots: bool = True
    mad_score: bool = False            # with several settings: best per setting, mean per task, then over tasks
    steps_to: Optional[float] = None   # add a column: first evaluation step with `metric` ≥ this (≤ when min)
    averages: Dict[str, List[str]] = field(default_factory=dict)   # column name → metrics it is each trial's mean of
    labels: Dict[str, str] = field(default_factory=dict)           # metric (or average) → its column header

    def check(self) -> None:
        for name, parts in self.averages.items():
            if not parts:
                raise ConfigError(f"averages.{name}", "an average needs at least one metric.", value=[])
            if name in parts:
                raise ConfigError(f"averages.{name}", "an average cannot list itself.", value=name)
            for i, m in enumerate(parts):
                if m in self.averages:
                    raise ConfigError(f"averages.{name}.{i}", "an average is of metrics, not of other averages.",
                                      value=m)


@dataclass
class ExperimentConfig:
    """The validated experiment (see the module docstring)."""

    name: str = ""
    description: str = ""
    imports: List[str] = field(default_factory=list)   # modules registering user parts (driver and trials)
    model: ModelNode = field(default_factory=ModelNode)
    task: Any = None
    tasks: Dict[str, Any] = field(default_factory=dict)
    eval: EvalNode = field(default_factory=EvalNode)
    train: Dict[str, Any] = field(default_factory=dict)
    seeds: List[int] = field(default_factory=lambda: [0])
    grid: Optional[GridNode] = None
    search: Optional[SearchNode] = None
    protocol: ProtocolNode = field(default_factory=ProtocolNode)
    num_samples: int = 1
    scheduler: SchedulerNode = field(default_factory=SchedulerNode)
    metric: str = "val/accuracy"
    mode: str = "max"
    max_concurrent: int = 0            # 0: as many as the resources allow
    max_failures: int = 1
    resources: ResourcesNode = field(default_factory=ResourcesNode)
    tracking: TrackingNode = field(default_factory=TrackingNode)
    report: ReportNode = field(default_factory=ReportNode)
    budget: BudgetNode = field(default_factory=BudgetNode)
    space: Dict[str, ParamNode] = field(default_factory=dict)   # filled from search.space (validated)

    def check(self) -> None:
        for name in ("eval", "protocol", "scheduler", "resources", "report", "budget"):
            try:
                getattr(self, name).check()
            except ConfigError as exc:
                raise exc.prefixed(name) from None

    @property
    def kind(self) -> str:
        return "search" if self.search is not None else "grid"

    def settings(self) -> Dict[str, Any]:
        """Setting name → task node (one setting named after the task when ``task`` is given)."""
        if self.tasks:
            return dict(self.tasks)
        node = to_container(self.task)
        name = node if isinstance(node, str) else (node or {}).get("name", "task")
        return {str(name): node}

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("space", None)
        return out


TOP_FIELDS = [f.name for f in dataclasses.fields(ExperimentConfig) if f.name != "space"]


def _check_key(key: str, path: str, exp_settings: Sequence[str]) -> None:
    """A dotted key of an axis / variant / search param must address the trial config."""
    root, _, rest = str(key).partition(".")
    if root not in KEY_ROOTS or not rest:
        raise ConfigError(path, f"a dotted key must start with one of {', '.join(KEY_ROOTS)} and name a field "
                          f"(e.g. model.mixers.atlas.memory.window.size, train.lr), got '{key}'.", value=str(key),
                          choices=list(KEY_ROOTS))
    if root == "tasks":
        setting, _, field_ = rest.partition(".")
        if setting not in exp_settings:
            raise ConfigError(path, f"no setting '{setting}' in tasks.", value=setting, choices=list(exp_settings))
        if not field_:
            raise ConfigError(path, f"'{key}' names a setting, not one of its fields.", value=str(key))
    if root == "eval":
        fields = [f.name for f in dataclasses.fields(EvalNode)]
        if rest not in fields:
            raise ConfigError(path, f"unknown eval field '{rest}'.", value=rest, choices=fields)


def parse_param(key: str, node: Any, path: str) -> ParamNode:
    node = to_container(node)
    if isinstance(node, (list, tuple)):
        node = {"type": "categorical", "choices": list(node)}
    elif not isinstance(node, Mapping):
        raise ConfigError(path, f"a search parameter is a mapping ({{type: float, low: …, high: …}}) or a list of "
                          f"choices, got {node!r}.", value=node)
    return _structured(ParamNode, node, path)


def validate_experiment(cfg: Any, source: str = "") -> ExperimentConfig:
    """Structural validation of an experiment node (the trials are validated by :mod:`.expand`)."""
    node = _top_level(cfg, source)
    raw_grid, raw_search = node.pop("grid", None), node.pop("search", None)
    raw_model = node.pop("model", None)
    exp = _structured(ExperimentConfig, node, "")
    exp.model = _model_node(raw_model)
    _check_tasks(exp)
    settings = list(exp.settings())
    _check_fields(exp)
    if raw_grid is not None and raw_search is not None:
        raise ConfigError("search", "an experiment is either an ablation grid or a search, not both.",
                          choices=["grid", "search"])
    if raw_search is not None:
        _validate_search(exp, raw_search, settings)
    else:
        _validate_grid(exp, raw_grid, settings)
    try:
        exp.scheduler.check_kind(exp.kind)
    except ConfigError as exc:
        raise exc.prefixed("scheduler") from None
    _check_budget(exp, settings)
    if exp.eval.lm_eval is not None:          # lm-eval installed and every task known, before any trial
        resolve_lm_eval(exp.eval.lm_eval, "eval.lm_eval")
    return exp


def _top_level(cfg: Any, source: str) -> Dict[str, Any]:
    """The experiment node as a dict whose keys are all experiment fields, named (after the file) if it was not."""
    node = to_container(cfg)
    if not isinstance(node, Mapping):
        raise ConfigError("", f"an experiment file must be a mapping, got {type(node).__name__}.")
    node = dict(node)
    for key in node:
        if key not in TOP_FIELDS:
            raise ConfigError(str(key), f"unknown experiment key '{key}'.", value=str(key), choices=TOP_FIELDS)
    if not node.get("name"):
        node["name"] = Path(source).stem if source else "experiment"
    if "space" in node:  # pragma: no cover - guarded by TOP_FIELDS
        node.pop("space")
    return node


def _model_node(raw_model: Any) -> ModelNode:
    """The base model (``model: <preset>`` or ``{preset, overrides}``); overrides a mapping or a dotlist."""
    model = to_container(raw_model)
    if model is None:
        raise ConfigError("model", "the experiment needs a base model: model: {preset: <name>, overrides: {...}}.",
                          choices=_preset_names())
    if isinstance(model, str):
        model = {"preset": model}
    out = _structured(ModelNode, model, "model")
    ov = out.overrides
    if ov is not None and not isinstance(ov, (Mapping, list, tuple)):
        raise ConfigError("model.overrides", f"expected a mapping or a list of 'key=value', got {ov!r}.", value=ov)
    return out


def _check_tasks(exp: ExperimentConfig) -> None:
    """Exactly one of ``task`` and ``tasks``; every setting of ``tasks`` a task node."""
    if exp.task is None and not exp.tasks:
        raise ConfigError("task", "the experiment needs a task (task: {name: …}) or settings (tasks: {…}).",
                          choices=_task_names())
    if exp.task is not None and exp.tasks:
        raise ConfigError("tasks", "give either task or tasks, not both.")
    for name, tnode in exp.tasks.items():
        if not isinstance(to_container(tnode), (Mapping, str)):
            raise ConfigError(f"tasks.{name}", f"expected a task node ({{name: …}}), got {tnode!r}.",
                              choices=_task_names())


def _check_fields(exp: ExperimentConfig) -> None:
    """The simple fields: mode, metric, seeds and the counts."""
    check_choice("mode", exp.mode, ("max", "min"))
    if "/" not in exp.metric:
        raise ConfigError("metric", f"a metric is '<split>/<name>' (e.g. val/accuracy), got '{exp.metric}'.",
                          value=exp.metric, choices=["val/accuracy", "val/loss", "val/exact_match"])
    if not exp.seeds:
        raise ConfigError("seeds", "needs at least one seed.", value=[])
    for i, s in enumerate(exp.seeds):
        check_range(f"seeds.{i}", s, 0, None)
    check_range("num_samples", exp.num_samples, 1, None)
    check_range("max_concurrent", exp.max_concurrent, 0, None)
    check_range("max_failures", exp.max_failures, 0, None)
    if len(set(exp.seeds)) != len(exp.seeds):
        raise ConfigError("seeds", f"repeated seeds {exp.seeds}.", value=exp.seeds)


def _validate_search(exp: ExperimentConfig, raw_search: Any, settings: Sequence[str]) -> None:
    """``search``: the space (into ``exp.space``), conditions on earlier parameters, no protocol, one seed."""
    exp.search = _structured(SearchNode, raw_search, "search")
    try:
        exp.search.score.check_settings(settings)
    except ConfigError as exc:
        raise exc.prefixed("search.score") from None
    if not exp.search.space:
        raise ConfigError("search.space", "a search needs at least one parameter.", value={})
    for key, pnode in exp.search.space.items():
        path = f"search.space.{key}"
        _check_key(key, path, settings)
        p = parse_param(key, pnode, path)
        _check_conditions(exp, p, path)
        exp.space[key] = p
    for i, point in enumerate(exp.search.enqueue):
        _check_enqueued(exp, point, f"search.enqueue.{i}")
    if exp.protocol.active:
        raise ConfigError("protocol", "the lr × weight-decay protocol is for grids; put train.lr and "
                          "train.weight_decay in search.space instead.")


def _check_budget(exp: ExperimentConfig, settings: Sequence[str]) -> None:
    """The budget's size keys address the model, and none of them is also set by the grid or the search (the
    budget would overwrite it)."""
    searched = set(exp.space) | set((exp.grid.axes if exp.grid else {}) or {})
    for key in exp.budget.size_by:
        _check_key(key, f"budget.size_by.{key}", settings)
        if key in searched:
            raise ConfigError(f"budget.size_by.{key}", "this key is also searched or a grid axis; the budget sets it "
                              "for every trial, so it can be one or the other.", value=key)
    if exp.search is not None:
        for i, (name, _) in enumerate(exp.search.objective_pairs(exp.metric, exp.mode)[1:]):
            if name == exp.metric:
                raise ConfigError(f"search.objectives.{i}", "the experiment's metric is already the first objective.",
                                  value=name)


def _check_conditions(exp: ExperimentConfig, p: ParamNode, path: str) -> None:
    """A ``when`` names parameters listed before this one (already in ``exp.space``), with values they can take."""
    seen = list(exp.space)
    for ckey, cval in p.when.items():
        if ckey not in seen:
            raise ConfigError(f"{path}.when.{ckey}", "a condition must name a parameter listed before "
                              "this one.", value=ckey, choices=seen)
        cp = exp.space[ckey]
        if cp.type == "categorical":
            vals = cval if isinstance(cval, list) else [cval]
            for v in vals:
                if v not in cp.choices:
                    raise ConfigError(f"{path}.when.{ckey}", f"{v!r} is not a choice of {ckey}.", value=v,
                                      choices=[str(c) for c in cp.choices])


def _check_enqueued(exp: ExperimentConfig, point: Any, path: str) -> None:
    """An enqueued point names parameters of the space (only those whose ``when`` holds on the point), each with a
    value the parameter can take (a choice, or a number within [low, high])."""
    if not isinstance(point, Mapping) or not point:
        raise ConfigError(path, f"an enqueued point is a non-empty mapping of space keys to values, got {point!r}.",
                          value=point, choices=list(exp.space))
    for key, value in point.items():
        kpath = f"{path}.{key}"
        if key not in exp.space:
            raise ConfigError(kpath, "not a parameter of search.space.", value=key, choices=list(exp.space))
        p = exp.space[key]
        for ckey, want in p.when.items():
            allowed = want if isinstance(want, list) else [want]
            if point.get(ckey) not in allowed:
                raise ConfigError(kpath, f"sampled only when {ckey} is one of {allowed}; the point gives "
                                  f"{point.get(ckey)!r}.", value=point.get(ckey), choices=[str(a) for a in allowed])
        if p.type == "categorical":
            if value not in p.choices:
                raise ConfigError(kpath, f"{value!r} is not a choice of this parameter.", value=value,
                                  choices=[str(c) for c in p.choices])
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not p.low <= value <= p.high:
            raise ConfigError(kpath, f"a number in [{p.low}, {p.high}], got {value!r}.", value=value)


def _validate_grid(exp: ExperimentConfig, raw_grid: Any, settings: Sequence[str]) -> None:
    """``grid`` (also when absent: one base point): axes, variants, exclusions and the baseline."""
    exp.grid = _structured(GridNode, raw_grid or {}, "grid")
    if exp.num_samples != 1:
        raise ConfigError("num_samples", "a grid runs every point once per seed: list repeats in seeds.",
                          value=exp.num_samples)
    g = exp.grid
    for key, values in g.axes.items():
        path = f"grid.axes.{key}"
        _check_key(key, path, settings)
        if not isinstance(values, list) or not values:
            raise ConfigError(path, f"an axis is a non-empty list of values, got {values!r}.", value=values)
    if g.mode == "zip" and g.axes:
        lengths = {k: len(v) for k, v in g.axes.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError("grid.axes", f"zipped axes need equal lengths, got {lengths}.", value=lengths)
    for vname, vnode in g.variants.items():
        vnode = {} if vnode is None else vnode
        if not isinstance(vnode, Mapping):
            raise ConfigError(f"grid.variants.{vname}", "a variant is a mapping of dotted keys to values.",
                              value=vnode)
        g.variants[vname] = dict(vnode)
        for key in vnode:
            _check_key(key, f"grid.variants.{vname}.{key}", settings)
    _check_exclude(g, exp.seeds)
    if g.baseline is not None and g.baseline not in g.variants:
        raise ConfigError("grid.baseline", f"no variant named '{g.baseline}'.", value=g.baseline,
                          choices=list(g.variants))


def _check_exclude(g: GridNode, seeds: Sequence[int]) -> None:
    """Each ``grid.exclude`` entry names a variant, axis values and/or a seed that exist, so a typo cannot silently
    exclude nothing."""
    if not isinstance(g.exclude, list):
        raise ConfigError("grid.exclude", "a list of mappings ({variant: name, <axis key>: value, seed: s}).",
                          value=g.exclude)
    for i, entry in enumerate(g.exclude):
        path = f"grid.exclude.{i}"
        if not isinstance(entry, Mapping) or not entry:
            raise ConfigError(path, "an exclusion is a non-empty mapping ({variant: name, <axis key>: value}).",
                              value=entry)
        for key, value in entry.items():
            if key == "variant":
                if value not in g.variants:
                    raise ConfigError(f"{path}.variant", f"no variant named {value!r}.", value=value,
                                      choices=list(g.variants))
            elif key == "seed":
                if value not in seeds:
                    raise ConfigError(f"{path}.seed", f"{value!r} is not one of the experiment's seeds.", value=value,
                                      choices=[str(s) for s in seeds])
            elif key not in g.axes:
                raise ConfigError(f"{path}.{key}", "an exclusion matches 'variant', a grid axis or 'seed'.", value=key,
                                  choices=["variant"] + list(g.axes) + ["seed"])
            elif value not in g.axes[key]:
                raise ConfigError(f"{path}.{key}", f"{value!r} is not a value of this axis.", value=value,
                                  choices=list(g.axes[key]))


def _preset_names() -> List[str]:
    return list_presets()


def _task_names() -> List[str]:
    return get_registry("task").names()


def load_experiment_node(path: Optional[str] = None, overrides: Sequence[str] = (), node: Any = None) -> DictConfig:
    """The experiment as a DictConfig (file or ``node``) with dotlist ``overrides`` applied, not yet validated.

    An override key may contain a dotted grid key in quotes-free form only when it is a top-level field
    path (``train.steps=50``, ``grid.baseline=ATLAS``, ``scheduler.name=none``); to change an axis use
    ``grid.axes={...}`` with a YAML value."""
    if node is not None:
        cfg = OmegaConf.create(to_container(node))
    else:
        p = Path(str(path))
        if not p.is_file():
            raise ConfigError("experiment", f"no such file {str(path)!r}.", value=str(path))
        try:
            cfg = OmegaConf.load(p)
        except Exception as exc:  # yaml errors
            raise ConfigError("experiment", f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError("experiment", "an experiment file must be a mapping.")
    for item in overrides:
        key, value = parse_override(item)
        root = key.split(".")[0]
        if root not in TOP_FIELDS:
            raise ConfigError(key, f"unknown experiment key '{root}'.", value=root, choices=TOP_FIELDS)
        update_node(cfg, key, value, merge=True)
    return cfg


def load_experiment(path: Optional[str] = None, overrides: Sequence[str] = (), node: Any = None) -> ExperimentConfig:
    """Load, override and validate an experiment file (structure only; see :func:`expand.validate`)."""
    cfg = load_experiment_node(path, overrides, node)
    exp = validate_experiment(cfg, source=str(path or ""))
    import_user_modules(exp.imports)
    return exp


__all__ = [
    "KEY_ROOTS",
    "EvalNode",
    "ExperimentConfig",
    "GridNode",
    "ModelNode",
    "ParamNode",
    "BudgetNode",
    "ProtocolNode",
    "ReportNode",
    "ResourcesNode",
    "SchedulerNode",
    "ScoreNode",
    "SearchNode",
    "TrackingNode",
    "load_experiment",
    "load_experiment_node",
    "parse_override",
    "validate_experiment",
]
