#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, as root:  sudo bash scripts/test.sh [PYTEST ARGS]
# Two workers (pytest-xdist), each module's tests on one of them in order; then the tests marked
# `serial` (they time things, a CPU-heavy neighbour starves them, or they starve neighbours) alone.
# PYTEST ARGS go to both.
# A test that failed beside the other worker is run once more alone, after the serial step: on two
# CPUs most of these tests record real processes, and a neighbour that starves a recorded workload
# changes what it allocates while recorded. It passes the suite only if it passes alone, and is
# then named in the last lines ("passed only alone"), so a flake is seen, not hidden. A test that
# fails alone, or more than MAX_ALONE of them, fails the suite.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
.venv/bin/ruff check .
workers=${ALLOCSAMPLER_TEST_WORKERS:-2}
MAX_ALONE=3
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
rc=0
.venv/bin/python -m pytest -q -o cache_dir="$cache" \
    -n "$workers" --dist loadfile -m "not serial" "$@" || rc=$?
[ "$rc" -eq 5 ] && rc=0         # 5: no test selected (PYTEST ARGS named serial tests only)
mapfile -t failed < <(.venv/bin/python -c 'import json, sys
try:
    print("\n".join(json.load(open(sys.argv[1]))))
except FileNotFoundError:
    pass' "$cache/v/cache/lastfailed")
rc2=0
.venv/bin/python -m pytest -q -p no:cacheprovider -m serial "$@" || rc2=$?
[ "$rc2" -eq 5 ] && rc2=0
if [ "$rc" -eq 1 ] && [ ${#failed[@]} -ge 1 ] && [ ${#failed[@]} -le $MAX_ALONE ]; then
    echo "test.sh: ${#failed[@]} test(s) failed beside the other worker; each is run once more alone:"
    printf '  %s\n' "${failed[@]}"
    rc=0
    .venv/bin/python -m pytest -q -p no:cacheprovider "${failed[@]}" || rc=$?
    [ "$rc" -eq 0 ] && { echo "test.sh: passed only alone (a flake beside a neighbour: look at it):"; printf '  %s\n' "${failed[@]}"; }
fi
exit $(( rc != 0 ? rc : rc2 ))
