#!/usr/bin/env bash
# The issue-11 LM sweep in the order the sweep needs (tuning first: it sets every later cell).
# Resumable: rerun it and it continues with the first cell not yet in the results files.
#   nohup bash benchmarks/lm_sweep_background.sh > /tmp/lm_sweep.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
PY="nice -n 19 env PYTHONPATH=$PWD .venv/bin/python benchmarks/lm_sweep.py"
$PY --tune --methods isoloco diloco --workers 8
$PY --methods fedavg diloco isoloco --workers 1 8 32 128 --seeds 0
$PY --methods dp-adamw --workers 8 --seeds 0
