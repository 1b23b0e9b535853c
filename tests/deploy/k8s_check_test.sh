#!/bin/bash
# Runs one check of tests/deploy/k8s_checks.py (its docstring lists them) with
# Debian's python3 (PyYAML, python3-jsonschema from scripts/debian-packages.txt).
set -euo pipefail
if ! command -v python3 >/dev/null 2>&1; then
  echo "SKIP: python3 is not installed (./tandem setup installs it)"
  exit 0
fi
if ! python3 -c 'import yaml' 2>/dev/null; then
  echo "SKIP: PyYAML is not installed (Debian python3-yaml; ./tandem setup installs it)"
  exit 0
fi
exec python3 tests/deploy/k8s_checks.py "$@"
