"""Write ``docs/models.md`` (the model zoo) from the preset files and the registry.

    python docs/gen_models.py            # rewrite docs/models.md
    python docs/gen_models.py --check    # exit 1 if docs/models.md is stale

Every number on the page is computed here from the built model (parameters, recurrent-state size), and every
part from the resolved config, so the page cannot drift from the presets: ``tests/docs/test_docs.py`` compares the
committed file with :func:`render`. The presets are those of :func:`atlaslab.models.presets.list_presets` (the preset
folder, ``$ATLASLAB_PRESETS`` when set), so one that ``atlaslab export-preset --into-package`` wrote is listed too
(``tests/search/test_preset_export.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "models.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from atlaslab.models.layers import GateConfig, MemoryLayerConfig  # noqa: E402
from atlaslab.memory.spec import PART_KINDS, MemoryParts  # noqa: E402
from atlaslab.models.presets import build_model, list_presets, preset_path  # noqa: E402

PART_LABELS = {"memory": "memory", "attentional_bias": "attentional bias", "retention": "retention",
               "feature_map": "feature map φ", "inner_optimizer": "inner optimizer", "window": "window"}


# --------------------------------------------------------------------------------------------------
# the preset file's header comment, in the project's words
# --------------------------------------------------------------------------------------------------
#: A pointer into the site, ``docs/concepts/memory.md#retention-placement``, as the header writes it.
DOC_REF = re.compile(r"docs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")


def doc_link(m: "re.Match") -> str:
    """``docs/PAGE.md#anchor`` as a link relative to ``docs/models.md``, labelled by the anchor."""
    page, anchor = m.group(1), m.group(2)
    if anchor:
        return f"[{anchor.replace('-', ' ')}]({page}#{anchor})"
    return f"[{page[:-3].rsplit('/', 1)[-1]}]({page})"


def header_notes(name: str) -> str:
    """The preset file's leading comment block as prose; its pointers into ``docs/`` become links."""
    lines = []
    for line in preset_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return DOC_REF.sub(doc_link, md_escape(" ".join(lines).strip()))


# --------------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------------
def md_escape(text: str) -> str:
    """Prose with equations: φ*, M* are not emphasis and "[A Eq.25]" is not a link reference."""
    return text.replace("*", "\\*").replace("[", "\\[").replace("]", "\\]")


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v)) if abs(v) >= 1 else str(v)
    return str(v)


def fmt_part(node: Dict[str, Any]) -> str:
    """``name (field=value, …)`` of a resolved part config."""
    fields = [f"{k}={fmt_value(v)}" for k, v in node.items() if k != "name"]
    return f"`{node['name']}`" + (f" ({', '.join(fields)})" if fields else "")


def short_part(kind: str, node: Dict[str, Any], spec: Dict[str, Any]) -> str:
    name = node["name"]
    if kind == "memory" and name in ("mlp", "mlp_ln", "gated_mlp"):
        return f"{name} ×{node.get('depth', 2)}" if name != "gated_mlp" else name
    if kind == "retention" and name == "decay":
        return "decay " + ("before" if node.get("placement") == "before_step" else "after") + \
            (", channel-wise" if node.get("channel_wise") else "")
    if kind == "feature_map" and name == "polynomial":
        return f"polynomial p={node.get('degree')}"
    if kind == "feature_map" and name == "exp":
        return f"exp ({node.get('mode')})"
    if kind == "attentional_bias" and name == "lp":
        return f"lp p={fmt_value(node.get('p'))}"
    return name


def gate_notes(cfg: Any) -> List[str]:
    """Gate settings that differ from the defaults."""
    default = dataclasses.asdict(GateConfig())
    out = []
    for gate in ("lr", "retention", "momentum", "window", "delta"):
        g = dataclasses.asdict(getattr(cfg.gates, gate))
        diff = {k: v for k, v in g.items() if v != default[k]}
        if diff:
            out.append(f"{gate}: " + ", ".join(f"{k}={fmt_value(v)}" for k, v in diff.items()))
    return out


def memory_parts(mixer) -> MemoryParts:
    found = [m for m in mixer.modules() if isinstance(m, MemoryParts)]
    return found[0] if found else None


