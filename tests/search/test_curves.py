"""``curves.csv``: a run folder's learning curves, written from the records' histories and read back."""
from atlaslab.search.curves import first_step, first_step_of_mean, read_curves, write_curves


def _records():
    hist = [{"step": 10, "val/accuracy": 0.25, "train/loss": 2.0, "config/train/lr": 0.01}, {"step": 20, "train/loss": 1.5},
            {"step": 30, "val/accuracy": 0.91, "train/loss": float("nan")}, {"step": 40, "val/accuracy": 0.95}]
    return [{"key": "t000", "variant": "A", "row": "A", "seed": 0, "history": hist},
            {"key": "t001", "variant": "B", "row": "B · h=2", "seed": 1, "history": [{"step": 5}]},
            {"key": "t002", "variant": "B", "row": "B · h=2", "seed": 2, "history": []}]


def test_curves_round_trip_and_first_step(tmp_path):
    path = write_curves(tmp_path, _records())
    text = path.read_text().splitlines()
    assert text[0] == "key,variant,row,seed,step,train/loss,val/accuracy"
    assert len(text) == 5                   # t000's four logged steps; a step with no metric is left out
    curves = read_curves(path)
    assert list(curves) == ["t000"]
    c = curves["t000"]
    assert [h["step"] for h in c] == [10, 20, 30, 40] and c[0]["seed"] == 0 and c[0]["row"] == "A"
    assert "train/loss" not in c[2] and c[2]["val/accuracy"] == 0.91      # NaN is written as an empty cell
    assert "val/accuracy" not in c[1]
    assert first_step(c, "val/accuracy", 0.9) == 30 and first_step(c, "val/accuracy", 0.99) is None
    assert first_step(c, "train/loss", 1.6, mode="min") == 20
    assert write_curves(tmp_path, _records()).read_text().splitlines() == text     # same records, same file


def test_first_step_of_mean_holds_an_ended_curve_at_its_last_value():
    early = [{"step": 25, "val/accuracy": 0.5}, {"step": 50, "val/accuracy": 0.99}]       # early-stopped at 50
    slow = [{"step": 25, "val/accuracy": 0.2}, {"step": 50, "val/accuracy": 0.7}, {"step": 75, "val/accuracy": 0.8},
            {"step": 100, "val/accuracy": 0.85}]
    assert first_step_of_mean([early, slow], "val/accuracy", 0.9) == 100           # at 75: (0.99 + 0.8) / 2 < 0.9
    assert first_step_of_mean([early, slow], "val/accuracy", 0.89) == 75
    assert first_step_of_mean([early, slow], "val/accuracy", 0.84) == 50
    assert first_step_of_mean([early, slow], "val/accuracy", 0.95) is None
    late = [{"step": 50, "val/accuracy": 1.0}]                                       # nothing logged at 25: counts 0
    assert first_step_of_mean([early, late], "val/accuracy", 0.75) == 50
    assert first_step_of_mean([early, []], "val/accuracy", 0.1) is None             # a setting with no curve
    assert first_step_of_mean([], "val/accuracy", 0.1) is None
