"""Per-VMA memory of a process from /proc/PID/smaps, with glibc malloc heaps and stacks told apart.

glibc's secondary arenas live in 64 MiB-aligned heaps that start with
`heap_info {ar_ptr, prev, size, mprotect_size, pagesize}`; reading that header through
/proc/PID/mem confirms a candidate VMA is really a heap (needs ptrace rights, i.e. root).

The process writes those headers, so what is read for them is bounded (docs/security.md):
MAX_HEAP_PIECES 64 MiB pieces per process and snapshot, one header read each (and, for a VMA of
several merged heaps, their page map, counted with numpy). glibc makes at most arena_max arenas
(8 x online CPUs by default), each one heap until it outgrows 64 MiB: 512 is arena_max on a
64-CPU host, or 32 GiB of heaps. A VMA with more pieces than are left is not split at all (real
merged heaps are a few adjacent ones): what is left unread is counted (MemoryBreakdown.heaps_unread).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

HEAP_MAX_SIZE = 64 << 20  # size and alignment of a secondary-arena heap on 64-bit glibc
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_HEAP_INFO = struct.Struct("<5Q")
# The first heap of an arena holds its malloc_state right after heap_info, so ar_ptr - base is
# sizeof(heap_info): 48 since glibc 2.35 added `pagesize` (plus 8 bytes of pad), 32 before.
_FIRST_HEAP_ARENA_OFFSETS = (48, 32)
MAX_HEAP_PIECES = 512

HEAP = "heap"
ARENA = "arena"
ARENA_RESERVE = "arena_reserve"
STACK = "stack"
ANON = "anon"
FILE = "file"
SPECIAL = "special"

# One match per VMA. Skipped lines must start with an upper-case field name, so a block missing a
# field can never swallow the next VMA's header. One regex pass is ~3x faster than a line loop.
_SMAPS_RE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ (\d+) *(.*)\n"
    rb"Size: +(\d+) kB\n(?:[A-Z].*\n)*?"
    rb"Rss: +(\d+) kB\nPss: +(\d+) kB\n(?:[A-Z].*\n)*?"
    rb"Anonymous: +(\d+) kB\n(?:[A-Z].*\n)*?"
    rb"Swap: +(\d+) kB\n",
    re.M,
)


@dataclass(frozen=True)
class Region:
    """One VMA (or one 64 MiB heap of a merged arena VMA); memory fields in bytes."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str  # '' for anonymous memory
    size: int
    rss: int
    pss: int
    swap: int
    anonymous: int
    kind: str = ""
    arena_ptr: int = 0  # heap_info.ar_ptr (the arena's malloc_state) for kind 'arena'
    arena_first: bool = False  # the arena's first heap: one per secondary arena, never unmapped


@dataclass
class MemoryBreakdown:
    """Byte totals by region kind; `rss` is the sum over all regions (== smaps Rss total)."""

    rss: int = 0
    heap_rss: int = 0
    heap_size: int = 0
    heap_swap: int = 0
    arena_rss: int = 0
    arena_size: int = 0  # committed (rw) part of the arena heaps
    arena_swap: int = 0
    arena_heaps: int = 0
    arenas: int = 0  # secondary arenas; add 1 for the main arena when heap_size > 0
    anon_rss: int = 0
    file_rss: int = 0
    stack_rss: int = 0
    swap: int = 0
    heaps_unread: int = 0  # 64 MiB pieces of heap candidates not read (over MAX_HEAP_PIECES): not arenas here
    regions: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, kind) by start


def _gone(pid: int) -> ProcessLookupError:
    return ProcessLookupError(f"process {pid} is gone")


def read_smaps(pid: int) -> list[Region]:
    """Parse /proc/PID/smaps; regions come in address order with kind ''."""
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError) as e:
        raise _gone(pid) from e
    return [
        Region(
            int(start, 16), int(end, 16), perms.decode(), int(offset, 16), int(inode),
            os.fsdecode(path), int(size) << 10, int(rss) << 10, int(pss) << 10, int(swap) << 10,
            int(anon) << 10,
        )
        for start, end, perms, offset, inode, path, size, rss, pss, anon, swap in _SMAPS_RE.findall(data)
    ]


