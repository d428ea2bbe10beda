#!/usr/bin/env bash
# Quickstart demo: set up, record the bundled leaking service for ~30 s, print the top stacks and
# the findings, and write an HTML report next to the dataset.
#   sudo bash scripts/demo.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/var/tmp/allocsampler-demo}
bash "$here/scripts/setup.sh"
rm -rf "$out"
echo "recording the demo service for 30 s into $out ..." >&2
# The service would run for 10 minutes; the recording ends after 30 s and stops it.
"$here/.venv/bin/allocsampler" record --out "$out" --duration 30 -- \
    "$here/.venv/bin/python" "$here/scripts/demo_workload.py" --seconds 600
echo
"$here/.venv/bin/allocsampler" analyze "$out"
"$here/.venv/bin/allocsampler" report "$out" --html "$out/report.html"
