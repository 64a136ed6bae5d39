#!/usr/bin/env bash
# The issue-21 horizon study (benchmarks/lm/lm_sweep.py --protocol horizon), in the order that gives
# the first complete comparison soonest: M = 8 tuning at T = 200 and 600, the inner lr at 600,
# then the M = 8 seeds, then M = 1 / 32, then T = 1080. Resumable: rerun it and every recorded
# cell is skipped. Results: benchmarks/results/lm_horizon{,_tuning}.json, committed (only those
# two files) after every command and every 10 minutes while one runs; HORIZON_COMMIT=0: no commits.
#   nohup bash benchmarks/lm/lm_sweep_horizon.sh > /tmp/lm_horizon.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD  # Ray workers import this checkout's code
PY="nice -n 19 .venv/bin/python benchmarks/lm/lm_sweep.py --protocol horizon"
FILES=(benchmarks/results/lm_horizon.json benchmarks/results/lm_horizon_tuning.json)
ALL="fedavg diloco isoloco iso_c-sgd dp-adamw"

commit() {
  [ "${HORIZON_COMMIT:-1}" = 1 ] || return 0
  local have=()
  for f in "${FILES[@]}"; do [ -f "$f" ] && have+=("$f"); done
  [ ${#have[@]} -gt 0 ] || return 0
  git add -- "${have[@]}" && ! git diff --cached --quiet -- "${have[@]}" || return 0
  local n
  n=$(.venv/bin/python -c 'import json,sys; print(sum(len(json.load(open(f))) for f in sys.argv[1:]))' "${have[@]}")
  git commit -q -m "horizon study: $n records (lm_sweep_horizon.sh)" -- "${have[@]}" || true
}
( while sleep 600; do commit; done ) &
WATCH=$!
trap 'kill $WATCH 2>/dev/null; commit' EXIT
step() { $PY "$@"; commit; }

# 0. a first comparison: every method at T = 200, M = 8, seed 0 at the issue-11 optimum (the
#    centre of its grid, so these are the grids' first points)
step --tune --grid-points 1 --horizon 200 --methods dp-adamw isoloco diloco iso_c-sgd
step --horizon 200 --workers 8 --seeds 0 --methods fedavg
# 1. outer (dp-adamw: peak) lr at M = 8, T = 200 then 600, at the default inner lr 3e-3
step --tune --horizon 200 --methods dp-adamw isoloco diloco iso_c-sgd
step --tune --horizon 600 --methods dp-adamw isoloco diloco iso_c-sgd
# 2. the workers' inner lr at T = 600, then the outer grids again at the tuned inner lr
#    (cells already recorded are skipped: a no-op where the inner lr stayed 3e-3)
step --tune-inner --methods fedavg diloco isoloco iso_c-sgd
step --tune --horizon 200 600 --methods isoloco diloco iso_c-sgd
# 3. the first complete comparison: M = 8, 3 seeds, T = 200 and 600
step --horizon 200 600 --workers 8 --seeds 0 1 2 --methods $ALL
# 4. M = 1 and 32, 2 seeds
step --horizon 200 600 --workers 1 32 --seeds 0 1 --methods $ALL
# 5. the longest horizon
step --tune --horizon 1080 --methods dp-adamw isoloco diloco iso_c-sgd
step --horizon 1080 --workers 8 --seeds 0 1 2 --methods $ALL
# seed-major at M = 1 / 32: one seed of every method at both M before the second seed
for seed in 0 1; do step --horizon 1080 --workers 32 1 --seeds $seed --methods $ALL; done
