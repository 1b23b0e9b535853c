#!/bin/bash
# ./tandem up's process and port plan (--dry-run: nothing is built or started):
# the default layout is unchanged, no two ports coincide for any prefill/decode
# counts (with 11 prefill workers prefill-10 used to get decode-0's port),
# underscored and --opt=V spellings equal the hyphenated ones, and colliding or
# out-of-range choices are refused before anything starts. Then each process's
# command line: every option, pass-through and --config setting reaches the
# process it names, the command line overrides the file, bad values are refused.
set -euo pipefail
export TANDEM_CACHE_DIR="$TEST_TMPDIR/cache"
TANDEM=./tandem
fail() { echo "FAIL: $*" >&2; exit 1; }
# --dry-run's plan lines (NAME PORT METRICS_PORT), and its command lines.
dry() { "$TANDEM" up --dry-run --no-setup "$@"; }
plan() { local out; out="$(dry "$@")" || return; grep -v '^command ' <<<"$out"; }

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
refused "takes no value" --kv-tcp=1
refused "unknown option --bogus" --bogus

# ---- command lines
# The flags of process NAME (one a line) in the dry run of the given options.
flags() {  # name args...
  local name="$1" out
  shift
  out="$(dry "$@")" || fail "dry run refused: $*"
  awk -v n="$name" '$1 == "command" && $2 == n {for (i = 4; i <= NF; i++) print $i}' <<<"$out"
}
has() {  # name flag args...: NAME's command line has FLAG (exactly, once)
  local name="$1" flag="$2" got
  shift 2
  got="$(flags "$name" "$@")"
  (( $(grep -cxF -- "$flag" <<<"$got") == 1 )) ||
    fail "$name: expected $flag once with: $*"$'\n'"$got"
}
lacks() {  # name pattern args...: no flag of NAME matches the grep pattern
  local name="$1" pattern="$2" got
  shift 2
  got="$(flags "$name" "$@")"
  ! grep -q -- "$pattern" <<<"$got" || fail "$name: unexpected $pattern with: $*"$'\n'"$got"
}

# One command line per process, after the plan; the default ones name the tiny model
# (not generated by --dry-run) and every port of the plan.
out="$(dry)"
(( $(grep -c '^command ' <<<"$out") == 4 )) || fail "command lines:"$'\n'"$out"
tiny="$TANDEM_CACHE_DIR/models/tiny-seed0"
has router "--model=$tiny"
has router --port=50051
has router --metrics_port=9100
has decode-0 --port=50071
has decode-0 --metrics_port=9111
has decode-0 --router=127.0.0.1:50051
has gateway --port=8000
[[ "$(awk '$2 == "prefill-0" {print $3}' <<<"$out")" == */prefill/prefill_main ]] ||
  fail "prefill binary: $out"
lacks decode-0 '^--speculative' # the decode worker's own default
# The workers share 0.1 of the available memory for their caches, evenly; a
# --kv_cache_memory of a role replaces its share.
has prefill-0 --kv_cache_memory=0.05
has decode-0 --kv_cache_memory=0.05
has decode-3 --kv_cache_memory=0.02 --decode 4
has decode-0 --kv_cache_memory=8GiB --decode-arg=--kv_cache_memory=8GiB
has prefill-0 --kv_cache_memory=0.05 --decode-arg=--kv_cache_memory=8GiB
lacks router kv_cache_memory
lacks decode-0 '^--backend'
[[ -z "$(ls -A "$TANDEM_CACHE_DIR" 2>/dev/null)" ]] || fail "--dry-run wrote $TANDEM_CACHE_DIR"

# Speculative decoding reaches the decode workers only, in every spelling.
for args in "--speculative ngram --num-speculative-tokens 5" \
            "--speculative=ngram --num_speculative_tokens=5" \
            "--decode-arg=--speculative=ngram --decode-arg --num_speculative_tokens=5"; do
  # shellcheck disable=SC2086
  {
    has decode-0 --speculative=ngram $args --decode 2
    has decode-1 --num_speculative_tokens=5 $args --decode 2
    lacks prefill-0 speculative $args
    lacks router speculative $args
  }
