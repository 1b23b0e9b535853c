#!/usr/bin/env bash
# kv_device_bench on the emulator, each path the workers take: staged through
# host memory in one process, and device to device into a second process's
# shareable memory (--two_processes, the IPC path). Every run must land the
# bytes exactly (checked by the bench: byte for byte, or the receiver
# process's XXH3-64 of its buffer) and end with its JSON line naming the path.
set -euo pipefail
BIN="${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-tandem}/worker/kv_device_bench"
[[ -x "$BIN" ]] || BIN="worker/kv_device_bench"
fail() { echo "FAIL: $*" >&2; exit 1; }
out="$(mktemp)"
run() {  # run PATH ARGS...: the run passes, its last line names PATH, exact
  local want="$1"; shift
  local rc=0
  "$BIN" --backend cuda_sim --mib 4 --iterations 1 "$@" >"$out" 2>&1 || rc=$?
  cat "$out"
  (( rc == 0 )) || fail "kv_device_bench $* exited $rc"
  local last
  last="$(tail -n 1 "$out")"
  [[ "$last" == '{'*'"bench":"kv_device"'* ]] || fail "the last line is not the JSON line: $last"
  [[ "$last" == *"\"path\":\"$want\""* ]] || fail "$*: path is not $want: $last"
  [[ "$last" == *'"exact":true'* ]] || fail "$*: the bytes differ"
  echo "$last"
}
staged="$(run staged --kv_buffer host | tail -n 1)"
[[ "$staged" == *'"direct_bytes":0'* ]] || fail "staged run wrote directly: $staged"
ipc="$(run device_ipc --kv_buffer host --two_processes | tail -n 1)"
[[ "$ipc" == *'"staged_to_host_bytes":0'* ]] || fail "the IPC run staged bytes: $ipc"
[[ "$ipc" == *'"direct_bytes":0'* ]] && fail "the IPC run wrote nothing directly: $ipc"
echo "PASS"
