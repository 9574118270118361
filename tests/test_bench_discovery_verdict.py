"""bench/discovery_verdict.py writes the discovery study's verdict and early-stopping experiments from the study's
committed data: the committed experiment files are what it writes today (nothing in them is typed by hand)."""
import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("discovery_verdict", ROOT / "bench" / "discovery_verdict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _written(header: str, exp) -> str:
    return header + yaml.safe_dump(exp, sort_keys=False, width=120, allow_unicode=True)


def test_the_verdict_and_early_stopping_experiments_regenerate_from_the_committed_data():
    b = _bench()
    search, presets = b.DATA / "search" / "data", b.DATA / "presets" / "data"
    assert (ROOT / "experiments" / "discovery_verdict.yaml").read_text() == \
        _written(b.HEADER, b.verdict_experiment(search, presets))
    assert (ROOT / "experiments" / "discovery_early_stopping.yaml").read_text() == \
        _written(b.ES_HEADER, b.early_stopping_experiment(search))
    assert (ROOT / "experiments" / "discovery_suite_verdict.yaml").read_text() == _written(
        b.SUITE_HEADER, b.suite_verdict_experiment(b.DATA / "suite_search" / "data", b.DATA / "suite_presets" / "data"))


def test_the_early_stopping_check_reruns_every_stopped_trial_and_the_winner():
    b = _bench()
    exp = b.early_stopping_experiment(b.DATA / "search" / "data")
    rows = [r for r in b.trials(b.DATA / "search" / "data")]
    winner = b.winner(b.DATA / "search" / "data")["key"]
    import csv
    with open(b.DATA / "search" / "data" / "trials.csv", newline="") as f:
        pruned = {r["key"] for r in csv.DictReader(f) if r["status"] == "pruned"}
    assert set(exp["grid"]["variants"]) == pruned | {f"control {winner}"}
    assert "scheduler" not in exp and "search" not in exp and rows


def _suite_folder(tmp_path, rows):
    """A multi-task run folder: the committed suite search's experiment and ``rows`` as its trials.csv."""
    import csv
    import shutil
    b = _bench()
    shutil.copy(b.DATA / "suite_search_asha" / "data" / "experiment.yaml", tmp_path / "experiment.yaml")
    with open(tmp_path / "trials.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return tmp_path


def test_the_suite_winner_is_the_best_score_over_every_setting(tmp_path):
    import json
    b = _bench()
    params = {"model.layers": ["gated_deltanet"], "train.lr": 0.01, "model.mixers.*.num_heads": 2}
    acc = {"c0": {"mqar": 0.9, "in_context_recall": 0.9, "selective_copying": 0.3},     # mean 0.7
           "c1": {"mqar": 0.5, "in_context_recall": 0.9, "selective_copying": 0.8},     # mean 0.733: the winner
           "c2": {"mqar": 1.0, "in_context_recall": 1.0, "selective_copying": 1.0}}     # pruned on one setting
    rows = [{"key": f"{c}{s}", "candidate": c, "setting": s, "status": "pruned" if (c, s) == ("c2", "mqar")
             else "completed", "params": json.dumps({**params, "train.lr": 0.01 * (i + 1)}), "protocol": "{}",
             "val/accuracy": v, "step_time_s": 0.1}
            for i, (c, by) in enumerate(acc.items()) for s, v in by.items()]
    cid, won, sc = b.suite_winner(_suite_folder(tmp_path, rows))
    assert cid == "c1" and abs(sc - (0.5 + 0.9 + 0.8) / 3) < 1e-12
    assert won == {"model.layers": ["gated_deltanet"], "train.lr": 0.02}     # the budget's size is left to the budget