# --------------------------------------------------------------------------------------------------
# one preset
# --------------------------------------------------------------------------------------------------
def describe(name: str) -> Dict[str, Any]:
    model = build_model(name)
    r = model.resolved
    c = r.config
    mixers = []
    for key in dict.fromkeys(model.layer_keys):
        kind, mcfg = r.mixers[key]
        mixer = model.mixers()[model.layer_keys.index(key)]
        parts = memory_parts(mixer)
        mixers.append({"key": key, "kind": kind, "cfg": mcfg, "mixer": mixer,
                       "spec": parts.spec.to_dict() if parts is not None else None,
                       "heads": getattr(parts, "num_heads", getattr(mixer, "num_heads", None)),
                       "head_dim": getattr(parts, "key_dim", getattr(mixer, "head_dim", None))})
    return {"name": name, "model": model, "config": c, "mixers": mixers,
            "params": model.num_parameters(), "params_ne": model.num_parameters(exclude_embeddings=True),
            "state": model.state_size(), "state_per_token": model.state_size_per_token(),
            "notes": header_notes(name)}


def summary_row(d: Dict[str, Any]) -> str:
    mems = [m for m in d["mixers"] if m["spec"] is not None]
    kinds = [m["cfg"].name for m in d["mixers"] if m["cfg"].name != "memory"]
    name = f"[{d['name']}](#{d['name']})" + (f" ({', '.join(kinds)})" if kinds else "")
    if mems:
        s = mems[0]["spec"]
        cells = [short_part(k, s[k], s) for k in ("memory", "attentional_bias", "retention", "feature_map",
                                                  "inner_optimizer")]
        c = s["window"].get("size") if s["window"]["name"] == "omega" else "∞"
        cells += [str(c), str(s["chunk_size"])]
    elif d["mixers"][0]["cfg"].name == "armt":          # ARMT's associative memory is not a six-part memory spec
        m = d["mixers"][0]["mixer"]
        fm = m.feature_map.cfg if m.feature_map is not None else None
        phi = (f"{fm.name} ν={fm.nu}" if fm.name == "dpfp" else fm.name) if fm is not None else "—"
        cells = ["associative A, z" if fm is not None else "(segment attention)", "delta, normalised" if fm else "—",
                 "none" if fm else "—", phi, "one step per segment" if fm else "—", "—", str(m.cfg.segment)]
    else:
        cells = ["(softmax attention)", "—", "—", "—", "—", "—", "—"]
    state = fmt_int(d["state"]) + (f" + {fmt_int(d['state_per_token'])}/token" if d["state_per_token"] else "")
    return (f"| {name} | " + " | ".join(cells) +
            f" | {fmt_int(d['params'])} | {state} |")


