"""The ATLAS Table 2 protocol (experiments/lm_table2.yaml) and its CPU-sized run (lm_table2_cpu.yaml): the GPU file
validates with its two site paths pointed at local stand-ins and expands into the Table 2 trials (models, size,
token budget, lm-eval tasks and metrics, resources); its header's 1.3B command gives the 1.3B block; without the
site's data it stops at the field to edit. The local lm-eval tasks regenerate byte for byte, hold no training
text, load through lm-eval, and their loader refuses data built from another corpus. The CPU variant, cut to one
model and two steps, runs end to end through Ray (slow)."""
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from atlaslab.registry import ConfigError
from tests.scripts import load_script
from atlaslab.search.driver import prepare

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'atlaslab[eval]')")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "experiments" / "lm_table2.yaml"
CPU = ROOT / "experiments" / "lm_table2_cpu.yaml"
LM_TASKS = ROOT / "experiments" / "lm_tasks"

#: Table 2's rows with a preset, and Mamba2 (Table 2's 1.3B block; Titans Table 1 at 760M)
ROWS = {"Transformer++": "transformer", "DeepTransformers": "deeptransformer", "Dot": "dot", "RetNet": "retnet",
        "DeltaNet": "deltanet", "Gated DeltaNet": "gated_deltanet", "Titans (LMM)": "titans", "Memora": "memora",
        "SWDT": "swdt", "DLA": "dla", "OmegaNet": "omeganet", "Atlas": "atlas", "Atlas++": "atlas_pp",
        "Atlas (MAG)": "atlas_mag", "Atlas (MAL)": "atlas_mal", "Mamba2": "mamba2"}
#: Table 2's columns: lm-eval task → the metric its column reports
COLUMNS = {"wikitext": "word_perplexity", "lambada_openai": "perplexity", "piqa": "acc", "hellaswag": "acc_norm",
           "winogrande": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "social_iqa": "acc", "boolq": "acc"}
ACCURACIES = ["lm_eval/lambada_openai/acc"] + [f"lm_eval/{t}/{m}" for t, m in COLUMNS.items()
                                               if m.startswith("acc") and t != "lambada_openai"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Stand-ins for the two site paths: one jsonl shard and a 32K-id tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    root = tmp_path_factory.mktemp("site")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(32000 - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    (root / "shard.jsonl").write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(50)))
    return ["task.path=json", f"task.data_files={root / 'shard.jsonl'}", f"task.tokenizer.path={root / 'tokenizer.json'}"]


@pytest.fixture(scope="module")
def gpu(site):
    """The file validated (every trial's task, training, lm-eval tasks and model) with one block per model instead
    of 24: the blocks of a model are alike, and 16 models × 24 blocks take half a minute to build even on the meta
    device. ``atlaslab run experiments/lm_table2.yaml … --dry-run`` validates the full size (docs/results/lm-table2.md)."""
    return prepare(str(GPU), site + ["model.overrides.num_layers=1"])


def _model(trial):
    return trial["model_config"]


def test_the_gpu_protocol_expands_into_the_table2_trials(gpu):
    exp, trials = gpu.exp, gpu.trials
    assert {t["row"]: t["info"]["preset"] for t in trials} == ROWS
    for t in trials:
        m = _model(t)
        assert (m["d_model"], m["num_layers"], m["vocab_size"]) == (1536, 1, 32000), t["row"]
        assert {k: mx["num_heads"] for k, mx in m["mixers"].items()} == {k: 16 for k in m["mixers"]}, t["row"]
        task, train = t["config"]["task"], t["info"]["train"]
        assert task["seq_len"] == 4096 and task["streaming"] and task["name"] == "lm_corpus"
        tokens = train["steps"] * train["batch_size"] * task["seq_len"]
        assert 30e9 <= tokens < 30e9 + train["batch_size"] * task["seq_len"]          # 30B tokens, to one step
        assert (train["lr"], train["weight_decay"], train["schedule"], train["batch_size"]) == (1.25e-3, 0.1, "cosine", 128)
        assert t["config"]["eval"]["lm_eval"]["tasks"] == list(COLUMNS)
        # Titans' hybrid blocks cannot take packed sequences: they train with target masking only
        assert task.get("boundaries", "packed") == ("mask" if "Atlas (MA" in t["row"] else "packed"), t["row"]
    assert exp.metric == "val/loss" and exp.eval.lm_eval.num_fewshot == 0
    # the report: Table 2's columns (the right metric per task), and Avg over its 8 accuracy columns
    assert exp.report.metrics[:10] == [f"lm_eval/{t}/{m}" for t, m in list(COLUMNS.items())[:2]] \
        + ACCURACIES[:1] + [f"lm_eval/{t}/{m}" for t, m in list(COLUMNS.items())[2:]]
    assert exp.report.averages == {"Avg": ACCURACIES} and len(ACCURACIES) == 8
    assert exp.report.labels["lm_eval/hellaswag/acc_norm"] == "Hella acc_n"
    # 8 Ray Train workers per trial, one GPU each
    from atlaslab.search.settings import worker_resources
    r = exp.resources
    assert (r.workers_per_trial, r.gpus_per_trial) == (8, 8)
    assert worker_resources(r)["GPU"] == 1


