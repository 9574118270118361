"""compile=True (torch.compile of the chunked engine's per-chunk work) equals eager: outputs, final state and the
gradients of every input, gate and parameter, in float64; the setting is checked once and a missing toolchain is a
clear error. The equality tests compile (tens of seconds each on a loaded 2-core machine): slow."""
import pytest
import torch
from helpers import random_qkv, rms_ratio
from test_chunked import build as _parts   # the parts in float64, seeded, with a non-trivial initial memory
from test_engine import SPECS, gates_for

from atlaslab import memorize
from atlaslab.engines import compiled as compiled_mod
from atlaslab.models.layers import MemoryLayer
from atlaslab.registry import ConfigError, resolve_part

B, H, D = 2, 2, 4
TOL = 1e-10
#: one spec per compiled path: the online linear rules' block forms (delta rule), the dual form with momentum
#: (a Titans-like deep memory) and with GD over an Omega window (ATLAS without Muon)
COMPILED_SPECS = {
    "gdn": SPECS["gdn"],
    "titans": SPECS["titans"],
    "atlas_gd": {"memory": {"name": "mlp", "residual": False, "expansion": 1}, "feature_map": "polynomial",
                 "retention": "decay", "inner_optimizer": "gd", "window": {"size": 3}, "chunk_size": 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED_SPECS))
def test_compiled_equals_eager_in_float64(name):
    parts = _parts(COMPILED_SPECS[name])
    T = 10   # not a multiple of the chunk (b = 4): a partial last chunk
    q, k, v = random_qkv(B, T, H, D, requires_grad=True)
    gates = {n: x.clone().requires_grad_(True) for n, x in gates_for(parts, T=T, seed=1).items()}
    leaves = [q, k, v, *gates.values(), *parts.parameters()]
    results = []
    for compile in (False, True):
        o, state = memorize(q, k, v, parts, gates, mode="chunked", compile=compile)
        weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=o.dtype)
        grads = torch.autograd.grad((o * weight).sum(), leaves, allow_unused=True)
        results.append((o, state, grads))
    (o_e, s_e, g_e), (o_c, s_c, g_c) = results
    assert rms_ratio(o_c, o_e) < TOL
    for n in s_e.weights:
        assert rms_ratio(s_c.weights[n], s_e.weights[n]) < TOL
        if s_e.momentum is not None:
            assert rms_ratio(s_c.momentum[n], s_e.momentum[n]) < TOL
    checked = 0
    for a, r in zip(g_c, g_e):
        assert (a is None) == (r is None)
        if r is not None and r.abs().sum() > 0:
            assert rms_ratio(a, r) < TOL
            checked += 1
    assert checked >= 5   # q, k, v, the gates and the initial memory all carry gradient


@pytest.mark.slow
def test_memory_layer_compile_setting_equals_eager():
    """``compile: true`` in a layer config reaches the engine: same outputs and parameter gradients (float64)."""
    outs = []
    for compile in (False, True):
        torch.manual_seed(0)
        cfg = resolve_part("mixer", {"name": "memory", "memory": COMPILED_SPECS["titans"], "num_heads": 2,
                                     "compile": compile})
        layer = MemoryLayer(cfg, 8).double()
        x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        y = layer(x)
        y.square().sum().backward()
        outs.append((y, [p.grad for p in layer.parameters()]))
    assert rms_ratio(outs[1][0], outs[0][0]) < TOL
    for a, r in zip(outs[1][1], outs[0][1]):
        if r is not None and r.abs().sum() > 0:
            assert rms_ratio(a, r) < TOL


@pytest.mark.parametrize("fields, bad", [({"mode": "recurrent", "compile": True}, "mixers.m.compile"),
                                         ({"checkpoint": True, "compile": True}, "mixers.m.compile")])
def test_compile_setting_is_checked_once(fields, bad):
    with pytest.raises(ConfigError) as exc:
        resolve_part("mixer", {"name": "memory", "memory": SPECS["gdn"], **fields}, path="mixers.m")
    assert exc.value.path == bad


def test_memorize_rejects_compile_outside_the_chunked_engine():
    parts = _parts(SPECS["gdn"])
    q, k, v = random_qkv(B, 4, H, D)
    with pytest.raises(ValueError, match="compile=True runs the chunked engine"):
        memorize(q, k, v, parts, gates_for(parts, T=4), mode="recurrent", compile=True)


def test_missing_cpp_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "atlaslab-no-such-compiler++")
    monkeypatch.setattr(compiled_mod, "_CHECKED", set())
    parts = _parts(SPECS["gdn"])
    q, k, v = random_qkv(B, 4, H, D)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        memorize(q, k, v, parts, gates_for(parts, T=4), mode="chunked", compile=True)


def test_missing_python_headers_are_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled_mod.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.setattr(compiled_mod, "_CHECKED", set())
    with pytest.raises(RuntimeError, match="Python development headers"):
        compiled_mod.check_toolchain(torch.device("cpu"))
