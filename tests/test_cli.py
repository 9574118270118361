"""The ``atlaslab`` command line: ``list`` and ``show``.

``show`` prints the resolved config and the state size; the state size is checked against a count made
independently from that printed config (fast weights per head from the memory's shapes, × momentum / dual
copies, + the Omega window's last c − 1 (k, v, γ), + conv caches, + KV caches), not from the model objects.
"""
import math

import pytest
import yaml

from atlaslab.cli import COMMANDS, main
from atlaslab.models.presets import list_presets

PRESETS = list_presets()


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_all_kinds_and_presets(capsys):
    rc, out, _ = run(capsys, "list")
    assert rc == 0
    for header in ("memory:", "attentional_bias:", "retention:", "feature_map:", "inner_optimizer:", "window:",
                   "mixer:", "block:", "preset:"):
        assert header in out.splitlines(), header
    assert "  muon " in out and "  mac " in out and "  atlas " in out


def test_list_one_kind_with_a_pattern(capsys):
    rc, out, _ = run(capsys, "list", "mixer")
    assert rc == 0 and out.splitlines()[0] == "mixer:"
    mixers = {line.split()[0] for line in out.splitlines()[1:]}
    assert mixers == {"attention", "forgetting_attention", "lact", "memory", "swa"}
    rc, out, _ = run(capsys, "list", "preset", "--pattern", "titans*")
    assert {line.split()[0] for line in out.splitlines()[1:]} == {"titans", "titans_mac", "titans_mag", "titans_mal"}
    rc, _, err = run(capsys, "list", "mixers")
    assert rc == 2 and "mixer" in err


def test_subcommands_are_pluggable():
    assert {"list", "show"} <= set(COMMANDS)


# ---------------------------------------------------------------------------------------------------
# independent state count from the printed config
# ---------------------------------------------------------------------------------------------------
def _feature_dim(spec, dk):
    fm = spec["feature_map"]
    if fm["name"] == "polynomial":
        return math.comb(dk + fm["degree"], fm["degree"])
    if fm["name"] == "exp":
        kernel = fm["mode"] == "kernel" or (fm["mode"] == "auto" and spec["memory"]["name"] == "linear")
        return None if kernel else math.comb(dk + fm["degree"], fm["degree"])
    return dk


def _fast_weights_per_head(arch, feat, dv):
    name = arch["name"]
    if name == "linear":
        return dv * feat
    if name == "diagonal":
        return feat
    base = dv if arch.get("hidden_from") == "output" else feat
    hidden = max(1, int(round(arch["expansion"] * base)))
    if name == "gated_mlp":
        return 2 * hidden * feat + dv * hidden
    dims = [feat] + [hidden] * (arch["depth"] - 1) + [dv]
    return sum(a * b for a, b in zip(dims, dims[1:]))


def _memory_layer_state(m, d):
    h = m["num_heads"]
    dk = m["head_dim"] or d // h
    dv = m["value_dim"] or d // h
    spec = m["memory"]
    feat = _feature_dim(spec, dk)
    conv = (m["conv_size"] - 1) * h * (2 * dk + dv) if m["conv"] else 0
    momentum = spec["inner_optimizer"]["name"] in ("momentum", "muon")
    if feat is None:                                                   # exp kernel trick: slots per token
        return conv, h * (dk + dv * (1 + momentum))
    copies = 1 + momentum + (spec["retention"]["name"] in ("lq", "kl", "elastic_net", "sigmoid"))
    c = spec["window"].get("size")
    window = (c - 1) * h * (dk + dv + 1) if c else 0
    per_token = h * (dk + dv + 1) if c is None else 0
    return h * _fast_weights_per_head(spec["memory"], feat, dv) * copies + window + conv, per_token


def _kv(tokens, heads, head_dim):
    return tokens * 2 * heads * head_dim


