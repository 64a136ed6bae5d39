#!/usr/bin/env bash
# Coordinating site: allow a SuperNode to join, by registering its public key.
#
#   scripts/deploy/register_supernode.sh PUBLIC_KEY CONNECTION [SITE_NAME]
#
# CONNECTION: the name written by write_cli_config.sh. Only registered SuperNodes can connect
# once the SuperLink runs with --enable-supernode-auth.
set -euo pipefail

PUBLIC_KEY=${1:?usage: register_supernode.sh PUBLIC_KEY CONNECTION [SITE_NAME]}
CONNECTION=${2:?missing CONNECTION}
SITE_NAME=${3:-}
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}

if [ -n "$SITE_NAME" ]; then
  flwr supernode register "$PUBLIC_KEY" "$CONNECTION" --name "$SITE_NAME"
else
  flwr supernode register "$PUBLIC_KEY" "$CONNECTION"
fi
