"""The one override module: one dotlist parser, one wildcard rule (no match is an error unless the key starts with
'?', where present), one completion of a preset for a task; the same rule for show/train (presets) and the search
expansion."""
import pytest
from omegaconf import OmegaConf

from atlaslab.models.overrides import complete_for_task, override_items, parse_override
from atlaslab.models.presets import load_preset, preset_for_task
from atlaslab.registry import ConfigError
from atlaslab.search.expand import model_config


def test_one_parser_for_every_form():
    assert parse_override("+train.lr=1e-3") == ("train.lr", 1e-3)
    assert parse_override("mixers.x.memory.memory={name: linear}") == ("mixers.x.memory.memory", {"name": "linear"})
    assert parse_override("name=a: b: c")[0] == "name"       # not YAML: kept as the string
    for bad in ("no_equals", "=1", 3):
        with pytest.raises(ConfigError, match="key"):
            parse_override(bad)
    items = override_items({"d_model": 8, "mixers": {"a": {"num_heads": 2, "memory": {"retention": {"name": "decay"}}}}})
    assert items == [("d_model", 8, "overrides.d_model"), ("mixers.a.num_heads", 2, "overrides.mixers.a.num_heads"),
                     ("mixers.a.memory.retention", {"name": "decay"}, "overrides.mixers.a.memory.retention")]
    assert override_items(["d_model=8", ["num_layers", 1, "src"]]) == [("d_model", 8, "overrides.0"),
                                                                       ("num_layers", 1, "src")]


def test_a_wildcard_that_matches_nothing_is_an_error_unless_where_present():
    for load in (lambda ov: load_preset("transformer", ov),                                   # show / train
                 lambda ov: model_config({"preset": "transformer", "overrides": [[ov[0].split("=")[0],  # search
                                                                                  "chunked", "src"]]})):
        with pytest.raises(ConfigError, match="matches no key") as info:
            load(["mixers.*.mode=chunked"])
        assert "?mixers.*.mode" in str(info.value)
        cfg = load(["?mixers.*.mode=chunked"])
        assert "mode" not in OmegaConf.to_container(cfg)["mixers"]["transformer"]
    cfg = load_preset("gated_deltanet", ["?mixers.*.mode=recurrent", "?no_such_field=1"])
    assert cfg.mixers.gated_deltanet.mode == "recurrent" and "no_such_field" not in cfg


def test_a_preset_is_completed_for_a_task_in_one_place():
    _, resolved = preset_for_task("deltanet", {"d_model": 16}, vocab_size=40)
    assert resolved.config.vocab_size == 40 and resolved.config.d_model == 16
    _, resolved = preset_for_task("deltanet", ["vocab_size=12"], vocab_size=40)     # the user's value wins
    assert resolved.config.vocab_size == 12
    cfg = complete_for_task(OmegaConf.create({"vocab_size": 1}), [["?vocab_size", 7, "x"]], vocab_size=40)
    assert cfg.vocab_size == 7
    with pytest.raises(ConfigError) as info:                                         # the source of the culprit
        preset_for_task("deltanet", [["mixers.deltanet.num_heads", 0, "grid.axes.model.x"]], 40)
    assert info.value.source == "grid.axes.model.x"


def test_where_present_in_a_grid_key():
    from atlaslab.search.driver import prepare
    node = {"name": "w", "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.*.num_heads": 2}},
            "task": {"name": "mqar", "vocab_size": 16, "seq_len": 8, "num_kv_pairs": [2], "eval_examples": 8},
            "train": {"steps": 2, "batch_size": 4}, "seeds": [0], "metric": "val/accuracy",
            "grid": {"variants": {"gdn": {"model.?mixers.*.mode": "recurrent"},
                                  "attention": {"model.preset": "transformer", "model.?mixers.*.mode": "recurrent"}}}}
    p = prepare(node=node)
    assert p.trials[0]["model_config"]["mixers"]["gated_deltanet"]["mode"] == "recurrent"
    assert "mode" not in p.trials[1]["model_config"]["mixers"]["transformer"]
    node["grid"]["variants"]["attention"] = {"model.preset": "transformer", "model.mixers.*.mode": "recurrent"}
    with pytest.raises(ConfigError, match=r"trial t001 .*matches no key.*set by grid\.variants\.attention"):
        prepare(node=node)


def test_a_wildcard_is_matched_against_a_config_resolved_once(monkeypatch):
    """Sizing a search candidate applies the same overrides at several head counts: the config each size wildcard
    is matched against is the same every time, so its defaults are resolved once, and the result is unchanged."""
    from atlaslab.models import overrides

    calls = []
    resolve = overrides.resolve_lm_config
    monkeypatch.setattr(overrides, "resolve_lm_config", lambda cfg: calls.append(1) or resolve(cfg))
    monkeypatch.setattr(overrides, "_DEFAULTS", {})
    built = []
    for heads in (1, 2, 4, 8):
        cfg, _ = preset_for_task("gated_deltanet", ["d_model=32", "mixers.swa={name: swa, num_heads: 4}",
                                                           f"mixers.*.num_heads={heads}"], vocab_size=64)
        built.append(cfg)
    assert len(calls) == 1, calls           # the wildcard's config, before num_heads is set: the same each time
    assert [c.mixers.gated_deltanet.num_heads for c in built] == [1, 2, 4, 8]
    assert [c.mixers.swa.num_heads for c in built] == [1, 2, 4, 8]
