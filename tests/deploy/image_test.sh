#!/bin/bash
# The container image (`./tandem image`), only with TANDEM_TEST_IMAGE=1 (building it
# downloads Debian packages and takes minutes; `./tandem image --test` builds it and
# runs this). TANDEM_IMAGE=LAYOUT:TAG names it (default: the newest tag in
# .cache/image/tandem-oci). Checks:
#   - the config: user 10001 (non-root), the git revision label = the tag's;
#   - the root: every Tandem program, the tiny checkpoint; no compiler, no -dev package;
#   - every binary's libraries resolve inside the root;
#   - the root serves: tandem-allinone (router + colocated decode worker + gateway)
#     from the unpacked image, as user 10001 in a chroot, answers one chat
#     completion over HTTP. With podman (as root) the same runs as a container;
#     without it, that part says it was skipped.
set -euo pipefail
if [[ "${TANDEM_TEST_IMAGE:-}" != 1 ]]; then
  echo "SKIP: set TANDEM_TEST_IMAGE=1 to test the image (./tandem image --test)"
  exit 0
fi
fail() { echo "FAIL: $*" >&2; exit 1; }
export PATH="$PATH:/usr/sbin:/sbin"  # chroot, mount (Bazel's strict PATH lacks them)
command -v umoci >/dev/null || fail "umoci is not installed (./tandem setup)"
[[ "$(id -u)" == 0 ]] || fail "needs root (umoci unpack, chroot)"
image="${TANDEM_IMAGE:-}"
if [[ -z "$image" ]]; then
  layout="${TANDEM_CACHE_DIR:-.cache}/image/tandem-oci"
  [[ -d "$layout" ]] || fail "no image at $layout (./tandem image)"
  image="$layout:$(umoci ls --layout "$layout" | tail -n 1)"
fi
layout="${image%:*}" tag="${image##*:}"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/image-test.XXXXXX")"
pids=()
cleanup() {
  local p
  for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null || true; done
  for p in ${pids[@]+"${pids[@]}"}; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# ---- config
blob_config() {
  # The image config blob, found through the index and manifest.
  python3 - "$layout" "$tag" <<'PY'
import json, sys, os
layout, tag = sys.argv[1], sys.argv[2]
def blob(d):
    alg, h = d.split(":")
    return json.load(open(os.path.join(layout, "blobs", alg, h)))
idx = json.load(open(os.path.join(layout, "index.json")))
m = [m for m in idx["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag][0]
man = blob(m["digest"])
print(json.dumps(blob(man["config"]["digest"])))
PY
}
cfg="$(blob_config)"
user="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["config"].get("User",""))' "$cfg")"
[[ "$user" == 10001:10001 ]] || fail "image user is '$user', not 10001:10001"
label="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["config"]["Labels"]["org.opencontainers.image.revision"])' "$cfg")"
[[ "$tag" == "$label"* ]] || fail "tag $tag does not carry the revision label $label"
echo "config: user $user, revision $label"

# ---- root file system
umoci unpack --image "$image" "$work/bundle" >/dev/null
root="$work/bundle/rootfs"
for p in router_main prefill_main decode_main gateway_main health_check tandem-allinone tandem-fetch-weights; do
  [[ -x "$root/opt/tandem/bin/$p" ]] || fail "/opt/tandem/bin/$p missing"
done
[[ -f "$root/opt/tandem/models/tiny-seed0/config.json" ]] || fail "the tiny checkpoint is missing"
for c in gcc g++ cc c++ clang ld as make; do
  [[ ! -e "$root/usr/bin/$c" ]] || fail "compiler or build tool /usr/bin/$c in the image"
done
devs="$(chroot "$root" dpkg-query -W -f "\${Package}\n" | grep -E -- '-dev$' || true)"
[[ -z "$devs" ]] || fail "-dev packages in the image: $devs"
for f in "$root"/opt/tandem/bin/*_main; do
  if chroot "$root" /usr/bin/ldd "/opt/tandem/bin/$(basename "$f")" | grep 'not found' | grep -v -E 'libcuda|libnvidia'; then
    fail "$(basename "$f") has unresolved libraries in the image"
  fi
done
echo "root: programs, tiny checkpoint, no compilers or -dev packages, libraries resolve ($(du -sh "$root" | cut -f1) unpacked)"

# ---- serve one request from the image's root
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mounted=()
for m in proc dev sys; do
  if mount --bind "/$m" "$root/$m" 2>/dev/null; then mounted+=("$root/$m"); fi
done
# A memory-backed /dev/shm of its own (UCX's shared-memory transport), as the pods'.
if mount -t tmpfs -o mode=1777,size=1g tmpfs "$root/dev/shm" 2>/dev/null; then
  mounted+=("$root/dev/shm")
fi
umount_all() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
}
trap 'umount_all; cleanup' EXIT
gw="$(free_port)" rp="$(free_port)" rm_="$(free_port)" wp="$(free_port)" wm="$(free_port)"
chroot --userspec=10001:10001 "$root" /usr/bin/env HOME=/home/tandem \
  /opt/tandem/bin/tandem-allinone --model=/opt/tandem/models/tiny-seed0 --port="$gw" \
  --router-port="$rp" --router-metrics-port="$rm_" --worker-port="$wp" --worker-metrics-port="$wm" \
  --worker-arg=--kv_cache_memory=256MiB --worker-arg=--max_num_seqs=4 \
  >"$work/allinone.log" 2>&1 &
pids+=($!)
body='{"model":"kimi-k3","messages":[{"role":"user","content":"Hello"}],"max_tokens":4}'
ok=0
for _ in $(seq 1 240); do
  if out="$(curl -sf -m 30 "http://127.0.0.1:$gw/v1/chat/completions" -H 'content-type: application/json' -d "$body" 2>/dev/null)"; then
    ok=1
    break
  fi
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.5
done
if ((ok == 0)); then
  tail -n 40 "$work/allinone.log" >&2
  fail "tandem-allinone from the image did not answer a chat completion"
fi
python3 -c 'import json,sys; r=json.loads(sys.argv[1]); assert r["choices"][0]["message"]["content"] is not None and r["usage"]["completion_tokens"] > 0, r' "$out" ||
  fail "unexpected completion: $out"
echo "served: $out"
kill -TERM "${pids[0]}"
wait "${pids[0]}" || true
pids=()

if command -v podman >/dev/null 2>&1; then
  podman run --rm --network host "oci:$layout:$tag" /opt/tandem/bin/router_main --help >/dev/null 2>&1 ||
    [[ $? == 1 ]] || fail "podman could not run the image"
  echo "podman: ran router_main --help in the image"
else
  echo "podman: skipped (not installed; the chroot above ran the image's root instead)"
fi
echo "PASS"
