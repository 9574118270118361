"""Early stopping for a search whose candidates train on several task settings.

    scheduler = CandidateASHA(settings=["mqar", "copy"], score=partial(fitness.score, exp), mode="max",
                              grace_period=100, reduction_factor=3, max_t=300, max_concurrent=2)
    searcher = CandidateLimiter(PartSearcher(exp), max_concurrent=2, gate=scheduler)

A search with several settings trains each candidate (one draw of the sampler) on every setting, one Tune trial per
setting (:mod:`atlaslab.search.searcher`), and tells the sampler the candidate's **score**
(:func:`atlaslab.search.fitness.score`). :class:`CandidateASHA` (``scheduler: {name: candidate_asha}``) is
asynchronous successive halving over candidates, on that score:

* rungs at ``grace_period × reduction_factor^k`` steps (``k = 0, 1, …``), below ``max_t``;
* a setting's trial whose result reaches the candidate's next rung (its ``step`` ≥ the rung) is **paused** there
  (Tune's ``PAUSE``: it is checkpointed at that step and gives its slot up) until every setting of its candidate has
  reached the rung; a setting that finished before the rung (the loop's early stop) counts with its final value;
* when the last one arrives, the candidate's score at the rung is the score of its settings' ``metric`` there, and
  the candidate goes on if the score is in the top ``1/reduction_factor`` of the scores earlier candidates had at
  that rung — at or above their ``(1 - 1/reduction_factor)`` quantile, the first candidate always goes on (Ray's ASHA
  rule, :func:`cutoff`) — else it is stopped: its paused trials resume from their checkpoints (in order, as slots
  free), or all its trials stop. A score that is not finite (a diverging setting) stops the candidate.

A stopped candidate's trials end without a final result, so the searcher tells the sampler the candidate as pruned
and the report counts it as stopped early. A trial that fails or diverges fails its candidate: its paused siblings
are stopped at once, its running ones at their next result. With one setting a candidate is one trial, nothing
waits, and the rule is ASHA's over the search's trials.

**No deadlock.** A paused trial does not count against ``max_concurrent``: :class:`CandidateLimiter`, the searcher's
concurrency limit, counts only trials that run or wait to start, so the siblings a paused trial waits for (queued in
the searcher, handed out before any new draw) get started. A paused trial whose candidate went on resumes before any
new trial starts (:meth:`CandidateASHA.choose_trial_to_run`, and the limiter draws nothing while one waits), so a
candidate that passed a rung finishes before new candidates take the slots.

**Resume.** Tune does not save a scheduler's state, so this one writes its record (each candidate's next rung,
results at it, status; every rung's scores) to ``state_path`` at every decision and reads it back when a resumed
sweep adds its trials. Tune restarts paused trials on a resume; one that had reached its candidate's undecided rung
keeps its result there and pauses again at its next report.

:class:`PerSettingScheduler` (``scheduler: asha`` with several settings) is the older rule: one ASHA per setting, a
candidate stopped on one setting stopped on the others. It compares a trial only with its own setting's trials, but
a candidate then gets a score only if no setting's ASHA stops it (the first run of ``experiments/discovery_suite.yaml``
scored none of its 24 candidates).
"""
from __future__ import annotations

import copy
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

import numpy as np
from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import ConcurrencyLimiter, Searcher


def setting_of(trial: Any) -> str:
    """The task setting of a Tune trial (its admitted trial's ``setting``)."""
    config = getattr(trial, "config", None) or {}
    return str((config.get("trial") or {}).get("setting", ""))


def cell_of(trial: Any) -> str:
    """The cell of a Tune trial: its admitted trial's ``cell`` (a setting, or ``<setting>@<seed>`` in a search with
    several seeds: :func:`atlaslab.search.fitness.cells`), else its setting."""
    config = getattr(trial, "config", None) or {}
    admitted = config.get("trial") or {}
    return str(admitted.get("cell") or admitted.get("setting", ""))


def candidate_of(trial: Any) -> str:
    """The search candidate a Tune trial trains ("" where it has none)."""
    config = getattr(trial, "config", None) or {}
    return str((config.get("trial") or {}).get("candidate") or "")


