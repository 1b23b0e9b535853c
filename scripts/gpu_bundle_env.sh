#!/usr/bin/env bash
# Sourced (as env.sh inside a GPU bundle, scripts/gpu_bundle.sh) by the bundle's
# `run` wrapper and by gpu_check.sh. Sets, for the bundle folder it lives in:
#   GPU_BUNDLE_DIR        the bundle
#   GPU_BUNDLE_LD_PATH    where the binaries' libraries are: lib/, the unpacked
#                         compressed ones (lib/*.gz, *.xz: under $TMPDIR), the directories holding the CUDA toolkit
#                         libraries left to the target (manifest.env's
#                         BUNDLE_TARGET_LIBS), and lib/glibc when it is used
#   GPU_BUNDLE_XBIN       where the compressed binaries (bin/*.xz) are unpacked
#   GPU_BUNDLE_LOADER     empty, or lib/glibc's loader when this machine's glibc is
#                         older than the one the bundle was built on (then the
#                         binaries run as `$GPU_BUNDLE_LOADER --library-path ...`)
#   GPU_BUNDLE_MISSING    target libraries not found here (space-separated)
#   GPU_BUNDLE_NOTES      what was decided, one line each
# It prints nothing and exits nothing: callers report.
GPU_BUNDLE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Already set up for this bundle in this environment (gpu_check.sh, then `run`).
if [[ -n "${GPU_BUNDLE_LD_PATH:-}" && "${GPU_BUNDLE_ENV_FOR:-}" == "$GPU_BUNDLE_DIR" ]]; then
  return 0
fi
GPU_BUNDLE_NOTES=""
GPU_BUNDLE_MISSING=""
GPU_BUNDLE_LOADER=""
BUNDLE_GLIBC=0
BUNDLE_TARGET_LIBS=""
# shellcheck source=/dev/null
[[ -f "$GPU_BUNDLE_DIR/manifest.env" ]] && source "$GPU_BUNDLE_DIR/manifest.env"

_gb_note() { GPU_BUNDLE_NOTES+="$*"$'\n'; }

