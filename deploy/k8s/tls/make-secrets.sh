#!/usr/bin/env bash
# The Secrets the mtls component (deploy/k8s/components/mtls) mounts, from a
# throw-away CA made by tools/tls_pki.sh (7 days: for a trial; in production let
# cert-manager issue them, see deploy/README.md "TLS"):
#   tandem-router-tls, tandem-worker-tls, tandem-gateway-tls   (kubernetes.io/tls
#   with tls.crt, tls.key and ca.crt).
#
# usage: deploy/k8s/tls/make-secrets.sh [--namespace NS] [--dir DIR] [--dry-run]
#   --dir     where the PKI is kept (default .cache/k8s-tls); reused when present
#   --dry-run print the Secrets as YAML instead of applying them
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
ns=tandem dir="$root/.cache/k8s-tls" dry=0
while (($#)); do
  case "$1" in
    --namespace) ns=$2; shift 2 ;;
    --namespace=*) ns=${1#*=}; shift ;;
    --dir) dir=$2; shift 2 ;;
    --dir=*) dir=${1#*=}; shift ;;
    --dry-run) dry=1; shift ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "make-secrets: unknown option $1" >&2; exit 2 ;;
  esac
done
command -v kubectl >/dev/null || { echo "make-secrets: kubectl is needed" >&2; exit 1; }
# Service names in the certificates too (the router is dialled by its Service).
names=(tandem-router tandem-worker tandem-gateway)
"$root/tools/tls_pki.sh" "$dir" "${names[@]}"
out=()
((dry)) && out=(--dry-run=client -o yaml)
for n in "${names[@]}"; do
  kubectl create secret generic "$n-tls" --namespace "$ns" --type=kubernetes.io/tls \
    --from-file=tls.crt="$dir/$n.crt" --from-file=tls.key="$dir/$n.key" \
    --from-file=ca.crt="$dir/ca.crt" "${out[@]}"
  ((dry)) && echo "---"
done
exit 0
