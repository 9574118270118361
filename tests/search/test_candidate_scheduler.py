"""``scheduler: candidate_asha``: a search's candidates compared by their score at each rung, a candidate's settings
paused at the rung until all of them reached it (:class:`atlaslab.search.schedulers.CandidateASHA`).

The decision tests feed fake trials and results to the scheduler, with a fake Tune controller that records what the
scheduler stops; one test runs a tiny search on Ray end to end."""
import glob
import json
import ray.cloudpickle as pickle
import types

import pytest
from ray.tune import Stopper
from ray.tune.schedulers import TrialScheduler

from atlaslab.registry import ConfigError
from atlaslab.search.schedulers import CandidateASHA, CandidateLimiter, cutoff, rungs
from atlaslab.search.schema import load_experiment
from tests.search.test_fitness import suite

CONT, PAUSE, STOP = TrialScheduler.CONTINUE, TrialScheduler.PAUSE, TrialScheduler.STOP
ACC = "val/accuracy"


class Controller:
    """What the scheduler uses of Tune's controller: the trials, and stopping one (Tune then tells the scheduler that
    a paused or pending trial was removed)."""

    def __init__(self):
        self.trials = []
        self.stopped = []
        self.marked = []

    def _mark_trial_to_checkpoint(self, trial):     # Tune saves the trial's status with its next checkpoint
        self.marked.append(trial.trial_id)

    def get_trials(self):
        return self.trials

    def stop_trial(self, trial):
        self.stopped.append(trial.trial_id)
        if trial.status in ("PAUSED", "PENDING"):
            self.sched.on_trial_remove(self, trial)
        trial.status = "TERMINATED"


def make(settings=("a", "b"), grace=1, rf=2.0, max_t=9, max_concurrent=2, mode="max", state_path=None):
    def score(values):                     # the mean, as search.score's default
        vals = [values.get(s) for s in settings]
        return None if any(v is None for v in vals) else sum(vals) / len(vals)
    sched = CandidateASHA(list(settings), score, ACC, mode, grace_period=grace, reduction_factor=rf, max_t=max_t,
                          max_concurrent=max_concurrent, state_path=state_path)
    ctl = Controller()
    ctl.sched = sched
    return sched, ctl


def add(sched, ctl, cid, setting, status="RUNNING"):
    t = types.SimpleNamespace(trial_id=f"{cid}-{setting}", status=status, is_saving=False,
                              config={"trial": {"candidate": cid, "setting": setting}})
    ctl.trials.append(t)
    sched.on_trial_add(ctl, t)
    return t


def report(sched, ctl, trial, step, acc):
    """A result; the trial's status follows the decision, as Tune's would."""
    act = sched.on_trial_result(ctl, trial, {"step": step, ACC: acc})
    if act == PAUSE:
        trial.status = "PAUSED"
    elif act == STOP:
        trial.status = "TERMINATED"
        sched.on_trial_complete(ctl, trial, {"step": step, ACC: acc})
    return act


def test_rungs_and_cutoff():
    assert rungs(1, 2, 9) == [1, 2, 4, 8] and rungs(100, 3, 300) == [100] and rungs(5, 2, 5) == []
    assert rungs(2, 1.5, 10) == [2, 3, 4, 6]
    assert cutoff([], 3) is None and cutoff([0.2, 0.4], 2) == pytest.approx(0.3)
    assert cutoff([0.1, float("nan"), None, 0.5, 0.9], 3) == pytest.approx(0.6333, abs=1e-3)


