#!/usr/bin/env bash
# The issue-11 LM sweep, in the order the claims need it (tuning first: it sets every later cell;
# then one seed of every question before more seeds of any). Resumable: rerun it and it continues
# with the first cell not yet in the results files (each cell is skipped when recorded).
#   nohup bash benchmarks/lm/lm_sweep_background.sh > /tmp/lm_sweep.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="nice -n 19 env PYTHONPATH=$PWD .venv/bin/python benchmarks/lm/lm_sweep.py"
# 1. tuning: DiLoCo/IsoLoCo at M = 8 (5 lrs x 2 momenta) and at M = 64 (lrs around the M = 8 optimum)
$PY --tune --methods isoloco diloco --workers 8
$PY --tune --methods isoloco diloco --workers 64
# 2. headline cells, 3 seeds (M <= 16 at the M = 8 optimum, M >= 32 at the M = 64 one)
$PY --methods fedavg diloco isoloco --workers 1 8 32 128 --seeds 0 1 2
# 3. no-momentum methods and merging baselines: tuning at M = 8
$PY --tune --methods diloco-sgd iso_c-sgd ties dare tsv_m iso_cts --workers 8
# 4. beyond the paper, one seed: H and where Iso-C acts; then the merge rules' seeds (the M = 8
#    table), the 4x model, Iso-C / mean without momentum along M
$PY --protocol h-sweep --inner-steps 30 --methods isoloco diloco --workers 8 --seeds 0
$PY --protocol h-sweep --inner-steps 100 --methods isoloco diloco --workers 8 --seeds 0
$PY --protocol iso_c-no-embed --methods isoloco iso_c-sgd --workers 8 --seeds 0
$PY --methods ties dare tsv_m iso_cts --workers 8 --seeds 0 1 2
$PY --protocol large-model --methods isoloco diloco --workers 8 32 --seeds 0
$PY --methods iso_c-sgd diloco-sgd --workers 1 32 128 --seeds 0
# 5. the rest of the M axis, seed 0 first
$PY --methods fedavg diloco isoloco --workers 2 4 16 64 --seeds 0
$PY --methods diloco-sgd iso_c-sgd --workers 2 4 16 64 --seeds 0
$PY --protocol per-worker-batch --methods isoloco diloco --workers 4 16 64 --seeds 0
$PY --methods ties dare tsv_m iso_cts --workers 32 --seeds 0
$PY --methods fedavg diloco isoloco --workers 2 4 16 64 --seeds 1 2
$PY --protocol h-sweep --inner-steps 100 --methods isoloco diloco --workers 8 --seeds 1 2
$PY --protocol h-sweep --inner-steps 30 --methods isoloco diloco --workers 8 --seeds 1 2
# 6. the reference line (tuned inner lr: benchmarks/lm/lm_inner_lr.py)
$PY --methods dp-adamw --workers 8 --seeds 0
