"""Searching the part space: a state budget every trial is sized to, combinations of parts that cannot be built
rejected before training (counted, listed, told to the sampler), multi-objective search with a Pareto front, and
the report's account of what mattered."""
import json

import pytest

from atlaslab.registry import ConfigError
from atlaslab.search.admission import Admission, preflight
from atlaslab.search.driver import prepare, run, trial_table
from atlaslab.search.expand import expand_grid
from atlaslab.search.mattered import dominates, marginals, pareto_front
from atlaslab.search.schema import load_experiment
from tests.search.test_search_ray import tiny

MEM = "model.mixers.gated_deltanet.memory."
HEADS = "model.mixers.*.num_heads"


def _budget(state, tolerance=0.2, heads=(1, 2, 4, 8)):
    return {"state": state, "tolerance": tolerance, "size_by": {HEADS: list(heads)}}


def test_budget_sizes_each_trial_to_the_state_nearest_the_budget():
    """d_model 16: a linear memory of H heads of 16/H holds H·(16/H)² = 256/H scalars per layer, plus the
    short-convolution caches; the budget picks the head count whose total state is nearest within the tolerance."""
    node = tiny("budget", grid={"variants": {"GDN": {}, "deep": {MEM + "memory": {"name": "mlp", "depth": 2,
                                                                                   "expansion": 1}}}})
    exp = load_experiment(node=dict(node, budget=_budget(0)))
    sizes = {}
    adm0 = Admission(exp)
    for h in (1, 2, 4, 8):
        for t in expand_grid(load_experiment(node=dict(node, model=dict(node["model"], overrides={
                "d_model": 16, "mixers.*.num_heads": h})))):
            sizes[(t["variant"], h)] = adm0.admit(t)["info"]["state_size"]
    target = sizes[("GDN", 2)]
    exp = load_experiment(node=dict(node, budget=_budget(target, 0.05)))
    adm = Admission(exp)
    admitted = adm.admit(expand_grid(exp)[0])
    assert admitted["info"]["state_size"] == target
    assert admitted["info"]["budget"] == {"state": target, "tolerance": 0.05, "size": {HEADS: 2}}
    assert admitted["params"][HEADS] == 2
    deep = [v for (name, h), v in sizes.items() if name == "deep"]
    if not any(abs(v / target - 1) <= 0.05 for v in deep):
        with pytest.raises(ConfigError, match=r"no size brings the state within ±5% of \d+ \(tried num_heads=1 → "):
            adm.admit(expand_grid(exp)[1])
    # a grid point that fits no size is an error before Ray starts, naming the trial
    with pytest.raises(ConfigError, match=r"trial t000 \(GDN\).*budget.state"):
        prepare(node=dict(node, budget=_budget(10 ** 7, 0.01)))


def test_a_size_key_that_matches_nothing_is_not_built_again(monkeypatch):
    """``?…memory.memory.expansion`` is a no-op for a linear memory: its sizes differ from the head counts' only
    there, so each head count is built once and the other expansions reuse its state (the error still lists every
    size); an MLP memory has the field, so every (heads, expansion) is built and the state follows the expansion."""
    from atlaslab.search import expand
    builds = []
    real = expand.meta_model
    monkeypatch.setattr(expand, "meta_model", lambda cfg: builds.append(cfg) or real(cfg))
    exp_key = "model.?mixers.*.memory.memory.expansion"
    node = tiny("inert", grid={"variants": {"GDN": {}, "deep": {MEM + "memory": {"name": "mlp", "depth": 2,
                                                                                  "expansion": 1}}}})
    budget = {"state": 10 ** 7, "tolerance": 0.01, "size_by": {HEADS: [1, 2], exp_key: [1, 2, 4]}}
    exp = load_experiment(node=dict(node, budget=budget))
    linear, deep = expand_grid(exp)
    with pytest.raises(ConfigError) as err:
        Admission(exp).admit(linear)
    assert len(builds) == 2                                      # one per head count, not six
    tried = str(err.value).split("(tried ", 1)[1]
    assert tried.count("→") == 6                                  # every size is still reported
    states = [int(x.split("→ ")[1].split(",")[0].rstrip(").")) for x in tried.split("num_heads=")[1:]]
    assert states[:3] == [states[0]] * 3 and states[3:] == [states[3]] * 3
    builds.clear()
    with pytest.raises(ConfigError) as err:
        Admission(exp).admit(deep)
    assert len(builds) == 6
    deep_states = [int(x.split("→ ")[1].split(",")[0].rstrip(").")) for x in
                   str(err.value).split("(tried ", 1)[1].split("num_heads=")[1:]]
    assert deep_states[0] < deep_states[1] < deep_states[2]      # the expansion reached the MLP memory