def thread_stack_pointers(pid: int) -> list[int]:
    """User stack pointer of each thread not running on a CPU right now (those report 'running')."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except FileNotFoundError as e:
        raise _gone(pid) from e
    sps = []
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/syscall", "rb") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited meanwhile
        # 'NR args... sp pc', or '-1 sp pc' when blocked outside a syscall
        if len(fields) >= 3:
            sps.append(int(fields[-2], 16))
    return sps


class _ProcFiles:
    """/proc/PID/{mem,pagemap}, opened on first use: most regions never need them."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._fds: dict[str, int] = {}

    def pread(self, name: str, n: int, offset: int) -> bytes:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = self._fds[name] = os.open(f"/proc/{self._pid}/{name}", os.O_RDONLY)
            except FileNotFoundError as e:
                raise _gone(self._pid) from e
        try:
            return os.pread(fd, n, offset)
        except OSError:
            return b""  # unmapped meanwhile (EIO) or the process exited

    def __enter__(self) -> _ProcFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)


def _heap_arena(files: _ProcFiles, base: int) -> int:
    """ar_ptr of the glibc heap at `base`, or 0 when heap_info there does not check out."""
    data = files.pread("mem", _HEAP_INFO.size, base)
    if len(data) != _HEAP_INFO.size:
        return 0
    ar_ptr, prev, size, mprotect_size, _pagesize = _HEAP_INFO.unpack(data)
    ok = (
        ar_ptr % HEAP_MAX_SIZE in _FIRST_HEAP_ARENA_OFFSETS
        and prev % HEAP_MAX_SIZE == 0
        and 0 < size <= HEAP_MAX_SIZE
        and size % 4096 == 0
        and size <= mprotect_size <= HEAP_MAX_SIZE
    )
    return ar_ptr if ok else 0


