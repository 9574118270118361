"""Run, resume and collect an experiment on Ray Tune, tracked in MLflow.

    prepared = prepare("experiments/quickstart.yaml", ["train.steps=100"])   # validates every trial
    summary = run(prepared, run_dir="runs/quickstart")                         # Ray Tune + MLflow + report
    summary = resume("runs/quickstart")                                        # after an interruption

The run folder holds everything an experiment needs to be resumed or reported::

    experiment.yaml   the experiment after command-line overrides     trials.json   the expanded trials
    state.json        MLflow ids, tracking URI, Tune path, status      results.json  one record per trial
    ray/              Tune's storage                                    report.md, report.csv, trials.csv,
                                                                      curves.csv (learning curves), plots/*.png

MLflow's default store is shared by the run folders beside each other: ``runs/mlflow.db`` (and ``runs/mlartifacts/``)
for the default ``runs/<name>-<time>`` (:func:`atlaslab.search.tracking.default_tracking_uri`).

Ray: local by default (``ray.init(num_cpus=…)``, no dashboard, every process on 127.0.0.1 because
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before ``import ray``); ``ray_address`` / ``$RAY_ADDRESS``
joins a cluster. A Ray session this module started is shut down at the end, also on errors.
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import functools
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")     # experiment state: small, save it often
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
# trials on several workers run Ray Train's TorchTrainer inside a Tune trial, which needs Ray Train V2 (on by
# default in recent Ray releases; earlier ones need the switch); the trials inherit it from a Ray started here
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "100")
# Ray runs workers at niceness 15 by default, so on a shared machine any other process starves the trials;
# trials are this program's main work (a local Ray started here only; a cluster keeps its own setting)
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")     # inherited by the trials
os.environ.setdefault("DO_NOT_TRACK", "true")

from omegaconf import OmegaConf

from atlaslab.models.lm import resolve_lm_config
from atlaslab.registry import ConfigError, import_user_modules
from atlaslab.registry.config import BASE_DIR_ENV
from atlaslab.search import tracking as T
from atlaslab.search.admission import Admission, preflight
from atlaslab.search.expand import Prepared, expand_grid, protocol_points
from atlaslab.search.fitness import cell_score, cells, is_multi
from atlaslab.search.formatting import fmt_value, human_count
from atlaslab.search.report import write_report
from atlaslab.search.results import RESULTS_NAME, SYNONYMS_NAME, WAITING, collect, read_rejected, read_state, saved_statuses
from atlaslab.search.schema import ExperimentConfig, load_experiment, load_experiment_node, validate_experiment
from atlaslab.search.settings import TrialSettings
from atlaslab.search.synonyms import Synonym, find_synonyms, synonym_error
from atlaslab.search.trainable import run_trial

TUNE_NAME = "tune"


def prepare(path: Optional[str] = None, overrides: Sequence[str] = (), node: Any = None) -> Prepared:
    """Load, override and validate an experiment, expanding and validating every trial (no Ray, no MLflow).

    Raises :class:`ConfigError` (a :class:`~atlaslab.search.expand.TrialConfigError` names the trial)."""
    t0 = time.time()
    cfg = load_experiment_node(path, overrides, node)
    raw = OmegaConf.to_container(cfg, resolve=True)
    exp = validate_experiment(cfg, source=str(path or ""))
    import_user_modules(exp.imports)
    raw.setdefault("name", exp.name)
    adm = Admission(exp)
    rejected: List[Dict[str, Any]] = []
    synonyms: List[Synonym] = []
    if exp.kind == "grid":
        trials = [adm.admit(t) for t in expand_grid(exp)]
    else:                                # every choice of the space admitted in one combination at least
        trials, rejected = preflight(adm, seed=exp.search.seed)
        synonyms = find_synonyms(exp, [t["params"] for t in trials])
        if synonyms and exp.search.synonyms == "error":
            raise synonym_error(synonyms[0])
    return Prepared(raw, exp, trials, str(path or ""), time.time() - t0, list(overrides), adm.resolved, rejected,
                    [s.to_dict() for s in synonyms])


def trial_table(p: Prepared) -> str:
    """The expanded trials as a text table (``--dry-run``)."""
    exp = p.exp
    lines = []
    if exp.kind == "search":
        lines.append(f"search '{exp.name}': {exp.num_samples} samples, sampler {exp.search.sampler}, "
                     f"scheduler {exp.scheduler.name}, metric {exp.metric} ({exp.mode})")
        if is_multi(exp):
            sc = exp.search.score
            how = ("weighted mean" if sc.weights else "mean") if sc.combine == "mean" else "worst setting"
            weights = (" (weights " + ", ".join(f"{k}={fmt_value(v)}" for k, v in sc.weights.items()) + ")"
                       if sc.weights else "")
            seeds = (f" × {len(exp.seeds)} seeds ({', '.join(str(x) for x in exp.seeds)}; a setting's value is the "
                     f"mean over its seeds)" if len(exp.seeds) > 1 else "")
            lines.append(f"fitness: each candidate trained on {len(exp.settings())} setting(s) "
                         f"({', '.join(exp.settings())}){seeds}; score = {how} of {exp.metric}{weights}; "
                         f"{n_trials(p)} trials" + _scheduler_note(exp))
        lines.append("space:")
        for k, prm in exp.space.items():
            if prm.type == "categorical":
                desc = "choice " + ", ".join(fmt_value(c) for c in prm.choices)
            else:
                desc = f"{prm.type} [{prm.low}, {prm.high}]" + (" log" if prm.log else "")
            cond = ("  when " + ", ".join(f"{c}={fmt_value(v)}" for c, v in prm.when.items())) if prm.when else ""
            lines.append(f"  {k}: {desc}{cond}")
        if exp.search.objectives:
            lines.append("objectives: " + ", ".join(f"{m} ({d})" for m, d in
                                                    exp.search.objective_pairs(exp.metric, exp.mode)))
        if exp.budget.active:
            lines.append(f"state budget: {exp.budget.state} ± {exp.budget.tolerance:.0%}, sized by "
                         + ", ".join(exp.budget.size_by))
        lines.append(f"admitted {len(p.trials)} configs covering every choice of the space "
                     f"({len(p.preflight_rejected)} draws rejected on the way, e.g. a combination that cannot be "
                     f"built or sized; the searcher rejects and counts such draws):")
        for syn in p.synonyms:
            lines.insert(-1, f"synonymous choices (search.synonyms: allow) of {syn['key']}: "
                         + Synonym(**syn).describe())
    else:
        lines.append(f"grid '{exp.name}': {len(p.trials)} trials ({len(exp.settings())} setting(s) × "
                     f"{max(1, len(exp.grid.variants))} variant(s) × axes × {max(1, len(_proto(exp)))} lr/wd × "
                     f"{len(exp.seeds)} seed(s)), scheduler {exp.scheduler.name}, metric {exp.metric} ({exp.mode})")
    head = ["key", "setting", "row", "seed", "lr/wd", "preset", "params", "state", "steps"]
    rows = []
    for t in p.trials:
        info = t.get("info", {})
        tr = info.get("train", {})
        proto = ",".join(f"{k}={fmt_value(v)}" for k, v in t.get("protocol", {}).items())
        rows.append([t["key"], t["setting"], t["label"] if exp.kind == "search" else t["row"], str(t["seed"]),
                     proto or "-", info.get("preset", "?"), human_count(info.get("num_parameters")),
                     human_count(info.get("state_size")), str(tr.get("steps", "?"))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
    lines.append(f"(validated in {p.validate_s:.1f} s; every model built on the meta device)")
    return "\n".join(lines)


def _scheduler_note(exp: ExperimentConfig) -> str:
    """What the scheduler does with a search's candidates (``--dry-run``)."""
    if exp.scheduler.name == "asha":
        return "; ASHA per setting"
    if exp.scheduler.name == "candidate_asha":
        from atlaslab.search.schedulers import rungs
        s = exp.scheduler
        grace, max_t = _grace_and_max_t(exp)
        at = rungs(grace, s.reduction_factor, max_t)
        return (f"; candidates compared by score at steps {', '.join(map(str, at)) or '(none: no rung below max_t)'}, "
                f"the top 1/{fmt_value(s.reduction_factor)} go on (candidate_asha)")
    return ""