done
mkdir -p "$TEST_TMPDIR/draft" && echo '{}' >"$TEST_TMPDIR/draft/config.json"
has decode-0 --draft_model="$TEST_TMPDIR/draft" --speculative draft --draft-model "$TEST_TMPDIR/draft"
# draft on the tiny model: its tiny draft checkpoint (generated on first real start).
has decode-0 --draft_model="$TANDEM_CACHE_DIR/models/tiny-draft-seed1" --speculative draft
[[ -z "$(ls -A "$TANDEM_CACHE_DIR" 2>/dev/null)" ]] || fail "--dry-run generated a draft"

# The kernel backend reaches every worker, not the router or gateway.
has prefill-0 --backend=cpu_reference --backend cpu_reference
has decode-0 --backend=cpu_reference --backend=cpu_reference
lacks router backend --backend cpu_reference
lacks gateway backend --backend cpu_reference
# Workers on the GPU share it: 0.9 of its memory split among them; the emulator's
# devices are each process's own (its default); host backends share host memory.
has prefill-0 --gpu_memory_utilization=0.45 --backend cuda
has decode-1 --gpu_memory_utilization=0.3 --backend cuda --decode 2
lacks decode-0 kv_cache_memory --backend cuda
lacks decode-0 gpu_memory_utilization --backend cuda_sim
lacks decode-0 kv_cache_memory --backend cuda_sim
has decode-0 --gpu_memory_utilization=0.2 --backend cuda --decode-arg=--gpu_memory_utilization=0.2
# The GPU backends too (cuda_sim: the emulator, nothing to build with nvcc).
has prefill-0 --backend=cuda_sim --backend cuda_sim
has decode-0 --backend=cuda_sim_bf16 --backend=cuda_sim_bf16
# Options that existed: to their process.
has router --colocate_below_tokens=8 --colocate-below 8
has prefill-0 --tp=2 --tp 2
# The KV moves over shared memory by default (peer-failure detection off in every
# worker, issue 19); --kv-tcp (--no-ucx-shm, up.kv_tcp) keeps UCX's detection on
# (tcp on one host); the later of --kv-tcp / --ucx-shm / a pass-through wins.
has prefill-0 --ucx_peer_failure_detection=false
has decode-0 --ucx_peer_failure_detection=false
has decode-1 --ucx_peer_failure_detection=false --decode 2
lacks router ucx_peer_failure_detection
lacks gateway ucx_peer_failure_detection
has decode-0 --ucx_peer_failure_detection=false --ucx-shm
has prefill-0 --ucx_peer_failure_detection=false --ucx-shm
has prefill-0 --ucx_peer_failure_detection=true --kv-tcp
has decode-1 --ucx_peer_failure_detection=true --kv_tcp --decode 2
has decode-0 --ucx_peer_failure_detection=true --no-ucx-shm
has prefill-0 --ucx_peer_failure_detection=false --kv-tcp --ucx-shm
has decode-0 --ucx_peer_failure_detection=true --ucx-shm --kv-tcp
has prefill-0 --ucx_peer_failure_detection=true --prefill-arg=--ucx_peer_failure_detection=true
has decode-0 --ucx_peer_failure_detection=false --prefill-arg=--ucx_peer_failure_detection=true
printf 'up:\n  kv_tcp: true\n' >"$TEST_TMPDIR/kv_tcp.yaml"
has decode-0 --ucx_peer_failure_detection=true --config "$TEST_TMPDIR/kv_tcp.yaml"
has decode-0 --ucx_peer_failure_detection=false --config "$TEST_TMPDIR/kv_tcp.yaml" --ucx-shm
# The KV transfer agent and its progress timeout reach both workers (not the
# router or gateway); bad values are refused before anything starts.
lacks prefill-0 kv_transport
lacks decode-0 kv_progress_timeout
has prefill-0 --kv_transport=libfabric:shm --kv-transport libfabric:shm
has decode-1 --kv_transport=libfabric --kv_transport=libfabric --decode 2
has decode-0 --kv_transport=libfabric:tcp:2 --kv-transport=libfabric:tcp:2
lacks router kv_transport --kv-transport libfabric
lacks gateway kv_transport --kv-transport libfabric
has prefill-0 --kv_progress_timeout=3s --kv-progress-timeout 3s
has decode-0 --kv_progress_timeout=inf --kv_progress_timeout=inf
printf 'up:\n  kv_transport: libfabric:shm\n  kv_progress_timeout: 500ms\n' >"$TEST_TMPDIR/kv.yaml"
has decode-0 --kv_transport=libfabric:shm --config "$TEST_TMPDIR/kv.yaml"
has prefill-0 --kv_progress_timeout=500ms --config "$TEST_TMPDIR/kv.yaml"
has prefill-0 --kv_transport=ucx --config "$TEST_TMPDIR/kv.yaml" --kv-transport ucx
refused "--kv-transport must be" --kv-transport rdma
refused "--kv-transport must be" --kv-transport libfabric:
refused "--kv-progress-timeout must be" --kv-progress-timeout soon
refused "--kv-progress-timeout must be" --kv-progress-timeout 0s
has decode-0 --kv_progress_timeout=1m30s --kv-progress-timeout 1m30s
has prefill-0 --kv_transport=libfabric:efa:auto --kv-transport libfabric:efa:auto
refused "--kv-transport must be" --kv-transport libfabric:tcp:0
# Pass-through values the workers would refuse are refused here too.
has decode-0 --kv_transport=libfabric:shm --decode-arg=--kv_transport=libfabric:shm
refused "--kv-transport must be" --prefill-arg=--kv_transport=rdma
refused "--kv-progress-timeout must be" --decode-arg=--kv-progress-timeout=never
# Prefix caching: the workers' default (on) unless --no-prefix-cache (also up.no_prefix_cache).
lacks prefill-0 enable_prefix_caching
lacks decode-0 enable_prefix_caching
has prefill-0 --enable_prefix_caching=false --no-prefix-cache
has decode-1 --enable_prefix_caching=false --no_prefix_cache --decode 2
lacks router enable_prefix_caching --no-prefix-cache
printf 'up:\n  no_prefix_cache: true\n' >"$TEST_TMPDIR/no_prefix_cache.yaml"
has decode-0 --enable_prefix_caching=false --config "$TEST_TMPDIR/no_prefix_cache.yaml"
has gateway --served_model_name=m_1 --served_model_name=m_1
has gateway --api_key=k --api-key k
has gateway --stream_interval=4 --stream-interval 4

