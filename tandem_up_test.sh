#!/bin/bash
# ./tandem up's process and port plan (--dry-run: nothing is built or started):
# the default layout is unchanged, no two ports coincide for any prefill/decode
# counts (with 11 prefill workers prefill-10 used to get decode-0's port),
# underscored and --opt=V spellings equal the hyphenated ones, and colliding or
# out-of-range choices are refused before anything starts.
set -euo pipefail
export TANDEM_CACHE_DIR="$TEST_TMPDIR/cache"
TANDEM=./tandem
fail() { echo "FAIL: $*" >&2; exit 1; }
plan() { "$TANDEM" up --dry-run --no-setup "$@"; }

# The default cluster, exactly as before.
want=$'router 50051 9100\nprefill-0 50061 9110\ndecode-0 50071 9111\ngateway 8000 -'
got="$(plan)"
[[ "$got" == "$want" ]] || fail "default plan:"$'\n'"$got"
[[ -z "$(ls -A "$TANDEM_CACHE_DIR" 2>/dev/null)" ]] || fail "--dry-run wrote $TANDEM_CACHE_DIR"

# Up to 10 prefill workers: decode ports are base + 10 + i, as they always were.
got="$(plan --prefill 10 --decode 2 | grep '^decode-')"
[[ "$got" == $'decode-0 50071 9120\ndecode-1 50072 9121' ]] || fail "10 prefill: $got"

# The reported defect: prefill-10 and decode-0 must not share 50071.
got="$(plan --prefill 11 --decode 1)"
grep -qx 'prefill-10 50071 9120' <<<"$got" || fail "11 prefill:"$'\n'"$got"
grep -qx 'decode-0 50072 9121' <<<"$got" || fail "11 prefill:"$'\n'"$got"

# Any counts: one line per process, prefill-i on base + i, decode after every
# prefill port, and every port (gRPC/HTTP and metrics, all processes) distinct.
for p in 0 1 2 9 10 11 12 19 20 21 33; do
  for d in 1 2 3 10 11 17; do
    got="$(plan --prefill "$p" --decode "$d")"
    (( $(wc -l <<<"$got") == p + d + 2 )) || fail "$p/$d: line count"$'\n'"$got"
    dups="$(awk '{print $2; if ($3 != "-") print $3}' <<<"$got" | sort | uniq -d)"
    [[ -z "$dups" ]] || fail "$p prefill, $d decode: ports used twice: $dups"$'\n'"$got"
    if (( p > 0 )); then
      last=$(( 50061 + p - 1 ))
      grep -qx "prefill-$((p - 1)) $last [0-9]*" <<<"$got" || fail "$p/$d: last prefill"
      first_decode="$(awk '$1 == "decode-0" {print $2}' <<<"$got")"
      (( first_decode > last )) || fail "$p/$d: decode-0 on $first_decode, not past $last"
    fi
  done
done

# Spellings: --opt V, --opt=V, --opt_name V and --opt_name=V are the same.
a="$(plan --prefill 2 --decode 3 --router-port 7000 --metrics-port 7100 --gateway-port 7200 \
  --worker-port-base 6000 --worker-metrics-port-base 7300 --tp 2 --colocate-below 8)"
b="$(plan --prefill=2 --decode=3 --router_port=7000 --metrics_port 7100 --gateway_port=7200 \
  --worker_port_base 6000 --worker_metrics_port_base=7300 --tp=2 --colocate_below 8)"
[[ "$a" == "$b" ]] || fail "spellings differ:"$'\n'"$a"$'\n'"vs"$'\n'"$b"
grep -qx 'decode-2 6012 7304' <<<"$a" || fail "chosen bases: $a"
[[ "$(plan --no_gateway | tail -1)" == "decode-0 50071 9111" ]] || fail "--no_gateway"
plan --ucx_shm --served_model_name=m_1 --api-key k --stream_interval 4 >/dev/null ||
  fail "gateway and UCX options"

# Refused before anything starts, with the reason.
refused() {  # fragment args...
  local fragment="$1" out
  shift
  if out="$(plan "$@" 2>&1)"; then fail "accepted: $*"; fi
  grep -q -- "$fragment" <<<"$out" || fail "$*: expected '$fragment' in: $out"
}
refused "ports collide" --worker-metrics-port-base 50061
refused "ports collide" --gateway-port 50051
refused "ports collide" --worker-metrics-port-base 9100
refused "ports collide" --worker-port-base 50000 --prefill 60
refused "> 65535" --worker-port-base 65530 --prefill 3
refused "1..65535" --router-port 0
refused "--decode >= 1" --decode 0
refused "--tp must be >= 1" --tp 0
refused "needs a value" --prefill
refused "takes no value" --no-gateway=1
refused "unknown option --bogus" --bogus
echo PASS
