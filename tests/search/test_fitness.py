"""A fitness of several tasks: each search draw is one candidate trained on every task setting, told to Optuna as one
score; early stopping compares trials of one setting only; the report ranks candidates by the score."""
import json
import types

import pytest

from atlaslab.registry import ConfigError
from atlaslab.search.fitness import candidates, combine_objective, score
from atlaslab.search.schema import load_experiment
from tests.search.test_search_ray import tiny

MEM = "model.mixers.gated_deltanet.memory."
HEADS = "model.mixers.*.num_heads"
#: two tiny settings: MQAR and MAD's in-context recall (a 16-token vocabulary, 16 tokens)
TASKS = {"mqar": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 32},
         "recall": {"name": "in_context_recall", "vocab_size": 16, "seq_len": 16, "num_train_examples": 256,
                    "eval_examples": 32}}


def suite(name="suite", steps=30, search=None, **extra):
    node = tiny(name, steps=steps, **extra)
    node.pop("task")
    node["tasks"] = json.loads(json.dumps(TASKS))
    node["search"] = search or {"sampler": "random", "seed": 0,
                                "space": {"train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
                                          MEM + "retention.name": ["decay", "none"]}}
    return node


def test_score_is_validated_once_naming_the_field():
    with pytest.raises(ConfigError, match=r"search.score.combine: bad value 'median'.*mean, worst"):
        load_experiment(node=suite(search={"space": {"train.lr": [1e-3]}, "score": {"combine": "median"}}))
    with pytest.raises(ConfigError, match=r"search.score.weights.copy: no setting 'copy' in tasks.*mqar, recall"):
        load_experiment(node=suite(search={"space": {"train.lr": [1e-3]}, "score": {"weights": {"copy": 1.0}}}))
    with pytest.raises(ConfigError, match=r"search.score.weights.mqar: a weight is a positive number"):
        load_experiment(node=suite(search={"space": {"train.lr": [1e-3]}, "score": {"weights": {"mqar": 0}}}))
    with pytest.raises(ConfigError, match=r"search.score.weights: weights apply to combine: mean"):
        load_experiment(node=suite(search={"space": {"train.lr": [1e-3]},
                                           "score": {"combine": "worst", "weights": {"mqar": 2}}}))


def test_score_and_the_other_objectives_combine_over_the_settings():
    exp = load_experiment(node=suite())
    assert score(exp, {"mqar": 0.8, "recall": 0.4}) == pytest.approx(0.6)
    assert score(exp, {"mqar": 0.8, "recall": float("nan")}) is None
    assert score(exp, {"mqar": 0.8}) is None
    w = load_experiment(node=suite(search={"space": {"train.lr": [1e-3]}, "score": {"weights": {"mqar": 3}}}))
    assert score(w, {"mqar": 0.8, "recall": 0.4}) == pytest.approx((3 * 0.8 + 0.4) / 4)
    worst = load_experiment(node=suite(search={"space": {"train.lr": [1e-3]}, "score": {"combine": "worst"}}))
    assert score(worst, {"mqar": 0.8, "recall": 0.4}) == 0.4
    assert combine_objective(exp, "step_time_s", {"mqar": 0.01, "recall": 0.03}, "min") == pytest.approx(0.02)
    assert combine_objective(exp, "state_size", {"mqar": 500, "recall": 700}, "min") == 700
    assert combine_objective(exp, "steps_trained", {"mqar": 250, "recall": 1000}, "min") == pytest.approx(625)


def _fake_result(acc, final=True, state=None):
    r = {"val/accuracy": acc, "step": 30, "step_time_s": 0.01}
    if final:
        r["final"] = 1
    return r