# Pass-through: one flag each, to the process named, repeatable, dashes as underscores.
a=(--router-arg=--max_in_flight=7 --prefill-arg --kv_stream_layers=false
   --decode-arg=--max-lease-s=5 --decode_arg=--unlanded_quarantine_s=2
   --gateway-arg=--io_threads=3 --decode-arg=--some_bool)
has router --max_in_flight=7 "${a[@]}"
has prefill-0 --kv_stream_layers=false "${a[@]}"
has decode-0 --max_lease_s=5 "${a[@]}"
has decode-0 --unlanded_quarantine_s=2 "${a[@]}"
has decode-0 --some_bool "${a[@]}"
has gateway --io_threads=3 "${a[@]}"
lacks router io_threads "${a[@]}"
lacks decode-0 max_in_flight "${a[@]}"
# The later setting of a flag wins, in place.
has decode-0 --max_lease_s=9 --decode-arg=--max_lease_s=5 --decode-arg=--max_lease_s=9
has decode-0 --speculative=none --speculative ngram --decode-arg=--speculative=none

# ---- --config FILE.yaml
cfg="$TEST_TMPDIR/cluster.yaml"
cat >"$cfg" <<'YAML'
# a deployment's settings
up:
  prefill: 2
  decode: 2
  router_port: 7000
  ucx_shm: true
  backend: cpu_reference
