"""Feature maps against their definitions: DPFP (Schlag et al. 2021) by explicit index loops, its bounds and errors.

Its use inside every engine (recurrent, chunked, linear_delta, Triton) is checked by the engine parity tests, which
carry a DPFP spec (``dpfp_delta`` in tests/engines, ``deltanet_dpfp`` in tests/kernels/test_triton.py).
"""
import pytest
import torch

from atlaslab.memory import build_memory
from atlaslab.registry import ConfigError, build_part, get_registry


def dpfp_direct(x: torch.Tensor, nu: int) -> torch.Tensor:
    """φ_{2d(j−1)+i}(x) = r_i r_{(i+j) mod 2d}, r = [relu(x), relu(−x)], i < 2d, j ≤ ν, for ``x: [d]``."""
    r = [max(float(t), 0.0) for t in x] + [max(-float(t), 0.0) for t in x]
    n = len(r)
    return torch.tensor([r[i] * r[(i + j) % n] for j in range(1, nu + 1) for i in range(n)], dtype=torch.float64)


@pytest.mark.parametrize("nu", [1, 2, 3, 7])
def test_dpfp_is_its_definition(nu):
    d = 4
    fm = build_part("feature_map", {"name": "dpfp", "nu": nu}, in_dim=d)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(nu), dtype=torch.float64)
    phi = fm(x)
    assert fm.out_dim == phi.shape[-1] == 2 * d * nu
    expected = torch.stack([dpfp_direct(row, nu) for row in x.reshape(-1, d)]).reshape(3, 5, -1)
    assert torch.equal(phi, expected)
    assert (phi >= 0).all() and fm.nonnegative
    gram = phi.reshape(-1, phi.shape[-1]) @ phi.reshape(-1, phi.shape[-1]).T
    assert (gram >= 0).all()                                # every kernel value non-negative: a normaliser is safe


def test_dpfp_is_homogeneous_of_degree_two_and_parameter_free():
    fm = build_part("feature_map", {"name": "dpfp", "nu": 2}, in_dim=3)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.allclose(fm(2.5 * x), 2.5 ** 2 * fm(x), rtol=1e-13, atol=0)
    assert list(fm.parameters()) == []


def test_nonnegative_flags():
    flagged = {e.name for e in get_registry("feature_map") if getattr(e.cls, "nonnegative", False)}
    assert {"dpfp", "elu_plus_one"} <= flagged and not {"identity", "polynomial"} & flagged


def test_dpfp_bounds_name_the_field():
    with pytest.raises(ConfigError) as info:                     # ν ≤ 2·d_k − 1 is known only at build time
        build_memory({"feature_map": {"name": "dpfp", "nu": 8}}, 2, 4, 4)
    assert info.value.path == "memory.feature_map.nu" and "7" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_memory({"feature_map": {"name": "dpfp", "nu": 0}}, 2, 4, 4)
    assert info.value.path == "memory.feature_map.nu"
    assert build_memory({"feature_map": {"name": "dpfp", "nu": 3}}, 2, 4, 4).feature_map.out_dim == 24
