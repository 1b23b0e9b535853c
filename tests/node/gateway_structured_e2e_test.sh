#!/bin/bash
# Runs tests/node/gateway_structured_e2e.mjs: structured outputs through
# cluster (router_main + prefill_main + decode_main, tiny checkpoint), driven by
# the official openai npm client from tools/node.
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
  echo "FAIL: node (v20+) is not installed; run ./tandem setup" >&2
  exit 1
fi
# The script is a symlink into the source tree; node_modules sits beside the
# pinned package.json there (git-ignored, installed by ./tandem setup).
SCRIPT="$(realpath tests/node/gateway_structured_e2e.mjs)"
ROOT="$(dirname "$(dirname "$(dirname "$SCRIPT")")")"
export TANDEM_NODE_MODULES="$ROOT/tools/node/node_modules"
if [[ ! -d "$TANDEM_NODE_MODULES/openai" ]]; then
  echo "FAIL: $TANDEM_NODE_MODULES/openai is missing; run ./tandem setup" >&2
  exit 1
fi
export ROUTER_BIN="$PWD/router/router_main"
export PREFILL_BIN="$PWD/prefill/prefill_main"
export DECODE_BIN="$PWD/decode/decode_main"
export GATEWAY_BIN="$PWD/gateway/gateway_main"
export MODEL_DIR="$PWD/engine/model/tiny_checkpoint"
export CORPUS="$PWD/engine/grammar/testdata/schema_corpus.jsonl"
exec node "$SCRIPT"
