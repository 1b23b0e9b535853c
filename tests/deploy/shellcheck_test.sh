#!/bin/bash
# Runs shellcheck over the deploy and image scripts (the image's entry points, the
# image builder, these tests); then shows it catches a broken script.
set -euo pipefail
if ! command -v shellcheck >/dev/null 2>&1; then
  echo "SKIP: shellcheck is not installed (Debian shellcheck; ./tandem setup installs it)"
  exit 0
fi
scripts=(
  tools/image/tandem-allinone.sh
  tools/image/fetch-weights.sh
  tools/image/build_image.sh
  tools/tls_pki.sh
  deploy/k8s/tls/make-secrets.sh
  tests/deploy/k8s_check_test.sh
  tests/deploy/yamllint_test.sh
  tests/deploy/shellcheck_test.sh
  tests/deploy/terraform_test.sh
  tests/deploy/image_test.sh
  tests/deploy/allinone_test.sh
)
for s in "${scripts[@]}"; do
  [[ -f "$s" ]] || { echo "FAIL: $s is missing" >&2; exit 1; }
done
shellcheck -x "${scripts[@]}"
echo "shellcheck: ${#scripts[@]} scripts clean"
bad="${TEST_TMPDIR:-$(mktemp -d)}/bad.sh"
# The broken script's $1 is meant literally.
# shellcheck disable=SC2016
printf '#!/bin/bash\nrm -rf $1/*\n' >"$bad"
if shellcheck "$bad" >/dev/null 2>&1; then
  echo "FAIL: shellcheck accepted an unquoted rm -rf \$1/*" >&2
  exit 1
fi
