#!/usr/bin/env bash
# Coordinating site: run the SuperLink with TLS and SuperNode authentication switched on.
#
#   scripts/deploy/start_superlink.sh CERT_DIR [HOST] [PORT] [DATABASE]
#
# One port serves the Fleet API (SuperNodes), the Control API (`flwr` CLI) and the Runtime
# API (ServerApp). HOST: address to bind (default 127.0.0.1; 0.0.0.0 to accept other sites).
# DATABASE: state file so runs and registered SuperNodes survive a restart (default: in memory).
# Apps run in this Python environment: install flwr-isoloco here first
# (runtime dependency installation is off; it would reinstall torch for every run).
set -euo pipefail

CERT_DIR=${1:?usage: start_superlink.sh CERT_DIR [HOST] [PORT] [DATABASE]}
HOST=${2:-127.0.0.1}
PORT=${3:-9093}
DATABASE=${4:-:flwr-in-memory:}
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}

exec flower-superlink \
  --ssl-ca-certfile "$CERT_DIR/ca.crt" \
  --ssl-certfile "$CERT_DIR/server.pem" \
  --ssl-keyfile "$CERT_DIR/server.key" \
  --enable-supernode-auth \
  --disable-runtime-dependency-installation \
  --host "$HOST" --port "$PORT" \
  --database "$DATABASE"
