"""`python -m sampler.cli`: the same as the `allocsampler` command."""

import sys

from sampler.cli import entry

sys.exit(entry())
