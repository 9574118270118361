"""Experiments: declared ablation grids and Optuna searches, run on Ray Tune, tracked in MLflow, reported.

    atlaslab run experiments/quickstart.yaml [key=value ...] [--dry-run]
    atlaslab resume RUN_DIR
    atlaslab report RUN_DIR

* :mod:`.schema` — the experiment file (structured, validated; errors name the dotted path);
* :mod:`.expand` — grid expansion into trials and the validation of every trial before Ray starts;
* :mod:`.space` — Optuna define-by-run search spaces with conditional parameters;
* :mod:`.trainable` — the Ray Tune function trainable (build, train, report, checkpoint, MLflow run);
* :mod:`.driver` — Ray session, Tuner, run and resume; :mod:`.progress` — live progress;
* :mod:`.results` — the trials' records of a run folder (from Tune's results), read by the driver and the report,
  and one trial picked from a finished run folder (by key, or the best);
* :mod:`.tracking` — MLflow parent/child runs; :mod:`.report` — markdown, CSV and PNG reports;
* :mod:`.export` — a trial as a Hugging Face model folder; :mod:`.preset_export` — a trial's model as a preset file;
* :mod:`.formatting` — how keys and values are written in labels, tables and plots.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set when this package is imported (before ``import ray``), so a
local Ray keeps every process on 127.0.0.1.
"""
import os as _os

_os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from atlaslab.search.expand import TrialConfigError, expand_grid, validate_trials
from atlaslab.search.schema import ExperimentConfig, load_experiment

__all__ = ["ExperimentConfig", "TrialConfigError", "expand_grid", "load_experiment", "validate_trials"]
