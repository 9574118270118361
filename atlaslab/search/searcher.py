"""The search's Ray Tune searcher: Optuna's ask-and-tell, with every draw admitted (validated and sized to the
state budget) in the driver before a trial is started.

    searcher = PartSearcher(exp, run_dir)    # TuneConfig(search_alg=searcher, num_samples=num_samples × cells)

For each trial Tune asks for, :meth:`PartSearcher.suggest` asks Optuna for a point of the space
(:func:`atlaslab.search.space.sample`, conditions respected), turns it into a trial and admits it
(:class:`~atlaslab.search.admission.Admission`). A point that cannot be built (parts that do not go together) or
cannot be sized to the budget is told to Optuna as infeasible (a violated constraint, which TPE and NSGA-II rank
below every feasible trial, so the sampler learns to avoid it), recorded with its
reason in ``rejected.json`` of the run folder and in the report, and the next point is drawn: a rejected
combination never becomes a crashed trial. After ``search.max_rejections`` rejections in a row the search stops
drawing (the report says so). The points of ``search.enqueue`` are Optuna's first trials (``enqueue_trial``), so
a search can start from known good points (the presets'); they are admitted like any draw.

The trial Tune starts carries the admitted trial (``{"trial": …}``, as a grid's does), so the worker trains
exactly the sized, validated model. Objectives: the experiment's ``metric`` first, then ``search.objectives``
(a reported metric, or ``state_size`` / ``num_parameters`` / ``step_time_s``, read from the trial's final
result); with more than one, Optuna's study is multi-objective (TPE or NSGA-II) and a trial that did not finish
(stopped by the scheduler, raised) is told as pruned / failed rather than with a partial value. A trial that
diverged, or went over its step-cost bound (``train.max_step_time_s``), is told as infeasible (a violated
constraint ``diverged`` / ``over_cost``), as a rejected draw is, so the sampler learns to avoid it.

**Several settings** (``tasks: {setting: …}``): one draw is one *candidate* trained on every setting. The draw is
turned into one trial per setting, each admitted and sized to the budget at its own sequence length; if any setting
rejects it, the whole draw is rejected (the reason names the setting). The first trial goes to Tune at once, the
others wait in :attr:`PartSearcher.queue` and are handed out by the next ``suggest`` calls, before a new draw.
When every setting's trial of a draw has ended, Optuna is told the candidate's objectives
(:func:`atlaslab.search.fitness.combine_objective`: the score of ``search.score`` for the metric, the mean step
time, the max state): FAIL if a setting's trial raised, infeasible if one diverged or went over its step-cost
bound, PRUNED if one was stopped by the scheduler.
**Several seeds** (``seeds: [0, 1, …]``): the draw is trained on every setting × seed, one trial per *cell*
(:func:`atlaslab.search.fitness.cells`), and a setting's value is the mean over its seeds before the settings
combine; with one setting and several seeds a draw is a candidate too.
The queue and the per-draw results (:attr:`PartSearcher.draws`) are saved with the searcher, so a resumed search
finishes the draws it had started.
"""
from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any, Dict, List, Optional

from ray.tune.search import Searcher

from atlaslab.registry import ConfigError
from atlaslab.search.admission import Admission
from atlaslab.search.expand import trial_from_params
from atlaslab.search.fitness import cells, combine_objective, per_setting
from atlaslab.search.results import REJECTED_NAME
from atlaslab.search.schema import ExperimentConfig
from atlaslab.search.space import make_sampler, optuna_value, sample

#: the user attribute of an Optuna trial whose draw was rejected before training (its reason)
REJECTED_ATTR = "atlaslab_rejected"
#: the user attribute of an Optuna trial whose training went over ``train.max_step_time_s`` (measured / bound − 1)
OVER_COST_ATTR = "atlaslab_over_cost"
#: the user attribute of an Optuna trial whose training diverged (a non-finite loss or gradient)
DIVERGED_ATTR = "atlaslab_diverged"


def _over_cost(result: Dict[str, Any]) -> Optional[float]:
    """How far a finished trial went over its step-cost bound (measured / bound − 1), or None when it did not end
    as ``over_cost``."""
    if result.get("status") != "over_cost":
        return None
    bound = result.get("max_step_time_s")
    per_step = result.get("train_step_time_s")
    if bound and per_step:
        return max(float(per_step) / float(bound) - 1.0, 0.0)
    return 0.0