def _proto(exp: ExperimentConfig) -> List[Any]:
    return protocol_points(exp) if exp.protocol.active else []


# --------------------------------------------------------------------------------------------------
# run folder
# --------------------------------------------------------------------------------------------------
def default_run_dir(name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    try:
        import numpy as np
        if isinstance(x, np.generic):
            return x.item()
    except ImportError:  # pragma: no cover
        pass
    return str(x)


# --------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------
class RaySession:
    """``with RaySession(address, num_cpus):`` starts (or joins) Ray and shuts down only what it started."""

    def __init__(self, address: Optional[str] = None, num_cpus: Optional[int] = None, num_gpus: Optional[int] = None,
                 quiet: bool = False):
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus, self.num_gpus, self.quiet = num_cpus, num_gpus, quiet
        self.started = False

    def __enter__(self):
        if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
            pass  # pragma: no cover - imported elsewhere first; nothing to do but carry on
        import ray
        # workers chdir into their trial folders: keep the driver's folder importable (user parts)
        cwd = os.getcwd()
        pp = os.environ.get("PYTHONPATH", "")
        if cwd not in pp.split(os.pathsep):
            os.environ["PYTHONPATH"] = cwd + (os.pathsep + pp if pp else "")
        os.environ[BASE_DIR_ENV] = cwd     # relative data / tokenizer / task paths (registry.local_path)
        if ray.is_initialized():
            return self
        kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level="ERROR")
        if self.address:
            ray.init(address=self.address, **kw)
        else:
            os.environ.pop("RAY_ADDRESS", None)
            # "local": a new Ray of our own, never one a leftover /tmp/ray/ray_current_cluster points at
            ray.init(address="local", num_cpus=self.num_cpus or os.cpu_count() or 1, num_gpus=self.num_gpus, **kw)
        self.started = True
        return self

    def __exit__(self, *exc):
        if self.started:
            import ray
            ray.shutdown()
        return False


