#!/usr/bin/env bash
# Institution: run one SuperNode, connected over TLS and authenticated with its private key.
#
#   scripts/deploy/start_supernode.sh CA_CERT SUPERLINK_ADDRESS PRIVATE_KEY NODE_CONFIG [APPIO_PORT]
#
# CA_CERT: the CA certificate that signed the SuperLink's certificate (ca.crt).
# SUPERLINK_ADDRESS: host:port of the SuperLink.
# NODE_CONFIG: this site's settings, read by the ClientApp via context.node_config, e.g.
#   'partition-id=0 num-partitions=3'  or  'site-name="hospital-a" data-path="/data/a"'.
# APPIO_PORT: local port for this SuperNode's ClientAppIo API (default 9094; must differ
#   between SuperNodes on one machine). Set FLWR_HOME to give each SuperNode its own folder.
set -euo pipefail

CA_CERT=${1:?usage: start_supernode.sh CA_CERT SUPERLINK_ADDRESS PRIVATE_KEY NODE_CONFIG [APPIO_PORT]}
SUPERLINK=${2:?missing SUPERLINK_ADDRESS}
PRIVATE_KEY=${3:?missing PRIVATE_KEY}
NODE_CONFIG=${4:?missing NODE_CONFIG}
APPIO_PORT=${5:-9094}
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}

exec flower-supernode \
  --root-certificates "$CA_CERT" \
  --superlink "$SUPERLINK" \
  --auth-supernode-private-key "$PRIVATE_KEY" \
  --node-config "$NODE_CONFIG" \
  --host 127.0.0.1 --port "$APPIO_PORT"