def _quiet_optuna():
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


class PartSearcher(Searcher):
    """Optuna ask-and-tell over ``exp.space`` with admission in the driver (see the module docstring)."""

    def __init__(self, exp: ExperimentConfig, run_dir: Optional[Path] = None):
        pairs = exp.search.objective_pairs(exp.metric, exp.mode)
        metric = [m for m, _ in pairs] if len(pairs) > 1 else pairs[0][0]
        mode = [d for _, d in pairs] if len(pairs) > 1 else pairs[0][1]
        super().__init__(metric=metric, mode=mode)
        self.exp = exp
        self.pairs = pairs
        self.run_dir = None if run_dir is None else str(run_dir)
        optuna = _quiet_optuna()
        directions = ["maximize" if d == "max" else "minimize" for _, d in pairs]
        self.study = optuna.create_study(directions=directions, sampler=make_sampler(exp))
        for point in exp.search.enqueue:             # evaluated first, in order; keys left out are sampled
            self.study.enqueue_trial({k: optuna_value(exp.space[k], v) for k, v in point.items()},
                                     skip_if_exists=True)
        self.live: Dict[str, Any] = {}               # Tune trial id → Optuna trial number
        self.info: Dict[str, Dict[str, Any]] = {}    # Tune trial id → the admitted trial's info (objectives)
        self.rejected: List[Dict[str, Any]] = []     # every rejected draw: {number, params, reason}
        self.in_a_row = 0
        self.stopped = ""                            # why the search stopped drawing ("" while it draws)
        self._admission: Optional[Admission] = None
        #: every (cell name, setting, seed) a candidate is trained on (:func:`~atlaslab.search.fitness.cells`)
        self.cells: List[tuple] = cells(exp)
        #: several settings: admitted trials of accepted draws waiting for a Tune trial (the draw's other settings)
        self.queue: List[Dict[str, Any]] = []
        #: several settings: Optuna number → {"candidate": id, "results": {setting: outcome}} of draws not yet told
        self.draws: Dict[int, Dict[str, Any]] = {}
        self.where: Dict[str, str] = {}              # Tune trial id → its cell (several settings or seeds)
        #: Optuna number → the asked trial of a draw in training (to mark it infeasible when it is over its cost)
        self.asked: Dict[int, Any] = {}

    # -- Tune's interface -------------------------------------------------------------------------------------
    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True                                  # the space is ours; Tune's param space holds only settings

    @property
    def multi(self) -> bool:
        """Whether each draw is a candidate trained on several cells (settings, or seeds)."""
        return len(self.cells) > 1

    def suggest(self, trial_id: str) -> Optional[Dict[str, Any]]:
        """The admitted trial of the next accepted draw, or ``Searcher.FINISHED`` after too many rejections. With
        several settings: the next queued setting of a draw already made, else the first setting of a new draw."""
        if self.queue:
            return self._start(trial_id, self.queue.pop(0))
        if self.stopped:
            return Searcher.FINISHED
        adm = self.admission
        while True:
            ot = self.study.ask()
            params = sample(self.exp.space, ot)
            if self.multi:
                trials = self._admit_all(ot, params)
                if trials is None:
                    if self._too_many():
                        return Searcher.FINISHED
                    continue
                self.in_a_row = 0
                self.asked[ot.number] = ot
                self.draws[ot.number] = {"candidate": trials[0]["candidate"], "results": {}}
                self.queue.extend(trials[1:])
                return self._start(trial_id, trials[0])
            trial = trial_from_params(self.exp, params, key=str(trial_id), index=ot.number)
            try:
                trial = adm.admit(trial)
            except ConfigError as exc:
                self._reject(ot, params, exc)
                if self._too_many():
                    return Searcher.FINISHED
                continue
            self.in_a_row = 0
            self.asked[ot.number] = ot
            self.live[trial_id] = ot.number
            self.info[trial_id] = dict(trial.get("info") or {})
            trial["resolved_model"] = adm.resolved[trial["key"]]
            return {"trial": trial}

    def on_trial_complete(self, trial_id: str, result: Optional[Dict] = None, error: bool = False) -> None:
        number = self.live.pop(trial_id, None)
        if number is None:
            return
        optuna = _quiet_optuna()
        state = optuna.trial.TrialState
        values = self._values(trial_id, result or {})
        final = bool((result or {}).get("final"))
        over = _over_cost(result or {}) if final and not error else None
        diverged = final and not error and (result or {}).get("status") == "diverged"
        if self.multi:
            self._setting_done(number, self.where.pop(trial_id, ""), values, final, error, over, diverged)
            return
        try:
            if diverged:
                self._tell_infeasible(number, "diverged", 1.0)
            elif over is not None:
                self._tell_infeasible(number, "over_cost", over)
            elif error or values is None and final:
                self.study.tell(number, state=state.FAIL)
            elif values is None or (len(self.pairs) > 1 and not final):
                self.study.tell(number, state=state.PRUNED)
            else:
                self.study.tell(number, values if len(values) > 1 else values[0])
        except (RuntimeError, ValueError):           # already told (a resumed trial that completed twice)
            pass
        self.asked.pop(number, None)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump({k: v for k, v in self.__dict__.items() if k != "_admission"}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        self._admission = None

    # -- several settings ---------------------------------------------------------------------------------------
    def _admit_all(self, ot, params: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """The draw's trial on every cell (setting × seed), each admitted (sized to the budget at its setting's
        length) and carrying its typed model config; None (the draw rejected, the reason naming the setting) if one
        is not admitted. The seeds of one setting share the admitted model (the size does not depend on the
        seed)."""
        cid = f"c{ot.number:03d}"
        out = []
        for cell, setting, seed in self.cells:
            key = f"{cid}-{setting}" if cell == setting else f"{cid}-{setting}-s{seed}"
            trial = trial_from_params(self.exp, params, key=key, index=ot.number, setting=setting, seed=seed)
            try:
                trial = self.admission.admit(trial)
            except ConfigError as exc:
                self._reject(ot, params, exc, setting=setting)
                return None
            trial["candidate"], trial["cell"] = cid, cell
            trial["resolved_model"] = self.admission.resolved[trial["key"]]
            out.append(trial)
        return out

    def _start(self, trial_id: str, trial: Dict[str, Any]) -> Dict[str, Any]:
        """Hand a queued (or first) setting's trial to Tune trial ``trial_id``: the trial takes its key."""
        trial = dict(trial, key=str(trial_id), variant=str(trial_id), row=str(trial_id))
        self.live[trial_id] = trial["index"]
        self.where[trial_id] = trial.get("cell", trial["setting"])
        self.info[trial_id] = dict(trial.get("info") or {})
        return {"trial": trial}

    def _setting_done(self, number: int, cell: str, values: Optional[List[float]], final: bool,
                      error: bool, over: Optional[float] = None, diverged: bool = False) -> None:
        """Record one cell's outcome of draw ``number``; once every cell has one, tell Optuna the candidate:
        FAIL if a cell raised (or ended without a value), infeasible if one diverged or was over its step-cost
        bound (``train.max_step_time_s``), PRUNED if one stopped early (no final result), else its objectives
        (a setting's value the mean over its seeds, then combined over the settings:
        :func:`~atlaslab.search.fitness.per_setting`, :func:`~atlaslab.search.fitness.combine_objective`)."""
        draw = self.draws.get(number)
        if draw is None:
            return
        draw["results"][cell] = {"values": values, "final": final, "error": bool(error), "over_cost": over,
                                 "diverged": bool(diverged)}
        if any(c not in draw["results"] for c, _, _ in self.cells):
            return
        del self.draws[number]
        optuna = _quiet_optuna()
        state = optuna.trial.TrialState
        outs = draw["results"].values()
        try:
            overs = [o["over_cost"] for o in outs if o.get("over_cost") is not None]
            told_why = [o for o in outs if o.get("over_cost") is not None or o.get("diverged")]
            if any(o["error"] or (o["values"] is None and o["final"] and o not in told_why) for o in outs):
                self.study.tell(number, state=state.FAIL)
            elif any(o.get("diverged") for o in outs):
                self._tell_infeasible(number, "diverged", 1.0)
            elif overs:
                self._tell_infeasible(number, "over_cost", max(overs))
            elif any(o["values"] is None or not o["final"] for o in outs):
                self.study.tell(number, state=state.PRUNED)
            else:
                combined = self.candidate_values(draw["results"])
                if combined is None:
                    self.study.tell(number, state=state.FAIL)
                else:
                    self.study.tell(number, combined if len(combined) > 1 else combined[0])
        except (RuntimeError, ValueError):           # already told (a resumed trial that completed twice)
            pass
        self.asked.pop(number, None)

    def candidate_values(self, results: Dict[str, Dict[str, Any]]) -> Optional[List[float]]:
        """The candidate's objectives from its cells' values (``results``: cell → ``{"values": […]}``)."""
        out = []
        for i, (name, mode) in enumerate(self.pairs):
            by_setting = per_setting(self.exp, {c: o["values"][i] for c, o in results.items()})
            v = combine_objective(self.exp, name, by_setting, mode)
            if v is None:
                return None
            out.append(v)
        return out

    def _tell_infeasible(self, number: int, why: str, excess: float) -> None:
        """Tell draw ``number`` as infeasible, as a rejected draw is (placeholder values and a violated constraint,
        which TPE and NSGA-II rank below every feasible trial): ``why`` is ``diverged`` (a non-finite loss or
        gradient: excess 1) or ``over_cost`` (excess = measured step time / bound − 1 > 0). A failed trial would be
        ignored by both samplers, which then draw the same diverging combination again (the second multi-task
        search drew one 10 times before this)."""
        ot = self.asked.pop(number, None)
        if ot is None:                               # asked before a restore that lost it: no score, no lesson
            self.study.tell(number, state=_quiet_optuna().trial.TrialState.FAIL)
            return
        ot.set_user_attr(OVER_COST_ATTR if why == "over_cost" else DIVERGED_ATTR, float(excess))
        ot.set_constraint(why, max(float(excess), 1e-9))
        self.study.tell(ot, [0.0] * len(self.pairs) if len(self.pairs) > 1 else 0.0)

    def _too_many(self) -> bool:
        """Whether the rejections in a row reached ``search.max_rejections`` (the search then stops drawing)."""
        if self.in_a_row < self.exp.search.max_rejections:
            return False
        self.stopped = (f"{self.in_a_row} draws in a row were rejected (search.max_rejections); the "
                        f"search stopped drawing")
        self._write()
        return True

    # -- helpers ----------------------------------------------------------------------------------------------
    @property
    def admission(self) -> Admission:
        if self._admission is None:
            self._admission = Admission(self.exp)
        return self._admission

    def _values(self, trial_id: str, result: Dict[str, Any]) -> Optional[List[float]]:
        """The objectives of a finished trial (model measures from its admitted info or its result), or None when
        one is missing or not finite."""
        out = []
        info = self.info.get(trial_id, {})
        for name, _ in self.pairs:
            v = result.get(name, info.get(name))
            if v is None or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                return None
            out.append(float(v))
        return out

    def _reject(self, ot, params: Dict[str, Any], exc: ConfigError, setting: Optional[str] = None) -> None:
        """Record a rejected draw and tell it to Optuna as infeasible: complete, with placeholder values and the
        violated constraint ``rejected`` (``Trial.set_constraint``), which TPE and NSGA-II rank below every feasible
        trial; a failed trial would be ignored by both, teaching them nothing. ``setting``: the setting that
        rejected it (several settings), named first in the reason."""
        reason = f"{exc.path}: {exc.reason}" if exc.path else exc.reason
        if setting is not None:
            reason = f"setting {setting}: {reason}"
        ot.set_user_attr(REJECTED_ATTR, reason[:500])
        ot.set_constraint("rejected", 1.0)
        self.study.tell(ot, [0.0] * len(self.pairs) if len(self.pairs) > 1 else 0.0)
        self.in_a_row += 1
        labels = {k: optuna_value(self.exp.space[k], v) for k, v in params.items()}
        entry = {"number": ot.number, "params": {k: _jsonable(v) for k, v in labels.items()}, "reason": reason,
                 "path": exc.path}
        if setting is not None:
            entry["setting"] = setting
        self.rejected.append(entry)
        self._write()

    def _write(self) -> None:
        if self.run_dir is None:
            return
        path = Path(self.run_dir) / REJECTED_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"rejected": self.rejected, "stopped": self.stopped}, indent=1))
        tmp.replace(path)


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (type(None), bool, int, float, str)) else str(v)


__all__ = ["PartSearcher"]