# --------------------------------------------------------------------------------------------------
# Tune
# --------------------------------------------------------------------------------------------------
def _trial_dirname(trial) -> str:
    t = trial.config.get("trial")
    return str(t["key"]) if t else str(trial.trial_id)


#: what the Tune trial of a trial on several workers asks for: no CPU (it only coordinates its Ray Train
#: workers, which ask for the trial's CPUs and GPUs), and memory, since Tune needs some resource
COORDINATOR_MEMORY = 512 * 2**20


def _trainable(exp: ExperimentConfig, settings: TrialSettings):
    """``run_trial`` with the experiment's settings bound (``tune.with_parameters``) and the trial's resources (see
    :data:`COORDINATOR_MEMORY` for several workers)."""
    from ray import tune
    if exp.resources.workers_per_trial > 1:
        res = {"cpu": 0.0, "memory": COORDINATOR_MEMORY}
    else:
        res = {"cpu": float(exp.resources.cpus_per_trial)}
        if exp.resources.gpus_per_trial:
            res["gpu"] = float(exp.resources.gpus_per_trial)
    return tune.with_resources(tune.with_parameters(run_trial, settings=settings), res)


def _grace_and_max_t(exp: ExperimentConfig):
    """The scheduler's ``grace_period`` (default: ``eval.interval``, the first evaluation) and ``max_t`` (default:
    ``train.steps``)."""
    s = exp.scheduler
    steps = int(exp.train.get("steps", 1000)) if isinstance(exp.train, Mapping) else 1000
    return s.grace_period or max(1, int(exp.eval.interval or steps)), s.max_t or steps


