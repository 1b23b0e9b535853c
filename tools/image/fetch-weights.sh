#!/bin/bash
# tandem-fetch-weights SRC DST: copies a checkpoint directory (e.g. FSx for Lustre)
# to local disk (the node's NVMe) with TANDEM_FETCH_JOBS parallel copies (default
# 16), once: DST/.tandem-complete records the source's file list and sizes, and a
# later run whose source lists the same skips the copy (any other DST is deleted
# and copied again). Files are copied under
# temporary names and renamed, so an interrupted copy is never taken for complete.
# Ownership goes to TANDEM_FETCH_OWNER (default 10001:10001, the image's user).
# Installed in the image as /opt/tandem/bin/tandem-fetch-weights.
set -euo pipefail

if [[ $# -ne 2 || "$1" == "--help" ]]; then
  echo "Usage: tandem-fetch-weights SRC_DIR DST_DIR" >&2
  exit 2
fi
src="${1%/}" dst="${2%/}"
jobs="${TANDEM_FETCH_JOBS:-16}"
owner="${TANDEM_FETCH_OWNER:-10001:10001}"
[[ -d "$src" ]] || { echo "tandem-fetch-weights: no directory $src" >&2; exit 1; }

manifest="$(cd "$src" && find . -type f -printf '%P %s\n' | LC_ALL=C sort)"
[[ -n "$manifest" ]] || { echo "tandem-fetch-weights: $src holds no files" >&2; exit 1; }
if [[ -f "$dst/.tandem-complete" ]] && [[ "$(cat "$dst/.tandem-complete")" == "$manifest" ]]; then
  echo "tandem-fetch-weights: $dst is complete ($(wc -l <<<"$manifest") files); nothing to copy"
  exit 0
fi

start=$SECONDS
# An incomplete or different copy is removed, not resumed.
rm -rf -- "$dst"
mkdir -p "$dst"
(cd "$src" && find . -type d -printf '%P\n') | while IFS= read -r d; do
  [[ -z "$d" ]] || mkdir -p "$dst/$d"
done
export src dst
# The single-quoted script is expanded by the sh that xargs runs, not here.
# shellcheck disable=SC2016
(cd "$src" && find . -type f -printf '%P\0') |
  xargs -0 -r -n 1 -P "$jobs" sh -c 'cp -- "$src/$1" "$dst/$1.part" && mv -f -- "$dst/$1.part" "$dst/$1"' copy
copied="$(cd "$dst" && find . -type f ! -name .tandem-complete -printf '%P %s\n' | LC_ALL=C sort)"
if [[ "$copied" != "$manifest" ]]; then
  echo "tandem-fetch-weights: $dst does not match $src after the copy" >&2
  exit 1
fi
chown -R "$owner" "$dst" 2>/dev/null || echo "tandem-fetch-weights: warning: cannot chown $dst to $owner" >&2
printf '%s\n' "$manifest" >"$dst/.tandem-complete.part"
mv -f "$dst/.tandem-complete.part" "$dst/.tandem-complete"
echo "tandem-fetch-weights: copied $(wc -l <<<"$manifest") files to $dst in $((SECONDS - start)) s"