def test_a_candidate_waits_at_a_rung_for_every_setting_then_goes_on_or_stops_on_all():
    """Each candidate's first setting pauses at the rung; when the second arrives the candidate is judged on its
    mean: the first goes on (its paused trial is released), one below the cut is stopped on both settings (the
    paused one through the controller), one above the cut goes on. Scores are recorded per rung."""
    sched, ctl = make()
    c0a, c0b = add(sched, ctl, "c0", "a"), add(sched, ctl, "c0", "b")
    assert report(sched, ctl, c0a, 1, 0.9) == PAUSE
    assert sched.idle() == {"c0-a"} and not sched.resuming()
    assert report(sched, ctl, c0b, 1, 0.5) == CONT          # the first candidate at the rung goes on
    assert sched.released == {"c0-a"} and sched.resuming()
    assert sched.choose_trial_to_run(ctl) is c0a            # c0-b runs, a slot of 2 is free: c0-a resumes
    c0a.status = "PENDING"
    c1a, c1b = add(sched, ctl, "c1", "a"), add(sched, ctl, "c1", "b")
    assert report(sched, ctl, c1a, 1, 0.2) == PAUSE
    assert report(sched, ctl, c1b, 1, 0.1) == STOP           # 0.15 < 0.7 (the median of the earlier score)
    assert ctl.stopped == ["c1-a"] and c1a.status == "TERMINATED" and ctl.marked == ["c1-a"]
    assert sched.cands["c1"]["status"] == "stopped" and sched.cands["c1"]["scores"] == {"1": pytest.approx(0.15)}
    c2a, c2b = add(sched, ctl, "c2", "a"), add(sched, ctl, "c2", "b")
    assert report(sched, ctl, c2b, 1, 0.9) == PAUSE          # any setting may arrive first
    assert report(sched, ctl, c2a, 1, 0.95) == CONT          # 0.925 ≥ 0.425, the median of 0.7 and 0.15
    assert sched.recorded["1"] == {"c0": pytest.approx(0.7), "c1": pytest.approx(0.15), "c2": pytest.approx(0.925)}
    # the next rung (step 2) of c0: c0-b arrives first and waits, c0-a (resumed) arrives and c0 is judged again
    assert report(sched, ctl, c0b, 2, 0.6) == PAUSE
    c0a.status = "RUNNING"
    assert report(sched, ctl, c0a, 2, 0.9) == CONT and sched.cands["c0"]["rung"] == 2


def test_min_mode_and_a_diverging_score_stop():
    """mode min: lower is better; a candidate whose score is not finite (a NaN metric at the rung) is stopped, even
    the first at its rung."""
    sched, ctl = make(mode="min")
    t = {(c, s): add(sched, ctl, c, s) for c in ("c0", "c1", "c2") for s in ("a", "b")}
    report(sched, ctl, t["c0", "a"], 1, float("nan"))
    assert report(sched, ctl, t["c0", "b"], 1, 0.1) == STOP and ctl.stopped == ["c0-a"]
    report(sched, ctl, t["c1", "a"], 1, 0.5)
    assert report(sched, ctl, t["c1", "b"], 1, 0.5) == CONT
    report(sched, ctl, t["c2", "a"], 1, 0.9)
    assert report(sched, ctl, t["c2", "b"], 1, 0.9) == STOP     # a loss of 0.9 against 0.5


def test_a_paused_trial_is_never_resumed_before_its_candidate_is_decided_and_pending_trials_go_first():
    """max_concurrent 1 with two settings: the first setting waits at the rung and holds no slot, so the limiter
    starts its sibling (queued in the searcher); choose_trial_to_run prefers a pending trial, never picks a waiting
    one, resumes a released one only in a free slot, and the limiter draws nothing new while one waits to resume."""
    sched, ctl = make(max_concurrent=1)

    from ray.tune.search import Searcher as TuneSearcher

    class Searcher(TuneSearcher):
        def __init__(self):
            super().__init__()
            self.asked = []

        def suggest(self, tid):
            self.asked.append(tid)
            return {"trial": tid}

        def on_trial_complete(self, tid, result=None, error=False):
            pass

    inner = Searcher()
    lim = CandidateLimiter(inner, 1, sched)
    assert lim.suggest("c0-a") == {"trial": "c0-a"}
    c0a = add(sched, ctl, "c0", "a")
    assert lim.suggest("x") is None                          # one running: the slot is taken
    assert report(sched, ctl, c0a, 1, 0.5) == PAUSE
    assert sched.choose_trial_to_run(ctl) is None            # waiting: not resumed
    assert lim.suggest("c0-b") == {"trial": "c0-b"}          # the paused trial holds no slot
    c0b = add(sched, ctl, "c0", "b", status="PENDING")
    assert sched.choose_trial_to_run(ctl) is c0b             # pending first
    c0b.status = "RUNNING"
    assert report(sched, ctl, c0b, 1, 0.5) == CONT
    assert sched.choose_trial_to_run(ctl) is None            # released, but c0-b runs in the only slot
    assert lim.suggest("y") is None
    c0b.status = "TERMINATED"
    sched.on_trial_complete(ctl, c0b, {"step": 9, ACC: 0.6, "final": 1})
    lim.on_trial_complete("c0-b")
    assert sched.choose_trial_to_run(ctl) is c0a             # the slot freed: the released trial resumes
    assert lim.suggest("z") is None                          # … before anything new is drawn
    c0a.status = "PENDING"
    assert lim.suggest("z") is None                          # it takes the slot
    assert inner.asked == ["c0-a", "c0-b"]
    state = lim.get_state()
    assert "gate" not in state and "searcher" not in state
    lim.set_state(state)
    assert lim.gate is sched