#: the rows whose feature map expands the key: polynomial φ_2, Taylor φ*
FEATURE_ROWS = ["DeepTransformers", "Dot", "SWDT", "DLA", "OmegaNet", "Atlas", "Atlas++", "Atlas (MAG)", "Atlas (MAL)"]


def test_every_row_is_the_size_of_the_transformer_at_table2_width(gpu):
    """At head dim 96 the feature-map rows would be 1.55G (Atlas) to 36G (the Taylor rows) parameters: their keys are
    16-dim (153 features) and their values 96-dim, so every row stays near the Transformer++'s size and no memory
    holds more than 2.5× Titans (LMM)'s fast weights per sequence."""
    by_row = {t["row"]: t for t in gpu.trials}
    base = by_row["Transformer++"]["info"]["num_parameters"]
    titans = by_row["Titans (LMM)"]["info"]["state_size"]
    for row, t in by_row.items():
        assert t["info"]["num_parameters"] <= 1.1 * base, row
        if row != "Transformer++":                                  # its state is the KV cache
            assert t["info"]["state_size"] <= 2.5 * titans, row
    for row in FEATURE_ROWS:
        (mixer,) = _model(by_row[row])["mixers"].values()
        assert mixer["head_dim"] == 16 and mixer.get("value_dim") is None, row     # values: d_model / heads


def test_the_pages_size_table_data_is_what_the_file_builds(gpu, site):
    """docs/results/lm-table2/sizes.json (the page's size table, generated) holds the sizes the file's 24-block models
    have. A model's blocks are alike, so its size is linear in the block count: the 1-block build (the ``gpu``
    fixture) and a 2-block build give the 24-block sizes exactly, without the half minute a full build takes."""
    import yaml
    blocks = yaml.safe_load(GPU.read_text())["model"]["overrides"]["num_layers"]
    assert blocks == 24
    two = {t["row"]: t["info"] for t in prepare(str(GPU), site + ["model.overrides.num_layers=2"]).trials}
    built = {}
    for t in gpu.trials:
        one = t["info"]
        built[t["row"]] = {k: one[k] + (blocks - 1) * (two[t["row"]][k] - one[k])
                           for k in ("num_parameters", "state_size")}
    committed = json.loads((ROOT / "docs" / "results" / "lm-table2" / "sizes.json").read_text())["rows"]
    assert committed == built, ("stale sizes: run `python docs/gen_runs.py --lm-sizes` and "
                                "`python docs/gen_tables.py --write`")


def _gen_runs():
    return load_script("docs/gen_runs.py")


