#!/usr/bin/env bash
# gpu_bench on the emulator: it runs every section, says the figures are emulated,
# and ends with one JSON line naming the backend, with the yardsticks measured.
set -euo pipefail
BIN="${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-tandem}/kernels/cuda/gpu_bench"
[[ -x "$BIN" ]] || BIN="kernels/cuda/gpu_bench"
out="$(mktemp)"
rc=0
"$BIN" --backend cuda_sim >"$out" 2>&1 || rc=$?
cat "$out"
fail() { echo "FAIL: $*" >&2; exit 1; }
(( rc == 0 )) || fail "gpu_bench --backend cuda_sim exited $rc"
grep -q "EMULATED" "$out" || fail "the emulated run does not say so"
last="$(tail -n 1 "$out")"
[[ "$last" == '{"bench":"gpu_kernels"'* ]] || fail "the last line is not the JSON line: $last"
for key in '"backend":"cuda_sim"' '"emulated":true' '"copy_gbs":' '"gemm_64_tflops":' \
           '"targets":{' '"vision_attention_tflops":' '"mla_dec_ctx200_b2_bw_frac":' \
           '"mla_verify_ctx200_b1_q4_bw_frac":'; do
  [[ "$last" == *"$key"* ]] || fail "JSON line lacks $key"
done
if command -v python3 >/dev/null; then
  python3 -c 'import json,sys; json.loads(sys.argv[1])' "$last" || fail "JSON line does not parse"
fi
# A bad backend name is refused with a message (exit 2), not run.
rc=0
"$BIN" --backend cpu >"$out" 2>&1 || rc=$?
(( rc == 2 )) || fail "--backend cpu should be refused (exit 2), got $rc"
echo "PASS"
