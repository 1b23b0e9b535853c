#!/usr/bin/env bash
# A throw-away PKI for mTLS on one machine (./tandem up --tls, the TLS cluster
# test): a CA in DIR/ca.{crt,key} (made once) and, for each NAME,
# DIR/NAME.{crt,key} signed by it: EC P-256, valid 7 days, subjectAltName
# localhost, 127.0.0.1 and NAME, usable as server and client certificate.
# Keys are mode 600 in a mode-700 DIR. Nothing here is fit for production.
#
# usage: tools/tls_pki.sh DIR NAME...
set -euo pipefail
if (($# < 2)); then
  echo "usage: $0 DIR NAME..." >&2
  exit 2
fi
dir=$1
shift
mkdir -p "$dir"
chmod 700 "$dir"
log=$dir/openssl.log
umask 077
run() {
  if ! "$@" >>"$log" 2>&1; then
    echo "tls_pki: failed: $* (see $log)" >&2
    exit 1
  fi
}
if [[ ! -s $dir/ca.crt || ! -s $dir/ca.key ]]; then
  run openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days 7 \
    -subj "/CN=tandem throw-away CA $(date -u +%Y%m%dT%H%M%S)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign"
fi
for name in "$@"; do
  run openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/$name.key" -out "$dir/$name.csr" -subj "/CN=$name"
  printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:$name" \
    "extendedKeyUsage=serverAuth,clientAuth" \
    "keyUsage=critical,digitalSignature,keyEncipherment" >"$dir/$name.ext"
  run openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 7 -out "$dir/$name.crt" -extfile "$dir/$name.ext"
  rm -f "$dir/$name.csr" "$dir/$name.ext"
done
