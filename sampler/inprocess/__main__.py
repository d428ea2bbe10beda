"""`python -m sampler.inprocess`: build the in-process code (preload shim, injected sampler,
placement helper) now and print where each is (scripts/setup.sh runs this)."""

import sys

from sampler.errors import AllocsamplerError
from sampler.inprocess import inject, preload

try:
    for path in (preload.shim_path(), *inject.built()):
        print(path)
except AllocsamplerError as e:
    print(f"allocsampler: error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
