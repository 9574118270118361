"""``atlaslab export-preset``: a trial of a finished run folder as a preset file that ``atlaslab show`` builds into
the trial's model (its recorded parameter count and state size), that passes the checks every shipped preset
passes (its header cites the docs, it trains one step, ``show``'s state size matches an independent count), that
the model zoo lists once it is in the preset folder, and the errors (unknown trial, existing file, bad name).

The run folders are written here the way the driver writes them (experiment.yaml, state.json, trials.json from
:func:`prepare`, results.json with one record per trial), without Ray: the records are what a finished run holds,
with made-up final metrics. ``tests/search/test_export.py`` exports a real sweep's trial the same way.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from atlaslab.cli import main
from atlaslab.models.presets import build_model, list_presets
from atlaslab.registry import ConfigError
from atlaslab.search.driver import prepare
from atlaslab.search.preset_export import export_preset
from atlaslab.search.results import PLACE_KEYS
from test_search import TINY  # the tiny gated DeltaNet on MQAR of the search tests)

ROOT = Path(__file__).resolve().parents[2]
#: two variants that build different models: the exported preset tells which trial it came from
GRID = {"grid": {"variants": {"narrow": {}, "wide": {"model.d_model": 32, "model.num_layers": 1}}}, "seeds": [7]}



def unwrapped_header(text: str) -> str:
    """An exported preset's header comment as one line: it is prose wrapped at 116 characters around the run
    folder's path, whose length varies from machine to machine, so a phrase can fall across two lines."""
    return " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))