class PerSettingScheduler(FIFOScheduler):
    """One scheduler per task setting (e.g. Ray's ``AsyncHyperBandScheduler``, made by ``make``); each trial's events
    go to the one of its setting, so each rung's cut is taken over one setting's trials. A candidate stopped on one
    setting is told to the sampler as pruned whatever its other settings reach, so with ``stop_candidate`` (the
    default) its trials on the other settings are stopped too, at their next result."""

    def __init__(self, make: Callable[[], TrialScheduler], settings: Sequence[str], stop_candidate: bool = True):
        super().__init__()
        self.by_setting: Dict[str, TrialScheduler] = {str(s): make() for s in settings}
        self.stop_candidate = stop_candidate
        self.stopped: Set[str] = set()       # candidates one setting's scheduler stopped

    def _of(self, trial: Any) -> TrialScheduler:
        setting = setting_of(trial)
        if setting not in self.by_setting:
            raise KeyError(f"trial {getattr(trial, 'trial_id', trial)} has setting {setting!r}, not one of "
                           f"{sorted(self.by_setting)}")
        return self.by_setting[setting]

    @property
    def metric(self) -> Optional[str]:
        return next(iter(self.by_setting.values())).metric if self.by_setting else None

    def set_search_properties(self, metric: Optional[str], mode: Optional[str], **spec) -> bool:
        return all([s.set_search_properties(metric, mode, **spec) for s in self.by_setting.values()])

    def on_trial_add(self, tune_controller, trial) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_error(self, tune_controller, trial) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: Dict) -> str:
        action = self._of(trial).on_trial_result(tune_controller, trial, result)
        if not self.stop_candidate:
            return action
        cand = candidate_of(trial)
        if action == TrialScheduler.STOP and cand:
            self.stopped.add(cand)
        if cand in self.stopped:
            return TrialScheduler.STOP
        return action

    def on_trial_complete(self, tune_controller, trial, result: Dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller, trial) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "\n".join(f"[{s}] {sch.debug_string()}" for s, sch in self.by_setting.items())

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def rungs(grace_period: int, reduction_factor: float, max_t: int) -> List[int]:
    """The steps at which candidates are compared: ``grace_period × reduction_factor^k`` (rounded down), below
    ``max_t`` (a trial that reaches ``max_t`` has finished: its final result is what the sampler is told)."""
    if grace_period < 1 or reduction_factor <= 1:
        raise ValueError(f"grace_period ≥ 1 and reduction_factor > 1, got {grace_period}, {reduction_factor}")
    out: List[int] = []
    k = 0
    while True:
        r = int(grace_period * reduction_factor ** k)
        if r >= max_t:
            return out
        if not out or r > out[-1]:
            out.append(r)
        k += 1