def test_budget_keys_are_checked():
    node = tiny("budget")
    with pytest.raises(ConfigError, match="budget.size_by: a state budget needs at least one model key"):
        load_experiment(node=dict(node, budget={"state": 100}))
    with pytest.raises(ConfigError, match="budget.size_by.train.lr: a budget sizes the model"):
        load_experiment(node=dict(node, budget={"state": 100, "size_by": {"train.lr": [1e-3]}}))
    with pytest.raises(ConfigError, match="also searched or a grid axis"):
        load_experiment(node=dict(node, budget=_budget(100), grid={"axes": {HEADS: [1, 2]}}))
    with pytest.raises(ConfigError, match=r"search.objectives.0: .*'<metric>:min'"):
        load_experiment(node=dict(node, search={"space": {"train.lr": [1e-3]}, "objectives": ["state_size"]}))


PARTS = {
    MEM + "inner_optimizer": [{"name": "gd", "lr": 1.0}, {"name": "implicit_gd", "lr": 1.0}],
    MEM + "attentional_bias.name": ["l2", "dot"],
    MEM + "retention.name": ["decay", "none"],
}


def test_preflight_admits_every_choice_and_rejects_a_misspelt_part():
    """implicit_gd has a closed form only with the l2 bias: (implicit_gd, dot) cannot be built, but each choice can
    in another combination, so the space passes; a part name that is not registered never can, so it fails."""
    exp = load_experiment(node=tiny("parts", search={"sampler": "random", "space": dict(PARTS)}, num_samples=4))
    admitted, rejected = preflight(Admission(exp), seed=0)
    seen = {(t["params"][MEM + "inner_optimizer"]["name"], t["params"][MEM + "attentional_bias.name"])
            for t in admitted}
    assert ("implicit_gd", "dot") not in seen
    assert {o for o, _ in seen} == {"gd", "implicit_gd"} and {b for _, b in seen} == {"l2", "dot"}
    assert all("implicit_gd has a closed form only" in r["reason"] for r in rejected)
    bad = dict(PARTS, **{MEM + "retention.name": ["decay", "decayy"]})
    with pytest.raises(ConfigError, match=r"search.space.model.mixers.gated_deltanet.memory.retention.name: no "
                                          r"combination with .*'decayy'"):
        preflight(Admission(load_experiment(node=tiny("parts", search={"space": bad}))), seed=0)


