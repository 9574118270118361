"""What the modules of the six memory parts share (docs/concepts/memory.md): the validated config each is built from."""
from __future__ import annotations

from torch import nn

from atlaslab.registry import PartConfig


class Part(nn.Module):
    """Base of every registered part's module: ``cfg``, the part's validated config."""

    def __init__(self, cfg: PartConfig):
        super().__init__()
        self.cfg = cfg
