#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, as root:  sudo bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
.venv/bin/ruff check .
# two workers, each module's tests on one of them in order (its fixtures and the state its tests
# hand on): a test runs beside another module's, which the tests tolerate (a daemon's or
# recorder's state is its own; what judges load, loads the machine itself)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
