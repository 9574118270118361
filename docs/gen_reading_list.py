"""The reading-list page's tables (docs/results/reading-list.md), from the run data committed in the repository.

    python docs/gen_reading_list.py reading-list-mqar      # print one table (the names are the keys of TABLES)

Every value is read from a committed file: the runs' ``trials.csv`` under ``docs/results/reading-list/runs/<run>/``
(what ``atlaslab run`` wrote beside its report), the recall-vs-state study's ``rvs_atlas_wd`` run, and
``bench/results/learning_mac_cpu.json`` (the titans-pytorch MAC reference). A cell is the mean ± sample std over the
row's finished seeds with each seed's value in seed order (one seed: its value; every seed exactly 0: "0"), as
``docs/gen_seed_table.py`` prints it. A segment column is a trial's ``test/accuracy/pos_<a>_<b>`` (the run's own
position split, ``task.eval_position_span``).

A row whose run folder was not kept (the page names them: ``rlist_mqar`` and its probes, ``rvs_atlas8``, the
checkpoints that gave the older runs' split by segment, the Titans (MAC) probes and the tiny-MQAR probes of FoX's
forget bias) is printed with :data:`LOST` in place of its numbers: a number that nothing committed can check is not
printed as a result.

:data:`TABLES` is read by ``docs/gen_tables.py``, which writes each table into the page's
``<!-- generated: NAME -->`` blocks.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from atlaslab.search.formatting import human_count  # noqa: E402

RUNS = DOCS / "results" / "reading-list" / "runs"
RVS = DOCS / "results" / "recall-vs-state" / "runs"
MAC_REF = ROOT / "bench" / "results" / "learning_mac_cpu.json"
FINISHED = ("completed", "early_stopped")
#: what a row whose data was not committed shows in place of its numbers
LOST = "no committed data"
#: the four query segments of MQAR at 64 tokens (test metrics of the runs' position split)
SEGMENTS = ("test/accuracy/pos_0_16", "test/accuracy/pos_16_32", "test/accuracy/pos_32_48", "test/accuracy/pos_48_64")


def trials(run: str, row: str, root: Path = RUNS) -> List[Dict[str, str]]:
    """The finished trials of ``row`` in the committed run folder ``root/run``, in seed order (an error if none)."""
    with open(root / run / "trials.csv", newline="") as f:
        got = [t for t in csv.DictReader(f) if t["row"] == row and t["status"] in FINISHED]
    if not got:
        raise ValueError(f"{root / run / 'trials.csv'}: no finished trial of row {row!r}")
    return sorted(got, key=lambda t: int(t["seed"]))


def pooled(runs: Sequence[str], row: str, root: Path = RUNS) -> List[Dict[str, str]]:
    """The finished trials of ``row`` over several folders of the same experiment (seeds run apart)."""
    return sorted((t for run in runs for t in trials(run, row, root)), key=lambda t: int(t["seed"]))


def values(ts: Sequence[Dict[str, str]], metric: str) -> List[float]:
    return [float(t[metric]) for t in ts if t.get(metric) not in (None, "")]


def seeds_cell(vals: Sequence[float], digits: int = 3) -> str:
    """mean ± sample std (each seed's value), one seed's value alone, "0" when every seed is exactly 0."""
    if not vals:
        return "—"
    if all(v == 0 for v in vals):
        return "0"
    each = ", ".join(f"{v:.{digits}f}" for v in vals)
    if len(vals) == 1:
        return each
    return f"{statistics.mean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f} ({each})"


def each_cell(vals: Sequence[float], sep: str = " / ", digits: int = 3) -> str:
    """Each seed's value, in seed order ("0" for an exact 0)."""
    return sep.join("0" if v == 0 else f"{v:.{digits}f}" for v in vals)


def sizes(ts: Sequence[Dict[str, str]]) -> List[str]:
    return [human_count(ts[0]["num_parameters"]), human_count(ts[0]["state_size"])]


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def lost(label: str, width: int, why: str) -> List[str]:
    return [label, f"{LOST} ({why})"] + ["—"] * (width - 2)


# --- MQAR -----------------------------------------------------------------------------------------------------------

def runs_table() -> str:
    """The committed MQAR runs of the page: the rows each holds and its finished / all trials."""
    runs = {"rlist_rest_long": "", "rlist_long": "", "rlist_armt_long": "",
            "rlist_armt_stack": " ([below](#armt-through-the-stack))",
            "rlist_titans_wd": ", rerun after the weight-decay change",
            "rlist_lact_mac_wd": ", rerun after the weight-decay change"}
    rows = []
    for run, note in runs.items():
        with open(RUNS / run / "trials.csv", newline="") as f:
            ts = list(csv.DictReader(f))
        names = list(dict.fromkeys(t["row"] for t in ts))
        done = sum(t["status"] in FINISHED for t in ts)
        rows.append([f"`runs/{run}`", ", ".join(names) + note, f"{done}/{len(ts)}"])
    return table(["run", "rows (as `trials.csv` names them)", "finished / trials"], rows)


def mqar() -> str:
    """The main table: test accuracy over seeds 0, 1, 2, params, state."""
    spec = [("Transformer++", "rlist_rest_long", "Transformer"),
            ("FoX (forget bias 6, the preset; `runs/rlist_mqar_fox6`)", "rlist_mqar_fox6", "FoX, forget_bias_init 6"),
            ("FoX (forget bias 3, the preset when this table ran)", "rlist_rest_long", "FoX"),
            ("Titans (LMM)", "rlist_titans_wd", "Titans (LMM)"),
            ("ATLAS (NS per chunk of 4), 8 heads (800 steps; `runs/rvs_atlas8`)", None, "rvs_atlas8 was not kept"),
            ("ATLAS (NS per chunk of 4), 8 heads (800 steps), rerun after the weight-decay change "
             "(recall-vs-state's `runs/rvs_atlas_wd`)", "rvs_atlas_wd", "ATLAS (NS per chunk of 4) · num_heads=8"),
            ("LaCT (chunk = window = 16)", "rlist_lact_mac_wd", "LaCT (chunk = window = 16)"),
            ("ARMT (memory tokens per layer, the preset)", "rlist_armt_long", "ARMT"),
            ("ARMT (memory through the stack, `memory_flow: through_stack`; `runs/rlist_armt_stack`)",
             "rlist_armt_stack", "ARMT, memory through the stack"),
            ("Titans (MAC)", "rlist_lact_mac_wd", "Titans (MAC)")]
    rows = []
    for label, run, row in spec:
        if run is None:
            rows.append(lost(label, 4, row))
            continue
        ts = trials(run, row, RVS if run.startswith("rvs_") else RUNS)
        rows.append([label, seeds_cell(values(ts, "test/accuracy"))] + sizes(ts))
    return table(["model", "test accuracy (seeds 0, 1, 2)", "params", "state (scalars)"], rows)


def mqar_before() -> str:
    """The three memory rows before the weight-decay change."""
    spec = [("Titans (LMM)", "rlist_rest_long"), ("LaCT (chunk = window = 16)", "rlist_long"),
            ("Titans (MAC)", "rlist_long")]
    rows = [[row, seeds_cell(values(trials(run, row), "test/accuracy"))] for row, run in spec]
    return table(["model, before the weight-decay change (`rlist_rest_long`, `rlist_long`)",
                  "test accuracy (seeds 0, 1, 2)"], rows)


def segments() -> str:
    """Accuracy by the query's segment, each seed; the older runs' split came from checkpoints that were not kept."""
    rows = []
    for label, run in (("LaCT", "rlist_long"), ("ARMT (memory tokens per layer)", "rlist_armt_long"),
                       ("Titans (MAC)", "rlist_long")):
        rows.append(lost(label + ", seeds 0 / 1 / 2", 5, f"split computed from `{run}`'s final checkpoints, not kept"))
    spec = [("ARMT (through the stack, `rlist_armt_stack`)", "rlist_armt_stack", "ARMT, memory through the stack"),
            ("LaCT, rerun (`rlist_lact_mac_wd`)", "rlist_lact_mac_wd", "LaCT (chunk = window = 16)"),
            ("Titans (MAC), rerun (`rlist_lact_mac_wd`)", "rlist_lact_mac_wd", "Titans (MAC)")]
    for label, run, row in spec:
        ts = trials(run, row)
        rows.append([label + ", seeds 0 / 1 / 2"] + [each_cell(values(ts, m)) for m in SEGMENTS])
    return table(["model, seed", "segment 1", "2", "3", "4"], rows)


def first_run() -> str:
    """The first, 800-step run and its probes: no folder was kept, so no number is printed."""
    labels = ["Transformer++", "FoX", "Titans (LMM)", "LaCT (chunk = window = 16)", "ARMT", "Titans (MAC)"]
    rows = [lost(m, 2, "`runs/rlist_mqar`") for m in labels]
    rows.append(lost("*SWA, window 16 (calibration)*", 2, "`runs/rlist_swa16`"))
    rows.append(lost("*LaCT, inner lr 0 / 0.01 / 0.1 (probes, seed 0)*", 2,
                     "`runs/rlist_lact_lr0`, `runs/rlist_lact_lr`"))
    return table(["model", "test accuracy, 800 steps (seeds 0, 1, 2)"], rows)


def mac_probes() -> str:
    """The Titans (MAC) probes at 800 steps: they ran from a script that wrote no run folder."""
    labels = ["the preset", "`gate: none` (o = y, memory reads kept)",
              "`gate: none`, `read_tokens: false`: attention over [P ‖ segment] only",
              "the same with `persistent_tokens: 0`",
              "the same with the 4 persistent tokens initialised at std 0.02 instead of 1",
              "the same with `persistent_tokens: 0` and `segment: 64` (one segment: full attention)"]
    return table(["Titans (MAC) variant, 800 steps, seed 0", "test accuracy"],
                 [lost(m, 2, "probe script, no run folder") for m in labels])


# --- ARMT -----------------------------------------------------------------------------------------------------------

def armt_stack() -> str:
    """ARMT through the stack against memory tokens per layer: all queries and the later segments."""
    ts = trials("rlist_armt_stack", "ARMT, memory through the stack")
    rows = [["memory through the stack"] + [seeds_cell(values(ts, m)) for m in ("test/accuracy",) + SEGMENTS[1:]]]
    per = trials("rlist_armt_long", "ARMT")
    rows.append(["memory tokens per layer (`rlist_armt_long`)", seeds_cell(values(per, "test/accuracy"))]
                + [f"{LOST} (`rlist_armt_long`'s checkpoint split, not kept)"] * 3)
    return table(["ARMT, test accuracy", "all queries", "segment 2", "segment 3", "segment 4"], rows)


def armt_floor() -> str:
    """ARMT through the stack with the bounded read (``read_floor: 1``) against the authors' rule."""
    floor = pooled(("rlist_armt_floor", "rlist_armt_floor_s12"), "ARMT, memory through the stack, read floor 1")
    stack = trials("rlist_armt_stack", "ARMT, memory through the stack")
    rows = [[label, seeds_cell(values(ts, "test/accuracy"))] + [each_cell(values(ts, m), ", ") for m in SEGMENTS[1:]]
            for label, ts in (("`read_floor: 1`", floor), ("`read_floor: 0` (the authors' rule)", stack))]
    rows += [[label, each_cell(values(ts, "val/accuracy"), ", "), "", "", ""]
             for label, ts in (("final validation accuracy, `read_floor: 1`", floor),
                               ("final validation accuracy, `read_floor: 0`", stack))]
    return table(["ARMT through the stack, test accuracy", "all queries (seeds 0, 1, 2)", "segment 2", "segment 3",
                  "segment 4"], rows)


# --- Titans (MAC) against titans-pytorch -----------------------------------------------------------------------------

def _mac_ref_runs() -> Dict[int, Dict]:
    data = json.loads(MAC_REF.read_text())
    return {r["seed"]: r for r in data["runs"] if r["name"] == "titans_mac"}


def mac_reference_curve() -> str:
    """Seed 0 of the reference: validation accuracy every 100 steps (its history, every 50 steps, is committed)."""
    hist = _mac_ref_runs()[0]["history"]
    rows = [[str(h["step"]), f"{h['val/accuracy']:.3f}"] for h in hist if h["step"] % 100 == 0]
    return table(["step", "titans-pytorch MAC, seed 0, validation accuracy"], rows)


def mac_reference() -> str:
    """Final validation accuracy by seed: the reference (``bench/results/learning_mac_cpu.json``) and our preset."""
    ref = _mac_ref_runs()
    ours = trials("rlist_lact_mac_wd", "Titans (MAC)")
    old = trials("rlist_long", "Titans (MAC)")
    seeds = sorted(ref)
    rv = [ref[s]["history"][-1]["val/accuracy"] for s in seeds]
    ov, pv = values(ours, "val/accuracy"), values(old, "val/accuracy")
    rows = [[str(s), f"{a:.3f}", f"{b:.3f}", f"{c:.3f} ({d:.3f})"]
            for s, a, b, c, d in zip(seeds, rv, ov, pv, values(old, "test/accuracy"))]
    rows.append(["mean ± std"] + [f"{statistics.mean(v):.3f} ± {statistics.stdev(v):.3f}" for v in (rv, ov, pv)])
    return table(["seed", "titans-pytorch MAC (reference)", "our Titans (MAC) preset (`rlist_lact_mac_wd`)",
                  "our preset before the weight-decay change (`rlist_long`; test in brackets)"], rows)


def niah_armt() -> str:
    """ARMT on S-NIAH, each seed: memory tokens per layer, through the stack, and through the stack with
    ``read_floor: 1``; a trial that failed shows its status."""
    spec = [("memory tokens per layer (`rlist_niah_s0`–`s2`)", NIAH, "ARMT"),
            ("through the stack (`rlist_niah_armt_stack`)", ("rlist_niah_armt_stack",),
             "ARMT, memory through the stack"),
            ("through the stack, `read_floor: 1` (`rlist_niah_armt_floor`, `_s12`)",
             ("rlist_niah_armt_floor", "rlist_niah_armt_floor_s12"), "ARMT, memory through the stack, read floor 1")]
    rows = []
    for label, runs, row in spec:
        got = {}
        for run in runs:
            with open(RUNS / run / "trials.csv", newline="") as f:
                got.update({int(t["seed"]): t for t in csv.DictReader(f) if t["row"] == row})
        cells = []
        for s in (0, 1, 2):
            t = got[s]
            if t["status"] not in FINISHED:
                cells.append(t["message"] or f"{t['status']} at step {t['steps']}")
            else:
                em = float(t["test/exact_match"])
                cells.append(f"{float(t['test/accuracy']):.3f} (exact match {'0' if em == 0 else f'{em:.3f}'})")
        rows.append([label] + cells)
    return table(["ARMT on S-NIAH, test digit accuracy (exact match)", "seed 0", "seed 1", "seed 2"], rows)


# --- S-NIAH ---------------------------------------------------------------------------------------------------------

NIAH = ("rlist_niah_s0", "rlist_niah_s1", "rlist_niah_s2")
NIAH_METRICS = ("test/exact_match", "test/accuracy", "test/len_512/exact_match")


def niah() -> str:
    """S-NIAH over seeds 0, 1, 2: exact match at 256 and 512 bytes, digit accuracy, params, state."""
    spec = [("LaCT (chunk = window = 64)", NIAH, "LaCT (chunk = window = 64)"),
            ("Transformer++", NIAH, "Transformer"), ("ARMT", NIAH, "ARMT"),
            ("FoX (forget bias 6, the preset; `rlist_niah_fox6`, `rlist_niah_fox6_s12`)",
             ("rlist_niah_fox6", "rlist_niah_fox6_s12"), "FoX, forget_bias_init 6"),
            ("FoX (forget bias 3, the preset when this table ran)", NIAH, "FoX"),
            ("Titans (LMM)", NIAH, "Titans (LMM)"), ("Titans (MAC)", NIAH, "Titans (MAC)")]
    rows = []
    for label, runs, row in spec:
        ts = pooled(runs, row)
        rows.append([label] + [seeds_cell(values(ts, m)) for m in NIAH_METRICS] + sizes(ts))
    return table(["model", "test exact match, 256", "test digit accuracy", "exact match, 512", "params", "state"], rows)


def niah_wd() -> str:
    """The S-NIAH rerun after the weight-decay change, seeds 0 and 1, beside the same seeds before it."""
    rows = []
    for row in ("LaCT (chunk = window = 64)", "Titans (LMM)", "Titans (MAC)"):
        new = pooled(("rlist_niah_wd_s0", "rlist_niah_wd_s1"), row)
        old = pooled(NIAH[:2], row)
        rows.append([row] + [f"{each_cell(values(new, m))} ({each_cell(values(old, m))})"
                             for m in ("test/exact_match", "test/accuracy")])
    return table(["model", "test exact match, seeds 0 / 1 (before)", "test digit accuracy, seeds 0 / 1 (before)"],
                 rows)


def fox_bias() -> str:
    """FoX's forget-gate bias 3 against 6 on MQAR and S-NIAH (means over seeds 0, 1, 2)."""
    spec = [("3", pooled(("rlist_rest_long",), "FoX"), pooled(NIAH, "FoX")),
            ("6 (the preset)", trials("rlist_mqar_fox6", "FoX, forget_bias_init 6"),
             pooled(("rlist_niah_fox6", "rlist_niah_fox6_s12"), "FoX, forget_bias_init 6"))]
    rows = []
    for label, mq, nh in spec:
        cells = [seeds_cell(values(mq, "test/accuracy")), seeds_cell(values(nh, "test/accuracy")),
                 seeds_cell(values(nh, "test/exact_match"))]
        rows.append([label] + [c.split(" (")[0] for c in cells] + [f"{LOST} (probe script, no run folder)"])
    return table(["forget bias", "MQAR test accuracy", "S-NIAH test digit accuracy", "S-NIAH exact match",
                  "tiny MQAR, seeds 0 / 1 / 2"], rows)


TABLES = {"reading-list-runs": runs_table, "reading-list-mqar": mqar, "reading-list-mqar-before": mqar_before,
          "reading-list-segments": segments, "reading-list-first-run": first_run,
          "reading-list-mac-probes": mac_probes, "reading-list-armt-stack": armt_stack,
          "reading-list-armt-floor": armt_floor, "reading-list-niah-armt": niah_armt,
          "reading-list-mac-reference-curve": mac_reference_curve,
          "reading-list-mac-reference": mac_reference, "reading-list-niah": niah, "reading-list-niah-wd": niah_wd,
          "reading-list-fox-bias": fox_bias}


if __name__ == "__main__":
    for name in sys.argv[1:] or TABLES:
        print(f"{name}:\n{TABLES[name]()}\n")
