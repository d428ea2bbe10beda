"""pymalloc's arenas read from outside (sampler/proc/pymalloc.py) against what a target can make of
them: a reservation of many GiB costs a bounded scan, and headers that only look valid (forged at
16 KiB-aligned places, or one arena's index spread over more than an arena) are not counted.
The real thing, against CPython's own accounting: tests/analysis/test_pinning.py."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

from sampler.proc.memory import sample_process
from sampler.proc.pymalloc import pymalloc_row

# a header of size class 3 (64-byte blocks) with 10 blocks in use, arena index 999 (the child's own
# arenas, it being a Python, are a handful)
FORGER = r"""
import ctypes, mmap, struct, sys
size = int(sys.argv[1]) << 30
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
base = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)   # MAP_NORESERVE
pool = (base + 16383) & ~16383
header = struct.pack("<QQQQIIII", 10, 0, 0, 0, 999, 3, 48 + 11 * 64, 16384 - 64)
for at in (pool, pool + (4 << 20)):            # one arena's index, 4 MiB apart: no arena spans that
    ctypes.memmove(at, header, len(header))
print(hex(pool), flush=True)
sys.stdin.readline()
"""


def test_a_huge_reservation_and_forged_headers_cost_a_bounded_scan_and_count_nothing():
    child = subprocess.Popen([sys.executable, "-c", FORGER, "96"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        child.stdout.readline()
        regions = sample_process(child.pid).breakdown.regions
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.process_time()
        row = pymalloc_row(child.pid, regions)
        cpu = time.process_time() - t0
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        # 96 GiB is over the scan's 64 GiB of address space: given up, after reading its page map
        # a window at a time (never the 192 MiB of it at once)
        assert row is None
        assert grown < 16 << 10, f"the scan grew our RSS by {grown} KiB"
        assert cpu < 5.0, cpu
        # under the bound: scanned (the child's own arenas are found), and the two pools that claim
        # one arena 4 MiB apart are not counted as one
        small = subprocess.Popen([sys.executable, "-c", FORGER, "1"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            pool = int(small.stdout.readline(), 16)
            pins = []
            row = pymalloc_row(small.pid, sample_process(small.pid).breakdown.regions, pins)
            assert row is not None and row["heaps"] >= 1
            spans = [(p.start, p.start + len(p.ratio) * 4096) for p in pins]
            assert not any(lo <= at < hi for lo, hi in spans for at in (pool, pool + (4 << 20))), spans
        finally:
            small.kill()
            small.wait()
    finally:
        child.kill()
        child.wait()
