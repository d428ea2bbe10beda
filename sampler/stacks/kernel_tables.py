"""The unwind tables BPF walks stacks with: files' rows in `uw_rows`, processes' mappings in
`uw_maps` (sampler/bpf/abi.h, common.h walk_native).

A file's rows are built once (sampler/stacks/table_worker.py, cached on disk by CFI key), loaded
once into a range of `uw_rows` and shared by every process that maps the file. A process's
executable mappings are written to a fresh slot of `uw_maps`, then `uw_procs` is pointed at it
in one map update, so that BPF never reads a half-written table; the old slot is reused last.
Mappings of files not built yet are marked pending, where BPF hands the walk over to user space.
Rows of files no process maps stay loaded until their room is needed.

Everything runs on the recorder's thread: `track` and `changed` note work, `poll` does it.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import numpy as np

from sampler.bpf.abi import UW_MAP, UW_MAPS, UW_PAGE_SHIFT, UW_PENDING, UW_PROC
from sampler.proc.maps import Mapping, open_path, read_maps
from sampler.stacks.table_worker import BuildFailed, TableWorker
from sampler.stacks.unwind_rows import FileRows

log = logging.getLogger(__name__)

UNKNOWN_CODE_S = 1.0        # code in no known mapping (JIT, or a dlopen not seen): maps re-read at most this often
BUILD_ATTEMPTS = 3          # a build lost with a crashed worker, or opened through a mapping gone since


@dataclass
class _File:
    ident: tuple[str, int]                  # (dev, inode)
    state: str = "building"                 # building, ready, failed
    rows: FileRows | None = None
    lo: int = 0                             # its rows in uw_rows[lo, lo + n) when loaded
    n: int = -1                             # -1: not loaded
    page_lo: int = 0                        # its page index in uw_pages[page_lo, page_lo + page_n)
    page_n: int = 0
    page_first: int = 0                     # vaddr >> UW_PAGE_SHIFT of its first row
    pids: set[int] = field(default_factory=set)


@dataclass
class _Proc:
    slot: int
    maps: list[Mapping]
    due: float = 0.0                        # re-read its maps at this time (0: not due)
    read_at: float = 0.0
    written_ns: int = 0                     # CLOCK_MONOTONIC after its uw_procs entry last changed


class _Ranges:
    """First-fit allocation of row ranges in uw_rows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)]

    def take(self, n: int) -> int | None:
        for i, (lo, size) in enumerate(self.free):
            if size >= n:
                self.free[i] = (lo + n, size - n)
                return lo
        return None

    def give(self, lo: int, n: int) -> None:
        self.free.append((lo, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for a, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            elif size:
                merged.append((a, size))
        self.free = merged

    @property
    def used(self) -> int:
        return self.capacity - sum(size for _, size in self.free)


class KernelTables:
    def __init__(self, probes, worker: TableWorker):
        """`probes`: a BpfProbes, whose config sizes the maps (unwind_rows, _pages, _procs)."""
        cfg = probes.cfg
        rows_capacity, procs_capacity = cfg.unwind_rows, cfg.unwind_procs
        self._rows = probes.bpf["uw_rows"]
        self._pages = probes.bpf["uw_pages"]
        self._page_ranges = _Ranges(cfg.unwind_pages)
        self._maps = probes.bpf["uw_maps"]
        self._procs_map = probes.bpf["uw_procs"]
        self.worker = worker
        self._ranges = _Ranges(rows_capacity)
        self._files: dict[tuple[str, int], _File] = {}
        self._idle: OrderedDict[tuple[str, int], None] = OrderedDict()   # loaded, mapped by no process
        self._procs: dict[int, _Proc] = {}
        self._slots: deque[int] = deque(range(procs_capacity))
        self._shared: dict[int, int] = {}   # slot -> how many more processes' tables it is (forks)
        self._dirty_files: set[tuple[str, int]] = set()
        self._retries: dict[tuple[str, int], int] = {}
        self.full_warned = False

    # processes -------------------------------------------------------------------------------
    def track(self, pid: int) -> bool:
        """Walk `pid`'s stacks in BPF from now on; False when no slot is free (its stacks are
        then unwound in user space, as before)."""
        if pid in self._procs:
            return True
        if len(self._slots) < 2:            # one for it, one to rewrite a table into
            return False
        try:
            maps = _code_maps(pid)
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            return False
        self._procs[pid] = _Proc(self._slots.popleft(), [])
        self._set_maps(pid, maps)
        return True

    def fork(self, parent: int, child: int, fork_ns: int) -> bool:
        """`child` was forked from `parent` at `fork_ns` (BPF's clock): its table is the
        parent's, not read again. BPF pointed it at the parent's slot at the fork: when the
        parent's entry has not changed since, the two share that slot (counted, so that it is
        reused only once neither points at it), and a child that exits without mapping code costs
        no map access at all. False as for track."""
        p = self._procs.get(parent)
        if p is None or child in self._procs or p.written_ns > fork_ns:
            return self.track(child)     # the parent's table moved since the fork: read its own
        self._procs[child] = _Proc(p.slot, list(p.maps))
        self._shared[p.slot] = self._shared.get(p.slot, 0) + 1
        for m in p.maps:
            if (f := self._files.get((m.dev, m.inode))) is not None:
                f.pids.add(child)
        return True

    def changed(self, pid: int, exec_: bool = False) -> None:
        """`pid` mapped code, or exec'd: its maps are read again at the next poll. After an exec
        its old table is dropped at once: the new image may lie where the old one did."""
        p = self._procs.get(pid)
        if p is None:
            return
        if exec_:
            self._procs_map.put(_key(pid), None)
            p.written_ns = time.monotonic_ns()
        if not p.due:
            p.due = time.monotonic()

    def refresh(self, pid: int) -> None:
        """`pid` mapped code its walks need at once (the injected sampler, placed beside the loop):
        its maps are read now, and the rows of new files start building."""
        p = self._procs.get(pid)
        if p is None:
            return
        p.due, p.read_at = 0.0, time.monotonic()
        try:
            self._set_maps(pid, _code_maps(pid))
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            self.untrack(pid)

    def unknown_code(self, pid: int) -> None:
        """A walk met code in no mapping BPF knows: a library mapped since, or JIT code (which
        stays unknown: hence the rate)."""
        p = self._procs.get(pid)
        if p is not None and not p.due:
            p.due = max(time.monotonic(), p.read_at + UNKNOWN_CODE_S)

    def untrack(self, pid: int, bpf_gone: bool = False) -> None:
        """`bpf_gone`: its exit event came, and BPF dropped its entry already."""
        p = self._procs.pop(pid, None)
        if p is None:
            return
        if not bpf_gone:
            self._procs_map.put(_key(pid), None)
        self._give_slot(p.slot)
        self._release(pid, p.maps)

    # work ------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Files' rows are being built (poll() loads them as they come)."""
        return self.worker.pending > 0

    def poll(self) -> None:
        """Load the builds that finished and re-read the maps of processes that mapped code."""
        for ident, result in self.worker.done():
            f = self._files.get(ident)       # type: ignore[arg-type]
            if f is None:
                continue
            if isinstance(result, BuildFailed):
                self._retries[ident] = self._retries.get(ident, 1) + 1      # type: ignore[index]
                if (result.worker_died or result.gone) and self._retries[ident] <= BUILD_ATTEMPTS and f.pids:
                    # not the file's doing: built again from the processes' current maps
                    del self._files[ident]                                # type: ignore[arg-type]
                    for pid in f.pids:
                        self.changed(pid)
                    continue
                f.state = "failed"
                log.info("unwind rows of %s not built: %s", ident, result)
                continue
            f.state, f.rows = "ready", result
            self._load(f)
            # in uw_rows now (or never, when full): only how its mappings translate is needed
            f.rows = replace(result, rows=result.rows[:0].copy())
            self._dirty_files.add(f.ident)
        now = time.monotonic()
        for pid, p in list(self._procs.items()):
            if p.due and now >= p.due:
                self.refresh(pid)
        if self._dirty_files:
            pids = {pid for ident in self._dirty_files for pid in self._files[ident].pids}
            self._dirty_files.clear()
            for pid in pids:
                if pid in self._procs:
                    self._write(pid)

    @property
    def rows_used(self) -> int:
        return self._ranges.used

    def stats(self) -> dict[str, int]:
        states = [f.state for f in self._files.values()]
        return {"files_ready": states.count("ready"), "files_building": states.count("building"),
                "files_failed": states.count("failed"), "rows_used": self._ranges.used,
                "pages_used": self._page_ranges.used,
                "rows_capacity": self._ranges.capacity, "processes": len(self._procs)}

    def close(self) -> None:
        self.worker.close()

    # internals -------------------------------------------------------------------------------
    def _set_maps(self, pid: int, maps: list[Mapping]) -> None:
        p = self._procs[pid]
        old = p.maps
        p.maps = maps
        for m in sorted(maps, key=lambda m: m.end - m.start):     # small files first: ready sooner
            ident = (m.dev, m.inode)
            f = self._files.get(ident)
            if f is None:
                f = self._files[ident] = _File(ident)
                self._submit(f, pid, m)
            f.pids.add(pid)
            self._idle.pop(ident, None)
        self._release(pid, old, keep={(m.dev, m.inode) for m in maps})
        self._write(pid)

    def _submit(self, f: _File, pid: int, m: Mapping) -> None:
        f.state = "building"
        self.worker.submit(f.ident, open_path(pid, m), m.path, f"/proc/{pid}/root")

    def _release(self, pid: int, maps: list[Mapping], keep: set[tuple[str, int]] = frozenset()) -> None:
        for m in maps:
            ident = (m.dev, m.inode)
            f = self._files.get(ident)
            if f is None or ident in keep:
                continue
            f.pids.discard(pid)
            if not f.pids:
                if f.n >= 0:
                    self._idle[ident] = None           # loaded: kept until its room is needed
                elif f.state != "building":
                    del self._files[ident]

    def _load(self, f: _File) -> None:
        rows = f.rows
        if rows is None or not rows.fits or not len(rows.rows):
            f.n = 0 if rows is not None and rows.fits else -1
            return
        pcs = rows.rows["pc"]
        first = int(pcs[0]) >> UW_PAGE_SHIFT
        starts = (np.arange(first, (int(pcs[-1]) >> UW_PAGE_SHIFT) + 2, dtype=np.int64) << UW_PAGE_SHIFT)
        # the row in force at each page's start (0 before the first row: its search then finds none);
        # entry i: that of page i and of page i + 1
        at = np.maximum(np.searchsorted(pcs, starts, "right") - 1, 0).astype(np.uint64)
        pages = at[:-1] | at[1:] << np.uint64(32)
        n, npages = len(rows.rows), len(pages)
        lo, plo = self._take(self._ranges, n), self._take(self._page_ranges, npages)
        if lo is None or plo is None:
            if lo is not None:
                self._ranges.give(lo, n)
            if plo is not None:
                self._page_ranges.give(plo, npages)
            if not self.full_warned:
                self.full_warned = True
                log.warning("the unwind tables are full (%d rows, %d pages): stacks in %s are unwound in user "
                            "space; raise unwind_rows", self._ranges.capacity, self._page_ranges.capacity, f.ident)
            return
        self._rows.write_array(lo, memoryview(np.ascontiguousarray(rows.rows)).cast("B"))   # no copy
        self._pages.write_array(plo, memoryview(pages).cast("B"))
        f.lo, f.n, f.page_lo, f.page_n, f.page_first = lo, n, plo, npages, first

    def _take(self, ranges: _Ranges, n: int) -> int | None:
        """Room for n entries, evicting files no process maps (oldest first) until there is."""
        lo = ranges.take(n)
        while lo is None and self._idle:
            self._evict(next(iter(self._idle)))
            lo = ranges.take(n)
        return lo

    def _evict(self, ident: tuple[str, int]) -> None:
        self._idle.pop(ident, None)
        f = self._files.pop(ident, None)
        if f is not None and f.n > 0:
            self._ranges.give(f.lo, f.n)
            self._page_ranges.give(f.page_lo, f.page_n)

    def _write(self, pid: int) -> None:
        """A fresh slot with pid's mappings, then uw_procs pointed at it."""
        p = self._procs[pid]
        if not self._slots:
            return
        slot = self._slots.popleft()
        entries = []
        for m in p.maps[:UW_MAPS]:
            f = self._files.get((m.dev, m.inode))
            lo, n, bias, pages = UW_PENDING, 0, 0, (0, 0, 0)
            if f is not None and f.state == "ready" and f.rows is not None and f.n >= 0:
                vaddr = f.rows.vaddr(m.offset)
                if vaddr is not None:
                    lo, n, bias = (f.lo if f.n else 0), f.n, (m.start - vaddr) & (1 << 64) - 1
                    pages = (f.page_lo, f.page_n, f.page_first)
            entries.append(UW_MAP.struct.pack(m.start, m.end, bias, lo, n, *pages))
        if entries:
            keys = struct.pack(f"<{len(entries)}I", *range(slot * UW_MAPS, slot * UW_MAPS + len(entries)))
            self._maps.update_batch(keys, b"".join(entries), len(entries))
        self._procs_map[_key(pid)] = _proc_value(slot, len(entries))
        p.written_ns = time.monotonic_ns()
        self._give_slot(p.slot)             # the old slot, reused last
        p.slot = slot

    def _give_slot(self, slot: int) -> None:
        """A process no longer points at `slot`: free once no other (a fork) does."""
        if self._shared.get(slot):
            self._shared[slot] -= 1
            if not self._shared[slot]:
                del self._shared[slot]
        else:
            self._slots.append(slot)


def _code_maps(pid: int) -> list[Mapping]:
    """pid's executable file mappings, sorted by start."""
    return sorted((m for m in read_maps(pid) if m.executable and m.file_backed), key=lambda m: m.start)


def _key(pid: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(pid)


def _proc_value(slot: int, n: int) -> ctypes.Array:
    return (ctypes.c_char * UW_PROC.struct.size).from_buffer_copy(UW_PROC.struct.pack(slot, n))
