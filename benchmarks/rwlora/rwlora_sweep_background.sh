#!/usr/bin/env bash
# The issue-11 RW-LoRA sweep in the order the claims need it: one seed of every graph and
# partition before more seeds, then the rank and 16-client settings. Resumable (recorded cells
# are skipped).   nohup bash benchmarks/rwlora/rwlora_sweep_background.sh > /tmp/rw_sweep.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="nice -n 19 env PYTHONPATH=$PWD .venv/bin/python benchmarks/rwlora/rwlora_sweep.py"
$PY --methods rwlora gossip fedavg --graphs ring complete --partitions iid --seeds 0 1 2
$PY --methods rwlora gossip fedavg --graphs ring complete regular-3 --partitions dirichlet-0.5 --seeds 0
$PY --methods rwlora gossip --graphs regular-3 --partitions iid --seeds 0
$PY --methods rwlora gossip fedavg --graphs ring complete regular-3 --partitions dirichlet-0.5 --seeds 1 2
$PY --methods rwlora gossip --graphs regular-3 --partitions iid --seeds 1 2
$PY --suite ranks
$PY --suite clients16
# inner-lr probe (ring, seed 0; the main cells use 2e-3): label skew at 5e-4 and 1e-3, IID at 1e-3
for lr in 5e-4 1e-3; do
  $PY --methods rwlora gossip --graphs ring --partitions dirichlet-0.5 --seeds 0 --lr $lr
done
$PY --methods rwlora gossip --graphs ring --partitions iid --seeds 0 --lr 1e-3
# the lr that did best under skew at seed 0, checked on seeds 1 and 2 (fresh test sets)
$PY --methods rwlora gossip --graphs ring --partitions dirichlet-0.5 --seeds 1 2 --lr 1e-3