def test_the_geometry_table_data_is_what_the_file_builds(gpu):
    """docs/results/lm-table2/geometry.json (docs/concepts/memory.md's LM-scale geometry table, generated) holds the
    24-block sizes of the file's Atlas and DeepTransformers rows under each geometry, extrapolated here from 1- and
    2-block builds as above (``gpu`` first, so lm-eval's task index is already loaded); its Table 2 geometry is the
    file's own Atlas and DeepTransformers rows (sizes.json), so the geometries are built as the file builds them."""
    import yaml
    gr = _gen_runs()
    blocks = yaml.safe_load(GPU.read_text())["model"]["overrides"]["num_layers"]
    one, two = (gr.measure_lm_geometry([f"model.overrides.num_layers={n}"]) for n in (1, 2))
    built = {g: {row: {k: one[g][row][k] + (blocks - 1) * (two[g][row][k] - one[g][row][k]) for k in one[g][row]}
                 for row in one[g]} for g in one}
    committed = json.loads(gr.LM_GEOMETRY.read_text())
    assert committed["geometries"] == gr.GEOMETRIES
    assert committed["rows"] == built, ("stale geometry: run `python docs/gen_runs.py --lm-geometry` and "
                                        "`python docs/gen_tables.py --write`")
    sizes = json.loads(gr.LM_SIZES.read_text())["rows"]
    (table2,) = [g for g in gr.GEOMETRIES if "the Table 2 file" in g]
    for row in gr.GEOMETRY_ROWS:
        assert {k: v for k, v in committed["rows"][table2][row].items() if k != "initial_memory"} == sizes[row], row
    # the initial memory is the first geometry's ``init_*`` parameters: 16 heads × 24 blocks × (hidden × 4,753 + 96
    # × hidden), hidden = 4 × 4,753 (input) / 4 × 96 (output); shared keeps head 0's
    for g, hidden, heads in ((0, 4 * 4753, 16), (1, 4 * 96, 16), (2, 4 * 96, 1)):
        label = list(gr.GEOMETRIES)[g]
        assert committed["rows"][label]["Atlas"]["initial_memory"] == heads * blocks * hidden * (4753 + 96), label


def test_the_file_as_written_is_the_760m_block_and_its_headers_1_3b_command_the_1_3b_block(gpu, site):
    """The file's own size (24 blocks), then the command in its header (read from it, so it cannot drift) applied
    as CLI overrides."""
    from atlaslab.search.expand import expand_grid, model_config
    from atlaslab.search.schema import load_experiment
    for t in expand_grid(load_experiment(str(GPU), site))[:2]:
        cfg = model_config(t["config"]["model"], 32000)
        assert (cfg.d_model, cfg.num_layers) == (1536, 24) and {mx.num_heads for mx in cfg.mixers.values()} == {16}
    header = [ln[1:].strip() for ln in GPU.read_text().splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(header) if ln.startswith("atlaslab run experiments/lm_table2.yaml model."))
    cmd = " ".join(ln.rstrip("\\").strip() for ln in header[start:start + 3])
    argv = shlex.split(cmd)
    assert argv[:3] == ["atlaslab", "run", "experiments/lm_table2.yaml"]
    exp = load_experiment(str(GPU), argv[3:] + site)
    trials = expand_grid(exp)
    assert {t["row"] for t in trials} == set(ROWS) - {"SWDT", "DLA", "Atlas (MAG)", "Atlas (MAL)"}
    tr = trials[0]["config"]
    tokens = tr["train"]["steps"] * tr["train"]["batch_size"] * tr["task"]["seq_len"]
    assert 100e9 <= tokens < 100e9 + 128 * 4096 and tr["train"]["lr"] == 7e-4
    for t in trials[:3]:
        cfg = model_config(t["config"]["model"], 32000)
        assert (cfg.d_model, cfg.num_layers) == (2048, 18)
        assert {mx.num_heads for mx in cfg.mixers.values()} == {8}


def test_without_the_sites_data_validation_stops_at_the_field_to_edit(site):
    with pytest.raises(ConfigError) as e:
        prepare(str(GPU))
    assert e.value.path == "task.data_files" and "no file matches" in str(e.value)
    with pytest.raises(ConfigError) as e:
        prepare(str(GPU), site[:2])                      # data, but not the tokenizer
    assert e.value.path.startswith("task.tokenizer")


