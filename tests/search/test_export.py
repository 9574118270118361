"""``atlaslab export`` end to end: a tiny two-trial sweep on a local Ray (127.0.0.1), its best trial written as a
Hugging Face folder that AutoModelForCausalLM loads after ``import atlaslab``, with the trained weights, logged
to its MLflow run and registered, and as a preset file (``atlaslab export-preset``) that builds the trial's model;
another trial by key, without MLflow."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from atlaslab.cli import main  # noqa: E402
from atlaslab.models.presets import build_model  # noqa: E402
from atlaslab.search.driver import prepare, run  # noqa: E402
from atlaslab.search.export import ARTIFACT, checkpoint_of, load_checkpoint_model  # noqa: E402



def tiny(name, steps, **extra):
    return {"name": name, "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
            "task": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 32},
            "eval": {"interval": 10, "examples": 32},
            "train": {"steps": steps, "batch_size": 8, "lr": 3.0e-3, "log_interval": 5}, **extra}


def test_export_the_best_trial_and_register_it(local_ray, tmp_path, capsys):
    node = tiny("exp", steps=10, grid={"variants": {"slow": {"train.lr": 1e-4}, "fast": {"train.lr": 1e-2}}},
                max_concurrent=2)
    run_dir = tmp_path / "run"
    summary = run(prepare(node=node), run_dir=run_dir, num_cpus=2, quiet=True)
    assert summary["completed"] == 2
    recs = {r["key"]: r for r in json.loads((run_dir / "results.json").read_text())}
    best = max(recs.values(), key=lambda r: r["metrics"]["val/accuracy"])["key"]

    assert main(["export", str(run_dir)]) == 0
    folder = run_dir / "export" / best
    assert capsys.readouterr().out.strip().endswith(str(folder))
    assert {"config.json", "model.safetensors", "atlaslab_trial.json"} <= {p.name for p in folder.iterdir()}
    meta = json.loads((folder / "atlaslab_trial.json").read_text())
    assert meta["key"] == best and meta["best"] and meta["tokenizer"] is None      # MQAR: token ids, no text

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    trained, _ = load_checkpoint_model(checkpoint_of(recs[best]))
    ids = torch.randint(0, 16, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, trained(ids))
        mask = torch.tensor([[0, 0, 0] + [1] * 9, [1] * 12])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out[0, 12:].tolist() == trained.generate(ids[:1, 3:], 3)[0, 9:].tolist()

    from mlflow.tracking import MlflowClient
    state = json.loads((run_dir / "state.json").read_text())
    c = MlflowClient(state["tracking"]["uri"])
    versions = c.search_model_versions("name = 'atlaslab-exp'")
    assert len(versions) == 1 and versions[0].source.endswith(ARTIFACT)
    child = c.get_run(versions[0].run_id)
    assert child.data.tags["atlaslab.trial_key"] == best
    assert "model.safetensors" in {a.path.split("/")[-1] for a in c.list_artifacts(child.info.run_id, ARTIFACT)}

    # the same trial as a preset (atlaslab export-preset): the model of the real run's record, by its sizes
    assert main(["export-preset", str(run_dir), "--out", str(tmp_path / "best.yaml")]) == 0
    preset = build_model(capsys.readouterr().out.strip())
    info = recs[best]["info"]
    assert (preset.num_parameters(), preset.state_size(), preset.state_size_per_token()) == (
        info["num_parameters"], info["state_size_fixed"], info["state_size_per_token"])

    other = next(k for k in recs if k != best)
    assert main(["export", str(run_dir), other, "--out", str(tmp_path / "other")]) == 0
    assert not json.loads((tmp_path / "other" / "atlaslab_trial.json").read_text())["best"]
    assert len(c.search_model_versions("name = 'atlaslab-exp'")) == 1          # only the best is registered
    assert main(["export", str(run_dir), "t999"]) == 2                           # a clear error, exit 2
    assert "t999" in capsys.readouterr().err


def test_export_an_atlaslab_train_folder_with_its_byte_tokenizer(tmp_path, capsys):
    """``atlaslab train`` (byte-level text) → ``atlaslab export RUN`` → AutoModelForCausalLM + AutoTokenizer →
    ``generate`` from a left-padded batch of text prompts equals each prompt alone: the wheel check's path."""
    (tmp_path / "run.yaml").write_text(
        "name: tiny_bytes\nmodel: {preset: gated_deltanet, overrides: {d_model: 16, 'mixers.*.num_heads': 2}}\n"
        "task: {name: byte_lm, seq_len: 32, eval_examples: 8}\n"
        "train: {steps: 4, batch_size: 4, lr: 3.0e-3, eval_interval: 0}\n")
    run_dir = tmp_path / "run"
    assert main(["train", str(tmp_path / "run.yaml"), "--run-dir", str(run_dir), "--quiet"]) == 0
    assert main(["export", str(run_dir)]) == 0
    folder = run_dir / "export"
    assert capsys.readouterr().out.strip().endswith(str(folder))
    assert json.loads((folder / "atlaslab_trial.json").read_text())["tokenizer"] == "ByteTokenizer"

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    prompts = ["def f(x):", "import"]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch["input_ids"][1].tolist()[-6:] == list(b"import")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=False)
        for i, p in enumerate(prompts):
            alone = model.generate(**tok([p], return_tensors="pt", add_special_tokens=False), max_new_tokens=5,
                                   do_sample=False)
            assert out[i, batch["input_ids"].shape[1]:].tolist() == alone[0, len(p):].tolist()
    trained, _ = load_checkpoint_model(run_dir / "checkpoint.pt")
    ids = batch["input_ids"][:1]
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, trained(ids))