def test_a_trial_paused_by_tune_on_its_own_is_resumed():
    """Ray 2.60 saves a pending PAUSE with its experiment and applies it after a resume: a trial this scheduler never
    held ends up paused. It is resumed since its candidate does not wait for it (read from the record), and so is a
    late-paused trial of a stopped candidate (stopped at its first result); a waiting one is not."""
    sched, ctl = make(max_concurrent=1)
    a, b = add(sched, ctl, "c0", "a"), add(sched, ctl, "c0", "b")
    assert report(sched, ctl, a, 1, 0.5) == PAUSE
    assert report(sched, ctl, b, 1, 0.5) == CONT
    assert report(sched, ctl, b, 2, 0.6) == PAUSE            # b waits at rung 2 for a
    a.status = "RUNNING"
    assert report(sched, ctl, a, 2, 0.7) == CONT and sched.choose_trial_to_run(ctl) is None   # a runs in the slot
    assert report(sched, ctl, a, 3, 0.7) == CONT
    a.status = "PAUSED"                                      # Tune paused it on its own
    assert sched.choose_trial_to_run(ctl) in (a, b) and sched.released == {"c0-a", "c0-b"}
    c = add(sched, ctl, "c1", "a")
    add(sched, ctl, "c1", "b")
    assert report(sched, ctl, c, 1, 0.9) == PAUSE
    assert "c1-a" not in sched.released                     # waits for c1-b
    sched.cands["c1"]["status"] = "stopped"
    assert "c1-a" in sched.released and report(sched, ctl, c, 2, 0.9) == STOP


def test_a_failing_or_diverging_setting_fails_its_candidate_and_releases_the_waiting_ones():
    """A setting that raises (Tune's final error) or diverges (a final result marked failed) fails the candidate:
    its paused siblings are stopped at once, a running one at its next result. Tune's retry of a raising trial
    (on_trial_error while the trial is ERROR, then added again) does not fail it."""
    sched, ctl = make(settings=("a", "b", "c"))
    a, b, c = add(sched, ctl, "c0", "a"), add(sched, ctl, "c0", "b"), add(sched, ctl, "c0", "c")
    assert report(sched, ctl, a, 1, 0.5) == PAUSE
    b.status = "ERROR"
    sched.on_trial_error(ctl, b)                             # a retry: nothing happens
    assert sched.cands["c0"]["status"] == "going" and a.status == "PAUSED"
    b.status = "RUNNING"
    sched.on_trial_add(ctl, b)
    sched.on_trial_error(ctl, b)                             # the last try failed
    assert sched.cands["c0"]["status"] == "failed" and ctl.stopped == ["c0-a"]
    assert report(sched, ctl, c, 1, 0.9) == STOP
    d0, d1 = add(sched, ctl, "c1", "a"), add(sched, ctl, "c1", "b")
    assert report(sched, ctl, d0, 1, 0.5) == PAUSE
    sched.on_trial_complete(ctl, d1, {"step": 1, ACC: float("nan"), "final": 1, "failed": 1, "status": "diverged"})
    assert sched.cands["c1"]["status"] == "failed" and ctl.stopped[-1] == "c1-a" and not sched.idle()


