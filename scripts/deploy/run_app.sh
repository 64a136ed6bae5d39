#!/usr/bin/env bash
# Submit a Flower app to the SuperLink and wait until the run finishes; exit 0 only if the run
# status is `finished:completed` (`flwr run --stream` exits 0 even when the ServerApp crashed).
#
#   scripts/deploy/run_app.sh APP_DIR CONNECTION [RUN_CONFIG] [TIMEOUT_S]
#
# RUN_CONFIG: overrides, e.g. "num-server-rounds=3 output-dir='/abs/out'" (strings quoted).
# Prints the run id on the first line, the final status on the last line.
set -euo pipefail

APP_DIR=${1:?usage: run_app.sh APP_DIR CONNECTION [RUN_CONFIG] [TIMEOUT_S]}
CONNECTION=${2:?missing CONNECTION}
RUN_CONFIG=${3:-}
TIMEOUT_S=${4:-1800}
POLL_S=${POLL_S:-2}
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}
PY=${PYTHON:-python3}

args=(run "$APP_DIR" "$CONNECTION" --format json)
[ -n "$RUN_CONFIG" ] && args+=(--run-config "$RUN_CONFIG")
out=$(flwr "${args[@]}")
run_id=$(printf '%s' "$out" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d.get("run-id") or "")')
if [ -z "$run_id" ]; then
  echo "flwr run did not start a run: $out" >&2
  exit 2
fi
echo "run-id $run_id"

deadline=$(( $(date +%s) + TIMEOUT_S ))
status=""
while :; do
  status=$(flwr ls "$CONNECTION" --run-id "$run_id" --format json \
    | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d["runs"][0]["status"] if d.get("runs") else "")' \
    || true)
  case "$status" in finished:*) break ;; esac
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "run $run_id still '$status' after ${TIMEOUT_S}s; stopping it" >&2
    flwr stop "$run_id" "$CONNECTION" >/dev/null 2>&1 || true
    echo "status timeout"
    exit 3
  fi
  sleep "$POLL_S"
done
echo "status $status"
[ "$status" = "finished:completed" ]