def expected_state(cfg):
    d, fixed, per_token = cfg["d_model"], 0, 0
    for i in range(cfg["num_layers"]):
        m = cfg["mixers"][cfg["layers"][i % len(cfg["layers"])]]
        name = m["name"]
        if name in ("attention", "swa"):
            hd = m["head_dim"] or d // m["num_heads"]
            if name == "swa":
                fixed += _kv(m["window"], m["num_heads"], hd)
            else:
                per_token += _kv(1, m["num_heads"], hd)
            continue
        if name == "forgetting_attention":                             # KV cache + log f per token, token shifts
            h, hd = m["num_heads"], m["head_dim"] or d // m["num_heads"]
            per_token += _kv(1, h, hd) + h
            fixed += (m["k_shift"] + m["v_shift"]) * h * hd
            continue
        if name == "lact":                                             # fast weights (+ momentum) + SWA cache
            h = m["ttt_heads"]
            spec = m["memory"]
            momentum = spec["inner_optimizer"]["name"] in ("momentum", "muon")
            fixed += h * _fast_weights_per_head(spec["memory"], d // h, d // h) * (1 + momentum)
            fixed += _kv(m["window"], m["num_heads"], d // m["num_heads"])
            continue
        if name == "armt":                                             # A, z per memory head + one segment's KV
            hm = m["memory_heads"]
            dk, fm = m["key_dim"] or d // hm, m["feature_map"]
            feat = 2 * dk * fm.get("nu", 3) if fm["name"] == "dpfp" else dk
            fixed += _kv(m["segment"], m["num_heads"], m["head_dim"] or d // m["num_heads"])
            fixed += hm * feat * (d // hm + 1) if m["use_memory"] else 0
            continue
        mem, mem_tok = _memory_layer_state(m, d)
        if name == "memory":
            fixed, per_token = fixed + mem, per_token + mem_tok
            continue
        a = m["attention"]
        ah = a["num_heads"] or m["num_heads"]
        ahd = a["head_dim"] or d // ah
        if name == "mac":
            fixed += _kv(m["segment"] * (2 if m["read_tokens"] else 1), ah, ahd)
            if m["read_tokens"] or m["gate"] != "none":
                dk = m["head_dim"] or d // m["num_heads"]
                read_conv = (m["conv_size"] - 1) * m["num_heads"] * dk if (m["read_tokens"] and m["conv"]) else 0
                fixed, per_token = fixed + mem + read_conv, per_token + mem_tok
            continue
        if name in ("mag", "mal"):
            fixed += _kv(a["window"], ah, ahd)
            if name == "mag" and m["gate"] == "none":
                continue
        fixed, per_token = fixed + mem, per_token + mem_tok
    return fixed, per_token


def parse_show(out):
    head, _, tail = out.partition("# ---")
    cfg = yaml.safe_load("\n".join(line for line in head.splitlines() if not line.startswith("#")))
    values = {}
    for line in tail.splitlines():
        key, sep, val = line.partition(":")
        if sep and val.strip().split(" ")[0].isdigit():
            values[key.strip()] = int(val.strip().split(" ")[0])
    return cfg, values


@pytest.mark.parametrize("name", PRESETS)
def test_show_prints_the_state_size_of_the_config(capsys, name):
    rc, out, _ = run(capsys, "show", name, "--context", "100")
    assert rc == 0
    cfg, values = parse_show(out)
    assert cfg["name"] == name and values["parameters"] > 0
    fixed, per_token = expected_state(cfg)
    assert values["state_size"] == fixed
    assert values["state_size_per_token"] == per_token
    assert values["state_size_at_context"] == fixed + 100 * per_token


@pytest.mark.parametrize("overrides", [
    ["mixers.deeptransformer.memory.memory={name: linear, init: zeros}"],        # exp kernel trick: per token
    ["mixers.deeptransformer.memory.window={name: global}"],                    # global window: per token
    ["mixers.deeptransformer.memory.inner_optimizer.name=momentum", "mixers.deeptransformer.head_dim=6",
     "mixers.deeptransformer.value_dim=5", "mixers.deeptransformer.conv=false", "num_layers=3"],
])
def test_show_state_size_with_overrides(capsys, overrides):
    rc, out, _ = run(capsys, "show", "deeptransformer", *overrides)
    assert rc == 0
    cfg, values = parse_show(out)
    assert (values["state_size"], values["state_size_per_token"]) == expected_state(cfg)


def test_show_of_a_hybrid_and_linear_memory_count(capsys):
    rc, out, _ = run(capsys, "show", "gated_deltanet", "num_layers=3", "layers=[g, g, s]",
                     "mixers.g=${mixers.gated_deltanet}", "mixers.s={name: swa, window: 8}")
    assert rc == 0
    _, values = parse_show(out)
    h, dk = 4, 16                                    # defaults: d_model 64, 4 heads
    per_layer = h * dk * dk + 3 * h * 3 * dk         # H·D_v·D_k fast weights + conv caches (K − 1 = 3)
    assert values["state_size"] == 2 * per_layer + 8 * 2 * 64


def test_show_reports_config_errors_with_the_dotted_path(capsys):
    rc, _, err = run(capsys, "show", "atlas", "mixers.atlas.memory.inner_optimizer.name=muom")
    assert rc == 2
    assert "mixers.atlas.memory.inner_optimizer.name" in err and "muon" in err
    rc, _, err = run(capsys, "show", "no_such_model")
    assert rc == 2 and "preset" in err
