"""Rows of the `malloc_arenas` table: per glibc arena, its resident memory, the sampled live
bytes located in it and, read from glibc's own metadata, its free chunks.

Sampling can only say how much of an arena is live; what is free, and whether `malloc_trim(0)`
could give it back, is in the arena's bins. They are read through /proc/PID/mem without stopping
the process (as root, like the heap_info check in smaps.py), so a walk races with the allocator:
every pointer is checked to stay inside the arena's heaps and every size to fit its heap, and an
arena whose walk fails or runs over the budget gets nulls rather than a guess. Residency comes
from /proc/PID/pagemap, and chunk headers are read only from resident pages: the walk never
faults heap memory in or swaps it back.

The process writes the headers it is walked by, so the walk is bounded by what a real allocator
has, not by what it claims (docs/security.md): smaps.py reads at most MAX_HEAP_PIECES heaps; their
page maps are read PAGEMAP_BUDGET bytes per call at most, a window at a time, counted with numpy;
a heap's present bits are kept only while its arena is walked; pinned pages are found from the
free chunks' ends (not per page of the heap) and PinMaps stop at PIN_BUDGET bytes. What is left out
is said in `notes`. The free-list walk itself is spaced by its cost (sampler/control/pacing.py).

Which pages are pinned: the free chunks (and the top chunk) give each page of a heap its free
bytes, exactly; a resident page holding both free bytes and anything else (a live chunk, or
glibc's own metadata) is pinned: `malloc_trim` cannot return it, however little stays on it. Each
arena's row says how many bytes such pages hold free (`pinned_bytes`), and `PinMap`s carry, per
pinned page, its free bytes per byte in use, so that the recording can charge them to the sampled
live blocks on the page (record/outstanding.py: `pinned`).

Layout (x86-64 glibc since 2.27, checked on 2.36 by tests/workloads/arena_bloat.c's tests):
`struct malloc_state` is mutex, flags, have_fastchunks (4 bytes each, padded to 16), fastbinsY[10], top, last_remainder,
bins[254] (fd/bk pairs of 127 circular lists whose head is `&bins[2i-2] - 16`), ... 2200 bytes.
The bins are checked before anything is trusted: an empty list's fd and bk point at its own
head, which no other layout or stray data reproduces (another layout gets nulls).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from sampler.proc.maps import read_maps
from sampler.proc.smaps import ARENA, HEAP

PAGE = os.sysconf("SC_PAGE_SIZE")
_HEAP_INFO = struct.Struct("<4Q")     # ar_ptr, prev, size, mprotect_size
_TOP, _BINS = 96, 112                 # offsets in struct malloc_state
_NBINS = 127                          # bins 1..127: 1 = unsorted, 2..63 small, 64..126 large
# mtrim() (malloc_trim) madvises free chunks of the unsorted bin and of the bins from
# bin_index(4096) = 99 up: smaller chunks cannot contain a whole page after their header.
_TRIM_BINS = [1, *range(99, _NBINS + 1)]
_OTHER_BINS = list(range(2, 99))
_MALLOC_CHUNK = 48                    # sizeof(struct malloc_chunk): mtrim keeps this much
_MINSIZE = 32
CHUNK_HEADER = 16                     # a chunk starts this far before the pointer malloc returned
_CHUNK_HDR = struct.Struct("<QQ")     # size, fd (at chunk + 8)
# The target sizes what is read: its heaps' page maps (8 bytes a page) up to PAGEMAP_BUDGET in all
# (32 GiB of heap: the biggest brk heap walked; a walked arena keeps 5 bytes a page of it while
# it is walked), libc's data and what follows it up to _MAX_LIBC_DATA, and main_arena
# candidates in it up to _MAX_CANDIDATES. Past them: no row for those arenas (said in `notes`),
# no main arena found.
PAGEMAP_BUDGET = 64 << 20
_WINDOW = 1 << 16                     # pages whose page map entries are read at a time (512 KiB)
PIN_BUDGET = 16 << 20                 # bytes of PinMaps per call (2 Mi pinned pages, 8 GiB of them)
_MAX_LIBC_DATA = 4 << 20
_MAX_CANDIDATES = 1024
DEFAULT_BUDGET = 1 << 17              # free chunks read per process and snapshot (~0.5 s)
WALK_TRIES = 3                        # reads of an arena whose lists changed while they were read
FREE_COLUMNS = ("free_bytes", "free_chunks", "top_bytes", "free_resident_bytes", "trimmable_bytes",
                "pinned_bytes", "pinned_pages")


class _Budget(Exception):
    pass


@dataclass(frozen=True)
class PinMap:
    """One heap's pinned pages: page k = [start + k * PAGE, ...) holds `ratio[k]` free bytes per
    byte in use (0: not pinned: free, fully used, or not resident)."""

    start: int
    ratio: np.ndarray


@dataclass
class _Heap:
    start: int
    end: int                          # end of the rw (committed) part
    arena: int                        # address of its malloc_state; 0 = main arena (unknown)
    resident_n: int = 0               # resident pages
    swapped: int = 0
    # kept only while its arena is walked (_residency): page k resident, and how many before k
    present: np.ndarray | None = None
    csum: np.ndarray | None = None    # int32

    def resident(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Resident bytes in each [lo, hi) (within this heap), partial pages pro rata."""
        a, b = lo - self.start, hi - self.start
        hp, tp = a // PAGE, (b - 1) // PAGE
        pres = self.present.astype(np.int64)
        same = (b - a) * pres[hp]
        head = (PAGE - a % PAGE) * pres[hp] + (b - tp * PAGE) * pres[tp]
        middle = PAGE * (self.csum[tp].astype(np.int64) - self.csum[np.minimum(hp + 1, tp)])
        return np.where(hp == tp, same, head + middle)

    def resident_pages(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Resident bytes of the whole pages [lo, hi) (page-aligned bounds)."""
        c = self.csum
        return PAGE * (c[(hi - self.start) // PAGE].astype(np.int64) - c[(lo - self.start) // PAGE])


class _Mem:
    """/proc/PID/{mem,pagemap}; short reads (unmapped meanwhile, process gone) return b''."""

    def __init__(self, pid: int) -> None:
        self.fds = {name: os.open(f"/proc/{pid}/{name}", os.O_RDONLY) for name in ("mem", "pagemap")}

    def read(self, addr: int, n: int, name: str = "mem") -> bytes:
        try:
            return os.pread(self.fds[name], n, addr)
        except OSError:
            return b""

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def arena_rows(pid: int, regions: list[tuple[int, int, str]], blocks: list[tuple[int, int, float]],
               budget: int = DEFAULT_BUDGET, pins: list[PinMap] | None = None, walk: bool = True,
               notes: list[str] | None = None, main_hint: int = 0) -> list[dict]:
    """One row per arena (the main arena when `[heap]` exists, each secondary arena).

    `regions` are the classified (start, end, kind) of smaps.MemoryBreakdown; `blocks` the sampled
    live blocks as (address, size, inclusion probability). With `pins`, the pinned pages of each
    arena whose free lists were read are appended to it. Without `walk`, the free lists are not
    read (their columns are null): residency and sampled live bytes only. [] when the process is gone or its
    memory cannot be read. What the budgets left out is said in `notes`. `main_hint`: where the main
    arena was found last time (its row's `arena`), checked before libc's data is searched again."""
    try:
        mem = _Mem(pid)
    except OSError:
        return []
    try:
        heaps = _heaps(mem, regions)
        if not heaps:
            return []
        main = next((h for h in heaps if h.arena == 0), None)
        if main is not None:
            ok = main_hint and _bins(mem, main_hint, [(main.start, main.end)]) is not None \
                and _top(mem, main_hint, [main], True) is not None
            main.arena = main_hint if ok else _find_main_arena(mem, pid, main)
        by_arena: dict[int, list[_Heap]] = {}
        for h in heaps:
            by_arena.setdefault(h.arena, []).append(h)
        live = _live(blocks, heaps)
        left, maps_left, pin_left = [budget], PAGEMAP_BUDGET, [PIN_BUDGET]
        rows, over = [], []
        for arena, hs in by_arena.items():
            is_main = hs[0] is main
            need = sum((h.end - h.start) // PAGE * 8 for h in hs)
            if need > maps_left:
                over.append(len(hs))
                continue
            maps_left -= need
            walked = bool(arena and walk)
            hs = [h for h in hs if _residency(mem, h, walked)]     # the rest was unmapped meanwhile
            if not hs:
                continue
            free = None
            for _ in range(WALK_TRIES if walked else 0):
                # a busy process relinks its bins while they are read: a torn read is read again
                free = _free_chunks(mem, arena, hs, is_main, left, pins, pin_left)
                if free is not None or left[0] <= 0:
                    break
            for h in hs:
                h.present = h.csum = None
            lb, lv, ls = (sum(live[id(h)][k] for h in hs) for k in range(3))
            rows.append({
                "pid": pid, "arena": arena, "main": is_main, "heaps": len(hs),
                "size": sum(h.end - h.start for h in hs),
                "rss": sum(h.resident_n for h in hs) * PAGE, "swap": sum(h.swapped for h in hs) * PAGE,
                "live_bytes": lb, "live_stderr_bytes": lv ** 0.5, "live_samples": ls,
                **(free or dict.fromkeys(FREE_COLUMNS)),
                "in_use_bytes": None if not free else sum(h.end - h.start for h in hs) - free["free_bytes"],
            })
        if notes is not None and over:
            notes.append(f"{len(over):,} of {len(by_arena):,} glibc arenas ({sum(over):,} heaps) have no malloc_arenas "
                         f"row: their page maps are over the {PAGEMAP_BUDGET >> 20} MiB read per snapshot")
        if notes is not None and pin_left[0] < 0:
            notes.append(f"pinned pages of some heaps not charged to their stacks: over {PIN_BUDGET >> 20} MiB of "
                         "pin maps")
        return rows
    finally:
        mem.close()


def _heaps(mem: _Mem, regions: list[tuple[int, int, str]]) -> list[_Heap]:
    heaps = []
    for start, end, kind in regions:
        if kind == HEAP:
            heaps.append(_Heap(start, end, 0))
        elif kind == ARENA:
            raw = mem.read(start, _HEAP_INFO.size)
            if len(raw) == _HEAP_INFO.size:   # else unmapped since smaps was read
                heaps.append(_Heap(start, end, _HEAP_INFO.unpack(raw)[0]))
    return heaps


def _residency(mem: _Mem, h: _Heap, keep: bool) -> bool:
    """Count h's resident and swapped pages from its page map, read _WINDOW pages at a time; with
    `keep`, its present bits and their running count stay (for its arena's walk). False when the
    heap was unmapped meanwhile."""
    n = (h.end - h.start) // PAGE
    present = np.zeros(n, bool) if keep else None
    h.resident_n = h.swapped = 0
    for k in range(0, n, _WINDOW):
        m = min(_WINDOW, n - k)
        raw = mem.read((h.start // PAGE + k) * 8, m * 8, "pagemap")
        if len(raw) != m * 8:
            return False
        entries = np.frombuffer(raw, "<u8")
        bits = (entries >> np.uint64(63)).astype(bool)
        h.resident_n += int(np.count_nonzero(bits))
        h.swapped += int(np.count_nonzero(entries & np.uint64(1 << 62)))
        if present is not None:
            present[k:k + m] = bits
    if present is not None:
        h.present, h.csum = present, np.zeros(n + 1, np.int32)
        np.cumsum(present, dtype=np.int32, out=h.csum[1:])
    return True


def _live(blocks: list[tuple[int, int, float]], heaps: list[_Heap]) -> dict[int, list[float]]:
    """Per heap: [estimated live chunk bytes, their variance, live samples] (the weights of
    sampler/control/weights.py, over glibc chunk sizes)."""
    out = {id(h): [0.0, 0.0, 0] for h in heaps}
    if not blocks:
        return out
    addrs = np.fromiter((b[0] for b in blocks), np.uint64, len(blocks))
    sp = np.array([(b[1], b[2]) for b in blocks], float).reshape(-1, 2)
    size, p = sp[:, 0], sp[:, 1]
    chunk = np.maximum(32, (size.astype(np.int64) + 8 + 15) & ~15)
    est, var = chunk / p, chunk * chunk * (1 - p) / (p * p)
    for h in heaps:
        m = (addrs >= h.start) & (addrs < h.end)
        out[id(h)] = [float(est[m].sum()), float(var[m].sum()), int(m.sum())]
    return out


def _find_main_arena(mem: _Mem, pid: int, heap: _Heap) -> int:
    """Address of glibc's `main_arena` (in libc's data): the one spot of libc's writable
    mappings holding a malloc_state whose top chunk lies in [heap] and whose bins check out.
    0 when not found (static binary, another allocator, main arena spilled into mmap)."""
    try:
        maps = read_maps(pid)
    except ProcessLookupError:
        return 0
    for i, m in enumerate(maps):
        name = os.path.basename(m.path)
        if m.perms != "rw-p" or not (name.startswith("libc.so") or name.startswith("libc-")):
            continue
        end = maps[i + 1].end if i + 1 < len(maps) and maps[i + 1].start == m.end and not maps[i + 1].path \
            else m.end                        # libc's .bss follows its .data
        raw = mem.read(m.start, min(end - m.start, _MAX_LIBC_DATA))
        words = np.frombuffer(raw, "<u8", len(raw) // 8)
        cand = np.nonzero((words >= heap.start) & (words < heap.end))[0] * 8 - _TOP
        for off in cand[cand >= 0][:_MAX_CANDIDATES]:
            base = m.start + int(off)
            if _bins(mem, base, [(heap.start, heap.end)]) is not None and _top(mem, base, [heap], True) is not None:
                return base
    return 0


def _bins(mem: _Mem, base: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """(head, first chunk) of each bin, or None unless every list is empty (fd == bk == head)
    or points into the arena's heaps."""
    raw = mem.read(base + _BINS, _NBINS * 16)
    if len(raw) != _NBINS * 16:
        return None
    out = []
    for i, (fd, bk) in enumerate(struct.iter_unpack("<QQ", raw), 1):
        head = base + _BINS + (i - 1) * 16 - 16
        if fd == bk == head:
            out.append((head, head))
        elif _inside(fd, ranges) and _inside(bk, ranges):
            out.append((head, fd))
        else:
            return None
    return out


def _top(mem: _Mem, base: int, heaps: list[_Heap], main: bool) -> tuple[_Heap, int, int] | None:
    """(heap, address, size) of the arena's top chunk; it must end where its heap's used part
    ends: the program break for the main arena, heap_info.size for a secondary heap."""
    raw = mem.read(base + _TOP, 8)
    if len(raw) != 8:
        return None
    (top,) = struct.unpack("<Q", raw)
    h = next((h for h in heaps if h.start <= top < h.end), None)
    if h is None or top % 16:
        return None
    hdr = mem.read(top + 8, 8) if _present(mem, h, top + 8) else b""
    used = mem.read(h.start + 16, 8) if not main else struct.pack("<Q", h.end - h.start)
    if len(hdr) != 8 or len(used) != 8:
        return None
    size = struct.unpack("<Q", hdr)[0] & ~7
    return (h, top, size) if size >= _MINSIZE and top + size == h.start + struct.unpack("<Q", used)[0] else None


def _present(mem: _Mem, h: _Heap, addr: int) -> bool:
    """Whether the page of `addr` is resident: from h's kept bits, else its page map entry."""
    if h.present is not None:
        return bool(h.present[(addr - h.start) // PAGE])
    raw = mem.read(addr // PAGE * 8, 8, "pagemap")
    return len(raw) == 8 and raw[7] >> 7 == 1


def _inside(addr: int, ranges: list[tuple[int, int]]) -> bool:
    return addr % 16 == 0 and any(lo <= addr < hi for lo, hi in ranges)


def _free_chunks(mem: _Mem, base: int, heaps: list[_Heap], main: bool, left: list[int],
                 pins: list[PinMap] | None = None, pin_left: list[int] | None = None) -> dict | None:
    """Free-list totals of one arena; None when its metadata does not check out. Chunks cached
    in tcache and fastbins are in use as far as the bins are concerned and are not counted (nor
    are they free bytes of a page: a tcache'd chunk pins its page until it is reused)."""
    ranges = [(h.start, h.end) for h in heaps]
    bins = _bins(mem, base, ranges)
    top = _top(mem, base, heaps, main)
    if bins is None or top is None:
        return None
    chunks: dict[int, list[tuple[int, int]]] = {}
    out: dict = {**dict.fromkeys(FREE_COLUMNS), "top_bytes": top[2]}
    try:
        for group in (_TRIM_BINS, _OTHER_BINS):
            for i in group:
                walked = _walk(mem, *bins[i - 1], heaps, left)
                if walked is None:
                    return None
                chunks[i] = walked
            if group is _TRIM_BINS:
                out["trimmable_bytes"] = _trimmable([c for i in _TRIM_BINS for c in chunks[i]], heaps, top, main)
    except _Budget:
        return out if "trimmable_bytes" in out else None
    every = [c for cs in chunks.values() for c in cs]
    h, addr, size = top
    resident = _sum_resident(every, heaps) + int(h.resident(np.array([addr]), np.array([addr + size]))[0])
    out.update(free_bytes=sum(s for _, s in every) + size, free_chunks=len(every), free_resident_bytes=resident)
    pinned = pages = 0
    for hp, first, ratio, b, n in _pinned([*every, (addr, size)], heaps):
        pinned, pages = pinned + b, pages + n
        if pins is not None and n:
            if pin_left is not None:
                pin_left[0] -= ratio.nbytes
                if pin_left[0] < 0:
                    continue                  # counted in its row, not charged to the stacks on it
            pins.append(PinMap(hp.start + first * PAGE, ratio))
    out.update(pinned_bytes=pinned, pinned_pages=pages)
    return out


def _pinned(free: list[tuple[int, int]], heaps: list[_Heap]):
    """Per heap: (heap, its first pinned page, free bytes per byte in use of each page from there
    to the last pinned one, pinned free bytes, pinned pages). A page is pinned when it is resident
    and holds free bytes and bytes in use: only a page where a free chunk starts or ends can be
    (the pages inside one are wholly free), so the work is per chunk, not per page of the heap."""
    for hp, lo, hi in _by_heap(free, heaps):
        a, b = lo - hp.start, np.minimum(hi, hp.end) - hp.start
        fa, lb = a // PAGE, (b - 1) // PAGE
        one = fa == lb
        pages = np.sort(np.concatenate((fa, lb)))
        pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]     # np.unique: 20x slower
        per_page = np.zeros(len(pages), np.int64)
        np.add.at(per_page, np.searchsorted(pages, fa[one]), (b - a)[one])
        many = ~one
        np.add.at(per_page, np.searchsorted(pages, fa[many]), PAGE - a[many] % PAGE)
        np.add.at(per_page, np.searchsorted(pages, lb[many]), b[many] - lb[many] * PAGE)
        # a page strictly inside another chunk (a torn read) is wholly free
        starts, ends = np.sort(fa[many] + 1), np.sort(lb[many])
        inside = np.searchsorted(starts, pages, "right") - np.searchsorted(ends, pages, "right")
        free_b = np.minimum(per_page + (inside > 0) * PAGE, PAGE)
        pinned = hp.present[pages] & (free_b > 0) & (free_b < PAGE)
        if not pinned.any():
            yield hp, 0, np.zeros(0), 0, 0
            continue
        at, fb = pages[pinned], free_b[pinned]
        ratio = np.zeros(int(at[-1] - at[0]) + 1)
        ratio[at - at[0]] = fb / np.maximum(PAGE - fb, 1)
        yield hp, int(at[0]), ratio, int(fb.sum()), len(at)


def _walk(mem: _Mem, head: int, first: int, heaps: list[_Heap], left: list[int]) -> list[tuple[int, int]] | None:
    """The (address, size) of the chunks on one bin list, following fd from `first` to `head`."""
    out = []
    p, lo, hi, present = first, 0, 0, heaps[0].present    # [lo, hi): the heap of the previous chunk
    fd_mem, unpack, n = mem.fds["mem"], _CHUNK_HDR.unpack, _CHUNK_HDR.size
    while p != head:
        if left[0] <= 0:
            raise _Budget
        left[0] -= 1
        if not lo <= p < hi - n - 8:
            h = next((h for h in heaps if h.start <= p < h.end - n - 8), None)
            if h is None:
                return None
            lo, hi, present = h.start, h.end, h.present
        if not (present[(p + 8 - lo) // PAGE] and present[(p + 7 + n - lo) // PAGE]):
            return None                       # never fault a page in (or swap it back) to read it
        try:
            raw = os.pread(fd_mem, n, p + 8)
        except OSError:
            return None
        if p % 16 or len(raw) != n:
            return None
        size, fd = unpack(raw)
        size &= ~7
        if size < _MINSIZE or p + size > hi:
            return None
        out.append((p, size))
        p = fd
    return out


def _by_heap(chunks: list[tuple[int, int]], heaps: list[_Heap]):
    if not chunks:
        return
    a = np.array(chunks, np.int64).reshape(-1, 2)
    for h in heaps:
        m = (a[:, 0] >= h.start) & (a[:, 0] < h.end)
        if m.any():
            yield h, a[m, 0], a[m, 0] + a[m, 1]


def _sum_resident(chunks: list[tuple[int, int]], heaps: list[_Heap]) -> int:
    return sum(int(h.resident(lo, hi).sum()) for h, lo, hi in _by_heap(chunks, heaps))


def _trimmable(chunks: list[tuple[int, int]], heaps: list[_Heap], top: tuple[_Heap, int, int], main: bool) -> int:
    """Resident bytes that malloc_trim(0) would madvise away: whole pages of free chunks past
    their malloc_chunk header (mtrim), and for the main arena the top chunk's pages above
    MINSIZE (systrim). A secondary arena's top is not touched by malloc_trim (glibc trims it by
    itself past M_TRIM_THRESHOLD)."""
    total = 0
    for h, lo, hi in _by_heap(chunks, heaps):
        start = (lo + _MALLOC_CHUNK + PAGE - 1) & ~(PAGE - 1)
        stop = np.maximum(start, hi & ~(PAGE - 1))
        total += int(h.resident_pages(start, stop).sum())
    if main:
        h, addr, size = top
        extra = max(0, size - _MINSIZE - 1) & ~(PAGE - 1)
        if extra:
            total += int(h.resident_pages(np.array([addr + size - extra]), np.array([addr + size]))[0])
    return total