def section(d: Dict[str, Any]) -> List[str]:
    c = d["config"]
    desc = md_escape(c.description)
    out = [f"## {d['name']} {{#{d['name']}}}", "", f"**{desc}**", ""]
    if d["notes"]:
        out += [d["notes"], ""]
    pattern = ", ".join(f"`{k}`" for k in c.layers)
    out += ["| field | value |", "|---|---|",
            f"| file | `atlaslab/presets/{d['name']}.yaml` (`atlaslab show {d['name']}`) |",
            f"| size | vocabulary {c.vocab_size}, d_model {c.d_model}, {c.num_layers} layers, pattern [{pattern}] |",
            f"| parameters | {fmt_int(d['params'])} ({fmt_int(d['params_ne'])} without the embedding) |",
            f"| recurrent state | {fmt_int(d['state'])} scalars per sequence"
            + (f", plus {fmt_int(d['state_per_token'])} per token of context (KV cache)" if d["state_per_token"]
               else "") + " |", ""]
    for m in d["mixers"]:
        cfg = m["cfg"]
        which = "memory heads" if (m["spec"] is not None and not isinstance(cfg, MemoryLayerConfig)) else "heads"
        head = f", {m['heads']} {which} of dimension {m['head_dim']}" if m["heads"] else ""
        what = {"block": "block", "mixer": "layer" if m["spec"] is not None else "mixer"}.get(m["kind"], m["kind"])
        out += [f"Mixer `{m['key']}`: a `{cfg.name}` {what}{head}.", ""]
        out += ["| part | resolved config |", "|---|---|"]
        if m["spec"] is not None:
            s = m["spec"]
            for kind in PART_KINDS:
                out.append(f"| {PART_LABELS[kind]} | {fmt_part(s[kind])} |")
            out.append(f"| training chunk b | {s['chunk_size']} |")
            out.append(f"| read | {s['read']} |")
            if isinstance(cfg, MemoryLayerConfig):
                gates = gate_notes(cfg)
                out.append(f"| gates | {'; '.join(gates) if gates else 'defaults'} |")
                base = {f.name for f in dataclasses.fields(MemoryLayerConfig)}
            else:   # a mixer of its own around a memory (lact): its fields after the memory's parts
                base = {"name", "memory", "mode"}
            out.append(f"| engine | `{cfg.mode}` |")
            for f in dataclasses.fields(cfg):
                if f.name in base:
                    continue
                v = getattr(cfg, f.name)
                if dataclasses.is_dataclass(v):
                    v = ", ".join(f"{k}={fmt_value(x)}" for k, x in dataclasses.asdict(v).items() if x is not None)
                out.append(f"| {f.name} | {fmt_value(v)} |")
        else:
            for f in dataclasses.fields(cfg):
                if f.name == "name":
                    continue
                v = getattr(cfg, f.name)
                if f.name == "head_dim" and v is None:
                    v = f"{m['head_dim']} (d_model / heads)"
                if isinstance(v, dict) and "name" in v:
                    v = fmt_part(v)
                out.append(f"| {f.name} | {fmt_value(v)} |")
        out.append("")
    return out


def render() -> str:
    descs = [describe(n) for n in list_presets()]
    lines = [
        "# Model zoo",
        "",
        "<!-- generated by docs/gen_models.py from atlaslab/presets/*.yaml and the registry; do not edit -->",
        "",
        f"{len(descs)} presets, one YAML file each in `atlaslab/presets/`. This page is generated from those",
        "files and from the models they build (`python docs/gen_models.py`), and a test fails when it is stale.",
        "Bracketed references point into the papers: A = ATLAS (arXiv 2505.23735), T = Titans (arXiv 2501.00663),",
        "M = Miras (arXiv 2504.13173).",
        "Every preset is a [language model](concepts/language-model.md) whose token mixers are",
        "[memories](concepts/memory.md) (or attention); the parts are explained on the memory page.",
        "",
        "Parameters and state are at each preset's own size (the numbers `atlaslab show PRESET` prints). *State* is",
        "the recurrent state a sequence carries, in scalars, summed over layers: fast weights, momentum, mirror-map",
        "accumulators, the last c − 1 window tokens and the SWA window's keys and values. Causal attention and the",
        "φ* kernel trick keep a cache that grows with the context instead: their growth is shown per token.",
        "A different size is an override away: `atlaslab show atlas d_model=128 mixers.atlas.num_heads=8`.",
        "",
        "A trial of a finished experiment becomes a preset with `atlaslab export-preset RUN_DIR [TRIAL] --name NAME",
        "--into-package` ([export a trial as a preset](huggingface.md#export-preset)). The file lands in",
        "`atlaslab/presets/`, so this page lists it once regenerated, and its header (the experiment, trial, seed, metric",
        "and overrides it came from) becomes its notes here.",
        "",
        "| preset (mixer) | memory | bias | retention | φ | optimizer | c | b | params | state |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [summary_row(d) for d in descs]
    lines += ["", "c = Omega window (1 = online), b = training chunk size (1 = fully online). The mixer is named when "
              "it is not the plain memory layer: the blocks `mag`, `mal`, `mac` wrap the same memory with an "
              "attention branch, `lact` pairs a memory with SWA on shared projections, `armt` is segment-local "
              "attention with an associative memory written once per segment (its b column is the segment length), "
              "and `attention`, `swa` are softmax attention.", ""]
    for d in descs:
        lines += section(d)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/models.md differs from the output")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        ok = OUT.is_file() and OUT.read_text() == text
        print("docs/models.md is up to date" if ok else "docs/models.md is stale: run python docs/gen_models.py")
        return 0 if ok else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
