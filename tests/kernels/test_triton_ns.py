"""The fused Newton–Schulz kernel's Triton backward (atlaslab/kernels/newton_schulz/fused.py, issue 6).

Gradients of the kernel path (forward saves the iterates, ``_ns_bwd_kernel`` walks them in reverse) against
autograd of the torch reference (``atlaslab.kernels.newton_schulz``) in float64, fla's RMS-error ratio ≤ 1e-3
in fp32: square, wide and tall matrices, a batch with extra leading dims, steps 0, 1, 5, ``shape_factor``,
non-default coefficients / ε, a zero matrix in the batch, a non-contiguous upstream gradient; the backward
kernel really runs (``BACKWARD_LAUNCHES``); the ``BACKWARD = "torch"`` fallback agrees and launches nothing;
no iterates are saved when the input needs no gradient; fp16 inputs (looser bar: the forward's products run
in fp16). The staged backward (``_ns_bwd_staged_kernel``, padded tiles over ``STAGED_TILE``: 128 × 128 and 64 × 256)
at small tiles with ``STAGED_TILE`` lowered (several row blocks, fewer programs than matrices so a program loops, the
same cases as above), which tiles take it, and at 128 × 128 and 256 × 64 as they are. Under TRITON_INTERPRET=1
on CPU: tiny shapes only.
"""
import pytest
import torch
from helpers import require_triton, rms_ratio, triton_device

tk = require_triton()

from atlaslab.kernels.newton_schulz import newton_schulz as ns_torch  # noqa: E402
from atlaslab.kernels.newton_schulz import fused as nsk  # noqa: E402

TOL = 1e-3
DEVICE = triton_device(tk)
pytestmark = pytest.mark.usefixtures("poison_empty")   # NaN-filled empty buffers (conftest)


