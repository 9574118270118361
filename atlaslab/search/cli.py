"""``atlaslab run | resume | report``: the search driver's commands (added to :data:`atlaslab.cli.COMMANDS`)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from atlaslab.search.driver import command_line, prepare, resume, run, trial_table
from atlaslab.search.report import report_from_dir
from atlaslab.search.tracking import TrackingUnavailable


def cmd_run(args: argparse.Namespace) -> int:
    p = prepare(args.experiment, args.overrides)
    if args.dry_run:
        print(trial_table(p))
        return 0
    if not args.quiet:
        print(f"validated {len(p.trials)} trial configs in {p.validate_s:.1f} s", flush=True)
    argv = ["run", args.experiment] + list(args.overrides)
    try:
        summary = run(p, run_dir=args.run_dir, ray_address=args.ray_address, tracking_uri=args.tracking_uri,
                      num_cpus=args.num_cpus, quiet=args.quiet, command=command_line(argv))
    except TrackingUnavailable as exc:
        return _tracking_lost(exc)
    return _finish(summary, args.quiet)


def cmd_resume(args: argparse.Namespace) -> int:
    try:
        summary = resume(args.run_dir, ray_address=args.ray_address, num_cpus=args.num_cpus, quiet=args.quiet)
    except TrackingUnavailable as exc:
        return _tracking_lost(exc)
    return _finish(summary, args.quiet)


def _tracking_lost(exc: TrackingUnavailable) -> int:
    """The sweep ended without its tracking server: say so (no traceback) and exit 1; the run folder resumes."""
    print(f"error: {exc}. The run folder is kept: `atlaslab resume <run dir>` once the server is back.",
          file=sys.stderr)
    return 1


def cmd_report(args: argparse.Namespace) -> int:
    path = report_from_dir(Path(args.run_dir), refresh=args.refresh, compare=args.compare)
    if args.print:
        print(path.read_text())
    else:
        print(f"report: {path}")
    return 0


def _finish(summary, quiet: bool) -> int:
    msg = (f"{summary['trials']} trials: {summary['completed']} completed, {summary['failed']} failed"
           + (f", {summary['pruned']} stopped early" if summary.get("pruned") else "")
           + f" in {summary['wall_s']:.0f} s. Report: {summary['report']}")
    if summary.get("status") == "interrupted":
        msg += (f"\nInterrupted with {summary['unfinished']} trials unfinished: "
                f"`atlaslab resume {summary['run_dir']}` finishes them.")
    print(msg, file=sys.stderr if quiet else sys.stdout)
    if not quiet:
        print(Path(summary["report"]).read_text())
    return 0


def _ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=None,
                   help="join a Ray cluster (default: $RAY_ADDRESS, else a local Ray on this machine)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--quiet", action="store_true", help="progress to stderr; print only the summary")


def add_run(sub) -> None:
    p = sub.add_parser("run", help="run an experiment (ablation grid or search) on Ray Tune, tracked in MLflow")
    p.add_argument("experiment", help="experiment YAML (see experiments/)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides of the experiment, e.g. train.steps=50 seeds=[0,1]")
    p.add_argument("--dry-run", action="store_true", help="validate, print the expanded trial table and exit")
    p.add_argument("--run-dir", default=None, help="run folder (default runs/<name>-<time>)")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite in the run folder)")
    _ray_args(p)
    p.set_defaults(func=cmd_run)


def add_resume(sub) -> None:
    p = sub.add_parser("resume", help="resume an interrupted experiment from its run folder")
    p.add_argument("run_dir")
    _ray_args(p)
    p.set_defaults(func=cmd_resume)


def add_report(sub) -> None:
    p = sub.add_parser("report", help="(re)write the report of a run folder (markdown, CSV, plots)")
    p.add_argument("run_dir")
    p.add_argument("--print", action="store_true", help="print the markdown report")
    p.add_argument("--refresh", action="store_true",
                   help="re-read the results from Tune's folder (automatic while an experiment is unfinished)")
    p.add_argument("--compare", action="append", default=[], metavar="RUN_DIR",
                   help="a grid run of reference models (e.g. presets × learning rates, on the search's settings) "
                   "to draw against a search's Pareto front, each variant at its best learning rate by the search's "
                   "score; repeatable")
    p.set_defaults(func=cmd_report)


__all__ = ["add_report", "add_resume", "add_run"]
