#!/bin/bash
# tandem-allinone (the HyperPod InferenceEndpointConfig's one server per pod) on
# the tiny checkpoint with the Bazel-built binaries: it serves a chat completion
# through its gateway (the router colocates the prefill on the decode worker), and
# on SIGTERM stops all three processes and exits.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v curl >/dev/null || fail "curl is not installed (./tandem setup)"
bin="$TEST_TMPDIR/bin"
mkdir -p "$bin"
for b in router/router_main decode/decode_main gateway/gateway_main; do
  ln -sf "$PWD/$b" "$bin/"
done
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
gw="$(free_port)" rp="$(free_port)" rm_="$(free_port)" wp="$(free_port)" wm="$(free_port)"
log="$TEST_TMPDIR/allinone.log"
TANDEM_BIN_DIR="$bin" bash tools/image/tandem-allinone.sh --model="$PWD/engine/model/tiny_checkpoint" \
  --port="$gw" --router-port="$rp" --router-metrics-port="$rm_" --worker-port="$wp" \
  --worker-metrics-port="$wm" --worker-arg=--kv_cache_memory=256MiB \
  --worker-arg=--max_num_seqs=4 >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
body='{"model":"kimi-k3","messages":[{"role":"user","content":"Hello"}],"max_tokens":4}'
out=""
for _ in $(seq 1 600); do
  if out="$(curl -sf -m 30 "http://127.0.0.1:$gw/v1/chat/completions" \
    -H 'content-type: application/json' -d "$body" 2>/dev/null)"; then
    break
  fi
  out=""
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.2
done
if [[ -z "$out" ]]; then
  tail -n 40 "$log" >&2
  fail "tandem-allinone did not answer a chat completion"
fi
python3 - "$out" <<'PY' || fail "unexpected completion: $out"
import json, sys
r = json.loads(sys.argv[1])
assert r["object"] == "chat.completion", r
assert r["usage"]["completion_tokens"] > 0, r
PY
# The router placed it on the colocated path (no prefill worker exists).
metrics="$(curl -sf "http://127.0.0.1:$rm_/metrics")"
grep -E '^tandem_router_paths_total\{[^}]*path="colocated"[^}]*\} [1-9]' <<<"$metrics" >/dev/null ||
  fail "the router did not count a colocated request: $(grep path= <<<"$metrics" | head -5)"
# All three stop on SIGTERM.
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
trap - EXIT
(( rc == 143 )) || fail "tandem-allinone exited $rc on SIGTERM (want 143)"
for p in "$gw" "$rp" "$wp"; do
  if curl -s -m 2 "http://127.0.0.1:$p/" >/dev/null 2>&1; then fail "port $p still answers after SIGTERM"; fi
done
echo "PASS: $out"
