#!/bin/bash
# One flag spelling everywhere (issue 16, item 5): every binary a `./tandem`
# subcommand runs takes a flag's hyphenated name (`--max-tokens 8`) as its
# underscored one (common/init.cc and bench/benchmark_main.cc rewrite known
# names; values are never rewritten). Each binary is run with a hyphenated
# form of one of its own flags and arguments that make it exit quickly; the
# check is that the flag was taken (its value shows in the output) and never
# "Unknown command line flag". `generate` and `generate --router` are
# engine/runtime:generate and tools:generate_client (generate_client_test);
# kernels_bench has no flags (only the positional `gemm`).
set -euo pipefail
T="$TEST_TMPDIR"
TOK=third_party/kimi_k3_tokenizer
fail() { echo "FAIL: $*" >&2; exit 1; }

# expect PATTERN CMD...: CMD's stdout+stderr (any exit status, 60 s at most)
# matches the extended regex PATTERN and names no unknown flag.
expect() {
  local want="$1"; shift
  local out
  out="$(timeout 60 "$@" </dev/null 2>&1)" || true
  if grep -q 'Unknown command line flag\|unrecognized command-line flag' <<<"$out"; then
    fail "$* refused a flag:"$'\n'"$out"
  fi
  grep -Eq -- "$want" <<<"$out" || fail "$*: no /$want/ in:"$'\n'"$out"
}

# The check can fail: a name the binary does not define stays unknown.
out="$(engine/tokenizer/tokenize --no-such-flag=1 2>&1)" && fail "--no-such-flag accepted"
grep -q "Unknown command line flag 'no-such-flag'" <<<"$out" || fail "no-such-flag: $out"

# ./tandem make-checkpoint: a real tiny checkpoint. Run from $T, where the
# default --tokenizer_dir (third_party/...) does not exist: --tokenizer-dir is
# taken, its value (with its hyphen) as given.
mkdir -p "$T/tok-dir" && cp "$TOK"/* "$T/tok-dir/"
(cd "$T" && "$OLDPWD/engine/model/make_checkpoint" --tokenizer-dir "$T/tok-dir" --out=ck \
  --size tiny --seed=0) >"$T/make_checkpoint.log" 2>&1 ||
  fail "make_checkpoint: $(cat "$T/make_checkpoint.log")"
[[ -f "$T/ck/model.safetensors.index.json" && -f "$T/ck/tiktoken.model" ]] ||
  fail "make_checkpoint wrote no checkpoint"

# ./tandem tokenize / detokenize: stdin through, --log-level both ways.
ids="$(echo '{"text":"hello world"}' |
  engine/tokenizer/tokenize --log-level=warning --model "$T/ck")" || fail "tokenize"
want="$(echo '{"text":"hello world"}' |
  engine/tokenizer/tokenize --log_level=warning --model "$T/ck")"
[[ "$ids" == "$want" && "$ids" == *'"ids"'* ]] || fail "tokenize: '$ids' vs '$want'"
text="$(echo "$ids" | engine/tokenizer/detokenize --log-level warning --model="$T/ck")"
[[ "$text" == '{"text":"hello world"}' ]] || fail "detokenize: $text"

# ./tandem bench NAME: quick real runs where a run is quick...
expect '"iterations":1' engine/model/checkpoint_bench --model="$T/ck" --iterations=1 \
  --work-dir="$T/cb"
expect '"latency_floats":4' parallel/allreduce_bench --ranks=2 --floats=7168 \
  --latency-floats=4 --latency-calls=2 --seconds=0.01
expect '^BM_CollectAndSerialize$' metrics/metrics_benchmark --benchmark-list-tests \
  --benchmark-filter=BM_Collect
expect '^BM_Greedy$' engine/sampling/sampler_benchmark --benchmark-list-tests=true \
  --benchmark-filter=BM_Greedy
# ...and elsewhere the flag's value refused by name, which only a known flag is.
bad() { echo "Illegal value 'x' specified for flag '$1'"; }
expect "$(bad target_mb)" engine/tokenizer/tokenizer_bench --target-mb=x
expect "$(bad mla_layers)" kvtransfer/kvtransfer_bench --mla-layers x
expect "$(bad stream_tokens)" gateway/gateway_bench --stream-tokens=x
expect "$(bad prompt_len)" engine/runtime/engine_bench --prompt-len=x
expect "$(bad repetition_penalty)" engine/runtime/speculative_bench --repetition-penalty=x
expect "$(bad num_prompts)" bench/serving_bench --num-prompts=x
expect "$(bad repeats)" prefill/stream_bench --prompt-lens=64 --repeats=x
expect "$(bad decode_steps)" engine/runtime/tp_bench --decode-steps=x
expect "$(bad piece_bytes)" worker/kv_device_bench --piece-bytes=x

# The processes of ./tandem up: a hyphenated flag whose value makes start-up fail
# with its own error (an out-of-range port, a tiny health-check deadline).
expect 'bad port 127.0.0.1:99999' router/router_main --model="$T/ck" --port=0 \
  --metrics-port=99999
expect 'bad port 127.0.0.1:99999' prefill/prefill_main --model="$T/ck" --port=0 \
  --router=127.0.0.1:1 --worker-id=prefill-flags --metrics-port 99999
expect 'bad port 127.0.0.1:99999' decode/decode_main --model="$T/ck" --port=0 \
  --router=127.0.0.1:1 --worker-id=decode-flags --max-lease-s=5 --metrics-port=99999
# --kv-buffer reaches the transfer agent, which refuses a bad mode by name.
expect "kv_buffer must be auto, device or host, got 'bogus'" prefill/prefill_main \
  --model="$T/ck" --port=0 --router=127.0.0.1:1 --worker-id=prefill-kvb --kv-buffer=bogus
# The gateway's only port is --port: --log-process names its error line (the
# value keeps its hyphen).
expect ' gateway-flags gateway_main.cc:[0-9]+\] cannot listen .*bad port 127.0.0.1:99999' \
  gateway/gateway_main --model="$T/ck" --io-threads=1 --log-process=gateway-flags --port=99999
expect 'not SERVING within 0.2s' tools/health_check --address=127.0.0.1:1 --timeout-s=0.2

# --help shows the hyphenated spelling (and no underscored flag name): BIN FLAG
# lists FLAG (one of BIN's own, hyphenated) and no --name_with_underscores.
help_shows() {
  local bin="$1" flag="$2" out
  out="$(timeout 60 "$bin" --help 2>&1 </dev/null)" || true
  grep -q -- "--$flag\b" <<<"$out" || fail "$bin --help does not show --$flag:"$'\n'"$out"
  # (The header line names the underscored spelling on purpose.)
  local named
  named="$(grep -v '^Flags (' <<<"$out" | grep -Eo -- '--(\[no-\])?[a-z0-9]+_[a-z0-9_]+' || true)"
  [[ -z "$named" ]] || fail "$bin --help shows underscored names: $(head -3 <<<"$named")"
}
help_shows decode/decode_main kv-cache-memory
help_shows decode/decode_main max-num-seqs
help_shows prefill/prefill_main max-model-len
help_shows router/router_main max-queued-requests
help_shows gateway/gateway_main io-threads
help_shows engine/tokenizer/tokenize log-level
help_shows tools/health_check timeout-s
help_shows bench/serving_bench num-prompts
out="$(decode/decode_main --help 2>&1)" || true
grep -q -- '--\[no-\]ucx-peer-failure-detection' <<<"$out" || fail "booleans: $out"

echo PASS
