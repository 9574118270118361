"""The recall-vs-state page's table rows and state plot from one or more run folders of the study.

    python docs/gen_recall_vs_state.py [RUN_DIR ...]

Reads each folder's ``trials.csv`` (written by ``atlaslab run`` / ``resume`` / ``report``; ``atlaslab report RUN_DIR``
writes it for a run that is still going or was stopped) and its ``trials.json``, and pools the
finished trials by (row, seed) across the folders: the first folder that finished a row's seed wins, so a later
pass that reran a seed (a changed configuration, or a determinism check) is listed first. A row's value is the
mean ± sample std of ``test/accuracy`` over its seeds; a trial that failed (e.g. diverged) counts only when the
row has no finished seed, and is then shown with its message. Prints the Markdown table rows of
docs/results/recall-vs-state.md and draws docs/results/recall-vs-state/state.png with the report's own
:func:`atlaslab.search.report.plot_state`.

The rows of the first four run folders (rvs2, rvs_pass2, rvs_pass3, rvs_atlas8) come from
``recall-vs-state/rows.csv``, the values the page printed from them (mean, std and each seed's value to two
decimals): those folders were not kept. A row that a folder given here also has is taken from the folder. Later
passes keep their ``trials.csv`` and ``trials.json`` under ``recall-vs-state/runs/``.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from atlaslab.search.report import plot_state

HERE = Path(__file__).resolve().parent / "results" / "recall-vs-state"
OUT = HERE / "state.png"
ARCHIVE = HERE / "rows.csv"
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


def archived_rows():
    """The rows of the run folders that were not kept: ``{row: {...}}`` as the page printed them."""
    return {r["row"]: r for r in csv.DictReader(open(ARCHIVE))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="*")
    run_dirs = ap.parse_args().run_dirs
    rows = pool_trials(run_dirs)
    table = {}                 # row → (variant, state, mean, std, value text, seeds, folders)
    for name, r in archived_rows().items():
        std = float(r["std"]) if r["std"] else 0.0
        value = r["mean"] + (f" ± {r['std']}" if r["std"] else "") + f" ({r['seeds']})"
        table[name] = (r["variant"], int(r["state_size"]), float(r["mean"]), std, value, int(r["n"]), r["folders"])
    for name, r in rows.items():
        vals = [r["seeds"][s] for s in sorted(r["seeds"])]
        if vals:
            mean, std = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
            value = f"{mean:.3f}" + (f" ± {std:.3f}" if len(vals) > 1 else "")
            value += " (" + ", ".join(f"{v:.2f}" for v in vals) + ")"
        else:
            mean, std, value = None, None, "; ".join(r["failed"])
        table[name] = (r["variant"], r["state_size"], mean, std, value, len(vals), ", ".join(sorted(r["folders"])))
    # the models in the order of the archive (the first passes), then those the later passes add
    variants = list(dict.fromkeys(v[0] for v in table.values()))
    order = sorted(table, key=lambda n: (variants.index(table[n][0]), table[n][1] or 0))
    plot_state([{"variant": table[n][0], "label": n, "setting": None, "state_size": table[n][1], METRIC: table[n][2],
                 METRIC + " std": table[n][3]} for n in order if table[n][2] is not None], METRIC, OUT)
    for name in order:
        variant, state, _, _, value, n, folders = table[name]
        size = f"{state:,}" if state else "—"
        print(f"| {name.replace(' · num_heads=', ' · ')} | {size} | {value} | {n} | {folders} |")


if __name__ == "__main__":
    main()
