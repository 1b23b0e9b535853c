#!/usr/bin/env bash
# Runs a libFuzzer binary for a bounded time over a writable copy of its seed corpus.
# usage: run_fuzzer.sh FUZZER SECONDS [SEED_FILE...]
set -euo pipefail
fuzzer="$1"; seconds="$2"; shift 2
work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
mkdir -p "$work"
for seed in "$@"; do cp "$seed" "$work/"; done
artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-$work}/"
exec "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$artifacts" "$work"
