"""Which parameters take weight decay.

AdamW's decoupled decay shrinks a weight towards zero. That is meant for the weights of projections,
embeddings and convolutions (and our learned initial fast weights and memory tokens, whose zero is a
sensible start), never for the gains, offsets and biases of normalisations: decaying an RMSNorm gain of 1
pulls the layer's output scale towards zero for no reason. The usual rule, "decay tensors of two or more
dimensions", misses per-head norm gains (``[H, D]``), so a parameter can also opt out by carrying the
attribute ``_no_weight_decay = True`` (the convention of fla and Mamba, which mark ``A_log`` and
``dt_bias`` this way). :func:`exempt_from_weight_decay` sets it; :func:`takes_weight_decay` is the rule
:func:`atlaslab.train.make_optimizer` applies.
"""
from __future__ import annotations

import torch

NO_WEIGHT_DECAY_ATTR = "_no_weight_decay"


def exempt_from_weight_decay(*params: torch.Tensor) -> None:
    """Mark ``params`` (norm gains, offsets, scales) so that the optimizer never decays them."""
    for p in params:
        setattr(p, NO_WEIGHT_DECAY_ATTR, True)


def takes_weight_decay(p: torch.Tensor) -> bool:
    """True for a tensor of ≥ 2 dimensions that was not marked by :func:`exempt_from_weight_decay`."""
    return p.ndim >= 2 and not getattr(p, NO_WEIGHT_DECAY_ATTR, False)
