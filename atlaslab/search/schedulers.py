"""Early stopping that compares a trial only with trials of its own task setting.

    scheduler = PerSettingScheduler(lambda: ASHAScheduler(time_attr="step", metric=…, mode=…), ["mqar", "copy"])

A search with several settings trains every candidate on each of them (:mod:`atlaslab.search.searcher`). One ASHA
over all those trials would put them in the same rungs, so a trial on a hard setting (whose accuracy is low for every
candidate) would be stopped for falling below the cut set by an easy setting's trials. This scheduler keeps one
scheduler per setting (made by ``make``, e.g. Ray's ``AsyncHyperBandScheduler``) and hands each Tune trial's events to
the one of its setting (``trial.config["trial"]["setting"]``): each rung's cut is taken over one setting's trials.
Which pending trial runs next is Tune's first-in-first-out order (``FIFOScheduler``), as with ASHA itself.

A candidate stopped on one setting is told to the sampler as pruned whatever its other settings reach, so with
``stop_candidate`` (the default) the trials of its other settings are stopped too, at their next result: a stopped
candidate costs about one rung of training per setting, not a full run on every setting but one. The decision to stop
is still taken by one setting's scheduler over that setting's trials only.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, Optional, Sequence, Set

from ray.tune.schedulers import FIFOScheduler, TrialScheduler


def setting_of(trial: Any) -> str:
    """The task setting of a Tune trial (its admitted trial's ``setting``)."""
    config = getattr(trial, "config", None) or {}
    return str((config.get("trial") or {}).get("setting", ""))


def candidate_of(trial: Any) -> str:
    """The search candidate a Tune trial trains ("" where it has none)."""
    config = getattr(trial, "config", None) or {}
    return str((config.get("trial") or {}).get("candidate") or "")


class PerSettingScheduler(FIFOScheduler):
    """One scheduler per task setting; each trial's events go to its setting's (see the module docstring)."""

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


__all__ = ["PerSettingScheduler", "candidate_of", "setting_of"]
