"""The Hugging Face half of the wheel check: from an installed atlaslab (run it outside the repository, in the
fresh environment with the wheel and its ``hf`` extra), train a tiny byte-level model, export it, reload it with
``AutoModelForCausalLM`` / ``AutoTokenizer`` and generate from a left-padded batch, which must equal each prompt
generated alone. Exits non-zero on any failure.

    python .ci/hf_wheel_check.py WORK_DIR [--any-source]     # --any-source: also from a checkout (trying it out)
"""
import json
import subprocess
import sys
from pathlib import Path

args = [a for a in sys.argv[1:] if a != "--any-source"]
work = Path(args[0] if args else "hf-wheel-check").resolve()
work.mkdir(parents=True, exist_ok=True)
(work / "run.yaml").write_text(
    "name: tiny_bytes\nmodel: {preset: gated_deltanet, overrides: {d_model: 16, 'mixers.*.num_heads': 2}}\n"
    "task: {name: byte_lm, seq_len: 32, eval_examples: 8}\n"
    "train: {steps: 4, batch_size: 4, lr: 3.0e-3, eval_interval: 0}\n")
run_dir = work / "run"
cli = [sys.executable, "-m", "atlaslab.cli"]
subprocess.run(cli + ["train", str(work / "run.yaml"), "--run-dir", str(run_dir), "--quiet"], check=True, cwd=work)
subprocess.run(cli + ["export", str(run_dir), "--out", str(work / "model")], check=True, cwd=work)

import atlaslab  # noqa: E402,F401  (registers the model type with the Auto classes)
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

assert "--any-source" in sys.argv or "site-packages" in atlaslab.__file__, \
    f"atlaslab comes from {atlaslab.__file__}, not the installed wheel"
model = AutoModelForCausalLM.from_pretrained(work / "model").eval()
tok = AutoTokenizer.from_pretrained(work / "model")
tok.padding_side = "left"
prompts = ["def f(x):", "import"]
batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    for i, p in enumerate(prompts):
        alone = model.generate(**tok([p], return_tensors="pt", add_special_tokens=False), max_new_tokens=5,
                               do_sample=False)
        assert out[i, batch["input_ids"].shape[1]:].tolist() == alone[0, len(p):].tolist(), (p, out[i], alone)
print(json.dumps({"hf_wheel_check": "ok", "model": type(model).__name__,
                  "generated": [tok.decode(o[batch["input_ids"].shape[1]:]) for o in out]}))
