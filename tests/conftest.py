"""Test-wide settings. TRITON_INTERPRET must be set before any Triton kernel is decorated, so it is set at import time."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster (and immune to oversubscribed CPUs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so a kernel that skips an element fails
    (the Triton tests use it through ``pytestmark``)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        # a tensor that requires grad (torch.utils.checkpoint's empty marker) cannot be filled in place: left as is
        return t.fill_(float("nan")) if t.is_floating_point() and not t.requires_grad else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))
