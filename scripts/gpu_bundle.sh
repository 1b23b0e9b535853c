#!/usr/bin/env bash
# ./tandem gpu-bundle [--out DIR] [--target LABEL]... [--pack-only BIN...]
#
# Builds the GPU check's binaries with --config=cuda here and packs them into one
# self-contained folder for the lent GPU machine (which has the NVIDIA driver,
# nvcc and the CUDA 13 toolkit, but no Bazel, no Debian libraries and no
# network). docs/gpu_check.md says how to carry and run it. Layout:
#
#   gpu_check.sh      the check (scripts/gpu_check.sh)
#   run NAME ARGS     runs bin/NAME with the bundle's libraries (sources env.sh)
#   env.sh            library path set-up (scripts/gpu_bundle_env.sh)
#   manifest.env      build facts for env.sh/gpu_check.sh (glibc, git revision,
#                     the libraries resolved on the target)
#   MANIFEST.txt      what was built, what could not be, every library and why
#   tests.tsv         the tests gpu_check.sh runs: name, kind, gtest filter,
#                     racecheck filter
#   bin/              the binaries (debug info stripped, symbols kept) in one
#                     solid archive, binaries.tar.xz (NAME.gz each without
#                     xz), unpacked by env.sh under $TMPDIR (GPU_BUNDLE_XBIN)
#   lib/              every shared library they load, as `ldd` lists them here,
#                     except (1) the CUDA driver (libcuda.so.*: the target's own),
#                     (2) glibc and its loader (ld-linux, libc, libm, libpthread,
#                     libdl, librt: the target has them; copies kept in
#                     lib/glibc/ are used only where the target's glibc is older
#                     than the one built against), (3) CUDA toolkit libraries over
#                     8 MiB (cuBLASLt is 541 MB, NCCL 218 MB: far over the 64 MiB
#                     the device tool carries), found on the target's CUDA 13
#                     toolkit by env.sh. Libraries over 128 KiB are stored
#                     compressed (*.xz, or *.gz without xz here) and unpacked by
#                     env.sh on first use, outside the bundle (under $TMPDIR;
#                     xz there, else python3's lzma).
#   runfiles/         the tokenizer files make_checkpoint needs; gpu_check.sh
#                     generates the tiny checkpoint there (seed 0, as
#                     //engine/model:tiny_checkpoint; 45 MB, so not carried)
#
# What is built: //kernels:conformance_test, //kernels/cuda:gpu_bench,
# //engine/runtime:engine_bench (the engine from GPU memory, issue #15),
# //worker:kv_device_bench (the KV hand-off between device buffers),
# //engine/vision:vision_bench (the vision tower from GPU memory),
# //engine/model:make_checkpoint, the cluster test //tests:cluster_cuda_sim_test
# with the router and worker binaries it starts (run there on "cuda"), the
# engine tests of ENGINE_TESTS below (run with
# the filter of their "cuda" instances), every test tagged "gpu" (kernel or
# engine tests that run on the "cuda" backend opt in with that tag, as for
# ./tandem test --gpu; run whole) and each --target. A target that fails to build is listed in
# MANIFEST.txt and left out; the bundle is still made (exit 0) as long as the
# conformance test, the benchmark and make_checkpoint built; else exit 1 and an
# earlier bundle at --out is left as it was.
#
# --pack-only BIN...: no Bazel; packs the given ELF binaries (the packing test,
# scripts/gpu_bundle_test.sh).
# --verify DIR: checks that a bundle is self-contained: under the library path
# its env.sh sets, `ldd` of every binary resolves every library inside the
# bundle, except glibc's, the CUDA driver's and the toolkit libraries listed in
# manifest.env; and that it is under the size limit. Every packing ends with it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BAZEL="${BAZEL:-bazel}"
OUT_DIR="$ROOT/gpu_bundle"
EXTRA_TARGETS=()
PACK_ONLY=()
VERIFY_DIR=""
# The device tool carries the working tree and the carried paths together, at most
# 64 MiB; the bundle gets what the tree leaves (checked at the end).
MAX_BUNDLE_MIB="${GPU_BUNDLE_MAX_MIB:-56}"
GZIP_OVER_BYTES=$((128 << 10))
TARGET_LIB_OVER_BYTES=$((8 << 20))

