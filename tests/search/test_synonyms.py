"""Synonymous choices: a space whose two choices build the same model (a mapping choice merged into the config's
mapping) is refused before Ray starts, naming the key; with ``search.synonyms: allow`` it runs and the dry run and
the report list the pair."""
import json

import pytest

from atlaslab.registry import ConfigError
from atlaslab.search.driver import prepare, trial_table
from atlaslab.search.mattered import search_analysis
from atlaslab.search.schema import load_experiment
from atlaslab.search.synonyms import find_synonyms
from tests.search.test_search_ray import tiny

MEMORY = "model.mixers.gated_deltanet.memory.memory"
LR = {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}


def _node(choices, **search):
    return tiny("syn", search=dict({"sampler": "random", "space": {MEMORY: choices, "train.lr": LR}}, **search),
                num_samples=2)


def test_a_choice_that_merges_into_the_same_model_is_refused_naming_the_key():
    """Gated DeltaNet's memory learns its initial value: ``{name: linear}`` merges into it and keeps
    ``init: learned``, so it is ``{name: linear, init: learned}`` under another label."""
    with pytest.raises(ConfigError, match=r"search\.space\.model\.mixers\.gated_deltanet\.memory\.memory: the "
                                          r"choices linear and \{name: linear, init: learned\} build the same model"
                                          r".*search\.synonyms: allow"):
        prepare(node=_node([{"name": "linear"}, {"name": "linear", "init": "learned"}]))


def test_choices_that_differ_pass_and_a_renamed_part_replaces_the_node():
    """``init: zeros`` against the default differ; an MLP choice replaces the linear memory whole (its own
    ``init`` default, not the linear memory's), so it is no synonym of either."""
    p = prepare(node=_node([{"name": "linear"}, {"name": "linear", "init": "zeros"},
                            {"name": "mlp", "depth": 2, "expansion": 1}]))
    assert p.synonyms == [] and "synonymous" not in trial_table(p)


def test_allowed_synonyms_are_listed_by_the_dry_run_and_the_report(tmp_path):
    p = prepare(node=_node([{"name": "linear"}, {"name": "linear", "init": "learned"}], synonyms="allow"))
    assert [(s["key"], s["labels"]) for s in p.synonyms] == [(MEMORY, ["linear", "{name: linear, init: learned}"])]
    assert p.synonyms[0]["checked"] >= 1 and len(p.synonyms[0]["where"]) == p.synonyms[0]["checked"]
    assert f"synonymous choices (search.synonyms: allow) of {MEMORY}: the choices linear and" in trial_table(p)
    (tmp_path / "synonyms.json").write_text(json.dumps(p.synonyms))
    report = "\n".join(search_analysis(p.exp, [], tmp_path))
    assert "Synonymous choices: the space ran with choices that build the same model" in report
    assert f"- `{MEMORY}`: the choices linear and {{name: linear, init: learned}} build the same model" in report


def test_only_the_layers_the_model_uses_are_compared():
    """A choice that changes a mixer no layer uses changes nothing: with the layers ``[swa]`` the memory choices
    are one model (the check compares the mixers the layers name, not the whole config)."""
    exp = load_experiment(node=_node([{"name": "linear"}, {"name": "linear", "init": "zeros"}]))
    point = {MEMORY: {"name": "linear"}, "train.lr": 1e-3}
    assert find_synonyms(exp, [point]) == []
    exp_swa = load_experiment(node=dict(_node([{"name": "linear"}, {"name": "linear", "init": "zeros"}]),
                                        model={"preset": "gated_deltanet",
                                               "overrides": {"mixers.swa": {"name": "swa", "num_heads": 2,
                                                                            "window": 4},
                                                             "layers": ["swa"]}}))
    syns = find_synonyms(exp_swa, [point])
    assert [s.labels for s in syns] == [("linear", "{name: linear, init: zeros}")]
