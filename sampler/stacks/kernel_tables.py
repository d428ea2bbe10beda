"""The unwind tables BPF walks stacks with: files' rows in `uw_rows`, processes' mappings in
`uw_maps` (bpf/abi.h, common.h walk_native).

A file's rows are built once (sampler/stacks/table_worker.py, cached on disk by CFI key) and
loaded once into a range of `uw_rows`, shared by every file whose rows have the same content
(their digest). A mapping is tied to a file by files.identity of what its map_files link reaches
(device, inode, size, mtime, ctime), never by the device and inode /proc/PID/maps shows: btrfs
subvolumes share the device there while inode numbers repeat, and a deleted file's inode number
is reused, so that another user's file could otherwise lend its rows to a victim's mapping. The
worker answers the identity of the descriptor it read, and rows are used only for mappings whose
file has that identity.

A process's executable mappings are written to a fresh slot of `uw_maps`, then `uw_procs` is
pointed at it in one map update, so that BPF never reads a half-written table; the old slot is
reused last. Mappings of files not built yet are marked pending, where BPF hands the walk over to
user space. Rows no mapping uses are dropped after IDLE_ROWS_S, or sooner when their room is needed.

Everything runs on the recorder's thread: `track` and `changed` note work, `poll` does it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import numpy as np

from sampler import files
from sampler.bpf.abi import UW_MAP, UW_MAPS, UW_PAGE_SHIFT, UW_PENDING, UW_PROC
from sampler.proc.maps import Mapping, open_path, read_maps
from sampler.stacks.table_worker import BuildFailed, TableWorker
from sampler.stacks.unwind_rows import FileRows

log = logging.getLogger(__name__)

UNKNOWN_CODE_S = 1.0        # code in no known mapping (JIT, or a dlopen not seen): maps re-read at most this often
BUILD_ATTEMPTS = 3          # a build lost with a crashed worker, or opened through a mapping gone since
IDLE_ROWS_S = 60.0          # rows no mapping uses are kept this long (a process restarting finds them)

Ident = files.FileIdentity


@dataclass
class _Rows:
    """One rows table in uw_rows, by content."""
    digest: str
    lo: int = 0                             # uw_rows[lo, lo + n)
    n: int = 0
    page_lo: int = 0                        # uw_pages[page_lo, page_lo + page_n)
    page_n: int = 0
    page_first: int = 0                     # vaddr >> UW_PAGE_SHIFT of its first row
    files: set[Ident] = field(default_factory=set)


@dataclass
class _File:
    ident: Ident
    state: str = "building"                 # building, ready, failed
    built: FileRows | None = None           # how its mappings translate (its rows are in `table`)
    table: _Rows | None = None              # None when ready: no rows in BPF (none, or no room)
    no_cfi: bool = False                    # ready with no rows at all: frame pointers only
    pids: set[int] = field(default_factory=set)


@dataclass
class _Proc:
    slot: int
    maps: list[tuple[Mapping, Ident | None]]   # None: its file could not be identified (gone)
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
        self._files: dict[Ident, _File] = {}
        self._tables: dict[str, _Rows] = {}
        self._idle: OrderedDict[str, float] = OrderedDict()    # digest -> when its last file went
        self._procs: dict[int, _Proc] = {}
        self._slots: deque[int] = deque(range(procs_capacity))
        self._shared: dict[int, int] = {}   # slot -> how many more processes' tables it is (forks)
        self._dirty_files: set[Ident] = set()
        self._retries: dict[Ident, int] = {}
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
        for _, ident in p.maps:
            if ident is not None and (f := self._files.get(ident)) is not None:
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
        """Load the builds that finished, re-read the maps of processes that mapped code, and
        drop rows idle for IDLE_ROWS_S."""
        for ident, result in self.worker.done():
            f = self._files.get(ident)       # type: ignore[arg-type]
            if f is None:
                continue
            if isinstance(result, FileRows) and result.file != ident:
                # the worker read another file than the mapping's (replaced, remapped): try again
                result = BuildFailed("the file changed before it was read", gone=True)
            if isinstance(result, BuildFailed):
                tries = self._retries[f.ident] = self._retries.get(f.ident, 1) + 1
                if (result.worker_died or result.gone) and (tries <= BUILD_ATTEMPTS or not f.pids):
                    # not the file's doing: built again from the processes' current maps (none
                    # now: the next process to map it builds it)
                    del self._files[f.ident]
                    if not f.pids:
                        self._retries.pop(f.ident, None)
                    for pid in f.pids:
                        self.changed(pid)
                    continue
                f.state = "failed"
                log.info("unwind rows of %s not built: %s", f.ident, result)
                continue
            self._retries.pop(f.ident, None)
            f.state, f.no_cfi = "ready", result.fits and not len(result.rows)
            f.table = self._attach(f, result)
            # in uw_rows now (or never, when full): only how its mappings translate is needed
            f.built = replace(result, rows=result.rows[:0].copy())
            if not f.pids:
                self._release_file(f)
            self._dirty_files.add(f.ident)
        now = time.monotonic()
        while self._idle and now - next(iter(self._idle.values())) > IDLE_ROWS_S:
            self._evict(next(iter(self._idle)))
        for pid, p in list(self._procs.items()):
            if p.due and now >= p.due:
                self.refresh(pid)
        if self._dirty_files:
            pids = {pid for ident in self._dirty_files if (f := self._files.get(ident)) for pid in f.pids}
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
                "pages_used": self._page_ranges.used, "tables": len(self._tables), "tables_idle": len(self._idle),
                "rows_capacity": self._ranges.capacity, "processes": len(self._procs)}

    def close(self) -> None:
        self.worker.close()

    # internals -------------------------------------------------------------------------------
    def _set_maps(self, pid: int, maps: list[tuple[Mapping, Ident | None]]) -> None:
        p = self._procs[pid]
        old = p.maps
        p.maps = maps
        for m, ident in sorted(maps, key=lambda e: e[0].end - e[0].start):     # small files first: ready sooner
            if ident is None:
                continue
            f = self._files.get(ident)
            if f is None:
                f = self._files[ident] = _File(ident)
                self._submit(f, pid, m)
            f.pids.add(pid)
            if f.table is not None:
                self._idle.pop(f.table.digest, None)
        self._release(pid, old, keep={ident for _, ident in maps})
        self._write(pid)

    def _submit(self, f: _File, pid: int, m: Mapping) -> None:
        f.state = "building"
        self.worker.submit(f.ident, open_path(pid, m), m.path, f"/proc/{pid}/root")

    def _release(self, pid: int, maps: list[tuple[Mapping, Ident | None]], keep: set = frozenset()) -> None:
        for _, ident in maps:
            f = self._files.get(ident) if ident is not None else None
            if f is None or ident in keep:
                continue
            f.pids.discard(pid)
            if not f.pids:
                self._release_file(f)

    def _release_file(self, f: _File) -> None:
        """`f` is mapped by no process: kept while its rows are loaded (a process restarting finds
        them), which are idle once no file using them is mapped."""
        t = f.table
        if t is None:
            if f.state != "building":
                del self._files[f.ident]
                self._retries.pop(f.ident, None)
        elif not any(g.pids for i in t.files if (g := self._files.get(i)) is not None):
            self._idle[t.digest] = time.monotonic()
            self._idle.move_to_end(t.digest)        # oldest first: the idle sweep stops at a young one

    def _attach(self, f: _File, built: FileRows) -> _Rows | None:
        """The loaded rows of `built` (shared by content: loaded only when no file has the same),
        with `f` among their files; None when they cannot be loaded."""
        t = self._tables.get(built.digest) if built.digest else None
        if t is None:
            t = self._load(built)
            if t is None:
                return None
            self._tables[t.digest] = t
        t.files.add(f.ident)
        self._idle.pop(t.digest, None)
        return t

    def _load(self, built: FileRows) -> _Rows | None:
        if not built.fits or not len(built.rows) or not built.digest:
            return None
        pcs = built.rows["pc"]
        first = int(pcs[0]) >> UW_PAGE_SHIFT
        starts = (np.arange(first, (int(pcs[-1]) >> UW_PAGE_SHIFT) + 2, dtype=np.int64) << UW_PAGE_SHIFT)
        # the row in force at each page's start (0 before the first row: its search then finds none);
        # entry i: that of page i and of page i + 1
        at = np.maximum(np.searchsorted(pcs, starts, "right") - 1, 0).astype(np.uint64)
        pages = at[:-1] | at[1:] << np.uint64(32)
        n, npages = len(built.rows), len(pages)
        lo, plo = self._take(self._ranges, n), self._take(self._page_ranges, npages)
        if lo is None or plo is None:
            if lo is not None:
                self._ranges.give(lo, n)
            if plo is not None:
                self._page_ranges.give(plo, npages)
            if not self.full_warned:
                self.full_warned = True
                log.warning("the unwind tables are full (%d rows, %d pages): stacks in files whose rows do not fit "
                            "are unwound in user space; raise unwind_rows", self._ranges.capacity,
                            self._page_ranges.capacity)
            return None
        self._rows.write_array(lo, memoryview(np.ascontiguousarray(built.rows)).cast("B"))   # no copy
        self._pages.write_array(plo, memoryview(pages).cast("B"))
        return _Rows(built.digest, lo, n, plo, npages, first)

    def _take(self, ranges: _Ranges, n: int) -> int | None:
        """Room for n entries, evicting rows no mapping uses (oldest first) until there is."""
        lo = ranges.take(n)
        while lo is None and self._idle:
            self._evict(next(iter(self._idle)))
            lo = ranges.take(n)
        return lo

    def _evict(self, digest: str) -> None:
        """Rows no mapping uses leave uw_rows, and the unmapped files that used them are forgotten."""
        self._idle.pop(digest, None)
        t = self._tables.pop(digest, None)
        if t is None:
            return
        self._ranges.give(t.lo, t.n)
        self._page_ranges.give(t.page_lo, t.page_n)
        for ident in t.files:
            f = self._files.get(ident)
            if f is not None and f.table is t:
                f.table = None
                if not f.pids and f.state != "building":
                    del self._files[ident]

    def _write(self, pid: int) -> None:
        """A fresh slot with pid's mappings, then uw_procs pointed at it."""
        p = self._procs[pid]
        if not self._slots:
            # its old slot may name rows released since: BPF hands its walks to user space until
            # a slot is free
            self._procs_map.put(_key(pid), None)
            p.written_ns = time.monotonic_ns()
            return
        slot = self._slots.popleft()
        entries = []
        for m, ident in p.maps[:UW_MAPS]:
            f = self._files.get(ident) if ident is not None else None
            lo, n, bias, pages = UW_PENDING, 0, 0, (0, 0, 0)
            if f is not None and f.state == "ready" and f.built is not None and (f.table or f.no_cfi):
                vaddr = f.built.vaddr(m.offset)
                if vaddr is not None:
                    bias = (m.start - vaddr) & (1 << 64) - 1
                    t = f.table
                    lo, n = (t.lo, t.n) if t else (0, 0)
                    pages = (t.page_lo, t.page_n, t.page_first) if t else (0, 0, 0)
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


def _code_maps(pid: int) -> list[tuple[Mapping, Ident | None]]:
    """pid's executable file mappings, sorted by start, each with the identity of its file."""
    maps = sorted((m for m in read_maps(pid) if m.executable and m.file_backed), key=lambda m: m.start)
    return [(m, _identify(pid, m)) for m in maps]


def _identify(pid: int, m: Mapping) -> Ident | None:
    """files.identity of the file behind `m`, through its map_files link (the mapped inode
    itself); None when it cannot be reached (gone since)."""
    try:
        return files.identity(os.stat(open_path(pid, m)))
    except OSError:
        return None


def _key(pid: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(pid)


def _proc_value(slot: int, n: int) -> ctypes.Array:
    return (ctypes.c_char * UW_PROC.struct.size).from_buffer_copy(UW_PROC.struct.pack(slot, n))
