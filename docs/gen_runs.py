"""The results tables of whole experiment runs, from the run data committed under ``docs/results/<study>/data/``
(and the tutorials' runs, under ``docs/tutorials/<name>/data/``).

    python docs/gen_runs.py quickstart          # print one table (the names are the keys of TABLES)
    python docs/gen_runs.py --plots             # redraw the pages' figures of these runs (PLOTS)
    python docs/gen_runs.py --lm-sizes          # rebuild docs/results/lm-table2/sizes.json (meta device)
    python docs/gen_runs.py --lm-geometry       # rebuild docs/results/lm-table2/geometry.json (meta device)

A study's ``data/`` folder is what ``atlaslab run`` wrote into its run folder, less the checkpoints, Tune's
folder and MLflow's store: ``experiment.yaml`` (the experiment after its command-line overrides), ``trials.csv``
(each trial's final metrics), ``curves.csv`` (each trial's learning curve, :mod:`atlaslab.search.curves`),
``report.csv`` and ``state.json`` (wall time). A table row is an experiment row (variant × axis values); a value is
the mean over the row's finished seeds, with the sample std when there are several. "steps to X" is the first
evaluation at which the experiment's metric reached ``report.steps_to`` (the run report's rule), averaged over the
seeds that reached it; "k/n seeds" says how many did when not all of them. Parameters and state are the validated
models' counts. ``report.averages`` columns (ATLAS Table 2's Avg) are each trial's mean of their metrics, averaged
over seeds, and ``report.labels`` names the columns, as in the run's own report.

:data:`TABLES` is read by ``docs/gen_tables.py``, which writes each table into the pages' ``<!-- generated: NAME -->``
blocks.
"""
from __future__ import annotations

import contextlib
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

import yaml

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from atlaslab.search.curves import first_step, read_curves  # noqa: E402
from atlaslab.search.formatting import human_count  # noqa: E402

RESULTS = DOCS / "results"
FINISHED = ("completed", "early_stopped")


class RunData:
    """One or more committed runs of the same experiment (e.g. ``seeds=[0]`` and ``seeds=[1,2]`` run apart): the
    first folder's experiment, every folder's trials and curves. ``rows`` maps a row label to its trials (csv
    records, first-seen order, a (row, seed) taken from the first folder that has it); a trial's curve is
    ``curves[(folder, key)]``."""

    def __init__(self, *folders: Path):
        self.folders = [Path(f) for f in folders]
        self.exp = yaml.safe_load((self.folders[0] / "experiment.yaml").read_text())
        self.trials: List[Dict[str, str]] = []
        self.curves: Dict = {}
        seen = set()
        for folder in self.folders:
            with open(folder / "trials.csv", newline="") as f:
                for t in csv.DictReader(f):
                    if (t["row"], t["seed"]) not in seen:
                        seen.add((t["row"], t["seed"]))
                        self.trials.append({**t, "folder": str(folder)})
            if (folder / "curves.csv").is_file():
                self.curves.update({(str(folder), k): c for k, c in read_curves(folder / "curves.csv").items()})
        self.rows: Dict[str, List[Dict[str, str]]] = {}
        for t in self.trials:
            self.rows.setdefault(t["row"], []).append(t)

    def finished(self, row: str) -> List[Dict[str, str]]:
        return sorted((t for t in self.rows[row] if t["status"] in FINISHED), key=lambda t: int(t["seed"]))

    def value(self, trial: Mapping[str, str], metric: str) -> Optional[float]:
        """A trial's final ``metric``; an ``report.averages`` name is the mean of its metrics."""
        avg = ((self.exp.get("report") or {}).get("averages") or {}).get(metric)
        if avg:
            vals = [self.value(trial, m) for m in avg]
            return None if None in vals else sum(vals) / len(vals)
        v = trial.get(metric)
        return float(v) if v not in (None, "") else None

    def steps_to(self, trial: Mapping[str, str], threshold: float) -> Optional[int]:
        return first_step(self.curves.get((trial["folder"], trial["key"]), []), self.exp.get("metric", "val/accuracy"), threshold,
                          self.exp.get("mode", "max"))


