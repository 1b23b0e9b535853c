#!/bin/bash
# Builds Tandem's container image from Debian 12 packages (`./tandem image` stages
# the binaries and calls this; run that, not this).
#
#   staged binaries --ldd--> the shared libraries they load --dpkg -S--> the
#   Debian packages that ship them (no compilers, no -dev packages)
#   mmdebstrap bookworm (essential variant + those packages) -> rootfs
#   + /opt/tandem/{bin,lib,models} + user tandem (10001) -> umoci -> OCI layout
#
# Libraries no Debian package owns (the CUDA toolkit's libcudart, cuBLAS, NCCL in
# a --config=cuda build) are copied into /opt/tandem/lib; the NVIDIA driver's
# libcuda/libnvidia-* come from the node at run time (the NVIDIA container toolkit)
# and are not copied. Debian packages come from the host's apt sources (or
# TANDEM_IMAGE_MIRROR), the only download.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: build_image.sh --stage DIR --out DIR --tag TAG [--variant cpu|cuda]

--stage DIR holds bin/ (the programs), models/ (optional) and revision (git
revision); the OCI image layout is written to --out DIR as tandem:TAG.
USAGE
}

stage="" out="" tag="" variant=cpu
while (($#)); do
  case "$1" in
    --stage) stage="$2"; shift ;;
    --out) out="$2"; shift ;;
    --tag) tag="$2"; shift ;;
    --variant) variant="$2"; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build_image.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$stage" && -n "$out" && -n "$tag" ]] || { usage >&2; exit 2; }
for tool in mmdebstrap umoci ldd dpkg-query chroot; do
  command -v "$tool" >/dev/null || { echo "build_image.sh: $tool is not installed (./tandem setup)" >&2; exit 1; }
done
[[ "$(id -u)" == 0 ]] || { echo "build_image.sh: run as root (mmdebstrap root mode, umoci unpack)" >&2; exit 1; }

say() { echo "image: $*" >&2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/tandem-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# ---- the Debian packages the binaries need, and the libraries none owns
: >"$work/libs"
for f in "$stage"/bin/*; do
  [[ "$(head -c 4 "$f" | tail -c 3)" == ELF ]] || continue
  ldd "$f" >"$work/ldd" || true
  if grep 'not found' "$work/ldd" | grep -v -E 'libcuda\.so|libnvidia-' >&2; then
    echo "build_image.sh: $f has unresolved libraries (above)" >&2
    exit 1
  fi
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' "$work/ldd" >>"$work/libs"
done
declare -A pkgs=()
declare -A loose=()
while read -r lib; do
  real="$(readlink -f "$lib")"
  owner=""
  # usrmerge: ldd names /lib/..., dpkg may know /usr/lib/... (or the other way).
  for p in "$lib" "$real" "/usr$lib" "${lib#/usr}" "/usr$real" "${real#/usr}"; do
    owner="$(dpkg-query -S "$p" 2>/dev/null | head -n 1 || true)"
    [[ -z "$owner" ]] || break
  done
  if [[ -n "$owner" ]]; then
    # "libfoo1:amd64: /usr/lib/..." -> libfoo1:amd64
    pkgs["${owner%%: *}"]=1
  else
    case "$(basename "$lib")" in
      libcuda.so* | libnvidia-*) ;;  # the node's driver provides these
      *) loose["$lib"]=1 ;;
    esac
  fi
done < <(LC_ALL=C sort -u "$work/libs")
# Runtime tools the image's scripts use (bash, coreutils, findutils come with the
# essential variant): ca-certificates for TLS, procps for debugging.
include="ca-certificates,procps,$(printf '%s\n' "${!pkgs[@]}" | sed 's/:amd64$//' | LC_ALL=C sort -u | paste -sd, -)"
say "Debian packages: $(tr ',' ' ' <<<"$include")"
((${#loose[@]} == 0)) || say "libraries from outside Debian (copied to /opt/tandem/lib): ${!loose[*]}"

# ---- the root file system
mirror=()
if [[ -n "${TANDEM_IMAGE_MIRROR:-}" ]]; then mirror=("$TANDEM_IMAGE_MIRROR"); fi
rev="$(cat "$stage/revision")"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(cat "$stage/source_date_epoch" 2>/dev/null || date +%s)}"
mkdir -p "$work/bundle"
rootfs="$work/rootfs"
say "mmdebstrap bookworm ($variant) -> $rootfs"
# The hook's "$1" is expanded by mmdebstrap's shell (the root's path), not here.
# shellcheck disable=SC2016
mmdebstrap --mode=root --variant=essential --quiet \
  --include="$include" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/* "$1"/etc/machine-id "$1"/var/cache/ldconfig/aux-cache' \
  bookworm "$rootfs" ${mirror[@]+"${mirror[@]}"}

install -d -m 0755 "$rootfs/opt/tandem/bin" "$rootfs/opt/tandem/lib" "$rootfs/opt/tandem/models"
cp -L "$stage"/bin/* "$rootfs/opt/tandem/bin/"
chmod 0755 "$rootfs"/opt/tandem/bin/*
if [[ -d "$stage/models" ]]; then cp -rL "$stage/models/." "$rootfs/opt/tandem/models/"; fi
for lib in "${!loose[@]}"; do cp -L "$lib" "$rootfs/opt/tandem/lib/"; done
echo /opt/tandem/lib >"$rootfs/etc/ld.so.conf.d/tandem.conf"
chroot "$rootfs" /sbin/ldconfig
# The non-root user every Tandem container runs as (the manifests' runAsUser).
echo 'tandem:x:10001:10001:Tandem:/home/tandem:/usr/sbin/nologin' >>"$rootfs/etc/passwd"
echo 'tandem:x:10001:' >>"$rootfs/etc/group"
echo 'tandem:!:19000::::::' >>"$rootfs/etc/shadow"
install -d -m 0750 -o 10001 -g 10001 "$rootfs/home/tandem"
echo "$rev" >"$rootfs/opt/tandem/REVISION"
# Every binary starts inside the root (its libraries resolve there).
for f in "$rootfs"/opt/tandem/bin/*_main; do
  if ! chroot "$rootfs" "/opt/tandem/bin/$(basename "$f")" --help >/dev/null 2>"$work/err"; then
    # --help exits 1 (as Abseil's); a missing library exits 127 with a loader message.
    if grep -q 'error while loading shared libraries' "$work/err"; then
      cat "$work/err" >&2
      exit 1
    fi
  fi
done
find "$rootfs" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0 -r touch -h -d "@$SOURCE_DATE_EPOCH"

# ---- OCI image
rm -rf "$out"
mkdir -p "$(dirname "$out")"
umoci init --layout "$out"
umoci new --image "$out:$tag"
umoci unpack --image "$out:$tag" "$work/bundle"
rm -rf "$work/bundle/rootfs"
mv "$rootfs" "$work/bundle/rootfs"
umoci repack --image "$out:$tag" --history.created "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)" \
  --history.created_by "tandem image ($variant, $rev)" "$work/bundle"
umoci config --image "$out:$tag" \
  --created "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)" \
  --author "Tandem" \
  --config.user 10001:10001 \
  --config.workingdir /home/tandem \
  --config.env PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.cmd /opt/tandem/bin/router_main --config.cmd --help \
  --config.label "org.opencontainers.image.revision=$rev" \
  --config.label "org.opencontainers.image.title=tandem" \
  --config.label "org.opencontainers.image.source=https://example.invalid/tandem" \
  --config.label "dev.tandem.variant=$variant" \
  --config.exposedports 8000/tcp --config.exposedports 50051/tcp
umoci gc --layout "$out"
say "built $out:$tag"
