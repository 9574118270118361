"""The training loop: learning, determinism, resume after a kill, divergence, early stop, callbacks,
config validation and the ``atlaslab train`` command. Tiny self-contained models keep it CPU-fast."""
import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.registry import ConfigError
from atlaslab.tasks import build_task
from atlaslab.train import TrainConfig, load_checkpoint, lr_at, resolve_train_config, train
from atlaslab.train.cli import main as cli_main
from atlaslab.train.cli import run_config

TESTS = Path(__file__).resolve().parent


pytestmark = pytest.mark.usefixtures("one_thread")


class TinyAttention(nn.Module):
    """Embedding + learned positions + causal softmax attention blocks with MLPs: [B, T] -> [B, T, V]."""

    def __init__(self, vocab_size: int, d: int = 64, layers: int = 2, heads: int = 2, max_len: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        self.emb, self.pos, self.heads = nn.Embedding(vocab_size, d), nn.Embedding(max_len, d), heads
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            n1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), o=nn.Linear(d, d), n2=nn.LayerNorm(d),
            mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))) for _ in range(layers))
        self.drop = nn.Dropout(dropout)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab_size)

    def forward(self, ids):
        B, T = ids.shape
        x = self.drop(self.emb(ids) + self.pos(torch.arange(T, device=ids.device)))
        for b in self.blocks:
            q, k, v = b["qkv"](b["n1"](x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + self.drop(b["o"](a))
            x = x + self.drop(b["mlp"](b["n2"](x)))
        return self.head(self.norm(x))


def tiny_model(vocab_size: int = 32, d: int = 16, layers: int = 1, dropout: float = 0.1, seed: int = 0):
    """Factory used by the CLI test (``test_train:tiny_model``) and the resume tests."""
    torch.manual_seed(seed)
    return TinyAttention(vocab_size, d=d, layers=layers, heads=2, dropout=dropout)


SMALL_TASK = {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 16}
SMALL_TRAIN = dict(steps=24, batch_size=8, lr=1e-2, warmup_steps=3, eval_interval=8, log_interval=3,
                   checkpoint_interval=5, seed=3, test_lengths=[24])


# --------------------------------------------------------------------------------------------------
# learning
# --------------------------------------------------------------------------------------------------
def test_tiny_attention_learns_mqar_well_above_chance():
    """The calibration measurement, scaled down: 2-layer width-64 softmax attention on MQAR (V = 32, T = 16,
    4 pairs, batch 64, AdamW 3e-3) passes 90% answer accuracy (chance: 1/16 values; 1/4 for a model that
    only knows which values are in context); the early stop ends it as soon as it does (100-200 steps for
    model seeds 0-7, 100 for seed 0; the cap of 400 leaves room for other CPUs' arithmetic)."""
    task = build_task({"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": [4], "eval_examples": 128})
    torch.manual_seed(0)
    model = TinyAttention(32, d=64, layers=2, heads=2)
    res = train(model, task, steps=400, batch_size=64, lr=3e-3, schedule="constant", warmup_steps=20,
                weight_decay=0.0, eval_interval=25, early_stop_threshold=0.9, early_stop_metric="accuracy",
                log_interval=25)
    assert res.status == "early_stopped", res.summary()
    assert res.metrics["val/accuracy"] >= 0.9 and res.metrics["test/accuracy"] >= 0.8
    assert res.best["metric"] == "val/accuracy" and res.best["step"] == res.steps
    assert res.message.startswith("val/accuracy = ") and "reached 0.9" in res.message


# --------------------------------------------------------------------------------------------------
# determinism, resume, divergence
# --------------------------------------------------------------------------------------------------
def test_same_config_and_seed_give_identical_metrics():
    task = build_task(SMALL_TASK)
    a = train(tiny_model(), task, SMALL_TRAIN)
    b = train(tiny_model(), task, SMALL_TRAIN)
    assert a.status == "completed" and a.steps == 24
    assert a.metrics == b.metrics and a.history == b.history
    assert {"train/loss", "train/lr", "val/accuracy", "test/accuracy", "test/len_24/accuracy"} <= set(a.metrics)
    c = train(tiny_model(), task, {**SMALL_TRAIN, "seed": 4})
    assert c.metrics["train/loss"] != a.metrics["train/loss"]


class Killed(Exception):
    pass


def test_a_run_killed_midway_resumes_to_the_same_result(tmp_path):
    task = build_task(SMALL_TASK)
    ref = train(tiny_model(), task, SMALL_TRAIN)

    def kill_at_12(metrics, step):
        if step >= 12:
            raise Killed()

    with pytest.raises(Killed):                        # dies after the checkpoint of step 10, mid log interval
        train(tiny_model(), task, SMALL_TRAIN, callback=kill_at_12, checkpoint_dir=tmp_path)
    seen = []
    res = train(tiny_model(seed=99), task, SMALL_TRAIN, checkpoint_dir=tmp_path,
                callback=lambda m, s: seen.append(s))
    assert res.resumed_from == 10 and seen[0] == 12
    assert res.metrics == ref.metrics and res.history == ref.history and res.best == ref.best
    for p, q in zip(res.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    again = train(tiny_model(seed=5), task, SMALL_TRAIN, checkpoint_dir=tmp_path)    # finished: stored result
    assert again.resumed_from == 24 and again.metrics == ref.metrics
    with pytest.raises(ConfigError, match=r"train: .*lr: 0\.01 → 0\.02"):
        train(tiny_model(), task, {**SMALL_TRAIN, "lr": 2e-2}, checkpoint_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^task: .*another task"):
        train(tiny_model(), build_task({**SMALL_TASK, "seed": 1}), SMALL_TRAIN, checkpoint_dir=tmp_path)


@pytest.mark.parametrize("interval", [0, 5])
def test_the_callback_of_a_step_finds_the_checkpoint_of_that_step(tmp_path, interval):
    """The checkpoint due at step N is on disk, history included, before the callback of step N runs (the search's
    Ray checkpoint of the report of step N is a copy of it); with ``checkpoint_interval`` 5 the file of every call is
    that of the last multiple of 5, with 0 that of the last evaluation."""
    cfg = {**SMALL_TRAIN, "checkpoint_interval": interval}
    seen = []

    def check(metrics, step):
        evaluation = any(k.startswith("val/") for k in metrics)
        due = step % interval == 0 if interval else evaluation
        if not due or not any(k.startswith(("train/", "val/")) for k in metrics):
            return                                     # (the end's test metrics come after the final checkpoint)
        ckpt = load_checkpoint(tmp_path)
        assert ckpt is not None, f"no checkpoint on disk at the callback of step {step}"
        state = ckpt["state"]
        assert state["step"] == step and state["status"] == "running", (step, state["step"])
        assert state["history"][-1] == {"step": step, **metrics}
        seen.append(step)

    res = train(tiny_model(), build_task(SMALL_TASK), cfg, callback=check, checkpoint_dir=tmp_path)
    assert res.status == "completed" and seen == ([8, 16, 24] if interval == 0 else [15])


def test_a_run_stopped_early_at_a_checkpoint_resumes_to_its_end_only(tmp_path):
    """An early stop at an evaluation (the threshold reached) is checkpointed before the callback too: a run resumed
    from that checkpoint trains no further, runs only the end (the test metrics) and ends as the run did."""
    task = build_task(SMALL_TASK)
    cfg = {**SMALL_TRAIN, "checkpoint_interval": 0, "early_stop_threshold": 0.0}    # reached at the first evaluation
    copy = tmp_path / "at_8"

    def keep(metrics, step):
        if any(k.startswith("val/") for k in metrics):
            shutil.copytree(tmp_path / "run", copy)

    ref = train(tiny_model(), task, cfg, callback=keep, checkpoint_dir=tmp_path / "run")
    assert ref.status == "early_stopped" and ref.steps == 8
    state = load_checkpoint(copy)["state"]
    assert (state["step"], state["status"], state["finished"]) == (8, "early_stopped", False)
    calls = []
    res = train(tiny_model(seed=99), task, cfg, checkpoint_dir=copy, callback=lambda m, s: calls.append((s, set(m))))
    assert res.resumed_from == 8 and res.status == "early_stopped"
    assert res.metrics == ref.metrics and res.history == ref.history
    assert len(calls) == 1 and calls[0][0] == 8 and all(k.startswith("test/") for k in calls[0][1])
    assert load_checkpoint(copy)["state"]["finished"] is True
    again = train(tiny_model(), task, cfg, checkpoint_dir=copy, callback=lambda m, s: calls.append(s))
    assert again.metrics == ref.metrics and len(calls) == 1               # finished: its stored result, no call


def test_a_step_cost_bound_ends_a_run_over_it_at_an_evaluation():
    """train.max_step_time_s: at the first evaluation a run whose training steps averaged more wall seconds than the
    bound ends as ``over_cost`` (the message gives the measured cost and the bound), and its test metrics are still
    computed; under a generous bound the same run completes. A bound ≤ 0 is a ConfigError naming the field."""
    task = build_task(SMALL_TASK)
    slow = train(tiny_model(), task, TrainConfig(**{**SMALL_TRAIN, "max_step_time_s": 1e-9}))
    assert slow.status == "over_cost" and slow.steps == 8
    assert "above train.max_step_time_s = 1e-09" in slow.message and "test/accuracy" in slow.metrics
    fine = train(tiny_model(), task, TrainConfig(**{**SMALL_TRAIN, "max_step_time_s": 60.0}))
    assert fine.status == "completed" and fine.steps == 24
    with pytest.raises(ConfigError, match=r"max_step_time_s: a bound in seconds > 0"):
        TrainConfig(**{**SMALL_TRAIN, "max_step_time_s": 0}).check()


def test_a_sigkilled_process_resumes_to_the_same_result(tmp_path):
    """The real thing: the training process is SIGKILLed mid-run, then a new process resumes."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        torch.set_num_threads(1)
        from test_train import SMALL_TASK, SMALL_TRAIN, tiny_model
        from atlaslab.tasks import build_task
        from atlaslab.train import train
        def die(metrics, step):
            if step >= 17:
                os.kill(os.getpid(), signal.SIGKILL)
        train(tiny_model(), build_task(SMALL_TASK), SMALL_TRAIN, callback=die, checkpoint_dir={str(tmp_path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (tmp_path / "checkpoint.pt").exists()
    res = train(tiny_model(seed=7), build_task(SMALL_TASK), SMALL_TRAIN, checkpoint_dir=tmp_path)
    ref = train(tiny_model(), build_task(SMALL_TASK), SMALL_TRAIN)
    assert res.resumed_from == 15
    assert res.metrics == ref.metrics and res.history == ref.history


class Exploding(nn.Module):
    """A model whose training forward returns NaN from its ``at``-th call (or whose gradient is inf)."""

    def __init__(self, at: int, where: str = "loss"):
        super().__init__()
        self.inner, self.at, self.calls, self.where = tiny_model(dropout=0.0), at, 0, where
        self.scale = nn.Parameter(torch.ones(()))
        if where == "grad":
            self.scale.register_hook(lambda g: g * math.inf if self.calls >= self.at else g)

    def forward(self, ids):
        if self.training:
            self.calls += 1
        out = self.inner(ids) * self.scale
        if self.where == "loss" and self.training and self.calls >= self.at:
            out = out * math.nan
        return out


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_divergence_ends_the_run_with_a_clear_result(where, tmp_path):
    res = train(Exploding(at=4, where=where), build_task(SMALL_TASK), SMALL_TRAIN, checkpoint_dir=tmp_path)
    assert res.status == "diverged" and res.diverged and not res.ok
    assert res.diverged_at == 4 and res.steps == 3
    assert res.message.startswith("diverged at step 4") and ("loss" if where == "loss" else "gradient") in res.message
    assert all(math.isfinite(v) for v in res.metrics.values())
    assert not any(k.startswith("test/") for k in res.metrics)        # no final evaluation of a diverged model
    json.dumps(res.to_dict())
    stored = train(Exploding(at=4, where=where), build_task(SMALL_TASK), SMALL_TRAIN, checkpoint_dir=tmp_path)
    assert stored.status == "diverged" and stored.diverged_at == 4


# --------------------------------------------------------------------------------------------------
# callbacks, schedule, config
# --------------------------------------------------------------------------------------------------
def test_callback_receives_train_val_and_test_metrics_and_can_stop(capsys):
    calls = []

    def cb(metrics, step):
        calls.append((step, dict(metrics)))
        return step >= 9

    res = train(tiny_model(), build_task(SMALL_TASK), SMALL_TRAIN, callback=cb)
    assert res.status == "stopped" and res.steps == 9 and "stopped by the callback at step 9" in res.message
    assert [s for s, _ in calls] == [3, 6, 8, 9, 9]
    assert set(calls[0][1]) == {"train/loss", "train/grad_norm", "train/lr", "train/tokens"}
    assert any(k.startswith("val/") for k in calls[2][1]) and not any(k.startswith("val/") for k in calls[3][1])
    assert all(k.startswith("test/") for k in calls[-1][1])
    assert capsys.readouterr().out == ""               # no progress bar when stdout is not a TTY


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0) and lr_at(cfg, 60) == pytest.approx(0.55)
    assert lr_at(cfg, 110) == pytest.approx(0.1)
    lin = TrainConfig(steps=10, lr=1.0, schedule="linear")
    assert lr_at(lin, 5) == pytest.approx(0.5)
    assert lr_at(TrainConfig(lr=2.0, schedule="constant"), 999) == 2.0


def test_train_config_validation():
    assert resolve_train_config({"steps": 5}).steps == 5
    with pytest.raises(ConfigError, match=r"train\.stepz: .*Did you mean 'steps'"):
        resolve_train_config({"stepz": 5})
    with pytest.raises(ConfigError, match=r"train\.precision"):
        resolve_train_config({"precision": "fp8"})
    with pytest.raises(ConfigError, match=r"train\.steps"):
        resolve_train_config({"steps": 0})
    with pytest.raises(ConfigError, match=r"train\.lr"):
        resolve_train_config({"lr": "fast"})
    with pytest.raises(ConfigError, match=r"train\.early_stop_metric"):
        train(tiny_model(), build_task(SMALL_TASK), steps=2, eval_interval=1, early_stop_metric="bleu")
    with pytest.raises(TypeError, match="learnability"):
        train(tiny_model(), {"name": "learnability"}, steps=1)


def test_bf16_setting_runs_in_fp32_on_cpu():
    res = train(tiny_model(), build_task(SMALL_TASK), steps=2, batch_size=4, precision="bf16", final_eval=False)
    assert res.status == "completed"


def test_task_heads_are_trained_and_checkpointed(tmp_path):
    task = build_task({"name": "compression", "seq_len": 8, "eval_examples": 8, "decoder_dim": 16})
    cfg = dict(steps=6, batch_size=4, eval_interval=3, checkpoint_interval=2, final_eval=False)
    ref = train(tiny_model(vocab_size=16), task, cfg)
    assert type(ref.model).__name__ == "CompressionHead"

    def kill(m, s):
        if s >= 3:
            raise Killed()

    with pytest.raises(Killed):
        train(tiny_model(vocab_size=16), task, cfg, callback=kill, checkpoint_dir=tmp_path)
    res = train(tiny_model(vocab_size=16, seed=3), task, cfg, checkpoint_dir=tmp_path)
    assert res.metrics == ref.metrics


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def write_config(path: Path, model: dict, steps: int = 6) -> Path:
    import yaml
    cfg = {"name": "cli-test", "model": model, "task": SMALL_TASK,
           "train": {"steps": steps, "batch_size": 4, "eval_interval": 3, "log_interval": 3, "seed": 1}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_command_prints_saves_and_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = write_config(tmp_path / "run.yaml", {"factory": "test_train:tiny_model", "kwargs": {"d": 8}})
    run_dir = tmp_path / "run"
    assert cli_main([str(cfg), "train.lr=5e-3", "--run-dir", str(run_dir), "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((run_dir / "result.json").read_text())
    assert printed["status"] == "completed" and printed["config"]["lr"] == 5e-3
    assert saved["metrics"] == printed["metrics"] and len(saved["history"]) > 0
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoint.pt").exists()
    assert cli_main([str(cfg), "train.lr=5e-3", "--run-dir", str(run_dir), "--quiet"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["resumed_from"] == 6 and again["metrics"] == printed["metrics"]
    # configuration errors: one line naming the dotted path, exit status 2, nothing trained
    assert cli_main([str(cfg), "task.num_kv_pairs=[9]", "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "task.num_kv_pairs.0" in err and "Traceback" not in err
    assert cli_main([str(cfg), "train.lrr=1", "--no-checkpoint"]) == 2
    assert "train.lrr" in capsys.readouterr().err


def test_run_config_builds_an_atlaslab_language_model():
    presets = pytest.importorskip("atlaslab.models.presets")
    assert hasattr(presets, "build_model")
    node = {"model": {"d_model": 16, "num_layers": 1, "layers": ["a"],
                      "mixers": {"a": {"name": "attention", "num_heads": 2}}},
            "task": SMALL_TASK, "train": {"steps": 3, "batch_size": 4, "final_eval": False}}
    res = run_config(node)
    assert res.status == "completed" and res.model.cfg.vocab_size == 32


def test_linear_attention_recall_grows_with_state_size(one_thread):
    """The recall/state trade-off (zoology): the same linear-attention model, trained on the same MQAR budget,
    recalls far better with a 32-dim head (state 2,624 scalars) than with a 4-dim head (state 104).
    Measured: 20% vs 78% test accuracy after 150 steps (chance ≈ 6%, values-in-context ≈ 25%)."""
    from atlaslab.models.presets import build_model

    task = build_task({"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": [4], "eval_examples": 128})
    acc = {}
    for head_dim in (4, 32):
        torch.manual_seed(0)
        model = build_model("linear_attention", ["vocab_size=32", "d_model=32", "num_layers=2",
                                                 "mixers.linear_attention.num_heads=1",
                                                 f"mixers.linear_attention.head_dim={head_dim}",
                                                 f"mixers.linear_attention.value_dim={head_dim}"])
        res = train(model, task, steps=150, batch_size=64, lr=3e-3, schedule="constant", warmup_steps=20,
                    eval_interval=0, seed=0, progress="never")
        acc[model.state_size()] = res.metrics["test/accuracy"]
    (small, a_small), (large, a_large) = sorted(acc.items())
    assert small < large
    assert a_large > a_small + 0.3, acc