router: {max_in_flight: 64, kv_checksums: false}
prefill:
  kv_stream_layers: no
decode: {speculative: ngram, num_speculative_tokens: 4, max-lease-s: 20}
gateway:
  served_model_name: from-file
YAML
got="$(plan --config "$cfg")"
grep -qx 'router 7000 9100' <<<"$got" || fail "config up.router_port:"$'\n'"$got"
grep -qx 'prefill-1 50062 9111' <<<"$got" || fail "config up.prefill:"$'\n'"$got"
grep -qx 'decode-1 50072 9113' <<<"$got" || fail "config up.decode:"$'\n'"$got"
has router --max_in_flight=64 --config "$cfg"
has router --kv_checksums=false --config "$cfg"
has prefill-1 --kv_stream_layers=false --config "$cfg"
has prefill-1 --backend=cpu_reference --config "$cfg"
has prefill-1 --ucx_peer_failure_detection=false --config "$cfg"
has decode-1 --speculative=ngram --config "$cfg"
has decode-1 --num_speculative_tokens=4 --config "$cfg"
has decode-1 --max_lease_s=20 --config "$cfg"
has decode-1 --router=127.0.0.1:7000 --config "$cfg"
has gateway --served_model_name=from-file --config "$cfg"
lacks router speculative --config "$cfg"
# The command line overrides the file, wherever --config stands.
got="$(plan --decode 1 --config="$cfg" --router-port 7500)"
grep -qx 'router 7500 9100' <<<"$got" || fail "override router port:"$'\n'"$got"
! grep -q '^decode-1' <<<"$got" || fail "override --decode:"$'\n'"$got"
has decode-0 --speculative=none --config "$cfg" --speculative none
has decode-0 --num_speculative_tokens=2 --config "$cfg" --num-speculative-tokens 2
has decode-0 --max_lease_s=3 --config "$cfg" --decode-arg=--max_lease_s=3
has prefill-0 --backend=cpu --config "$cfg" --backend cpu
has router --max_in_flight=1 --config "$cfg" --router-arg=--max_in_flight=1
has gateway --served_model_name=cli --config "$cfg" --served-model-name cli
# Empty file, empty sections: the defaults.
: >"$TEST_TMPDIR/empty.yaml"
[[ "$(plan --config "$TEST_TMPDIR/empty.yaml")" == "$want" ]] || fail "empty config"
printf 'up:\nrouter:\n' >"$TEST_TMPDIR/sections.yaml"
[[ "$(plan --config "$TEST_TMPDIR/sections.yaml")" == "$want" ]] || fail "empty sections"

# ---- refused, with the reason (and the file's line for the config file)
refused "--speculative must be none, ngram or draft, got 'foo'" --speculative foo
refused "--speculative must be" --decode-arg=--speculative=eagle
refused "--num-speculative-tokens must be a number in 1..16, got '0'" --num-speculative-tokens 0
refused "in 1..16, got '17'" --num_speculative_tokens=17
refused "in 1..16, got 'x'" --decode-arg=--num_speculative_tokens=x
refused "--draft-model needs --speculative draft" --draft-model "$TEST_TMPDIR/draft"
refused "--draft-model needs --speculative draft" --speculative ngram --draft-model "$TEST_TMPDIR/draft"
refused "no config.json in $TEST_TMPDIR/nodir" --speculative draft --draft-model "$TEST_TMPDIR/nodir"
refused "needs --draft-model DIR" --speculative draft --model "$TEST_TMPDIR/draft"
refused "--backend must be one of: cpu cpu_bf16 cpu_reference cuda cuda_bf16 cuda_sim cuda_sim_bf16 (got 'gpu')" --backend gpu
refused "--backend must be one of" --prefill-arg=--backend=tpu
refused "takes one flag, --name or --name=value, got 'max_lease_s=5'" --decode-arg max_lease_s=5
refused "takes one flag" --router-arg=-x
refused "needs a value" --gateway-arg
refused "--port is set by ./tandem up itself" --decode-arg=--port=1
refused "--model is set by ./tandem up itself" --router-arg=--model=/x
refused "--tp is set by ./tandem up itself" --prefill-arg=--tp=2
refused "--router is set by ./tandem up itself" --gateway-arg=--router=h:1
refused "--colocate-below must be a number" --colocate-below x
refused "--config: no such file" --config "$TEST_TMPDIR/missing.yaml"
refused "--config may appear once" --config "$cfg" --config "$cfg"
bad() {  # fragment yaml: the config file is refused with FILE:LINE: fragment
  local fragment="$1" f="$TEST_TMPDIR/bad.yaml"
  printf '%s\n' "$2" >"$f"
  refused "$f:$fragment" --config "$f"
}
bad "3: unknown section 'workers' (known: up, router, prefill, decode, gateway)" \
  $'up:\n  prefill: 1\nworkers:\n  n: 2'
