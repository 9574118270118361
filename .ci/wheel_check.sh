#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (the wheel from the sdist, so a file missing from
# the sdist fails here), install the wheel non-editable into a fresh venv that has only torch and the wheel's own
# dependencies (no triton, no dev extras), and use it from a folder outside the repository.
#
#   bash .ci/wheel_check.sh [PYTHON]      # PYTHON: an interpreter with `build` (default .venv/bin/python)
#
# Environment: WHEEL_CHECK_DIR (work folder, default a new temporary one, removed at the end unless
# WHEEL_CHECK_KEEP=1), WHEEL_EXTRAS (extras to install with the wheel, e.g. "hf"; default none), WHEEL_CHECK_COPIED
# (a file touched once the checkout is copied, so that a caller can start writing in the checkout).
# To add a check, write a function check_<name> below and add it to CHECKS: it runs in $OUTSIDE with
# $VENV/bin on PATH; the checks that need extras install them through WHEEL_EXTRAS.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
WORK="${WHEEL_CHECK_DIR:-$(mktemp -d /tmp/atlaslab-wheel.XXXXXX)}"
cleanup() { [ "${WHEEL_CHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT
DIST="$WORK/dist"; VENV="$WORK/venv"; OUTSIDE="$WORK/outside"; SRC="$WORK/src"
mkdir -p "$DIST" "$OUTSIDE" "$SRC"
t0=$(date +%s)
step() { echo "wheel check [$(( $(date +%s) - t0 ))s]: $*"; }

step "build sdist and wheel"
# from a copy of the checkout (the build writes egg-info and build/ into its source folder); --no-isolation: the
# build backend (setuptools) of the calling venv, no download
tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=./build --exclude=./site \
    --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$SRC" -xf -
# the copy is taken: a caller running other work in the checkout meanwhile (.ci/run's pytest) may start now
[ -z "${WHEEL_CHECK_COPIED:-}" ] || touch "$WHEEL_CHECK_COPIED"
"$PY" -m build --no-isolation --sdist --wheel --outdir "$DIST" "$SRC" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$DIST"/atlaslab-*.whl)
"$PY" - "$WHEEL" "$ROOT" <<'EOF'
import sys, zipfile
from pathlib import Path
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = {f"atlaslab/presets/{p.name}" for p in (Path(sys.argv[2]) / "atlaslab" / "presets").glob("*.yaml")}
missing = sorted(want - names)
assert want and not missing, f"presets missing from the wheel: {missing}"
print(f"  the wheel holds {len(want)} presets")
EOF

step "fresh venv: torch==2.13.0 (the CPU wheel), then the wheel"
# --no-compile: no .pyc for the ~1 GB of dependencies up front (the checks compile the little they import)
pip_install() {
    "$VENV/bin/pip" install -q --no-compile "$@" >>"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
}
python3 -m venv "$VENV"
pip_install torch==2.13.0
spec="$WHEEL"; [ -n "${WHEEL_EXTRAS:-}" ] && spec="atlaslab[${WHEEL_EXTRAS}] @ file://$WHEEL"
pip_install "$spec"
export PATH="$VENV/bin:$PATH" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 OMP_NUM_THREADS=1
cd "$OUTSIDE"

check_installed() {
    # the package comes from the venv, not the checkout; no triton (an extra), the presets are package data
    python - "$ROOT" <<'EOF'
import importlib.util, sys
from pathlib import Path
import atlaslab
from atlaslab.models.presets import preset_dir
root = Path(sys.argv[1]).resolve()
assert root not in Path(atlaslab.__file__).resolve().parents, atlaslab.__file__
assert importlib.util.find_spec("triton") is None, "triton is installed: it should come only with atlaslab[triton]"
assert root not in preset_dir().resolve().parents, preset_dir()
# every module imports without triton (its imports are guarded) and without the extras; the kernels say so
import importlib, pkgutil
from atlaslab.kernels.utils import available
EXTRAS = {"atlaslab.eval.harness"}            # lm-eval (extra eval), loaded only when a benchmark runs
mods = [m.name for m in pkgutil.walk_packages(atlaslab.__path__, "atlaslab.")
        if m.name not in EXTRAS and not m.name.endswith("__main__")]
for name in mods:
    importlib.import_module(name)
assert not available()
print(f"  atlaslab from {Path(atlaslab.__file__).parent}; {len(mods)} modules import without triton")
EOF
}

check_cli() {
    atlaslab list >list.txt
    grep -q "atlas" list.txt && grep -q "titans_mac" list.txt || { cat list.txt; exit 1; }
    atlaslab show atlas >show.txt || { cat show.txt; exit 1; }
    grep -q "atlas" show.txt
    echo "  list: $(grep -c . list.txt) lines; show atlas: $(grep -c . show.txt) lines"
}

check_train() {
    # a tiny real run on the torch engines (no triton), logged to the default MLflow store runs/mlflow.db
    cat >tiny.yaml <<'EOF'
name: tiny
model:
  preset: atlas
  overrides: {d_model: 16, num_layers: 1, "mixers.*.num_heads": 2, "mixers.*.mode": chunked}
task: {name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: [2], eval_examples: 32}
train: {steps: 4, batch_size: 8, eval_interval: 2, eval_examples: 32, progress: never}
EOF
    atlaslab train tiny.yaml --quiet >train.json
    python - <<'EOF'
import json
from pathlib import Path
out = json.loads(Path("train.json").read_text())
res = json.loads(Path("runs/tiny/result.json").read_text())
assert out["steps"] == 4 and res["steps"] == 4, out
assert Path("runs/mlflow.db").is_file(), "atlaslab train did not log to runs/mlflow.db"
from mlflow.tracking import MlflowClient
c = MlflowClient(tracking_uri="sqlite:///" + str(Path("runs/mlflow.db").resolve()))
exp = c.get_experiment_by_name("tiny")
run = c.search_runs([exp.experiment_id])[0]
assert run.info.status == "FINISHED" and run.data.params.get("train.steps") == "4", run
assert any(m.step == 4 for m in c.get_metric_history(run.info.run_id, "val/accuracy")), "no metric at step 4"
print(f"  trained 4 steps: val/accuracy {out['metrics'].get('val/accuracy')}; MLflow run {run.info.run_id}")
EOF
}

check_hf() {
    # export the trained model as a Hugging Face folder, reload it through transformers' Auto classes, and
    # generate from a left-padded batch (equal to each prompt alone); needs WHEEL_EXTRAS=hf
    python "$ROOT/.ci/hf_wheel_check.py" "$OUTSIDE/hf"
}

CHECKS=(installed cli train)
case ",${WHEEL_EXTRAS:-}," in *,hf,*) CHECKS+=(hf) ;; esac
for c in "${CHECKS[@]}"; do
    step "$c"
    "check_$c"
done
step "passed"
