"""Registry, structured configs and validation: bad configs fail early with the dotted path and choices."""
import sys
import textwrap
import warnings

import pytest
from omegaconf import OmegaConf

import atlaslab  # noqa: F401  (registers the parts)
from atlaslab.memory import build_memory, resolve_memory_spec
from atlaslab.registry import KINDS, ConfigError, get_registry, list_parts, resolve_part


def test_every_kind_has_a_registry_and_memory_kinds_are_filled():
    assert set(list_parts()) == set(KINDS)
    parts = list_parts()
    assert {"linear", "mlp", "gated_mlp", "mlp_ln", "diagonal"} <= set(parts["memory"])
    assert {"dot", "l2", "lp", "l1", "huber", "value_shift"} <= set(parts["attentional_bias"])
    assert {"none", "decay", "lq", "kl", "elastic_net", "sigmoid"} <= set(parts["retention"])
    assert {"identity", "polynomial", "exp", "elu_plus_one"} <= set(parts["feature_map"])
    assert {"gd", "momentum", "muon", "multi_step_gd", "implicit_gd"} <= set(parts["inner_optimizer"])
    assert {"omega", "global"} <= set(parts["window"])


def test_wildcard_listing():
    assert get_registry("attentional_bias").list("l*") == ["l1", "l2", "lp"]
    assert list_parts("memory", "*mlp*") == {"memory": ["gated_mlp", "mlp", "mlp_ln"]}


def test_unknown_part_names_path_choices_and_suggestion():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"inner_optimizer": {"name": "muom"}})
    e = err.value
    assert e.path == "memory.inner_optimizer.name"
    assert "muom" in str(e) and "Did you mean 'muon'?" in str(e)
    assert set(e.choices) >= {"gd", "momentum", "muon"}


def test_unknown_field_names_the_field_and_valid_fields():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"feature_map": {"name": "polynomial", "degre": 3}})
    assert err.value.path == "memory.feature_map.degre"
    assert "degree" in err.value.choices


def test_wrong_type_is_rejected_with_path():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"window": {"name": "omega", "size": "four"}})
    assert err.value.path == "memory.window.size" and "four" in str(err.value)


def test_bad_enum_value_lists_choices():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"retention": {"name": "decay", "placement": "before"}})
    assert err.value.path == "memory.retention.placement"
    assert err.value.choices == ["after_step", "before_step"]
    assert "Did you mean 'before_step'?" in str(err.value)


def test_out_of_range_value():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"window": {"name": "omega", "size": 0}})
    assert err.value.path == "memory.window.size"
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"chunk_size": 0})
    assert err.value.path == "memory.chunk_size"


def test_unknown_memory_field():
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec({"optimizer": "gd"})
    assert err.value.path == "memory.optimizer" and "inner_optimizer" in err.value.choices


@pytest.mark.parametrize("node, path, needle", [
    ({"memory": "diagonal", "inner_optimizer": "muon"}, "memory.inner_optimizer.name", "vector-valued"),
    ({"memory": "mlp", "inner_optimizer": {"name": "muon", "ns_granularity": "chunk"}},
     "memory.inner_optimizer.ns_granularity", "read: chunk"),
    ({"memory": "mlp", "inner_optimizer": "implicit_gd"}, "memory.inner_optimizer.name", "closed form"),
    ({"memory": "mlp", "retention": {"name": "decay", "channel_wise": True}},
     "memory.retention.channel_wise", "per-head"),
    ({"memory": "linear", "feature_map": "exp", "attentional_bias": "dot"}, "memory.memory.init", "zero"),
    ({"memory": {"name": "linear", "init": "zeros"}, "feature_map": "exp", "inner_optimizer": "muon"},
     "memory.inner_optimizer.name", "slots"),
    ({"memory": "mlp", "feature_map": {"name": "exp", "normalize": True}}, "memory.feature_map.normalize",
     "normaliser"),
])
def test_incompatible_combinations_are_rejected(node, path, needle):
    with pytest.raises(ConfigError) as err:
        resolve_memory_spec(node)
    assert err.value.path == path
    assert needle in str(err.value)
    assert err.value.choices


def test_config_errors_survive_pickling():
    """Ray pickles a worker's exception to the process waiting on it; the error must arrive whole."""
    import pickle

    from atlaslab.search.expand import TrialConfigError
    for err in (ConfigError("train.device", "CUDA is not available.", value="cuda", choices=["auto", "cpu"]),
                TrialConfigError("t001 (x)", "train.batch_size", "does not split.", value=6)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.path, back.reason, back.value, back.choices) == (err.path, err.reason, err.value, err.choices)


def test_dimension_checks_happen_at_build_with_a_path():
    # a residual MLP cannot add a 4-dim input to polynomial features of another size
    with pytest.raises(ConfigError) as err:
        build_memory({"memory": "mlp", "feature_map": "polynomial"}, num_heads=2, key_dim=4, value_dim=4)
    assert err.value.path == "memory.memory.residual"
    build_memory({"memory": {"name": "mlp", "residual": False}, "feature_map": "polynomial"}, 2, 4, 4)