bad "3: malformed YAML" $'up:\n  prefill: 1\n decode: 2'
bad "2: malformed YAML" $'decode: {speculative: ngram\nrouter: {}'
bad "1: expected sections" '- up'
bad "2: decode.x: the value must be a single scalar" $'decode:\n  x: [1, 2]'
bad "2: no value" $'decode:\n  x:'
bad "3: --speculative must be none, ngram or draft, got 'foo'" $'up: {}\ndecode:\n  speculative: foo'
bad "2: --num-speculative-tokens must be a number in 1..16" $'up:\n  num_speculative_tokens: 0'
bad "2: unknown option --nonsense=1" $'up:\n  nonsense: 1'
bad "2: decode.port: --port is set by ./tandem up itself" $'decode:\n  port: 1'
bad "2: up.no_gateway must be true or false" $'up:\n  no_gateway: 3'

# --tls (or up: {tls: true}): every process gets the throw-away CA and its own
# certificate; without it none does; --dry-run makes no certificates.
tlsdir="$TANDEM_CACHE_DIR/run/tls"
for args in "--tls" "--config $TEST_TMPDIR/tls.yaml"; do
  printf 'up: {tls: true}\n' >"$TEST_TMPDIR/tls.yaml"
  # shellcheck disable=SC2086
  got="$(dry $args --decode 2 | grep '^command ')"
  for name in router prefill-0 decode-0 decode-1 gateway; do
    grep -q "^command $name .* --tls_ca=$tlsdir/ca.crt --tls_cert=$tlsdir/$name.crt --tls_key=$tlsdir/$name.key" \
      <<<"$got" || fail "$args: $name has no TLS flags:"$'\n'"$got"
  done
  grep -q "^command gateway .* --ssl_certfile=$tlsdir/gateway.crt --ssl_keyfile=$tlsdir/gateway.key" \
    <<<"$got" || fail "$args: the gateway does not serve HTTPS:"$'\n'"$got"
done
[[ ! -e "$tlsdir" ]] || fail "--dry-run --tls made certificates"
if dry | grep -q -- '--tls_'; then fail "TLS flags without --tls"; fi
refused "--tls takes no value" --tls=1

# A port something already listens on (an earlier ./tandem up) is refused before
# anything is built or started, naming it.
portfile="$TEST_TMPDIR/listener.port"
python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(4)
open(sys.argv[1], "w").write(str(s.getsockname()[1])); time.sleep(60)' "$portfile" &
listener=$!
trap 'kill $listener 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do [[ -s "$portfile" ]] && break; sleep 0.1; done
busy="$(cat "$portfile")"
set +e
out="$("$TANDEM" up --no-setup --router-port "$busy" 2>&1)"
rc=$?
set -e
(( rc != 0 )) || fail "a busy router port was accepted"
grep -q "port $busy (router's port) is in use" <<<"$out" || fail "busy port: $out"
[[ ! -d "$TANDEM_CACHE_DIR/logs" ]] || fail "a busy port started something"
echo PASS
