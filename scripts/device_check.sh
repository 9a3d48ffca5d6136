#!/usr/bin/env bash
# The accelerator check on a lent GPU machine (docs/results.md, "On an H200"): the carried wheels and the repo's
# packages on the path (device_setup.sh), then every section of device_check.py into $OUT (or the folder given).
#   bash scripts/device_check.sh [OUT_DIR] [device_check.py options...]
# .whl/ and .devdata/ are made here first by scripts/device_prepare.sh and carried along.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-runs/device_check}}"
shift || true
source scripts/device_setup.sh || { echo "device_check.sh: set-up failed" >&2; exit 2; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m scripts.device_check --out "$out" "$@"
