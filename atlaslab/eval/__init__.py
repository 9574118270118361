"""Evaluation beyond the task's own metrics: zero-shot benchmarks through lm-evaluation-harness.

    from atlaslab.eval import load_trained, run_lm_eval
    model, tokenizer, info = load_trained("runs/lm")                 # a training loop's checkpoint folder
    metrics = run_lm_eval(model, tokenizer, {"tasks": ["lambada_openai"], "limit": 100})

:mod:`atlaslab.eval.harness` holds the ``lm_eval`` model class ``atlaslab`` (it imports ``lm_eval`` at the top;
nothing else here does). ``python -m atlaslab.eval run --model atlaslab --model_args checkpoint=DIR --tasks …``
is lm-eval's own command line with that class registered. This floor sits between ``train`` and ``search``.
"""
from atlaslab.eval.checkpoint import load_trained, tokenizer_for
from atlaslab.eval.lm_eval import LMEvalConfig, lm_eval_metrics, resolve_lm_eval, run_lm_eval

__all__ = ["LMEvalConfig", "lm_eval_metrics", "load_trained", "resolve_lm_eval", "run_lm_eval", "tokenizer_for"]
