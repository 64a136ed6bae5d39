#!/usr/bin/env bash
# Coordinating site: remove a SuperNode from the federation (its key can no longer connect).
#
#   scripts/deploy/unregister_supernode.sh NODE_ID CONNECTION
#
# NODE_ID: as printed by register_supernode.sh or listed by `flwr supernode ls CONNECTION`.
set -euo pipefail

NODE_ID=${1:?usage: unregister_supernode.sh NODE_ID CONNECTION}
CONNECTION=${2:?missing CONNECTION}
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}

flwr supernode unregister "$NODE_ID" "$CONNECTION"
