"""What every trial of an experiment needs besides its own record, as one typed object across the Ray boundary.

The driver makes one :class:`TrialSettings` from the validated experiment and binds it to the trainable
(``tune.with_parameters(run_trial, settings=settings)``); the Tune trial (:mod:`.trainable`) and its Ray Train workers
(:mod:`.workers`) read its fields, never a dict with restated defaults.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

from atlaslab.search.schema import ExperimentConfig, ResourcesNode


@dataclass(frozen=True)
class TrialSettings:
    """The experiment's settings a trial runs with (validated by the driver; immutable)."""

    name: str
    kind: str                            # grid | search
    metric: str                          # e.g. val/accuracy
    mode: str                            # max | min
    imports: Tuple[str, ...]             # the experiment's ``imports``: modules that register user parts
    resources: ResourcesNode             # cpus / gpus / workers per trial
    tracking: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # MLflow: uri, experiment and parent run

    @classmethod
    def of(cls, exp: ExperimentConfig, tracking: Mapping[str, Any]) -> "TrialSettings":
        """The settings of a validated experiment (``tracking``: the MLflow part of the run's state)."""
        r = exp.resources
        return cls(exp.name, exp.kind, exp.metric, exp.mode, tuple(exp.imports),
                   ResourcesNode(r.cpus_per_trial, r.gpus_per_trial, r.workers_per_trial), dict(tracking or {}))

    @property
    def workers(self) -> int:
        """Ray Train workers of one trial (1: the trial trains in its own process)."""
        return int(self.resources.workers_per_trial)

    @property
    def threads(self) -> int:
        """Torch threads of the trial's process (its CPUs, at least one)."""
        return max(1, int(self.resources.cpus_per_trial))


def worker_resources(resources: ResourcesNode) -> Dict[str, float]:
    """One Ray Train worker's share of a trial's resources: ``cpus_per_trial`` / N CPUs, and one GPU when the trial
    has ``gpus_per_trial = N``."""
    n = int(resources.workers_per_trial)
    res = {"CPU": float(resources.cpus_per_trial) / n}
    if resources.gpus_per_trial:
        res["GPU"] = float(resources.gpus_per_trial) / n
    return res


__all__ = ["TrialSettings", "worker_resources"]
