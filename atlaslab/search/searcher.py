"""The search's Ray Tune searcher: Optuna's ask-and-tell, with every draw admitted (validated and sized to the
state budget) in the driver before a trial is started.

    searcher = PartSearcher(exp, run_dir)          # TuneConfig(search_alg=searcher, num_samples=exp.num_samples)

For each trial Tune asks for, :meth:`PartSearcher.suggest` asks Optuna for a point of the space
(:func:`atlaslab.search.space.sample`, conditions respected), turns it into a trial and admits it
(:class:`~atlaslab.search.admission.Admission`). A point that cannot be built (parts that do not go together) or
cannot be sized to the budget is told to Optuna as infeasible (a violated constraint, which TPE and NSGA-II rank
below every feasible trial, so the sampler learns to avoid it), recorded with its
reason in ``rejected.json`` of the run folder and in the report, and the next point is drawn: a rejected
combination never becomes a crashed trial. After ``search.max_rejections`` rejections in a row the search stops
drawing (the report says so).

The trial Tune starts carries the admitted trial (``{"trial": …}``, as a grid's does), so the worker trains
exactly the sized, validated model. Objectives: the experiment's ``metric`` first, then ``search.objectives``
(a reported metric, or ``state_size`` / ``num_parameters`` / ``step_time_s``, read from the trial's final
result); with more than one, Optuna's study is multi-objective (TPE or NSGA-II) and a trial that did not finish
(stopped by the scheduler, failed, diverged) is told as pruned / failed rather than with a partial value.
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
from atlaslab.search.results import REJECTED_NAME
from atlaslab.search.schema import ExperimentConfig
from atlaslab.search.space import make_sampler, optuna_value, sample

#: the user attribute of an Optuna trial whose draw was rejected before training (its reason)
REJECTED_ATTR = "atlaslab_rejected"


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
        self.live: Dict[str, Any] = {}               # Tune trial id → Optuna trial number
        self.info: Dict[str, Dict[str, Any]] = {}    # Tune trial id → the admitted trial's info (objectives)
        self.rejected: List[Dict[str, Any]] = []     # every rejected draw: {number, params, reason}
        self.in_a_row = 0
        self.stopped = ""                            # why the search stopped drawing ("" while it draws)
        self._admission: Optional[Admission] = None

    # -- Tune's interface -------------------------------------------------------------------------------------
    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True                                  # the space is ours; Tune's param space holds only settings

    def suggest(self, trial_id: str) -> Optional[Dict[str, Any]]:
        """The admitted trial of the next accepted draw, or ``Searcher.FINISHED`` after too many rejections."""
        if self.stopped:
            return Searcher.FINISHED
        adm = self.admission
        while True:
            ot = self.study.ask()
            params = sample(self.exp.space, ot)
            trial = trial_from_params(self.exp, params, key=str(trial_id), index=ot.number)
            try:
                trial = adm.admit(trial)
            except ConfigError as exc:
                self._reject(ot, params, exc)
                if self.in_a_row >= self.exp.search.max_rejections:
                    self.stopped = (f"{self.in_a_row} draws in a row were rejected (search.max_rejections); the "
                                    f"search stopped drawing")
                    self._write()
                    return Searcher.FINISHED
                continue
            self.in_a_row = 0
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
        try:
            if error or values is None and final:
                self.study.tell(number, state=state.FAIL)
            elif values is None or (len(self.pairs) > 1 and not final):
                self.study.tell(number, state=state.PRUNED)
            else:
                self.study.tell(number, values if len(values) > 1 else values[0])
        except (RuntimeError, ValueError):           # already told (a resumed trial that completed twice)
            pass

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump({k: v for k, v in self.__dict__.items() if k != "_admission"}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        self._admission = None

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

    def _reject(self, ot, params: Dict[str, Any], exc: ConfigError) -> None:
        """Record a rejected draw and tell it to Optuna as infeasible: complete, with placeholder values and the
        violated constraint ``rejected`` (``Trial.set_constraint``), which TPE and NSGA-II rank below every feasible
        trial; a failed trial would be ignored by both, teaching them nothing."""
        ot.set_user_attr(REJECTED_ATTR, f"{exc.path}: {exc.reason}"[:500])
        ot.set_constraint("rejected", 1.0)
        self.study.tell(ot, [0.0] * len(self.pairs) if len(self.pairs) > 1 else 0.0)
        self.in_a_row += 1
        labels = {k: optuna_value(self.exp.space[k], v) for k, v in params.items()}
        self.rejected.append({"number": ot.number, "params": {k: _jsonable(v) for k, v in labels.items()},
                              "reason": f"{exc.path}: {exc.reason}" if exc.path else exc.reason, "path": exc.path})
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
