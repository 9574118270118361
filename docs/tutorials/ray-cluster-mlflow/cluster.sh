#!/usr/bin/env bash
# A sweep on a Ray cluster, tracked on an MLflow server: both started here, on 127.0.0.1, and stopped at the end.
# From the repository root:  bash docs/tutorials/ray-cluster-mlflow/cluster.sh [WORK_DIR [key=value ...]]
# WORK_DIR (default runs/cluster-tutorial) receives the run folder, the MLflow store and the logs.
# RAY_PORT / MLFLOW_PORT choose the ports (default 6380 / 5000); extra arguments go to `atlaslab run`.
# Step 3 presses Ctrl-C once the first trial checkpoint is stored (an event, not a time; INTERRUPT_ON, a file
# pattern, names another event).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-runs/cluster-tutorial}"; shift || true
mkdir -p "$work" && work="$(cd "$work" && pwd)"
ray_port="${RAY_PORT:-6380}"
mlflow_port="${MLFLOW_PORT:-5000}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
# `ray start --head` turns on Ray's token authentication (the token is kept in ~/.ray/auth_token); every client
# (ray status, the atlaslab driver, its trials) must then send it, which RAY_AUTH_MODE=token asks for.
export RAY_AUTH_MODE=token

wait_for() {   # wait_for WHAT COMMAND...: retry COMMAND once a second, for at most two minutes
  local what="$1"; shift
  for _ in $(seq 120); do "$@" > /dev/null 2>&1 && return 0; sleep 1; done
  echo "$what did not come up" >&2; return 1
}

# --8<-- [start:ray]
# 1. A Ray head node. --block keeps `ray start` running: SIGTERM to it (or Ctrl-C in its terminal) stops the node.
#    --temp-dir: its sockets, logs and address file stay out of /tmp/ray (a short path: sockets have a length limit).
ray_tmp="$(mktemp -d /tmp/ray-tutorial-XXXXXX)"
ray start --head --node-ip-address=127.0.0.1 --port="$ray_port" --num-cpus=2 --temp-dir="$ray_tmp" \
    --include-dashboard=false --disable-usage-stats --block > "$work/ray.log" 2>&1 &
ray_pid=$!
# --8<-- [end:ray]

# --8<-- [start:mlflow]
# 2. An MLflow tracking server: runs and metrics in SQLite, artifacts in a folder, served on 127.0.0.1.
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid mlflow server --host 127.0.0.1 --port "$mlflow_port" --workers 1 \
    --backend-store-uri "sqlite:///$work/mlflow.db" --artifacts-destination "$work/mlartifacts" \
    > "$work/mlflow.log" 2>&1 &
mlflow_pid=$!     # setsid: the server and its workers form one process group, stopped together
# --8<-- [end:mlflow]

stop() {   # stop exactly what this script started, keep the script's exit status
  local rc=$?
  kill -TERM "$ray_pid" 2> /dev/null || true
  kill -TERM -- "-$mlflow_pid" 2> /dev/null || true
  wait "$ray_pid" "$mlflow_pid" 2> /dev/null || true
  rm -rf "$ray_tmp"
  exit "$rc"
}
trap stop EXIT
wait_for "Ray" ray status --address "127.0.0.1:$ray_port"
wait_for "MLflow" curl -sf "http://127.0.0.1:$mlflow_port/health"

# --8<-- [start:run]
# 3. The sweep: every trial runs on the cluster and is tracked on the server.
run=(--run-dir "$work/run" --ray-address "127.0.0.1:$ray_port" --tracking-uri "http://127.0.0.1:$mlflow_port")
set -m                       # job control: the sweep runs in its own process group and Ctrl-C (SIGINT) reaches it
atlaslab run "$here/experiment.yaml" "$@" "${run[@]}" &
sweep=$!
set +m
# Ctrl-C once Tune has stored a trial's first checkpoint in the run folder (or when the sweep has ended by itself)
event="${INTERRUPT_ON:-$work/run/ray/*/*/checkpoint_*/atlaslab_trial.json}"
until compgen -G "$event" > /dev/null || ! kill -0 "$sweep" 2> /dev/null; do sleep 1; done
kill -INT "$sweep" 2> /dev/null || true
wait "$sweep" || true
# --8<-- [end:run]

# --8<-- [start:resume]
# 4. Resume: finished trials are kept, the others continue from their last checkpoint, on the same cluster
#    and server (both recorded in the run folder's state.json).
atlaslab resume "$work/run"
# --8<-- [end:resume]

# --8<-- [start:look]
# 5. What went where.
python - "$work/run" "http://127.0.0.1:$mlflow_port" << 'PY'
import json, sys
from pathlib import Path
from mlflow.tracking import MlflowClient
run_dir, uri = Path(sys.argv[1]), sys.argv[2]
state = json.loads((run_dir / "state.json").read_text())
print("run folder:", sorted(p.name for p in run_dir.iterdir()))
print("status:", state["status"], "| Ray:", state.get("ray_address"), "| MLflow:", state["tracking"]["uri"])
client = MlflowClient(uri)
runs = client.search_runs([state["tracking"]["experiment_id"]])
for r in sorted(runs, key=lambda r: r.data.tags.get("atlaslab.trial_key", "")):
    tags = r.data.tags
    print(f"{r.info.status:9} {tags.get('atlaslab.trial_key', 'parent'):7} {tags.get('atlaslab.variant', ''):15}"
          f" {tags.get('atlaslab.status', ''):10} test/accuracy={r.data.metrics.get('test/accuracy')}")
PY
# --8<-- [end:look]
