#!/usr/bin/env bash
# gpu_check.sh [OUT_DIR]: the GPU check of issue #14, run on a lent GPU machine
# inside a bundle made by ./tandem gpu-bundle (docs/gpu_check.md).
#
# OUT_DIR defaults to $OUT (the device tool's result folder), else ./gpu_check_out.
# Writes OUT_DIR/gpu_check.log (everything) and OUT_DIR/gpu_check.json (one object:
# the machine, every step's pass/fail, timings, test counts, sanitizer error counts
# and the benchmark's JSON line).
#
# Steps, in this order so that the results that matter most come first, each under
# `timeout` and within one overall budget (GPU_CHECK_BUDGET_S, default 330 s: the
# check must finish in under 8 minutes on one H200, and a rerun must fit in the
# same 15 minutes of device time):
#   1. facts: nvidia-smi (GPU, driver, memory, clocks), glibc, CUDA tools; no
#      usable GPU: says so, writes the JSON and exits 3 at once
#   2. set-up: the bundle's libraries (env.sh), every binary's ldd resolved, the
#      tiny checkpoint generated (make_checkpoint, seed 0)
#   3. the conformance suite on "cuda" (gtest filter from tests.tsv), then every
#      other bundled GPU test (TANDEM_TEST_BACKEND=cuda), plain; the cluster test
#      (router + prefill + decode worker processes on "cuda", their tokens
#      against a CPU decode worker's; TANDEM_CLUSTER_BACKEND=cuda, the KV in
#      place where the bundle's UCX has CUDA support, else host-staged)
#   4. the kernel benchmark (gpu_bench --backend cuda, then cuda_bf16)
#   4b. the engine from GPU memory (engine_bench --backend cuda, issue #15): the
#      tiny checkpoint at batch 1/8/64 (CUDA graphs on, then --enforce_eager when
#      the binary has it), then the mid checkpoint (generated there: too big to
#      carry) at batch 1/8/64 with 4k prompts, and a 32k prefill
#   4c. (run before 4b, being short) the KV hand-off between device buffers (kv_device_bench --backend cuda,
#      --kv_buffer auto then host, then device to device into a second
#      process's memory: --two_processes, CUDA IPC) against the device's own
#      copy
#   5. compute-sanitizer where present: memcheck over the same tests, racecheck
#      over the shared-memory kernels' tests (tests.tsv's racecheck filter), in
#      the time left (a step that does not fit is recorded as skipped)
# Exit: 0 all passed, 1 a step failed, 3 no GPU, 4 the bundle is broken.
set -uo pipefail

SELF_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Inside a bundle gpu_check.sh sits next to run/env.sh; from the repository
# (scripts/), the bundle is ../gpu_bundle unless GPU_BUNDLE says otherwise.
if [[ -n "${GPU_BUNDLE:-}" ]]; then
  BUNDLE="$(cd "$GPU_BUNDLE" && pwd)"
elif [[ -f "$SELF_DIR/env.sh" && -d "$SELF_DIR/bin" ]]; then
  BUNDLE="$SELF_DIR"
else
  BUNDLE="$(cd "$SELF_DIR/.." && pwd)/gpu_bundle"
fi
OUT_DIR="${1:-${OUT:-$PWD/gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
JSON="$OUT_DIR/gpu_check.json"
BUDGET_S="${GPU_CHECK_BUDGET_S:-330}"
NVIDIA_SMI="${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}"
START=$SECONDS
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
: >"$LOG"