def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_run(run_dir, node, metrics, trials=None):
    """A finished run folder: ``metrics`` (trial key → val/accuracy) for the trials of ``prepare(node)`` (or for
    ``trials``: dicts with key and params, a search's trials, which trials.json does not hold)."""
    p = prepare(node=node)
    run_dir.mkdir(parents=True)
    (run_dir / "experiment.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(p.node)))
    (run_dir / "trials.json").write_text(json.dumps(p.trials))
    (run_dir / "state.json").write_text(json.dumps({"name": p.exp.name, "kind": p.exp.kind, "status": "finished",
                                                    "tracking": {}}))
    records = []
    for t in trials or p.trials:
        acc = metrics.get(t["key"])
        records.append({**{k: t[k] for k in PLACE_KEYS if k in t},
                        "status": "completed" if acc is not None else "error", "failed": acc is None, "message": "",
                        "metrics": {"val/accuracy": acc, "step": 20, "final": 1} if acc is not None else {},
                        "history": [], "info": {k: v for k, v in (t.get("info") or {}).items()
                                                if k not in ("train", "task")}, "path": ""})
    (run_dir / "results.json").write_text(json.dumps(records))
    return p


@pytest.fixture
def grid_run(tmp_path):
    run_dir = tmp_path / "run"
    p = write_run(run_dir, {**TINY, **GRID}, {"t000": 0.25, "t001": 0.75})
    return run_dir, {t["key"]: t for t in p.trials}


def show(capsys, target):
    """``atlaslab show TARGET``: (printed config, {parameters, state_size, state_size_per_token})."""
    assert main(["show", str(target)]) == 0
    out = capsys.readouterr().out
    cfg_text, _, numbers = out.partition("# ---")
    values = {k.strip(): int(v) for k, _, v in (line.partition(":") for line in numbers.splitlines())
              if v.strip().isdigit()}
    return yaml.safe_load(cfg_text), values


def test_the_best_trial_becomes_a_preset_that_show_builds_into_the_trials_model(grid_run, capsys):
    run_dir, trials = grid_run
    assert main(["export-preset", str(run_dir)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == run_dir / "export" / "tiny_t001.yaml"              # the best (val/accuracy max) is t001, "wide"
    cfg, values = show(capsys, path)
    info = trials["t001"]["info"]
    assert cfg["name"] == "tiny_t001" and cfg["d_model"] == 32 and cfg["num_layers"] == 1
    assert cfg["vocab_size"] == 16                                        # the task's, as the trial trained
    assert values["parameters"] == info["num_parameters"]
    assert (values["state_size"], values["state_size_per_token"]) == (info["state_size_fixed"],
                                                                      info["state_size_per_token"])
    text = path.read_text()
    head = unwrapped_header(text)
    for fact in ("experiment 'tiny'", "trial t001 (wide)", "seed 7", "val/accuracy = 0.75", "the best trial",
                 "preset gated_deltanet", "d_model=32", "gated_deltanet.memory=linear",
                 f"{info['num_parameters']:,} parameters", "docs/huggingface.md#export-preset"):
        assert fact in head, fact
    body = yaml.safe_load(text)
    assert body == {**trials["t001"]["model_config"], "name": "tiny_t001", "description": body["description"]}
    assert "wide" in body["description"] and "0.75" in body["description"]


def test_a_named_trial_into_the_preset_folder_passes_the_checks_of_every_preset(grid_run, capsys, monkeypatch,
                                                                                 tmp_path):
    run_dir, trials = grid_run
    folder = tmp_path / "presets"
    folder.mkdir()
    monkeypatch.setenv("ATLASLAB_PRESETS", str(folder))
    assert main(["export-preset", str(run_dir), "t000", "--name", "gdn_narrow", "--into-package",
                 "--description", "gated DeltaNet, narrow"]) == 0
    assert Path(capsys.readouterr().out.strip()) == folder / "gdn_narrow.yaml"
    assert list_presets() == ["gdn_narrow"]
    cfg, values = show(capsys, "gdn_narrow")                               # by name, as a shipped preset
    assert cfg["description"] == "gated DeltaNet, narrow" and cfg["d_model"] == 16
    assert values["parameters"] == trials["t000"]["info"]["num_parameters"]
    head = unwrapped_header((folder / "gdn_narrow.yaml").read_text())
    assert "status completed" in head and "the best trial" not in head   # t000 is not the best

    presets = _module("tests/models/test_presets.py", "_preset_checks")
    presets.test_preset_file_is_documented("gdn_narrow")     # header cites the docs; name = file name; description
    presets.test_preset_trains("gdn_narrow")                  # no mixing, finite, gradients, one step lowers the loss
    cli = _module("tests/test_cli.py", "_cli_checks")
    cli.test_show_prints_the_state_size_of_the_config(capsys, "gdn_narrow")   # state counted from the config

    zoo = _module("docs/gen_models.py", "_gen_models").render()              # the model zoo lists it
    assert "| [gdn_narrow](#gdn_narrow) |" in zoo and "## gdn_narrow {#gdn_narrow}" in zoo
    assert "`atlaslab/presets/gdn_narrow.yaml` (`atlaslab show gdn_narrow`)" in zoo
    assert f"| parameters | {trials['t000']['info']['num_parameters']:,} " in zoo
    assert "[export preset](huggingface.md#export-preset)" in zoo           # the header's pointer, as a link


def test_a_search_trial_is_made_again_from_its_sampled_params(tmp_path, capsys):
    node = {**TINY, "search": {"sampler": "random", "seed": 0, "space": {
        "model.mixers.gated_deltanet.memory.retention.placement": ["before_step", "after_step"],
        "model.d_model": [16, 24]}}, "num_samples": 2}
    params = {"model.mixers.gated_deltanet.memory.retention.placement": "after_step", "model.d_model": 24}
    run_dir = tmp_path / "search"
    write_run(run_dir, node, {"a1b2c3": 0.5}, trials=[{"key": "a1b2c3", "index": 0, "seed": 0, "params": params}])
    path = export_preset(run_dir)
    cfg, values = show(capsys, path)
    assert cfg["d_model"] == 24 and cfg["mixers"]["gated_deltanet"]["memory"]["retention"]["placement"] == "after_step"
    assert values["parameters"] == build_model("gated_deltanet", ["d_model=24", "mixers.*.num_heads=2",
                                                                  "vocab_size=16"]).num_parameters()
    assert "trial a1b2c3" in unwrapped_header(path.read_text())


def test_errors_name_the_trials_and_refuse_to_overwrite(grid_run, capsys):
    run_dir, _ = grid_run
    with pytest.raises(ConfigError, match="t999") as ei:
        export_preset(run_dir, "t999")
    assert ei.value.choices == ["t000", "t001"]
    assert main(["export-preset", str(run_dir), "t999"]) == 2
    assert "t000" in capsys.readouterr().err

    out = run_dir / "mine.yaml"
    assert export_preset(run_dir, "t000", out=out) == out
    assert yaml.safe_load(out.read_text())["name"] == "mine"            # the name defaults to the file's
    before = out.read_text()
    with pytest.raises(ConfigError, match="exists"):
        export_preset(run_dir, "t001", out=out)
    assert out.read_text() == before                                      # untouched
    assert export_preset(run_dir, "t001", out=out, force=True) == out
    assert yaml.safe_load(out.read_text())["d_model"] == 32

    with pytest.raises(ConfigError, match="not a preset name"):
        export_preset(run_dir, name="../evil")
    with pytest.raises(ConfigError, match="not both"):
        export_preset(run_dir, out=out, into_package=True)
    with pytest.raises(SystemExit):                                       # argparse: --out and --into-package
        main(["export-preset", str(run_dir), "--out", str(out), "--into-package"])


def test_no_completed_trial_and_a_model_that_changed_are_errors(tmp_path, monkeypatch):
    run_dir = tmp_path / "failed"
    write_run(run_dir, {**TINY, **GRID}, {})
    with pytest.raises(ConfigError, match="no finished trial") as ei:
        export_preset(run_dir)
    assert ei.value.choices == ["t000", "t001"]

    run_dir = tmp_path / "changed"
    write_run(run_dir, {**TINY, **GRID}, {"t000": 0.5})
    records = json.loads((run_dir / "results.json").read_text())
    records[0]["info"]["num_parameters"] += 1                             # as if the model code had changed since
    (run_dir / "results.json").write_text(json.dumps(records))
    with pytest.raises(ConfigError, match="num_parameters"):
        export_preset(run_dir, "t000")
    assert not (run_dir / "export").exists()
