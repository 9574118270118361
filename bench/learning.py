"""Learning parity on MQAR: atlaslab presets vs independent reference implementations, same loop, same data.

    python bench/peers.py --install                       # the fla / titans-pytorch peers → bench/.peers
    python bench/learning.py                              # calibration: presets + refs, seeds 0,1,2
    python bench/learning.py --presets none --seeds 0     # the references alone
    python bench/learning.py --setting hard               # MQAR 16 pairs at T = 256
    python bench/learning.py --presets none --reuse       # re-run only references whose runs/options changed
    python bench/learning.py --reuse                      # add a preset: the unchanged runs are taken as they are
    python bench/learning.py --seeds 0,1,2 --reuse-from other.json   # pool seeds that ran in another command
    python bench/learning.py --setting reading_list --presets titans_mac --refs titans_mac --parallel 2

Every model, ours (``load_preset`` → ``LanguageModel``) or a reference (bench/learning_refs.py), is trained by
atlaslab's own ``train`` with the same settings, so the batch of step s is the same for every model of a seed
(a pure function of the seed and s) and every model is evaluated on the same validation set. Each
(model, seed) run is a fresh interpreter with one torch thread (``--parallel N`` runs N at a time); a run that
fails, diverges or times out is recorded as such and the bench goes on. The results (``<out>.json`` and
``<out>.md``, default bench/results/learning_<setting>_cpu, learning_cpu for ``calibration``) are rewritten after
every run. Each run records the training loop's revision (``atlaslab.train.TRAINING_REVISION``); ``--reuse`` takes
an older revision's run only where the loop's changes since leave that model's training as it was.

Per model: final validation accuracy (the last evaluation) and the steps to 90% validation accuracy (the
first evaluation at ≥ 0.9, so a multiple of the eval interval), mean ± std over the seeds (sample std, 0 for
one seed; steps-to-90 over the seeds that got there), and the recurrent state size after T tokens
(``LanguageModel.state_size(T)`` for ours; the same count for the references, see learning_refs).

Goal: each preset that has a reference reaches 90% validation accuracy within 1.5× the reference's steps.

Verdicts (:func:`compare`), one of three:

- **no verdict**: the reference did not reach 90% on every seed (a reference that did not learn the setting
  judges nothing; no target is lowered to its plateau), or a side has fewer than 2 seeds, or the 90% bootstrap
  interval of ours / ref spans 1.5× (the seeds cannot tell), or ours missed 90% on some seed and the lower
  bound below does not settle it;
- **met**: the reference reached 90% on every seed, so did ours, and the whole interval is ≤ 1.5×;
- **not met**: the whole interval is > 1.5×. A seed of ours that never reached 90% counts as budget + 1 steps
  (a lower bound on its steps), so ours failing to learn can give "not met" (when even that bound puts the
  interval above 1.5×) or "no verdict", never "met".

Held-out seeds (the rule): seeds used to choose a preset's defaults, a reference's recipe or a probe are never
the seeds of its verdict. Tuning happens on seeds 0, 1, 2 (:data:`TUNING_SEEDS`); verdicts are taken on seeds
3, 4, 5 (:data:`HELDOUT_SEEDS`), their number fixed before the run (no seed is added after seeing a result).
A verdict one of whose held-out seeds later turns out to have helped choose something (a probe on another setting)
is taken again on fresh seeds 6, 7, 8 (:data:`FRESH_SEEDS`, fixed on 2026-12-07 before any run on them).
Titans' reference recipe (titans-pytorch with ``store_with_lookahead_value``) learned on held-out seeds 3 and 5
but not 4 within 600 steps, so seeds 3-5 helped choose its budget: its verdict is taken on seeds 6, 7, 8 with a
1,200-step budget (:data:`TITANS_FRESH_STEPS`), both fixed on 2026-12-07 at 21:05 UTC before any run on them.
bench/results/learning_heldout* hold the verdict runs; learning_cpu.* and the other files on seeds 0–2 are
tuning and calibration records, whose comparison tables are not verdicts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

SETTINGS: Dict[str, Dict[str, Any]] = {
    "calibration": {"vocab_size": 128, "seq_len": 64, "num_kv_pairs": 4, "d_model": 64, "num_layers": 2,
                    "batch_size": 64, "lr": 3e-3, "warmup_steps": 20, "eval_interval": 25, "eval_examples": 256,
                    "steps": 600, "early_stop": 0.99},
    "hard": {"vocab_size": 128, "seq_len": 256, "num_kv_pairs": 16, "d_model": 64, "num_layers": 2,
             "batch_size": 64, "lr": 3e-3, "warmup_steps": 20, "eval_interval": 25, "eval_examples": 256,
             "steps": 1500, "early_stop": 0.99},
    # experiments/reading_list_mqar.yaml's MQAR and training (cosine over 1,600 steps, eval every 50 on 512)
    "reading_list": {"vocab_size": 128, "seq_len": 64, "num_kv_pairs": 4, "d_model": 64, "num_layers": 2,
                     "batch_size": 64, "lr": 3e-3, "warmup_steps": 20, "eval_interval": 50, "eval_examples": 512,
                     "steps": 1600, "early_stop": 0.99, "schedule": "cosine"},
}
#: LaCT's chunk (= its window) per setting: T / 4, so its fast weights carry the three earlier chunks (with a chunk
#: of T every query would read the initial weights, LaCT applying a chunk's update only to later chunks)
LACT_CHUNK = {"calibration": 16, "hard": 64, "reading_list": 16}


def preset_overrides(name: str, setting_name: str) -> List[str]:
    """Overrides a preset runs with in a setting (LaCT's chunk and window, :data:`LACT_CHUNK`)."""
    if name == "lact":
        c = LACT_CHUNK[setting_name]
        return [f"mixers.lact.window={c}", f"mixers.lact.memory.chunk_size={c}"]
    return []


DEFAULT_PRESETS = ["transformer", "gated_deltanet", "deltanet", "linear_attention", "titans", "atlas", "omeganet"]
THRESHOLD = 0.9
GOAL_FACTOR = 1.5
MET, NOT_MET, NO_VERDICT = "met", "not met", "no verdict"
#: seeds of verdicts (held out): never used to choose a preset's defaults, a reference's recipe or a probe
HELDOUT_SEEDS = (3, 4, 5)
#: the second held-out set, for a verdict whose seeds 3-5 were touched by a probe (fixed before any run on them)
FRESH_SEEDS = (6, 7, 8)
#: titans' budget on FRESH_SEEDS (its reference learned late on seeds 3-5; fixed before the run)
TITANS_FRESH_STEPS = 1200
#: seeds on which defaults, reference recipes and probes may be chosen
TUNING_SEEDS = (0, 1, 2)


def _refs_module():
    sys.path.insert(0, str(HERE))
    try:
        import learning_refs
    finally:
        sys.path.remove(str(HERE))
    return learning_refs


# --------------------------------------------------------------------------------------------------
# one run (in its own interpreter)
# --------------------------------------------------------------------------------------------------
def task_node(setting: Dict[str, Any]) -> Dict[str, Any]:
    return {"name": "mqar", "vocab_size": setting["vocab_size"], "seq_len": setting["seq_len"],
            "num_kv_pairs": [setting["num_kv_pairs"]], "eval_examples": setting["eval_examples"]}


def train_config(setting: Dict[str, Any], seed: int, steps: int) -> Dict[str, Any]:
    return {"steps": steps, "batch_size": setting["batch_size"], "lr": setting["lr"],
            "schedule": setting.get("schedule", "constant"),
            "warmup_steps": setting["warmup_steps"], "eval_interval": setting["eval_interval"],
            "eval_examples": setting["eval_examples"], "early_stop_metric": "accuracy",
            "early_stop_threshold": setting["early_stop"], "final_eval": False, "progress": "never",
            "log_interval": setting["eval_interval"], "device": "cpu", "seed": seed}


def preset_config(job: Dict[str, Any]) -> Dict[str, Any]:
    """A preset job's fully resolved model config (every default filled in), as JSON-plain containers: what
    ``--reuse`` compares, so that a run is reused only while the preset, its overrides and the defaults are
    unchanged."""
    from atlaslab.models.lm import resolve_lm_config
    from atlaslab.models.presets import load_preset
    s = job["setting"]
    cfg = load_preset(job["name"], [f"vocab_size={s['vocab_size']}", f"d_model={s['d_model']}",
                                    f"num_layers={s['num_layers']}", *job.get("overrides", [])])
    return json.loads(json.dumps(resolve_lm_config(cfg).to_dict()))


def build_model(job: Dict[str, Any], config: Optional[Dict[str, Any]] = None):
    """(model, state size after T tokens) for a job ``{"kind": "preset" | "ref", "name", "setting", ...}``; a
    preset is built from ``config`` (its :func:`preset_config`, resolved here when not given)."""
    import torch
    s = job["setting"]
    torch.manual_seed(job["seed"])          # the model's init depends on the seed too
    if job["kind"] == "preset":
        from atlaslab.models.lm import LanguageModel
        model = LanguageModel(config or preset_config(job))
    else:
        refs = _refs_module()
        model = refs.build_ref(job["name"], s["vocab_size"], s["d_model"], s["num_layers"], max_len=s["seq_len"],
                               **job.get("ref_kwargs", {}))
    return model, int(model.state_size(s["seq_len"]))


def worker(job: Dict[str, Any]) -> Dict[str, Any]:
    """Train one (model, seed); prints ``PROGRESS …`` lines, returns the record."""
    import torch
    torch.set_num_threads(1)
    from atlaslab.train.loop import TRAINING_REVISION, train
    label = f"{job['name']} seed {job['seed']}"
    config = preset_config(job) if job["kind"] == "preset" else None
    model, state = build_model(job, config)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    deadline = time.time() + job.get("budget_s", 1e9)
    t0 = time.time()

    def cb(metrics, step):
        if "val/accuracy" in metrics:
            print(f"PROGRESS {label}: step {step} val/accuracy {metrics['val/accuracy']:.3f} "
                  f"loss {metrics.get('train/loss', float('nan')):.3f} ({time.time() - t0:.0f}s)", flush=True)
        return time.time() > deadline   # stop (status "stopped") past the run's budget

    r = train(model, task_node(job["setting"]), train_config(job["setting"], job["seed"], job["steps"]), callback=cb)
    return {"status": r.status, "message": r.message, "steps": r.steps, "wall_s": r.wall_time_s,
            "num_parameters": params, "state_size": state, "train_revision": TRAINING_REVISION,
            **({"model_config": config} if config is not None else {}),
            "history": [{k: v for k, v in h.items() if k in ("step", "val/accuracy", "train/loss")}
                        for h in r.history if "val/accuracy" in h]}


def run_job(job: Dict[str, Any], timeout: float, log=print) -> Dict[str, Any]:
    """``worker(job)`` in a fresh interpreter; a crash, divergence or timeout becomes a failed record."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    errs: List[str] = []
    reader = threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True)
    reader.start()
    result = None
    try:
        for line in proc.stdout:
            if line.startswith("PROGRESS "):
                log("  " + line[len("PROGRESS "):].rstrip())
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.wait()
    finally:
        timer.cancel()
        reader.join(timeout=5)
    base = {"kind": job["kind"], "name": job["name"], "seed": job["seed"]}
    if result is None:
        timed_out = time.time() - t0 >= timeout
        tail = [e.rstrip() for e in errs if e.strip()]
        why = f"timeout > {timeout:.0f}s" if timed_out else (tail[-1][:300] if tail else f"exit code {proc.returncode}")
        return {**base, "status": "failed", "message": why, "history": []}
    return {**base, **result}


# --------------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------------
def curve(history: Sequence[Dict[str, float]]) -> List[List[float]]:
    """[[step, val accuracy], …] from a train history (the evaluation entries)."""
    return [[int(h["step"]), float(h["val/accuracy"])] for h in history if "val/accuracy" in h]


def steps_to(history: Sequence[Dict[str, float]], threshold: float) -> Optional[int]:
    """The first evaluation step with validation accuracy ≥ threshold (None: never)."""
    for step, acc in curve(history):
        if acc >= threshold:
            return step
    return None


def mean_std(xs: Sequence[float]) -> Optional[List[float]]:
    """[mean, sample std] (std 0 for one value); None for no values."""
    xs = [float(x) for x in xs]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return [m, sd]


def summarise_run(run: Dict[str, Any], threshold: float = THRESHOLD) -> Dict[str, Any]:
    c = curve(run.get("history", []))
    ok = run.get("status") not in ("failed", "diverged") and bool(c)
    return {"ok": ok, "final_accuracy": c[-1][1] if ok else None, "best_accuracy": max(a for _, a in c) if ok else None,
            "steps_to_90": steps_to(run["history"], threshold) if ok else None}


def summarise_model(runs: Sequence[Dict[str, Any]], threshold: float = THRESHOLD) -> Dict[str, Any]:
    """Over the seeds of one model: final / best accuracy mean ± std (successful runs), steps-to-90 mean ± std
    (the runs that got there) and how many did."""
    per = [summarise_run(r, threshold) for r in runs]
    good = [p for p in per if p["ok"]]
    reached = [p["steps_to_90"] for p in good if p["steps_to_90"] is not None]
    states = {r.get("state_size") for r in runs if r.get("state_size") is not None}
    params = {r.get("num_parameters") for r in runs if r.get("num_parameters") is not None}
    return {"seeds": len(per), "ok": len(good), "reached_90": len(reached),
            "final_accuracy": mean_std([p["final_accuracy"] for p in good]),
            "best_accuracy": mean_std([p["best_accuracy"] for p in good]),
            "steps_to_90": mean_std(reached),
            "state_size": states.pop() if len(states) == 1 else (sorted(states) or None),
            "num_parameters": params.pop() if len(params) == 1 else (sorted(params) or None),
            "failures": [f"seed {r['seed']}: {r['status']} {r.get('message', '')}".strip() for r in runs
                         if r.get("status") in ("failed", "diverged")]}


def ratio_interval(ours: Sequence[float], ref: Sequence[float], level: float = 0.9, resamples: int = 4000,
                   seed: int = 0) -> Optional[List[float]]:
    """Percentile bootstrap interval of mean(ours) / mean(ref), each resampled over its own seeds (seeded, so the
    report is reproducible); None when either side has fewer than 2 values. With 3 seeds a side it has few distinct
    resamples and understates the uncertainty: read it as a lower bound on the noise, not a test."""
    if len(ours) < 2 or len(ref) < 2:
        return None
    rng = random.Random(seed)
    mean = lambda xs: sum(xs) / len(xs)   # noqa: E731
    ratios = sorted(mean(rng.choices(ours, k=len(ours))) / mean(rng.choices(ref, k=len(ref)))
                    for _ in range(resamples))
    lo = ratios[int((1 - level) / 2 * (resamples - 1))]
    hi = ratios[int((1 + level) / 2 * (resamples - 1))]
    return [lo, hi]


def compare(ours_runs: Sequence[Dict[str, Any]], ref_runs: Sequence[Dict[str, Any]],
            factor: float = GOAL_FACTOR, threshold: float = THRESHOLD,
            budget: Optional[int] = None) -> Dict[str, Any]:
    """Ours vs its reference: the verdict ``"met"``, ``"not met"`` or ``"no verdict"`` (see the module's
    docstring, "Verdicts") with the numbers behind it.

    target = ``threshold`` (0.9). ref / ours steps: mean ± std of the steps to the target over the seeds.
    ratio = mean ours / mean ref; ratio_ci: the 90% percentile bootstrap interval of that ratio
    (:func:`ratio_interval`). ``budget``: the runs' step limit; a seed of ours that never reached the target
    counts as ``budget + 1`` steps (a lower bound on its steps), so the ratio and its interval are then lower
    bounds (``ratio_is_lower_bound``). ``met`` (True / False / None) mirrors the verdict for older readers."""
    ref = summarise_model(ref_runs, threshold)
    out: Dict[str, Any] = {"verdict": NO_VERDICT, "target": threshold, "ours_steps": None, "ref_steps": None,
                           "ratio": None, "met": None, "ratio_ci": None, "ratio_is_lower_bound": False, "why": "",
                           "ours_reached": None, "ref_reached": f"{ref['reached_90']}/{ref['seeds']}"}

    def steps(runs):
        ok = [r for r in runs if summarise_run(r, threshold)["ok"]]
        return [g for g in (steps_to(r["history"], threshold) for r in ok) if g is not None], len(runs)

    (o_raw, o_all), (f_raw, f_all) = steps(ours_runs), steps(ref_runs)
    out.update(ours_steps=mean_std(o_raw), ref_steps=mean_std(f_raw), ours_reached=f"{len(o_raw)}/{o_all}",
               ref_reached=f"{len(f_raw)}/{f_all}")
    if f_all == 0 or len(f_raw) < f_all:
        out["why"] = (f"the reference reached {threshold:g} on {len(f_raw)}/{f_all} seeds: it did not learn the "
                      "setting on every seed, so nothing is judged against it")
        return out
    if len(f_raw) < 2 or o_all < 2:
        out["why"] = "fewer than 2 seeds a side: no estimate of the seed noise"
        return out
    censored = o_all - len(o_raw)
    if censored and budget is None:
        out["why"] = f"ours reached {threshold:g} on {len(o_raw)}/{o_all} seeds (no step budget to bound the rest)"
        return out
    o_vals = o_raw + [budget + 1] * censored if censored else o_raw
    mean = lambda xs: sum(xs) / len(xs)   # noqa: E731
    ci = ratio_interval(o_vals, f_raw)
    out.update(ratio=mean(o_vals) / mean(f_raw), ratio_ci=ci, ratio_is_lower_bound=bool(censored))
    if ci[0] > factor:
        out["verdict"] = NOT_MET
        if censored:
            out["why"] = (f"ours reached {threshold:g} on {len(o_raw)}/{o_all} seeds; even counting those at the "
                          f"budget the interval lies above {factor:g}×")
    elif censored:
        out["why"] = (f"ours reached {threshold:g} on {len(o_raw)}/{o_all} seeds: the ratio is only a lower bound "
                      f"and its interval reaches {factor:g}×")
    elif ci[1] <= factor:
        out["verdict"] = MET
    else:
        out["why"] = f"the interval spans {factor:g}×"
    out["met"] = {MET: True, NOT_MET: False}.get(out["verdict"])
    return out


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _pm(ms, digits=3, fmt=None) -> str:
    if not ms:
        return "—"
    f = fmt or (lambda x: f"{x:.{digits}f}")
    return f"{f(ms[0])} ± {f(ms[1])}"


VERDICT_RULE = (
    "Verdict rule (bench/learning.py): target 90% validation accuracy; steps = mean ± std over the seeds of the "
    "first evaluation at ≥ 90%; ours / ref = mean ours / mean ref, with a 90% percentile bootstrap interval over "
    "each side's seeds. **no verdict** when the reference did not reach 90% on every seed (it did not learn the "
    "setting), when a side has fewer than 2 seeds, or when the interval spans the goal; **met** when the whole "
    f"interval is ≤ {GOAL_FACTOR}×; **not met** when it is all above {GOAL_FACTOR}×. A seed of ours that never "
    "reached 90% counts as budget + 1 steps, so the ratio is then a lower bound (marked ≥): it can give "
    "\"not met\", never \"met\". Verdict seeds are held out: none was used to choose a default, a reference's "
    "recipe or a probe.")


#: the last column of a comparison table over a run with tuning seeds: what the rule gives there is no verdict
TUNING_COLUMN = "the rule on these seeds (tuning seeds: not a verdict)"


def tuning_note(seeds: Sequence[int]) -> str:
    """The warning a report on tuning seeds carries above its comparison table."""
    used = ", ".join(str(x) for x in seeds if x in TUNING_SEEDS)
    return (f"**Tuning seeds.** Seed(s) {used} of this run are tuning seeds ({', '.join(map(str, TUNING_SEEDS))}), on "
            "which defaults, reference recipes and probes were chosen: the last column below says what the rule gives "
            "on them, a calibration record, not a verdict. Verdicts are taken on the held-out seeds "
            f"{', '.join(map(str, HELDOUT_SEEDS))} (bench/results/learning_heldout_*).")


def render(path: Path) -> str:
    """Rewrite ``<prefix>.md`` (and the summary / comparison of ``<prefix>.json``) from the runs recorded in
    ``path`` (``<prefix>.json``), without training anything; returns the markdown."""
    data = json.loads(Path(path).read_text())
    data = {k: v for k, v in data.items() if k not in ("summary", "comparison")}
    return write_report(data, Path(str(path)[:-len(".json")]))


def verdict_row(name: str, c: Dict[str, Any]) -> str:
    """One markdown row of the verdict table from a :func:`compare` record (also used by docs/gen_learning.py)."""
    fmt = lambda x: f"{x:.0f}"   # noqa: E731
    lb = "≥ " if c.get("ratio_is_lower_bound") else ""
    ratio = "—" if c["ratio"] is None else f"{lb}{c['ratio']:.2f}×"
    ci = c["ratio_ci"]
    interval = "—" if ci is None else f"{lb}{ci[0]:.2f}–{ci[1]:.2f}×"
    verdict = c["verdict"] + (f" ({c['why']})" if c.get("why") else "")
    return (f"| {name} | {c['reference']} | {c.get('ref_reached') or '—'} | {c.get('ours_reached') or '—'} | "
            f"{_pm(c['ours_steps'], fmt=fmt)} | {_pm(c['ref_steps'], fmt=fmt)} | {ratio} | {interval} | {verdict} |")


def write_report(data: Dict[str, Any], out: Path) -> str:
    """Write ``<out>.json`` and ``<out>.md`` from the bench's record; returns the markdown."""
    md, summary, comparisons = report(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps({**data, "summary": summary, "comparison": comparisons}, indent=1))
    Path(str(out) + ".md").write_text(md)
    return md


def markdown(data: Dict[str, Any]) -> str:
    """``<prefix>.md`` from the record ``<prefix>.json`` alone (bench/render_results.py)."""
    return report(data)[0]


def report(data: Dict[str, Any]) -> tuple:
    """The report of a bench record (its ``runs``, setting, seeds, command; a stored ``summary`` / ``comparison``
    is ignored and recomputed) → ``(markdown, summary, comparison)``, written nowhere."""
    refs_mod = _refs_module()
    s = data["setting"]
    runs = data["runs"]
    models: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        models.setdefault((r["kind"], r["name"]), []).append(r)
    summary = {f"{k}:{n}": summarise_model(rs) for (k, n), rs in models.items()}
    lines = [f"# Learning parity on MQAR ({data['setting_name']}, CPU)", "",
             f"Command: `{data['command']}`", ""]
    if data.get("provenance"):          # a record extracted from an earlier report: where its runs come from
        lines += [f"Provenance: {data['provenance']}", ""]
    lines += [
             (f"torch {data['torch']}, {data['machine']}, one torch thread per run, each (model, seed) in its own "
              f"process. Started {data['started']}."), "",
             (f"Setting `{data['setting_name']}`: MQAR vocab {s['vocab_size']}, T = {s['seq_len']}, "
              f"{s['num_kv_pairs']} key-value pairs; d_model {s['d_model']}, {s['num_layers']} layers; batch "
              f"{s['batch_size']}, AdamW lr {s['lr']:g} ({_weight_decay_rule(runs)}, "
              "grad clip 1), "
              f"linear warm-up {s['warmup_steps']} steps then {s.get('schedule', 'constant')}; eval every "
              f"{s['eval_interval']} steps on "
              f"{s['eval_examples']} validation examples; up to {data['steps']} steps, early stop at val accuracy "
              f"≥ {s['early_stop']}. Seeds {', '.join(map(str, data['seeds']))}. The same atlaslab `train` loop and "
              f"data for every model (the batch of step s depends only on the seed and s)."), "",
             ("Final = the last evaluation's accuracy; steps to 90% = the first evaluation at ≥ 0.9 (a multiple of "
              "the eval interval); mean ± sample std over the seeds (steps-to-90 over the seeds that reached it, "
              "count shown). State = recurrent-state scalars per sequence after T tokens, summed over layers "
              "(ours: `LanguageModel.state_size(T)`; references: the same count: memory state + conv caches + "
              "KV cache)."), "",
             "| model | kind | params | state (T tokens) | final val acc | best val acc | steps to 90% | reached 90% | runs ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (kind, name), rs in models.items():
        m = summary[f"{kind}:{name}"]
        label = "ours" if kind == "preset" else ("probe" if name in refs_mod.PROBES else "reference")
        lines.append(f"| {name} | {label} | {m['num_parameters'] or '—'} | "
                     f"{m['state_size'] or '—'} | {_pm(m['final_accuracy'])} | {_pm(m['best_accuracy'])} | "
                     f"{_pm(m['steps_to_90'], fmt=lambda x: f'{x:.0f}')} | {m['reached_90']}/{m['seeds']} | "
                     f"{m['ok']}/{m['seeds']} |")
    comparisons = {}
    tuning = bool(set(data["seeds"]) & set(TUNING_SEEDS))
    lines += ["", f"## Verdicts (goal: ours reaches 90% within {GOAL_FACTOR}× the reference's steps)", "",
              VERDICT_RULE, "",
              *([tuning_note(data["seeds"]), ""] if tuning else []),
              "| preset | reference | ref reached 90% | ours reached 90% | ours steps | ref steps | ours / ref | "
              f"90% interval | {TUNING_COLUMN if tuning else 'verdict'} |",
              "|---|---|---|---|---|---|---|---|---|"]
    rows = 0
    for (kind, name), rs in models.items():
        ref = refs_mod.PRESET_REF.get(name)
        if kind != "preset" or not ref:
            continue
        rows += 1
        ref_runs = models.get(("ref", ref))
        if not ref_runs:
            lines.append(f"| {name} | {ref} | — | — | — | — | — | — | reference not run |")
            continue
        c = compare(rs, ref_runs, budget=data["steps"])
        comparisons[name] = {"reference": ref, **c}
        lines.append(verdict_row(name, comparisons[name]))
    if not rows:
        lines.append("| — | — | — | — | — | — | — | — | no preset with a reference in this run |")
    if data.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in data["skipped"].items())]
    fails = [f"{n}: {f}" for (k, n), rs in models.items() for f in summary[f"{k}:{n}"]["failures"]]
    if fails:
        lines += ["", "Failed runs: " + "; ".join(fails)]
    lines += ["", "## References", ""]
    ran = {n for k, n in models if k == "ref"}
    lines += [f"- `{n}`: {d}" for n, d in refs_mod.ref_info().items() if n in ran] or ["- none in this run"]
    if data.get("ref_kwargs"):
        lines += ["", "Reference options of this run: " + "; ".join(
            f"{n}: {', '.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in data["ref_kwargs"].items() if kw) + "."]
    lines += ["", "## Curves (step: val accuracy)", ""]
    for r in runs:
        c = curve(r.get("history", []))
        pts = " ".join(f"{st}:{a:.2f}" for st, a in c) or "—"
        extra = f" — {r['status']}" + (f": {r['message']}" if r.get("message") else "")
        if r.get("reused_from"):
            extra += f" (reused: {r['reused_from']})"
        wall = f", {r['wall_s']:.0f}s" if r.get("wall_s") is not None else ""
        lines.append(f"- {r['name']} seed {r['seed']}{extra}{wall}: {pts}")
    return "\n".join(lines) + "\n", summary, comparisons


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _job_key(job: Dict[str, Any]) -> str:
    return json.dumps({"kind": job["kind"], "name": job["name"], "seed": job["seed"], "steps": job["steps"],
                       "setting": job["setting"], "ref_kwargs": job.get("ref_kwargs") or {},
                       "model_config": job.get("model_config")}, sort_keys=True)


def _previous_runs(path: Path) -> Dict[str, Dict[str, Any]]:
    """The successful runs of an earlier results file, by job key (for ``--reuse``): every reference run, and the
    preset runs that recorded their resolved model config (files older than that record retrain their presets)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    out = {}
    for r in old.get("runs", []):
        if r.get("status") == "failed" or (r.get("kind") == "preset" and "model_config" not in r):
            continue
        key = _job_key({**r, "steps": old["steps"], "setting": old["setting"],
                        "ref_kwargs": old.get("ref_kwargs", {}).get(r["name"], {}) if r.get("kind") == "ref" else {}})
        out[key] = {**r, "reused_from": r.get("reused_from") or f"{path.name}, run started {old.get('started')}"}
    return out


def _config_matches(old: Any, new: Any, baseline: Any) -> bool:
    """Does a run recorded with the resolved config ``old`` stand for ``new``? Equal values match; a field that
    ``new`` has and ``old`` lacks (an option added since the run) matches when it holds ``baseline``'s value, the
    preset resolved without this run's ``--override``s, i.e. the new option's default (which keeps the old
    behaviour); a field ``old`` has and ``new`` lacks never matches."""
    if isinstance(old, dict) and isinstance(new, dict):
        base = baseline if isinstance(baseline, dict) else {}
        return (all(k in new and _config_matches(v, new[k], base.get(k)) for k, v in old.items())
                and all(k in base and new[k] == base[k] for k in new.keys() - old.keys()))
    return old == new


def _find_previous(previous: Dict[str, Dict[str, Any]], job: Dict[str, Any],
                   baseline: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The earlier run that stands for ``job``: the one with its exact key, else (presets) one of the same name,
    seed, steps and setting whose recorded config matches by :func:`_config_matches`; in both cases only if the
    training loop has not changed since, for this model (:func:`atlaslab.train.revision_changes_training`; a run
    that recorded no ``train_revision`` is of revision 1)."""
    rec = _same_job(previous, job, baseline)
    if rec is None or rec.get("train_revision", 1) == _training_revision():
        return rec
    from atlaslab.train import revision_changes_training
    model, _ = build_model(job, job.get("model_config"))
    return None if revision_changes_training(rec.get("train_revision", 1), model) else rec


#: what weight decay reached under each training-loop revision (atlaslab.train.TRAINING_REVISION)
WEIGHT_DECAY_RULES = {1: "weight decay 0.1 on every parameter of 2 or more dims, per-head norm gains [H, D] included",
                      2: "weight decay 0.1 on weight matrices, not norm gains"}


def _weight_decay_rule(runs: List[Dict[str, Any]]) -> str:
    """The weight-decay rule of the runs, by the training revision each recorded (none recorded: revision 1); runs of
    several revisions name each rule with its revision."""
    revs = sorted({int(r.get("train_revision", 1)) for r in runs})
    if len(revs) == 1:
        return f"{WEIGHT_DECAY_RULES[revs[0]]}: training revision {revs[0]}"
    return "; ".join(f"training revision {v}: {WEIGHT_DECAY_RULES[v]}" for v in revs) + \
        " — each run's revision is in the JSON"


def _training_revision() -> int:
    from atlaslab.train import TRAINING_REVISION
    return TRAINING_REVISION


def _same_job(previous: Dict[str, Dict[str, Any]], job: Dict[str, Any],
              baseline: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    rec = previous.get(_job_key(job))
    if rec is not None or job["kind"] != "preset" or baseline is None:
        return rec
    for key, run in previous.items():
        k = json.loads(key)
        if (k["kind"], k["name"], k["seed"], k["steps"], k["setting"]) == \
                (job["kind"], job["name"], job["seed"], job["steps"], job["setting"]) \
                and _config_matches(k["model_config"], job["model_config"], baseline):
            return run
    return None


def _options(items: Sequence[str]) -> Dict[str, Any]:
    """``["key=json", …]`` → {key: value} (a value that is not JSON stays a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--titans-option {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _names(arg: Optional[str], default: Sequence[str]) -> List[str]:
    if arg is None:
        return list(default)
    if arg.strip().lower() in ("", "none"):
        return []
    return [a.strip() for a in arg.split(",") if a.strip()]


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="calibration")
    ap.add_argument("--presets", help=f"comma list, or 'none' (default: {','.join(DEFAULT_PRESETS)})")
    ap.add_argument("--refs", help="comma list, or 'none' (default: every available reference; probes only by name)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, help="max steps (default: the setting's)")
    ap.add_argument("--out", help="results prefix (default: bench/results/learning_cpu | learning_hard_cpu)")
    ap.add_argument("--parallel", type=int, default=1, help="(model, seed) runs at a time, each its own process")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per (model, seed) run before it is killed")
    ap.add_argument("--titans-chunk", type=int, default=4, help="titans-pytorch NeuralMemory chunk_size")
    ap.add_argument("--softmax-positions", default="learned_small",
                    help="softmax_transformer's positions: learned | learned_small (the default, chosen on seeds "
                         "0-2) | rope (learning_refs.SOFTMAX_POSITIONS)")
    ap.add_argument("--titans-option", action="append", default=[], metavar="KEY=JSON",
                    help="a titans-pytorch NeuralMemory constructor option for titans_neural_memory (repeatable), "
                         "e.g. qk_rmsnorm=true")
    ap.add_argument("--gdn-expand-v", type=float, default=2.0,
                    help="fla GDN ref value head dim / key head dim (fla's default 2)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotlist override applied to every preset of the run (repeatable; recorded in each run's "
                         "resolved config, so --reuse tells such runs apart), e.g. mixers.deltanet.output_gate=false")
    ap.add_argument("--in-ref-lm", default="deltanet", metavar="PRESET",
                    help="the preset of the shell probes: ours_in_ref_lm puts its mixers in the references' LM shell, "
                         "ref_in_our_lm puts its fla reference's layers in its language model")
    ap.add_argument("--reuse", action="store_true",
                    help="take runs with the same name, seed, steps, setting and options (for presets: the same "
                         "resolved model config) from the existing <out>.json instead of training them again "
                         "(marked 'reused' in the report)")
    ap.add_argument("--reuse-from", action="append", default=[], metavar="JSON",
                    help="also take matching runs from this results file (repeatable; implies --reuse), e.g. to pool "
                         "seeds that ran in separate commands into one report")
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="only rewrite the reports of these results files from their recorded runs (no training)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        for path in args.render:
            render(Path(path))
            print(f"rendered {path[:-len('.json')]}.md")
        return
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    import torch
    refs_mod = _refs_module()
    setting = dict(SETTINGS[args.setting])
    steps = args.steps or setting["steps"]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    presets = _names(args.presets, DEFAULT_PRESETS)
    refs = _names(args.refs, [r for r in refs_mod.REFS if r not in refs_mod.PROBES])
    out = Path(args.out) if args.out else RESULTS / ("learning_cpu" if args.setting == "calibration"
                                                     else f"learning_{args.setting}_cpu")
    c = LACT_CHUNK[args.setting]
    ref_kwargs = {"softmax_transformer": {"positions": args.softmax_positions},
                  "titans_neural_memory": {"chunk_size": args.titans_chunk, **_options(args.titans_option)},
                  "fla_gated_deltanet": {"expand_v": args.gdn_expand_v},
                  "lact": {"chunk_size": c, "window": c}, "ours_in_ref_lm": {"preset": args.in_ref_lm},
                  "ref_in_our_lm": {"preset": args.in_ref_lm,
                                    **({"expand_v": args.gdn_expand_v} if args.in_ref_lm == "gated_deltanet" else {})}}
    previous = {}
    if args.reuse or args.reuse_from:     # the output file's own runs win over those of the extra files
        for path in [*args.reuse_from, str(out) + ".json"]:
            previous.update(_previous_runs(Path(path)))
    skipped, jobs = {}, []
    for name in refs:
        ok, why = refs_mod.available(name)
        if not ok:
            skipped[name] = why
            print(f"skip reference {name}: {why}", flush=True)
            continue
        jobs += [{"kind": "ref", "name": name, "seed": sd, "ref_kwargs": ref_kwargs.get(name, {})} for sd in seeds]
    baselines = {}            # each preset without --override: the defaults of options added since a reused run
    for name in presets:      # resolving the config here also rejects a bad preset before any run starts
        job = {"kind": "preset", "name": name, "overrides": preset_overrides(name, args.setting) + args.override,
               "setting": setting}
        config = preset_config(job)
        baselines[name] = preset_config({**job, "overrides": preset_overrides(name, args.setting)})
        jobs += [{**job, "seed": sd, "model_config": config} for sd in seeds]
    data = {"command": "python bench/learning.py" + (" " + shlex.join(argv) if argv else ""),
            "setting_name": args.setting, "setting": setting, "steps": steps, "seeds": seeds,
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "presets": presets, "refs": refs,
            "ref_kwargs": ref_kwargs, "skipped": skipped, "runs": []}
    done: Dict[int, Dict[str, Any]] = {}
    lock = threading.Lock()

    def one(i: int, job: Dict[str, Any]) -> None:
        job = {**job, "setting": setting, "steps": steps}
        print(f"[{i}/{len(jobs)}] {job['kind']} {job['name']} seed {job['seed']}", flush=True)
        rec = _find_previous(previous, job, baselines.get(job["name"]) if job["kind"] == "preset" else None)
        if rec is None:
            rec = run_job(job, args.timeout)
        else:
            print("  reused from the previous results file", flush=True)
        m = summarise_run(rec)
        print(f"[{i}/{len(jobs)}] {job['name']} seed {job['seed']}: {rec['status']}"
              + (f" ({rec.get('message')})" if rec.get("message") else "")
              + (f", final acc {m['final_accuracy']:.3f}, steps to 90%: {m['steps_to_90']}" if m["ok"] else ""),
              flush=True)
        with lock:                          # the report keeps the job order, whichever run ends first
            done[i] = rec
            data["runs"] = [done[k] for k in sorted(done)]
            write_report(data, out)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for f in [pool.submit(one, i, job) for i, job in enumerate(jobs, 1)]:
            f.result()
    md = write_report(data, out)
    print(md)
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