def test_omegaconf_nodes_and_plain_names_are_accepted():
    node = OmegaConf.create({"memory": {"name": "mlp", "depth": 3}, "inner_optimizer": "momentum",
                             "chunk_size": 4})
    spec = resolve_memory_spec(node)
    assert spec.memory.depth == 3 and spec.inner_optimizer.momentum == 0.9 and spec.chunk_size == 4
    assert resolve_memory_spec(spec.to_dict()) == spec


def test_user_part_from_own_module_needs_no_edit_to_atlaslab(tmp_path, monkeypatch):
    module = tmp_path / "my_lab_parts.py"
    module.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from atlaslab.registry import PartConfig, register
        from atlaslab.memory.attentional_biases import AttentionalBias

        @register("attentional_bias", "cauchy")
        class Cauchy(AttentionalBias):
            """Cauchy loss ½ log(1 + ‖r‖²/s²): a robust bias from outside atlaslab."""

            @dataclass
            class Config(PartConfig):
                scale: float = 1.0

            def loss(self, pred, target, delta=None):
                r2 = ((pred - target) ** 2).sum(-1)
                return 0.5 * (1 + r2 / self.cfg.scale ** 2).log()

            def output_grad(self, pred, target, delta=None):
                r = pred - target
                return r / (self.cfg.scale ** 2 + (r * r).sum(-1, keepdim=True))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yaml = "attentional_bias: {name: my_lab_parts.cauchy, scale: 2.0}\nmemory: mlp\n"
    spec = resolve_memory_spec(OmegaConf.create(yaml))
    assert spec.attentional_bias.name == "cauchy" and spec.attentional_bias.scale == 2.0
    import torch
    from helpers import random_qkv
    q, k, v = random_qkv(B=1, T=3)
    o, _ = atlaslab.memorize(q, k, v, build_memory(spec, 2, 4, 4).double())
    assert torch.isfinite(o).all()
    get_registry("attentional_bias")._entries.pop("cauchy")
    sys.modules.pop("my_lab_parts", None)


def test_importable_module_without_the_part_is_reported():
    with pytest.raises(ConfigError) as err:
        resolve_part("attentional_bias", {"name": "json.nothing"}, "memory.attentional_bias")
    assert err.value.path == "memory.attentional_bias.name" and "nothing" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve_part("attentional_bias", {"name": "no_such_module_xyz.bias"}, "b")
    assert "cannot import" in str(err.value)


def test_deprecation_shim_forwards_with_warning():
    reg = get_registry("attentional_bias")
    reg.deprecate("delta_rule", "l2")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = resolve_part("attentional_bias", "delta_rule")
        assert cfg.name == "l2"
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    finally:
        reg._deprecated.pop("delta_rule")


def test_every_part_has_a_description_and_a_default_config():
    for kind in ("memory", "attentional_bias", "retention", "feature_map", "inner_optimizer", "window"):
        for entry in get_registry(kind):
            assert entry.description, f"{kind}/{entry.name} has no docstring"
            cfg = resolve_part(kind, entry.name)
            assert cfg.name == entry.name


def test_a_validated_node_is_remembered_as_a_copy_and_an_invalid_one_fails_every_time():
    """resolve_part / validate_structured keep what an equal node gave (a search resolves the same parts at every
    size and seed): each call gets its own instance, and a bad node raises on every call with that call's path."""
    from atlaslab.registry.config import _VALIDATED, validate_structured
    from atlaslab.train.config import TrainConfig
    node = {"name": "muon", "ns_steps": 3}
    a = resolve_part("inner_optimizer", node, path="x")
    b = resolve_part("inner_optimizer", dict(node), path="y")
    assert a == b and a is not b and a.ns_steps == 3
    a.ns_steps = 7
    assert resolve_part("inner_optimizer", node).ns_steps == 3
    assert any(cls is type(a) for cls, _ in _VALIDATED)
    for path in ("first", "second"):
        with pytest.raises(ConfigError, match=rf"{path}\.ns_steps"):
            resolve_part("inner_optimizer", {"name": "muon", "ns_steps": "many"}, path=path)
    t1 = validate_structured(TrainConfig, {"steps": 5}, "train")
    t2 = validate_structured(TrainConfig, {"steps": 5}, "train")
    assert t1 == t2 and t1 is not t2


def test_a_part_registered_again_under_its_name_is_validated_with_its_new_config():
    """The remembered validations are keyed by the config class: a part removed and registered again (a module
    reloaded) with another default gets its new default, not the one remembered for the old class."""
    from dataclasses import dataclass

    from atlaslab.memory.attentional_biases import AttentionalBias
    from atlaslab.registry import PartConfig, register
    reg = get_registry("attentional_bias")
    try:
        for default in (1.0, 2.0):
            @register("attentional_bias", "scaled_test_bias")
            class Scaled(AttentionalBias):
                """A test bias whose config default changes between registrations."""

                @dataclass
                class Config(PartConfig):
                    scale: float = default

            assert resolve_part("attentional_bias", {"name": "scaled_test_bias"}).scale == default
            reg._entries.pop("scaled_test_bias")      # a module reloaded in a notebook registers it again
    finally:
        reg._entries.pop("scaled_test_bias", None)
