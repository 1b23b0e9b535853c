#!/usr/bin/env bash
# ./tandem project's binary: the labelled table and the JSON line, a measured
# efficiency read from engine_bench's line or a GPU check's results.json (and
# refused from a CPU run or without --measured_on), bad flags refused clearly.
set -uo pipefail
BIN="engine/runtime/projection_main"
T="${TEST_TMPDIR:-$(mktemp -d)}"
fails=0
check() {  # description, command...
  local what="$1"; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fails=$((fails + 1)); fi
}
json_of() { grep '^{' "$1" | tail -n 1; }
py() { python3 -c "$1" "${@:2}"; }

# Defaults: K3 on 8 B300s, labelled a projection, the roofline.
"$BIN" >"$T/default.out" 2>&1; rc=$?
check "default run exits 0" test "$rc" -eq 0
check "labelled a projection" grep -q '^PROJECTION, not a measurement: kimi_k3' "$T/default.out"
check "JSON line: projection, b300, TP 8, the full context held" py '
import json,sys
d=json.loads(sys.argv[1])
assert d["projection"] is True and d["hardware"]=="b300" and d["tp"]==8, d
assert d["cache"]["max_model_len"]==1048576, d["cache"]
assert all(r["efficiency"]==1.0 for r in d["decode"])
assert len(d["decode"])==16 and len(d["handoff"])==4
' "$(json_of "$T/default.out")"

# A measurement on an H200: engine_bench'"'"'s line (copy 4300 GB/s of 4800).
cat >"$T/engine.json" <<'JSON'
{"bench":"engine","backend":"cuda","model":"mid","copy_bandwidth_gb_per_s":4300.0,"results":[{"batch":1,"decode_bandwidth_efficiency":0.5},{"batch":64,"decode_bandwidth_efficiency":0.8}]}
JSON
"$BIN" --measured "$T/engine.json" --measured_on h200 --batches 1,32 --contexts 4096 >"$T/measured.out" 2>&1
check "measured: efficiency = copy share x the nearest batch's" py '
import json,sys
d=json.loads(sys.argv[1])
share=4300/4800
e=[r["efficiency"] for r in d["decode"]]
assert abs(e[0]-share*0.5)<1e-9 and abs(e[1]-share*0.8)<1e-9, e
assert d["efficiency_source"].startswith("measured on h200"), d["efficiency_source"]
' "$(json_of "$T/measured.out")"

# The same from a GPU check's results.json (engine.engine_mid).
py '
import json,sys
line=json.load(open(sys.argv[1]))
json.dump({"check":"tandem_gpu_check","engine":{"engine_tiny":{"results":[]},"engine_mid":line}},open(sys.argv[2],"w"))
' "$T/engine.json" "$T/results.json"
"$BIN" --measured "$T/results.json" --measured_on H200 --batches 1 --contexts 4096 >"$T/check.out" 2>&1
check "a GPU check's results.json: engine_mid is read" py '
import json,sys
d=json.loads(sys.argv[1])
assert abs(d["decode"][0]["efficiency"]-4300/4800*0.5)<1e-9, d["decode"][0]
' "$(json_of "$T/check.out")"

# Refusals, each with its reason and exit 1.
refused() {  # pattern, args...
  local pattern="$1"; shift
  "$BIN" "$@" >"$T/refused.out" 2>&1
  local rc=$?
  [[ $rc -eq 1 ]] && grep -q -- "$pattern" "$T/refused.out"
}
sed 's/"backend":"cuda"/"backend":"cpu"/' "$T/engine.json" >"$T/cpu.json"
check "a CPU measurement is refused" refused 'a projection to a GPU takes a GPU' --measured "$T/cpu.json" --measured_on h200
check "--measured needs --measured_on" refused 'needs --measured_on' --measured "$T/engine.json"
check "an unknown GPU is refused" refused 'unknown hardware "a100"; known: b300, h200, h100' --hardware a100
check "a TP size the model does not divide" refused 'tensor-parallel size 5' --tp 5
check "a bad list" refused '"x" is not a positive integer' --batches 1,x
check "K3 does not fit 8 H200s" refused 'kimi_k3 at TP 8 on h200' --hardware h200
printf 'not json\n' >"$T/bad.json"
check "a file without JSON" refused 'holds no JSON object' --measured "$T/bad.json" --measured_on h200

(( fails == 0 )) || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed"
