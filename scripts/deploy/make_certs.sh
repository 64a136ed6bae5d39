#!/usr/bin/env bash
# Create a throw-away certificate authority and a SuperLink server certificate signed by it.
#
#   scripts/deploy/make_certs.sh CERT_DIR [SAN ...]
#
# SAN entries are host names or IP addresses the SuperNodes and the CLI use to reach the
# SuperLink (default: 127.0.0.1 localhost). Writes CERT_DIR/{ca.key,ca.crt,server.key,server.pem}.
# For a real federation, use your institution's CA instead and keep ca.key offline.
set -euo pipefail

CERT_DIR=${1:?usage: make_certs.sh CERT_DIR [SAN ...]}
shift
SANS=("$@")
[ ${#SANS[@]} -eq 0 ] && SANS=(127.0.0.1 localhost)
DAYS=${CERT_DAYS:-365}

san_list=""
for s in "${SANS[@]}"; do
  if [[ $s =~ ^[0-9.]+$ || $s == *:* ]]; then entry="IP:$s"; else entry="DNS:$s"; fi
  san_list="${san_list:+$san_list,}$entry"
done

mkdir -p "$CERT_DIR"
umask 077
openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$DAYS" \
  -keyout "$CERT_DIR/ca.key" -out "$CERT_DIR/ca.crt" \
  -subj "/CN=flwr-isoloco throw-away CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null
openssl req -newkey rsa:2048 -nodes -sha256 \
  -keyout "$CERT_DIR/server.key" -out "$CERT_DIR/server.csr" \
  -subj "/CN=${SANS[0]}" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$san_list" > "$CERT_DIR/server.ext"
openssl x509 -req -sha256 -days "$DAYS" -in "$CERT_DIR/server.csr" \
  -CA "$CERT_DIR/ca.crt" -CAkey "$CERT_DIR/ca.key" -CAcreateserial \
  -extfile "$CERT_DIR/server.ext" -out "$CERT_DIR/server.pem" 2>/dev/null
rm -f "$CERT_DIR/server.csr" "$CERT_DIR/server.ext" "$CERT_DIR/ca.srl"
chmod 644 "$CERT_DIR/ca.crt" "$CERT_DIR/server.pem"
openssl verify -CAfile "$CERT_DIR/ca.crt" "$CERT_DIR/server.pem" >/dev/null
echo "certificates in $CERT_DIR (SAN: $san_list)"
