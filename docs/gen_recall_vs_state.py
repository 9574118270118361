"""The recall-vs-state page's tables and state plot, from the study's run data committed in the repository.

    python docs/gen_recall_vs_state.py        # print the main table and redraw docs/results/recall-vs-state/state.png

The main table pools the finished trials of the committed run folders in :data:`RUNS`
(``docs/results/recall-vs-state/runs/<run>/trials.csv`` and ``trials.json``) by (row, seed): the first folder in
:data:`RUNS` that finished a row's seed wins. A row's value is the mean ± sample std of ``test/accuracy`` over its
seeds, with each seed's value; a trial that failed (e.g. diverged) counts only when the row has no finished seed,
and is then shown with its message. Rows of folders that were not kept (the first passes, ``rvs2``, ``rvs_pass2``,
``rvs_pass3``, ``rvs_atlas8``; attention's and the 16-head ATLAS row have no other) are not in the table: a number
without its data is not printed.

:data:`TABLES` is read by ``docs/gen_tables.py``: ``recall-vs-state`` (the main table) and
``recall-vs-state-budget`` (the 1,600-step rerun against the 800-step rows).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HERE = DOCS / "results" / "recall-vs-state"
OUT = HERE / "state.png"
METRIC = "test/accuracy"
FINISHED = ("completed", "early_stopped")
#: the committed runs of the 800-step table, first wins for a (row, seed)
RUNS = ("rvs_wd", "rvs_titans_wd", "rvs_omega_wd", "rvs_atlas_wd", "rvs_attention_wd")
#: the 1,600-step rerun of the rows below 0.97
LONG = "rvs_long_wd"
#: the models in the order of the page (the study's variants)
ORDER = ("attention", "linear attention", "DeltaNet", "Gated DeltaNet", "Titans (LMM)", "OmegaNet",
         "ATLAS (NS per chunk of 4)")


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


def _value(r) -> str:
    vals = [r["seeds"][s] for s in sorted(r["seeds"])]
    if not vals:
        return "; ".join(r["failed"])
    text = f"{statistics.mean(vals):.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")
    return text + " (" + ", ".join(f"{v:.2f}" for v in vals) + ")"


def _order(rows):
    """Rows by model (:data:`ORDER`), then by state size."""
    return sorted(rows, key=lambda n: (ORDER.index(rows[n]["variant"]) if rows[n]["variant"] in ORDER else len(ORDER),
                                       rows[n]["state_size"] or 0))


def _label(row: str) -> str:
    return row.replace(" · num_heads=", " · ")


def main_rows():
    return pool_trials([HERE / "runs" / r for r in RUNS])


def table() -> str:
    """The main table: model · heads, state, test accuracy over the seeds, seeds, run folder."""
    rows = main_rows()
    lines = ["| model · heads | state (scalars) | test accuracy (seeds) | seeds | run folder |",
             "|---|---|---|---|---|"]
    for name in _order(rows):
        r = rows[name]
        size = f"{r['state_size']:,}" if r["state_size"] else "—"
        lines.append(f"| {_label(name)} | {size} | {_value(r)} | {len(r['seeds'])} | "
                     f"{', '.join(sorted(r['folders']))} |")
    return "\n".join(lines)


def budget_table() -> str:
    """The 1,600-step rerun (:data:`LONG`) beside the same rows of the 800-step table."""
    short, long = main_rows(), pool_trials([HERE / "runs" / LONG])
    lines = ["| model · heads | state (scalars) | 800 steps (the table) | 1,600 steps (seeds 0, 1, 2) |",
             "|---|---|---|---|"]
    # the rows the rerun has, and the 800-step rows of the same models and states that it did not rerun
    models, states = {r["variant"] for r in long.values()}, {r["state_size"] for r in long.values()}
    both = {**{n: r for n, r in short.items() if r["variant"] in models and r["state_size"] in states}, **long}
    for name in _order(both):
        r = long.get(name)
        if r is None:
            text = "not rerun"
        else:
            vals = [r["seeds"][s] for s in sorted(r["seeds"])]
            text = f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f} (" + ", ".join(
                f"{v:.3f}" for v in vals) + ")"
        r = both[name]
        before = short.get(name)
        old = (_value(before).split(" (")[0]) if before else "—"
        lines.append(f"| {_label(name)} | {r['state_size']:,} | {old} | {text} |")
    return "\n".join(lines)


def plot() -> None:
    """docs/results/recall-vs-state/state.png, with the run report's own state plot."""
    from atlaslab.search.report import plot_state
    rows = main_rows()
    pts = []
    for n in _order(rows):
        vals = [rows[n]["seeds"][s] for s in sorted(rows[n]["seeds"])]
        if vals:
            pts.append({"variant": rows[n]["variant"], "label": n, "setting": None,
                        "state_size": rows[n]["state_size"], METRIC: statistics.mean(vals),
                        METRIC + " std": statistics.stdev(vals) if len(vals) > 1 else 0.0})
    plot_state(pts, METRIC, OUT)


TABLES = {"recall-vs-state": table, "recall-vs-state-budget": budget_table}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    plot()
    print(table())


if __name__ == "__main__":
    main()
