#!/usr/bin/env bash
# The issue-11 LM sweep in the order the sweep needs (tuning first: it sets every later cell).
# Resumable: rerun it and it continues with the first cell not yet in the results files.
#   nohup bash benchmarks/lm_sweep_background.sh > /tmp/lm_sweep.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/.."
PY="nice -n 19 env PYTHONPATH=$PWD .venv/bin/python benchmarks/lm_sweep.py"
# 1. tuning: DiLoCo/IsoLoCo at M = 8 (5 lrs x 2 momenta) and at M = 64 (3 lrs around the M = 8 optimum)
$PY --tune --methods isoloco diloco --workers 8
$PY --tune --methods isoloco diloco --workers 64
# 2. repeatability: a cell recorded before the content-digest merge order, rerun into a side file
#    (an empty tuning file and explicit outer values, so the stored twin is not reused)
$PY --methods isoloco --workers 8 --seeds 0 --outer-lr 1.8 --outer-momentum 0.8 \
    --tuning-file /tmp/lm_rerun_empty_tuning.json --out benchmarks/results/lm_rerun_check.json
# 3. headline cells, 3 seeds (M <= 16 at the M = 8 optimum, M >= 32 at the M = 64 one)
$PY --methods fedavg diloco isoloco --workers 1 8 32 128 --seeds 0 1 2
# 4. no-momentum methods and merging baselines: tuning at M = 8
$PY --tune --methods diloco-sgd iso_c-sgd ties dare tsv_m iso_cts --workers 8
$PY --methods fedavg diloco isoloco --workers 2 4 16 64 --seeds 0 1 2
$PY --methods ties dare tsv_m iso_cts --workers 8 --seeds 0 1 2
$PY --methods ties dare tsv_m iso_cts --workers 32 --seeds 0
$PY --methods diloco-sgd iso_c-sgd --workers 1 2 4 8 16 32 64 128 --seeds 0
$PY --methods dp-adamw --workers 8 --seeds 0
