#!/usr/bin/env bash
# The GPU bundle's packing and the GPU check's no-GPU path, without a GPU or Bazel:
#   1. gpu_bundle.sh --pack-only packs a real Bazel binary (gpu_bench, with its
#      _solib libraries, Debian's and glibc's); --verify finds it self-contained:
#      under env.sh's library path `ldd` resolves every library inside the bundle
#      except glibc's (and libcuda / the target's toolkit libraries, none here);
#      it is under the size limit;
#   2. the bundle's `run` wrapper runs the binary from the bundle (the emulator
#      backend: its JSON line comes out);
#   3. a library stored as .xz is unpacked (xz, or python3's lzma without it),
#      and so is a binary (bin/NAME.gz or .xz, or bin/binaries.tar.xz; run
#      from GPU_BUNDLE_XBIN);
#   4. --verify catches a bundle missing a library;
#   5. gpu_check.sh on this machine (no GPU) says so, writes its JSON and exits 3
#      within seconds.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }
RUNFILES="${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-tandem}"
[[ -d "$RUNFILES/scripts" ]] || RUNFILES="$PWD"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
export TMPDIR="$TMP"  # env.sh unpacks the gzipped libraries under it
# The scripts as a checkout has them (gpu_bundle.sh finds its siblings).
mkdir -p "$TMP/repo/scripts" "$TMP/repo/third_party"
cp "$RUNFILES"/scripts/gpu_bundle.sh "$RUNFILES"/scripts/gpu_bundle_env.sh \
  "$RUNFILES"/scripts/gpu_check.sh "$TMP/repo/scripts/"
BIN="$RUNFILES/kernels/cuda/gpu_bench"
[[ -x "$BIN" ]] || fail "no gpu_bench at $BIN"

# 1. Pack and verify (gzip: xz would take minutes on a cold cache; the xz path
# is checked in 3).
B="$TMP/bundle"
GPU_BUNDLE_COMPRESS=gzip "$TMP/repo/scripts/gpu_bundle.sh" --out "$B" --pack-only "$BIN" 2>"$TMP/pack.log" ||
  { cat "$TMP/pack.log" >&2; fail "packing failed"; }
cat "$TMP/pack.log"
grep -q "is self-contained" "$TMP/pack.log" || fail "the packing did not verify the bundle"
for f in run env.sh gpu_check.sh manifest.env MANIFEST.txt tests.tsv bin/gpu_bench.gz; do
  [[ -e "$B/$f" ]] || fail "bundle lacks $f"
