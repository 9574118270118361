"""The search driver without Ray: experiment schema, expansion, validation, search spaces, reports.

Ray / MLflow end-to-end behaviour is in ``test_search_ray.py``.
"""
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atlaslab.registry import ConfigError
from atlaslab.search.driver import prepare, trial_table
from atlaslab.search.expand import TrialConfigError, expand_grid, model_config
from atlaslab.search.schema import load_experiment

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p for p in (ROOT / "experiments").glob("*.yaml"))

TINY = {
    "name": "tiny",
    "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
    "task": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2], "eval_examples": 32},
    "eval": {"interval": 10, "examples": 32},
    "train": {"steps": 20, "batch_size": 8, "lr": 3e-3},
}


def _exp(**extra):
    node = json.loads(json.dumps(TINY))
    node.update(extra)
    return node


# --------------------------------------------------------------------------------------------------
# shipped experiments
# --------------------------------------------------------------------------------------------------
def test_experiments_are_shipped():
    names = {p.stem for p in EXPERIMENTS}
    assert {"quickstart", "atlas_ablation", "titans_ablation", "mad_protocol", "niah_extrapolation",
            "hpo_atlas"} <= names


#: experiments that read a site's own data: on a machine without it, validation stops at the field to edit
#: (tests/search/test_lm_table2.py validates lm_table2 with the paths pointed at stand-ins)
SITE_DATA = {"lm_table2": "task.data_files"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_shipped_experiment_dry_run_validates(path, capsys):
    from atlaslab.cli import main
    if path.stem in SITE_DATA:
        assert main(["run", str(path), "--dry-run"]) == 2
        assert f"): {SITE_DATA[path.stem]}: no file matches" in capsys.readouterr().err
        return
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "validated" in out and "key" in out


def test_quickstart_grid_is_the_readme_ablation():
    p = prepare(str(ROOT / "experiments" / "quickstart.yaml"))
    rows = {t["row"] for t in p.trials}
    assert any("Titans" in r for r in rows) and any("Gated DeltaNet" in r for r in rows)
    assert any("Transformer" in r for r in rows)
    assert sum(t["info"]["preset"] == "atlas" for t in p.trials) >= 5     # full + window, poly, Muon, deep
    comps = {t["row"]: t["info"]["components"] for t in p.trials}
    full = comps["ATLAS"]
    assert full["atlas.inner_optimizer"] == "muon" and full["atlas.feature_map"] == "polynomial"
    assert int(full["atlas.window_size"]) > 1 and full["atlas.memory"] == "mlp"
    assert comps["w/o Muon (GD)"]["atlas.inner_optimizer"] == "gd"
    assert comps["linear memory"]["atlas.memory"] == "linear"


# --------------------------------------------------------------------------------------------------
# bad experiments fail fast, with the dotted path and the valid choices, before Ray starts
# --------------------------------------------------------------------------------------------------
def test_bad_variant_names_trial_path_and_choices(tmp_path):
    node = _exp(model={"preset": "atlas", "overrides": {"d_model": 16, "mixers.atlas.num_heads": 2,
                                                         "mixers.atlas.memory.chunk_size": 4}},
                grid={"variants": {"ATLAS": {}, "w/o Muon": {"model.mixers.atlas.memory.inner_optimizer":
                                                             {"name": "muom"}}}})
    with pytest.raises(TrialConfigError) as ei:
        prepare(node=node)
    msg = str(ei.value)
    assert msg.startswith("trial t001 (w/o Muon)")
    assert "model.mixers.atlas.memory.inner_optimizer.name" in msg
    assert "Did you mean 'muon'" in msg and "Valid choices:" in msg and "gd" in msg
    assert "grid.variants.w/o Muon" in msg            # which line of the file set it


@pytest.mark.parametrize("change, path, needle", [
    ({"grdi": {}}, "grdi", "Valid choices:"),
    ({"task": {"name": "mqarr"}}, "task.name", "Did you mean 'mqar'"),
    ({"train": {"stesp": 3}}, "train.stesp", "steps"),
    ({"grid": {"axes": {"modle.d_model": [16, 32]}}}, "grid.axes.modle.d_model", "model, task, tasks, train, eval"),
    ({"grid": {"mode": "cros"}}, "grid.mode", "cross, zip"),
    ({"scheduler": {"name": "hyperband"}}, "scheduler.name", "asha"),
    ({"search": {"space": {"train.lr": {"type": "float", "low": 1e-3}}}}, "search.space.train.lr.high", "high"),
    ({"search": {"space": {"train.lr": {"type": "flaot", "low": 1e-3, "high": 1e-2}}}},
     "search.space.train.lr.type", "categorical"),
    ({"model": {"preset": "atlass"}}, "model.preset", "Did you mean 'atlas'"),
    ({"grid": {"variants": {"A": {"model.mixers.gated_deltanet.memory.retention.name": "decya"}}}},
     "model.mixers.gated_deltanet.memory.retention.name", "Did you mean 'decay'"),
])
def test_bad_experiment_errors(change, path, needle):
    node = _exp(**change)
    with pytest.raises(ConfigError) as ei:
        prepare(node=node)
    assert path in str(ei.value), str(ei.value)
    assert needle in str(ei.value), str(ei.value)


def test_bad_file_fails_before_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""
        name: bad
        model: {preset: gated_deltanet, overrides: {d_model: 16}}
        task: {name: mqar, vocab_size: 16, seq_len: 16, num_kv_pairs: [2]}
        train: {steps: 5}
        grid:
          variants:
            ok: {}
            broken: {model.mixers.gated_deltanet.memory.inner_optimizer.name: adamw}
    """))
    code = ("import sys, time; from atlaslab.cli import main; t = time.time(); rc = main(sys.argv[1:]); "
            "print('RC', rc, 'RAY', 'ray' in sys.modules, 'T', round(time.time() - t, 2))")
    r = subprocess.run([sys.executable, "-c", code, "run", str(bad)], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert "RC 2 RAY False" in r.stdout, r.stdout + r.stderr
    assert "trial t001 (broken)" in r.stderr
    assert "model.mixers.gated_deltanet.memory.inner_optimizer.name" in r.stderr
    assert "Valid choices: gd" in r.stderr


# --------------------------------------------------------------------------------------------------
# expansion
# --------------------------------------------------------------------------------------------------
def test_grid_cross_zip_variants_protocol_seeds():
    node = _exp(grid={"mode": "cross", "variants": {"A": {}, "B": {"train.lr": 1e-3}},
                      "axes": {"model.d_model": [16, 32], "train.batch_size": [4, 8]}},
                protocol={"lr": [1e-3, 3e-3], "weight_decay": [0.0]}, seeds=[0, 1])
    exp = load_experiment(node=node)
    trials = expand_grid(exp)
    assert len(trials) == 2 * 4 * 2 * 2
    assert len({t["key"] for t in trials}) == len(trials)
    assert len({t["row"] for t in trials}) == 8
    t = trials[-1]
    assert t["variant"] == "B" and t["seed"] == 1 and t["protocol"] == {"lr": 3e-3, "weight_decay": 0.0}
    assert t["config"]["train"]["lr"] == 3e-3          # the protocol comes after the variant's lr
    assert t["config"]["train"]["seed"] == 1 and t["config"]["train"]["eval_interval"] == 10
    assert ["d_model", 32, "grid.axes.model.d_model"] in t["config"]["model"]["overrides"]
    node["grid"]["mode"] = "zip"
    trials = expand_grid(load_experiment(node=node))
    assert len(trials) == 2 * 2 * 2 * 2
    assert {(t["axes"]["model.d_model"], t["axes"]["train.batch_size"]) for t in trials} == {(16, 4), (32, 8)}
    node["grid"]["axes"]["train.batch_size"] = [4, 8, 16]
    with pytest.raises(ConfigError, match="zipped axes need equal lengths"):
        load_experiment(node=node)


def test_wildcard_overrides_touch_only_mixers_that_have_the_field():
    cfg = model_config({"preset": "titans_mag", "overrides": [["d_model", 32, "x"], ["mixers.*.num_heads", 2, "y"],
                                                              ["mixers.*.memory.chunk_size", 4, "z"]]})
    from omegaconf import OmegaConf
    c = OmegaConf.to_container(cfg)
    (key, node), = c["mixers"].items()
    assert node["num_heads"] == 2 and node["memory"]["chunk_size"] == 4
    with pytest.raises(ConfigError, match="matches no key") as info:     # the rule of atlaslab.models.overrides
        model_config({"preset": "transformer", "overrides": [["mixers.*.memory.chunk_size", 4, "z"]]})
    assert info.value.source == "z"
    cfg = model_config({"preset": "transformer", "overrides": [["?mixers.*.memory.chunk_size", 4, "z"]]})
    assert "memory" not in OmegaConf.to_container(cfg)["mixers"]["transformer"]


def test_task_settings_and_eval_mapping():
    node = _exp(tasks={"short": {"name": "mqar", "vocab_size": 16, "seq_len": 16, "num_kv_pairs": [2]},
                       "long": {"name": "mqar", "vocab_size": 16, "seq_len": 32, "num_kv_pairs": [4]}},
                eval={"interval": 5, "lengths": [16, 32]},
                grid={"axes": {"tasks.long.power_a": [0.01, 1.0]}})
    node.pop("task")
    p = prepare(node=node)
    assert len(p.trials) == 4
    longs = [t for t in p.trials if t["setting"] == "long"]
    assert {t["config"]["task"]["power_a"] for t in longs} == {0.01, 1.0}
    assert all("power_a" not in t["config"]["task"] for t in p.trials if t["setting"] == "short")
    assert all(t["config"]["train"]["test_lengths"] == [16, 32] for t in p.trials)
    assert all(t["info"]["state_size"] > 0 and t["info"]["num_parameters"] > 0 for t in p.trials)
    table = trial_table(p)
    assert "long" in table and "power_a=0.01" in table


# --------------------------------------------------------------------------------------------------
# search spaces
# --------------------------------------------------------------------------------------------------
SEARCH = {
    "model": {"preset": "atlas", "overrides": {"d_model": 16, "mixers.atlas.num_heads": 4,
                                               "mixers.atlas.memory.chunk_size": 4,
                                               "mixers.atlas.memory.memory.expansion": 1}},
    "search": {"sampler": "random", "seed": 3, "space": {
        "train.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
        "model.mixers.atlas.memory.inner_optimizer.name": ["muon", "gd", "momentum"],
        "model.mixers.atlas.memory.inner_optimizer.ns_steps": {
            "type": "int", "low": 1, "high": 5, "when": {"model.mixers.atlas.memory.inner_optimizer.name": "muon"}},
        "model.mixers.atlas.memory.inner_optimizer.momentum": {
            "type": "float", "low": 0.5, "high": 0.99,
            "when": {"model.mixers.atlas.memory.inner_optimizer.name": ["muon", "momentum"]}},
        "model.mixers.atlas.memory.memory": [{"name": "linear"}, {"name": "mlp", "depth": 2, "expansion": 1}],
    }},
    "num_samples": 8, "scheduler": {"name": "asha", "grace_period": 10},
}


def test_conditional_search_space_produces_only_valid_configs():
    import optuna

    from atlaslab.search.expand import Validator, trial_from_params
    from atlaslab.search.space import sample
    node = _exp(**SEARCH)
    exp = load_experiment(node=node)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    v = Validator(exp)
    seen = set()
    opt, ns, mom = ("model.mixers.atlas.memory.inner_optimizer." + k for k in ("name", "ns_steps", "momentum"))
    for i in range(40):
        trial = study.ask()
        sample(exp.space, trial)
        params = sample(exp.space, optuna.trial.FixedTrial(trial.params))
        assert (ns in params) == (params[opt] == "muon")
        assert (mom in params) == (params[opt] in ("muon", "momentum"))
        assert set(trial.params) == set(params)
        t = trial_from_params(exp, params, key=f"s{i}")
        v.validate(t)                                       # builds the model: every sample is a valid config
        seen.add((params[opt], params["model.mixers.atlas.memory.memory"]["name"]))
        study.tell(trial, 0.0)
    assert len(seen) == 6


def test_a_trial_builds_the_model_the_driver_validated(tmp_path):
    """A validated trial carries its model config: a worker builds the model whose size the driver recorded,
    even after the preset file changed (as before a resume); the trial stays JSON (trials.json, Tune)."""
    import shutil

    from atlaslab.models.presets import preset_path
    from atlaslab.search.build import build_trial
    preset = tmp_path / "gdn.yaml"
    shutil.copy(preset_path("gated_deltanet"), preset)
    p = prepare(node=_exp(model={"preset": str(preset), "overrides": {"d_model": 16, "mixers.*.num_heads": 2}}))
    trial = json.loads(json.dumps(p.trials[0]))
    preset.write_text("mixers: {gated_deltanet: {name: no_such_mixer}}\n")
    task, tcfg, model = build_trial(trial)
    assert model.num_parameters() == trial["info"]["num_parameters"]
    assert model.state_size(task.seq_len) == trial["info"]["state_size"]
    assert trial["model_config"]["d_model"] == 16 and tcfg.steps == 20


def test_overrides_are_taken_after_an_option_too(capsys):
    """`atlaslab run EXP --dry-run train.steps=7` applies the override (argparse alone stops collecting positionals
    at the first option); a real unknown option is still argparse's error."""
    from atlaslab.cli import main
    quick = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    assert main(["run", str(quick), "--dry-run", "train.steps=7", "seeds=[0]"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("t00")]
    assert rows and all(r[-1] == "7" for r in rows)
    with pytest.raises(SystemExit):
        main(["run", str(quick), "--dry-run", "--no-such-option"])


def test_search_dry_run_admits_every_choice_of_the_space():
    p = prepare(node=_exp(**SEARCH))
    opts = [t["params"]["model.mixers.atlas.memory.inner_optimizer.name"] for t in p.trials]
    assert set(opts) == {"muon", "gd", "momentum"}
    assert {t["params"]["model.mixers.atlas.memory.memory"]["name"] for t in p.trials} == {"linear", "mlp"}
    targets = sum(len(prm.choices) if prm.type == "categorical" else 2 for prm in p.exp.space.values())
    assert len(p.trials) <= targets         # one admitted draw per choice or range end at most, not the product
    assert all(("model.mixers.atlas.memory.inner_optimizer.ns_steps" in t["params"]) == (
        t["params"]["model.mixers.atlas.memory.inner_optimizer.name"] == "muon") for t in p.trials)
    assert "when model.mixers.atlas.memory.inner_optimizer.name=muon" in trial_table(p)


def test_search_condition_must_reference_an_earlier_choice():
    node = _exp(**SEARCH)
    node["search"]["space"]["model.mixers.atlas.memory.inner_optimizer.ns_steps"]["when"] = {
        "model.mixers.atlas.memory.inner_optimizer.name": "muonn"}
    with pytest.raises(ConfigError, match="'muonn' is not a choice") as ei:
        prepare(node=node)
    assert "Valid choices: muon, gd, momentum" in str(ei.value)


# --------------------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------------------
def _rec(key, row, seed, acc, status="completed", proto=None, variant=None, failed=False, msg=""):
    metrics = {"val/accuracy": acc, "test/accuracy": acc, "step": 20, "final": 1, "status": status,
               "test/len_16/accuracy": acc, "test/len_32/accuracy": acc / 2}
    hist = [{"step": 10, "val/accuracy": acc / 2}, {"step": 20, "val/accuracy": acc}]
    return {"key": key, "index": int(key[1:]), "setting": "mqar", "variant": variant or row, "label": row,
            "row": row, "axes": {}, "protocol": proto or {}, "seed": seed, "params": {}, "status": status,
            "failed": failed, "message": msg, "metrics": metrics if not failed else {"step": 2}, "history": hist,
            "info": {"num_parameters": 1000, "state_size": 64}, "train": {"steps": 20, "batch_size": 8},
            "task": {"name": "mqar"}}


def test_report_means_protocol_deltas_failures_and_plots(tmp_path):
    from atlaslab.search.report import aggregate, write_report
    node = _exp(grid={"variants": {"A": {}, "B": {}, "C": {}}, "baseline": "A"},
                protocol={"lr": [1e-3, 1e-2]}, seeds=[0, 1])
    exp = load_experiment(node=node)
    lo, hi = {"lr": 1e-3}, {"lr": 1e-2}
    recs = [_rec("t000", "A", 0, 0.5, proto=lo), _rec("t001", "A", 1, 0.7, proto=lo),
            _rec("t002", "A", 0, 0.2, proto=hi), _rec("t003", "A", 1, 0.2, proto=hi),
            _rec("t004", "B", 0, 0.9, proto=lo), _rec("t005", "B", 1, 0.9, proto=lo),
            _rec("t006", "B", 0, 0.1, proto=hi), _rec("t007", "B", 1, 0.3, proto=hi),
            _rec("t008", "C", 0, 0.0, status="diverged", proto=lo, failed=True, msg="diverged at step 2 (loss = nan)"),
            _rec("t009", "C", 1, 0.4, proto=lo), _rec("t010", "C", 0, 0.3, proto=hi),
            _rec("t011", "C", 1, 0.3, proto=hi)]
    rows = {r["row"]: r for r in aggregate(exp, recs)}
    assert rows["A"]["protocol"] == lo and math.isclose(rows["A"]["val/accuracy"], 0.6)
    assert math.isclose(rows["A"]["val/accuracy std"], math.sqrt(0.02))
    assert rows["A"]["baseline"] and rows["A"]["val/accuracy delta"] is None
    assert math.isclose(rows["B"]["val/accuracy delta"], 0.3)
    assert rows["C"]["protocol"] == lo and rows["C"]["n_ok"] == 1 and math.isclose(rows["C"]["val/accuracy"], 0.4)
    assert rows["C"]["n_failed"] == 1
    out = write_report(tmp_path, exp, recs, {"command": "atlaslab run x.yaml", "wall_s": 12})
    text = out.read_text()
    assert "| A (baseline) | 0.600 ± 0.141 |" in text
    assert "+0.300" in text and "diverged at step 2 (loss = nan)" in text and "best lr / wd" in text
    assert "atlaslab run x.yaml" in text
    for f in ("report.csv", "trials.csv", "plots/bar_val_accuracy.png", "plots/curves.png", "plots/length.png"):
        assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size > 100, f
    import csv
    rows_csv = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [r["row"] for r in rows_csv] == ["A", "B", "C"]
    assert len(list(csv.DictReader(open(tmp_path / "trials.csv")))) == 12


def test_mad_score_best_per_setting_then_mean():
    from atlaslab.search.report import mad_scores
    rows = [{"label": "m", "setting": "in_context_recall/baseline", "acc": 0.8},
            {"label": "m", "setting": "in_context_recall/seq_len_256", "acc": 0.6},
            {"label": "m", "setting": "selective_copying/baseline", "acc": 0.4}]
    s = mad_scores(rows, "acc")["m"]
    assert math.isclose(s["in_context_recall"], 0.7) and math.isclose(s["mad_score"], 0.55)


def test_trial_config_as_mlflow_params():
    from atlaslab.search.tracking import config_params
    f = config_params({"model": {"preset": "atlas", "overrides": [["d_model", 16, "x"], ["d_model", 32, "y"],
                                                                   ["mixers.atlas.memory.window", {"size": 1}, "z"]]},
                       "train": {"lr": 0.1, "test_lengths": [16, 32]}})
    assert f["model.preset"] == "atlas" and f["train.lr"] == "0.1" and f["train.test_lengths"] == "[16, 32]"
    assert f["model.overrides.d_model"] == "32"                       # the effective (last) value
    assert f["model.overrides.mixers.atlas.memory.window.size"] == "1"


def test_state_plot_draws_a_variant_seen_at_several_state_sizes(tmp_path):
    from atlaslab.search.report import plot_state
    rows = [{"variant": v, "label": f"{v} d={d}", "setting": "mqar", "state_size": s, "val/accuracy": a,
             "val/accuracy std": 0.01} for v, d, s, a in
            [("gdn", 16, 1000, 0.5), ("gdn", 32, 4000, 0.8), ("attention", 16, 8000, 1.0)]]
    assert plot_state(rows, "val/accuracy", tmp_path / "state.png") == tmp_path / "state.png"
    assert (tmp_path / "state.png").stat().st_size > 1000
    one_size = [dict(r, state_size=64) for r in rows]          # no variant at two sizes: nothing to draw
    assert plot_state(one_size, "val/accuracy", tmp_path / "none.png") is None


def test_report_steps_to_threshold_column(tmp_path):
    from atlaslab.search.report import aggregate, steps_to, write_report
    exp = load_experiment(node=_exp(grid={"variants": {"A": {}, "B": {}}}, seeds=[0, 1],
                                    report={"steps_to": 0.6}))
    recs = [_rec("t000", "A", 0, 0.7), _rec("t001", "A", 1, 0.5), _rec("t002", "B", 0, 1.4), _rec("t003", "B", 1, 1.4)]
    assert steps_to(recs[0], "val/accuracy", 0.6, "max") == 20            # history: 0.35 at 10, 0.7 at 20
    assert steps_to(recs[1], "val/accuracy", 0.6, "max") is None
    assert steps_to(recs[2], "val/accuracy", 0.6, "max") == 10            # 0.7 already at step 10
    assert steps_to(recs[0], "val/accuracy", 0.4, "min") == 10
    rows = {r["row"]: r for r in aggregate(exp, recs)}
    assert rows["A"]["steps_to"] == 20 and rows["A"]["steps_to n"] == 1 and rows["B"]["steps_to"] == 10
    text = write_report(tmp_path, exp, recs).read_text()
    assert "steps to 0.6" in text and "| 20 (1/2) |" in text and "| 10 ± 0 |" in text


def test_grid_exclude_drops_named_points_and_rejects_typos():
    axes = {"model.d_model": [16, 32], "train.batch_size": [4, 8]}
    node = _exp(grid={"variants": {"A": {}, "B": {}}, "axes": axes,
                      "exclude": [{"variant": "B", "model.d_model": 32}, {"train.batch_size": 8, "model.d_model": 16}]})
    trials = expand_grid(load_experiment(node=node))
    points = {(t["variant"], t["axes"]["model.d_model"], t["axes"]["train.batch_size"]) for t in trials}
    assert points == {("A", 16, 4), ("A", 32, 4), ("A", 32, 8), ("B", 16, 4)}
    for bad, path, choices in [({"variant": "C"}, "grid.exclude.0.variant", "A, B"),
                               ({"model.d_modl": 16}, "grid.exclude.0.model.d_modl", "variant, model.d_model"),
                               ({"model.d_model": 64}, "grid.exclude.0.model.d_model", "16, 32"),
                               ({}, "grid.exclude.0", None)]:
        node["grid"]["exclude"] = [bad]
        with pytest.raises(ConfigError) as e:
            load_experiment(node=node)
        assert path in str(e.value) and (choices is None or choices in str(e.value))


def test_report_averages_are_each_trials_mean_then_the_seeds_mean_and_labels_name_columns(tmp_path):
    from atlaslab.search.report import aggregate, write_report
    avg = {"Avg": ["test/accuracy", "test/len_32/accuracy"]}
    exp = load_experiment(node=_exp(grid={"variants": {"A": {}, "B": {}}}, seeds=[0, 1],
                                    report={"metrics": ["test/accuracy"], "averages": avg,
                                            "labels": {"test/accuracy": "Acc"}}))
    recs = [_rec("t000", "A", 0, 0.6), _rec("t001", "A", 1, 0.4), _rec("t002", "B", 0, 0.8), _rec("t003", "B", 1, 0.2)]
    del recs[3]["metrics"]["test/len_32/accuracy"]           # a trial without one of the parts has no average
    rows = {r["row"]: r for r in aggregate(exp, recs)}
    assert math.isclose(rows["A"]["Avg"], (0.6 + 0.3 + 0.4 + 0.2) / 4)      # (acc + acc/2) / 2 per trial, then seeds
    assert math.isclose(rows["B"]["Avg"], (0.8 + 0.4) / 2) and rows["B"]["Avg std"] is None
    assert math.isclose(rows["B"]["Avg delta"], 0.6 - 0.375)
    text = write_report(tmp_path, exp, recs).read_text()
    assert "| variant | Acc | Δ | Avg | Δ |" in text and "| A (baseline) | 0.500 ± 0.141 |  | 0.375 ± 0.106 |" in text
    for bad, path in (({"Avg": []}, "report.averages.Avg"), ({"Avg": ["Avg"]}, "report.averages.Avg"),
                      ({"Avg": ["x/y"], "Two": ["Avg"]}, "report.averages.Two.0")):
        with pytest.raises(ConfigError) as e:
            load_experiment(node=_exp(report={"averages": bad}))
        assert e.value.path == path


def test_grid_exclude_by_seed_runs_a_variant_on_fewer_seeds():
    node = _exp(seeds=[0, 1, 2], grid={"variants": {"A": {}, "B": {}},
                                       "exclude": [{"variant": "B", "seed": 1}, {"variant": "B", "seed": 2}]})
    trials = expand_grid(load_experiment(node=node))
    assert [(t["variant"], t["seed"]) for t in trials] == [("A", 0), ("A", 1), ("A", 2), ("B", 0)]
    assert [t["key"] for t in trials] == ["t000", "t001", "t002", "t003"]
    node["grid"]["exclude"] = [{"variant": "B", "seed": 3}]
    with pytest.raises(ConfigError) as e:
        load_experiment(node=node)
    assert "grid.exclude.0.seed" in str(e.value) and "0, 1, 2" in str(e.value)