#: the record of ``scheduler: candidate_asha`` in the run folder (its state, read back on a resume)
CANDIDATE_RUNGS_NAME = "candidate_rungs.json"


def _scheduler(exp: ExperimentConfig, max_concurrent: int = 1, run_dir: Optional[Path] = None):
    """The experiment's Tune scheduler: ASHA on ``step`` and the experiment's metric (for a search with several
    settings one ASHA per setting, :class:`~atlaslab.search.schedulers.PerSettingScheduler`, so that a trial is
    compared only with trials of its own setting); ``candidate_asha``: a search's candidates compared by their score
    at each rung, their settings paused there until all arrived
    (:class:`~atlaslab.search.schedulers.CandidateASHA`, its record in ``run_dir``/:data:`CANDIDATE_RUNGS_NAME`)."""
    if exp.scheduler.name not in ("asha", "candidate_asha"):
        return None
    from ray.tune.schedulers import ASHAScheduler
    s = exp.scheduler
    grace, max_t = _grace_and_max_t(exp)
    if s.name == "candidate_asha":
        from atlaslab.search.schedulers import CandidateASHA
        return CandidateASHA([c for c, _, _ in cells(exp)], functools.partial(cell_score, exp), exp.metric, exp.mode,
                             grace_period=grace, reduction_factor=s.reduction_factor, max_t=max_t,
                             max_concurrent=max_concurrent,
                             state_path=None if run_dir is None else str(Path(run_dir).resolve()
                                                                         / CANDIDATE_RUNGS_NAME))

    def make():
        return ASHAScheduler(time_attr="step", metric=exp.metric, mode=exp.mode, max_t=max_t,
                             grace_period=grace, reduction_factor=s.reduction_factor,
                             brackets=s.brackets)
    if is_multi(exp):
        from atlaslab.search.schedulers import PerSettingScheduler
        print(f"warning: scheduler asha with {len(exp.settings())} settings: a candidate gets a score only if no "
              f"setting's ASHA stops it, and a stopped candidate is pruned for the sampler (the first "
              f"discovery_suite run finished 0 of 24 candidates on every setting); scheduler: "
              f"{{name: candidate_asha}} compares candidates by their score, {{name: none}} scores every candidate",
              file=sys.stderr)
        return PerSettingScheduler(make, list(exp.settings()))
    return make()


def n_trials(p: Prepared) -> int:
    """How many Tune trials the experiment has: a grid's trials; a search's ``num_samples`` candidates, each
    trained on every setting."""
    exp = p.exp
    return len(p.trials) if exp.kind == "grid" else exp.num_samples * len(cells(exp))


