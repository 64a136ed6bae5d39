#!/usr/bin/env bash
# Run a Flower app in simulation with a private SuperLink, and fail unless the run completed.
#
#   scripts/run_app.sh <app-dir> <output-dir> [run-config override]...
#
#   e.g. scripts/run_app.sh simulations/isoloco-lm /tmp/out num-server-rounds=3 "strategy.name='diloco'"
#   (each override is key=value, TOML value syntax; no spaces inside a value)
#
# Flower 1.42 does the run itself (`flwr run <app> <connection> --stream --federation-config
# ... --run-config <file>`: simulation, Ray, logs). This script adds only what Flower cannot do
# (see docs/user-guide.md), each piece with its reason:
# - a private FLWR_HOME (under <repo>/.flwr/, gitignored), so no user or concurrent run is
#   touched: Flower has no per-run home;
# - its own `flower-superlink --simulation` on a free loopback port, PID kept: the SuperLink
#   that `flwr run` starts itself (connection address ":local:") listens on one fixed port
#   (39091) for every run on the machine, so concurrent runs would share it (and the
#   environment it froze at its first start); it is detached, no PID is recorded anywhere and
#   no `flwr` command stops it, so it outlives the run (and holds Ray) after Ctrl-C too;
# - the overrides checked and written as one TOML file (reasons at that step below);
# - the real exit status: `flwr run --stream` exits 0 even when the ServerApp crashed, so the
#   run's status is read from `flwr ls --format json`; the script exits 0 only for
#   `finished:completed`;
# - the SuperLink's process group (it holds the simulation and Ray) is stopped on every exit.
#
# Environment: NUM_SUPERNODES (default 4), CPUS_PER_CLIENT (default 1), GPUS_PER_CLIENT
# (default 0: none; e.g. 1, or 0.5 for two nodes per GPU), RUN_APP_KEEP_HOME=1
# keeps the FLWR_HOME folder, FLWR_BIN_DIR (default <repo>/.venv/bin), RUN_APP_DRY_RUN=1 checks
# the overrides (keys, types, and our apps' value checks), prints them as Flower will read them
# and exits 0 without starting anything.
set -euo pipefail