def _grads(shape, seed=0, dtype=torch.float32, zero=None, **kw):
    """(kernel-path dS, float64 reference dS, kernel output, reference output) for a random S and weight W."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(*shape, generator=g)
    if zero is not None:
        s[zero] = 0.0
    w = torch.randn(*shape, generator=g)
    a = s.to(DEVICE, dtype).clone().requires_grad_()
    b = s.double().clone().requires_grad_()
    out = nsk.newton_schulz(a, **kw)
    (out.float() * w.to(DEVICE)).sum().backward()
    ref = ns_torch(b, **kw)
    (ref * w.double()).sum().backward()
    return a.grad, b.grad, out, ref


def _check(shape, tol=TOL, **kw):
    before = nsk.BACKWARD_LAUNCHES
    da, db, out, ref = _grads(shape, **kw)
    assert nsk.BACKWARD_LAUNCHES == before + 1, "the backward kernel did not run"
    assert da.shape == db.shape and torch.isfinite(da).all()
    assert rms_ratio(out.double().cpu(), ref) <= tol
    err = rms_ratio(da.double().cpu(), db)
    assert err <= tol, err
    return err


@pytest.mark.parametrize("shape", [(2, 12, 12), (2, 8, 16), (2, 16, 8), (3, 5, 12), (2, 13, 6), (2, 3, 4, 8)],
                         ids=["square", "wide", "tall", "wide_ragged", "tall_ragged", "batch"])
@pytest.mark.parametrize("steps", [1, 5])
def test_backward_kernel_matches_reference(shape, steps):
    _check(shape, steps=steps)


@pytest.mark.parametrize("shape", [(2, 16, 8), (2, 8, 16), (1, 7, 7)])
def test_shape_factor(shape):
    _check(shape, steps=5, shape_factor=True)


def test_steps_zero_and_options():
    _check((2, 9, 5), steps=0)                                        # normalisation + transpose alone
    _check((2, 6, 10), steps=3, eps=1e-3, coefficients=(2.0, -1.5, 0.5))


def test_zero_matrix_in_batch():
    da, db, _, _ = _grads((3, 6, 10), zero=1, steps=2)
    assert rms_ratio(da[1].double(), db[1]) <= TOL                    # ‖S‖ = 0: the norm term drops, as torch's
    assert rms_ratio(da[0].double(), db[0]) <= TOL and rms_ratio(da[2].double(), db[2]) <= TOL


def test_noncontiguous_upstream_gradient():
    s = torch.randn(2, 12, 6, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    w = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    a, b = s.clone().requires_grad_(), s.double().requires_grad_()
    (nsk.newton_schulz(a) * w.mT).sum().backward()                    # grad_out arrives as a transposed view
    (ns_torch(b) * w.mT.double()).sum().backward()
    assert rms_ratio(a.grad.double(), b.grad) <= TOL


def test_torch_fallback_agrees(monkeypatch):
    kernel, *_ = _grads((2, 10, 6), seed=7, steps=5)
    monkeypatch.setattr(nsk, "BACKWARD", "torch")
    before = nsk.BACKWARD_LAUNCHES
    fallback, ref, _, _ = _grads((2, 10, 6), seed=7, steps=5)
    assert nsk.BACKWARD_LAUNCHES == before                            # the fallback launches no kernel
    assert rms_ratio(fallback.double(), ref) <= TOL
    assert rms_ratio(kernel, fallback) <= TOL


def test_no_iterates_saved_without_grad(monkeypatch):
    saves = []
    real = nsk._launch_forward
    monkeypatch.setattr(nsk, "_launch_forward", lambda *a: saves.append(a[-1]) or real(*a))
    s = torch.randn(2, 8, 16).to(DEVICE)
    nsk.newton_schulz(s)
    nsk.newton_schulz(s.requires_grad_())
    assert saves == [False, True]


def test_half_precision_input():
    if DEVICE == "cpu" and not tk.interpreting():   # pragma: no cover - guarded by require_triton
        pytest.skip("no kernel device")
    before = nsk.BACKWARD_LAUNCHES
    da, db, _, _ = _grads((2, 8, 16), dtype=torch.float16, steps=5)
    assert nsk.BACKWARD_LAUNCHES == before + 1 and da.dtype == torch.float16
    assert rms_ratio(da.double().cpu(), db) <= 5e-2                   # fp16 forward products


# ------------------------------------------------------------------ the staged backward (row blocks, workspace)

@pytest.fixture
def staged(monkeypatch):
    """Every tile takes the staged backward; row blocks of 16 rows (several per matrix from 32 padded rows)."""
    monkeypatch.setattr(nsk, "STAGED_TILE", 0)
    monkeypatch.setattr(nsk, "STAGED_ROWS", 16)
    return monkeypatch


def _check_staged(monkeypatch, shape, programs=None, **kw):
    before = nsk.STAGED_LAUNCHES
    monkeypatch.setattr(nsk, "STAGED_PROGRAMS", programs)
    err = _check(shape, **kw)
    assert nsk.STAGED_LAUNCHES == before + 1, "the staged backward kernel did not run"
    return err


def test_staged_tiles():
    assert nsk.staged(128, 128) and nsk.staged(100, 70) and nsk.staged(64, 256) and nsk.staged(200, 40)
    assert not any(nsk.staged(r, c) for r, c in [(64, 128), (128, 64), (64, 64), (16, 256), (32, 256), (8, 16)])
    assert nsk.staged_rows(128) == 32 and nsk.staged_rows(64) == 32 and nsk.staged_rows(32) == 16 == nsk.staged_rows(16)


@pytest.mark.parametrize("shape,programs", [((2, 20, 24), None), ((3, 24, 40), 2), ((3, 40, 20), 1),
                                            ((3, 5, 12), 2), ((2, 13, 6), None), ((2, 2, 3, 33), 3)],
                         ids=["square", "wide", "tall", "wide_ragged", "tall_ragged", "batch"])
@pytest.mark.parametrize("steps", [1, 5])
def test_staged_backward_matches_reference(staged, shape, programs, steps):
    _check_staged(staged, shape, programs, steps=steps)


def test_staged_options(staged):
    _check_staged(staged, (2, 9, 5), steps=0)                         # normalisation + transpose alone
    _check_staged(staged, (2, 40, 20), 1, steps=5, shape_factor=True)
    _check_staged(staged, (2, 18, 34), steps=2, eps=1e-3, coefficients=(2.0, -1.5, 0.5))
    staged.setattr(nsk, "STAGED_ROWS", 64)                            # BR / 2: two row blocks of 32
    _check_staged(staged, (1, 33, 40), steps=3)


def test_staged_zero_matrix_in_batch(staged):
    staged.setattr(nsk, "STAGED_PROGRAMS", 2)                         # program 0 runs matrices 0 and 2
    da, db, _, _ = _grads((3, 20, 17), zero=1, steps=2)
    assert all(rms_ratio(da[i].double(), db[i]) <= TOL for i in range(3))


def test_staged_half_precision_input(staged):
    before = nsk.STAGED_LAUNCHES
    da, db, _, _ = _grads((2, 20, 34), dtype=torch.float16, steps=5)
    assert nsk.STAGED_LAUNCHES == before + 1 and da.dtype == torch.float16
    assert rms_ratio(da.double().cpu(), db) <= 5e-2


def test_staged_backward_at_production_tiles(monkeypatch):
    """The tiles that take it by default: 128 × 128 (ATLAS head dim 128; two matrices on one program, 5 steps) and
    64 × 256 (tall: read through transposed strides)."""
    _check_staged(monkeypatch, (2, 128, 128), 1, steps=5)
    _check_staged(monkeypatch, (1, 256, 64), steps=1)
