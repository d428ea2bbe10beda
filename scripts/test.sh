#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, as root:  sudo bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