# Everything runs inside main(), so bash parses the whole file before executing any of it:
# editing or replacing this script while a run is in flight cannot change that run.
main() {

if [ $# -lt 2 ]; then
  echo "usage: $0 <app-dir> <output-dir> [run-config override]..." >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
APP=$(cd "$1" && pwd)
OUT=$2
shift 2
case "$OUT" in /*) ;; *) OUT="$(pwd)/$OUT" ;; esac
mkdir -p "$OUT"

BIN=${FLWR_BIN_DIR:-$REPO/.venv/bin}
export PATH="$BIN:$PATH"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 RAY_DEDUP_LOGS=0
SL_PID=""
RUN_HOME=""
cleanup() {
  local rc=$?
  if [ -n "$SL_PID" ] && kill -0 "$SL_PID" 2>/dev/null; then
    # The SuperLink's own group, plus the groups its children lead (flower-superexec calls
    # setsid; it runs flwr-simulation and Ray). Collected before anything is stopped.
    local groups="$SL_PID" child pg
    for child in $(pgrep -P "$SL_PID" || true); do
      pg=$(ps -o pgid= -p "$child" 2>/dev/null | tr -d ' ')
      [ -n "$pg" ] && groups="$groups $pg"
    done
    for pg in $groups; do kill -TERM -- "-$pg" 2>/dev/null || true; done
    for _ in $(seq 1 20); do kill -0 "$SL_PID" 2>/dev/null || break; sleep 0.5; done
    sleep 1
    for pg in $groups; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  fi
  # only the folder this script created (never an inherited FLWR_HOME)
  if [ -n "${RUN_HOME:-}" ] && [ "${RUN_APP_KEEP_HOME:-0}" != 1 ]; then rm -rf "$RUN_HOME"; fi
  exit $rc
}
trap cleanup EXIT INT TERM

# they go into the federation-config string below: plain positive integers only
for var in NUM_SUPERNODES CPUS_PER_CLIENT; do
  if [ -n "${!var:-}" ] && ! [[ ${!var} =~ ^[1-9][0-9]{0,5}$ ]]; then
    echo "run_app: $var=${!var} must be a positive integer" >&2
    exit 2
  fi
done
if [ -n "${GPUS_PER_CLIENT:-}" ] && ! [[ $GPUS_PER_CLIENT =~ ^([0-9]{1,3}(\.[0-9]{1,4})?)$ ]]; then
  echo "run_app: GPUS_PER_CLIENT=$GPUS_PER_CLIENT must be a number >= 0 (e.g. 1 or 0.5)" >&2
  exit 2
fi

mkdir -p "$REPO/.flwr"
RUN_HOME=$(mktemp -d "$REPO/.flwr/home.XXXXXX")
export FLWR_HOME=$RUN_HOME
RUN_CONFIG="$RUN_HOME/run-config.toml"

# The overrides go to Flower as one TOML file, written by tomli_w (a Flower dependency): a
# `--run-config` string cannot carry every path (its parser takes '...' or "..." values
# without escapes, so an output dir with a ' would end at that quote and the run would write
# elsewhere). Checked here first: Flower answers an override key that the app does not
# declare with a bare "[code: 15] Invalid run configuration.", so the message names the key;
# each value must have its declared type, and our apps' own config checks run on the result
# (flwr_isoloco.runconfig.precheck_app_config), so a bad value fails before the simulation
# starts; and the file is read back with Flower's own parser and must give exactly the
# overrides.
"$BIN/python" - "$APP/pyproject.toml" "$RUN_CONFIG" "$OUT" "$@" <<'PY' || exit 2
import difflib, json, os, sys, tomllib
import tomli_w
from flwr.common.config import flatten_dict, parse_config_args, unflatten_dict
pyproject, target, out, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with open(pyproject, "rb") as fh:
    known = flatten_dict(tomllib.load(fh)["tool"]["flwr"]["app"].get("config", {}))
joined = " ".join(args)  # as "$*": Flower's parser splits key=value pairs at spaces
try:
    given = parse_config_args([joined]) if joined.strip() else {}
except Exception as exc:  # noqa: BLE001
    sys.exit(f"run_app: cannot parse the run-config overrides {joined!r}: {exc}")
bad = [k for k in given if k not in known]
for k in bad:
    close = difflib.get_close_matches(k, list(known), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    print(f"run_app: unknown run-config key {k!r}{hint}; the app declares: {', '.join(sorted(known))}", file=sys.stderr)
if bad:
    sys.exit(1)
if "output-dir" in given:
    sys.exit("run_app: output-dir is set by the second argument (<output-dir>); drop the override")
try:
    out.encode("utf-8")
except UnicodeEncodeError:
    sys.exit(f"run_app: output dir {out!r} is not valid UTF-8, so it cannot be passed to Flower")
want = {**given, "output-dir": out}
# Types (against the declared values) and, for our apps (an AppSpec), the app's own checks of
# every value: a bad value stops here in seconds, not after the simulation has started.
from flwr_isoloco.runconfig import precheck_app_config
problems = precheck_app_config(os.path.dirname(pyproject), want)
for p in problems:
    print(f"run_app: {p}", file=sys.stderr)
if problems:
    sys.exit(1)
with open(target, "w", encoding="utf-8") as fh:
    fh.write(tomli_w.dumps(unflatten_dict(want)))
back = parse_config_args([target])
if back != want:
    sys.exit(f"run_app: the run-config overrides do not survive Flower's parser: {want!r} -> {back!r}")
if os.environ.get("RUN_APP_DRY_RUN") == "1":
    print("run_app: dry run, run-config overrides: " + json.dumps(back, sort_keys=True))
PY
if [ "${RUN_APP_DRY_RUN:-0}" = 1 ]; then exit 0; fi

PORT=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG="$OUT/flwr-run.log"

cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "runapp"

[superlink.runapp]
address = "127.0.0.1:$PORT"
insecure = true
EOF

# setsid: the SuperLink leads its own process group, so cleanup stops it and its children.
setsid "$BIN/flower-superlink" --insecure --simulation --isolation subprocess \
  --host 127.0.0.1 --port "$PORT" --database "$FLWR_HOME/state.db" \
  --log-file "$FLWR_HOME/superlink.log" --disable-runtime-dependency-installation \
  >"$FLWR_HOME/superlink.out" 2>&1 &
SL_PID=$!
# Wait until it accepts connections (bash's /dev/tcp: no interpreter start per probe), 60 s at
# most: Flower's own start-up wait is 15 s, too short for a loaded 2-core machine.
for _ in $(seq 1 120); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  kill -0 "$SL_PID" 2>/dev/null || { echo "SuperLink exited; see $FLWR_HOME/superlink.out" >&2; cat "$FLWR_HOME/superlink.out" >&2; exit 1; }
  sleep 0.5
done

# One --run-config file ($RUN_CONFIG, above): Flower 1.42 parses each --run-config flag into a
# nested dict and dict.update()s them, so a second flag with keys of the same section (train.a,
# then train.b) would silently drop the first. In one file all keys survive.
FED="num-supernodes=${NUM_SUPERNODES:-4} client-resources-num-cpus=${CPUS_PER_CLIENT:-1}"
FED="$FED client-resources-num-gpus=${GPUS_PER_CLIENT:-0}"

echo "run_app: $APP -> $OUT (SuperLink pid $SL_PID, port $PORT, FLWR_HOME $FLWR_HOME)"
T0=$(date +%s.%N)
"$BIN/flwr" run "$APP" runapp --stream --federation-config "$FED" --run-config "$RUN_CONFIG" 2>&1 | tee "$LOG"
T1=$(date +%s.%N)

"$BIN/flwr" ls runapp --format json > "$OUT/flwr-ls.json" 2>/dev/null || true
# this private SuperLink ran one run: the last listed is ours
STATUS=$("$BIN/python" -c '
import json, sys
try:
    runs = json.load(open(sys.argv[1])).get("runs") or []
except Exception as exc:  # noqa: BLE001
    runs = [{"status": f"unknown (flwr ls unreadable: {exc})"}]
print(runs[-1].get("status", "unknown") if runs else "unknown (no run listed)")' "$OUT/flwr-ls.json")
WALL=$(awk "BEGIN {printf \"%.1f\", $T1 - $T0}")
echo "run_app: status $STATUS, wall time ${WALL}s, log $LOG"
echo "{\"status\": \"$STATUS\", \"wall-time-s\": $WALL}" > "$OUT/run_app.json"
if [ "$STATUS" != "finished:completed" ]; then
  echo "run_app: FAILED: the run did not complete ($STATUS). Last ServerApp errors:" >&2
  grep -E "ERROR|Error|Traceback|RunConfigError" "$LOG" | tail -n 20 >&2 || true
  exit 1
fi
}

main "$@"