# --------------------------------------------------------------------------------------------------
# the local lm-eval tasks of the CPU variant
# --------------------------------------------------------------------------------------------------
def _maker():
    spec = importlib.util.spec_from_file_location("make_pydoc_tasks", LM_TASKS / "make_pydoc_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def maker():
    mod = _maker()
    manifest = json.loads((LM_TASKS / "data" / "MANIFEST.json").read_text())
    from atlaslab.tasks.corpus import load_corpus
    if load_corpus(manifest["corpus"]).sha256 != manifest["corpus_sha256"]:
        pytest.skip("this Python's pydoc text is not the one the shipped tasks were built from (the loader refuses "
                    "them here; rebuild with python experiments/lm_tasks/make_pydoc_tasks.py)")
    return mod


def test_the_local_tasks_regenerate_byte_for_byte(maker):
    files = maker.render(maker.build())
    for name, data in files.items():
        assert (LM_TASKS / "data" / name).read_bytes() == data, name
    assert maker.main(["--check"]) == 0
    assert maker.render(maker.build()) == files                               # no clock, no global RNG


def test_the_local_tasks_hold_no_training_text_and_the_cpu_run_trains_on_that_split(maker):
    from atlaslab.search.schema import load_experiment
    from atlaslab.tasks.corpus import corpus_pieces
    task = load_experiment(str(CPU)).task
    fractions = (task["val_fraction"], task["test_fraction"])
    assert fractions == (maker.VAL_FRACTION, maker.TEST_FRACTION)
    assert (task["tokenizer"]["val_fraction"], task["tokenizer"]["test_fraction"]) == fractions
    train = " ".join(" ".join(corpus_pieces("pydoc", *fractions)["train"]).split())
    docs = maker.build()
    assert min(len(v) for v in docs.values()) >= 20
    for d in docs["pydoc_lastword"]:
        words = d["text"].split()
        assert words[-1].lower() in {w.strip(".,;:!?()’'\"").lower() for w in words[:-1]}     # seen in the passage
        assert " ".join(words[-12:]) not in train
    for d in docs["pydoc_nextsent"]:
        assert len(d["endings"]) == 4 and len(set(d["endings"])) == 4 and 0 <= d["label"] < 4
        assert f"{d['ctx']} {d['endings'][d['label']]}" not in train
    labels = [d["label"] for d in docs["pydoc_nextsent"]]
    assert all(labels.count(k) >= len(labels) // 8 for k in range(4))        # the true ending is not always first


def test_lm_eval_indexes_and_loads_the_local_tasks_and_the_loader_refuses_another_corpus(maker, tmp_path):
    from lm_eval.tasks import get_task_dict

    from atlaslab.eval.lm_eval import resolve_lm_eval, task_manager
    names = ["pydoc_ppl", "pydoc_lastword", "pydoc_nextsent"]
    resolve_lm_eval({"tasks": names, "include_path": str(LM_TASKS), "builtin_tasks": False})
    counts = json.loads((LM_TASKS / "data" / "MANIFEST.json").read_text())["documents"]
    tasks = get_task_dict(names, task_manager(str(LM_TASKS), False))
    for name in names:
        assert len(list(tasks[name].test_docs())) == counts[name], name
    assert tasks["pydoc_lastword"].doc_to_target(next(iter(tasks["pydoc_lastword"].test_docs()))).startswith(" ")

    other = tmp_path / "lm_tasks"                                # the same tasks, data from "another" corpus
    shutil.copytree(LM_TASKS, other, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = json.loads((other / "data" / "MANIFEST.json").read_text())
    manifest["corpus_sha256"] = "0" * 64
    (other / "data" / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match=re.escape("make_pydoc_tasks.py")):
        get_task_dict(["pydoc_lastword"], task_manager(str(other), False))


# --------------------------------------------------------------------------------------------------
# the CPU variant, end to end (two steps, one model)
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow       # ~35 s on 2 busy cores: Ray's start, a trial worker, the tokenizer, three lm-eval tasks
@pytest.mark.timeout(600)
def test_the_cpu_variant_runs_end_to_end_and_reports_the_table2_columns(local_ray, tmp_path):
    from omegaconf import OmegaConf

    from atlaslab.search.driver import run
    node = OmegaConf.to_container(OmegaConf.load(CPU))
    node["grid"] = {"variants": {"Gated DeltaNet": {"model.preset": "gated_deltanet"}}}
    node["train"].update(steps=2, warmup_steps=0)
    node["eval"]["lm_eval"].update(limit=4, include_path=str(LM_TASKS))
    node["task"]["tokenizer"]["cache_dir"] = str(tmp_path / "tok")
    node["task"]["eval_examples"] = 4
    s = run(prepare(node=node), run_dir=tmp_path / "run", num_cpus=2, quiet=True)
    assert s["status"] == "finished" and s["completed"] == 1, s
    metrics = json.loads((tmp_path / "run" / "results.json").read_text())[0]["metrics"]
    cols = node["report"]["metrics"]
    assert all(isinstance(metrics.get(m), float) for m in cols), sorted(metrics)
    avg = sum(metrics[m] for m in node["report"]["averages"]["Avg"]) / 2
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| variant | word ppl (≈ Wiki) | Δ |" in report and f"| {avg:.3f} |" in report