def cutoff(earlier: Sequence[float], reduction_factor: float) -> Optional[float]:
    """The score a candidate must reach at a rung to go on: the ``(1 - 1/reduction_factor)`` quantile (linear
    interpolation) of the scores ``earlier`` candidates had there, signed so that higher is better (``None`` for the
    first candidate, which goes on). Ray's ``AsyncHyperBandScheduler`` cuts its trials by the same quantile."""
    vals = [v for v in earlier if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return float(np.percentile(vals, (1.0 - 1.0 / reduction_factor) * 100.0))


#: a candidate's status in :class:`CandidateASHA`: training, stopped at a rung, failed (a setting raised or diverged),
#: ended from outside (a trial stopped by a stopper), finished on every setting
GOING, STOPPED, FAILED, ENDED, FINISHED = "going", "stopped", "failed", "ended", "finished"


class CandidateASHA(FIFOScheduler):
    """Asynchronous successive halving over search candidates, a candidate's settings paused at each rung until all
    of them reached it (see the module docstring).

    ``settings``: the cells a candidate trains on (the experiment's setting names, or with several seeds
    ``<setting>@<seed>``: :func:`atlaslab.search.fitness.cells`); ``score``: cell → metric value ↦ the candidate's
    score (or None), :func:`atlaslab.search.fitness.cell_score`; ``metric`` / ``mode``: what each trial reports and its direction;
    ``grace_period``, ``reduction_factor``, ``max_t``: the rungs (:func:`rungs`); ``max_concurrent``: how many trials
    may run at once (a paused one resumes only in a free slot); ``state_path``: the JSON file of its record (resume).

    State: ``cands[candidate]`` — ``rung`` (index of the next rung to decide), ``at`` (setting → ``[step, value]``,
    its latest result, kept while it waits at ``rung``), ``done`` (setting → final value of a finished setting),
    ``status`` (going / stopped / failed / ended / finished), ``scores`` (rung step → score); ``recorded[rung step]``:
    candidate → signed score (higher is better) of every candidate decided there."""

    _supports_buffered_results = False     # a result per step: a trial pauses at the result that reached its rung

    def __init__(self, settings: Sequence[str], score: Callable[[Mapping[str, float]], Optional[float]],
                 metric: str, mode: str, grace_period: int, reduction_factor: float, max_t: int,
                 max_concurrent: int, time_attr: str = "step", state_path: Optional[str] = None):
        super().__init__()
        self.settings = [str(x) for x in settings]
        self.score, self._metric, self.mode, self.time_attr = score, metric, mode, time_attr
        self.rf = float(reduction_factor)
        self.rungs = rungs(int(grace_period), self.rf, int(max_t))
        self.max_concurrent = max(1, int(max_concurrent))
        self.state_path = None if state_path is None else str(state_path)
        self.cands: Dict[str, Dict[str, Any]] = {}
        self.recorded: Dict[str, Dict[str, float]] = {}
        self._runtime()

    def _runtime(self) -> None:
        """What lives only in this process: the Tune trials (they are re-added on a resume)."""
        self.trials: Dict[str, Dict[str, Any]] = {}     # candidate → setting → Tune trial
        self.held: Set[str] = set()                     # trial ids told to pause until their candidate's decision
        self.by_id: Dict[str, Any] = {}
        self._loaded = False

    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("trials", "held", "by_id")}
        state["_loaded"] = False
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._runtime()

    # -- Tune's interface -------------------------------------------------------------------------------------
    @property
    def metric(self) -> Optional[str]:
        return self._metric

    def set_search_properties(self, metric: Optional[str], mode: Optional[str], **spec) -> bool:
        return True                                   # metric and mode are the experiment's, given at construction

    def on_trial_add(self, tune_controller, trial) -> None:
        self._load()
        cid, setting = self._key(trial)
        self.trials.setdefault(cid, {})[setting] = trial
        self.by_id[trial.trial_id] = trial
        self.cands.setdefault(cid, self._new())

    def on_trial_result(self, tune_controller, trial, result: Dict) -> str:
        cid, setting = self._key(trial)
        c = self.cands.setdefault(cid, self._new())
        if c["status"] != GOING:
            self.held.discard(trial.trial_id)
            return TrialScheduler.STOP
        if result.get("final") == 1:                  # the trial's end: on_trial_complete takes its value
            return TrialScheduler.CONTINUE
        t = result.get(self.time_attr)
        if not isinstance(t, (int, float)):
            return TrialScheduler.CONTINUE
        if not self._waits(c, setting):               # one that waits at the rung keeps its result there
            c["at"][setting] = [int(t), _number(result.get(self._metric))]
        return self._advance(tune_controller, cid, current=trial)

    def on_trial_complete(self, tune_controller, trial, result: Dict) -> None:
        cid, setting = self._key(trial)
        c = self.cands.get(cid)
        self._forget(trial)
        if c is None or c["status"] != GOING:
            return
        result = result or {}
        value = _number(result.get(self._metric))
        if result.get("final") != 1:                  # stopped from outside (a stopper): it cannot finish
            self._end(tune_controller, cid, ENDED)
        elif result.get("failed") or result.get("status") in ("diverged", "error") or value is None:
            self._end(tune_controller, cid, FAILED)
        else:
            c["done"][setting] = value
            self._advance(tune_controller, cid, current=None)
            if c["status"] == GOING and all(s in c["done"] for s in self.settings):
                c["status"] = FINISHED
        self._save()

    def on_trial_error(self, tune_controller, trial) -> None:
        self._forget(trial)
        if getattr(trial, "status", None) == "ERROR":
            return                                    # Tune retries it (max_failures): it is added again
        cid, _ = self._key(trial)
        if cid in self.cands and self.cands[cid]["status"] == GOING:
            self._end(tune_controller, cid, FAILED)
            self._save()

    def on_trial_remove(self, tune_controller, trial) -> None:
        self._forget(trial)
        cid, _ = self._key(trial)
        if cid in self.cands and self.cands[cid]["status"] == GOING:
            self._end(tune_controller, cid, ENDED)     # a waiting or pending trial stopped from outside
            self._save()

    def choose_trial_to_run(self, tune_controller) -> Optional[Any]:
        """A pending trial first (a candidate's siblings get to run), else, in a free slot, a paused trial whose
        candidate went on (:meth:`_may_resume`); never a trial that waits for its candidate's decision."""
        trials = tune_controller.get_trials()
        for trial in trials:
            if trial.status == "PENDING":
                return trial
        if self.active(trials) >= self.max_concurrent:
            return None
        for trial in trials:
            if self._may_resume(trial):
                return trial
        return None

    def debug_string(self) -> str:
        n = {s: sum(c["status"] == s for c in self.cands.values()) for s in (GOING, STOPPED, FAILED, ENDED, FINISHED)}
        return (f"CandidateASHA: rungs {self.rungs}, candidates {n}, {len(self.held)} trials waiting at a rung, "
                f"{len(self.released)} to resume")

    @property
    def released(self) -> Set[str]:
        """Ids of the paused trials that may resume (:meth:`_may_resume`)."""
        return {i for i, t in self.by_id.items() if self._may_resume(t)}

    def _may_resume(self, trial: Any) -> bool:
        """Whether ``trial`` is paused and may resume: its candidate went on past the rung it waited at. This is read
        from the record, not from what this scheduler told Tune, so a trial Tune paused on its own also resumes (Ray
        2.60 saves a pending PAUSE with its experiment and applies it to the trial's first result after a resume). A
        paused trial of an ended candidate resumes too, to be stopped at its first result (one is stopped at once
        when its candidate ends; this only catches a pause that came later)."""
        if trial.status != "PAUSED":
            return False
        cid, setting = self._key(trial)
        c = self.cands.get(cid)
        return c is None or c["status"] != GOING or not self._waits(c, setting)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__getstate__(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__setstate__(pickle.load(f))

    # -- for the limiter --------------------------------------------------------------------------------------
    def idle(self) -> Set[str]:
        """Trial ids that are paused (or being paused) by this scheduler: they hold no slot."""
        return set(self.held) | {i for i, t in self.by_id.items() if t.status == "PAUSED"}

    def resuming(self) -> bool:
        """Whether a paused trial whose candidate went on waits for a slot (it goes before any new trial)."""
        return any(self._may_resume(t) for t in self.by_id.values())

    def active(self, trials: Sequence[Any]) -> int:
        """How many of ``trials`` run or wait to start (a trial being paused does not count)."""
        return sum(1 for t in trials if t.status in ("RUNNING", "PENDING") and t.trial_id not in self.held)

    # -- the rule ---------------------------------------------------------------------------------------------
    def _key(self, trial: Any):
        setting = cell_of(trial) or (self.settings[0] if len(self.settings) == 1 else "")
        return candidate_of(trial) or str(trial.trial_id), setting

    @staticmethod
    def _new() -> Dict[str, Any]:
        return {"rung": 0, "at": {}, "done": {}, "status": GOING, "scores": {}}

    def _arrived(self, c: Mapping[str, Any], setting: str, k: int) -> bool:
        at = c["at"].get(setting)
        return setting in c["done"] or (at is not None and at[0] >= self.rungs[k])

    def _waits(self, c: Mapping[str, Any], setting: str) -> bool:
        """Whether ``setting`` has reached its candidate's next rung, which is not decided yet."""
        return c["rung"] < len(self.rungs) and setting not in c["done"] and self._arrived(c, setting, c["rung"])

    def _value(self, c: Mapping[str, Any], setting: str, k: int) -> Optional[float]:
        at = c["at"].get(setting)
        if at is not None and at[0] >= self.rungs[k]:
            return at[1]
        return c["done"].get(setting)

    def _advance(self, tune_controller, cid: str, current: Any) -> str:
        """Decide every rung all the candidate's settings have reached; then hold (pause) the settings that reached
        the next one, release the others. Returns the action for ``current`` (the trial whose result this is)."""
        c = self.cands[cid]
        while c["rung"] < len(self.rungs) and all(self._arrived(c, s, c["rung"]) for s in self.settings):
            k = c["rung"]
            sc = self.score({s: self._value(c, s, k) for s in self.settings})
            if not self._judge(cid, k, sc):
                self._end(tune_controller, cid, STOPPED, current)
                self._save()
                return TrialScheduler.STOP
            c["rung"] = k + 1
        action = TrialScheduler.CONTINUE
        for setting, trial in self.trials.get(cid, {}).items():
            tid = trial.trial_id
            if setting in c["done"]:
                continue
            if self._waits(c, setting):
                self.held.add(tid)
                if trial is current:
                    action = TrialScheduler.PAUSE
            else:
                self.held.discard(tid)                # resumed by choose_trial_to_run once it is paused
        self._save()
        return action

    def _judge(self, cid: str, k: int, sc: Optional[float]) -> bool:
        """Record the candidate's score at rung ``k`` and say whether it goes on (see :func:`cutoff`)."""
        step = str(self.rungs[k])
        finite = sc is not None and math.isfinite(sc)
        signed = (sc if self.mode == "max" else -sc) if finite else None
        rec = self.recorded.setdefault(step, {})
        cut = cutoff([v for key, v in rec.items() if key != cid], self.rf)
        rec[cid] = signed
        self.cands[cid]["scores"][step] = sc if finite else None
        return signed is not None and (cut is None or signed >= cut)

    def _end(self, tune_controller, cid: str, status: str, current: Any = None) -> None:
        """End a candidate: its paused trials stop now, its running ones at their next result."""
        c = self.cands[cid]
        c["status"] = status
        for trial in list(self.trials.get(cid, {}).values()):
            tid = trial.trial_id
            self.held.discard(tid)
            if trial is current or tune_controller is None:
                continue
            if trial.status == "PAUSED" or getattr(trial, "is_saving", False):
                paused = trial.status == "PAUSED"
                tune_controller.stop_trial(trial)
                if paused:
                    _mark_for_checkpoint(tune_controller, trial)

    def _forget(self, trial: Any) -> None:
        self.held.discard(trial.trial_id)

    # -- the record (resume) ----------------------------------------------------------------------------------
    def record(self) -> Dict[str, Any]:
        """Rungs, each rung's scores and each candidate's state: what :meth:`_save` writes."""
        return {"rungs": self.rungs, "reduction_factor": self.rf, "mode": self.mode, "settings": self.settings,
                "recorded": self.recorded, "candidates": self.cands}

    def _save(self) -> None:
        if self.state_path is None:
            return
        path = Path(self.state_path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.record(), indent=1))
        os.replace(tmp, path)

    def _load(self) -> None:
        """Read the record back once per process (a resumed sweep: Tune gives the scheduler no state of its own)."""
        if self._loaded:
            return
        self._loaded = True
        if self.state_path is None or not Path(self.state_path).is_file():
            return
        rec = json.loads(Path(self.state_path).read_text())
        if rec.get("rungs") != self.rungs:
            raise ValueError(f"{self.state_path} has rungs {rec.get('rungs')}, this scheduler {self.rungs}")
        self.recorded = rec.get("recorded", {})
        self.cands = rec.get("candidates", {})


