#!/bin/bash
# tandem-allinone: the router, one decode worker that prefills its own prompts
# (the router's --colocate_below_tokens above any prompt) and the OpenAI gateway in
# one container: the shape of HyperPod's Inference Operator, one model server per
# pod (deploy/k8s/overlays/hyperpod-p6-b300/inference-endpoint). Installed in the
# image as /opt/tandem/bin/tandem-allinone.
#
#   SIGTERM -> gateway (drains for --shutdown_grace_s) -> worker -> router
#   any process exits -> the others are stopped, the container exits with its status
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tandem-allinone --model DIR [--tp N] [--backend NAME] [--port PORT]
                       [--router-arg FLAG]... [--worker-arg FLAG]... [--gateway-arg FLAG]...
                       [--router-port=N] [--router-metrics-port=N] [--worker-port=N]
                       [--worker-metrics-port=N] [--dry-run]

Runs router + one colocated decode worker + gateway. The gateway listens on
0.0.0.0:PORT (default 8000; /v1, /health, /metrics); the router (127.0.0.1:50051,
/metrics 9100) on loopback; the worker on 0.0.0.0:50061 (/metrics 9101), so that
the kubelet's gRPC probes reach its health service (SERVING once the weights are
loaded), reached by the router on loopback. Each port changes with its option.
--dry-run prints the three command lines ("router: ...", "worker: ...",
"gateway: ...") and exits. TANDEM_BIN_DIR names the binaries' folder (default:
this script's).
USAGE
}

bin_dir="${TANDEM_BIN_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
model="" tp=1 backend=cpu port=8000 dry_run=0
router_port=50051 router_metrics=9100 worker_port=50061 worker_metrics=9101
router_extra=() worker_extra=() gateway_extra=()
while (($#)); do
  case "$1" in
    --model) model="$2"; shift ;;
    --model=*) model="${1#*=}" ;;
    --tp) tp="$2"; shift ;;
    --tp=*) tp="${1#*=}" ;;
    --backend) backend="$2"; shift ;;
    --backend=*) backend="${1#*=}" ;;
    --port) port="$2"; shift ;;
    --port=*) port="${1#*=}" ;;
    --router-port=*) router_port="${1#*=}" ;;
    --router-metrics-port=*) router_metrics="${1#*=}" ;;
    --worker-port=*) worker_port="${1#*=}" ;;
    --worker-metrics-port=*) worker_metrics="${1#*=}" ;;
    --router-arg) router_extra+=("$2"); shift ;;
    --router-arg=*) router_extra+=("${1#*=}") ;;
    --worker-arg) worker_extra+=("$2"); shift ;;
    --worker-arg=*) worker_extra+=("${1#*=}") ;;
    --gateway-arg) gateway_extra+=("$2"); shift ;;
    --gateway-arg=*) gateway_extra+=("${1#*=}") ;;
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "tandem-allinone: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$model" ]] || { echo "tandem-allinone: --model DIR is required" >&2; exit 2; }

router_cmd=("$bin_dir/router_main" "--model=$model" "--host=127.0.0.1" "--port=$router_port"
  "--metrics_port=$router_metrics" --colocate_below_tokens=2147483647 --log_process=router
  ${router_extra[@]+"${router_extra[@]}"})
worker_cmd=("$bin_dir/decode_main" "--model=$model" "--router=127.0.0.1:$router_port"
  --worker_id=decode-0 --host=0.0.0.0 --advertise_host=127.0.0.1 "--port=$worker_port" "--metrics_port=$worker_metrics"
  "--tp=$tp" "--backend=$backend" --max_lease_s=3600 --log_process=decode-0
  ${worker_extra[@]+"${worker_extra[@]}"})
gateway_cmd=("$bin_dir/gateway_main" "--model=$model" "--router=127.0.0.1:$router_port"
  --host=0.0.0.0 "--port=$port" --shutdown_grace_s=600 --log_process=gateway
  ${gateway_extra[@]+"${gateway_extra[@]}"})

if ((dry_run)); then
  echo "router: ${router_cmd[*]}"
  echo "worker: ${worker_cmd[*]}"
  echo "gateway: ${gateway_cmd[*]}"
  exit 0
fi

pids=()
stop_all() {
  trap - TERM INT
  local i
  # Reverse start order: the gateway drains first, the router goes last.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
}
trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 130' INT

"${router_cmd[@]}" &
pids+=($!)
"${worker_cmd[@]}" &
pids+=($!)
"${gateway_cmd[@]}" &
pids+=($!)

status=0
wait -n || status=$?
echo "tandem-allinone: a process exited (status $status); stopping the others" >&2
stop_all
exit "$status"
