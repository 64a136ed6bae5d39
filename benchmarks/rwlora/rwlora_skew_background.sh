#!/usr/bin/env bash
# Issue 21 (3): RW-LoRA variants under Dirichlet(0.5) label skew, resumable, one run at a time.
# Sized for 2 shared cores at load ~15 (docs/results-rwlora.md, "Label skew"):
# 1. screening: each variant once (those of SCREEN before the choice, LATE after the finals) (ring, seed 0, 160 updates) on the validation split (the
#    clients' joined validation tails, never trained on, disjoint from the test set; 300 of
#    them, every 40 updates), with per-class accuracy;
# 2. the variant with the best validation accuracy at the budget (ties: mean of the last three
#    evaluations) on the test split, full budget (320 updates, 1,000 sentences, scored at 0,
#    160 and 320), ring, skew and IID, seeds 0, 1, 2, next to the paper's walk and gossip of the
#    main sweep (same cells, already recorded); then the other graphs under skew.
# Every finished run is appended to benchmarks/results/rwlora_sweep.json and committed.
#   nohup bash benchmarks/rwlora/rwlora_skew_background.sh > /tmp/rw_skew.log 2>&1 &
# FINALS=<variant> runs only that variant's finals (test split), in the order the claims need:
# Dirichlet(0.5) on ring, complete, regular-3, then IID ring, complete, regular-3, seeds 0, 1, 2
# each (cells already recorded are skipped); NICE sets
# the niceness (default 19):
#   FINALS=k2 NICE=15 nohup bash benchmarks/rwlora/rwlora_skew_background.sh > /tmp/rw_k2.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=benchmarks/results/rwlora_sweep.json
PY="nice -n ${NICE:-19} env PYTHONPATH=$PWD .venv/bin/python"
SWEEP="$PY benchmarks/rwlora/rwlora_sweep.py --methods rwlora --out $OUT --engine fake --per-class"
commit() {  # retried: another commit in the same worktree may hold the index lock
  for _ in 1 2 3 4 5; do
    git add "$OUT" && git commit -q -m "rwlora skew: $1" -- "$OUT" && return 0
    sleep 5
  done
  return 0
}
final() {  # final VARIANT GRAPH PARTITION SEED: one test-split cell of the sweep's protocol
  $SWEEP --graphs "$2" --partitions "$3" --seeds "$4" --variants "$1" --eval-every 160 \
      && commit "$1, $2, $3, seed $4 (test split)"
}
if [ -n "${FINALS:-}" ]; then
  for gp in "ring dirichlet-0.5" "complete dirichlet-0.5" "regular-3 dirichlet-0.5" "ring iid" \
      "complete iid" "regular-3 iid"; do
    for s in 0 1 2; do final "$FINALS" $gp $s; done
  done
  exit 0
fi
SCREEN=${SCREEN:-"avg0.9 paper tail1 carry"}  # screened before the choice
LATE=${LATE:-"mom0.5 lrdecay8 k2"}            # screened after the finals (time)
screen() {
  for v in "$@"; do
    $SWEEP --graphs ring --partitions dirichlet-0.5 --seeds 0 --variants "$v" --eval-split val \
        --updates 160 --eval-every 40 --eval-examples 300 \
        && commit "screening $v (ring, dirichlet-0.5, seed 0, val split)"
  done
}
screen $SCREEN
BEST=${BEST:-$($PY benchmarks/rwlora/rwlora_sweep_report.py --best-variant --variants $SCREEN)}
echo "[skew] best variant on the validation split among $SCREEN: $BEST"
[ "$BEST" = paper ] && SPLITS="" || SPLITS="0 dirichlet-0.5,0 iid,1 dirichlet-0.5,2 dirichlet-0.5,1 iid,2 iid"
IFS=, read -ra SPLITS <<< "$SPLITS"  # the paper's walk: its test cells are the main sweep's
for sp in "${SPLITS[@]}"; do
  set -- $sp
  $SWEEP --graphs ring --partitions "$2" --seeds "$1" --variants "$BEST" --eval-every 160 \
      && commit "$BEST, ring, $2, seed $1 (test split)"
done
screen $LATE
[ "$BEST" = paper ] && exit 0
for s in 0 1 2; do
  for g in complete regular-3; do
    $SWEEP --graphs $g --partitions dirichlet-0.5 --seeds $s --variants "$BEST" --eval-every 160 \
        && commit "$BEST, $g, dirichlet-0.5, seed $s (test split)"
  done
done
