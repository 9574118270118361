#!/usr/bin/env bash
# The own-retention tutorial, from the repository root: bash docs/tutorials/own-retention/run.sh [key=value ...]
# Extra arguments go to `atlaslab run` (overrides first, then options such as --run-dir).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"     # an absolute path: Ray's workers start in other folders

python "$here/check.py"                                   # validation, and the three engines agree
atlaslab run "$here/experiment.yaml" "$@" --dry-run       # every trial validated and listed, nothing trained
atlaslab run "$here/experiment.yaml" "$@"                 # the grid on Ray Tune, tracked in MLflow
