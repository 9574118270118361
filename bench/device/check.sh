#!/usr/bin/env bash
# Run THERE (the GPU device machine), from the repo root, as ONE call: the Triton tests compiled for the GPU, then
# the correctness-gated kernel benchmark. Everything it writes goes to $OUT (default bench/results/device):
#
#   gpu.txt      nvidia-smi, torch / triton versions
#   tests.log    TRITON_INTERPRET=0 pytest tests/kernels/test_triton*.py tests/kernels/test_bench_kernels.py (junit in tests.xml)
#   bench.log    python3 bench/kernels.py --dtype bf16 ... (results in kernels_<gpu>.{json,md})
#
# Budgets (seconds; the whole call must fit the session's device time with room for a rerun):
#   TEST_BUDGET (default 240) for the tests, PER_TEST (150) per test, WORKERS (12) pytest-xdist workers,
#   BENCH_BUDGET (300) for the benchmark;
#   BENCH_ARGS (default "--dtype bf16 --quick") for bench/kernels.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/bench/device/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
{ nvidia-smi || true; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"; } \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import omegaconf" || { echo "check: omegaconf is missing: run bench/device/prepare.sh here and carry bench/device/site"; exit 2; }

echo "== tests (budget ${TEST_BUDGET:-240} s) =="
# pytest-xdist workers (in the device image): compiling the kernels dominates, one process ran 117 of the ~350 tests in
# 228 s on the H200 machine, 12 workers ran 345 in 214 s
timeout -s INT "${TEST_BUDGET:-240}" python3 -m pytest tests/kernels/test_triton*.py tests/kernels/test_bench_kernels.py \
  -n "${WORKERS:-12}" -rfE --timeout "${PER_TEST:-150}" -p no:cacheprovider --junitxml "$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== bench (budget ${BENCH_BUDGET:-300} s) =="
budget=${BENCH_BUDGET:-300}
# shellcheck disable=SC2086
timeout -s INT "$budget" python3 bench/kernels.py ${BENCH_ARGS:---dtype bf16 --quick} --deadline $((budget - 30)) \
  --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "check: tests rc=$tests_rc, bench rc=$bench_rc (124 = stopped at its budget)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