done
[[ ! -e "$B/bin/gpu_bench" ]] || fail "the binary travels uncompressed"
grep -q "binaries: gpu_bench" "$TMP/pack.log" || fail "--verify did not check the unpacked gpu_bench"
# shellcheck disable=SC2016
xbin="$(bash -c 'source "$1/env.sh"; echo "$GPU_BUNDLE_XBIN"' _ "$B")"
[[ -x "$xbin/gpu_bench" ]] || fail "env.sh did not unpack bin/gpu_bench.gz into $xbin"
ls "$B"/lib/libabsl_*.so.* >/dev/null 2>&1 || fail "Debian's abseil libraries were not bundled"
ls "$B"/lib/libstdc++.so.* >/dev/null 2>&1 || fail "libstdc++ was not bundled"
[[ -e "$B/lib/glibc/libc.so.6" ]] || fail "no fallback copy of glibc"
[[ ! -e "$B/lib/libc.so.6" ]] || fail "glibc must not be on the bundle's library path"
# Every library of every binary resolves inside the bundle (glibc aside).
ls "$B"/lib/*.gz >/dev/null 2>&1 || fail "no compressed library (libdnnl is 37 MiB)"
# shellcheck disable=SC2016
ld_path="$(bash -c 'source "$1/env.sh"; echo "$GPU_BUNDLE_LD_PATH"' _ "$B")"
while IFS= read -r line; do
  [[ "$line" == *"=>"* ]] || continue
  so="$(awk '{print $1}' <<<"$line")" path="$(awk '{print $3}' <<<"$line")"
  case "$so" in ld-linux* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.*) continue ;; esac
  # Inside the bundle, or its gzipped copy unpacked by env.sh (under $TMPDIR).
  real="$(readlink -f "$path")"
  [[ "$real" == "$B"/* ]] ||
    { [[ "$real" == "$TMP"/tandem_gpu_bundle_*/lib/* && ( -e "$B/lib/$so.gz" || -e "$B/lib/$so.xz" ) ]]; } ||
    fail "gpu_bench: $so resolves outside the bundle: $line"
done < <(LD_LIBRARY_PATH="$ld_path" ldd "$xbin/gpu_bench")
"$TMP/repo/scripts/gpu_bundle.sh" --verify "$B" || fail "--verify rejects a good bundle"
kib="$(du -sk "$B" | cut -f1)"
(( kib < 56 * 1024 )) || fail "bundle is $kib KiB"

# 2. The wrapper runs it.
out="$(GPU_BUNDLE_RUNFILES="$TMP" "$B/run" gpu_bench --backend cuda_sim --only copy 2>&1)" ||
  { echo "$out"; fail "./run gpu_bench failed"; }
tail -n 1 <<<"$out" | grep -q '"bench":"gpu_kernels"' || { echo "$out"; fail "no JSON line from ./run gpu_bench"; }

# 3. An xz-compressed library is unpacked by env.sh (xz, else python3's lzma).
cp -r "$B" "$TMP/xzb"
so="$(basename "$(ls "$TMP"/xzb/lib/libabsl_strings.so.* | head -n 1)")"
xz -c "$TMP/xzb/lib/$so" >"$TMP/xzb/lib/$so.xz" && rm "$TMP/xzb/lib/$so"
"$TMP/repo/scripts/gpu_bundle.sh" --verify "$TMP/xzb" || fail "--verify rejects a bundle with an .xz library"
GPU_BUNDLE_RUNFILES="$TMP" "$TMP/xzb/run" gpu_bench --backend cuda_sim --only copy >/dev/null 2>&1 ||
  fail "./run with an .xz library failed"
if command -v python3 >/dev/null; then
  # Without xz on the PATH (python3's lzma then).
  mkdir -p "$TMP/noxz"
  for t in bash gzip python3 cksum cut mkdir mv rm chmod id dirname basename ldconfig awk getconf \
    grep timeout find readlink cat; do
    p="$(command -v "$t" || true)"
    [[ -n "$p" ]] && ln -sf "$p" "$TMP/noxz/$t"
  done
  rm -rf "$TMP"/tandem_gpu_bundle_*
  PATH="$TMP/noxz" GPU_BUNDLE_RUNFILES="$TMP" "$TMP/xzb/run" gpu_bench --backend cuda_sim --only copy \
    >/dev/null 2>&1 || fail "./run with an .xz library and no xz failed"
fi

# 3b. A binary stored as .xz (what the packing makes with xz at hand) is
# unpacked by env.sh into GPU_BUNDLE_XBIN, where `run` and --verify find it.
cp -r "$B" "$TMP/xzbin"
gzip -dc "$TMP/xzbin/bin/gpu_bench.gz" | xz -c >"$TMP/xzbin/bin/gpu_bench.xz"
rm "$TMP/xzbin/bin/gpu_bench.gz"
"$TMP/repo/scripts/gpu_bundle.sh" --verify "$TMP/xzbin" 2>"$TMP/verify_xzbin.log" ||
  { cat "$TMP/verify_xzbin.log" >&2; fail "--verify rejects a bundle with an .xz binary"; }
grep -q "gpu_bench" "$TMP/verify_xzbin.log" || fail "--verify did not check the unpacked gpu_bench"
out="$(GPU_BUNDLE_RUNFILES="$TMP" "$TMP/xzbin/run" gpu_bench --backend cuda_sim --only copy 2>&1)" ||
  { echo "$out"; fail "./run of an .xz binary failed"; }
tail -n 1 <<<"$out" | grep -q '"bench":"gpu_kernels"' || fail "no JSON line from the .xz gpu_bench"

# 3c. The binaries as one solid archive (bin/binaries.tar.xz, what the
# packing makes with xz at hand).
cp -r "$B" "$TMP/tarbin"
mkdir -p "$TMP/tarbin_plain"
gzip -dc "$TMP/tarbin/bin/gpu_bench.gz" >"$TMP/tarbin_plain/gpu_bench"
chmod +x "$TMP/tarbin_plain/gpu_bench"
tar -C "$TMP/tarbin_plain" -cf - . | xz -c >"$TMP/tarbin/bin/binaries.tar.xz"
rm "$TMP/tarbin/bin/gpu_bench.gz"
"$TMP/repo/scripts/gpu_bundle.sh" --verify "$TMP/tarbin" 2>"$TMP/verify_tar.log" ||
  { cat "$TMP/verify_tar.log" >&2; fail "--verify rejects a bundle with binaries.tar.xz"; }
grep -q "binaries: gpu_bench" "$TMP/verify_tar.log" || fail "--verify did not check the archive's gpu_bench"
out="$(GPU_BUNDLE_RUNFILES="$TMP" "$TMP/tarbin/run" gpu_bench --backend cuda_sim --only copy 2>&1)" ||
  { echo "$out"; fail "./run of a binary from binaries.tar.xz failed"; }
tail -n 1 <<<"$out" | grep -q '"bench":"gpu_kernels"' || fail "no JSON line from the archived gpu_bench"

# 4. A missing library is caught.
cp -r "$B" "$TMP/broken"
rm -f "$TMP"/broken/lib/libabsl_strings.so.*
if "$TMP/repo/scripts/gpu_bundle.sh" --verify "$TMP/broken" 2>"$TMP/verify.log"; then
  fail "--verify accepted a bundle without libabsl_strings"
fi
grep -q "libabsl_strings" "$TMP/verify.log" || fail "--verify did not name the missing library"

# 5. gpu_check.sh without a GPU: quick, clear, exit 3, JSON written.
start=$SECONDS
rc=0
GPU_CHECK_NVIDIA_SMI=/nonexistent/nvidia-smi "$B/gpu_check.sh" "$TMP/check" 2>"$TMP/check.log" || rc=$?
cat "$TMP/check.log"
(( rc == 3 )) || fail "gpu_check.sh without a GPU exited $rc, not 3"
(( SECONDS - start < 30 )) || fail "gpu_check.sh without a GPU took $((SECONDS - start))s"
grep -q "no usable NVIDIA GPU" "$TMP/check.log" || fail "gpu_check.sh does not say there is no GPU"
grep -q '"status":"no_gpu"' "$TMP/check/gpu_check.json" || fail "gpu_check.json lacks status no_gpu"
[[ -s "$TMP/check/gpu_check.log" ]] || fail "no gpu_check.log"
if command -v python3 >/dev/null; then
  python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$TMP/check/gpu_check.json" ||
    fail "gpu_check.json does not parse"
fi
# $OUT is the default result folder.
rc=0
OUT="$TMP/out_env" GPU_CHECK_NVIDIA_SMI=false "$B/gpu_check.sh" 2>/dev/null || rc=$?
(( rc == 3 )) && [[ -f "$TMP/out_env/gpu_check.json" ]] || fail "gpu_check.sh ignores \$OUT"
echo PASS
