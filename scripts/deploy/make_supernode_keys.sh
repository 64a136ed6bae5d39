#!/usr/bin/env bash
# Create a SuperNode's authentication key pair (ECDSA P-384, the type Flower expects).
#
#   scripts/deploy/make_supernode_keys.sh KEY_DIR NAME
#
# Writes KEY_DIR/NAME (private key: stays at the institution) and KEY_DIR/NAME.pub (public
# key: sent to the coordinating site, which registers it with `register_supernode.sh`).
set -euo pipefail

KEY_DIR=${1:?usage: make_supernode_keys.sh KEY_DIR NAME}
NAME=${2:?usage: make_supernode_keys.sh KEY_DIR NAME}
mkdir -p "$KEY_DIR"
rm -f "$KEY_DIR/$NAME" "$KEY_DIR/$NAME.pub"
ssh-keygen -q -t ecdsa -b 384 -N "" -C "$NAME" -f "$KEY_DIR/$NAME"
echo "keys: $KEY_DIR/$NAME (private) $KEY_DIR/$NAME.pub (public)"
