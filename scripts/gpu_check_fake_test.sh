#!/usr/bin/env bash
# gpu_check.sh end to end on a fake GPU machine, so that the script's own logic
# (steps in order, budget, gtest and sanitizer parsing, the benchmarks' JSON
# lines, the cluster test's runfiles, the JSON it writes) is checked here, not
# first on a lent GPU's 15 minutes:
#   - a fake nvidia-smi that lists one H200, a fake compute-sanitizer that runs
#     the binary and reports no errors;
#   - a bundle with the real env.sh (scripts/gpu_bundle_env.sh), the real `run`
#     wrapper (as scripts/gpu_bundle.sh writes it), the real tests.tsv layout,
#     and stubs for every binary the check runs (gtest-like summaries, one JSON
#     line for each benchmark, a mid checkpoint's config.json), which record
#     how they were called.
# Checked: exit 0 and "pass" with every step passing; each step the check is
# meant to run ran, with the arguments it is meant to (the cluster test on
# cuda with its three processes in the runfiles, engine_bench with and without
# --enforce_eager, kv_device_bench's auto, host and two-process runs, memcheck
# and racecheck); the JSON parses and carries the benchmarks' lines. Then a
# failing test: exit 1, "fail", the test named in the step's failed_tests.
set -euo pipefail
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-tandem}"
[[ -d "$RUNFILES/scripts" ]] || RUNFILES="$PWD"
fail() { echo "FAIL: $*" >&2; exit 1; }
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
export TMPDIR="$TMP"
B="$TMP/bundle"
mkdir -p "$B/bin" "$B/lib" "$B/runfiles/third_party/kimi_k3_tokenizer" "$TMP/fake"
cp "$RUNFILES/scripts/gpu_check.sh" "$B/gpu_check.sh"
cp "$RUNFILES/scripts/gpu_bundle_env.sh" "$B/env.sh"
# The wrapper exactly as the packing writes it.
sed -n "/^  cat >\"\$OUT_DIR\/run\" <<'RUN'$/,/^RUN$/p" "$RUNFILES/scripts/gpu_bundle.sh" |
  sed '1d;$d' >"$B/run"
grep -q 'exec "$bin" "$@"' "$B/run" || fail "could not take the run wrapper from gpu_bundle.sh"
chmod +x "$B/run" "$B/gpu_check.sh"
cat >"$B/manifest.env" <<MANIFEST
BUNDLE_GLIBC=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
BUNDLE_GIT_REV=fake
BUNDLE_DATE=fake
BUNDLE_TARGET_LIBS=""
MANIFEST
printf '%s\t%s\t%s\t%s\n' \
  conformance_test conformance '*/cuda:DeviceBackend*' '*Mla*/cuda' \
  gpu_engine_test engine_test '*/cuda' - \
  cuda_graph_test gpu_test - - \
  cluster_cuda_sim_test cluster_test - - >"$B/tests.tsv"

CALLS="$TMP/calls.log"
cat >"$TMP/fake/stub" <<'STUB'
#!/usr/bin/env bash
# A bundle binary: says what it was asked, answers as the real one would.
name="$(basename "$0")"
echo "$name $*" >>"$FAKE_CALLS"
gtest() {  # a passing run of $1 tests, or a failing one when FAKE_FAIL names us
  if [[ "${FAKE_FAIL:-}" == "$name" ]]; then
    echo "[ RUN      ] Suite.Broken/cuda"
    echo "[  FAILED  ] Suite.Broken/cuda (3 ms)"
    echo "[==========] $1 tests from 1 test suite ran. (9 ms total)"
    echo "[  PASSED  ] $(($1 - 1)) tests."
    echo "[  FAILED  ] 1 test, listed below:"
    echo "[  FAILED  ] Suite.Broken/cuda"
    exit 1
  fi
  echo "[==========] $1 tests from 1 test suite ran. (9 ms total)"
  echo "[  PASSED  ] $1 tests."
}
case "$name" in
  cluster_cuda_sim_test)
    [[ "${TANDEM_CLUSTER_BACKEND:-}" == cuda ]] || { echo "backend ${TANDEM_CLUSTER_BACKEND:-unset}"; exit 1; }
    for m in router prefill decode; do
      [[ -x "$m/${m}_main" ]] || { echo "no $m/${m}_main in $PWD"; exit 1; }
    done
    echo "KV buffer: auto (device to device between the processes (IPC))"
    gtest 3 ;;
  *_test) gtest 4 ;;
  gpu_bench) echo "{\"bench\":\"gpu_kernels\",\"backend\":\"$2\",\"copy_gbs\":4000}" ;;
  engine_bench)
    if [[ "$*" == *--helpfull* ]]; then echo "    --enforce_eager (graphs off)"; exit 0; fi
    echo "{\"bench\":\"engine\",\"eager\":$([[ "$*" == *--enforce_eager* ]] && echo true || echo false)}" ;;
  make_checkpoint)
    out=""; prev=""
    for a in "$@"; do [[ "$prev" == --out ]] && out="$a"; prev="$a"; done
    mkdir -p "$out" && echo '{}' >"$out/config.json" ;;
  vision_bench) echo "{\"bench\":\"vision\",\"backend\":\"$2\",\"towers\":[]}" ;;
  kv_device_bench)
    two=false; [[ "$*" == *--two_processes* ]] && two=true
    echo "kv_device: fake"
    echo "{\"bench\":\"kv_device\",\"two_processes\":$two,\"exact\":true}" ;;
  *) ;;
