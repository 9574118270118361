"""The recall-vs-state page's table rows and state plot from one or more run folders of the study.

    python docs/gen_recall_vs_state.py runs/rvs runs/rvs_rest

Reads each folder's ``report.csv`` (written by ``atlaslab run`` / ``atlaslab report``), keeps the rows with at
least one finished seed (the first folder wins where two have the same row), prints the Markdown table rows of
docs/results/recall-vs-state.md and draws docs/results/recall-vs-state/state.png with the report's own
:func:`atlaslab.search.report.plot_state`.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

from atlaslab.search.report import plot_state

OUT = Path(__file__).resolve().parent / "results" / "recall-vs-state" / "state.png"
METRIC = "test/accuracy"


def read_rows(run_dirs):
    rows, seen = [], set()
    for run in map(Path, run_dirs):
        for r in csv.DictReader(open(run / "report.csv")):
            if int(r["n_ok"]) == 0 or r["row"] in seen:
                continue
            seen.add(r["row"])
            std = r[METRIC + " std"]
            rows.append({"variant": r["variant"], "label": r["row"], "row": r["row"], "setting": None,
                         "state_size": int(r["state_size"]), METRIC: float(r[METRIC]),
                         METRIC + " std": float(std) if std not in ("", "nan") else 0.0, "n_ok": int(r["n_ok"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    rows = read_rows(ap.parse_args().run_dirs)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    rows.sort(key=lambda r: (variants.index(r["variant"]), r["state_size"]))
    plot_state(rows, METRIC, OUT)
    for r in rows:
        std = f" ± {r[METRIC + ' std']:.3f}" if r["n_ok"] > 1 else ""
        print(f"| {r['row']} | {r['state_size']:,} | {r[METRIC]:.3f}{std} | {r['n_ok']} |")


if __name__ == "__main__":
    main()
