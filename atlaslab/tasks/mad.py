"""The MAD synthetic suite (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures";
reference code ``athms/mad-lab``, ``mad/data/instances.py``), generated locally from a seed.

Six tasks, each registered under its own name:

============================  ====================================================================
``in_context_recall``         pairs ``k v`` with a per-sequence key→value map; score the value of every
                              repeated key (``multi_query``) or of a final probe after a copy token
``noisy_in_context_recall``   the same with pairs of noise tokens (from a separate noise vocabulary)
                              inserted with probability ``frac_noise``
``fuzzy_in_context_recall``   keys and values are motifs of 1…``k_motif_size`` / ``v_motif_size`` tokens;
                              evaluation keys always have the maximal motif size
``selective_copying``         ``num_tokens_to_copy`` tokens scattered among blanks; after a copy token
                              reproduce them in order at the trailing blank positions
``compression``               a random sequence ending in a compression token must be reconstructed from
                              the model's output *at the last position* by a small MLP decoder that the
                              task adds (:class:`CompressionHead`, MAD's auto-encoder set-up)
``memorization``              a fixed key→value map (drawn from the task seed) shared by every sequence:
                              ``key insert`` pairs, the value is scored at the insert token
============================  ====================================================================

Faithful to MAD: the vocabulary layout (keys in the lower, values in the upper half of the non-special
vocabulary, special tokens at the top), the noise mechanism, the training targets of the recall tasks
(all next tokens, MAD's ``is_training``; ``lm_loss``), the finite training sets (``num_train_examples``)
and the 1,280-example test sets. Deviations, each fixing a defect of the reference: every random draw
uses the example's own generator (MAD's selective copying calls the global ``np.random``); motifs are
sampled directly instead of enumerating every permutation per instance; fuzzy recall always places its
probe pair in the context (MAD can skip it for long motifs); sequences are exactly ``seq_len`` tokens.

The MAD protocol's difficulty grid is :func:`mad_grid` (a baseline plus one-at-a-time ``changes``, from
MAD's ``configs/tasks/*.yml``), its optimiser sweep :data:`MAD_SWEEP`, and :func:`mad_score` aggregates
results (best over the sweep per setting, mean over settings, then over tasks).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from atlaslab.registry import ConfigError, check_range, register
from atlaslab.tasks.base import IGNORE_INDEX, CachedWrapperMixin, Example, Task, TaskConfig


# --------------------------------------------------------------------------------------------------
# shared config
# --------------------------------------------------------------------------------------------------
@dataclass
class MADConfig(TaskConfig):
    vocab_size: int = 16
    seq_len: int = 128
    num_train_examples: int = 12800   # finite training set as in MAD (0 = a fresh example every time)
    eval_examples: int = 1280         # MAD's num_test_examples
    noise_vocab_size: int = 0
    frac_noise: float = 0.0

    def check(self) -> None:
        super().check()
        check_range("num_train_examples", self.num_train_examples, 0, None)
        check_range("noise_vocab_size", self.noise_vocab_size, 0, None)
        check_range("frac_noise", self.frac_noise, 0.0, 0.999999, "must lie in [0, 1)")
        if self.frac_noise > 0 and self.noise_vocab_size < 1:
            raise ConfigError("noise_vocab_size", "must be ≥ 1 when frac_noise > 0.", value=self.noise_vocab_size)


class MADTask(Task):
    Config = MADConfig
    primary_metric = "accuracy"

    def num_train_examples(self) -> Optional[int]:
        n = int(self.cfg.num_train_examples)
        return n if n > 0 else None


def _finish_shifted(seq: List[int], answer: List[bool], T: int, lm_loss: bool) -> Example:
    """Inputs ``seq[:T]``; the target at ``t`` is ``seq[t + 1]`` where ``t + 1`` is an answer position.
    With ``lm_loss`` the training loss uses every next token (MAD's ``is_training`` targets)."""
    s = np.asarray(seq, dtype=np.int64)
    a = np.asarray(answer, dtype=bool)
    inputs = s[:T]
    targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
    nxt = s[1:T + 1]
    m = a[1:T + 1]
    targets[:len(nxt)][m] = nxt[m]
    loss_targets = None
    if lm_loss:
        loss_targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        loss_targets[:len(nxt)] = nxt
    return Example(inputs, targets, loss_targets)


def _recall_vocab(V: int, multi_query: bool, noise: int) -> tuple:
    special = 0 if multi_query else 1            # the copy prefix V - 1
    ns = V - special - noise
    return ns, V - 1


# --------------------------------------------------------------------------------------------------
# in-context recall (+ noisy)
# --------------------------------------------------------------------------------------------------
@dataclass
class RecallConfig(MADConfig):
    multi_query: bool = True      # score every repeated key (MAD's benchmark setting)
    lm_loss: bool = True          # train on every next token, as MAD does for the recall tasks

    def check(self) -> None:
        super().check()
        if self.seq_len % 2:
            raise ConfigError("seq_len", "must be even (sequences are key-value pairs).", value=self.seq_len)
        ns, _ = _recall_vocab(self.vocab_size, self.multi_query, self.noise_vocab_size)
        if ns < 2:
            raise ConfigError("vocab_size", f"leaves {ns} key/value tokens after the special and noise tokens "
                              "(need ≥ 2).", value=self.vocab_size)


@register("task", "in_context_recall")
class InContextRecall(MADTask):
    """MAD in-context recall: recall the value bound to a key earlier in the same sequence."""

    Config = RecallConfig

    def check_length(self, length: int) -> None:
        if length % 2 or length < 4:
            raise ValueError(f"{self.name}: length must be even and ≥ 4, got {length}")

    def generate(self, rng, split, length, index):
        c = self.cfg
        T = length
        ns, copy_tok = _recall_vocab(c.vocab_size, c.multi_query, c.noise_vocab_size)
        nk = ns // 2
        P = T // 2                                  # pairs incl. the final probe pair
        m = P - 1                                   # context pairs
        value_of = rng.integers(nk, ns, size=nk)    # per-sequence key→value map
        keys = rng.integers(0, nk, size=m)
        is_noise = np.zeros(m, dtype=bool)
        if c.frac_noise > 0 and m > 0:
            is_noise = rng.random(m) < c.frac_noise
            is_noise[int(rng.integers(m))] = False  # at least one real pair
            noise = rng.integers(ns, ns + c.noise_vocab_size, size=(m, 2))
        seq: List[int] = []
        ans: List[bool] = []
        seen = set()
        for i in range(m):
            if is_noise[i]:
                seq += [int(noise[i, 0]), int(noise[i, 1])]
                ans += [False, False]
                continue
            k = int(keys[i])
            seq += [k, int(value_of[k])]
            ans += [False, bool(c.multi_query and k in seen)]
            seen.add(k)
        if not seen:                                # only when m == 0
            k = int(rng.integers(nk))
            seen.add(k)
        order = sorted(seen)
        kp = order[int(rng.integers(len(order)))]
        if not c.multi_query:
            seq.append(copy_tok)
            ans.append(False)
        seq += [kp, int(value_of[kp])]
        ans += [False, True]
        return _finish_shifted(seq, ans, T, c.lm_loss and split == "train")


@dataclass
class NoisyRecallConfig(RecallConfig):
    vocab_size: int = 32
    noise_vocab_size: int = 16
    frac_noise: float = 0.2


@register("task", "noisy_in_context_recall")
class NoisyInContextRecall(InContextRecall):
    """MAD noisy in-context recall: in-context recall with noise pairs interleaved."""

    Config = NoisyRecallConfig


# --------------------------------------------------------------------------------------------------
# fuzzy in-context recall
# --------------------------------------------------------------------------------------------------
@dataclass
class FuzzyRecallConfig(RecallConfig):
    k_motif_size: int = 3
    v_motif_size: int = 3

    def check(self) -> None:
        MADConfig.check(self)
        check_range("k_motif_size", self.k_motif_size, 1, None)
        check_range("v_motif_size", self.v_motif_size, 1, None)
        special = 1 if self.multi_query else 2
        ns = self.vocab_size - special - self.noise_vocab_size
        if ns // 2 < max(self.k_motif_size, self.v_motif_size):
            raise ConfigError("vocab_size", f"the key/value vocabularies ({ns // 2} tokens each) are smaller "
                              "than the motif size.", value=self.vocab_size)
        if self.seq_len < 4 * (self.k_motif_size + self.v_motif_size) + 2:
            raise ConfigError("seq_len", "too short for the motif sizes.", value=self.seq_len)


@register("task", "fuzzy_in_context_recall")
class FuzzyInContextRecall(MADTask):
    """MAD fuzzy in-context recall: keys and values are variable-length token motifs."""

    Config = FuzzyRecallConfig

    def check_length(self, length: int) -> None:
        c = self.cfg
        if length < 4 * (c.k_motif_size + c.v_motif_size) + 2:
            raise ValueError(f"{self.name}: length {length} is too short for the motif sizes")

    def generate(self, rng, split, length, index):
        c = self.cfg
        T = length
        K, Vm = c.k_motif_size, c.v_motif_size
        copy_tok = c.vocab_size - 1
        pad = c.vocab_size - 2 if not c.multi_query else c.vocab_size - 1
        ns = (c.vocab_size - 2 if not c.multi_query else c.vocab_size - 1) - c.noise_vocab_size
        nk = ns // 2
        training = split == "train"

        def motif(lo: int, hi: int, size: int) -> tuple:
            return tuple(int(t) for t in lo + rng.permutation(hi - lo)[:size])

        def k_size() -> int:
            return int(rng.integers(1, K + 1)) if training else K

        kps, vps = k_size(), int(rng.integers(1, Vm + 1))
        k_probe, v_probe = motif(0, nk, kps), motif(nk, ns, vps)
        kvp = kps + vps
        bound = T - kvp - (K + Vm)                  # context length bound (MAD's loop condition)
        probe_idx = int(rng.integers(max(1, bound - kvp)))
        kv_map: Dict[tuple, tuple] = {}
        seen = set()
        seq: List[int] = []
        ans: List[bool] = []
        probe_added = False

        def add_probe_pair() -> None:
            seq.extend(k_probe)
            seq.extend(v_probe)
            ans.extend([False] * kvp)
            kv_map[k_probe] = v_probe
            seen.add(k_probe)

        while len(seq) + (0 if probe_added else kvp) < bound:
            ks, vs = k_size(), int(rng.integers(1, Vm + 1))
            if not probe_added and len(seq) >= probe_idx:
                add_probe_pair()
                probe_added = True
                continue
            if c.frac_noise > 0 and rng.random() < c.frac_noise:
                n = ks + vs
                seq.extend(int(t) for t in rng.integers(ns, ns + c.noise_vocab_size, size=n))
                ans.extend([False] * n)
                continue
            k = motif(0, nk, ks)
            if k == k_probe:
                v = v_probe
                probe_added = True
            elif k in kv_map:
                v = kv_map[k]
            else:
                v = motif(nk, ns, vs)
                kv_map[k] = v
            seq.extend(k)
            seq.extend(v)
            ans.extend([False] * len(k))
            ans.extend([bool(c.multi_query and k in seen)] * len(v))
            seen.add(k)
        if not probe_added:
            add_probe_pair()
        if not c.multi_query:
            seq.append(copy_tok)
            ans.append(False)
        seq.extend(k_probe)
        seq.extend(v_probe)
        ans.extend([False] * kps + [True] * vps)
        n_pad = T + 1 - len(seq)
        assert n_pad >= 0, (n_pad, T)
        seq = [pad] * n_pad + seq
        ans = [False] * n_pad + ans
        return _finish_shifted(seq, ans, T, c.lm_loss and training)


# --------------------------------------------------------------------------------------------------
# selective copying
# --------------------------------------------------------------------------------------------------
@dataclass
class SelectiveCopyingConfig(MADConfig):
    seq_len: int = 256
    num_tokens_to_copy: int = 16

    def check(self) -> None:
        super().check()
        check_range("num_tokens_to_copy", self.num_tokens_to_copy, 1, None)
        check_range("vocab_size", self.vocab_size, 3, None)
        if self.seq_len <= 2 * self.num_tokens_to_copy + 1:
            raise ConfigError("seq_len", f"must exceed 2 · num_tokens_to_copy + 1 = "
                              f"{2 * self.num_tokens_to_copy + 1}.", value=self.seq_len)


@register("task", "selective_copying")
class SelectiveCopying(MADTask):
    """MAD selective copying: copy the non-blank tokens, in order, after the copy token."""

    Config = SelectiveCopyingConfig

    def check_length(self, length: int) -> None:
        if length <= 2 * self.cfg.num_tokens_to_copy + 1:
            raise ValueError(f"{self.name}: length {length} ≤ 2 · num_tokens_to_copy + 1")

    def generate(self, rng, split, length, index):
        c = self.cfg
        T, n = length, c.num_tokens_to_copy
        copy_tok, blank = c.vocab_size - 1, c.vocab_size - 2
        nb = T - 2 * n - 1
        to_copy = rng.integers(0, c.vocab_size - 2, size=n)
        where = rng.integers(0, n, size=nb)          # MAD: np.insert before element `where`
        body = np.insert(to_copy, where, blank)
        inputs = np.concatenate([body, [copy_tok], np.full(n, blank)]).astype(np.int64)
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        targets[T - n:] = to_copy
        return Example(inputs, targets)


# --------------------------------------------------------------------------------------------------
# compression
# --------------------------------------------------------------------------------------------------
def sincos_positions(T: int, dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Fixed 1-D sine-cosine position embeddings ``[T, dim]`` (MAD's ``posemb_sincos_1d``)."""
    half = dim // 2
    omega = 1.0 / (10000 ** (torch.arange(half, device=device, dtype=torch.float64) / max(half - 1, 1)))
    ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * omega[None, :]
    pe = torch.cat([ang.sin(), ang.cos()], dim=1)
    if pe.shape[1] < dim:
        pe = torch.cat([pe, pe.new_zeros(T, dim - pe.shape[1])], dim=1)
    return pe.to(dtype)


def _model_features(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    feats = getattr(model, "features", None)
    return feats(ids) if callable(feats) else model(ids)


class CompressionHead(nn.Module):
    """MAD's auto-encoder around a sequence model: the model reads the sequence; its output at the last
    position (``model.features(ids)`` when the model has that method, else its logits) is the code; an MLP
    decoder with sine-cosine position embeddings reconstructs token ``t`` from ``code + pos_t``.

    ``forward(ids: [B, T]) -> logits [B, T, V]``, so it trains and evaluates like any token model.
    """

    def __init__(self, model: nn.Module, vocab_size: int, in_dim: int, dim: int = 128):
        super().__init__()
        self.model = model
        self.dim = dim
        self.proj = nn.Linear(in_dim, dim)
        self.decoder = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(),
            nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(),
        )
        self.unembed = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        code = _model_features(self.model, ids)[:, -1]                       # [B, D_in]
        code = self.proj(code.float() if code.dtype == torch.float64 else code)
        pos = sincos_positions(ids.shape[1], self.dim, ids.device, code.dtype)
        x = code[:, None, :] + pos[None]                                     # [B, T, dim]
        return self.unembed(self.decoder(x))


@dataclass
class CompressionConfig(MADConfig):
    seq_len: int = 32
    decoder_dim: int = 128

    def check(self) -> None:
        super().check()
        check_range("decoder_dim", self.decoder_dim, 2, None)
        if self.vocab_size - 1 - self.noise_vocab_size < 1:
            raise ConfigError("vocab_size", "leaves no content tokens.", value=self.vocab_size)


@register("task", "compression")
class Compression(CachedWrapperMixin, MADTask):
    """MAD compression: reconstruct a random sequence from the model's output at its last token."""

    Config = CompressionConfig

    def generate(self, rng, split, length, index):
        c = self.cfg
        T = length
        ns = c.vocab_size - 1 - c.noise_vocab_size
        inputs = np.concatenate([rng.integers(0, ns, size=T - 1), [c.vocab_size - 1]]).astype(np.int64)
        targets = inputs.copy()
        if c.frac_noise > 0:
            noisy = rng.random(T - 1) < c.frac_noise
            inputs[:-1][noisy] = rng.integers(ns, ns + c.noise_vocab_size, size=int(noisy.sum()))
            targets[:-1][noisy] = IGNORE_INDEX
        return Example(inputs, targets)

    def _wrapper_type(self) -> type:
        return CompressionHead

    def _make_wrapper(self, model: nn.Module) -> nn.Module:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
        was = model.training
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe = torch.zeros(1, 2, dtype=torch.long, device=device)
            in_dim = int(_model_features(model, probe).shape[-1])
        model.train(was)
        return CompressionHead(model, self.vocab_size, in_dim, self.cfg.decoder_dim)


# --------------------------------------------------------------------------------------------------
# memorization
# --------------------------------------------------------------------------------------------------
@dataclass
class MemorizationConfig(MADConfig):
    vocab_size: int = 256
    seq_len: int = 32
    num_train_examples: int = 256

    def check(self) -> None:
        super().check()
        if self.seq_len % 2:
            raise ConfigError("seq_len", "must be even (key, insert pairs).", value=self.seq_len)
        if (self.vocab_size - 1 - self.noise_vocab_size) // 2 < 1:
            raise ConfigError("vocab_size", "leaves no key/value tokens.", value=self.vocab_size)


@register("task", "memorization")
class Memorization(MADTask):
    """MAD memorization: a fixed key→value map (from the task seed) learnt across sequences."""

    Config = MemorizationConfig

    def __init__(self, cfg, **context):
        super().__init__(cfg, **context)
        ns = cfg.vocab_size - 1 - cfg.noise_vocab_size
        rng = np.random.default_rng(np.random.SeedSequence([0x3E3, cfg.seed]))
        keys = rng.permutation(np.arange(ns // 2))
        values = rng.permutation(np.arange(ns // 2, ns))
        n = min(len(keys), len(values))
        self.kv_map: Dict[int, int] = {int(k): int(v) for k, v in zip(keys[:n], values[:n])}
        self._keys = np.array(sorted(self.kv_map), dtype=np.int64)
        self._lut = np.zeros(ns, dtype=np.int64)
        self._lut[self._keys] = [self.kv_map[int(k)] for k in self._keys]

    def check_length(self, length: int) -> None:
        if length % 2:
            raise ValueError(f"{self.name}: length must be even, got {length}")

    def generate(self, rng, split, length, index):
        c = self.cfg
        P = length // 2
        ins = c.vocab_size - 1
        ns = c.vocab_size - 1 - c.noise_vocab_size
        keys = self._keys[rng.integers(0, len(self._keys), size=P)]
        inputs = np.empty(2 * P, dtype=np.int64)
        targets = np.full(2 * P, IGNORE_INDEX, dtype=np.int64)
        inputs[0::2] = keys
        inputs[1::2] = ins
        targets[1::2] = self._lut[keys]
        if c.frac_noise > 0:
            noisy = rng.random(P) < c.frac_noise
            noisy[int(rng.integers(P))] = False
            idx = np.flatnonzero(noisy)
            inputs[2 * idx] = rng.integers(ns, ns + c.noise_vocab_size, size=len(idx))
            inputs[2 * idx + 1] = rng.integers(ns, ns + c.noise_vocab_size, size=len(idx))
            targets[2 * idx + 1] = IGNORE_INDEX
        return Example(inputs, targets)


# --------------------------------------------------------------------------------------------------
# the MAD protocol
# --------------------------------------------------------------------------------------------------
#: MAD's ``configs/tasks/*.yml``: the baseline setting of each task and the one-at-a-time changes.
MAD_PROTOCOL: Dict[str, Dict[str, Any]] = {
    "in_context_recall": {
        "baseline": {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12800, "multi_query": True},
        "changes": {"vocab_size": [32, 64, 128], "seq_len": [256, 512, 1024],
                    "num_train_examples": [6400, 3200, 1600, 800]},
    },
    "noisy_in_context_recall": {
        "baseline": {"vocab_size": 32, "noise_vocab_size": 16, "seq_len": 128, "num_train_examples": 12800,
                     "multi_query": True, "frac_noise": 0.2},
        "changes": {"vocab_size": [48, 80, 144], "seq_len": [256, 512, 1024],
                    "num_train_examples": [6400, 3200, 1600, 800], "frac_noise": [0.4, 0.6, 0.8]},
    },
    "fuzzy_in_context_recall": {
        "baseline": {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12800, "multi_query": True,
                     "k_motif_size": 3, "v_motif_size": 3},
        "changes": {"vocab_size": [32, 64, 128], "seq_len": [256, 512, 1024],
                    "num_train_examples": [6400, 3200, 1600, 800]},
    },
    "selective_copying": {
        "baseline": {"vocab_size": 16, "seq_len": 256, "num_tokens_to_copy": 16, "num_train_examples": 12800},
        "changes": {"vocab_size": [32, 64, 128], "seq_len": [512, 1024],
                    "num_train_examples": [6400, 3200, 1600, 800], "num_tokens_to_copy": [32, 64, 96]},
    },
    "compression": {
        "baseline": {"vocab_size": 16, "seq_len": 32, "num_train_examples": 12800},
        "changes": {"vocab_size": [32, 64, 128], "seq_len": [64, 128, 256],
                    "num_train_examples": [6400, 3200, 1600, 800]},
    },
    "memorization": {
        "baseline": {"vocab_size": 256, "seq_len": 32, "num_train_examples": 256},
        "changes": {"vocab_size": [512, 1024, 2048, 4096, 8192]},
    },
}

#: MAD's optimiser sweep per setting (the best run of the sweep is kept): dotted keys of an experiment.
MAD_SWEEP: Dict[str, List[float]] = {"train.lr": [1e-4, 5e-4, 1e-3], "train.weight_decay": [0.0, 0.1]}

#: MAD's training settings: batch 128, 200 epochs, AdamW, cosine schedule.
MAD_TRAIN = {"batch_size": 128, "epochs": 200, "lr": 5e-4, "weight_decay": 0.0}


def mad_train_steps(num_train_examples: int, epochs: int = 200, batch_size: int = 128) -> int:
    """Optimiser steps of MAD's ``epochs`` passes over a training set of ``num_train_examples``."""
    return int(math.ceil(num_train_examples / batch_size)) * epochs


def mad_grid(tasks: Optional[Iterable[str]] = None, include_baseline: bool = True) -> List[Dict[str, Any]]:
    """MAD's difficulty grid as task nodes: for each task its baseline, then the baseline with one
    field changed at a time. Each node carries ``name`` and a ``setting`` label is returned alongside::

        [{"setting": "in_context_recall/baseline", "task": {"name": "in_context_recall", ...}}, ...]
    """
    names = list(MAD_PROTOCOL) if tasks is None else list(tasks)
    out = []
    for name in names:
        if name not in MAD_PROTOCOL:
            raise ConfigError("task", f"unknown MAD task {name!r}.", value=name, choices=list(MAD_PROTOCOL))
        base = dict(MAD_PROTOCOL[name]["baseline"])
        if include_baseline:
            out.append({"setting": f"{name}/baseline", "task": {"name": name, **base}})
        for key, values in MAD_PROTOCOL[name]["changes"].items():
            for v in values:
                node = {"name": name, **copy.deepcopy(base), key: v}
                out.append({"setting": f"{name}/{key}_{v}", "task": node})
    return out


def mad_score(records: Iterable[Mapping[str, Any]], metric: str = "accuracy") -> Dict[str, float]:
    """MAD scores from run records ``{"setting": "<task>/<change>", metric: value, ...}`` (one per run of
    the optimiser sweep): the best run per setting, the mean over a task's settings, and ``mad_score``,
    the mean over tasks."""
    best: Dict[str, float] = {}
    for r in records:
        s, v = r["setting"], float(r[metric])
        if not math.isnan(v):
            best[s] = max(best.get(s, -math.inf), v)
    per_task: Dict[str, List[float]] = {}
    for s, v in best.items():
        per_task.setdefault(s.split("/")[0], []).append(v)
    scores = {t: float(np.mean(v)) for t, v in sorted(per_task.items())}
    if scores:
        scores["mad_score"] = float(np.mean(list(scores.values())))
    return scores


__all__ = ["Compression", "CompressionHead", "FuzzyInContextRecall", "InContextRecall", "MAD_PROTOCOL",
           "MAD_SWEEP", "MAD_TRAIN", "Memorization", "NoisyInContextRecall", "SelectiveCopying", "mad_grid",
           "mad_score", "mad_train_steps", "sincos_positions"]