def test_a_finished_setting_counts_at_every_later_rung_and_coarse_reports_pass_several_rungs():
    """A setting that finished early (the loop's threshold at step 1) is judged with its final value at the later
    rungs; a report past two rungs (step 5 with rungs 1, 2, 4) decides each of them with the same result."""
    sched, ctl = make()
    a, b = add(sched, ctl, "c0", "a"), add(sched, ctl, "c0", "b")
    assert report(sched, ctl, a, 1, 0.2) == PAUSE
    sched.on_trial_complete(ctl, b, {"step": 1, ACC: 0.99, "final": 1, "status": "early_stopped"})
    assert sched.released == {"c0-a"}                       # judged at rung 1 on (0.2, 0.99): goes on
    a.status = "RUNNING"
    assert report(sched, ctl, a, 5, 0.4) == CONT
    assert sched.cands["c0"]["rung"] == 3 and set(sched.cands["c0"]["scores"]) == {"1", "2", "4"}
    assert sched.cands["c0"]["scores"]["4"] == pytest.approx((0.4 + 0.99) / 2)
    # with a second candidate's first setting past two rungs, it waits at the first until its sibling arrives
    c, d = add(sched, ctl, "c1", "a"), add(sched, ctl, "c1", "b")
    assert report(sched, ctl, c, 2, 0.9) == PAUSE
    assert report(sched, ctl, d, 1, 0.9) == CONT            # rung 1 decided; c1-a waits at rung 2 for c1-b
    assert sched.held == {"c1-a"} and not sched.released
    assert report(sched, ctl, d, 2, 0.9) == CONT and sched.released == {"c1-a"}


def test_one_setting_is_asha_over_trials():
    """With one setting a candidate is one trial: nothing ever waits, the bottom of each rung stops."""
    sched, ctl = make(settings=("only",))
    acts = [report(sched, ctl, add(sched, ctl, f"c{i}", "only"), 1, acc) for i, acc in enumerate([0.5, 0.9, 0.1])]
    assert acts == [CONT, CONT, STOP] and not sched.held and not ctl.stopped
    t = types.SimpleNamespace(trial_id="t9", status="RUNNING", is_saving=False, config={"trial": {"setting": ""}})
    ctl.trials.append(t)
    sched.on_trial_add(ctl, t)
    assert report(sched, ctl, t, 1, 0.95) == CONT and "t9" in sched.cands


def test_the_record_survives_a_resume(tmp_path):
    """The scheduler writes its record at each decision; pickled as Tune pickles it (its runtime state dropped) and
    given the trials again, it reads the record back: a trial that waited at the rung and was restarted by the
    resume keeps its result there and pauses again, and the candidate is judged against the rung's earlier scores."""
    path = tmp_path / "candidate_rungs.json"
    sched, ctl = make(state_path=str(path))
    blob = pickle.dumps(sched)                              # as the Tuner pickles it (cloudpickle) before the run
    t = {(c, s): add(sched, ctl, c, s) for c in ("c0", "c1") for s in ("a", "b")}
    report(sched, ctl, t["c0", "a"], 1, 0.9)
    report(sched, ctl, t["c0", "b"], 1, 0.9)
    assert report(sched, ctl, t["c1", "a"], 1, 0.1) == PAUSE
    rec = json.loads(path.read_text())
    assert rec["rungs"] == [1, 2, 4, 8] and rec["candidates"]["c1"]["at"] == {"a": [1, 0.1]}
    again = pickle.loads(blob)
    assert not again.cands and not again.held
    ctl2 = Controller()
    ctl2.sched = again
    t2 = {k: add(again, ctl2, k[0], k[1], status="PENDING") for k in t}   # Tune re-adds paused trials as PENDING
    assert again.cands["c0"]["rung"] == 1 and again.recorded["1"]["c0"] == pytest.approx(0.9)
    t2["c1", "a"].status = "RUNNING"
    assert report(again, ctl2, t2["c1", "a"], 2, 0.95) == PAUSE  # it waits with its step-1 result
    t2["c1", "b"].status = "RUNNING"
    assert report(again, ctl2, t2["c1", "b"], 1, 0.2) == STOP    # (0.1 + 0.2)/2 below 0.9
    assert ctl2.stopped == ["c1-a"]


def test_candidate_asha_is_validated_once():
    exp = load_experiment(node=suite(scheduler={"name": "candidate_asha", "grace_period": 10}))
    assert exp.scheduler.name == "candidate_asha"
    with pytest.raises(ConfigError, match=r"scheduler.name: bad value 'candidate-asha'.*candidate_asha"):
        load_experiment(node=suite(scheduler={"name": "candidate-asha"}))
    with pytest.raises(ConfigError, match=r"scheduler.brackets: candidate_asha has one bracket"):
        load_experiment(node=suite(scheduler={"name": "candidate_asha", "brackets": 2}))
    grid = suite(scheduler={"name": "candidate_asha"})
    grid.pop("search")
    with pytest.raises(ConfigError, match=r"scheduler.name: candidate_asha compares the candidates of a search"):
        load_experiment(node=grid)


