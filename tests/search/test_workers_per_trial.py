"""``resources.workers_per_trial``: validation (no Ray), and a trial on 2 Ray Train workers over 127.0.0.1,
interrupted and resumed, against one process on the same global batch.

The end-to-end test starts one local Ray (2 CPUs) and ends it by its own handle; a 2-worker trial pays for
a Ray Train controller and two worker processes, so it is marked slow. The equivalence of data-parallel and
one-process training itself is tested without Ray, in float64, in ``tests/train/test_parallel.py``.
"""
import json
import os
import signal
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from atlaslab.registry import ConfigError
from atlaslab.search.driver import prepare
from atlaslab.search.schema import load_experiment


def node(name="wpt", workers=2, steps=40, **extra):
    out = {
        "name": name,
        "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
        "task": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [1, 4], "eval_examples": 32},
        "eval": {"interval": 10, "examples": 32},
        "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "log_interval": 5, "checkpoint_interval": 0},
        "resources": {"cpus_per_trial": 2, "workers_per_trial": workers},
        "max_failures": 0,
    }
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------------
# validation (before any Ray worker starts)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, match", [
    (0, r"^resources\.workers_per_trial: bad value 0: must lie in \[1, inf\]"),
    ("two", r"^resources\.workers_per_trial"),
    (1.5, r"^resources\.workers_per_trial"),
])
def test_bad_workers_per_trial_names_the_field(value, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(node=node(workers=value))


def test_gpus_must_be_one_per_worker():
    n = node(workers=2)
    n["resources"]["gpus_per_trial"] = 1
    with pytest.raises(ConfigError, match=r"^resources\.gpus_per_trial: .*one GPU per worker.*0 or 2") as e:
        load_experiment(node=n)
    assert e.value.choices == ["0", "2"]
    n["resources"]["gpus_per_trial"] = 2
    assert load_experiment(node=n).resources.gpus_per_trial == 2


def test_the_global_batch_must_split_over_the_workers():
    with pytest.raises(ConfigError, match=r"trial t000 .*train\.batch_size: 8 does not split over 3 workers: the "
                                          r"global batch must be a multiple .*\(resources\.workers_per_trial\)"):
        prepare(node=node(workers=3))
    # a grid axis over the batch size is checked trial by trial
    with pytest.raises(ConfigError, match=r"trial t001 .*train\.batch_size: 6 does not split over 4"):
        prepare(node=node(workers=4, grid={"axes": {"train.batch_size": [8, 6]}}))
    assert len(prepare(node=node(workers=4)).trials) == 1
    assert load_experiment(node=node(workers=1)).resources.workers_per_trial == 1
    default = node()
    default["resources"] = {"cpus_per_trial": 1}
    assert load_experiment(node=default).resources.workers_per_trial == 1


# --------------------------------------------------------------------------------------------------
# end to end on Ray
# --------------------------------------------------------------------------------------------------
class InterruptAtStep:
    """Ctrl-C (SIGINT to this process) at the first result of ``step``, once (a flag file keeps it from firing
    again in the restored experiment). At that step the earlier reports' checkpoints have been saved."""

    def __init__(self, flag, step):
        self.flag, self.step = str(flag), step

    def __call__(self, trial_id, result):
        if result.get("step") == self.step and not os.path.exists(self.flag):
            Path(self.flag).write_text("fired")
            os.kill(os.getpid(), signal.SIGINT)
        return False

    def stop_all(self):
        return False


def reference(trial):
    """The trial trained by one process, in this process, on the same global batch."""
    from atlaslab.search.build import build_trial
    from atlaslab.train import train
    task, tcfg, model = build_trial(trial)
    return train(model, task, tcfg)


@pytest.mark.slow
@pytest.mark.timeout(900)      # a leaked placement group would keep the resumed trial waiting for its workers
def test_two_workers_interrupted_resumed_match_one_process(local_ray, tmp_path):
    from ray.tune import Stopper

    from mlflow.tracking import MlflowClient

    from atlaslab.search.driver import resume, run

    class Interrupt(InterruptAtStep, Stopper):
        pass

    # t000 trains on 2 workers; t001 fails in its workers (no CUDA here): recorded as failed, the sweep goes on
    exp = node(grid={"variants": {"ok": {}, "fails": {"train.device": "cuda"}}})
    p = prepare(node=exp)
    run_dir = tmp_path / "run"
    s1 = run(p, run_dir=run_dir, num_cpus=2, quiet=True, stop=Interrupt(tmp_path / "flag", 30))
    assert s1["status"] == "interrupted"
    s2 = resume(run_dir, quiet=True)
    assert s2["status"] == "finished" and s2["completed"] == 1 and s2["failed"] == 1, s2
    recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    ok, bad = recs["t000"]["metrics"], recs["t001"]

    # the trial ran on 2 workers whose parameters ended identical, and it resumed from a checkpoint
    assert ok["workers"] == 2
    digests = ok["param_digests"].split(",")
    assert len(digests) == 2 and digests[0] == digests[1]
    # the Ray checkpoint of the report of step 30 holds step 30; if the Ctrl-C came before Tune recorded that report,
    # the trial restores the one of step 20
    assert ok["resumed_from"] in (20, 30) and ok["step"] == 40

    # the result is that of one process on the same global batch (float32: summation order differs)
    ref = reference(p.trials[0])
    for k in ("train/loss", "val/loss", "test/loss", "val/accuracy", "test/accuracy"):
        assert ok[k] == pytest.approx(ref.metrics[k], rel=1e-4, abs=1e-5), k

    assert bad["status"] == "error" and bad["failed"] and "CUDA is not available" in bad["message"], bad

    # MLflow: one run per trial; every evaluation logged once, though the steps after the restored checkpoint that the
    # interrupted attempt had trained were trained twice
    state = json.loads((run_dir / "state.json").read_text())
    c = MlflowClient(state["tracking"]["uri"])
    children = [r for r in c.search_runs([state["tracking"]["experiment_id"]], max_results=100)
                if "mlflow.parentRunId" in r.data.tags]
    by_key = {r.data.tags["atlaslab.trial_key"]: r for r in children}
    assert sorted(by_key) == ["t000", "t001"] and len(children) == 2
    good = by_key["t000"]
    assert good.info.status == "FINISHED" and good.data.tags["atlaslab.resumed"] == "true"
    assert [m.step for m in c.get_metric_history(good.info.run_id, "val/accuracy")] == [10, 20, 30, 40]
    assert by_key["t001"].info.status == "FAILED"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_trial_asha_stops_releases_its_workers_for_the_next(local_ray, tmp_path):
    """ASHA stops t001 at its first rung; its workers must finish and give their CPUs back, or t002 (which
    needs all of them) never starts (this hung before the trial told its workers that it stopped listening)."""
    from atlaslab.search.driver import run
    exp = node(steps=20, grid={"variants": {"good": {}, "bad": {"train.lr": 1e-7}, "next": {"train.lr": 4e-3}}},
               scheduler={"name": "asha", "grace_period": 10, "reduction_factor": 2},
               metric="val/loss", mode="min")
    s = run(prepare(node=exp), run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    recs = {r["key"]: r for r in json.loads((tmp_path / "run" / "results.json").read_text())}
    assert s["status"] == "finished" and s["pruned"] == 1, s
    assert recs["t001"]["status"] == "pruned" and recs["t001"]["metrics"]["step"] == 10
    assert recs["t002"]["status"] == "completed" and recs["t002"]["metrics"]["step"] == 20
    assert recs["t002"]["metrics"]["workers"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_worker_trial_runs_its_lm_eval_node_on_rank_0(local_ray, tmp_path):
    """The trial process holds no model (its workers do): the eval.lm_eval tasks run on rank 0 and come back with
    its result, to the report and to MLflow (before, they were skipped without a word). Their numbers are those of
    the same trial trained by one process (float32: summation order differs)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    from mlflow.tracking import MlflowClient

    from atlaslab.eval import run_lm_eval, tokenizer_for
    from atlaslab.search.driver import run

    tok = {"name": "bpe_local", "vocab_size": 512, "val_fraction": 0.05, "test_fraction": 0.2,
           "cache_dir": str(tmp_path / "tok")}
    lm_eval = {"tasks": ["pydoc_lastword"], "limit": 8, "builtin_tasks": False,
               "include_path": str(Path(__file__).resolve().parents[2] / "experiments" / "lm_tasks")}
    exp = node(steps=6, model={"preset": "transformer", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
               task={"name": "lm_corpus", "corpus": "pydoc", "seq_len": 32, "val_fraction": 0.05,
                     "test_fraction": 0.2, "eval_examples": 4, "tokenizer": tok},
               eval={"interval": 3, "examples": 4, "lm_eval": lm_eval}, metric="val/loss", mode="min")
    p = prepare(node=exp)
    s = run(p, run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    assert s["status"] == "finished" and s["completed"] == 1, s
    got = json.loads((tmp_path / "run" / "results.json").read_text())[0]["metrics"]
    assert got["workers"] == 2
    names = ("lm_eval/pydoc_lastword/perplexity", "lm_eval/pydoc_lastword/acc")
    assert all(k in got for k in names), sorted(got)

    ref = reference(p.trials[0])
    want = run_lm_eval(ref.model, tokenizer_for(ref.task), lm_eval, max_length=32)
    assert got[names[0]] == pytest.approx(want[names[0]], rel=1e-3) and got[names[1]] == want[names[1]]

    state = json.loads((tmp_path / "run" / "state.json").read_text())
    c = MlflowClient(state["tracking"]["uri"])
    child = next(r for r in c.search_runs([state["tracking"]["experiment_id"]]) if "mlflow.parentRunId" in r.data.tags)
    assert child.data.metrics[names[0]] == pytest.approx(got[names[0]])
