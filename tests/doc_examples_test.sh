#!/bin/bash
# The README's and docs' `./tandem ...` example commands, as written, are accepted
# by the subcommands they name (tests/doc_examples.py says how each is checked).
set -euo pipefail
exec python3 tests/doc_examples.py "$@"
