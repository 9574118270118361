#!/usr/bin/env bash
# The ablation-grid tutorial, from the repository root: bash docs/tutorials/ablation-grid/run.sh [key=value ...]
# Extra arguments go to `atlaslab run` (overrides first, then options such as --run-dir).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

atlaslab run "$here/zip.yaml" --dry-run                   # zip: 3 widths paired with 3 head counts, 3 trials
atlaslab run "$here/experiment.yaml" "$@" --dry-run       # the grid: every trial validated and listed
atlaslab run "$here/experiment.yaml" "$@"                 # run it; the report lands in the run folder
