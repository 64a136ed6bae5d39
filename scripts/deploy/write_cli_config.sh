#!/usr/bin/env bash
# Add a TLS connection to the SuperLink to the Flower CLI's config ($FLWR_HOME/config.toml).
#
#   scripts/deploy/write_cli_config.sh NAME SUPERLINK_ADDRESS CA_CERT
#
# Afterwards `flwr run <app> NAME`, `flwr ls NAME`, `flwr supernode register KEY.pub NAME` talk
# to that SuperLink. FLWR_HOME defaults to ~/.flwr.
set -euo pipefail

NAME=${1:?usage: write_cli_config.sh NAME SUPERLINK_ADDRESS CA_CERT}
ADDRESS=${2:?missing SUPERLINK_ADDRESS}
CA_CERT=$(realpath "${3:?missing CA_CERT}")
FLWR_HOME=${FLWR_HOME:-$HOME/.flwr}
CONFIG="$FLWR_HOME/config.toml"
mkdir -p "$FLWR_HOME"
if [ ! -f "$CONFIG" ]; then
  printf '[superlink]\ndefault = "%s"\n' "$NAME" > "$CONFIG"
elif grep -q "^\[superlink\.$NAME\]" "$CONFIG"; then
  echo "connection '$NAME' already in $CONFIG; edit it there" >&2
  exit 1
fi
printf '\n[superlink.%s]\naddress = "%s"\nroot-certificates = "%s"\n' \
  "$NAME" "$ADDRESS" "$CA_CERT" >> "$CONFIG"
echo "connection '$NAME' -> $ADDRESS written to $CONFIG"
