"""The reading-list study (experiments/reading_list_mqar.yaml, reading_list_niah.yaml) expands to the intended trials:
every model × 3 seeds per task (ATLAS: MQAR only, seed 0), each at the study's task, training and model size."""
from collections import Counter
from pathlib import Path

import pytest

from atlaslab.search.driver import prepare

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

PRESETS = {   # variant → preset, per task
    "mqar": {"ATLAS (NS per chunk of 4)": "atlas", "Transformer": "transformer", "FoX": "fox",
             "LaCT (chunk = window = 16)": "lact", "Titans (LMM)": "titans", "Titans (MAC)": "titans_mac",
             "ARMT": "armt"},
    "sniah": {"Titans (MAC)": "titans_mac", "ARMT": "armt", "Titans (LMM)": "titans",
              "LaCT (chunk = window = 64)": "lact", "FoX": "fox", "Transformer": "transformer"},
}
TASKS = {"mqar": {"name": "mqar", "vocab_size": 128, "seq_len": 64, "num_kv_pairs": [4]},
         "sniah": {"name": "sniah", "variant": "passkey", "seq_len": 256}}
TRAIN = {"mqar": {"batch_size": 64, "lr": 3e-3, "steps": 1600, "early_stop_threshold": 0.99},
         "sniah": {"batch_size": 16, "lr": 1e-3, "steps": 2000, "early_stop_threshold": 0.99}}
FILES = {"mqar": "reading_list_mqar.yaml", "sniah": "reading_list_niah.yaml"}


@pytest.fixture(scope="module", params=list(FILES))
def study(request):
    return request.param, prepare(str(EXPERIMENTS / FILES[request.param]))


def test_every_model_runs_on_three_seeds_but_atlas_on_one(study):
    task, p = study
    seeds = Counter(t["variant"] for t in p.trials)
    expected = {v: (1 if p_ == "atlas" else 3) for v, p_ in PRESETS[task].items()}
    assert dict(seeds) == expected
    assert {t["seed"] for t in p.trials if t["variant"] != "ATLAS (NS per chunk of 4)"} == {0, 1, 2}
    assert [t["seed"] for t in p.trials if t["variant"] == "ATLAS (NS per chunk of 4)"] == ([0] if task == "mqar" else [])
    assert p.trials[0]["variant"] == next(iter(PRESETS[task]))     # the costliest trial starts first (MQAR: ATLAS, S-NIAH: MAC)


def test_trials_share_the_task_training_and_model_size(study):
    task, p = study
    for t in p.trials:
        cfg, model = t["config"], t["model_config"]
        assert t["info"]["preset"] == PRESETS[task][t["variant"]]
        assert {k: cfg["task"][k] for k in TASKS[task]} == TASKS[task]
        assert {k: cfg["train"][k] for k in TRAIN[task]} == TRAIN[task]
        assert (model["d_model"], model["num_layers"]) == (64, 2), t["variant"]


def test_lact_chunk_and_window_are_a_quarter_of_the_sequence(study):
    task, p = study
    T = TASKS[task]["seq_len"]
    for t in p.trials:
        if t["info"]["preset"] == "lact":
            mixer = t["model_config"]["mixers"]["lact"]
            assert mixer["window"] == mixer["memory"]["chunk_size"] == T // 4


def test_atlas_is_the_chunk_granular_variant_that_learns_mqar(study):
    task, p = study
    atlas = [t["model_config"]["mixers"]["atlas"] for t in p.trials if t["info"]["preset"] == "atlas"]
    assert len(atlas) == (1 if task == "mqar" else 0)
    for mixer in atlas:
        mem = mixer["memory"]
        assert mixer["num_heads"] == 8 and mem["chunk_size"] == 4 and mem["read"] == "chunk"
        assert mem["inner_optimizer"]["name"] == "muon" and mem["inner_optimizer"]["ns_granularity"] == "chunk"