# Gzipped libraries: unpacked outside the bundle (which then stays as small as it
# travels, and may be read-only), in a directory of this user and bundle under
# $TMPDIR.
_gb_unpack_dir="${TMPDIR:-/tmp}/tandem_gpu_bundle_$(id -u)_$(printf '%s' "$GPU_BUNDLE_DIR:${BUNDLE_DATE:-}" | cksum | cut -d' ' -f1)/lib"
mkdir -p "$_gb_unpack_dir"
_gb_unxz() {  # file.xz -> stdout: xz, else python3's lzma
  if command -v xz >/dev/null; then
    xz -dc "$1"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"
  fi
}
for _gb_gz in "$GPU_BUNDLE_DIR"/lib/*.gz "$GPU_BUNDLE_DIR"/lib/*.xz; do
  [[ -e "$_gb_gz" ]] || continue
  _gb_so="$_gb_unpack_dir/$(basename "${_gb_gz%.*}")"
  if ! [[ -s "$_gb_so" && "$_gb_so" -nt "$_gb_gz" ]]; then
    case "$_gb_gz" in
      *.gz) gzip -dc "$_gb_gz" >"$_gb_so.tmp.$$" ;;
      *.xz) _gb_unxz "$_gb_gz" >"$_gb_so.tmp.$$" ;;
    esac && mv -f "$_gb_so.tmp.$$" "$_gb_so" ||
      { rm -f "$_gb_so.tmp.$$"; _gb_note "could not unpack $_gb_gz"; }
  fi
done

GPU_BUNDLE_LD_PATH="$GPU_BUNDLE_DIR/lib:$_gb_unpack_dir"

# Compressed binaries (bin/binaries.tar.xz, or bin/NAME.gz / NAME.xz one by
# one): unpacked the same way, into GPU_BUNDLE_XBIN; `run NAME` looks there
# after bin/.
GPU_BUNDLE_XBIN="${_gb_unpack_dir%/lib}/bin"
mkdir -p "$GPU_BUNDLE_XBIN"
_gb_tar="$GPU_BUNDLE_DIR/bin/binaries.tar.xz"
if [[ -e "$_gb_tar" && ! ( -e "$GPU_BUNDLE_XBIN/.unpacked" && "$GPU_BUNDLE_XBIN/.unpacked" -nt "$_gb_tar" ) ]]; then
  if _gb_unxz "$_gb_tar" | tar -C "$GPU_BUNDLE_XBIN" -xf - 2>/dev/null; then
    : >"$GPU_BUNDLE_XBIN/.unpacked"
  else
    _gb_note "could not unpack $_gb_tar"
  fi
fi
for _gb_gz in "$GPU_BUNDLE_DIR"/bin/*.gz "$GPU_BUNDLE_DIR"/bin/*.xz; do
  [[ -e "$_gb_gz" && "$_gb_gz" != *.tar.xz ]] || continue
  _gb_so="$GPU_BUNDLE_XBIN/$(basename "${_gb_gz%.*}")"
  if ! [[ -s "$_gb_so" && "$_gb_so" -nt "$_gb_gz" ]]; then
    case "$_gb_gz" in
      *.gz) gzip -dc "$_gb_gz" >"$_gb_so.tmp.$$" ;;
      *.xz) _gb_unxz "$_gb_gz" >"$_gb_so.tmp.$$" ;;
    esac && chmod +x "$_gb_so.tmp.$$" && mv -f "$_gb_so.tmp.$$" "$_gb_so" ||
      { rm -f "$_gb_so.tmp.$$"; _gb_note "could not unpack $_gb_gz"; }
  fi
done

# The CUDA toolkit libraries left to the target (cuBLASLt, NCCL, ...): the
# dynamic linker's cache, the CUDA toolkit folders, then the NVIDIA Python
# wheels' folders (PyTorch's image carries them), then a bounded search.
_gb_find_lib() {  # soname -> directory
  local so="$1" d
  d="$(ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s { print $NF; exit }' || true)"
  if [[ -n "$d" && -e "$d" ]]; then dirname "$d"; return 0; fi
  for d in ${GPU_BUNDLE_CUDA_LIB_DIRS:-} "${CUDA_PATH:-/nonexistent}/lib64" \
    "${CUDA_HOME:-/nonexistent}/lib64" /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
    /usr/local/cuda-*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu \
    /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib \
    /usr/local/lib/python3*/dist-packages/nvidia/*/lib \
    /usr/lib/python3/dist-packages/nvidia/*/lib; do
    if [[ -e "$d/$so" ]]; then echo "$d"; return 0; fi
  done
  d="$(timeout 20 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$so" -print -quit 2>/dev/null || true)"
  [[ -n "$d" ]] && { dirname "$d"; return 0; }
  return 1
}
for _gb_so in $BUNDLE_TARGET_LIBS; do
  if _gb_dir="$(_gb_find_lib "$_gb_so")"; then
    case ":$GPU_BUNDLE_LD_PATH:" in *":$_gb_dir:"*) ;; *) GPU_BUNDLE_LD_PATH+=":$_gb_dir" ;; esac
    _gb_note "$_gb_so: $_gb_dir"
  else
    GPU_BUNDLE_MISSING+="$_gb_so "
    _gb_note "$_gb_so: NOT FOUND on this machine"
  fi
done

# glibc: this machine's if it is at least the bundle's, else the bundled copy.
_gb_glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
[[ -n "$_gb_glibc" ]] || _gb_glibc=0
_gb_older() {  # a b: is a < b (major.minor)
  local a1="${1%%.*}" a2="${1#*.}" b1="${2%%.*}" b2="${2#*.}"
  (( a1 < b1 || (a1 == b1 && a2 < b2) ))
}
if _gb_older "$_gb_glibc" "$BUNDLE_GLIBC" && [[ -x "$GPU_BUNDLE_DIR/lib/glibc/ld-linux-x86-64.so.2" ]]; then
  GPU_BUNDLE_LOADER="$GPU_BUNDLE_DIR/lib/glibc/ld-linux-x86-64.so.2"
  GPU_BUNDLE_LD_PATH="$GPU_BUNDLE_DIR/lib/glibc:$GPU_BUNDLE_LD_PATH"
  _gb_note "glibc $_gb_glibc here < $BUNDLE_GLIBC built against: using the bundled glibc loader"
else
  _gb_note "glibc $_gb_glibc here (bundle built on $BUNDLE_GLIBC): the system's"
fi
# The driver's folder where it is not in the linker cache (the lent machines
# mount it read-only at /usr/local/nvidia).
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  for _gb_d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib64/nvidia; do
    [[ -e "$_gb_d/libcuda.so.1" ]] && GPU_BUNDLE_LD_PATH+=":$_gb_d" && break
  done
fi
GPU_BUNDLE_ENV_FOR="$GPU_BUNDLE_DIR"
export GPU_BUNDLE_DIR GPU_BUNDLE_LD_PATH GPU_BUNDLE_LOADER GPU_BUNDLE_MISSING GPU_BUNDLE_NOTES \
  GPU_BUNDLE_ENV_FOR GPU_BUNDLE_XBIN
unset _gb_gz _gb_so _gb_dir _gb_glibc _gb_d _gb_unpack_dir _gb_tar
