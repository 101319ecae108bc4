#!/usr/bin/env bash
# Install gpumode into .venv and run the main job on an emulated host (no GPU, no root needed beyond the install).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[server]'
exec .venv/bin/gpumode demo "$@"
