"""CPython's small-object allocator (pymalloc) read from outside: one `malloc_arenas` row per
process with its arenas' resident, in-use, free and pinned bytes, and the pinned pages for the
recording to charge to the sampled Python objects on them (record/outstanding.py: `pinned`).

pymalloc (CPython 3.10 and later on 64-bit: 1 MiB arenas mapped anonymously, 16 KiB pools) gives an
arena back only when every pool in it is empty, and never returns a page of one that is not: a
few surviving objects keep whole arenas resident. Each pool starts, 16 KiB-aligned, with a
48-byte header (count of blocks in use, free list, list links, arena index, size class, next and
last offsets), so the pools are found by reading the first bytes of every resident 16 KiB of the
process's anonymous memory and keeping the headers whose fields agree with one another (the last
offset is exactly 16 KiB minus the block size of the class, the next offset a whole number of
blocks, the count within what the pool holds): no symbol of the interpreter is needed, and a
build with another layout (4 KiB pools before 3.10, a debug build) gives no pools, not a guess.
Like the glibc walk (arenas.py), reads are bounded (MAX_POOL_READS per process and snapshot),
never touch a page that is not resident, and race with the process: a count read while it
changes is off by what changed in between.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from sampler.proc.arenas import PAGE, PinMap
from sampler.proc.smaps import ANON

POOL = 16384
POOL_OVERHEAD = 48
CLASSES = 32                          # size classes of 16 bytes up to 512
ARENA = 1 << 20
_HEADER = struct.Struct("<QQQQIIII")  # ref.count (union with a pointer), freeblock, nextpool, prevpool,
                                      # arenaindex, szidx, nextoffset, maxnextoffset
MAX_POOL_READS = 1 << 16              # pool headers read per process and scan (~0.25 s, 1 GiB)
MAX_SCANNED = 64 << 30                # address space whose page map a scan reads (1 MiB of it per 128 MiB)
WINDOW = 256 << 20                    # the page map is read this much address space at a time (512 KiB)
MAX_ARENA_INDEX = 1 << 24


def _pool(raw: bytes, addr: int) -> tuple[int, int, int] | None:
    """(arena index, size class, blocks in use) of a valid pool header, else None."""
    count, free, _, _, arena, szidx, nxt, last = _HEADER.unpack(raw)
    count &= 0xFFFFFFFF
    if szidx >= CLASSES or arena >= MAX_ARENA_INDEX:
        return None
    size = (szidx + 1) * 16
    if last != POOL - size or not POOL_OVERHEAD <= nxt <= last + size or (nxt - POOL_OVERHEAD) % size:
        return None
    if count > (nxt - POOL_OVERHEAD) // size or (free and not addr + POOL_OVERHEAD <= free < addr + POOL):
        return None
    return arena, szidx, count


def pymalloc_row(pid: int, regions: list[tuple[int, int, str]], pins: list[PinMap] | None = None,
                 max_reads: int = MAX_POOL_READS) -> dict | None:
    """The pymalloc row of a process (None: no pools found, the process is gone, or the scan ran
    over its budget). With `pins`, each arena holding objects gets a PinMap over its span whose
    resident pages carry its free bytes per byte in use."""
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        pools = _scan(mem, pagemap, [(lo, hi) for lo, hi, kind in regions if kind == ANON], max_reads)
        if not pools:
            return None
        return _row(pagemap, pools, pins)
    finally:
        os.close(mem)
        os.close(pagemap)


def _scan(mem: int, pagemap: int, ranges: list[tuple[int, int]],
          max_reads: int) -> list[tuple[int, int, int, int]] | None:
    """(address, arena index, size class, count) of every pool in `ranges`; None over budget."""
    out = []
    reads = scanned = 0
    for lo, hi in ranges:
        # a reservation of many GiB (a JIT's, an allocator's) has a page map of many MiB: read in
        # windows, and over MAX_SCANNED in all the scan gives up
        for start in range((lo + POOL - 1) & ~(POOL - 1), hi - POOL + 1, WINDOW):
            end = min(hi, start + WINDOW)
            scanned += end - start
            if scanned > MAX_SCANNED:
                return None
            n = (end - start) // POOL
            raw = _pread(pagemap, start // PAGE * 8, n * POOL // PAGE * 8)
            entries = np.frombuffer(raw, "<u8", len(raw) // 8)
            present = (entries[:: POOL // PAGE][:n] >> np.uint64(63)).astype(bool)
            for k in np.nonzero(present)[0]:
                reads += 1
                if reads > max_reads:
                    return None
                addr = start + int(k) * POOL
                header = _pread(mem, addr, POOL_OVERHEAD)
                if len(header) == POOL_OVERHEAD and (p := _pool(header, addr)) is not None:
                    out.append((addr, *p))
    return out


def _pread(fd: int, offset: int, n: int) -> bytes:
    try:
        return os.pread(fd, n, offset)
    except OSError:
        return b""


def _row(pagemap: int, pools: list[tuple[int, int, int, int]], pins: list[PinMap] | None) -> dict | None:
    arenas: dict[int, list[tuple[int, int, int]]] = {}
    for addr, arena, szidx, count in pools:
        arenas.setdefault(arena, []).append((addr, szidx, count))
    rss = in_use = pinned = pages = free_blocks = 0
    for arena, ps in list(arenas.items()):
        lo, hi = min(a for a, _, _ in ps), max(a for a, _, _ in ps) + POOL
        if hi - lo > ARENA:             # no arena spans more: headers that only look valid
            del arenas[arena]
            continue
        raw = _pread(pagemap, lo // PAGE * 8, (hi - lo) // PAGE * 8)
        present = (np.frombuffer(raw, "<u8", len(raw) // 8) >> np.uint64(63)).astype(bool)
        resident = int(present.sum()) * PAGE
        used = sum(count * (szidx + 1) * 16 for _, szidx, count in ps)
        free_blocks += sum(((POOL - POOL_OVERHEAD) // ((s + 1) * 16) - c) for _, s, c in ps if c)
        rss, in_use = rss + resident, in_use + used
        if used and resident > used:
            # pymalloc returns an arena only once it is empty: every resident byte of it not in a
            # block in use (free blocks, empty pools, headers) is kept by the blocks that are
            pinned += resident - used
            pages += int(present.sum())
            if pins is not None:
                pins.append(PinMap(lo, np.where(present, (resident - used) / used, 0.0)))
    if not arenas:
        return None
    return {"allocator": "pymalloc", "arena": 0, "main": False, "heaps": len(arenas), "size": len(arenas) * ARENA,
            "rss": rss, "swap": 0, "free_bytes": rss - in_use, "free_chunks": free_blocks, "top_bytes": None,
            "free_resident_bytes": rss - in_use, "trimmable_bytes": 0, "pinned_bytes": pinned,
            "pinned_pages": pages, "in_use_bytes": in_use}
