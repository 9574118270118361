"""``atlaslab export-preset RUN_DIR [TRIAL]``: a trial's model as a preset file, from a finding to a named model.

    path = export_preset("runs/quickstart")                # the best trial → runs/quickstart/export/<name>.yaml
    path = export_preset("runs/quickstart", "t003", name="atlas_gd", into_package=True)
    model = build_model(str(path))                         # or `atlaslab show atlas_gd`, or a later experiment's
                                                           # model.preset

The preset is the trial's model config as the driver validated it: its preset with the experiment's overrides
applied (``model_config`` of ``trials.json``; a search's trial, which is made as the search runs, is made again from
its sampled ``params``), under a new ``name`` and ``description``. ``vocab_size`` stays the one the trial trained with
(its task's), as every preset carries one: an experiment replaces it with its own task's. The header comment says
where the preset came from: the experiment and run folder, the trial's key, label, seed and final metric, the
preset and overrides it was made of, its parts, and its size as trained. Before anything is written, the preset is
built on the meta device and must give the parameter count and state size recorded for the trial.

``into_package`` writes into the preset folder (``atlaslab/presets/``, or ``$ATLASLAB_PRESETS``), where
``atlaslab show NAME``, ``atlaslab list preset`` and the model zoo (``docs/gen_models.py``) find it.
"""
from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import yaml
from omegaconf import OmegaConf

from atlaslab.models.lm import resolve_lm_config
from atlaslab.models.presets import preset_dir
from atlaslab.registry import ConfigError
from atlaslab.search.expand import Validator, meta_model, trial_from_params
from atlaslab.search.formatting import fmt_value
from atlaslab.search.results import PickedTrial, expanded_trials, pick_trial

#: a preset name: a file name without folders or dots (``atlaslab show NAME`` and the zoo's anchor use it)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
#: where the docs explain the command (the header points there, as every preset header points into docs/)
DOCS = "docs/huggingface.md#export-preset"
#: the recorded sizes the exported preset must reproduce: record info key → what the built model gives
SIZES = {"num_parameters": lambda m: m.num_parameters(), "state_size_fixed": lambda m: m.state_size(),
         "state_size_per_token": lambda m: m.state_size_per_token()}


def validated_trial(picked: PickedTrial) -> Dict[str, Any]:
    """The picked trial as the driver validated it (``model_config``, ``info``, ``config``): from ``trials.json``
    (a grid), else made again from the record's sampled ``params`` (a search) and validated."""
    key = picked.record["key"]
    trial = expanded_trials(picked.run_dir).get(key)
    if trial is None and picked.exp.kind == "search":
        trial = trial_from_params(picked.exp, picked.record.get("params") or {}, key=key,
                                  setting=picked.record.get("setting") or None)   # its task's vocabulary
    if trial is None:
        raise ConfigError("trial", f"{picked.run_dir} has no trials.json entry for trial {key}.", value=key)
    if trial.get("model_config") is None:               # a search's trial, or a run folder of an older version
        trial = Validator(picked.exp).validate(dict(trial))
    return trial


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def header(picked: PickedTrial, trial: Mapping[str, Any], info: Mapping[str, Any]) -> List[str]:
    """The comment lines that say where the preset came from (prose, wrapped; the model zoo shows them)."""
    rec, exp = picked.record, picked.exp
    value = (rec.get("metrics") or {}).get(exp.metric)
    rank = "the best trial" if picked.is_best else f"status {rec.get('status')}"
    label = _one_line(rec.get("label") or rec["key"])
    model = trial["config"]["model"]
    overrides = [f"{k}={fmt_value(v)}" for k, v, *_ in model.get("overrides") or []]
    parts = [f"{k}={v}" for k, v in (info.get("components") or {}).items()]
    task = (trial["config"].get("task") or {}).get("name", "?")
    per_token = info.get("state_size_per_token") or 0
    text = [
        f"Exported by `atlaslab export-preset` ({DOCS}) from experiment '{_one_line(exp.name)}' "
        f"(run folder {_one_line(picked.run_dir)}): trial {rec['key']}" + (f" ({label})" if label != rec["key"] else "")
        + f", seed {rec.get('seed')}, {exp.metric} = "
        + (f"{value:.6g}" if isinstance(value, (int, float)) else "not reported")
        + f" ({rank}; {exp.metric} {exp.mode}).",
        f"Made of preset {model.get('preset')}"
        + (" with the overrides (in order) " + "; ".join(overrides) if overrides else "") + ".",
        "Parts: " + (", ".join(parts) if parts else "not recorded") + ".",
        f"As trained: {info.get('num_parameters', 0):,} parameters, recurrent state {info.get('state_size_fixed', 0):,}"
        + (f" + {per_token:,} per token" if per_token else "")
        + f"; vocab_size is the task's ({task}): an experiment sets its own task's.",
    ]
    return [f"# {line}" for para in text
            for line in textwrap.wrap(_one_line(para), 116, break_long_words=False, break_on_hyphens=False)]


