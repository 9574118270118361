#!/usr/bin/env bash
# Run HERE (the CPU machine), once per session, before the GPU call: gathers what the device machine lacks into
# git-ignored folders that the device tool's `carry` takes along (bench/device/README.md says how to call it).
#
#   bench/device/site/   pure-Python packages absent from the device image (omegaconf, from this venv)
#   bench/.peers/        fla-core for the bench's fla row (python bench/peers.py --install, if it is not there)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
site=$($py -c "import omegaconf, pathlib; print(pathlib.Path(omegaconf.__file__).parent.parent)")
rm -rf bench/device/site && mkdir -p bench/device/site
cp -r "$site/omegaconf" bench/device/site/
find bench/device/site -name __pycache__ -prune -exec rm -rf {} +
if [ ! -d bench/.peers/fla ]; then
  $py bench/peers.py --install || echo "prepare: fla-core could not be installed into bench/.peers (the fla row will say so)"
fi
du -sh bench/device/site bench/.peers 2>/dev/null || true