def test_preflight_tries_both_ends_of_every_range():
    """A range whose low end cannot be built (a window of 0 tokens) fails before Ray starts, naming the key, as the
    corner configs did; both ends of a valid range appear among the admitted configs."""
    win = MEM + "window.size"
    ok = tiny("ends", search={"space": {win: {"type": "int", "low": 1, "high": 4},
                                        "train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}})
    p = prepare(node=ok)
    assert {t["params"][win] for t in p.trials} >= {1, 4}
    assert {t["params"]["train.lr"] for t in p.trials} >= {1e-3, 1e-2}
    bad = tiny("ends", search={"space": {win: {"type": "int", "low": 0, "high": 4}}})
    with pytest.raises(ConfigError, match=r"search.space.model.mixers.gated_deltanet.memory.window.size: no "
                                          r"combination with .*=0 could be trained"):
        prepare(node=bad)


def test_pareto_front_and_marginals():
    assert dominates([0.9, 100], [0.8, 100], ["max", "min"])
    assert not dominates([0.9, 200], [0.8, 100], ["max", "min"])
    assert not dominates([0.9, 100], [0.9, 100], ["max", "min"])
    recs = []
    for i, (acc, state, opt) in enumerate([(0.9, 400, "gd"), (0.8, 100, "gd"), (0.7, 300, "momentum"),
                                           (0.95, 800, "momentum"), (0.6, 100, "gd")]):
        recs.append({"key": f"t{i}", "status": "completed", "metrics": {"val/accuracy": acc},
                     "info": {"state_size": state}, "params": {"train.lr": 1e-3, MEM + "inner_optimizer.name": opt}})
    front = pareto_front(recs, [("val/accuracy", "max"), ("state_size", "min")])
    assert [r["key"] for r in front] == ["t3", "t0", "t1"]
    exp = load_experiment(node=tiny("m", search={"space": {MEM + "inner_optimizer.name": ["gd", "momentum", "muon"],
                                                            "train.lr": [1e-3]}}))
    marg = marginals(exp, recs)[MEM + "inner_optimizer.name"]
    assert [(m["choice"], m["n"]) for m in marg] == [("gd", 3), ("momentum", 2), ("muon", 0)]
    assert marg[0]["mean"] == pytest.approx(0.766666, abs=1e-5) and marg[1]["best"] == 0.95
    # a further objective has its own marginals and importances (here: which optimizer keeps the state small)
    by_state = marginals(exp, recs, "state_size", "min")[MEM + "inner_optimizer.name"]
    assert by_state[0]["mean"] == pytest.approx(200) and by_state[0]["best"] == 100 and by_state[1]["best"] == 300
    from atlaslab.search.mattered import importances, mattered_section
    imp = importances(exp, recs, "state_size", "min")
    assert imp[MEM + "inner_optimizer.name"] >= imp.get("train.lr", 0.0)        # lr has one value: it explains nothing
    multi = load_experiment(node=tiny("m", search={"space": {MEM + "inner_optimizer.name": ["gd", "momentum", "muon"],
                                                              "train.lr": [1e-3]}, "objectives": ["state_size:min"]}))
    text = "\n".join(mattered_section(multi, recs))
    assert "### For state_size (min)" in text and "| inner_optimizer.name | gd | 3 | 200" in text


def test_part_search_on_ray_rejects_sizes_and_reports_the_front(local_ray, tmp_path):
    """A multi-objective search (accuracy up, state down) over parts at a state budget, end to end on Ray: every
    trained trial fits the budget, the draws that cannot be built are rejected before training and listed, none
    crashed, and the report has the candidates, the Pareto front and what mattered."""
    space = dict(PARTS, **{"train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}})
    node = tiny("discover", steps=20, search={"sampler": "random", "seed": 3, "space": space,
                                              "objectives": ["state_size:min", "steps_trained:min"]},
                budget=_budget(500, 0.2, heads=(1, 2, 4)), num_samples=5, max_concurrent=2)
    p = prepare(node=node)
    assert "objectives: val/accuracy (max), state_size (min), steps_trained (min)" in trial_table(p)
    assert "state budget: 500 ± 20%" in trial_table(p)
    summary = run(p, run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    recs = json.loads((tmp_path / "run" / "results.json").read_text())
    assert summary["trials"] == 5 and summary["failed"] == 0
    for r in recs:
        assert abs(r["info"]["state_size"] / 500 - 1) <= 0.2
        assert r["info"]["budget"]["size"][HEADS] in (1, 2, 4)
        assert not (r["params"][MEM + "inner_optimizer"]["name"] == "implicit_gd"
                    and r["params"][MEM + "attentional_bias.name"] == "dot")
        assert r["metrics"]["step_time_s"] > 0
        assert r["metrics"]["steps_trained"] == 20             # no early stop: the whole budget
    rejected = json.loads((tmp_path / "run" / "rejected.json").read_text())["rejected"]
    assert rejected                     # this seed's draws include (implicit_gd, dot)
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"The search drew {5 + len(rejected)} candidates: 5 trained" in report
    for r in rejected:
        assert "implicit_gd has a closed form only" in r["reason"] or "no size brings the state" in r["reason"]
    assert "## Pareto front" in report and "## What mattered" in report
    assert "### For state_size (min)" in report and "### For steps_trained (min)" in report
    assert (tmp_path / "run" / "plots" / "pareto.png").is_file()


def test_interrupted_part_search_resumes_with_its_sampler_and_rejections(local_ray, tmp_path):
    """Ctrl-C after the first trial finished, then `resume`: the searcher comes back from Tune's checkpoint (its
    Optuna study and rejections), the sweep ends with exactly num_samples trials, none trained twice, and the
    rejections drawn before the interruption are still listed."""
    from atlaslab.search.driver import resume
    from tests.search.test_search_ray import InterruptAfterFirstTrial
    node = tiny("resume", steps=30, search={"sampler": "random", "seed": 3, "space": dict(PARTS)}, num_samples=4,
                max_concurrent=1)
    run_dir = tmp_path / "run"
    s1 = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True,
             stop=InterruptAfterFirstTrial(tmp_path / "f", run_dir / "ray" / "tune"))
    assert s1["status"] == "interrupted"
    before = json.loads((run_dir / "rejected.json").read_text())["rejected"] if (
        run_dir / "rejected.json").is_file() else []
    s2 = resume(run_dir, quiet=True)
    assert s2["status"] == "finished" and s2["trials"] == 4 and s2["failed"] == 0
    recs = json.loads((run_dir / "results.json").read_text())
    assert len({r["key"] for r in recs}) == 4
    assert all(r["status"] == "completed" for r in recs)
    after = json.loads((run_dir / "rejected.json").read_text())["rejected"]
    assert after[:len(before)] == before
    numbers = [r["number"] for r in after]
    assert len(set(numbers)) == len(numbers)                 # the restored study did not hand out a number twice


def test_rejected_draws_steer_tpe_away():
    """A rejected draw is told to Optuna as infeasible (a violated constraint), not as failed: TPE ranks it below
    every feasible trial and draws that combination less than a sampler that ignores it (a failed trial teaches TPE
    nothing)."""
    from atlaslab.search.searcher import PartSearcher
    exp = load_experiment(node=tiny("steer", search={"sampler": "tpe", "seed": 0, "space": dict(PARTS)},
                                    num_samples=30))
    searcher = PartSearcher(exp)
    bad = 0
    for i in range(30):
        trial = searcher.suggest(f"t{i}")["trial"]
        searcher.on_trial_complete(f"t{i}", {"val/accuracy": 0.5, "final": 1})
    rejected = searcher.rejected
    assert rejected and all("implicit_gd" in r["reason"] for r in rejected)
    states = [t for t in searcher.study.trials if t.user_attrs.get("atlaslab_rejected")]
    assert len(states) == len(rejected) and all(t.state.name == "COMPLETE" for t in states)
    # draws after TPE's startup trials propose (implicit_gd, dot) less often than the prior's 1 in 4
    late = [r["number"] for r in rejected if r["number"] >= 15]
    draws_late = len([t for t in searcher.study.trials if t.number >= 15])
    bad = len(late) / max(1, draws_late)
    assert bad < 0.25, (len(late), draws_late)


def test_a_trial_over_its_step_cost_bound_or_diverged_is_told_as_infeasible(tmp_path):
    """A trial that ended as over_cost (train.max_step_time_s) is told to Optuna as a rejected draw is: complete,
    with the violated constraint ``over_cost`` = measured / bound − 1, so TPE ranks it below every feasible trial
    (never as a score); the searcher saved mid-search and restored still tells its draws."""
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY

    from atlaslab.search.searcher import DIVERGED_ATTR, OVER_COST_ATTR, PartSearcher
    exp = load_experiment(node=tiny("cost", search={"sampler": "tpe", "seed": 0, "space": dict(PARTS)},
                                    num_samples=4))
    s = PartSearcher(exp)
    for i in range(3):
        s.suggest(f"t{i}")
    s.on_trial_complete("t0", {"val/accuracy": 0.9, "final": 1, "status": "over_cost", "train_step_time_s": 3.0,
                               "max_step_time_s": 1.0})
    s.save(str(tmp_path / "searcher.pkl"))
    restored = PartSearcher(exp)
    restored.restore(str(tmp_path / "searcher.pkl"))
    restored.on_trial_complete("t1", {"val/accuracy": 0.5, "final": 1, "status": "completed"})
    restored.on_trial_complete("t2", {"val/accuracy": float("nan"), "final": 1, "status": "diverged", "failed": 1})
    by_number = {t.number: t for t in restored.study.trials}
    told = [t for t in by_number.values() if t.user_attrs.get(OVER_COST_ATTR) is not None]
    assert len(told) == 1 and told[0].user_attrs[OVER_COST_ATTR] == pytest.approx(2.0)
    assert told[0].state.name == "COMPLETE" and told[0].system_attrs[f"{_CONSTRAINTS_KEY}:over_cost"] == \
        pytest.approx(2.0)
    diverged = [t for t in by_number.values() if t.user_attrs.get(DIVERGED_ATTR)]
    assert len(diverged) == 1 and diverged[0].system_attrs[f"{_CONSTRAINTS_KEY}:diverged"] == 1.0
    scored = [t for t in by_number.values() if t.state.name == "COMPLETE" and t.user_attrs.get(OVER_COST_ATTR) is None
              and not t.user_attrs.get(DIVERGED_ATTR) and not t.user_attrs.get("atlaslab_rejected")]
    assert [t.value for t in scored] == [0.5] and not restored.asked.get(scored[0].number)


def test_enqueued_points_are_drawn_first_and_checked_naming_the_key():
    """search.enqueue: the listed points are the sampler's first draws, in order (keys left out are sampled); a point
    naming a key outside the space, a value that is not a choice, a number out of range or a conditional key whose
    condition the point does not meet is a ConfigError naming the point and key."""
    from atlaslab.search.searcher import PartSearcher
    space = {MEM + "retention.name": ["decay", "none"],
             MEM + "retention.placement": {"type": "categorical", "choices": ["before_step", "after_step"],
                                           "when": {MEM + "retention.name": "decay"}},
             MEM + "memory": [{"name": "linear"}, {"name": "mlp", "depth": 2, "expansion": 1}],
             "train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}
    points = [{MEM + "retention.name": "none", MEM + "memory": {"name": "mlp", "depth": 2, "expansion": 1},
               "train.lr": 2e-3},
              {MEM + "retention.name": "decay", MEM + "retention.placement": "after_step"}]
    exp = load_experiment(node=tiny("enq", search={"sampler": "tpe", "seed": 0, "space": space, "enqueue": points},
                                    num_samples=4))
    searcher = PartSearcher(exp)
    first, second = (searcher.suggest(f"t{i}")["trial"]["params"] for i in range(2))
    assert first == points[0]
    assert {k: second[k] for k in points[1]} == points[1] and MEM + "memory" in second and "train.lr" in second
    bad = [({"train.steps": 3}, r"search.enqueue.0.train.steps: not a parameter of search.space"),
           ({MEM + "retention.name": "kl"}, r"search.enqueue.0.model.*retention.name: 'kl' is not a choice.*decay"),
           ({"train.lr": 0.5}, r"search.enqueue.0.train.lr: a number in \[0.001, 0.01\]"),
           ({MEM + "retention.name": "none", MEM + "retention.placement": "before_step"},
            r"search.enqueue.0.model.*retention.placement: sampled only when .*retention.name is one of \['decay'\]"),
           ({}, r"search.enqueue.0: an enqueued point is a non-empty mapping")]
    for point, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_experiment(node=tiny("enq", search={"space": space, "enqueue": [point]}, num_samples=2))


@pytest.mark.slow     # the rejection logic itself is tested without Ray (test_rejected_draws_steer_tpe_away)
def test_a_search_that_stops_drawing_has_finished(local_ray, tmp_path):
    """After search.max_rejections rejected draws in a row the searcher stops drawing: the sweep ends with the
    trials it has, as finished (not interrupted), and the report says why it stopped."""
    space = {MEM + "inner_optimizer": PARTS[MEM + "inner_optimizer"],
             MEM + "attentional_bias.name": ["l2", "dot"]}
    node = tiny("stops", steps=10, search={"sampler": "random", "seed": 0, "space": space, "max_rejections": 1},
                num_samples=12, max_concurrent=1)
    summary = run(prepare(node=node), run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    rej = json.loads((tmp_path / "run" / "rejected.json").read_text())
    assert rej["stopped"].startswith("1 draws in a row were rejected")
    assert summary["status"] == "finished" and 0 < summary["trials"] < 12 and summary["unfinished"] == 0
    assert "The search stopped early: 1 draws in a row were rejected" in (tmp_path / "run" / "report.md").read_text()