def mean_std(vals: Sequence[float]):
    """(mean, sample std or None for one value)."""
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def fmt(vals: Sequence[float], digits: int) -> str:
    if not vals:
        return "—"
    mu, sd = mean_std(vals)
    return f"{mu:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def fmt_steps(steps: Sequence[Optional[int]]) -> str:
    """Mean ± std of the seeds that reached the threshold, with "k/n seeds" when not all did."""
    got = [s for s in steps if s is not None]
    n = len(steps)
    if not got:
        return "—" + (f" (0/{n} seeds)" if n > 1 else "")
    text = fmt(got, 0)
    return text + (f" ({len(got)}/{n} seeds)" if len(got) < n else "")


def run_table(folders: Sequence[Path], metrics: Sequence[str] = (), digits: int = 3, steps: bool = True,
              extra: Mapping[str, str] = None) -> str:
    """The Markdown table of a committed run: variant, the report's metrics (labelled), the ``extra`` metrics
    (name → label), steps to the threshold, params, state. The baseline row (``grid.baseline``, else the first; with
    axes, the baseline variant's row at each axis value, as the run report marks them) is marked "(baseline)"."""
    d = RunData(*([folders] if isinstance(folders, (str, Path)) else folders))
    rep = d.exp.get("report") or {}
    labels = {**(rep.get("labels") or {}), **(extra or {})}
    metrics = (list(metrics or rep.get("metrics") or [d.exp["metric"]]) + list((rep.get("averages") or {}))
               + list(extra or {}))
    threshold = rep.get("steps_to") if steps else None
    baseline = (d.exp.get("grid") or {}).get("baseline") or next(iter(d.rows))
    head = ["variant"] + [labels.get(m, m) for m in metrics]
    head += [f"steps to {threshold:g}"] if threshold is not None else []
    head += ["params", "state"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in d.rows:
        done = d.finished(row)
        base = row == baseline or row.startswith(f"{baseline} · ")          # the baseline variant at each axis value
        cells = [row + (" (baseline)" if base else "")]
        for m in metrics:
            cells.append(fmt([v for v in (d.value(t, m) for t in done) if v is not None], digits))
        if threshold is not None:
            cells.append(fmt_steps([d.steps_to(t, threshold) for t in done]))
        first = d.rows[row][0]
        cells += [human_count(first["num_parameters"]), human_count(first["state_size"])]
        if len(done) < len(d.rows[row]):
            cells[0] += f" ({len(done)}/{len(d.rows[row])} finished)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quickstart() -> str:
    """README and docs/results.md: the quickstart, seed 0."""
    return run_table(RESULTS / "quickstart" / "data")


def table6_cpu() -> str:
    """docs/results/table6-cpu.md: the quickstart's grid over seeds 0, 1, 2 (seed 0 is the quickstart's own run,
    seeds 1 and 2 the run ``atlaslab run experiments/quickstart.yaml 'seeds=[1,2]'``)."""
    return run_table([RESULTS / "quickstart" / "data", RESULTS / "table6-cpu" / "data"])


def lm_table2_cpu() -> str:
    """docs/results/lm-table2.md: the CPU-sized Table 2 run, with the final validation loss (no steps column: the
    metric is a loss)."""
    return run_table(RESULTS / "lm-table2" / "data", steps=False, extra={"val/loss": "val loss"})


TUTORIALS = DOCS / "tutorials"


def tutorial_ablation_grid() -> str:
    """docs/tutorials/ablation-grid.md: the committed run of ``bash docs/tutorials/ablation-grid/run.sh``."""
    return run_table(TUTORIALS / "ablation-grid" / "data")


def tutorial_own_retention() -> str:
    """docs/tutorials/own-retention.md: the committed run of ``bash docs/tutorials/own-retention/run.sh``."""
    return run_table(TUTORIALS / "own-retention" / "data")


def search_trials(folder: Path) -> str:
    """The ``## Trials (best first)`` table of a committed search run and its "Steps trained in total" line, drawn by
    the run report's own function (:func:`atlaslab.search.tables.search_section`) from ``trials.csv``: one row per
    trial, its sampled parameters, the report's metrics, the steps it trained, its status, params and state."""
    from atlaslab.search.aggregate import ranked_trials
    from atlaslab.search.schema import load_experiment
    from atlaslab.search.tables import search_section
    d = RunData(folder)
    exp = load_experiment(node=d.exp)
    recs = []
    for t in d.trials:
        metrics = {k: float(v) for k, v in t.items() if "/" in k and v not in ("", None)}
        metrics["step"] = int(t["steps"]) if t.get("steps") else None
        recs.append({"key": t["key"], "params": json.loads(t.get("params") or "{}"), "metrics": metrics,
                     "status": t["status"], "failed": t["status"] not in FINISHED + ("pruned",),
                     "train": {"steps": d.exp["train"]["steps"]},
                     "info": {"num_parameters": int(t["num_parameters"]), "state_size": int(t["state_size"])}})
    lines = search_section(exp, recs, ranked_trials(exp, recs), list(exp.report.metrics or [exp.metric]))
    return "\n".join(lines[2:]).strip("\n")


def tutorial_optuna_asha() -> str:
    """docs/tutorials/optuna-asha.md: the committed run of ``bash docs/tutorials/optuna-asha/run.sh``."""
    return search_trials(TUTORIALS / "optuna-asha" / "data")


def quickstart_machines() -> str:
    """README and docs/results.md: quickstart trials retrained by ``bench/quickstart_repro.py`` with other CPU
    kernels or thread counts (``docs/results/quickstart/data/machines.jsonl``, one JSON line per training)."""
    lines = ["| variant | CPU kernels | threads | test/accuracy | test/len_32/accuracy | train loss at step 10 |",
             "|---|---|---|---|---|---|"]
    with open(RESULTS / "quickstart" / "data" / "machines.jsonl") as f:
        for rec in map(json.loads, filter(str.strip, f)):
            kernels = rec["capability"] + (f" (MKL {rec['mkl_instructions']})" if rec.get("mkl_instructions") else "")
            lines.append(f"| {rec['row']} | {kernels} | {rec['threads']} | {rec['test/accuracy']:.3f} | "
                         f"{rec['test/len_32/accuracy']:.3f} | {rec['loss']['10']:.10f} |")
    return "\n".join(lines)


#: ATLAS Table 2's rows as the paper prints them (copied by hand once, the only typed numbers behind a table here)
PAPER_TABLE2 = RESULTS / "lm-table2" / "paper_table2.csv"
PAPER_COLUMNS = {"model": "model", "wiki_ppl": "Wiki ppl", "lmb_ppl": "LMB ppl", "lmb_acc": "LMB acc", "piqa": "PIQA",
                 "hella": "Hella", "wino": "Wino", "arc_e": "ARC-e", "arc_c": "ARC-c", "siqa": "SIQA", "boolq": "BoolQ",
                 "avg": "Avg"}
#: the eight accuracy columns whose mean is the paper's Avg
PAPER_ACCURACIES = ("lmb_acc", "piqa", "hella", "wino", "arc_e", "arc_c", "siqa", "boolq")


def paper_rows(block: str) -> List[Dict[str, str]]:
    """The paper's rows of one size block ("760M" or "1.3B"), values as printed (strings, so 50.1 stays 50.1)."""
    with open(PAPER_TABLE2, newline="") as f:
        return [r for r in csv.DictReader(f) if r["block"] == block]


def paper_table(block: str) -> str:
    lines = ["| " + " | ".join(PAPER_COLUMNS.values()) + " |", "|" + "---|" * len(PAPER_COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in PAPER_COLUMNS) + " |" for r in paper_rows(block)]
    return "\n".join(lines)


#: the GPU protocol's model sizes, as ``atlaslab run experiments/lm_table2.yaml … --dry-run`` builds them (meta device)
LM_SIZES = RESULTS / "lm-table2" / "sizes.json"
LM_FILE = ROOT / "experiments" / "lm_table2.yaml"


@contextlib.contextmanager
def lm_site() -> Iterator[List[str]]:
    """The overrides that point ``experiments/lm_table2.yaml``'s two site paths at stand-ins (a jsonl shard and a
    32,000-id word-level ``tokenizer.json``, written to a temporary folder): the sizes do not depend on the data."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(32000 - 2)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(root / "tokenizer.json"))
        (root / "shard.jsonl").write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n" for i in range(50)))
        yield ["task.path=json", f"task.data_files={root / 'shard.jsonl'}",
               f"task.tokenizer.path={root / 'tokenizer.json'}"]


def measure_lm_sizes(overrides: Sequence[str] = ()) -> Dict[str, Dict[str, int]]:
    """Row → parameters and recurrent-state scalars (one sequence at the file's 4,096 tokens) of every trial of
    ``experiments/lm_table2.yaml``, validated with its two site paths pointed at stand-ins (:func:`lm_site`)."""
    from atlaslab.search.driver import prepare
    with lm_site() as site:
        trials = prepare(str(LM_FILE), site + list(overrides)).trials
    return {t["row"]: {"num_parameters": int(t["info"]["num_parameters"]), "state_size": int(t["info"]["state_size"])}
            for t in trials}


def write_lm_sizes() -> Path:
    """``python docs/gen_runs.py --lm-sizes``: rebuild the file's 16 models at full size and write :data:`LM_SIZES`."""
    rows = measure_lm_sizes()
    LM_SIZES.write_text(json.dumps({"file": "experiments/lm_table2.yaml", "command": "python docs/gen_runs.py --lm-sizes",
                                    "rows": rows}, indent=1) + "\n")
    return LM_SIZES


#: docs/concepts/memory.md's LM-scale geometry table: the file's Atlas and DeepTransformers rows at the file's width
#: (24 blocks, d_model 1536, 16 heads) with other key widths and memory settings, built on the meta device
LM_GEOMETRY = RESULTS / "lm-table2" / "geometry.json"
#: the two rows of the table, and their presets
GEOMETRY_ROWS = {"Atlas": "atlas", "DeepTransformers": "deeptransformer"}
#: geometry label → the grid-variant settings over each row's preset (no ``head_dim``: d_model / heads = 96)
GEOMETRIES = {
    "keys 96, `hidden_from: input` (4 × 4,753)": {"model.mixers.*.memory.memory.hidden_from": "input"},
    "keys 96, `hidden_from: output`": {},
    "keys 96, `hidden_from: output`, `init: shared`": {"model.mixers.*.memory.memory.init": "shared"},
    "keys 32, values 96 (`head_dim: 32`)": {"model.mixers.*.head_dim": 32},
    "keys 16, values 96 (`head_dim: 16`, the Table 2 file)": {"model.mixers.*.head_dim": 16},
}


def measure_lm_geometry(overrides: Sequence[str] = ()) -> Dict[str, Dict[str, Dict[str, int]]]:
    """Geometry → row → parameters, recurrent-state scalars (one 4,096-token sequence) and the learned initial memory
    (the memories' ``init_*`` parameters) of ``experiments/lm_table2.yaml``'s Atlas and DeepTransformers rows, with
    the file's grid replaced by these two rows under each of :data:`GEOMETRIES`; every model is built on the meta
    device (no memory allocated)."""
    import yaml as _yaml

    from atlaslab.search.driver import prepare
    from atlaslab.search.expand import meta_model, model_config
    node = _yaml.safe_load(LM_FILE.read_text())
    out: Dict[str, Dict[str, Dict[str, int]]] = {}
    with lm_site() as site:
        for label, settings in GEOMETRIES.items():
            node["grid"] = {"variants": {row: {"model.preset": preset, **settings}
                                         for row, preset in GEOMETRY_ROWS.items()}}
            out[label] = {}
            for t in prepare(node=node, overrides=site + list(overrides)).trials:
                model = meta_model(model_config(t["config"]["model"], 32000))
                init = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("init_"))
                out[label][t["row"]] = {"num_parameters": int(t["info"]["num_parameters"]),
                                        "state_size": int(t["info"]["state_size"]), "initial_memory": int(init)}
    return out


def write_lm_geometry() -> Path:
    """``python docs/gen_runs.py --lm-geometry``: build the geometries at full size and write :data:`LM_GEOMETRY`."""
    LM_GEOMETRY.write_text(json.dumps({"file": "experiments/lm_table2.yaml",
                                       "command": "python docs/gen_runs.py --lm-geometry",
                                       "geometries": GEOMETRIES, "rows": measure_lm_geometry()}, indent=1) + "\n")
    return LM_GEOMETRY


def lm_geometry() -> str:
    """docs/concepts/memory.md: Atlas's and DeepTransformers' size under each geometry (:data:`LM_GEOMETRY`)."""
    rows = json.loads(LM_GEOMETRY.read_text())["rows"]
    lines = ["| geometry at 760M width, 24 blocks | Atlas parameters | Atlas fast weights per sequence "
             "| DeepTransformers parameters | DeepTransformers fast weights per sequence |", "|---|---|---|---|---|"]
    for label, r in rows.items():
        a, d = r["Atlas"], r["DeepTransformers"]
        lines.append(f"| {label} | {human_count(a['num_parameters'])} ({human_count(a['initial_memory'])} of initial "
                     f"memory) | {human_count(a['state_size'])} | {human_count(d['num_parameters'])} "
                     f"({human_count(d['initial_memory'])}) | {human_count(d['state_size'])} |")
    return "\n".join(lines)


def lm_table2_sizes() -> str:
    """docs/results/lm-table2.md: each row's parameters and state at the 760M width, two rows to a line."""
    rows = [(r, human_count(s["num_parameters"]), human_count(s["state_size"]))
            for r, s in json.loads(LM_SIZES.read_text())["rows"].items()]
    half = (len(rows) + 1) // 2
    right = rows[half:] + [("", "", "")] * (2 * half - len(rows))
    lines = ["| row | params | state | row | params | state |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(a + b) + " |" for a, b in zip(rows[:half], right)]
    return "\n".join(lines)


def records(d: RunData) -> List[Dict]:
    """The run's trials as the run report's records (final metrics, learning curve, sizes), for its plots."""
    out = []
    for t in d.trials:
        curve = d.curves.get((t["folder"], t["key"]), [])
        metrics = {k: float(v) for k, v in t.items() if "/" in k and v not in ("", None)}
        metrics["step"] = float(t["steps"]) if t.get("steps") else None
        out.append({"key": f"{t['folder']}:{t['key']}", "row": t["row"], "setting": t.get("setting"),
                    "variant": curve[0]["variant"] if curve else t["row"], "label": t["row"],
                    "seed": int(t["seed"]), "protocol": json.loads(t.get("protocol") or "{}"), "status": t["status"],
                    "failed": t["status"] not in FINISHED, "metrics": metrics,
                    "history": [{k: v for k, v in h.items() if k not in ("variant", "row", "seed")} for h in curve],
                    "info": {"num_parameters": int(t["num_parameters"]), "state_size": int(t["state_size"])}})
    return out


def plots(folders: Sequence[Path], out: Path, curve_metric: str = None) -> List[Path]:
    """The run report's bar chart of its first metric, its learning curves and its length plot, drawn with the
    report's own functions from the committed data, into ``out``."""
    from atlaslab.search.aggregate import aggregate
    from atlaslab.search.plots import plot_bars, plot_curves, plot_lengths
    from atlaslab.search.schema import load_experiment
    d = RunData(*folders)
    exp = load_experiment(node=d.exp)
    recs = records(d)
    rows = aggregate(exp, recs)
    first = (exp.report.metrics or [exp.metric])[0]
    figs = [plot_bars(rows, first, out / f"bar_{first.replace('/', '_')}.png", f"{exp.name}: {first}"),
            plot_curves(rows, recs, curve_metric or exp.report.curve_metric or exp.metric, out / "curves.png"),
            plot_lengths(rows, exp.report.length_metric, out / "length.png")]
    return [f for f in figs if f]


#: the figures of the pages: folder of the PNGs → the committed runs they are drawn from
PLOTS = {"lm-table2": ([RESULTS / "lm-table2" / "data"], "val/loss"),
         "table6-cpu": ([RESULTS / "quickstart" / "data", RESULTS / "table6-cpu" / "data"], None)}


TABLES = {"quickstart": quickstart, "quickstart-machines": quickstart_machines, "lm-table2-cpu": lm_table2_cpu,
          "table6-cpu": table6_cpu, "lm-table2-paper-760m": lambda: paper_table("760M"),
          "lm-table2-paper-1.3b": lambda: paper_table("1.3B"), "lm-table2-sizes": lm_table2_sizes,
          "lm-geometry": lm_geometry, "tutorial-ablation-grid": tutorial_ablation_grid,
          "tutorial-own-retention": tutorial_own_retention, "tutorial-optuna-asha": tutorial_optuna_asha}


if __name__ == "__main__":
    if sys.argv[1:] == ["--lm-sizes"]:
        print(f"wrote {write_lm_sizes().relative_to(ROOT)}")
    elif sys.argv[1:] == ["--lm-geometry"]:
        print(f"wrote {write_lm_geometry().relative_to(ROOT)}")
    elif sys.argv[1:] == ["--plots"]:
        for name, (folders, metric) in PLOTS.items():
            for fig in plots(folders, RESULTS / name, metric):
                print(f"wrote {fig.relative_to(ROOT)}")
    else:
        print(TABLES[sys.argv[1]]())
