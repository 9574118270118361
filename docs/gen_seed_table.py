"""One markdown table over the seeds of several run folders of the same experiment (e.g. ``seeds=[0]`` and
``seeds=[1]`` run apart): per row, each metric's mean ± sample std over the completed trials, with the per-seed
values in seed order, as the reading-list page's tables show them.

    python docs/gen_seed_table.py docs/results/reading-list/runs/rlist_niah_s{0,1,2}/trials.csv \\
        --metrics test/exact_match test/accuracy test/len_512/exact_match

The inputs are the runs' ``trials.csv`` files (what ``atlaslab run`` writes beside its report). Rows keep the order
in which they first appear; a trial that did not complete is left out of the mean and counted in the "runs" column.
"""
from __future__ import annotations

import argparse
import csv
from typing import Dict, List, Sequence

from atlaslab.search.report import _mean_std as mean_std     # the run reports' mean ± sample std


def read_trials(paths: Sequence[str]) -> Dict[str, List[Dict[str, str]]]:
    """Row label → its trials (the csv records of every file), in first-seen row order."""
    rows: Dict[str, List[Dict[str, str]]] = {}
    for path in paths:
        with open(path, newline="") as f:
            for rec in csv.DictReader(f):
                rows.setdefault(rec["row"], []).append(rec)
    return rows


def table(rows: Dict[str, List[Dict[str, str]]], metrics: Sequence[str], digits: int = 3) -> str:
    """The markdown table: row, one column per metric, params, state, completed runs / runs."""
    head = ["model", *metrics, "params", "state", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, recs in rows.items():
        done = sorted((r for r in recs if r["status"] in ("completed", "early_stopped")), key=lambda r: int(r["seed"]))
        cells = [row]
        for m in metrics:
            vals = [float(r[m]) for r in done if r.get(m) not in (None, "")]
            if not vals:
                cells.append("—")
                continue
            mu, sd = mean_std(vals)
            each = ", ".join(f"{v:.{digits}f}" for v in vals)
            cells.append(f"{mu:.{digits}f}" + (f" ± {sd:.{digits}f} ({each})" if sd is not None else ""))
        cells += [f"{int(recs[0]['num_parameters']) / 1e3:.0f}k", f"{int(recs[0]['state_size']) / 1e3:.1f}k",
                  f"{len(done)}/{len(recs)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trials", nargs="+", help="trials.csv files")
    ap.add_argument("--metrics", nargs="+", required=True)
    ap.add_argument("--digits", type=int, default=3)
    args = ap.parse_args()
    print(table(read_trials(args.trials), args.metrics, args.digits))


if __name__ == "__main__":
    main()
