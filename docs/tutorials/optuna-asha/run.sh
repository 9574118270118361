#!/usr/bin/env bash
# The optuna-asha tutorial, from the repository root: bash docs/tutorials/optuna-asha/run.sh [key=value ...]
# Extra arguments go to `atlaslab run` (overrides first, then options such as --run-dir).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

atlaslab run "$here/experiment.yaml" "$@" --dry-run       # the space, and its corner configurations validated
atlaslab run "$here/experiment.yaml" "$@"                 # the search; the report lists every trial, best first
