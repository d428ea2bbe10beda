"""Reading allocsampler datasets and finding memory problems in them."""

import os
import sys

# Arrow's allocator, chosen before pyarrow is first imported (only then does Arrow read it; a choice
# in the environment is kept): jemalloc with one arena. Against the default (mimalloc), on
# scripts/bench_analysis.py's day and week on top of 8018b5b on 2026-11-29: peak RSS 236-242 -> 205-210 MiB
# and 284-289 -> 258-268 MiB, 0-10% faster; the system allocator saved as much and was 10% slower.
if "pyarrow" not in sys.modules and "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "jemalloc"
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "narenas:1")
