"""Learnability probe (ATLAS §6.4, Fig. 6): how well a memory fits a target map *online*.

A memory is shown a stream of pairs ``(i_j, o_j) ∈ R^d × R^d`` one (or ``batch``) at a time: it first
predicts ``ô_j`` from ``i_j``, then updates itself on the pair. Its online fit is the relative error
``‖ô_j − o_j‖² / ‖o_j‖²`` (the spec reads the paper's ‖i_j − o_j‖²/‖o_j‖² as this). Five target maps,
each drawn from the task seed (``x_j`` i.i.d. standard normal):

==================  ===========================================================================
``low_rank``        ``o = X Y i`` with ``X: d×r``, ``Y: r×d``
``mlp``             ``o = MLP(i)``, a random one-hidden-layer GELU MLP
``attn_mlp``        ``i_j = x_j``, ``o_j = MLP(CausalAttn(x)_j)`` with random W_Q, W_K, W_V
``attn_input_mlp``  ``i_j = CausalAttn(x)_j``, ``o_j = MLP(i_j)`` (attention outputs as inputs)
``swa_mlp``         ``i_j = x_j``, ``o_j = MLP(SWA_w(x)_j)``, sliding-window attention (window 512)
==================  ===========================================================================

The probe does not train a language model: :meth:`LearnabilityProbe.evaluate` takes a *learner factory*
``make_learner(dim) -> learner`` and a learner is any callable ``learner(i: [b, d], o: [b, d]) -> ô: [b, d]``
that returns its prediction *before* updating on the pair. :class:`MLPMemoryLearner` is the paper's MLP
memory (depth × expansion, trained with Adam / RMSprop / SGD); any atlaslab memory can be wrapped the
same way. Metrics: ``rel_loss/<target>`` (mean over the last ``tail`` fraction of the stream),
``online_rel_loss/<target>`` (mean over the whole stream) and ``rel_loss`` (mean over targets).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atlaslab.registry import ConfigError, PartConfig, check_choice, check_range, register

TARGETS = ("low_rank", "mlp", "attn_mlp", "attn_input_mlp", "swa_mlp")
Learner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MLPMemoryLearner:
    """An MLP memory trained online: ``depth`` hidden layers of width ``expansion · dim`` (GELU), one
    optimiser step per call on the mean squared error of the pair, after predicting it."""

    def __init__(self, dim: int, depth: int = 2, expansion: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                 seed: int = 0, device: Optional[torch.device] = None):
        with torch.random.fork_rng(devices=[]):        # nn.Linear's default init must not touch the global RNG
            self._build(dim, depth, expansion, seed, device)
        opts = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop, "sgd": torch.optim.SGD}
        if optimizer not in opts:
            raise ConfigError("optimizer", f"unknown optimizer {optimizer!r}.", value=optimizer, choices=list(opts))
        self.opt = opts[optimizer](self.net.parameters(), lr=lr)

    def _build(self, dim, depth, expansion, seed, device) -> None:
        g = torch.Generator().manual_seed(seed)
        layers: List[nn.Module] = []
        width, d_in = expansion * dim, dim
        for _ in range(depth):
            lin = nn.Linear(d_in, width)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(d_in))
                lin.bias.zero_()
            layers += [lin, nn.GELU()]
            d_in = width
        out = nn.Linear(d_in, dim)
        with torch.no_grad():
            out.weight.copy_(torch.randn(out.weight.shape, generator=g) / math.sqrt(d_in))
            out.bias.zero_()
        layers.append(out)
        self.net = nn.Sequential(*layers).to(device or "cpu")

    def __call__(self, i: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        pred = self.net(i)
        loss = F.mse_loss(pred, o)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return pred.detach()


def make_mlp_learner(depth: int = 2, expansion: int = 1, optimizer: str = "adam", lr: float = 1e-3,
                     seed: int = 0) -> Callable[[int], Learner]:
    """A learner factory for :meth:`LearnabilityProbe.evaluate`."""
    return lambda dim: MLPMemoryLearner(dim, depth, expansion, optimizer, lr, seed)


def _attention(x: torch.Tensor, wq, wk, wv, window: Optional[int]) -> torch.Tensor:
    N, d = x.shape
    q, k, v = x @ wq, x @ wk, x @ wv
    s = (q @ k.t()) / math.sqrt(d)
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@register("task", "learnability")
class LearnabilityProbe:
    """ATLAS §6.4 learnability probe: online fit of a memory to five random target maps."""

    @dataclass
    class Config(PartConfig):
        seed: int = 0
        dim: int = 256
        num_pairs: int = 2048          # stream length
        batch: int = 1                 # pairs per learner call (1 = purely online)
        targets: List[str] = field(default_factory=lambda: list(TARGETS))
        rank: int = 16                 # low_rank
        mlp_hidden: int = 0            # 0: dim
        window: int = 512              # swa_mlp
        tail: float = 0.1              # fraction of the stream the final metric averages over

        def check(self) -> None:
            check_range("dim", self.dim, 1, None)
            check_range("num_pairs", self.num_pairs, 1, None)
            check_range("batch", self.batch, 1, None)
            check_range("rank", self.rank, 1, None)
            check_range("mlp_hidden", self.mlp_hidden, 0, None)
            check_range("window", self.window, 1, None)
            check_range("tail", self.tail, 1e-6, 1.0)
            if not self.targets:
                raise ConfigError("targets", "needs at least one target map.", value=[], choices=list(TARGETS))
            for i, t in enumerate(self.targets):
                check_choice(f"targets.{i}", t, TARGETS)

    primary_metric = "rel_loss"
    primary_mode = "min"

    def __init__(self, cfg: "LearnabilityProbe.Config", **context):
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.name

    def stream(self, target: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, outputs)``: ``[num_pairs, dim]`` float32 each, a pure function of the config."""
        c = self.cfg
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")
        g = torch.Generator().manual_seed(int(c.seed) * 1000 + TARGETS.index(target))
        d, N = c.dim, c.num_pairs
        h = c.mlp_hidden or d
        x = torch.randn(N, d, generator=g)
        w1 = torch.randn(d, h, generator=g) / math.sqrt(d)
        b1 = 0.1 * torch.randn(h, generator=g)
        w2 = torch.randn(h, d, generator=g) / math.sqrt(h)
        mlp = lambda z: F.gelu(z @ w1 + b1) @ w2  # noqa: E731
        wq, wk, wv = (torch.randn(d, d, generator=g) / math.sqrt(d) for _ in range(3))
        if target == "low_rank":
            X = torch.randn(d, c.rank, generator=g) / math.sqrt(c.rank)
            Y = torch.randn(c.rank, d, generator=g) / math.sqrt(d)
            return x, x @ (X @ Y).t()
        if target == "mlp":
            return x, mlp(x)
        if target == "attn_mlp":
            return x, mlp(_attention(x, wq, wk, wv, None))
        if target == "attn_input_mlp":
            a = _attention(x, wq, wk, wv, None)
            a = a / a.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)   # unit RMS, like x
            return a, mlp(a)
        return x, mlp(_attention(x, wq, wk, wv, c.window))

    def run(self, learner: Learner, target: str) -> np.ndarray:
        """Relative error per pair of the stream for one fresh ``learner``."""
        inputs, outputs = self.stream(target)
        errs = []
        b = self.cfg.batch
        for s in range(0, len(inputs), b):
            i, o = inputs[s:s + b], outputs[s:s + b]
            pred = learner(i, o)
            err = (pred.detach().float() - o).pow(2).sum(-1) / o.pow(2).sum(-1).clamp_min(1e-12)
            errs.append(err)
        return torch.cat(errs).numpy()

    def evaluate(self, make_learner: Callable[[int], Learner], targets: Optional[List[str]] = None) -> Dict[str, float]:
        """Metrics of fresh learners (``make_learner(dim)``, one per target map)."""
        out: Dict[str, float] = {}
        finals = []
        for t in targets or self.cfg.targets:
            curve = self.run(make_learner(self.cfg.dim), t)
            n_tail = max(1, int(round(len(curve) * self.cfg.tail)))
            out[f"rel_loss/{t}"] = float(curve[-n_tail:].mean())
            out[f"online_rel_loss/{t}"] = float(curve.mean())
            finals.append(out[f"rel_loss/{t}"])
        out["rel_loss"] = float(np.mean(finals))
        return out


__all__ = ["LearnabilityProbe", "MLPMemoryLearner", "TARGETS", "make_mlp_learner"]
