#!/bin/bash
# Pillow oracle: oracle.py (Debian's python3-pil) writes the corpus and the
# reference outputs; oracle_check compares engine/media's pipeline with them.
set -euo pipefail
oracle="$1"
check="$2"
corpus="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
/usr/bin/python3 "$oracle" "$corpus"
"$check" "$corpus"
