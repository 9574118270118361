"""The lm-evaluation-harness model class ``atlaslab``: an atlaslab language model and its tokenizer behind lm-eval's
three requests.

Notation: L – context length (``max_length``), V – vocabulary.

* ``loglikelihood(context, continuation)``: the sum of log p(continuation tokens | context) and whether greedy
  decoding would produce them. Text is tokenised as lm-eval's Hugging Face model does it: the context's trailing
  spaces move to the continuation, the pair is encoded whole and the context's tokens split off, so the
  continuation's tokens are those of the joined text. An empty context is the document-start token (EOS; a
  newline for byte models without one). Inputs longer than L + 1 keep their last L + 1 tokens.
* ``loglikelihood_rolling(text)``: the log-likelihood of every token of the text, in disjoint windows of L
  (lm-eval's ``get_rolling_token_windows``), the first conditioned on the document-start token.
* ``generate_until(context, {until, max_gen_toks})``: greedy decoding — ``model.generate(ids [1, T],
  max_new_tokens=n) → [1, T + n]`` where the model has it, else one full forward per new token over the last L
  tokens — stopped at EOS or the first stop string (cut off).

Scoring batches right-pad sequences to the longest of a batch; every atlaslab mixer is causal, so the padding
never changes a scored position.

    lm_eval --model atlaslab --model_args checkpoint=runs/lm ...   # via python -m atlaslab.eval run ...
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from atlaslab.eval.checkpoint import load_trained
from atlaslab.registry import ConfigError


@register_model("atlaslab")
class AtlaslabLM(LM):
    """An atlaslab model for lm-eval: ``checkpoint=<run folder>`` (or ``model=`` / ``tokenizer=`` objects)."""

    def __init__(self, checkpoint: Optional[str] = None, model: Optional[torch.nn.Module] = None,
                 tokenizer: Any = None, device: Any = None, batch_size: Any = 16, max_length: Any = 0,
                 max_gen_toks: Any = 128, max_batch_size: Any = None, **unused: Any):
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ConfigError("model_args", "the atlaslab model needs checkpoint=<a training checkpoint folder>.")
            model, tokenizer, info = load_trained(checkpoint, tokenizer)
            max_length = int(max_length or 0) or int(info.get("seq_len") or 0)
        elif tokenizer is None:
            raise ConfigError("model_args", "a model object needs its tokenizer.")
        self.model, self.tok = model, tokenizer
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"          # lm-eval's command line defaults to cuda, as its Hugging Face model does
        self._device = torch.device(device) if device else next(model.parameters()).device
        self.model.to(self._device)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length or 0) or 2048
        self.max_gen_toks = int(max_gen_toks)
        vocab = int(getattr(getattr(model, "cfg", None), "vocab_size", tokenizer.vocab_size))
        self.prefix_id = tokenizer.eos_id if tokenizer.eos_id < vocab else 10

    # -- scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _logits(self, rows: Sequence[List[int]]) -> torch.Tensor:
        """Log-probabilities ``[B, T_max, V]`` (float32) of right-padded token rows."""
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        self.model.eval()
        return F.log_softmax(self.model(ids.to(self._device)).float(), dim=-1).cpu()

    def _score(self, pairs: Sequence[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """``(log p(cont | ctx), greedy)`` per ``(ctx, cont)`` token pair, in batches of similar length."""
        L = self.max_length
        jobs = []
        for i, (ctx, cont) in enumerate(pairs):
            cont = cont[-L:]
            seq = (ctx + cont)[-(L + 1):]
            jobs.append((i, seq[:-1], cont))
        out: List[Tuple[float, bool]] = [(0.0, True)] * len(pairs)
        jobs = [j for j in jobs if j[2]]                    # an empty continuation: log 1, greedy
        jobs.sort(key=lambda j: -len(j[1]))
        for b in range(0, len(jobs), self.batch_size):
            chunk = jobs[b:b + self.batch_size]
            logp = self._logits([inp for _, inp, _ in chunk])
            for k, (i, inp, cont) in enumerate(chunk):
                n = len(cont)
                lp = logp[k, len(inp) - n:len(inp)]             # [n, V]: the positions predicting cont
                target = torch.tensor(cont, dtype=torch.long)
                out[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        return out

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        if not context:
            return [self.prefix_id], self.tok.encode(continuation)
        stripped = context.rstrip(" ")
        continuation = context[len(stripped):] + continuation
        whole = self.tok.encode(stripped + continuation)
        ctx = self.tok.encode(stripped)
        return ctx or [self.prefix_id], whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        return self._score([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        out = []
        for r in requests:
            tokens = self.tok.encode(r.args[0])
            windows = [make_disjoint_window(w) for w in
                       get_rolling_token_windows(tokens, self.prefix_id, self.max_length, context_len=1)]
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    # -- generation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _greedy(self, ids: List[int], max_new: int, stops: Sequence[str]) -> str:
        generate = getattr(self.model, "generate", None)
        if callable(generate):
            x = torch.tensor([ids[-self.max_length:]], dtype=torch.long, device=self._device)
            new = generate(x, max_new_tokens=max_new)[0, x.shape[1]:].tolist()
            if self.tok.eos_id in new:
                new = new[:new.index(self.tok.eos_id)]
            return _cut(self.tok.decode(new), stops)
        new: List[int] = []
        for _ in range(max_new):
            x = torch.tensor([(ids + new)[-self.max_length:]], dtype=torch.long, device=self._device)
            nxt = int(self.model(x)[0, -1].argmax())
            if nxt == self.tok.eos_id:
                break
            new.append(nxt)
            if stops and any(s in self.tok.decode(new) for s in stops):
                break
        return _cut(self.tok.decode(new), stops)

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        self.model.eval()
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            stops = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok.encode(context) if context else [self.prefix_id]
            out.append(self._greedy(ids, max_new, stops))
        return out


def _cut(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        if s:
            i = text.find(s)
            if i >= 0:
                cut = min(cut, i)
    return text[:cut]


__all__ = ["AtlaslabLM"]
