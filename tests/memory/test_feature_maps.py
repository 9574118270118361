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


def polynomial_direct(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """φ(x) for p = 2 by its definition: [√a_0, √a_1 x_i (i ≤ d), √(2 a_2) x_i x_j (i < j), √a_2 x_i² ] in the
    order of combinations_with_replacement, for ``x: [d]``."""
    d = x.shape[0]
    feats = [a[0].sqrt()] + [a[1].sqrt() * x[i] for i in range(d)]
    for i in range(d):
        for j in range(i, d):
            feats.append((a[2].sqrt() * (1.0 if i == j else 2.0 ** 0.5)) * x[i] * x[j])
    return torch.stack(feats)


@pytest.mark.parametrize("name", ["polynomial", "exp"])
def test_degree_two_polynomial_map_is_its_definition_and_the_general_loop(name):
    """The p = 2 map (one autograd node over e = [1, x]) equals the definition, the monomial loop used for other
    degrees and its plain-autograd reference bit for bit, and its kernel is Σ a_i (qᵀk)^i; its gradients equal the
    loop's and the reference's."""
    cfg = {"name": name, "degree": 2, **({"mode": "taylor"} if name == "exp" else {})}
    fm = build_part("feature_map", cfg, in_dim=4).double()
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    phi = fm(x)
    a = fm.coefficients().double()
    assert phi.shape[-1] == fm.out_dim == 15
    expected = torch.stack([polynomial_direct(row, a) for row in x.reshape(-1, 4)]).reshape(3, 5, -1)
    assert torch.allclose(phi, expected, rtol=1e-14, atol=0)
    loop = torch.cat([a[0].sqrt().expand(3, 5, 1)] + [x[..., fm._idx1].prod(-1) * (fm._scale1 * a[1].sqrt()),
                                                     x[..., fm._idx2].prod(-1) * (fm._scale2 * a[2].sqrt())], -1)
    assert torch.equal(phi, loop)
    reference = fm._degree_two_reference(x, fm.coefficients().to(x.dtype))
    assert torch.equal(phi, reference)
    q, k = x[0, 0], x[1, 1]
    kernel = phi[0, 0] @ phi[1, 1]
    assert torch.allclose(kernel, a[0] + a[1] * (q @ k) + a[2] * (q @ k) ** 2, rtol=1e-13)
    w = torch.randn(phi.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [x, *fm.parameters()]
    g_ref = torch.autograd.grad((reference * w).sum(), leaves, retain_graph=True)
    for g_new, g_loop, g_r in zip(torch.autograd.grad((phi * w).sum(), leaves),
                                  torch.autograd.grad((loop * w).sum(), leaves), g_ref):
        assert torch.allclose(g_new, g_loop, rtol=1e-13, atol=1e-15)
        assert torch.allclose(g_new, g_r, rtol=1e-13, atol=1e-15)
