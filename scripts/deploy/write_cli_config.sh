#!/usr/bin/env bash
# Add a TLS connection to the SuperLink to the Flower CLI's config ($FLWR_HOME/config.toml).
#
#   scripts/deploy/write_cli_config.sh NAME SUPERLINK_ADDRESS CA_CERT
#
# Afterwards `flwr run <app> NAME`, `flwr ls NAME`, `flwr supernode register KEY.pub NAME` talk
# to that SuperLink. FLWR_HOME defaults to ~/.flwr.
#
# NAME becomes a TOML table name, so it must be letters, digits, '-' or '_' (refused otherwise).
# The address and the CA path are written as TOML basic strings with '\', '"' and control
# characters escaped, so any path (quotes, backslashes, tabs, newlines) reads back exactly; a
# path that is not valid UTF-8 cannot be written to TOML and is refused.
set -euo pipefail

# $1 as a TOML basic string: "..." with \ -> \\, " -> \", control characters -> \uXXXX.
toml_string() {
  local LC_ALL=C  # one byte per character; bytes >= 0x80 (UTF-8) are copied as they are
  local s=$1 out="" c code i
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    case $c in
      '\') out+='\\' ;;
      '"') out+='\"' ;;
      *)
        printf -v code '%d' "'$c"
        if ((code < 32 || code == 127)); then printf -v c '\\u%04X' "$code"; fi
        out+=$c
        ;;
    esac
  done
  printf '"%s"' "$out"
}

refuse_non_utf8() {  # $1: what, $2: value
  if command -v iconv >/dev/null 2>&1 && ! printf '%s' "$2" | iconv -f UTF-8 -t UTF-8 >/dev/null 2>&1; then
    echo "write_cli_config: $1 is not valid UTF-8, so it cannot be written to TOML: $2" >&2
    exit 2
  fi
}

NAME=${1:?usage: write_cli_config.sh NAME SUPERLINK_ADDRESS CA_CERT}
ADDRESS=${2:?missing SUPERLINK_ADDRESS}
# realpath prints the path and a newline; the trailing "x" keeps a path that ends in newlines
CA_CERT=$(realpath -- "${3:?missing CA_CERT}" && printf x)
CA_CERT=${CA_CERT%x}
CA_CERT=${CA_CERT%$'\n'}
if ! [[ $NAME =~ ^[A-Za-z0-9_-]+$ ]]; then
  echo "write_cli_config: connection name '$NAME' must be letters, digits, '-' or '_' only" >&2
  exit 2
fi
refuse_non_utf8 "SUPERLINK_ADDRESS" "$ADDRESS"
refuse_non_utf8 "CA_CERT path" "$CA_CERT"
FLWR_HOME=${FLWR_HOME:-$HOME/.flwr}
CONFIG="$FLWR_HOME/config.toml"
mkdir -p "$FLWR_HOME"
if [ ! -f "$CONFIG" ]; then
  printf '[superlink]\ndefault = "%s"\n' "$NAME" > "$CONFIG"
elif grep -q "^\[superlink\.$NAME\]" "$CONFIG"; then
  echo "connection '$NAME' already in $CONFIG; edit it there" >&2
  exit 1
fi
printf '\n[superlink.%s]\naddress = %s\nroot-certificates = %s\n' \
  "$NAME" "$(toml_string "$ADDRESS")" "$(toml_string "$CA_CERT")" >> "$CONFIG"
echo "connection '$NAME' -> $ADDRESS written to $CONFIG"
