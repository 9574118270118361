"""Weight decay reaches weight matrices only: never norm gains and offsets, even per-head ``[H, D]`` ones."""
import pytest
import torch
from torch import nn

from atlaslab.models import build_model, list_presets, load_preset
from atlaslab.train import TrainConfig, make_optimizer

#: parameters that are weights although no Linear / Embedding / Conv1d owns them: learned initial fast weights
#: (``init_W``, ``init_W1``, …) and learned tokens (ARMT's memory tokens, Titans MAC's persistent memory)
WEIGHT_LIKE = ("init_", "memory_tokens", "persistent")


def _decayed_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> set:
    ids = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _expected_decayed(model: nn.Module) -> set:
    names = set()
    for mod_name, mod in model.named_modules():
        for pn, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pn}" if mod_name else pn
            if (isinstance(mod, (nn.Linear, nn.Embedding, nn.Conv1d)) and pn == "weight") or pn.startswith(WEIGHT_LIKE):
                names.add(full)
    return names


@pytest.mark.parametrize("preset", list_presets())
def test_only_weight_matrices_decay(preset):
    model = build_model(load_preset(preset, []))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    assert _decayed_names(model, opt) == _expected_decayed(model)


@pytest.mark.parametrize("preset", ["deltanet", "titans", "fox_pro", "lact"])
def test_norm_gains_keep_their_value_under_decay_alone(preset):
    """With zero gradients AdamW's step is decay alone: weights shrink, every norm gain stays at 1."""
    model = build_model(load_preset(preset, []))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.5, lr=1.0))
    gains = {n: p for n, p in model.named_parameters() if "norm" in n or n.endswith(("ln_weight", "qk_scale"))}
    assert any(p.ndim >= 2 for p in gains.values()), "the preset should have a per-head norm gain"
    proj = next(m for m in model.layers[0].mixer.modules() if isinstance(m, nn.Linear))
    before = proj.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in gains.items():
        assert torch.equal(p.detach(), torch.ones_like(p)), n
    torch.testing.assert_close(proj.weight.detach(), 0.5 * before)      # (1 − lr · wd) · W
