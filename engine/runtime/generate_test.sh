#!/bin/bash
# generate on the tiny checkpoint: --json output has the promised fields and
# exactly --max_tokens ids (greedy, EOS is improbable but allowed to stop early:
# then the count is <= max_tokens); the same seed gives the same ids; the
# streaming mode prints the speeds on stderr.
set -euo pipefail
BIN=engine/runtime/generate
MODEL=engine/model/tiny_checkpoint
out1=$($BIN --model $MODEL --prompt "Hello there" --raw --json --max_tokens 6 --temperature 0.8 --seed 3 --log_level warning)
out2=$($BIN --model $MODEL --prompt "Hello there" --raw --json --max_tokens 6 --temperature 0.8 --seed 3 --log_level warning)
ids1=$(sed -E 's/.*"ids":(\[[^]]*\]).*/\1/' <<<"$out1")
ids2=$(sed -E 's/.*"ids":(\[[^]]*\]).*/\1/' <<<"$out2")
[[ "$ids1" == "$ids2" && "$ids1" == \[* ]] || { echo "same seed, different ids: $out1 vs $out2"; exit 1; }
for key in ids text prompt_tokens completion_tokens prefill_tokens_per_s decode_tokens_per_s; do
  grep -q "\"$key\"" <<<"$out1" || { echo "missing $key in $out1"; exit 1; }
done
n=$(sed -E 's/.*"completion_tokens":([0-9]+).*/\1/' <<<"$out1")
(( n >= 1 && n <= 6 )) || { echo "completion_tokens $n"; exit 1; }
p=$(sed -E 's/.*"prompt_tokens":([0-9]+).*/\1/' <<<"$out1")
(( p == 2 )) || { echo "raw 'Hello there' should be 2 tokens, got $p"; exit 1; }
# Chat format: one user message plus the generation prompt is longer than raw.
chat=$($BIN --model $MODEL --prompt "Hello there" --json --max_tokens 2 --log_level warning)
pc=$(sed -E 's/.*"prompt_tokens":([0-9]+).*/\1/' <<<"$chat")
(( pc > p + 5 )) || { echo "chat prompt has $pc tokens"; exit 1; }
# Streaming mode reports speeds on stderr.
$BIN --model $MODEL --prompt "Hi" --raw --max_tokens 3 --log_level warning 2>"$TEST_TMPDIR/err.txt" >/dev/null
grep -q "tokens/s" "$TEST_TMPDIR/err.txt" || { echo "no speed line"; exit 1; }
echo PASS