esac
STUB
chmod +x "$TMP/fake/stub"
for b in conformance_test gpu_engine_test cuda_graph_test cluster_cuda_sim_test gpu_bench \
  engine_bench make_checkpoint kv_device_bench vision_bench router_main prefill_main decode_main; do
  ln -s "$TMP/fake/stub" "$B/bin/$b"
done
cat >"$TMP/fake/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
case "${1:-}" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-fake00000000)" ;;
  --query-gpu=*) echo "name, driver_version, memory.total [MiB]"; echo "NVIDIA H200, 580.00, 143771 MiB" ;;
  *) echo "fake nvidia-smi" ;;
esac
SMI
cat >"$TMP/fake/compute-sanitizer" <<'SAN'
#!/usr/bin/env bash
# Runs the binary (the first absolute path among the arguments) with the rest.
echo "compute-sanitizer $*" >>"$FAKE_CALLS"
while [[ $# -gt 0 && "$1" != /* ]]; do shift; done
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
SAN
chmod +x "$TMP/fake/nvidia-smi" "$TMP/fake/compute-sanitizer"

check() {  # out dir, FAKE_FAIL -> the exit code
  local rc=0
  FAKE_CALLS="$CALLS" FAKE_FAIL="$2" GPU_CHECK_NVIDIA_SMI="$TMP/fake/nvidia-smi" \
    COMPUTE_SANITIZER="$TMP/fake/compute-sanitizer" GPU_BUNDLE="$B" \
    "$B/gpu_check.sh" "$1" 2>"$1.stderr" || rc=$?
  return $rc
}

# 1. Everything passes.
: >"$CALLS"
rc=0
check "$TMP/out" "" || rc=$?
cat "$TMP/out/gpu_check.log"
(( rc == 0 )) || fail "the check exited $rc on a passing bundle"
python3 - "$TMP/out/gpu_check.json" <<'PY' || fail "gpu_check.json is not what a passing run writes"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["status"] == "pass", j["status"]
steps = {s["name"]: s for s in j["steps"]}
want = ["make_checkpoint", "conformance_test", "gpu_engine_test", "cuda_graph_test",
        "cluster_cuda_sim_test", "gpu_bench", "gpu_bench_bf16", "engine_tiny",
        "engine_tiny_eager", "make_checkpoint_mid", "engine_mid", "engine_mid_prefill_32k",
        "kv_device_auto", "kv_device_host", "kv_device_ipc", "vision_bench",
        "memcheck_conformance_test", "racecheck_conformance_test",
        "memcheck_gpu_engine_test", "memcheck_cuda_graph_test"]
missing = [w for w in want if w not in steps]
assert not missing, ("steps not run", missing)
bad = {n: s["status"] for n, s in steps.items() if s["status"] != "pass"}
assert not bad, ("steps not passing", bad)
assert steps["conformance_test"]["tests_ran"] == 4
assert steps["cluster_cuda_sim_test"]["tests_passed"] == 3
assert steps["memcheck_conformance_test"]["sanitizer_errors"] == 0
assert "memcheck_cluster_cuda_sim_test" not in steps  # plain only
assert j["bench"]["backend"] == "cuda" and j["bench_bf16"]["backend"] == "cuda_bf16"
assert j["engine"]["engine_tiny"]["eager"] is False
assert j["engine"]["engine_tiny_eager"]["eager"] is True
assert set(j["engine"]) == {"engine_tiny", "engine_tiny_eager", "engine_mid",
                            "engine_mid_prefill_32k"}, j["engine"]
kv = j["kv_device"]
assert set(kv) == {"auto", "host", "ipc"}, kv
assert kv["ipc"]["two_processes"] is True and kv["host"]["two_processes"] is False
assert j["facts"]["gpu"].startswith("GPU 0: NVIDIA H200"), j["facts"]["gpu"]
assert j["vision"]["bench"] == "vision" and j["vision"]["backend"] == "cuda", j["vision"]
PY
grep -q -- "^conformance_test --gtest_filter=\*/cuda:DeviceBackend\*$" "$CALLS" ||
  fail "conformance_test not run with its filter"
grep -q -- "^vision_bench --backend cuda --towers tiny,mid --min_seconds 0.5$" "$CALLS" ||
  fail "vision_bench not run on cuda"
grep -q -- "^kv_device_bench --backend cuda --kv_buffer host --two_processes$" "$CALLS" ||
  fail "kv_device_bench's two-process run not as documented"
grep -q -- "^kv_device_bench --backend cuda --kv_buffer auto$" "$CALLS" ||
  fail "kv_device_bench's auto run not as documented"
grep -q -- "--tool racecheck.*--gtest_filter=\*Mla\*/cuda" "$CALLS" ||
  fail "racecheck did not get tests.tsv's racecheck filter"

# 2. A failing test: the check fails, naming it.
rc=0
check "$TMP/out_fail" gpu_engine_test || rc=$?
(( rc == 1 )) || fail "a failing test gave exit $rc, not 1"
python3 - "$TMP/out_fail/gpu_check.json" <<'PY' || fail "gpu_check.json does not report the failure"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["status"] == "fail", j["status"]
s = {s["name"]: s for s in j["steps"]}["gpu_engine_test"]
assert s["status"] == "fail" and s["tests_failed"] == 1, s
assert "Suite.Broken/cuda" in s["failed_tests"], s
PY
echo PASS
