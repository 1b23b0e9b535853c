#!/bin/bash
# promtool over the monitoring configuration:
#   - check config: prometheus.yml (with a targets file as `./tandem up` writes
#     it) and prometheus-kubernetes.yml, with the rules file each loads;
#   - check rules: rules.yml;
#   - test rules: the alert unit tests in rules_test.yml (alerts that must fire
#     and must not fire on synthetic series).
# Fails (does not skip) when promtool is missing: ./tandem setup installs it.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
  echo "FAIL: promtool is not installed (Debian package prometheus); run ./tandem setup" >&2
  exit 1
fi
src="deploy/monitoring"
work="${TEST_TMPDIR:-$(mktemp -d)}/monitoring"
mkdir -p "$work/deploy/monitoring" "$work/.cache/run"
cp "$src/prometheus.yml" "$src/prometheus-kubernetes.yml" "$src/rules.yml" \
  "$src/rules_test.yml" "$work/deploy/monitoring/"

# A targets file in the shape `./tandem up` writes, where prometheus.yml looks.
cat >"$work/.cache/run/prometheus_targets.json" <<'JSON'
[
  {"targets": ["127.0.0.1:9100"], "labels": {"component": "router", "process": "router"}},
  {"targets": ["127.0.0.1:9110"], "labels": {"component": "prefill", "process": "prefill-0"}},
  {"targets": ["127.0.0.1:9111"], "labels": {"component": "decode", "process": "decode-0"}},
  {"targets": ["127.0.0.1:8000"], "labels": {"component": "gateway", "process": "gateway"}}
]
JSON
cd "$work/deploy/monitoring"
out="$(promtool check config prometheus.yml 2>&1)" || { echo "$out" >&2; exit 1; }
echo "$out"
if grep -q WARNING <<<"$out"; then
  echo "FAIL: promtool warned (the targets file was not found or not read)" >&2
  exit 1
fi

# Debian's promtool is built without Kubernetes service discovery; where it has
# it, check the file as is, else check everything else in it (relabelling
# regexes, rules) with the discovery block replaced by a static target.
k8s_out="$(promtool check config prometheus-kubernetes.yml 2>&1)" && echo "$k8s_out" || {
  if grep -q 'field kubernetes_sd_configs not found' <<<"$k8s_out"; then
    echo "promtool lacks kubernetes_sd_configs; checking the rest of the file"
    awk '
      /^ *kubernetes_sd_configs:/ { ind = index($0, "k"); print substr($0, 1, ind - 1) "static_configs:"; skip = 1; next }
      skip && /^ *- role: pod/ { print substr($0, 1, index($0, "-") - 1) "- targets: [\"10.0.0.1:9100\"]"; skip = 0; next }
      { print }
    ' prometheus-kubernetes.yml >k8s_static.yml
    grep -q 'static_configs' k8s_static.yml || { echo "FAIL: rewrite failed" >&2; exit 1; }
    promtool check config k8s_static.yml
  else
    echo "$k8s_out" >&2
    exit 1
  fi
}

promtool check rules rules.yml
promtool test rules rules_test.yml
echo "PASS"
