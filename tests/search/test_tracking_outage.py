"""A trial's MLflow run while the tracking server does not answer: metrics wait in the trial and reach MLflow, in
order and each once, when it answers again; past the outage bound the trial stops with a clear error. The server's
absence is simulated in the client (its ``log_batch`` fails while the test says so); the slow test in
``test_faults.py`` stops a real ``mlflow server``."""
import pytest

from atlaslab.search import tracking as T


class Flaky:
    """An MlflowClient whose ``log_batch`` raises while ``down`` is set (a server that does not answer)."""

    def __init__(self, c):
        self.c, self.down = c, False

    def log_batch(self, *args, **kwargs):
        if self.down:
            raise ConnectionError("connection refused")
        return self.c.log_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.c, name)


@pytest.fixture
def trial_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    exp = T.ensure_experiment(uri, "outage", (tmp_path / "art").as_uri())
    parent = T.client(uri).create_run(exp).info.run_id
    trial = {"key": "t000", "config": {"train": {"lr": 0.1}}}
    run = T.TrialRun(uri, exp, parent, trial, run_name="t000")
    run.c = Flaky(run.c)
    return run


def history(run, key):
    return [(m.step, m.value) for m in sorted(run.c.get_metric_history(run.run_id, key), key=lambda m: m.step)]


def test_metrics_logged_while_the_server_is_away_arrive_once_it_answers(trial_run):
    run = trial_run
    run.log({"train/loss": 1.0}, 1)
    run.c.down = True
    run.log({"train/loss": 0.9}, 2)
    run.log({"train/loss": 0.8, "val/accuracy": 0.5}, 3)           # training goes on: nothing raised
    assert run.down_since is not None and {m.step for m in run.pending} == {2, 3}
    assert history(run, "train/loss") == [(1, 1.0)]
    run.c.down = False
    run.next_try = 0.0                                             # the next try is due (not a wait on the clock)
    run.log({"train/loss": 0.7}, 4)
    assert not run.pending and run.down_since is None
    assert history(run, "train/loss") == [(1, 1.0), (2, 0.9), (3, 0.8), (4, 0.7)]
    assert history(run, "val/accuracy") == [(3, 0.5)]
    assert [s for s, _ in history(run, "step")] == [1, 2, 3, 4]    # each step once
    tags = run.c.get_run(run.run_id).data.tags
    assert "the metrics of steps 2–3 waited in the trial" in tags["atlaslab.tracking_outages"]


def test_a_server_away_past_the_bound_stops_the_trial_naming_the_steps_not_sent(trial_run):
    run = trial_run
    run.outage_s = 0.0
    run.c.down = True
    with pytest.raises(T.TrackingUnavailable, match=r"metrics of trial t000 at steps 5–5 \(2 values\) were not sent"
                                                    r".*atlaslab resume"):
        run.log({"train/loss": 0.5}, 5)
