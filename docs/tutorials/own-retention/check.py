"""What the norm-ball retention of my_retention.py gets from atlaslab: validation and every engine.

Run it with this folder on the path: PYTHONPATH=docs/tutorials/own-retention python docs/tutorials/own-retention/check.py
"""
import torch

import my_retention  # noqa: F401  (registers retention 'norm_ball')
from atlaslab import build_memory, memorize, resolve_memory_spec
from atlaslab.engines.triton import spec_reason
from atlaslab.registry import ConfigError

# 1. Validation: a typo in the name, a field or a value is a ConfigError naming the dotted path and the choices.
for retention in ({"name": "my_retention.norm_bal"},
                  {"name": "my_retention.norm_ball", "raduis": 2.0},
                  {"name": "my_retention.norm_ball", "radius": -1.0}):
    try:
        resolve_memory_spec({"retention": retention})
    except ConfigError as e:
        print(e)
    else:
        raise AssertionError(f"{retention} was accepted")

# 2. Every engine: the recurrent reference, the chunked engine and mode="triton" agree (float64).
torch.manual_seed(0)
B, T, H, D = 2, 12, 2, 8
q, k, v = torch.randn(3, B, T, H, D, dtype=torch.float64).unbind(0)
q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
gates = {"lr": torch.rand(B, T, H, dtype=torch.float64),
         "retention": 0.9 + 0.1 * torch.rand(B, T, H, dtype=torch.float64)}
for memory, b in (("linear", 1), ("linear", 4), ("mlp", 4)):
    spec = {"memory": memory, "attentional_bias": "l2", "inner_optimizer": {"name": "gd", "lr": 1.0},
            "retention": {"name": "my_retention.norm_ball", "radius": 0.5}, "chunk_size": b}
    parts = build_memory(spec, num_heads=H, key_dim=D, value_dim=D).double()
    out = {mode: memorize(q, k, v, parts, gates, mode=mode) for mode in ("recurrent", "chunked", "triton")}
    ref, state = out["recurrent"]
    for mode, (o, _) in out.items():
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    norm = max(w.flatten(2).norm(dim=-1).max().item() for w in state.weights.values())
    assert norm <= 0.5 + 1e-9, norm            # T is a multiple of b: the state is at a chunk end, inside the ball
    print(f"{memory} memory, b = {b}: recurrent = chunked = triton; max ‖W_T‖_F = {norm:.3f} (R = 0.5, T = {T}); "
          f"Triton kernel: {spec_reason(parts, b) or 'yes'}")