def test_driver_builds_candidate_asha_and_says_its_rungs():
    from atlaslab.search.driver import _scheduler, prepare, trial_table
    p = prepare(node=suite(num_samples=3, steps=90, scheduler={"name": "candidate_asha", "grace_period": 10}))
    sched = _scheduler(p.exp, 2)
    assert isinstance(sched, CandidateASHA) and sched.rungs == [10, 30] and sched.settings == ["mqar", "recall"]
    assert sched.score({"mqar": 0.8, "recall": 0.4}) == pytest.approx(0.6)        # search.score
    assert "candidates compared by score at steps 10, 30, the top 1/3 go on (candidate_asha)" in trial_table(p)


#: the candidates of the end-to-end test, in order (search.enqueue): a good learning rate first, then two that learn
#: too little to pass the first rung and one that passes it
LRS = [1e-2, 1e-5, 3e-3, 1e-6]


def test_candidate_asha_on_ray_end_to_end(local_ray, tmp_path, monkeypatch):
    """Four candidates on two settings (MQAR, in-context recall), one trial at a time (fewer slots than settings),
    rungs at steps 5 and 10 of 20, judged on the mean validation loss: the run finishes (no deadlock), the candidates
    that learn too little are stopped at a rung on both settings (pruned for the sampler, stopped early in the
    report), the best candidate finishes every setting and the sampler is told its score; its first setting's trial
    was paused at each rung and resumed from its checkpoint, and ends with the metrics of the same trial trained
    without a pause (in this process, same seed)."""
    import torch
    from ray.tune import ExperimentAnalysis, ResultGrid
    from ray.tune.stopper import TimeoutStopper

    from atlaslab.search.build import build_trial
    from atlaslab.search.driver import prepare, run
    from atlaslab.train.loop import train
    # Tune saves its experiment at every step: a trial stopped while paused must be saved as stopped, not paused
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "0")
    node = suite("cand", steps=20, num_samples=len(LRS), max_concurrent=1, eval={"interval": 5, "examples": 32},
                 metric="val/loss", mode="min", tracking={"enabled": False},
                 scheduler={"name": "candidate_asha", "grace_period": 5, "reduction_factor": 2},
                 search={"sampler": "random", "seed": 0, "space": {"train.lr": LRS},
                         "enqueue": [{"train.lr": lr} for lr in LRS]})
    run_dir = tmp_path / "run"
    summary = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True, stop=TimeoutStopper(400))
    recs = json.loads((run_dir / "results.json").read_text())
    assert summary["status"] == "finished" and summary["trials"] == 8 and summary["failed"] == 0, \
        (summary, [(r["key"], r["status"], r["message"]) for r in recs])
    by = {}
    for r in recs:
        by.setdefault(r["candidate"], {})[r["setting"]] = r
    status = {c: {s: r["status"] for s, r in v.items()} for c, v in by.items()}
    lr = {c: v["mqar"]["params"]["train.lr"] for c, v in by.items()}
    assert [lr[c] for c in sorted(lr)] == LRS
    rec = json.loads((run_dir / "candidate_rungs.json").read_text())
    assert rec["rungs"] == [5, 10]
    stopped = [c for c, v in rec["candidates"].items() if v["status"] == "stopped"]
    assert "c001" in stopped and "c003" in stopped and "c000" not in stopped
    for c in stopped:                       # stopped at a rung on both settings, never trained to the end
        assert set(status[c].values()) == {"pruned"}
        assert all(r["metrics"]["step"] < 20 for r in by[c].values())
    assert status["c000"] == {"mqar": "completed", "recall": "completed"}
    assert rec["candidates"]["c000"]["rung"] == 2 and rec["candidates"]["c000"]["status"] == "finished"
    report = (run_dir / "report.md").read_text()
    n_pruned = sum(s == "pruned" for v in status.values() for s in v.values())
    assert f"{n_pruned} stopped early" in report
    with open(glob.glob(str(run_dir / "ray" / "tune" / "searcher-state-*.pkl"))[-1], "rb") as f:
        study = pickle.load(f)["study"]
    told = {f"c{t.number:03d}": t for t in study.trials}
    for c, v in status.items():
        if set(v.values()) == {"completed"}:
            mean = (by[c]["mqar"]["metrics"]["val/loss"] + by[c]["recall"]["metrics"]["val/loss"]) / 2
            assert told[c].state.name == "COMPLETE" and told[c].value == pytest.approx(mean)
        else:
            assert told[c].state.name == "PRUNED"
    # one slot: c000's MQAR trial waited at step 5 for its recall trial, which then waited at step 10 for it; each
    # was resumed from the checkpoint of its rung and ends as the same trial trained without a pause
    assert by["c000"]["mqar"]["metrics"]["resumed_from"] == 5
    assert by["c000"]["recall"]["metrics"]["resumed_from"] == 10
    grid = ResultGrid(ExperimentAnalysis(str(run_dir / "ray" / "tune")))
    configs = {r.config["trial"]["key"]: r.config["trial"] for r in grid}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # as the trial (cpus_per_trial 1)
    try:
        for paused in by["c000"].values():
            task, tcfg, model = build_trial(configs[paused["key"]])
            ref = train(model, task, tcfg)
            assert ref.steps == 20 and ref.resumed_from is None
            for k in ("val/loss", "val/accuracy", "train/loss"):
                assert paused["metrics"][k] == ref.metrics[k], (paused["setting"], k)
    finally:
        torch.set_num_threads(threads)


