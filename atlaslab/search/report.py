"""Reports: a markdown table of variants × metrics, CSVs and PNG plots, from a run folder's records.

Rows are the experiment's variants (× axis values, × settings). Within a row, the seeds give mean ± std;
with ``protocol`` (MAD) the row is the best (lr, weight decay) by the mean of ``metric`` over seeds, and
the chosen point is printed. Deltas are against the baseline row of the same setting and axis values
(``grid.baseline``, default the first variant). Parameter count and recurrent-state size (scalars per
sequence at the task's length, zoology's ``state_size``) come from the validated models. Failed trials
(diverged, errored) are listed with their reason and left out of the means. ``report.averages`` adds columns
that are each trial's mean of other metrics (ATLAS Table 2's "Avg" of its accuracy columns), averaged over seeds
like the rest; ``report.labels`` names the columns. The rows come from :mod:`atlaslab.search.aggregate`, the
markdown and CSVs from :mod:`atlaslab.search.tables`, the figures from :mod:`atlaslab.search.plots`. A search scored
on several settings is reported per candidate (:func:`atlaslab.search.fitness.candidates`): a table with each
setting's metric and the score, ranked by it, and the Pareto front, importances and marginals of the score.

    atlaslab report RUN_DIR      # rewrites report.md, report.csv, trials.csv, plots/*.png
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from omegaconf import OmegaConf

from atlaslab.search.aggregate import (_mean_std, aggregate, mad_scores, mean_std, ranked_trials, report_metrics,
                                       steps_to, with_averages)
from atlaslab.search.curves import write_curves
from atlaslab.search.expand import Prepared
from atlaslab.search.fitness import candidates, is_multi, ranked_candidates
from atlaslab.search.mattered import search_analysis
from atlaslab.search.plots import grid_plots, plot_state, search_plots
from atlaslab.search.references import ReferenceRun, load_reference_run
from atlaslab.search.results import read_records
from atlaslab.search.schema import ExperimentConfig, load_experiment
from atlaslab.search.tables import (candidates_table, failed_section, grid_sections, header, length_section,
                                    search_section, settings_of, waiting_section, write_csvs)


def write_report(run_dir: Path, exp: ExperimentConfig, records: Sequence[Mapping[str, Any]],
                 state: Optional[Mapping[str, Any]] = None, references: Sequence[ReferenceRun] = ()) -> Path:
    """Write report.md, report.csv, trials.csv and plots/ into ``run_dir``; returns report.md's path. ``references``
    (a search's report only, :func:`atlaslab.search.references.load_reference_run`) are drawn against its front."""
    run_dir = Path(run_dir)
    state = state or {}
    records = with_averages(exp, records)
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    metrics = report_metrics(exp, records)
    lines = header(exp, records, state)
    rows: List[Dict[str, Any]] = []
    if exp.kind == "grid":
        rows = aggregate(exp, records)
        lines += grid_sections(exp, rows, metrics, multi=len(settings_of(records)) > 1)
        figs = grid_plots(exp, rows, records, metrics, plots) if exp.report.plots else []
        lines += length_section(exp, rows)
    elif is_multi(exp):              # candidates scored on several settings: ranked, analysed and drawn by score
        cands = candidates(exp, records)
        ranked = ranked_candidates(exp, cands)
        lines += candidates_table(exp, cands, ranked)
        lines += search_section(exp, records, ranked_trials(exp, records), metrics, title="Trials (per setting)")
        lines += search_analysis(exp, cands, run_dir, references)
        figs = search_plots(exp, cands, ranked, plots, trials=records, references=references) \
            if exp.report.plots else []
    else:
        ranked = ranked_trials(exp, records)
        lines += search_section(exp, records, ranked, metrics)
        lines += search_analysis(exp, records, run_dir, references)
        figs = search_plots(exp, records, ranked, plots, references=references) if exp.report.plots else []
    lines += waiting_section(exp, records) + failed_section(records)
    if figs:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}](plots/{p.name})" for p in figs]
        lines.append("")
    lines.append("Per-trial numbers: `trials.csv`; per-row numbers: `report.csv`; MLflow: "
                 f"`{(state.get('tracking') or {}).get('uri', 'off')}`.")
    write_csvs(run_dir, exp, rows, records, metrics)
    write_curves(run_dir, records)                       # curves.csv: every trial's learning curve
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def report_from_dir(run_dir: Path, refresh: bool = False, compare: Sequence[Union[str, Path]] = ()) -> Path:
    """Rewrite the report of a run folder. Without ``results.json`` (an experiment still running or
    interrupted), or with ``refresh``, the records are read from Tune's experiment folder; trials without a
    final result are then reported as ``unfinished``. ``compare``: reference run folders (grids of presets) to draw
    against a search's Pareto front, each validated before anything else is read (a ConfigError under ``compare``)."""
    run_dir = Path(run_dir)
    state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").is_file() else {}
    node = OmegaConf.to_container(OmegaConf.load(run_dir / "experiment.yaml"))
    exp = load_experiment(node=node)
    references = [load_reference_run(exp, path) for path in compare]
    trials = json.loads((run_dir / "trials.json").read_text()) if (run_dir / "trials.json").is_file() else []
    records = read_records(run_dir, Prepared(node, exp, trials), state, refresh=refresh)
    return write_report(run_dir, exp, records, state, references)


#: (besides its own two functions, the names this module has always offered to the scripts and tests that use them)
__all__ = ["_mean_std", "aggregate", "mad_scores", "mean_std", "plot_state", "report_from_dir", "report_metrics",
           "steps_to", "with_averages", "write_report"]
