"""docs/gen_seed_table.py: one table over the seeds of several run folders' trials.csv."""
import csv
import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
spec = importlib.util.spec_from_file_location("gen_seed_table", DOCS / "gen_seed_table.py")
gst = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gst)

FIELDS = ["key", "row", "seed", "status", "num_parameters", "state_size", "test/accuracy"]


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))
    return str(path)


def test_rows_pool_seeds_across_files_and_skip_failed_trials(tmp_path):
    a = _csv(tmp_path / "a.csv", [("t000", "B", 1, "completed", 2000, 500, 0.5),
                                  ("t001", "A", 1, "early_stopped", 1000, 100, 0.9)])
    b = _csv(tmp_path / "b.csv", [("t000", "B", 0, "completed", 2000, 500, 0.7),
                                  ("t001", "A", 0, "failed", 1000, 100, ""),
                                  ("t002", "A", 2, "completed", 1000, 100, 1.0)])
    md = gst.table(gst.read_trials([a, b]), ["test/accuracy"]).splitlines()
    assert md[0] == "| model | test/accuracy | params | state | runs |"
    assert md[2] == "| B | 0.600 ± 0.141 (0.700, 0.500) | 2k | 0.5k | 2/2 |"      # seed order, sample std
    assert md[3] == "| A | 0.950 ± 0.071 (0.900, 1.000) | 1k | 0.1k | 2/3 |"
    one = gst.table(gst.read_trials([a]), ["test/accuracy", "test/missing"]).splitlines()
    assert one[2] == "| B | 0.500 | — | 2k | 0.5k | 1/1 |"