log() { echo "$*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

json_str() {  # a JSON string literal of $1
  local s="$1"
  s="${s//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\n'/\\n}"
  s="${s//$'\t'/\\t}"
  s="${s//$'\r'/}"
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\010\013\014\016-\037')"
}

FACTS=()    # JSON members
STEPS=()    # JSON objects
BENCH_JSON="null"
BENCH_BF16_JSON="null"
ENGINE_JSON=()  # "name":{engine_bench JSON line}
KV_DEVICE_JSON=()  # "auto"|"host"|"ipc":{kv_device_bench JSON line}
VISION_JSON="null"  # vision_bench's JSON line
FAILED=0

write_json() {  # status, message
  local status="$1" message="$2" i
  {
    printf '{"check":"tandem_gpu_check","status":%s,"message":%s' "$(json_str "$status")" "$(json_str "$message")"
    printf ',"seconds":%d,"budget_s":%d' $((SECONDS - START)) "$BUDGET_S"
    printf ',"bundle":%s' "$(json_str "$BUNDLE")"
    printf ',"facts":{'
    for i in "${!FACTS[@]}"; do printf '%s%s' "$([[ $i -gt 0 ]] && echo ,)" "${FACTS[$i]}"; done
    printf '},"steps":['
    for i in "${!STEPS[@]}"; do printf '%s%s' "$([[ $i -gt 0 ]] && echo ,)" "${STEPS[$i]}"; done
    printf '],"bench":%s,"bench_bf16":%s,"engine":{' "$BENCH_JSON" "$BENCH_BF16_JSON"
    for i in "${!ENGINE_JSON[@]}"; do printf '%s%s' "$([[ $i -gt 0 ]] && echo ,)" "${ENGINE_JSON[$i]}"; done
    printf '},"kv_device":{'
    for i in "${!KV_DEVICE_JSON[@]}"; do printf '%s%s' "$([[ $i -gt 0 ]] && echo ,)" "${KV_DEVICE_JSON[$i]}"; done
    printf '},"vision":%s}\n' "$VISION_JSON"
  } >"$JSON"
}

fact() { FACTS+=("$(json_str "$1"):$(json_str "$2")"); }

finish() {  # exit code, status, message
  write_json "$2" "$3"
  log "gpu_check: $2: $3 ($((SECONDS - START))s; $JSON)"
  rm -rf "$WORK"
  exit "$1"
}

# ---------------------------------------------------------------- 1. facts
log "gpu_check: bundle $BUNDLE, results in $OUT_DIR, budget ${BUDGET_S}s, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
fact host "$(uname -n) $(uname -r) $(uname -m)"
fact glibc "$(ldd --version 2>/dev/null | head -n 1)"
if [[ -f "$BUNDLE/manifest.env" ]]; then
  fact bundle_manifest "$(tr '\n' ' ' <"$BUNDLE/manifest.env")"
fi
gpu_list="$(timeout 20 "$NVIDIA_SMI" -L 2>&1)"
smi_rc=$?
if (( smi_rc != 0 )) || ! grep -q '^GPU ' <<<"$gpu_list"; then
  log "gpu_check: no usable NVIDIA GPU on this machine ($NVIDIA_SMI -L: exit $smi_rc${gpu_list:+: $(head -n 1 <<<"$gpu_list")})."
  log "gpu_check: this check runs on a lent GPU machine (docs/gpu_check.md); nothing was run."
  fact gpu "none"
  finish 3 no_gpu "no usable NVIDIA GPU (nvidia-smi -L failed or listed none); nothing was run"
fi
log "$gpu_list"
fact gpu "$(head -n 1 <<<"$gpu_list")"
smi_q="$(timeout 20 "$NVIDIA_SMI" --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu,compute_cap --format=csv 2>&1)"
log "$smi_q"
fact nvidia_smi "$(tail -n 1 <<<"$smi_q")"
timeout 20 "$NVIDIA_SMI" >>"$LOG" 2>&1
SANITIZER=""
for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
  /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [[ -n "$c" && -x "$c" ]] && { SANITIZER="$c"; break; }
done
fact compute_sanitizer "${SANITIZER:-absent}"
[[ -n "$SANITIZER" ]] && fact compute_sanitizer_version "$("$SANITIZER" --version 2>&1 | tail -n 1)"
fact nvcc "$( (command -v nvcc >/dev/null && nvcc --version | tail -n 1) || ( [[ -x /usr/local/cuda/bin/nvcc ]] && /usr/local/cuda/bin/nvcc --version | tail -n 1) || echo absent)"

# ---------------------------------------------------------------- 2. set-up
[[ -f "$BUNDLE/env.sh" && -x "$BUNDLE/run" && -d "$BUNDLE/bin" ]] ||
  finish 4 bundle_broken "no bundle at $BUNDLE (make one with ./tandem gpu-bundle; set GPU_BUNDLE)"
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
log "libraries: $GPU_BUNDLE_LD_PATH"
log "${GPU_BUNDLE_NOTES%$'\n'}"
fact ld_path "$GPU_BUNDLE_LD_PATH"
fact loader "${GPU_BUNDLE_LOADER:-system}"
[[ -z "$GPU_BUNDLE_MISSING" ]] || log "gpu_check: WARNING: target libraries not found: $GPU_BUNDLE_MISSING"
fact missing_target_libs "$GPU_BUNDLE_MISSING"

# A binary of the bundle: bin/NAME, or its compressed copy unpacked by env.sh
# (GPU_BUNDLE_XBIN); empty when neither is there.
bin_path() {
  local b
  for b in "$BUNDLE/bin/$1" "${GPU_BUNDLE_XBIN:-/nonexistent}/$1"; do
    [[ -f "$b" && -x "$b" ]] && { echo "$b"; return 0; }
  done
  return 0
}

declare -A UNRESOLVED=()
for b in "$BUNDLE"/bin/* "${GPU_BUNDLE_XBIN:-/nonexistent}"/*; do
  [[ -f "$b" ]] || continue
  case "$b" in *.xz | *.gz) continue ;; esac
  name="$(basename "$b")"
  if [[ -n "$GPU_BUNDLE_LOADER" ]]; then
    missing="$("$GPU_BUNDLE_LOADER" --library-path "$GPU_BUNDLE_LD_PATH" --list "$b" 2>&1 | grep 'not found' || true)"
  else
    missing="$(LD_LIBRARY_PATH="$GPU_BUNDLE_LD_PATH" ldd "$b" 2>&1 | grep -E 'not found|version .* not found' || true)"
  fi
  if [[ -n "$missing" ]]; then
    UNRESOLVED[$name]="$(tr -s ' \t\n' ' ' <<<"$missing")"
    log "gpu_check: $name: unresolved libraries: ${UNRESOLVED[$name]}"
  fi
done

# A step: name, kind, timeout, then the command. Records status, seconds, gtest
# counts and the sanitizer's error summary; its output goes to the log.
run_step() {
  local step="$1" kind="$2" limit="$3"
  shift 3
  local out="$WORK/$step.out" t0=$SECONDS rc status
  if (( limit < 5 )); then
    log "---- $step: skipped (no time left in the ${BUDGET_S}s budget)"
    STEPS+=("{\"name\":$(json_str "$step"),\"kind\":$(json_str "$kind"),\"status\":\"skipped\",\"reason\":\"budget\"}")
    return 0
  fi
  log "---- $step (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$out" 2>&1
  rc=$?
  cat "$out" >>"$LOG"
  local secs=$((SECONDS - t0))
  case $rc in
    0) status=pass ;;
    124 | 137) status=timeout ;;
    *) status=fail ;;
  esac
  # gtest's summary lines, the sanitizer's error summary.
  local ran passed failed skipped san
  ran="$(grep -oE '^\[==========\] [0-9]+ tests? from .* ran' "$out" | tail -n 1 | grep -oE '[0-9]+' | head -n 1)"
  passed="$(grep -oE '^\[  PASSED  \] [0-9]+' "$out" | tail -n 1 | grep -oE '[0-9]+$')"
  failed="$(grep -oE '^\[  FAILED  \] [0-9]+ tests?, listed below' "$out" | tail -n 1 | grep -oE '[0-9]+' | head -n 1)"
  skipped="$(grep -oE '^\[  SKIPPED \] [0-9]+ tests?, listed below' "$out" | tail -n 1 | grep -oE '[0-9]+' | head -n 1)"
  san="$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$out" | tail -n 1 | grep -oE '[0-9]+')"
  if [[ "$kind" != bench && $status == pass && -n "$ran" && "$ran" == 0 ]]; then
    status=fail
    log "gpu_check: $step ran no tests (filter matched nothing)"
  fi
  [[ $status == pass ]] || FAILED=1
  local failures
  failures="$(grep -E '^\[  FAILED  \] [A-Za-z]' "$out" | grep -vE ' \([0-9]+ ms\)$' |
    sed 's/^\[  FAILED  \] //' | head -n 40 | tr '\n' ';')"
  STEPS+=("{\"name\":$(json_str "$step"),\"kind\":$(json_str "$kind"),\"status\":\"$status\",\"rc\":$rc,\"seconds\":$secs,\"timeout_s\":$limit,\"tests_ran\":${ran:-null},\"tests_passed\":${passed:-null},\"tests_failed\":${failed:-0},\"tests_skipped\":${skipped:-0},\"sanitizer_errors\":${san:-null},\"failed_tests\":$(json_str "$failures"),\"command\":$(json_str "$*")}")
  log "---- $step: $status (exit $rc, ${secs}s${ran:+, $ran tests}${failed:+, $failed failed}${san:+, sanitizer errors $san})"
  LAST_OUT="$out"
}

budget_for() {  # wanted seconds, seconds to keep for later steps
  local l
  l=$(( $(left) - $2 ))
  (( l > $1 )) && l=$1
  (( l < 0 )) && l=0
  echo "$l"
}

# The tiny checkpoint, where the engine tests find it (runfiles root).
export GPU_BUNDLE_RUNFILES="$WORK/runfiles"
mkdir -p "$GPU_BUNDLE_RUNFILES/engine/model"
[[ -d "$BUNDLE/runfiles/third_party" ]] && ln -s "$BUNDLE/runfiles/third_party" "$GPU_BUNDLE_RUNFILES/third_party"
if [[ -n "$(bin_path make_checkpoint)" ]]; then
  run_step make_checkpoint tool "$(budget_for 60 0)" "$BUNDLE/run" make_checkpoint --size tiny \
    --seed 0 --shards 3 --out "$GPU_BUNDLE_RUNFILES/engine/model/tiny_checkpoint" \
    --tokenizer_dir "$GPU_BUNDLE_RUNFILES/third_party/kimi_k3_tokenizer" --log_level warning
fi
export TEST_TMPDIR="$WORK/test_tmp" TANDEM_TEST_BACKEND=cuda
mkdir -p "$TEST_TMPDIR"
# The cluster test starts router/router_main, prefill/prefill_main and
# decode/decode_main from the runfiles root (its cwd, no TEST_SRCDIR); they
# inherit the bundle's library path from `run`.
for m in router prefill decode; do
  for b in "$BUNDLE/bin/${m}_main" "${GPU_BUNDLE_XBIN:-/nonexistent}/${m}_main"; do
    [[ -x "$b" ]] || continue
    mkdir -p "$GPU_BUNDLE_RUNFILES/$m"
    ln -sf "$b" "$GPU_BUNDLE_RUNFILES/$m/${m}_main"
    break
  done
done

# ---------------------------------------------------------------- 3. tests, plain
# tests.tsv: name, kind, gtest filter ('-': none), racecheck filter ('-': none).
TESTS=()
[[ -f "$BUNDLE/tests.tsv" ]] && mapfile -t TESTS <"$BUNDLE/tests.tsv"
[[ ${#TESTS[@]} -gt 0 ]] || log "gpu_check: WARNING: the bundle lists no tests (tests.tsv)"
test_cmd() {  # name filter -> the command words, into CMD
  CMD=("$BUNDLE/run" "$1")
  [[ "$2" != - ]] && CMD+=("--gtest_filter=$2")
  return 0
}
for entry in "${TESTS[@]}"; do
  IFS=$'\t' read -r name kind filter race <<<"$entry"
  if [[ -n "${UNRESOLVED[$name]:-}" ]]; then
    STEPS+=("{\"name\":$(json_str "$name"),\"kind\":$(json_str "$kind"),\"status\":\"fail\",\"reason\":$(json_str "unresolved libraries: ${UNRESOLVED[$name]}")}")
    FAILED=1
    continue
  fi
  # Caps per kind; 90 s kept for the benchmark.
  case "$kind" in
    conformance) want=120 ;; engine_test) want=90 ;; cluster_test) want=120 ;; *) want=60 ;;
  esac
  test_cmd "$name" "$filter"
  if [[ "$kind" == cluster_test ]]; then
    missing=""
    for m in router prefill decode; do
      [[ -x "$GPU_BUNDLE_RUNFILES/$m/${m}_main" ]] || missing+=" ${m}_main"
    done
    if [[ -n "$missing" ]]; then
      STEPS+=("{\"name\":$(json_str "$name"),\"kind\":\"cluster_test\",\"status\":\"fail\",\"reason\":$(json_str "not in the bundle:$missing")}")
      FAILED=1
      continue
    fi
    # The CPU reference at fp32 GEMM inputs, as tests/BUILD runs it.
    CMD=(env TANDEM_CLUSTER_BACKEND=cuda TANDEM_CPU_ISA=avx512 "${CMD[@]}")
  fi
  run_step "$name" "$kind" "$(budget_for $want 90)" "${CMD[@]}"
done

# ---------------------------------------------------------------- 4. benchmark
# The exact backend ("cuda": tokens match the CPU's), then the BF16-activation one
# ("cuda_bf16": the faster kernels), 60 s of the budget kept for the second.
bench_json() {  # output file [bench name] -> the JSON line (a JSON string if it does not parse)
  local line
  line="$(grep -E "^\\{.*\"bench\":\"${2:-gpu_kernels}\"" "$1" | tail -n 1)"
  [[ -n "$line" ]] || { echo null; return; }
  if command -v python3 >/dev/null && ! python3 -c 'import json,sys; json.loads(sys.argv[1])' "$line" 2>/dev/null; then
    json_str "$line"
  else
    echo "$line"
  fi
}
if [[ -n "$(bin_path gpu_bench)" && -z "${UNRESOLVED[gpu_bench]:-}" ]]; then
  LAST_OUT=""
  run_step gpu_bench bench "$(budget_for 120 60)" "$BUNDLE/run" gpu_bench --backend cuda
  [[ -n "$LAST_OUT" ]] && BENCH_JSON="$(bench_json "$LAST_OUT")"
  LAST_OUT=""
  run_step gpu_bench_bf16 bench "$(budget_for 90 0)" "$BUNDLE/run" gpu_bench --backend cuda_bf16
  [[ -n "$LAST_OUT" ]] && BENCH_BF16_JSON="$(bench_json "$LAST_OUT")"
else
  STEPS+=("{\"name\":\"gpu_bench\",\"kind\":\"bench\",\"status\":\"fail\",\"reason\":$(json_str "absent or unresolved: ${UNRESOLVED[gpu_bench]:-not in the bundle}")}")
  FAILED=1
fi

# ---------------------------------------------------------------- 4c. KV hand-off
# (before the engine benchmarks: three short runs, which the engine's long ones
# would otherwise leave no time for; 150 s kept for those)
# The KV between two device buffers as the workers move it (--kv_buffer auto:
# in place where the bundle's UCX has CUDA support, else staged through host
# memory), against the device's own copy in the same run; then forced staging;
# then into a second process's device memory (CUDA IPC, as between a prefill
# and a decode worker of one host).
if [[ -n "$(bin_path kv_device_bench)" && -z "${UNRESOLVED[kv_device_bench]:-}" ]]; then
  for kvb in auto host ipc; do
    LAST_OUT=""
    args=(--backend cuda --kv_buffer "$kvb")
    [[ "$kvb" == ipc ]] && args=(--backend cuda --kv_buffer host --two_processes)
    run_step "kv_device_$kvb" bench "$(budget_for 30 150)" "$BUNDLE/run" kv_device_bench \
      "${args[@]}"
    [[ -n "$LAST_OUT" ]] && KV_DEVICE_JSON+=("$(json_str "$kvb"):$(bench_json "$LAST_OUT" kv_device)")
  done
fi

# ---------------------------------------------------------------- 4d. vision tower
# The vision tower from GPU memory (weights uploaded, each call in device memory):
# latency per image at 448x448, 1024x1024 and 1920x1080 for the tiny and mid towers.
if [[ -n "$(bin_path vision_bench)" && -z "${UNRESOLVED[vision_bench]:-}" ]]; then
  LAST_OUT=""
  run_step vision_bench bench "$(budget_for 45 150)" "$BUNDLE/run" vision_bench \
    --backend cuda --towers tiny,mid --min_seconds 0.5
  [[ -n "$LAST_OUT" ]] && VISION_JSON="$(bench_json "$LAST_OUT" vision)"
fi

# ---------------------------------------------------------------- 4b. engine
# The engine from GPU memory: weights, MLA cache, KDA pool and activations on the
# device, the decode step against the device's own copy bandwidth, the host gap.
engine_step() {  # name, wanted seconds, seconds kept for later, engine_bench args...
  local name="$1" want="$2" keep="$3"
  shift 3
  LAST_OUT=""
  run_step "$name" bench "$(budget_for "$want" "$keep")" "$BUNDLE/run" engine_bench \
    --backend cuda --gemm_yardstick=false "$@"
  if [[ -n "$LAST_OUT" ]]; then
    ENGINE_JSON+=("$(json_str "$name"):$(bench_json "$LAST_OUT" engine)")
  fi
}
if [[ -n "$(bin_path engine_bench)" && -z "${UNRESOLVED[engine_bench]:-}" ]]; then
  engine_step engine_tiny 60 150 --batches 1,8,64 --prompt_len 512 --decode_steps 32
  if "$BUNDLE/run" engine_bench --helpfull 2>&1 | grep -q -- '-enforce_eager'; then
    engine_step engine_tiny_eager 45 120 --batches 1,8,64 --prompt_len 512 \
      --decode_steps 32 --enforce_eager
  fi
  MID="$WORK/mid_checkpoint"
  run_step make_checkpoint_mid tool "$(budget_for 90 90)" "$BUNDLE/run" make_checkpoint \
    --size mid --seed 0 --out "$MID" \
    --tokenizer_dir "$GPU_BUNDLE_RUNFILES/third_party/kimi_k3_tokenizer" --log_level warning
  if [[ -f "$MID/config.json" ]]; then
    engine_step engine_mid 90 45 --model "$MID" --batches 1,8,64 --prompt_len 4096 \
      --decode_steps 16
    engine_step engine_mid_prefill_32k 45 0 --model "$MID" --batches 1 \
      --prompt_len 32768 --chunk 8192 --decode_steps 2 --engine_step=false
  fi
else
  STEPS+=("{\"name\":\"engine_bench\",\"kind\":\"bench\",\"status\":\"fail\",\"reason\":$(json_str "absent or unresolved: ${UNRESOLVED[engine_bench]:-not in the bundle}")}")
  FAILED=1
fi

# ---------------------------------------------------------------- 5. sanitizers
if [[ -z "$SANITIZER" ]]; then
  log "gpu_check: compute-sanitizer not found: memcheck and racecheck skipped"
  STEPS+=("{\"name\":\"compute-sanitizer\",\"kind\":\"sanitizer\",\"status\":\"skipped\",\"reason\":\"compute-sanitizer not found\"}")
else
  SAN_COMMON=(--error-exitcode 99 --print-limit 30 --target-processes all)
  for entry in "${TESTS[@]}"; do
    IFS=$'\t' read -r name kind filter race <<<"$entry"
    [[ -z "${UNRESOLVED[$name]:-}" ]] || continue
    # The cluster test's GPU work is in its child processes (and their start-up
    # under the sanitizer would not fit the budget): plain only.
    [[ "$kind" == cluster_test ]] && continue
    # The sanitizer runs the binary itself, with the bundle's library path.
    test_cmd "$name" "$filter"
    bin=("$(bin_path "$name")")
    [[ -n "$GPU_BUNDLE_LOADER" ]] && bin=("$GPU_BUNDLE_LOADER" --library-path "$GPU_BUNDLE_LD_PATH" "$(bin_path "$name")")
    args=("${CMD[@]:2}")
    san_env=(env -C "$GPU_BUNDLE_RUNFILES" "LD_LIBRARY_PATH=$GPU_BUNDLE_LD_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    run_step "memcheck_$name" memcheck "$(budget_for 120 45)" "${san_env[@]}" "$SANITIZER" \
      --tool memcheck --leak-check no "${SAN_COMMON[@]}" "${bin[@]}" "${args[@]}"
    if [[ "$race" != - ]]; then
      [[ "$race" == '*' ]] && race="$filter"
      test_cmd "$name" "$race"
      args=("${CMD[@]:2}")
      run_step "racecheck_$name" racecheck "$(budget_for 90 0)" "${san_env[@]}" "$SANITIZER" \
        --tool racecheck --racecheck-report hazard "${SAN_COMMON[@]}" "${bin[@]}" "${args[@]}"
    fi
  done
fi

if (( FAILED )); then
  finish 1 fail "a step failed (see steps and $LOG)"
fi
finish 0 pass "every step passed"
