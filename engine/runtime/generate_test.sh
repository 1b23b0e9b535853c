#!/bin/bash
# generate on the tiny checkpoint: --json output has the keys of the schema
# shared with //tools:generate_client (tests/generate_client_test holds the two
# to the same key set) and at most --max_tokens ids (EOS is improbable but
# allowed to stop early); the same seed gives the same ids; hyphenated flags
# (--max-tokens 6) mean the same as absl's (--max_tokens=6); the streaming mode
# prints the speeds on stderr.
set -euo pipefail
BIN=engine/runtime/generate
MODEL=engine/model/tiny_checkpoint
out1=$($BIN --model $MODEL --prompt "Hello there" --raw --json --max_tokens 6 --temperature 0.8 --seed 3 --log_level warning)
out2=$($BIN --model $MODEL --prompt "Hello there" --raw --json --max-tokens 6 --temperature 0.8 --seed=3 --log-level=warning)
ids() { sed -E 's/.*"token_ids":(\[[^]]*\]).*/\1/' <<<"$1"; }
ids1=$(ids "$out1")
ids2=$(ids "$out2")
[[ "$ids1" == "$ids2" && "$ids1" == \[* ]] || { echo "same seed (hyphenated flags), different ids: $out1 vs $out2"; exit 1; }
for key in request_id token_ids text finish_reason prompt_tokens completion_tokens seed \
           ttft_s total_s prefill_tokens_per_s decode_tokens_per_s; do
  grep -q "\"$key\"" <<<"$out1" || { echo "missing $key in $out1"; exit 1; }
done
grep -q '"request_id":null' <<<"$out1" || { echo "local request_id should be null: $out1"; exit 1; }
grep -Eq '"finish_reason":"(stop|length)"' <<<"$out1" || { echo "finish_reason: $out1"; exit 1; }
grep -q '"seed":3' <<<"$out1" || { echo "seed: $out1"; exit 1; }
n=$(sed -E 's/.*"completion_tokens":([0-9]+).*/\1/' <<<"$out1")
(( n >= 1 && n <= 6 )) || { echo "completion_tokens $n"; exit 1; }
p=$(sed -E 's/.*"prompt_tokens":([0-9]+).*/\1/' <<<"$out1")
(( p == 2 )) || { echo "raw 'Hello there' should be 2 tokens, got $p"; exit 1; }
# A hyphenated flag's value is never rewritten, even when it looks like a flag.
dash=$($BIN --model $MODEL --prompt --max-tokens --raw --json --max-tokens 1 --log_level warning)
grep -q '"completion_tokens":1' <<<"$dash" || { echo "prompt '--max-tokens': $dash"; exit 1; }
# Chat format: one user message plus the generation prompt is longer than raw.
chat=$($BIN --model $MODEL --prompt "Hello there" --json --max_tokens 2 --log_level warning)
pc=$(sed -E 's/.*"prompt_tokens":([0-9]+).*/\1/' <<<"$chat")
(( pc > p + 5 )) || { echo "chat prompt has $pc tokens"; exit 1; }
# The usage text documents the schema and the hyphenated spelling.
help=$($BIN --help 2>&1 || true)
grep -q 'token_ids' <<<"$help" && grep -q -- '--max-tokens' <<<"$help" || { echo "help: $help"; exit 1; }
# Streaming mode reports speeds on stderr.
$BIN --model $MODEL --prompt "Hi" --raw --max_tokens 3 --log_level warning 2>"$TEST_TMPDIR/err.txt" >/dev/null
grep -q "tokens/s" "$TEST_TMPDIR/err.txt" || { echo "no speed line"; exit 1; }
# Sized from a memory budget: the sizing is reported; a prompt longer than the
# cache holds is refused with INVALID_ARGUMENT; a bad budget names the text.
$BIN --model $MODEL --prompt "Hi" --raw --max_tokens 2 --kv-cache-memory 8MiB --log_level warning 2>"$TEST_TMPDIR/err2.txt" >/dev/null
grep -q "kv cache: .* KDA slots" "$TEST_TMPDIR/err2.txt" || { echo "no sizing line: $(cat $TEST_TMPDIR/err2.txt)"; exit 1; }
if $BIN --model $MODEL --prompt "Hello there" --raw --max_tokens 2 --kv_cache_memory 8MiB --max_model_len 2 --log_level warning 2>"$TEST_TMPDIR/err3.txt" >/dev/null; then
  echo "a prompt longer than --max_model_len ran"; exit 1
fi
grep -q "INVALID_ARGUMENT" "$TEST_TMPDIR/err3.txt" || { echo "long prompt: $(cat $TEST_TMPDIR/err3.txt)"; exit 1; }
if $BIN --model $MODEL --prompt "Hi" --raw --kv_cache_memory 8parsecs --log_level warning 2>"$TEST_TMPDIR/err4.txt" >/dev/null; then
  echo "a bad --kv_cache_memory was taken"; exit 1
fi
grep -q '"8parsecs"' "$TEST_TMPDIR/err4.txt" || { echo "bad budget: $(cat $TEST_TMPDIR/err4.txt)"; exit 1; }
echo PASS
