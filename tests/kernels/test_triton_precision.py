"""tl.dot input precision of the Triton kernels (atlaslab/kernels/utils.py: dot_precision): TF32 for half-precision inputs, torch's
float32 matmul precision for fp32 inputs, IEEE for fp64; what each wrapper really launches with."""
import pytest
import torch

from helpers import require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.kernels.delta_rule import chunk as chunk_mod  # noqa: E402
from atlaslab.kernels.newton_schulz import fused as ns_mod  # noqa: E402
from atlaslab.kernels.utils import dot_precision  # noqa: E402
from atlaslab.kernels.delta_rule.naive import delta_rule_recurrent  # noqa: E402

DEVICE = triton_device(tk)
GDN = dict(bias="l2", placement="before_step", read="token")


@pytest.fixture
def matmul_precision():
    """Restores torch's float32 matmul precision after a test that changes it."""
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


def test_rule(matmul_precision):
    matmul_precision("highest")
    assert [dot_precision(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == \
        ["tf32", "tf32", "ieee", "ieee"]
    assert dot_precision(torch.float16, False) == "ieee" and dot_precision(torch.float32, True) == "tf32"
    assert dot_precision(torch.float64, True) == "ieee"           # TF32 never applies to fp64
    matmul_precision("high")
    assert dot_precision(torch.float32) == "tf32" and dot_precision(torch.float32, False) == "ieee"


def _launch_precisions(monkeypatch, module):
    """Every PRECISION constexpr the module's kernels are launched with (a set, filled as they run)."""
    seen = set()

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                seen.add(kwargs.get("PRECISION"))
                return launch(*args, **kwargs)
            return run

    for name in dir(module):
        if name.endswith("_kernel"):
            monkeypatch.setattr(module, name, Recorded(getattr(module, name)))
    return seen


@pytest.mark.parametrize("dtype,want", [(torch.float32, "ieee"), (torch.float16, "tf32")])
def test_chunk_kernels_launch_with_the_chosen_precision(monkeypatch, matmul_precision, dtype, want):
    matmul_precision("highest")
    seen = _launch_precisions(monkeypatch, chunk_mod)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 18, 1, 16, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, 18, 1, 16, generator=g)
    beta = torch.rand(1, 18, 1, generator=g) * 0.5 + 0.2
    leaves = [x.to(DEVICE, dtype).clone().requires_grad_() for x in (q, k, v, beta)]
    o, _ = chunk_mod.chunk_delta_rule(*leaves, **GDN, chunk_size=16)
    o.float().square().sum().backward()
    assert seen == {want}
    ref = [x.to(DEVICE, torch.float64).requires_grad_() for x in (q, k, v, beta)]
    o_r, _ = delta_rule_recurrent(*ref, **GDN)
    o_r.square().sum().backward()
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert rms_ratio(o.double(), o_r) <= tol
    assert all(rms_ratio(a.grad.double(), r.grad) <= tol for a, r in zip(leaves, ref))


def test_newton_schulz_backward_takes_tf32_for_half_inputs(monkeypatch, matmul_precision):
    matmul_precision("highest")
    seen = _launch_precisions(monkeypatch, ns_mod)
    s = torch.randn(2, 16, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    ns_mod.newton_schulz(s, 2).float().sum().backward()
    assert seen == {"tf32"} and torch.isfinite(s.grad).all()
