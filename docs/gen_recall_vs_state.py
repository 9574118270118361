"""The recall-vs-state page's table rows and state plot from one or more run folders of the study.

    python docs/gen_recall_vs_state.py runs/rvs_pass3 runs/rvs_pass2 runs/rvs2

Reads each folder's ``trials.csv`` (written by ``atlaslab run`` / ``resume`` / ``report``; ``atlaslab report RUN_DIR``
writes it for a run that is still going or was stopped) and its ``trials.json``, and pools the
finished trials by (row, seed) across the folders: the first folder that finished a row's seed wins, so a later
pass that reran a seed (a changed configuration, or a determinism check) is listed first. A row's value is the
mean ± sample std of ``test/accuracy`` over its seeds; a trial that failed (e.g. diverged) counts only when the
row has no finished seed, and is then shown with its message. Prints the Markdown table rows of
docs/results/recall-vs-state.md and draws docs/results/recall-vs-state/state.png with the report's own
:func:`atlaslab.search.report.plot_state`.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from atlaslab.search.report import plot_state

OUT = Path(__file__).resolve().parent / "results" / "recall-vs-state" / "state.png"
METRIC = "test/accuracy"
FINISHED = ("completed", "early_stopped")


def pool_trials(run_dirs):
    """``{row: {"variant", "state_size", "seeds": {seed: value}, "folders": set, "failed": [message]}}``, rows in the
    order first seen."""
    rows = {}
    for run in map(Path, run_dirs):
        variants = {t["key"]: t["variant"] for t in json.loads((run / "trials.json").read_text())}
        for t in csv.DictReader(open(run / "trials.csv")):
            r = rows.setdefault(t["row"], {"variant": variants[t["key"]], "state_size": None, "seeds": {},
                                           "folders": set(), "failed": []})
            seed = int(t["seed"])
            if t["status"] in FINISHED and t.get(METRIC) not in (None, "") and seed not in r["seeds"]:
                r["seeds"][seed] = float(t[METRIC])
                r["folders"].add(run.name)
                r["state_size"] = r["state_size"] or int(t["state_size"])
            elif t["status"] == "failed":
                r["failed"].append(f"seed {seed}: {t.get('message') or 'failed'}")
    return {k: v for k, v in rows.items() if v["seeds"] or v["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    run_dirs = ap.parse_args().run_dirs
    rows = pool_trials(run_dirs)
    plot_rows = []
    for name, r in rows.items():
        vals = list(r["seeds"].values())
        if vals:
            plot_rows.append({"variant": r["variant"], "label": name, "setting": None, "state_size": r["state_size"],
                              METRIC: statistics.mean(vals),
                              METRIC + " std": statistics.stdev(vals) if len(vals) > 1 else 0.0})
    # the models in the order the first pass lists them (the last folder), then those the later passes add
    variants = list(dict.fromkeys(t["variant"] for run in reversed(run_dirs)
                                  for t in json.loads((Path(run) / "trials.json").read_text())))
    plot_rows.sort(key=lambda r: (variants.index(r["variant"]), r["state_size"]))
    plot_state(plot_rows, METRIC, OUT)
    order = sorted(rows, key=lambda n: (variants.index(rows[n]["variant"]), rows[n]["state_size"] or 0))
    for name in order:
        r = rows[name]
        vals = [r["seeds"][s] for s in sorted(r["seeds"])]
        if vals:
            value = f"{statistics.mean(vals):.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")
            value += " (" + ", ".join(f"{v:.2f}" for v in vals) + ")"
        else:
            value = "; ".join(r["failed"])
        size = f"{r['state_size']:,}" if r["state_size"] else "—"
        print(f"| {name.replace(' · num_heads=', ' · ')} | {size} | {value} | {len(vals)} | {', '.join(sorted(r['folders']))} |")


if __name__ == "__main__":
    main()