class InterruptAtStep(Stopper):
    """Ctrl-C (SIGINT to this process) at the first result of ``step`` (once: a flag file keeps it from firing again
    in the restored experiment, which unpickles the stopper)."""

    def __init__(self, flag, step):
        self.flag, self.step = str(flag), step

    def __call__(self, trial_id, result):
        import os
        import signal
        if result.get("step") == self.step and result.get("final") != 1 and not os.path.exists(self.flag):
            open(self.flag, "w").write("fired")
            os.kill(os.getpid(), signal.SIGINT)
        return False

    def stop_all(self):
        return False


@pytest.mark.slow
def test_a_candidate_asha_search_interrupted_with_paused_trials_resumes(local_ray, tmp_path):
    """Ctrl-C when the first candidate's recall trial reports step 10 (its MQAR trial paused at step 5, released),
    then `resume`: Tune restarts the paused trials from their checkpoints, the scheduler reads its record back, and
    the sweep finishes with the first candidate trained to the end on both settings and told its score, the weak
    candidates stopped at the rung on both settings, every trial once."""

    from atlaslab.search.driver import prepare, resume, run
    node = suite("cand_resume", steps=20, num_samples=len(LRS), max_concurrent=1,
                 eval={"interval": 5, "examples": 32}, metric="val/loss", mode="min", tracking={"enabled": False},
                 scheduler={"name": "candidate_asha", "grace_period": 5, "reduction_factor": 2},
                 search={"sampler": "random", "seed": 0, "space": {"train.lr": LRS},
                         "enqueue": [{"train.lr": lr} for lr in LRS]})
    run_dir = tmp_path / "run"
    s1 = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True, stop=InterruptAtStep(tmp_path / "f", 10))
    assert s1["status"] == "interrupted"
    before = json.loads((run_dir / "candidate_rungs.json").read_text())
    assert before["candidates"]["c000"]["rung"] == 1 and before["recorded"] == {"5": {"c000": pytest.approx(
        -before["candidates"]["c000"]["scores"]["5"])}}
    s2 = resume(run_dir, quiet=True)
    recs = json.loads((run_dir / "results.json").read_text())
    assert s2["status"] == "finished" and s2["trials"] == 8 and s2["failed"] == 0, \
        (s2, [(r["key"], r["status"], r["message"]) for r in recs])
    assert len({r["key"] for r in recs}) == 8
    status = {}
    for r in recs:
        status.setdefault(r["candidate"], {})[r["setting"]] = r["status"]
    rec = json.loads((run_dir / "candidate_rungs.json").read_text())
    assert status["c000"] == {"mqar": "completed", "recall": "completed"} and rec["candidates"]["c000"]["rung"] == 2
    for c in ("c001", "c003"):
        assert rec["candidates"][c]["status"] == "stopped" and set(status[c].values()) == {"pruned"}
    with open(sorted(glob.glob(str(run_dir / "ray" / "tune" / "searcher-state-*.pkl")))[-1], "rb") as f:
        study = pickle.load(f)["study"]
    told = {f"c{t.number:03d}": t.state.name for t in study.trials}
    assert told["c000"] == "COMPLETE" and told["c001"] == told["c003"] == "PRUNED"