def _max_concurrent(exp: ExperimentConfig, num_cpus: Optional[int]) -> int:
    if exp.max_concurrent:
        return exp.max_concurrent
    cpus = num_cpus or os.cpu_count() or 1
    return max(1, int(cpus // max(exp.resources.cpus_per_trial, 1e-9)))


def build_tuner(p: Prepared, run_dir: Path, settings: TrialSettings, num_cpus: Optional[int], progress,
                stop: Any = None):
    from ray import tune
    exp = p.exp
    search_alg = None
    if exp.kind == "grid":
        space = {"trial": tune.grid_search(p.trials_for_tune)}
        num_samples = 1
    else:
        from atlaslab.search.searcher import PartSearcher
        search_alg = PartSearcher(exp, run_dir)         # suggests {"trial": the admitted draw}
        space = {}
        num_samples = n_trials(p)                       # a trial per candidate and setting
    concurrent = _max_concurrent(exp, num_cpus)
    scheduler = _scheduler(exp, concurrent, run_dir)
    if exp.scheduler.name == "candidate_asha":
        # the searcher's own limit, which does not count a trial paused at a rung (CandidateLimiter)
        from atlaslab.search.schedulers import CandidateLimiter
        search_alg = CandidateLimiter(search_alg, concurrent, scheduler)
        concurrent = None
    tune_config = tune.TuneConfig(scheduler=scheduler, search_alg=search_alg, num_samples=num_samples,
                                  max_concurrent_trials=concurrent, reuse_actors=True,
                                  trial_dirname_creator=_trial_dirname, trial_name_creator=_trial_dirname)
    run_config = tune.RunConfig(
        name=TUNE_NAME, storage_path=str((run_dir / "ray").resolve()),
        failure_config=tune.FailureConfig(max_failures=exp.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),     # the last and the one a torn last falls back to
        sync_config=tune.SyncConfig(sync_artifacts=False),   # trials' working folders are never copied (trainable)
        verbose=0, callbacks=[progress], log_to_file=True, stop=stop)
    return tune.Tuner(_trainable(exp, settings), param_space=space, tune_config=tune_config, run_config=run_config)


# --------------------------------------------------------------------------------------------------
# run / resume
# --------------------------------------------------------------------------------------------------
def _parent_run(exp: ExperimentConfig, run_dir: Path, uri: str, node: Mapping[str, Any], n_trials: int):
    """The experiment's MLflow parent run (its params, the experiment file); the tracking dict of state.json."""
    art = T.artifact_location(uri)
    mlexp = exp.tracking.experiment or exp.name
    exp_id = T.ensure_experiment(uri, mlexp, art)
    c = T.client(uri)
    tags = {T.TAG_EXPERIMENT: exp.name, T.TAG_KIND: exp.kind, "atlaslab.run_dir": str(run_dir.resolve()),
            "mlflow.runName": exp.name}
    run = c.create_run(exp_id, tags=tags, run_name=exp.name)
    pid = run.info.run_id
    params = T.flatten({k: v for k, v in node.items() if k not in ("grid", "search")})
    for k, v in (node.get("grid") or {}).get("axes", {}).items():
        params[f"grid.axes.{k}"] = json.dumps(v, default=str)
    for k in (node.get("grid") or {}).get("variants", {}):
        params[f"grid.variant.{k}"] = json.dumps((node["grid"]["variants"][k]), default=str)
    for k, v in (node.get("search") or {}).get("space", {}).items():
        params[f"search.space.{k}"] = json.dumps(v, default=str)
    params["n_trials"] = n_trials
    T.log_params(c, pid, params)
    T.retry(c.log_text, pid, (run_dir / "experiment.yaml").read_text(), "experiment.yaml", what="log experiment")
    return {"uri": uri, "experiment_id": exp_id, "parent_run_id": pid, "experiment": mlexp}


def run(p: Prepared, run_dir: Optional[os.PathLike] = None, ray_address: Optional[str] = None,
        tracking_uri: Optional[str] = None, num_cpus: Optional[int] = None, quiet: bool = False,
        command: Optional[str] = None, stop: Any = None) -> Dict[str, Any]:
    """Run a prepared experiment into ``run_dir`` (default ``runs/<name>-<time>``); returns the summary.

    ``stop``: a Tune stopper (``RunConfig(stop=…)``); one that ends the whole experiment early leaves it
    resumable, like an interruption."""
    exp = p.exp
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(exp.name)
    if (run_dir / "state.json").exists():
        raise ConfigError("run_dir", f"{run_dir} already holds an experiment; use `atlaslab resume {run_dir}` "
                          "or another --run-dir.", value=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "experiment.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(p.node)))
    _write_json(run_dir / "trials.json", p.trials)
    if p.synonyms:
        _write_json(run_dir / SYNONYMS_NAME, p.synonyms)
    uri = T.default_tracking_uri(run_dir, tracking_uri or exp.tracking.uri)
    addr = ray_address or os.environ.get("RAY_ADDRESS")
    if addr and T.is_local_uri(uri) and not quiet:
        print(f"warning: Ray address {addr} with a local MLflow store ({uri}): trials on other machines cannot "
              "reach it; pass --tracking-uri http://<server>:<port>.", file=sys.stderr)
    state = {"name": exp.name, "kind": exp.kind, "status": "starting", "created": time.time(),
             "tracking": {}, "tune_path": str((run_dir / "ray" / TUNE_NAME).resolve()),
             "command": command or "", "num_cpus": num_cpus, "ray_address": addr,
             "source": p.source, "overrides": p.overrides}
    _write_json(run_dir / "state.json", state)
    pending = None
    if exp.tracking.enabled:
        # the MLflow store (SQLite migrations: seconds) is set up in a thread while Ray starts
        pool = cf.ThreadPoolExecutor(1)
        pending = pool.submit(_parent_run, exp, run_dir, uri, p.node, n_trials(p))
        pool.shutdown(wait=False)
    return _execute(p, run_dir, state, resume=False, ray_address=addr, num_cpus=num_cpus, quiet=quiet,
                    pending_tracking=pending, stop=stop)


def resume(run_dir: os.PathLike, ray_address: Optional[str] = None, num_cpus: Optional[int] = None,
           quiet: bool = False) -> Dict[str, Any]:
    """Resume an interrupted experiment: finished trials are kept, unfinished and errored ones continue
    from their last checkpoint; each trial stays one MLflow run."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    node = OmegaConf.to_container(OmegaConf.load(run_dir / "experiment.yaml"), resolve=True)
    exp = load_experiment(node=node)
    trials = json.loads((run_dir / "trials.json").read_text())
    p = Prepared(node, exp, trials, state.get("source", ""))
    tr = state.get("tracking") or {}
    if tr.get("parent_run_id"):
        c = T.client(tr["uri"])
        T.retry(c.update_run, tr["parent_run_id"], status="RUNNING", what="reopen parent run")
        T.set_tags(c, tr["parent_run_id"], {"atlaslab.resumed": "true"})
    state["status"] = "running"
    state.setdefault("resumes", []).append(time.time())
    _write_json(run_dir / "state.json", state)
    addr = ray_address or state.get("ray_address") or os.environ.get("RAY_ADDRESS")
    return _execute(p, run_dir, state, resume=True, ray_address=addr,
                    num_cpus=num_cpus or state.get("num_cpus"), quiet=quiet)


def _execute(p: Prepared, run_dir: Path, state: Dict[str, Any], resume: bool, ray_address: Optional[str],
             num_cpus: Optional[int], quiet: bool, pending_tracking=None, stop: Any = None) -> Dict[str, Any]:
    """Start (or join) Ray, fit the tuner (fresh or restored), collect the records, write the results and the
    report, and close the MLflow parent run; ``state.json`` records the status and the time of every phase."""
    exp = p.exp
    total = n_trials(p)
    t0 = time.time()
    status = "failed"
    lap = _Laps(state.setdefault("timings", {}))
    try:
        with RaySession(ray_address, num_cpus):
            lap("ray_init_s")
            if pending_tracking is not None:
                state["tracking"] = pending_tracking.result()
            lap("mlflow_setup_wait_s")
            state["status"] = "running"
            _write_json(run_dir / "state.json", state)
            results = _fit(p, run_dir, state, resume, num_cpus, quiet, total, stop, lap)
            lap("fit_s")
            records, interrupted = _collect_fit(p, results, run_dir, state, total)
            lap.restart()
        status = "interrupted" if interrupted else "finished"
    finally:
        lap("ray_shutdown_s")
        state["status"] = status
        state["wall_s"] = state.get("wall_s", 0.0) + (time.time() - t0)
        _write_json(run_dir / "state.json", state)
    _write_json(run_dir / RESULTS_NAME, records)
    rep = write_report(run_dir, p.exp, records, state)
    lap("report_s")
    summary = _summary(run_dir, records, rep, status, t0)
    tracking = state.get("tracking") or {}
    if tracking.get("parent_run_id"):
        T.wait_for_server(tracking["uri"])         # a server that stays away: a clear error, the run folder kept
        _close_parent_run(tracking, run_dir, state, summary)
        lap("mlflow_final_s")
    _write_json(run_dir / "state.json", state)
    return summary


class _Laps:
    """``lap(name)`` adds the seconds since the previous lap to ``timings[name]`` (accumulated over resumes)."""

    def __init__(self, timings: Dict[str, float]):
        self.timings = timings
        self.mark = time.time()

    def __call__(self, name: str) -> None:
        now = time.time()
        self.timings[name] = round(self.timings.get(name, 0.0) + now - self.mark, 3)
        self.mark = now

    def restart(self) -> None:
        """Start the next lap now (the time since the last one is not counted)."""
        self.mark = time.time()


def tune_trials(p: Prepared) -> List[Dict[str, Any]]:
    """The grid trials as Tune gets them: each with its typed model config (``resolved_model``, resolved when the
    driver validated it), so that the trial builds its model without validating it again. On a resume (a new
    process: the driver's typed configs are gone) each is resolved again from the model config the trial recorded
    (``model_config``, what the driver validated, not the preset file as it is now)."""
    out = []
    for t in p.trials:
        typed = p.resolved.get(t["key"])
        if typed is None and t.get("model_config") is not None:
            typed = p.resolved[t["key"]] = resolve_lm_config(t["model_config"])
        out.append(dict(t, resolved_model=typed) if typed is not None else dict(t))
    return out


def _tuner(p: Prepared, run_dir: Path, state: Dict[str, Any], resume: bool, num_cpus: Optional[int],
           quiet: bool, total: int, stop: Any = None):
    """The Tuner of a fresh run (:func:`build_tuner`), or Tune's saved experiment restored (unfinished and
    errored trials continue); prints the one-line start message unless ``quiet``."""
    from ray import tune

    from atlaslab.search.progress import Progress
    exp = p.exp
    tracking = state.get("tracking") or {}
    settings = TrialSettings.of(exp, tracking)
    p.trials_for_tune = tune_trials(p)   # type: ignore[attr-defined]
    progress = Progress(exp.name, exp.metric, exp.mode, tracking, "stderr" if quiet else "stdout", total)
    if resume:
        # Tune keeps a grid's typed configs (not plain values: Tune's placeholders) in memory only, so a trial it had
        # not created before the interruption gets them from the grid given again (Tune's way: the same
        # param_space, its objects made anew)
        again = {"param_space": {"trial": tune.grid_search(p.trials_for_tune)}} if exp.kind == "grid" else {}
        tuner = tune.Tuner.restore(state["tune_path"], trainable=_trainable(exp, settings), resume_unfinished=True,
                                   resume_errored=True, **again)
        if not quiet:
            print(f"[{exp.name}] resuming {state['tune_path']}", flush=True)
        return tuner
    tuner = build_tuner(p, run_dir, settings, num_cpus, progress, stop)
    if not quiet:
        print(f"[{exp.name}] {total} trials → {run_dir}  (MLflow: {tracking.get('uri', 'off')})", flush=True)
    return tuner


CONTROLLER_RESTARTS = 3   # how often one run or resume restores Tune's experiment after a crash of Tune's controller


def _fit(p: Prepared, run_dir: Path, state: Dict[str, Any], resume: bool, num_cpus: Optional[int], quiet: bool,
         total: int, stop: Any, lap: "_Laps"):
    """Fit the tuner and return Tune's results. When Tune's controller itself stops on an error of Ray's rather
    than of a trial, the saved experiment is restored and fitted again (finished trials kept, the others continue
    from their checkpoints), at most :data:`CONTROLLER_RESTARTS` times; each restart is recorded in
    ``state["controller_restarts"]``. The case seen: Ray's memory monitor kills a trial's actor while it starts, and
    Tune (2.60) raises the ``OutOfMemoryError`` out of ``fit`` instead of failing the trial, ending the sweep."""
    for attempt in range(CONTROLLER_RESTARTS + 1):
        tuner = _tuner(p, run_dir, state, resume or attempt > 0, num_cpus, quiet, total, stop)
        lap("tuner_setup_s")
        try:
            return tuner.fit()
        except RuntimeError as e:
            cause = ray_system_error(e)
            if cause is None or attempt == CONTROLLER_RESTARTS:
                raise
            error = f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
            state.setdefault("controller_restarts", []).append({"time": time.time(), "error": error})
            _write_json(run_dir / "state.json", state)
            print(f"[{p.exp.name}] Tune stopped on an error of Ray's, not of a trial ({error}); restoring the "
                  f"experiment ({attempt + 1}/{CONTROLLER_RESTARTS})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")  # pragma: no cover


def ray_system_error(e: BaseException) -> Optional[BaseException]:
    """The Ray system error (``ray.exceptions.RayError``, not a trial's own ``RayTaskError``) that ``e`` was raised
    from, if any: what Tune's controller wraps in ``RuntimeError("Caught unexpected exception: …")``."""
    from ray.exceptions import RayError, RayTaskError
    seen = set()
    cur: Optional[BaseException] = e.__cause__
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, RayError) and not isinstance(cur, RayTaskError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__
    return None


def _collect_fit(p: Prepared, results, run_dir: Path, state: Mapping[str, Any], total: int):
    """``(records, interrupted)`` of a fit: interrupted when Tune returned fewer trials than the experiment
    has or its saved state still has trials to run."""
    statuses = saved_statuses(state["tune_path"])
    # a search whose searcher stopped drawing (too many rejections in a row) has fewer trials, and has finished
    short = len(results) < total and not (p.exp.kind == "search" and read_rejected(run_dir).get("stopped"))
    interrupted = short or any(v in WAITING for v in statuses.values())
    return collect(p, results, run_dir, partial=interrupted, statuses=statuses), interrupted


def _summary(run_dir: Path, records: List[Dict[str, Any]], report: Path, status: str, t0: float) -> Dict[str, Any]:
    """What :func:`run` and :func:`resume` return: the counts by status, the wall time and the report's path."""
    return {"run_dir": str(run_dir), "trials": len(records),
            "failed": sum(r["failed"] for r in records),
            "completed": sum(r["status"] in ("completed", "early_stopped") for r in records),
            "pruned": sum(r["status"] == "pruned" for r in records), "wall_s": time.time() - t0,
            "report": str(report), "status": status,
            "unfinished": sum(r["status"] in ("unfinished", "pending") for r in records)}


def _close_parent_run(tracking: Mapping[str, Any], run_dir: Path, state: Mapping[str, Any],
                      summary: Mapping[str, Any]) -> None:
    """Log the counts and the report to the MLflow parent run and end it (KILLED when interrupted)."""
    c = T.client(tracking["uri"])
    pid = tracking["parent_run_id"]
    T.log_metrics(c, pid, {"n_trials": summary["trials"], "n_failed": summary["failed"],
                           "n_completed": summary["completed"], "wall_s": state["wall_s"]}, 0)
    for f in sorted(run_dir.glob("report.*")) + sorted((run_dir / "plots").glob("*.png")) + \
            [run_dir / "trials.csv", run_dir / RESULTS_NAME]:
        if f.is_file():
            T.retry(c.log_artifact, pid, str(f), "plots" if f.suffix == ".png" else None, what="log report")
    T.retry(c.set_terminated, pid, status="FINISHED" if summary["status"] == "finished" else "KILLED",
            what="end parent run")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The ``atlaslab …`` command line that reproduces this run (recorded in state.json and the report)."""
    return "atlaslab " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))


__all__ = ["Prepared", "RaySession", "collect", "command_line", "default_run_dir", "prepare", "read_state",
           "resume", "run", "trial_table"]
