"""Reading allocsampler datasets and finding memory problems in them."""

import os
import sys

# Arrow's allocator, chosen before pyarrow is first imported (a choice in the environment is
# kept): jemalloc with one arena. Against the default (mimalloc), on scripts/bench_analysis.py's
# day and week on top of 8018b5b on 2026-11-29: peak RSS 236-242 -> 205-210 MiB and 284-289 ->
# 258-268 MiB, 0-10% faster; the system allocator saved as much and was 10% slower. The variables
# are set only while the pool and jemalloc are made: processes started later (a recorded command,
# a server) do not inherit them.
if "pyarrow" not in sys.modules and "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
    _added = {"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"}
    if "JE_ARROW_MALLOC_CONF" not in os.environ:
        _added["JE_ARROW_MALLOC_CONF"] = "narenas:1"
    os.environ.update(_added)
    try:
        import pyarrow

        pyarrow.allocate_buffer(1)      # the default pool, and jemalloc with its options, made now
    finally:
        for _k in _added:
            del os.environ[_k]
