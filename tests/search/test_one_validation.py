"""A setting is validated once: a trial's memory is resolved when the driver validates the trial, and the typed
config travels (pickled, as Ray sends it) to the trial, which builds, runs and trains its model without checking the
memory again (the layer, the engine and the kernels take the typed spec as it is)."""
import pickle

import pytest
import torch

from atlaslab.memory import spec as memory_spec
from atlaslab.memory.retention import Decay
from atlaslab.registry import ConfigError
from atlaslab.search.build import build_trial
from atlaslab.search.driver import prepare, tune_trials
from atlaslab.search.schema import load_experiment
from atlaslab.search.settings import TrialSettings

NODE = {
    "name": "once",
    "model": {"preset": "gated_deltanet", "overrides": {"d_model": 16, "mixers.gated_deltanet.num_heads": 2}},
    "task": {"name": "mqar", "vocab_size": 16, "seq_len": 8, "num_kv_pairs": [2], "eval_examples": 8},
    "train": {"steps": 2, "batch_size": 4},
    "seeds": [0],
    "grid": {"variants": {"a": {}, "b": {"model.d_model": 32}}},
    "metric": "val/accuracy",
}


def _count(monkeypatch):
    """Count the checks of the retention's placement (Decay.Config.check) and of the memory's part combination."""
    calls = {"decay": 0, "combination": 0}
    check, combination = Decay.Config.check, memory_spec._check_combination

    def counted_check(self):
        calls["decay"] += 1
        return check(self)

    def counted_combination(*a, **k):
        calls["combination"] += 1
        return combination(*a, **k)

    monkeypatch.setattr(Decay.Config, "check", counted_check)
    monkeypatch.setattr(memory_spec, "_check_combination", counted_combination)
    return calls


def test_a_trials_memory_is_validated_once(monkeypatch):
    """Both trials' memories are the same node (the models differ in d_model), so the driver validates it once and
    the registry remembers it (atlaslab.registry.config: an equal node gets a copy of the typed config)."""
    from atlaslab.registry import config as registry_config
    monkeypatch.setattr(registry_config, "_VALIDATED", {})        # nothing remembered from other tests
    calls = _count(monkeypatch)
    p = prepare(node=NODE)                       # the driver: expand and validate both trials (two distinct models)
    assert len(p.trials) == 2
    assert calls == {"decay": 1, "combination": 1}, calls
    for t in tune_trials(p):
        trial = pickle.loads(pickle.dumps(t))    # what a Ray trial receives
        task, tcfg, model = build_trial(trial)
        model(torch.randint(0, task.vocab_size, (2, 8))).square().mean().backward()   # layer, engine, kernels
    assert calls == {"decay": 1, "combination": 1}, f"validated again after the driver: {calls}"
    spec = model.layers[0].mixer.spec
    assert spec.retention.placement == "before_step" and isinstance(model.layers[0].mixer.cfg.memory, type(spec))


def test_trial_settings_carry_the_resources_typed():
    p = prepare(node=dict(NODE, resources={"cpus_per_trial": 2, "workers_per_trial": 2}))
    s = pickle.loads(pickle.dumps(TrialSettings.of(p.exp, {"uri": "x"})))
    assert (s.workers, s.threads, s.imports, s.metric, dict(s.tracking)) == (2, 2, (), "val/accuracy", {"uri": "x"})
    assert s.resources.workers_per_trial == 2 and s.resources.cpus_per_trial == 2


def test_an_import_that_fails_is_a_config_error_naming_the_module():
    """The experiment's ``imports`` go through the one helper (atlaslab.registry.import_user_modules), whose
    ImportError is a ConfigError at ``imports``, when the experiment is validated (before any trial starts)."""
    with pytest.raises(ConfigError, match=r"^imports: cannot import module 'no_such_module_xyz'"):
        load_experiment(node=dict(NODE, imports=["no_such_module_xyz"]))
