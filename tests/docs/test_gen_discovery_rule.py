"""The discovery verdict rule (docs/gen_discovery.py: verdict_line): three outcomes, the reference must have learned
on every held-out seed, and the step criterion counts as well as the margin."""
from tests.scripts import load_script


def _gen():
    return load_script("docs/gen_discovery.py")


def _rows(found, preset, found_steps=(None,) * 3, preset_steps=(None,) * 3):
    return {"found": {s: {"acc": a, "steps": n} for s, a, n in zip((1, 2, 3), found, found_steps)},
            "P": {s: {"acc": a, "steps": n} for s, a, n in zip((1, 2, 3), preset, preset_steps)}}


def test_a_reference_that_failed_on_one_seed_gives_no_verdict_even_with_a_mean_above_the_bar():
    g = _gen()
    line = g.verdict_line(_rows([0.99, 0.99, 0.99], [0.9, 0.95, 0.4]), "found", [1, 2, 3])   # mean 0.75
    assert line.startswith("**Verdict: no verdict**") and "seed 3" in line


def test_met_by_margin_by_steps_and_not_met():
    g = _gen()
    assert g.verdict_line(_rows([0.9, 0.9, 0.9], [0.8, 0.84, 0.6]), "found", [1, 2, 3]).startswith("**Verdict: met**")
    by_steps = _rows([0.99, 0.99, 0.99], [0.98, 0.98, 0.98], (100, 100, 150), (150, 200, 225))
    assert "in ≤ 2/3" in g.verdict_line(by_steps, "found", [1, 2, 3]).split(";")[0]
    slow = _rows([0.99, 0.99, 0.99], [0.98, 0.98, 0.98], (100, 150, 150), (150, 200, 225))     # 150 > 2/3 * 200
    assert g.verdict_line(slow, "found", [1, 2, 3]).startswith("**Verdict: not met**")
    missing = _rows([0.99, 0.99, 0.99], [0.98, 0.98, 0.98], (100, 100, None), (150, 200, 225))
    assert g.verdict_line(missing, "found", [1, 2, 3]).startswith("**Verdict: not met**")
