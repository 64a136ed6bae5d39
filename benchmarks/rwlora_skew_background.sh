#!/usr/bin/env bash
# Issue 21 (3): RW-LoRA variants under Dirichlet(0.5) label skew, resumable, one run at a time.
# 1. screening: each variant once (ring, seed 0) scored on the validation split (the clients'
#    joined validation tails, never trained on, disjoint from the test set), per-class;
# 2. the variant with the best validation accuracy at 320 updates (ties: best mean of the last
#    three evaluations), then on the test split at seeds 0, 1, 2 under skew and IID (ring),
#    next to the paper's walk and gossip of the main sweep (same cells, already recorded);
# 3. the other graphs under skew, seed 0, then seeds 1 and 2.
# Every finished run is appended to benchmarks/results/rwlora_sweep.json and committed.
#   nohup bash benchmarks/rwlora_skew_background.sh > /tmp/rw_skew.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/rwlora_sweep.json
PY="nice -n 19 env PYTHONPATH=$PWD .venv/bin/python"
SWEEP="$PY benchmarks/rwlora_sweep.py --methods rwlora --out $OUT"
commit() { git add "$OUT" && git commit -q -m "rwlora skew: $1" -- "$OUT" || true; }
SCREEN=${SCREEN:-"paper avg0.9 k2 lrdecay8 mom0.5"}
for v in $SCREEN; do
  $SWEEP --graphs ring --partitions dirichlet-0.5 --seeds 0 --variants "$v" --eval-split val \
      --per-class && commit "screening $v (ring, dirichlet-0.5, seed 0, val split)"
done
BEST=${BEST:-$($PY benchmarks/rwlora_sweep_report.py --best-variant --variants $SCREEN)}
echo "[skew] best variant on the validation split: $BEST"
for s in 0 1 2; do
  for p in dirichlet-0.5 iid; do
    $SWEEP --graphs ring --partitions $p --seeds $s --variants "$BEST" --per-class \
        && commit "$BEST, ring, $p, seed $s (test split)"
  done
done
for s in 0 1 2; do
  for g in complete regular-3; do
    $SWEEP --graphs $g --partitions dirichlet-0.5 --seeds $s --variants "$BEST" --per-class \
        && commit "$BEST, $g, dirichlet-0.5, seed $s (test split)"
  done
done