def export_preset(run_dir: Any, trial: Optional[str] = None, name: Optional[str] = None, out: Any = None,
                  description: Optional[str] = None, into_package: bool = False, force: bool = False) -> Path:
    """Write trial ``trial`` of a finished run folder as a preset YAML file; returns its path.

    Args:
        run_dir: the experiment's run folder (``atlaslab run``; it needs ``results.json``).
        trial: a trial key (``t003``); ``None``: the best completed trial by the experiment's ``metric`` and
            ``mode``, as ``atlaslab export`` picks it.
        name: the preset's name (its ``name`` field and file name); default the file name of ``out``, else
            ``<experiment>_<trial>``.
        out: the file to write; default ``<run_dir>/export/<name>.yaml``.
        description: the preset's one-line ``description``; default the trial's label, experiment and metric.
        into_package: write ``<name>.yaml`` into the preset folder (:func:`atlaslab.models.presets.preset_dir`)
            instead, so that ``atlaslab show NAME`` and the model zoo find it.
        force: replace an existing file.

    Returns:
        The path of the preset file: ``atlaslab show PATH`` (or ``NAME``, ``into_package``) builds the trial's model,
        with the parameter count and state size recorded for the trial.

    Raises:
        ConfigError: an unknown trial (the valid keys listed), a bad name, ``out`` with ``into_package``, an existing
            file without ``force``, or a preset that does not build the recorded model.
    """
    if into_package and out is not None:
        raise ConfigError("out", "give either an output file or into_package, not both.", value=str(out))
    picked = pick_trial(run_dir, trial)
    rec, exp = picked.record, picked.exp
    if name is None:
        name = Path(out).stem if out is not None else re.sub(r"[^A-Za-z0-9_-]+", "_", f"{exp.name}_{rec['key']}")
    if not NAME.fullmatch(name):
        raise ConfigError("name", f"'{name}' is not a preset name (letters, digits, '_' and '-').", value=name)
    path = preset_dir() / f"{name}.yaml" if into_package else \
        Path(out) if out is not None else picked.run_dir / "export" / f"{name}.yaml"
    if path.exists() and not force:
        raise ConfigError("out", f"{path} exists; pass --force (force=True) to replace it.", value=str(path))

    t = validated_trial(picked)
    info = {**(t.get("info") or {}), **(rec.get("info") or {})}      # the record's, as the run reported it
    body = copy.deepcopy(t["model_config"])
    value = (rec.get("metrics") or {}).get(exp.metric)
    body["name"] = name
    body["description"] = _one_line(description) if description else _one_line(
        f"{rec.get('label') or rec['key']} ({exp.name} {rec['key']}"
        + (f", {exp.metric} {value:.4g}" if isinstance(value, (int, float)) else "") + ")")
    body = {"name": body.pop("name"), "description": body.pop("description"), **body}
    model = meta_model(resolve_lm_config(OmegaConf.create(body)))
    wrong = {k: (f(model), info[k]) for k, f in SIZES.items() if k in info and int(f(model)) != int(info[k])}
    if wrong:
        raise ConfigError("trial", f"the preset of trial {rec['key']} builds another model than the trial recorded "
                          "(built, recorded: " + ", ".join(f"{k} {a}, {b}" for k, (a, b) in wrong.items())
                          + "); the model code has changed since the run.", value=rec["key"])
    text = "\n".join(header(picked, t, info)) + "\n" + yaml.safe_dump(
        body, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


__all__ = ["export_preset", "header", "validated_trial"]