def test_searcher_trains_each_draw_on_every_setting_and_tells_the_mean():
    """One draw → a trial per setting (the second queued for the next suggest), each sized to the budget at its
    own length; the candidate is told once all settings finished: the mean of their metric, the mean step time,
    the largest state; a failed setting fails the draw, a stopped one prunes it."""
    from atlaslab.search.searcher import PartSearcher
    node = suite(search={"sampler": "random", "seed": 0, "objectives": ["step_time_s:min", "state_size:min"],
                         "space": {"train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}},
                 budget={"state": 600, "tolerance": 0.5, "size_by": {HEADS: [1, 2, 4]}})
    exp = load_experiment(node=node)
    s = PartSearcher(exp)
    got = [s.suggest(f"t{i}")["trial"] for i in range(6)]
    assert [t["setting"] for t in got] == ["mqar", "recall"] * 3
    assert [t["candidate"] for t in got] == ["c000", "c000", "c001", "c001", "c002", "c002"]
    assert [t["key"] for t in got] == [f"t{i}" for i in range(6)]
    for a, b in zip(got[::2], got[1::2]):
        assert a["params"]["train.lr"] == b["params"]["train.lr"]
        assert a["config"]["task"]["name"] == "mqar" and b["config"]["task"]["name"] == "in_context_recall"
    for t in got:
        assert t["info"]["budget"]["state"] == 600 and abs(t["info"]["state_size"] / 600 - 1) <= 0.5
        assert t["resolved_model"] is not None
    s.on_trial_complete("t0", _fake_result(0.8))
    assert s.study.trials[0].state.name == "RUNNING"          # waits for the other setting
    r1 = dict(_fake_result(0.4), step_time_s=0.03)
    s.on_trial_complete("t1", r1)
    t0 = s.study.trials[0]
    states = [got[0]["info"]["state_size"], got[1]["info"]["state_size"]]
    assert t0.state.name == "COMPLETE" and t0.values == pytest.approx([0.6, 0.02, max(states)])
    s.on_trial_complete("t2", _fake_result(0.9))
    s.on_trial_complete("t3", _fake_result(float("nan")))       # final without a value (no status): failed
    assert s.study.trials[1].state.name == "FAIL"
    s.on_trial_complete("t4", _fake_result(0.9))
    s.on_trial_complete("t5", _fake_result(0.3, final=False))  # stopped by the scheduler
    assert s.study.trials[2].state.name == "PRUNED"
    assert not s.draws and not s.queue


def test_a_candidate_over_its_step_cost_on_one_setting_is_infeasible():
    """One setting over train.max_step_time_s makes the candidate infeasible (constraint over_cost, the largest
    excess over its settings), not a score; its status in the report is over_cost."""
    from atlaslab.search.fitness import candidate_status
    from atlaslab.search.searcher import OVER_COST_ATTR, PartSearcher
    s = PartSearcher(load_experiment(node=suite()))
    for i in range(2):
        s.suggest(f"t{i}")
    s.on_trial_complete("t0", _fake_result(0.8))
    s.on_trial_complete("t1", dict(_fake_result(0.9), status="over_cost", train_step_time_s=0.5,
                                   max_step_time_s=0.2))
    t = s.study.trials[0]
    assert t.state.name == "COMPLETE" and t.user_attrs[OVER_COST_ATTR] == pytest.approx(1.5)
    assert not s.asked and not s.draws
    assert candidate_status({"mqar": "completed", "recall": "over_cost"}, ["mqar", "recall"]) == "over_cost"
    assert candidate_status({"mqar": "diverged", "recall": "over_cost"}, ["mqar", "recall"]) == "diverged"


def test_a_candidate_that_diverged_on_a_setting_is_infeasible_not_failed():
    """A diverged setting (status diverged, metric NaN) makes the candidate infeasible (constraint ``diverged``), so
    TPE learns to avoid the combination; a failed trial teaches it nothing (the second multi-task search drew one
    diverging combination 10 times)."""
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY

    from atlaslab.search.searcher import DIVERGED_ATTR, PartSearcher
    s = PartSearcher(load_experiment(node=suite()))
    for i in range(2):
        s.suggest(f"t{i}")
    s.on_trial_complete("t0", _fake_result(0.8))
    s.on_trial_complete("t1", dict(_fake_result(float("nan")), status="diverged", failed=1))
    t = s.study.trials[0]
    assert t.state.name == "COMPLETE" and t.user_attrs[DIVERGED_ATTR] == 1.0
    assert t.system_attrs[f"{_CONSTRAINTS_KEY}:diverged"] == 1.0


def test_a_draw_one_setting_rejects_is_rejected_naming_the_setting():
    """MAD's recall needs an even length; a draw with an odd one is rejected as a whole (its MQAR trial is never
    started), told to Optuna as infeasible, and its reason names the setting."""
    from atlaslab.search.searcher import PartSearcher
    exp = load_experiment(node=suite(search={"sampler": "random", "seed": 1,
                                             "space": {"tasks.recall.seq_len": [16, 17], "train.lr": [1e-3, 3e-3]}}))
    s = PartSearcher(exp)
    got = [s.suggest(f"t{i}")["trial"] for i in range(6)]
    assert all(t["params"]["tasks.recall.seq_len"] == 16 for t in got)
    assert [t["setting"] for t in got] == ["mqar", "recall"] * 3
    assert s.rejected, "seed 1 draws an odd length"
    for r in s.rejected:
        assert r["setting"] == "recall" and r["reason"].startswith("setting recall: ") and "even" in r["reason"]
        told = s.study.trials[r["number"]]
        assert told.state.name == "COMPLETE" and told.user_attrs["atlaslab_rejected"].startswith("setting recall")


def test_searcher_saved_mid_draw_resumes_its_queue_and_partial_results(tmp_path):
    """Saved after the first setting of a draw finished (and its second was queued): the restored searcher hands
    out the queued setting, then tells the draw its score from the result it saved and the new one."""
    from atlaslab.search.searcher import PartSearcher
    exp = load_experiment(node=suite())
    a = PartSearcher(exp)
    first = a.suggest("t0")["trial"]
    a.on_trial_complete("t0", _fake_result(0.8))
    a.save(str(tmp_path / "searcher.pkl"))
    b = PartSearcher(exp)
    b.restore(str(tmp_path / "searcher.pkl"))
    second = b.suggest("t1")["trial"]
    assert (second["candidate"], second["setting"]) == (first["candidate"], "recall")
    assert second["params"] == first["params"]
    b.on_trial_complete("t1", _fake_result(0.2))
    assert b.study.trials[0].state.name == "COMPLETE" and b.study.trials[0].value == pytest.approx(0.5)
    third = b.suggest("t2")["trial"]
    assert third["candidate"] == "c001" and len(b.study.trials) == 2


def _trial(tid, setting, candidate=None):
    return types.SimpleNamespace(trial_id=tid, config={"trial": {"setting": setting, "candidate": candidate}})


def test_per_setting_asha_compares_a_trial_with_its_own_setting_only():
    """At the first rung, an easy setting's trials score 0.9-0.95 and a hard one's 0.2-0.3: one ASHA over all stops
    the hard setting's best trial (0.35 is below the cut set by the easy ones), one ASHA per setting keeps it (the
    best of its setting) and still stops the hard setting's worst."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    from atlaslab.search.schedulers import PerSettingScheduler

    def make():
        return ASHAScheduler(time_attr="step", metric="val/accuracy", mode="max", grace_period=1, max_t=9,
                             reduction_factor=2)

    def feed(sched):
        trials = [_trial("e0", "easy"), _trial("e1", "easy"), _trial("h0", "hard"), _trial("h1", "hard"),
                  _trial("h2", "hard"), _trial("h3", "hard")]
        for t in trials:
            sched.on_trial_add(None, t)
        acts = {}
        for t, acc in zip(trials, [0.9, 0.95, 0.2, 0.3, 0.35, 0.1]):
            acts[t.trial_id] = sched.on_trial_result(None, t, {"step": 1, "val/accuracy": acc})
        return acts

    shared = feed(make())
    assert shared["h2"] == TrialScheduler.STOP
    per = PerSettingScheduler(make, ["easy", "hard"])
    acts = feed(per)
    assert acts["h2"] == TrialScheduler.CONTINUE and acts["h3"] == TrialScheduler.STOP
    assert set(per.by_setting["hard"]._trial_info) == {"h0", "h1", "h2", "h3"}
    per.on_trial_complete(None, _trial("h2", "hard"), {"step": 2, "val/accuracy": 0.4})
    assert "h2" not in per.by_setting["hard"]._trial_info
    with pytest.raises(KeyError, match="setting 'other'"):
        per.on_trial_add(None, _trial("x", "other"))


def test_a_candidate_stopped_on_one_setting_is_stopped_on_the_others():
    """The candidate is pruned for the sampler as soon as one setting's ASHA stops it: its trial on the other
    setting stops at its next result although that setting's ASHA would let it go on; other candidates go on."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    from atlaslab.search.schedulers import PerSettingScheduler
    per = PerSettingScheduler(lambda: ASHAScheduler(time_attr="step", metric="val/accuracy", mode="max",
                                                    grace_period=1, max_t=9, reduction_factor=2), ["a", "b"])
    trials = {(c, s): _trial(f"{c}{s}", s, c) for c in ("c0", "c1", "c2") for s in ("a", "b")}
    for t in trials.values():
        per.on_trial_add(None, t)
    res = {c: per.on_trial_result(None, trials[(c, "a")], {"step": 1, "val/accuracy": acc})
           for c, acc in (("c0", 0.9), ("c1", 0.95), ("c2", 0.1))}
    assert res["c2"] == TrialScheduler.STOP and res["c0"] == res["c1"] == TrialScheduler.CONTINUE
    assert per.on_trial_result(None, trials[("c1", "b")], {"step": 1, "val/accuracy": 0.5}) == TrialScheduler.CONTINUE
    assert per.on_trial_result(None, trials[("c2", "b")], {"step": 1, "val/accuracy": 0.99}) == TrialScheduler.STOP
    keep = PerSettingScheduler(lambda: ASHAScheduler(time_attr="step", metric="val/accuracy", mode="max",
                                                     grace_period=1, max_t=9, reduction_factor=2), ["a", "b"],
                               stop_candidate=False)
    for t in trials.values():
        keep.on_trial_add(None, t)
    for c, acc in (("c0", 0.9), ("c1", 0.95), ("c2", 0.1)):
        keep.on_trial_result(None, trials[(c, "a")], {"step": 1, "val/accuracy": acc})
    assert keep.on_trial_result(None, trials[("c2", "b")], {"step": 1, "val/accuracy": 0.99}) == \
        TrialScheduler.CONTINUE


def test_driver_uses_per_setting_asha_and_counts_a_trial_per_setting():
    from atlaslab.search.driver import _scheduler, n_trials, prepare, trial_table
    from atlaslab.search.schedulers import PerSettingScheduler
    p = prepare(node=suite(num_samples=3, scheduler={"name": "asha", "grace_period": 10}))
    assert isinstance(_scheduler(p.exp), PerSettingScheduler)
    assert n_trials(p) == 6
    assert {t["setting"] for t in p.trials} == {"mqar", "recall"}     # preflight admits each draw on every setting
    assert "score = mean of val/accuracy; 6 trials; ASHA per setting" in trial_table(p)


def test_candidates_of_records_rank_by_score():
    exp = load_experiment(node=suite())
    recs = []
    for cid, accs, status in (("c000", (0.8, 0.4), "completed"), ("c001", (0.9, 0.9), "completed"),
                              ("c002", (0.7, None), "diverged")):
        for setting, acc in zip(("mqar", "recall"), accs):
            recs.append({"key": f"{cid}{setting}", "candidate": cid, "setting": setting, "index": int(cid[1:]),
                         "status": status if acc is None else "completed", "failed": acc is None,
                         "message": "nan", "params": {"train.lr": 1e-3, MEM + "retention.name": "decay"},
                         "metrics": {"val/accuracy": acc, "step": 30, "step_time_s": 0.01},
                         "info": {"state_size": 500 if setting == "mqar" else 600}})
    cands = {c["key"]: c for c in candidates(exp, recs)}
    assert cands["c000"]["metrics"]["val/accuracy"] == pytest.approx(0.6)
    assert cands["c000"]["by_setting"] == {"mqar": 0.8, "recall": 0.4}
    assert cands["c000"]["info"]["state_size"] == 600 and cands["c000"]["metrics"]["step"] == 60
    assert cands["c002"]["status"] == "diverged" and cands["c002"]["failed"]
    assert "val/accuracy" not in cands["c002"]["metrics"]


def test_a_search_on_two_settings_end_to_end(local_ray, tmp_path):
    """Three candidates on MQAR and MAD's in-context recall, on Ray with ASHA per setting: every candidate has a
    trial on each setting, the score it was ranked by is the mean of its two accuracies, and the report has a
    column per setting, the score, and trials.csv one line per (candidate, setting)."""
    import csv

    from atlaslab.search.driver import prepare, run
    node = suite("suite2", steps=10, num_samples=3, max_concurrent=2, eval={"interval": 5, "examples": 32},
                 scheduler={"name": "asha", "grace_period": 5, "reduction_factor": 2}, tracking={"enabled": False})
    summary = run(prepare(node=node), run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    assert summary["status"] == "finished" and summary["trials"] == 6 and summary["failed"] == 0
    recs = json.loads((tmp_path / "run" / "results.json").read_text())
    by = {}
    for r in recs:
        by.setdefault(r["candidate"], {})[r["setting"]] = r
    assert sorted(by) == ["c000", "c001", "c002"] and all(sorted(v) == ["mqar", "recall"] for v in by.values())
    for cid, pair in by.items():
        assert pair["mqar"]["params"] == pair["recall"]["params"]
    exp = load_experiment(node=node)
    cands = {c["key"]: c for c in candidates(exp, recs)}
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Candidates by score" in report and "## What mattered" in report
    head = next(line for line in report.splitlines() if line.startswith("| candidate |"))
    assert "| mqar | recall | score |" in head
    for cid, pair in by.items():
        accs = [pair[s]["metrics"].get("val/accuracy") for s in ("mqar", "recall")]
        if None in accs:
            continue
        mean = sum(accs) / 2
        assert cands[cid]["metrics"]["val/accuracy"] == pytest.approx(mean)
        line = next(line for line in report.splitlines() if line.startswith(f"| {cid} |"))
        assert f"| {accs[0]:.3f} | {accs[1]:.3f} | {mean:.3f} |" in line
    # what Optuna was told (the searcher's state, as Tune saved it): each completed candidate its score, once
    import glob
    import pickle
    with open(glob.glob(str(tmp_path / "run" / "ray" / "tune" / "searcher-state-*.pkl"))[-1], "rb") as f:
        study = pickle.load(f)["study"]
    told = {f"c{t.number:03d}": t for t in study.trials}
    assert sorted(told) == sorted(by)
    for cid, c in cands.items():
        if c["status"] == "completed":
            assert told[cid].state.name == "COMPLETE" and told[cid].value == pytest.approx(c["metrics"]["val/accuracy"])
        else:
            assert told[cid].state.name == "PRUNED" and c["status"] == "pruned"
    with open(tmp_path / "run" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["candidate"], r["setting"]) for r in rows) == sorted((c, s) for c in by for s in by[c])


def test_finished_candidates_rank_before_those_stopped_early():
    from atlaslab.search.fitness import ranked_candidates
    exp = load_experiment(node=suite())
    cands = [{"key": "a", "status": "pruned", "metrics": {"val/accuracy": 0.9}},
             {"key": "b", "status": "completed", "metrics": {"val/accuracy": 0.5}},
             {"key": "c", "status": "completed", "metrics": {"val/accuracy": 0.7}},
             {"key": "d", "status": "error", "metrics": {}}]
    assert [c["key"] for c in ranked_candidates(exp, cands)] == ["c", "b", "a"]


@pytest.mark.slow
def test_an_interrupted_search_on_two_settings_resumes_its_draws(local_ray, tmp_path):
    """Ctrl-C after the first setting's trial of the first candidate finished, then `resume`: Tune restores the
    searcher with its queue and the draw's saved result, so the candidate's other setting is trained (once) and the
    candidate is told its mean; the sweep ends with every candidate on both settings, no trial twice."""
    import glob
    import pickle

    from atlaslab.search.driver import prepare, resume, run
    from tests.search.test_search_ray import InterruptAfterFirstTrial
    node = suite("suite_resume", steps=30, num_samples=2, max_concurrent=1, tracking={"enabled": False})
    run_dir = tmp_path / "run"
    s1 = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True,
             stop=InterruptAfterFirstTrial(tmp_path / "f", run_dir / "ray" / "tune"))
    assert s1["status"] == "interrupted"
    s2 = resume(run_dir, quiet=True)
    assert s2["status"] == "finished" and s2["trials"] == 4 and s2["failed"] == 0
    recs = json.loads((run_dir / "results.json").read_text())
    assert len({r["key"] for r in recs}) == 4 and all(r["status"] == "completed" for r in recs)
    assert sorted((r["candidate"], r["setting"]) for r in recs) == [
        ("c000", "mqar"), ("c000", "recall"), ("c001", "mqar"), ("c001", "recall")]
    with open(sorted(glob.glob(str(run_dir / "ray" / "tune" / "searcher-state-*.pkl")))[-1], "rb") as f:
        saved = pickle.load(f)
    assert not saved["queue"] and not saved["draws"]
    exp = load_experiment(node=node)
    by = {c["key"]: c for c in candidates(exp, recs)}
    for t in saved["study"].trials:
        assert t.state.name == "COMPLETE"
        assert t.value == pytest.approx(by[f"c{t.number:03d}"]["metrics"]["val/accuracy"])


def test_the_best_candidate_is_exported_not_the_best_single_trial(tmp_path):
    """`atlaslab export` / `export-preset` pick the candidate with the best score (its trial on the first setting),
    not the trial with the best metric on one (easy) setting; the preset is built for that setting's task."""
    from atlaslab.search.preset_export import export_preset
    from atlaslab.search.results import pick_trial
    from tests.search.test_preset_export import unwrapped_header, write_run
    node = suite("pick")
    accs = {("c000", "mqar"): 0.3, ("c000", "recall"): 0.99, ("c001", "mqar"): 0.8, ("c001", "recall"): 0.7}
    trials = []
    for i, cid in enumerate(("c000", "c001")):
        for setting in ("mqar", "recall"):
            key = f"k{cid}{setting}"
            trials.append({"key": key, "index": i, "setting": setting, "variant": key, "label": key, "row": key,
                           "candidate": cid, "seed": 0, "params": {"train.lr": 1e-3, MEM + "retention.name": "decay"}})
    write_run(tmp_path / "run", node, {t["key"]: accs[(t["candidate"], t["setting"])] for t in trials}, trials)
    picked = pick_trial(tmp_path / "run")
    assert picked.record["key"] == "kc001mqar" and picked.is_best
    path = export_preset(tmp_path / "run")
    header = unwrapped_header(path.read_text())
    assert "the best trial" in header and "kc001mqar" in header


def test_a_search_with_several_seeds_trains_each_candidate_on_every_setting_and_seed():
    """``seeds: [3, 4]`` in a search: one draw → a trial per setting × seed (each trained with its seed), and the
    candidate is told the mean over the seeds of each setting, then the settings' mean; records of a missing seed
    leave the candidate unfinished and unscored."""
    from atlaslab.search.driver import n_trials, prepare, trial_table
    from atlaslab.search.fitness import cells, per_setting
    from atlaslab.search.searcher import PartSearcher
    node = suite(seeds=[3, 4], num_samples=2)
    exp = load_experiment(node=node)
    assert cells(exp) == [("mqar@3", "mqar", 3), ("mqar@4", "mqar", 4), ("recall@3", "recall", 3),
                          ("recall@4", "recall", 4)]
    s = PartSearcher(exp)
    got = [s.suggest(f"t{i}")["trial"] for i in range(4)]
    assert [(t["setting"], t["seed"], t["config"]["train"]["seed"]) for t in got] == \
        [("mqar", 3, 3), ("mqar", 4, 4), ("recall", 3, 3), ("recall", 4, 4)]
    assert {t["candidate"] for t in got} == {"c000"} and len({repr(t["params"]) for t in got}) == 1
    for tid, acc in zip(("t0", "t1", "t2"), (0.9, 0.5, 0.2)):
        s.on_trial_complete(tid, _fake_result(acc))
    assert s.study.trials[0].state.name == "RUNNING"          # waits for recall on seed 4
    s.on_trial_complete("t3", _fake_result(0.4))
    assert s.study.trials[0].value == pytest.approx(((0.9 + 0.5) / 2 + (0.2 + 0.4) / 2) / 2)
    assert per_setting(exp, {"mqar@3": 0.9, "mqar@4": 0.5, "recall@3": 0.2}) == \
        {"mqar": pytest.approx(0.7), "recall": None}
    recs = [{"key": t["key"], "candidate": "c000", "setting": t["setting"], "seed": t["seed"], "index": 0,
             "status": "completed", "failed": False, "params": t["params"],
             "metrics": {"val/accuracy": acc, "step": 30, "step_time_s": 0.01}, "info": {"state_size": 500}}
            for t, acc in zip(got, (0.9, 0.5, 0.2, 0.4))]
    [c] = candidates(exp, recs)
    assert c["metrics"]["val/accuracy"] == pytest.approx(0.5) and c["by_setting"] == \
        {"mqar": pytest.approx(0.7), "recall": pytest.approx(0.3)}
    assert c["by_cell"]["recall@4"] == 0.4 and c["status"] == "completed" and c["metrics"]["step"] == 120
    [c] = candidates(exp, recs[:3])
    assert c["status"] == "unfinished" and "val/accuracy" not in c["metrics"]
    p = prepare(node=node)
    assert n_trials(p) == 8
    assert "2 setting(s) (mqar, recall) × 2 seeds (3, 4; a setting's value is the mean over its seeds)" in \
        trial_table(p)


def test_a_search_on_one_setting_and_two_seeds_end_to_end(local_ray, tmp_path):
    """Two candidates of a one-task search, each trained on seeds 0 and 1 on Ray: trials.csv has a line per
    (candidate, seed), and the report ranks the candidates by the mean over their seeds."""
    import csv

    from atlaslab.search.driver import prepare, run
    node = tiny("seeds2", steps=10, num_samples=2, max_concurrent=2, seeds=[0, 1],
                eval={"interval": 5, "examples": 32}, tracking={"enabled": False})
    node["search"] = {"sampler": "random", "seed": 0,
                      "space": {"train.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}}
    summary = run(prepare(node=node), run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    assert summary["status"] == "finished" and summary["trials"] == 4 and summary["failed"] == 0
    with open(tmp_path / "run" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["candidate"], r["seed"]) for r in rows) == [("c000", "0"), ("c000", "1"), ("c001", "0"),
                                                                 ("c001", "1")]
    report = (tmp_path / "run" / "report.md").read_text()
    for cid in ("c000", "c001"):
        accs = [float(r["val/accuracy"]) for r in rows if r["candidate"] == cid]
        line = next(line for line in report.splitlines() if line.startswith(f"| {cid} |"))
        assert f"| {sum(accs) / 2:.3f} |" in line
