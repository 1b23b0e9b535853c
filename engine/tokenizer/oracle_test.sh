#!/bin/bash
# The C++ tokenizer (//engine/tokenizer:tokenize) and the independent Node
# oracle (tools/node/tiktoken_oracle.mjs) must give identical ids, line by line,
# on the corpus plus generated lines with runs longer than 25,000 characters.
set -euo pipefail

if ! command -v node >/dev/null 2>&1; then
  echo "FAIL: node (v20+) is not installed; run ./tandem setup" >&2
  exit 1
fi

MODEL=third_party/kimi_k3_tokenizer
TOKENIZE=engine/tokenizer/tokenize
ORACLE=tools/node/tiktoken_oracle.mjs
CORPUS=tests/data/tokenizer/corpus.jsonl
WORK="${TEST_TMPDIR:-$(mktemp -d)}"

# Generated lines: long ones cross the 25,000-character run limit with letters,
# spaces, newlines, mixed whitespace and a varied non-whitespace run
# (punctuation, digits, Han, emoji); short seeded random mixtures follow.
node -e '
const lines = [
  "a".repeat(30000),
  " ".repeat(30000) + "x",
  "x" + "\n".repeat(26000) + "y",
  " \t".repeat(15000) + "end",
  "Hello,World!123中文😀".repeat(3500),
  "word ".repeat(2000) + "Z".repeat(25001) + " tail",
];
// Seeded random mixtures over code points that exercise every pat_str branch.
const alphabet = Array.from("aBsStTrReEvmlLdD\u017F\u0027  \t\n\r\u000B\u000C\u0085\u00A0\u3000" +
  "\u2028\u001C\u200B\uFEFF12\u0663\u2162\u00BD!.-\"\u0301\u20DD\u093F\u2E80\u3005" +
  "\u3007中文あア\u02B0\u01C5\u03A9\u03C9\u0416\u0436한😀\u200D🇺\uFE0F\u{16FF0}");
let seed = 12345;
const rand = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
for (let i = 0; i < 1500; i++) {
  let t = "";
  const len = 1 + rand(40);
  for (let k = 0; k < len; k++) t += alphabet[rand(alphabet.length)];
  lines.push(t);
}
for (const t of lines) console.log(JSON.stringify({text: t}));
' > "$WORK/long.jsonl"
cat "$CORPUS" "$WORK/long.jsonl" > "$WORK/input.jsonl"
LINES=$(wc -l < "$WORK/input.jsonl")

"$TOKENIZE" --model "$MODEL" < "$WORK/input.jsonl" > "$WORK/cpp.jsonl"
node "$ORACLE" --model "$MODEL" < "$WORK/input.jsonl" > "$WORK/node.jsonl"

if [[ $(wc -l < "$WORK/cpp.jsonl") -ne $LINES || $(wc -l < "$WORK/node.jsonl") -ne $LINES ]]; then
  echo "FAIL: expected $LINES output lines" >&2
  exit 1
fi
if grep -q '"error"' "$WORK/cpp.jsonl" "$WORK/node.jsonl"; then
  echo "FAIL: an encoder reported an error" >&2
  exit 1
fi
if ! cmp -s "$WORK/cpp.jsonl" "$WORK/node.jsonl"; then
  # Name the first differing line and its text.
  line=$(paste -d '\n' "$WORK/cpp.jsonl" "$WORK/node.jsonl" |
         awk 'NR % 2 == 1 { a = $0; next } a != $0 { print NR / 2; exit }' || true)
  echo "FAIL: ids differ first at input line $line" >&2
  echo "text: $(sed -n "${line}p" "$WORK/input.jsonl" | cut -c1-300)" >&2
  echo "c++ : $(sed -n "${line}p" "$WORK/cpp.jsonl" | cut -c1-300)" >&2
  echo "node: $(sed -n "${line}p" "$WORK/node.jsonl" | cut -c1-300)" >&2
  exit 1
fi
echo "PASS: $LINES lines identical ($(grep -o ',' "$WORK/cpp.jsonl" | wc -l) ids)"