say() { echo "gpu-bundle: $*" >&2; }
die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --help | -h) usage; exit 0 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --out=*) OUT_DIR="${1#--out=}"; shift ;;
    --target) EXTRA_TARGETS+=("$2"); shift 2 ;;
    --target=*) EXTRA_TARGETS+=("${1#--target=}"); shift ;;
    --verify) VERIFY_DIR="$2"; shift 2 ;;
    --pack-only) shift; PACK_ONLY=("$@"); [[ ${#PACK_ONLY[@]} -gt 0 ]] || die "--pack-only needs binaries"; break ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ "$OUT_DIR" == /* ]] || OUT_DIR="$PWD/$OUT_DIR"

# ---------------------------------------------------------------- build
# Lines "LABEL<TAB>PATH" of the targets that built in this invocation, from the
# build event protocol (a failed target's old output must not be packed).
built_outputs() {  # bep.json
  python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        ev = json.loads(line)
    except ValueError:
        continue
    tc = ev.get("id", {}).get("targetCompleted")
    done = ev.get("completed")
    if not tc or done is None or not done.get("success"):
        continue
    for f in done.get("importantOutput", []):
        name = f.get("name", "")
        uri = f.get("uri", "")
        if uri.startswith("file://") and not name.endswith((".sh", ".runfiles")):
            print(tc["label"] + "\t" + uri[len("file://"):])
            break
PY
}

declare -A KIND=() FILTER=() RACE=()
# Engine tests whose gtest instances are named by backend: label -> the filter of
# their "cuda" instances (the other tests of such a binary may need "cuda_sim",
# which a --config=cuda build lacks).
declare -A ENGINE_TESTS=(
  [//engine/runtime:gpu_engine_test]='*/cuda'
  [//engine/runtime:overlap_engine_test]='*/cuda'
)
# The cluster test on the GPU (TANDEM_CLUSTER_BACKEND=cuda) and the worker and
# router binaries it starts; gpu_check.sh links them where the test looks
# (runfiles/decode/decode_main, ...).
CLUSTER_TEST=//tests:cluster_cuda_sim_test
CLUSTER_TARGETS=("$CLUSTER_TEST" //prefill:prefill_main //decode:decode_main
  //router:router_main)
BUILT=()      # "LABEL<TAB>PATH"
NOT_BUILT=()  # labels

# The bundle is built by a Bazel server of its own (its own output tree, the
# shared disk cache): the main server's output tree is one per workspace whatever
# the --define, so another build there (the default one, --config=asan) could
# replace a --config=cuda output between this build and its packing, and the
# switch would discard that server's analysis cache for everyone. No bazel-*
# symlinks are made (they would point the workspace's bazel-bin here).
BUNDLE_OUTPUT_BASE="${GPU_BUNDLE_OUTPUT_BASE:-$HOME/.cache/tandem-gpu-bundle-bazel}"
bazel_bundle() {
  "$BAZEL" --output_base="$BUNDLE_OUTPUT_BASE" --max_idle_secs=600 "$@"
}

build_all() {
  cd "$ROOT"
  command -v python3 >/dev/null || die "python3 is needed (build event parsing)"
  # The source packages (//... would also walk the bazel-* symlinks into the main
  # server's tree, which this server does not know to skip).
  local universe="" d
  for d in */; do
    d="${d%/}"
    [[ -L "$d" || "$d" == bazel-* || "$d" == third_party || "$d" == node_modules ]] && continue
    universe+="${universe:+ + }//$d/..."
  done
  local gpu_tests
  gpu_tests="$(bazel_bundle query --keep_going --noshow_progress "attr(tags, '\bgpu\b', tests($universe))" 2>/dev/null || true)"
  local targets=(//kernels:conformance_test //kernels/cuda:gpu_bench //engine/model:make_checkpoint
    //engine/runtime:engine_bench //worker:kv_device_bench //engine/vision:vision_bench)
  # The serving path on the GPU (issue #15): the cluster test and the processes
  # it starts (router, prefill and decode workers), run there on "cuda".
  local t
  for t in "${CLUSTER_TARGETS[@]}"; do targets+=("$t"); done
  local engine_tests=""
  # The engine tests parametrised over the device backends by name (their "cuda"
  # instances): those of ENGINE_TESTS that exist.
  for t in "${!ENGINE_TESTS[@]}"; do
    if bazel_bundle query --noshow_progress "$t" >/dev/null 2>&1; then
      engine_tests+=" $t"
    else
      say "no $t yet: not bundled"
    fi
  done
  for t in $gpu_tests $engine_tests "${EXTRA_TARGETS[@]}"; do targets+=("$t"); done
  # The emulator-only kernel family tests (launchers on host vectors, -DTANDEM_CUDA_SIM)
  # would test the emulator there, not the GPU: listed, not bundled.
  SIM_ONLY="$(bazel_bundle query --noshow_progress \
    "kind(cc_test, //kernels/cuda:all) except attr(tags, '\bgpu\b', //kernels/cuda:all)" 2>/dev/null || true)"
  say "building with --config=cuda: ${targets[*]}"
  local bep log
  bep="$(mktemp)"
  log="$(mktemp)"
  local start=$SECONDS rc=0
  bazel_bundle build --config=cuda --keep_going --noshow_progress --symlink_prefix=/ \
    --build_event_json_file="$bep" "${targets[@]}" >"$log" 2>&1 || rc=$?
  if (( rc != 0 )); then
    say "the --config=cuda build had failures (exit $rc); its errors:"
    grep -E 'ERROR|error:' "$log" | head -n 60 >&2 || true
  fi
  say "build took $((SECONDS - start))s"
  mapfile -t BUILT < <(built_outputs "$bep")
  local label found
  for t in "${targets[@]}"; do
    found=0
    for label in "${BUILT[@]}"; do [[ "${label%%$'\t'*}" == "$t" ]] && found=1; done
    (( found )) || NOT_BUILT+=("$t")
  done
  rm -f "$bep" "$log"
  for t in $gpu_tests "${EXTRA_TARGETS[@]}"; do KIND[$t]=gpu_test; done
  for t in $engine_tests; do
    KIND[$t]=engine_test
    FILTER[$t]="${ENGINE_TESTS[$t]}"
  done
  KIND[//kernels:conformance_test]=conformance
  KIND[//kernels/cuda:gpu_bench]=bench
  KIND[//engine/runtime:engine_bench]=bench
  KIND[//worker:kv_device_bench]=bench
  KIND[//engine/vision:vision_bench]=bench
  KIND[//engine/model:make_checkpoint]=tool
  KIND[$CLUSTER_TEST]=cluster_test
  local m
  for m in "${CLUSTER_TARGETS[@]:1}"; do KIND[$m]=server; done
  # The conformance suite's "cuda" instances and device tests; racecheck on the
  # ops whose kernels share memory (tiles, block reductions).
  FILTER[//kernels:conformance_test]='*/cuda:*/cuda_bf16:DeviceBackend*:CudaBackend*:VisionOps.*'
  RACE[//kernels:conformance_test]='*Mla*/cuda:*Kda*/cuda:*Moe*/cuda:*Router*/cuda:*RmsNorm*/cuda:*AttnRes*/cuda:*CausalConv*/cuda:*VisionAttention*/cuda:*VisionAttention*/cuda_bf16:*Mla*/cuda_bf16:*Moe*/cuda_bf16'
}

# ---------------------------------------------------------------- pack
LIB_NOTES=()  # "soname<TAB>where<TAB>why"
declare -A SEEN_LIB=()
TARGET_LIBS=()

glibc_basic() {
  case "$1" in
    linux-vdso.so.* | ld-linux-x86-64.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.*) return 0 ;;
  esac
  return 1
}

cuda_root() {
  local r
  for r in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda; do
    [[ -n "$r" && -d "$r" ]] && { readlink -f "$r"; return 0; }
  done
  return 1
}

# Compresses a library in lib/ or a binary in bin/ (FILE -> FILE.xz, else
# FILE.gz); prints how. (Libraries over 128 KiB: the small ones are not worth
# a process each.)
# xz saves ~40% over gzip on these (oneDNN 37 MiB: 7.0 vs 11.4 MiB) but takes
# minutes on 2 cores, so each library's .xz is cached by content under
# ~/.cache/tandem-gpu-bundle/xz. GPU_BUNDLE_COMPRESS=gzip forces gzip.
XZ_CACHE="${GPU_BUNDLE_XZ_CACHE:-$HOME/.cache/tandem-gpu-bundle/xz}"
compress_lib() {  # file
  local f="$1"
  if [[ "${GPU_BUNDLE_COMPRESS:-xz}" == xz ]] && command -v xz >/dev/null; then
    local key
    key="$(sha256sum "$f" | cut -c1-32)"
    mkdir -p "$XZ_CACHE"
    if ! [[ -s "$XZ_CACHE/$key.xz" ]]; then
      xz -T2 -6 -c "$f" >"$XZ_CACHE/$key.xz.tmp.$$" && mv -f "$XZ_CACHE/$key.xz.tmp.$$" "$XZ_CACHE/$key.xz"
    fi
    cp "$XZ_CACHE/$key.xz" "$f.xz" && rm -f "$f"
    echo "xz-compressed"
  else
    gzip -6 -f "$f"
    echo "gzipped"
  fi
}

# Every binary travels compressed; env.sh unpacks them under $TMPDIR
# (GPU_BUNDLE_XBIN), where `run` finds them. Each holds the kernels' device
# code and most of the engine again, so one solid xz -9 archive (64 MiB
# dictionary) of them all, bin/binaries.tar.xz, is a fraction of the files
# compressed one by one (4.3 vs 10.2 MiB for the 15 binaries of 2026-12-06);
# cached by content like the libraries. Without xz (GPU_BUNDLE_COMPRESS=gzip):
# bin/NAME.gz one by one.
compress_bins() {
  local f
  if [[ "${GPU_BUNDLE_COMPRESS:-xz}" == xz ]] && command -v xz >/dev/null; then
    local tarf="$OUT_DIR/binaries.tar" key
    tar -C "$OUT_DIR/bin" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
      -cf "$tarf" .
    key="$(sha256sum "$tarf" | cut -c1-32)"
    mkdir -p "$XZ_CACHE"
    if ! [[ -s "$XZ_CACHE/$key.tar.xz" ]]; then
      xz -T2 -9 -c "$tarf" >"$XZ_CACHE/$key.tar.xz.tmp.$$" &&
        mv -f "$XZ_CACHE/$key.tar.xz.tmp.$$" "$XZ_CACHE/$key.tar.xz"
    fi
    rm -f "$tarf" "$OUT_DIR"/bin/*
    cp "$XZ_CACHE/$key.tar.xz" "$OUT_DIR/bin/binaries.tar.xz"
  else
    for f in "$OUT_DIR"/bin/*; do gzip -6 -f "$f"; done
  fi
}

# Copies the libraries `ldd BIN` lists (transitively) into lib/.
pack_libs_of() {  # binary
  local bin="$1" line soname path real size croot
  croot="$(cuda_root || echo /nonexistent)"
  while IFS= read -r line; do
    soname="" path=""
    if [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+([^[:space:]]+) ]]; then
      soname="${BASH_REMATCH[1]}" path="${BASH_REMATCH[2]}"
    elif [[ "$line" =~ ^[[:space:]]*(/[^[:space:]]+)[[:space:]]+\( ]]; then
      path="${BASH_REMATCH[1]}" soname="$(basename "$path")"
    else
      continue
    fi
    [[ -n "${SEEN_LIB[$soname]:-}" ]] && continue
    SEEN_LIB[$soname]=1
    if [[ "$path" == "not" ]]; then
      LIB_NOTES+=("$soname"$'\t'"MISSING"$'\t'"not found by ldd here")
      continue
    fi
    case "$soname" in
      libcuda.so.* | libcuda.so | libnvidia-*.so*)
        LIB_NOTES+=("$soname"$'\t'"target"$'\t'"the CUDA driver: the GPU machine's own")
        continue ;;
    esac
    if glibc_basic "$soname"; then
      [[ "$soname" == linux-vdso* ]] && continue
      mkdir -p "$OUT_DIR/lib/glibc"
      cp -L "$path" "$OUT_DIR/lib/glibc/$soname"
      LIB_NOTES+=("$soname"$'\t'"target"$'\t'"glibc (copy in lib/glibc, used only if the target's glibc is older)")
      continue
    fi
    real="$(readlink -f "$path")"
    size="$(stat -Lc %s "$path")"
    if [[ "$real" == "$croot"/* && $size -gt $TARGET_LIB_OVER_BYTES ]]; then
      TARGET_LIBS+=("$soname")
      LIB_NOTES+=("$soname"$'\t'"target"$'\t'"CUDA toolkit, $((size >> 20)) MiB: found on the target's CUDA 13 toolkit")
      continue
    fi
    local dst="$OUT_DIR/lib/$soname"
    cp -L "$path" "$dst"
    chmod u+w "$dst"
    # Bazel's own libraries carry debug info (-g1); keep the symbols.
    [[ "$real" == "$ROOT"/* || "$real" == */bazel-out/* || "$real" == */execroot/* ]] &&
      strip --strip-debug "$dst" 2>/dev/null || true
    size="$(stat -c %s "$dst")"
    if (( size > GZIP_OVER_BYTES )); then
      local how
      how="$(compress_lib "$dst")"
      LIB_NOTES+=("$soname"$'\t'"bundle"$'\t'"from $path, $((size >> 20)) MiB, $how (env.sh unpacks it)")
    else
      LIB_NOTES+=("$soname"$'\t'"bundle"$'\t'"from $path")
    fi
  done < <(ldd "$bin" 2>/dev/null)
}

pack() {
  rm -rf "$OUT_DIR.tmp"
  local final="$OUT_DIR"
  OUT_DIR="$OUT_DIR.tmp"
  mkdir -p "$OUT_DIR/bin" "$OUT_DIR/lib" "$OUT_DIR/runfiles"
  local entry label path name
  : >"$OUT_DIR/tests.tsv"
  for entry in "${BUILT[@]}"; do
    label="${entry%%$'\t'*}" path="${entry#*$'\t'}"
    name="$(basename "$path")"
    [[ "$(head -c 4 "$path" | od -An -c | tr -d ' ')" == '177ELF' ]] ||
      { NOT_BUILT+=("$label (not an ELF binary: $path)"); continue; }
    cp -L "$path" "$OUT_DIR/bin/$name"
    chmod u+w "$OUT_DIR/bin/$name"
    strip --strip-debug "$OUT_DIR/bin/$name" 2>/dev/null || true
    pack_libs_of "$path"
    case "${KIND[$label]:-gpu_test}" in
      conformance | gpu_test | engine_test | cluster_test)
        printf '%s\t%s\t%s\t%s\n' "$name" "${KIND[$label]:-gpu_test}" "${FILTER[$label]:--}" \
          "${RACE[$label]:--}" >>"$OUT_DIR/tests.tsv.unsorted" ;;
    esac
  done
  compress_bins
  # The conformance suite first: the check runs the tests in this order.
  if [[ -f "$OUT_DIR/tests.tsv.unsorted" ]]; then
    { grep -P '^[^\t]+\tconformance\t' "$OUT_DIR/tests.tsv.unsorted" || true
      grep -vP '^[^\t]+\tconformance\t' "$OUT_DIR/tests.tsv.unsorted" || true; } >"$OUT_DIR/tests.tsv"
    rm -f "$OUT_DIR/tests.tsv.unsorted"
  fi
  # The tokenizer files make_checkpoint reads.
  if [[ -d "$ROOT/third_party/kimi_k3_tokenizer" ]]; then
    mkdir -p "$OUT_DIR/runfiles/third_party"
    cp -rL "$ROOT/third_party/kimi_k3_tokenizer" "$OUT_DIR/runfiles/third_party/"
    rm -f "$OUT_DIR/runfiles/third_party/kimi_k3_tokenizer/BUILD"
  fi
  cp "$ROOT/scripts/gpu_check.sh" "$OUT_DIR/gpu_check.sh"
  cp "$ROOT/scripts/gpu_bundle_env.sh" "$OUT_DIR/env.sh"
  cat >"$OUT_DIR/run" <<'RUN'
#!/usr/bin/env bash
# ./run NAME [ARGS...]: bin/NAME with the bundle's libraries (env.sh), from
# $GPU_BUNDLE_RUNFILES (default runfiles/, where the tests find
# engine/model/tiny_checkpoint).
set -euo pipefail
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$B/env.sh"
[[ $# -ge 1 ]] || { echo "usage: $0 NAME [ARGS...] (NAME in $B/bin)" >&2; exit 2; }
name="$1"; shift
bin="$B/bin/$name"
[[ -x "$bin" ]] || bin="$GPU_BUNDLE_XBIN/$name"  # a compressed one, unpacked
cd "${GPU_BUNDLE_RUNFILES:-$B/runfiles}"
if [[ -n "$GPU_BUNDLE_LOADER" ]]; then
  exec "$GPU_BUNDLE_LOADER" --library-path "$GPU_BUNDLE_LD_PATH" "$bin" "$@"
fi
export LD_LIBRARY_PATH="$GPU_BUNDLE_LD_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$bin" "$@"
RUN
  chmod +x "$OUT_DIR/run" "$OUT_DIR/gpu_check.sh" "$OUT_DIR/env.sh"
  local glibc rev
  glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
  [[ -n "$glibc" ]] || glibc=0
  rev="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  {
    echo "BUNDLE_GLIBC=$glibc"
    echo "BUNDLE_GIT_REV=$rev"
    echo "BUNDLE_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "BUNDLE_TARGET_LIBS=\"${TARGET_LIBS[*]}\""
  } >"$OUT_DIR/manifest.env"
  {
    echo "Tandem GPU bundle, $(date -u +%Y-%m-%dT%H:%M:%SZ), git $rev$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (uncommitted changes)'), built on glibc $glibc"
    echo
    echo "Built (--config=cuda):"
    for entry in "${BUILT[@]}"; do
      local bn
      bn="$(basename "${entry#*$'\t'}")"
      echo "  ${entry%%$'\t'*}  ->  $bn"
    done
    echo
    echo "Could not build (left out):"
    [[ ${#NOT_BUILT[@]} -eq 0 ]] && echo "  (none)"
    for label in "${NOT_BUILT[@]}"; do echo "  $label"; done
    echo
    echo "Emulator-only tests (not bundled: they run the SIMT emulator, not the GPU):"
    for label in ${SIM_ONLY:-}; do echo "  $label"; done
    echo
    echo "Tests gpu_check.sh runs (tests.tsv: name, kind, gtest filter, racecheck filter):"
    sed 's/^/  /' "$OUT_DIR/tests.tsv"
    echo
    echo "Shared libraries (soname, where, why):"
    local n
    for n in "${LIB_NOTES[@]}"; do echo "  $n"; done | sort
  } >"$OUT_DIR/MANIFEST.txt"
  local kib
  kib="$(du -sk "$OUT_DIR" | cut -f1)"
  echo "BUNDLE_KIB=$kib" >>"$OUT_DIR/manifest.env"
  rm -rf "$final"
  mv "$OUT_DIR" "$final"
  OUT_DIR="$final"
  if (( kib > MAX_BUNDLE_MIB * 1024 )); then
    say "bundle is $((kib / 1024)) MiB, over the ${MAX_BUNDLE_MIB} MiB it may take of the device tool's 64 MiB"
    return 1
  fi
  say "packed $OUT_DIR ($((kib / 1024)) MiB; MANIFEST.txt lists it)"
}


# ---------------------------------------------------------------- verify
verify_bundle() {  # dir
  local dir
  dir="$(cd "$1" && pwd)" || return 1
  [[ -f "$dir/env.sh" && -d "$dir/bin" ]] || { say "verify: $dir is not a bundle"; return 1; }
  local ld_path target_libs loader
  # shellcheck disable=SC2016
  ld_path="$(bash -c 'source "$1/env.sh" && echo "$GPU_BUNDLE_LD_PATH"' _ "$dir")"
  target_libs="$(bash -c 'source "$1/manifest.env" && echo "$BUNDLE_TARGET_LIBS"' _ "$dir")"
  local bad=0 b line soname path allowed_dirs=() d xbin checked=()
  IFS=: read -r -a allowed_dirs <<<"$ld_path"
  # shellcheck disable=SC2016
  xbin="$(bash -c 'source "$1/env.sh" && echo "$GPU_BUNDLE_XBIN"' _ "$dir")"
  for b in "$dir"/bin/* "${xbin:-/nonexistent}"/*; do
    [[ -f "$b" ]] || continue
    case "$b" in *.xz | *.gz) continue ;; esac
    checked+=("$(basename "$b")")
    while IFS= read -r line; do
      soname="" path=""
      if [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+not[[:space:]]+found ]]; then
        soname="${BASH_REMATCH[1]}" path="NOT-FOUND"
      elif [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+([^[:space:]]+) ]]; then
        soname="${BASH_REMATCH[1]}" path="${BASH_REMATCH[2]}"
      else
        continue
      fi
      glibc_basic "$soname" && continue
      case "$soname" in libcuda.so* | libnvidia-*) continue ;; esac
      [[ " $target_libs " == *" $soname "* ]] && continue
      local inside=0
      if [[ "$path" != NOT-FOUND ]]; then
        [[ "$(readlink -f "$path")" == "$dir"/* ]] && inside=1
        for d in "${allowed_dirs[@]}"; do
          [[ -n "$d" && "$path" == "$d"/* && "$d" == "$dir"* ]] && inside=1
          # The unpack directory outside a read-only bundle.
          [[ -n "$d" && "$path" == "$d"/* && "$d" == */tandem_gpu_bundle_*/lib ]] && inside=1
        done
      fi
      if (( ! inside )); then
        say "verify: $(basename "$b"): $soname => $path (not in the bundle)"
        bad=1
      fi
    done < <(LD_LIBRARY_PATH="$ld_path" ldd "$b" 2>&1)
  done
  local kib
  # Unpacked copies of the gzipped libraries do not travel (they are made there);
  # count the rest.
  kib="$(du -sk "$dir" | cut -f1)"
  local z
  for z in "$dir"/lib/*.gz "$dir"/lib/*.xz; do
    [[ -e "$z" && -e "${z%.*}" ]] && kib=$((kib - $(du -k "${z%.*}" | cut -f1)))
  done
  if (( kib > MAX_BUNDLE_MIB * 1024 )); then
    say "verify: $dir is $((kib / 1024)) MiB, over ${MAX_BUNDLE_MIB} MiB"
    bad=1
  fi
  (( bad == 0 )) && say "verify: $dir is self-contained ($((kib / 1024)) MiB; binaries: ${checked[*]}; libraries outside it: glibc, libcuda${target_libs:+, $target_libs})"
  return $bad
}

if [[ -n "$VERIFY_DIR" ]]; then
  verify_bundle "$VERIFY_DIR"
  exit $?
fi

if [[ ${#PACK_ONLY[@]} -gt 0 ]]; then
  SIM_ONLY=""
  for path in "${PACK_ONLY[@]}"; do
    [[ -f "$path" ]] || die "no such binary: $path"
    p="$(readlink -f "$path")"
    BUILT+=("//pack-only:$(basename "$p")"$'\t'"$p")
  done
  pack_rc=0
  pack || pack_rc=$?
  verify_bundle "$OUT_DIR" || pack_rc=1
  exit $pack_rc
fi

build_all
if [[ ${#BUILT[@]} -eq 0 ]]; then
  die "nothing built under --config=cuda (see the errors above)"
fi
# Without these the bundle is no use for the GPU check: an earlier good bundle
# at --out is then left as it is.
for must in //kernels:conformance_test //kernels/cuda:gpu_bench //engine/model:make_checkpoint; do
  for label in "${NOT_BUILT[@]}"; do
    if [[ "$label" == "$must" ]]; then
      say "could not build: ${NOT_BUILT[*]}"
      say "$must did not build: no bundle made${OUT_DIR:+ ($OUT_DIR left as it was)}"
      exit 1
    fi
  done
done
pack_rc=0
pack || pack_rc=$?
verify_bundle "$OUT_DIR" || pack_rc=1
sed -n '/^Built/,/^Shared libraries/p' "$OUT_DIR/MANIFEST.txt" | sed '$d' >&2
# What the device tool will carry: the working tree (tracked and untracked files
# that git does not ignore) plus the bundle, at most 64 MiB together.
tree_kib="$(cd "$ROOT" && git ls-files -z -co --exclude-standard 2>/dev/null |
  xargs -0 -r du -ck 2>/dev/null | tail -n 1 | cut -f1)"
bundle_kib="$(du -sk "$OUT_DIR" | cut -f1)"
say "the device tool carries the working tree (${tree_kib:-?} KiB) + this bundle (${bundle_kib} KiB) = $(( (${tree_kib:-0} + bundle_kib) / 1024 )) MiB of its 64 MiB"
if (( ${tree_kib:-0} + bundle_kib > 64 * 1024 )); then
  say "over 64 MiB: the run would be refused (GPU_BUNDLE_COMPRESS=gzip is larger; drop a --target)"
  pack_rc=1
fi
say "run it there: run(command=\"$(basename "$OUT_DIR")/gpu_check.sh \\\"\$OUT\\\"\", carry=[\"$(basename "$OUT_DIR")\"], timeout_s=420)  (docs/gpu_check.md)"
exit $pack_rc