class CandidateLimiter(ConcurrencyLimiter):
    """The searcher's concurrency limit for :class:`CandidateASHA`: at most ``max_concurrent`` of its trials run or
    wait to start; a trial paused at a rung holds no slot (else a candidate's settings could all wait at a rung for a
    sibling that never gets a slot); nothing new is drawn while a paused trial waits to resume. ``gate`` is the
    scheduler; it is not part of the state Tune saves (a restored limiter keeps the scheduler it was built with)."""

    def __init__(self, searcher: Searcher, max_concurrent: int, gate: CandidateASHA):
        super().__init__(searcher, max_concurrent=max_concurrent)
        self.gate = gate

    def suggest(self, trial_id: str) -> Optional[Dict]:
        busy = len(self.live_trials - self.gate.idle())
        if busy >= self.max_concurrent or self.gate.resuming():
            return None
        suggestion = self.searcher.suggest(trial_id)
        if suggestion not in (None, Searcher.FINISHED):
            self.live_trials.add(trial_id)
            self.num_unfinished_live_trials += 1
        return suggestion

    def get_state(self) -> Dict:
        return copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("searcher", "gate")})

    def set_state(self, state: Dict) -> None:
        self.__dict__.update({k: v for k, v in state.items() if k not in ("searcher", "gate")})


def _mark_for_checkpoint(tune_controller: Any, trial: Any) -> None:
    """Have Tune save ``trial``'s status with its next experiment checkpoint. Ray 2.60's controller does not when it
    stops a trial that is PAUSED (it has no actor, so the stop returns before marking it): its saved status stays
    PAUSED, and a finished sweep reads as interrupted (the end-to-end test, with Tune saving its experiment at every
    step, shows it every time without this). The scheduler
    gets Tune's controller wrapped; the wrapper keeps the controller itself as ``_tune_controller``."""
    inner = getattr(tune_controller, "__dict__", {}).get("_tune_controller", tune_controller)
    mark = getattr(type(inner), "_mark_trial_to_checkpoint", None)
    if mark is not None:
        mark(inner, trial)


def _number(v: Any) -> Optional[float]:
    """A finite float, else None."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


__all__ = ["CandidateASHA", "CandidateLimiter", "PerSettingScheduler", "candidate_of", "cutoff", "rungs",
           "setting_of"]
