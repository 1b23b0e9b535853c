#!/bin/bash
# yamllint (deploy/.yamllint) over every YAML file of deploy/k8s and the monitoring
# kustomization; then shows the linter catches a broken file.
set -euo pipefail
if ! command -v yamllint >/dev/null 2>&1; then
  echo "SKIP: yamllint is not installed (Debian yamllint; ./tandem setup installs it)"
  exit 0
fi
mapfile -t files < <(find -L deploy/k8s deploy/monitoring/kustomization.yaml \
  -name '*.yaml' ! -path 'deploy/k8s/crds/*' | LC_ALL=C sort)
(( ${#files[@]} >= 15 )) || { echo "FAIL: only ${#files[@]} YAML files found" >&2; exit 1; }
yamllint --strict -c deploy/.yamllint "${files[@]}"
echo "yamllint: ${#files[@]} files clean"
bad="${TEST_TMPDIR:-$(mktemp -d)}/bad.yaml"
printf 'a: 1\na: 2\nb:   [x,y]   \n' >"$bad"
if yamllint --strict -c deploy/.yamllint "$bad" >/dev/null 2>&1; then
  echo "FAIL: yamllint accepted duplicate keys and trailing spaces" >&2
  exit 1
fi