def _apportion(total: int, weights: list[int]) -> list[int]:
    """Split a kB-granular byte total in proportion to weights; the shares sum to total exactly."""
    kb, wsum = total >> 10, sum(weights)
    shares = [kb * w // wsum << 10 for w in weights]
    shares[-1] += total - sum(shares)
    return shares


@dataclass
class HeapReads:
    """What classify may still read as heap candidates (64 MiB pieces), and what it left unread."""

    left: int = MAX_HEAP_PIECES
    unread: int = 0


def _split_heaps(files: _ProcFiles, r: Region, reads: HeapReads) -> list[Region]:
    """Cut a 64 MiB-aligned rw VMA at heap boundaries; [] when its first piece is not a confirmed
    heap (a run of merged heaps starts with one), or when it has more pieces than `reads` allows."""
    pieces = -(-(r.end - r.start) // HEAP_MAX_SIZE)
    if not reads.left:
        reads.unread += pieces
        return []
    reads.left -= 1
    first = _heap_arena(files, r.start)
    if not first:
        return []
    if pieces - 1 > reads.left:     # never split a mapping longer than what is left (256 GiB: 4,096 pieces)
        reads.unread += pieces
        return []
    reads.left -= pieces - 1
    bounds = [(a, min(a + HEAP_MAX_SIZE, r.end)) for a in range(r.start, r.end, HEAP_MAX_SIZE)]
    arenas = [first, *(_heap_arena(files, a) for a, _ in bounds[1:])]
    if len(bounds) == 1:
        present = swapped = [1]
    else:
        # Adjacent full heaps merge into one VMA, so smaps has one total for several heaps:
        # split it by the present / swapped bits (63 / 62) of each piece's pagemap entries.
        present, swapped = [], []
        for a, e in bounds:
            raw = files.pread("pagemap", (e - a) // _PAGE_SIZE * 8, a // _PAGE_SIZE * 8)
            entries = np.frombuffer(raw, "<u8", len(raw) // 8)
            present.append(int(np.count_nonzero(entries >> np.uint64(63))))
            swapped.append(int(np.count_nonzero(entries & np.uint64(1 << 62))))
        sizes = [e - a for a, e in bounds]
        present = present if any(present) else sizes  # pages changed under us: best effort
        swapped = swapped if any(swapped) else sizes
    rss, pss = _apportion(r.rss, present), _apportion(r.pss, present)
    swap, anon = _apportion(r.swap, swapped), _apportion(r.anonymous, present)
    return [
        dataclasses.replace(
            r, start=a, end=e, size=e - a, rss=rss[k], pss=pss[k], swap=swap[k], anonymous=anon[k],
            kind=ARENA if arenas[k] else ANON, arena_ptr=arenas[k],
            arena_first=arenas[k] - a in _FIRST_HEAP_ARENA_OFFSETS,
        )
        for k, (a, e) in enumerate(bounds)
    ]


def _kind_by_name(r: Region) -> str:
    path = r.path
    if not path or path.startswith(("[anon:", "[anon_shmem:")):
        return ANON
    if path == "[heap]":
        return HEAP
    if path.startswith("[stack"):  # '[stack:TID]' on kernels before 4.5
        return STACK
    return SPECIAL if path.startswith("[") else FILE


def _with_kind(r: Region, kind: str) -> Region:
    # Twice as fast as dataclasses.replace, which shows with tens of thousands of VMAs.
    return Region(
        r.start, r.end, r.perms, r.offset, r.inode, r.path, r.size, r.rss, r.pss, r.swap, r.anonymous, kind
    )


def _heap_end(start: int) -> int:
    return (start // HEAP_MAX_SIZE + 1) * HEAP_MAX_SIZE


def classify(pid: int, regions: list[Region], stack_pointers: list[int],
             reads: HeapReads | None = None) -> list[Region]:
    """Set each region's kind; merged arena VMAs come back as one region per 64 MiB heap. Heap
    candidates are read as far as `reads` allows (MAX_HEAP_PIECES)."""
    reads = reads or HeapReads()
    sps = sorted(stack_pointers)
    out: list[Region] = []
    with _ProcFiles(pid) as files:
        for i, r in enumerate(regions):
            kind = _kind_by_name(r)
            if kind == ANON and r.perms == "rw-p" and r.start % HEAP_MAX_SIZE == 0:
                nxt = regions[i + 1] if i + 1 < len(regions) else None
                # A partly committed heap's PROT_NONE tail never reaches past its 64 MiB slot.
                tail_fits = (
                    r.end % HEAP_MAX_SIZE == 0 or nxt is None or nxt.start != r.end
                    or nxt.perms != "---p" or _kind_by_name(nxt) != ANON or nxt.end <= _heap_end(r.end)
                )
                heaps = _split_heaps(files, r, reads) if tail_fits else []
                if heaps:
                    out.extend(heaps)
                    continue
            elif (
                kind == ANON and r.perms == "---p" and out and out[-1].kind == ARENA
                and out[-1].end == r.start and r.end <= _heap_end(out[-1].start)
            ):
                kind = ARENA_RESERVE
            if kind == ANON:
                j = bisect_left(sps, r.start)
                if j < len(sps) and sps[j] < r.end:
                    kind = STACK
            out.append(_with_kind(r, kind))
    return out


def summarize(regions: list[Region]) -> MemoryBreakdown:
    """Totals of classified regions."""
    b = MemoryBreakdown()
    for r in regions:
        b.rss += r.rss
        b.swap += r.swap
        if r.kind == HEAP:
            b.heap_rss += r.rss
            b.heap_size += r.size
            b.heap_swap += r.swap
        elif r.kind == ARENA:
            b.arena_rss += r.rss
            b.arena_size += r.size
            b.arena_swap += r.swap
            b.arena_heaps += 1
            b.arenas += r.arena_first
        elif r.kind == ANON:
            b.anon_rss += r.rss
        elif r.kind == FILE:
            b.file_rss += r.rss
        elif r.kind == STACK:
            b.stack_rss += r.rss
        b.regions.append((r.start, r.end, r.kind))
    b.regions.sort()
    return b


def memory_breakdown(pid: int) -> MemoryBreakdown:
    """Classify /proc/PID/smaps once and total it; ProcessLookupError when the process is gone."""
    regions, reads = read_smaps(pid), HeapReads()
    b = summarize(classify(pid, regions, thread_stack_pointers(pid), reads))
    b.heaps_unread = reads.unread
    return b
