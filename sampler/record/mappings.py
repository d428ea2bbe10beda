"""What a target's memory-mapping syscalls do to its outstanding table, and their `vm_events`
rows (bounded per interval). vm_events.py names what glibc's allocator is doing with them."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

from sampler.bpf.abi import VmOp
from sampler.bpf.events import Event
from sampler.record import rows
from sampler.record.outstanding import FAULT
from sampler.record.target import Target
from sampler.record.vm_events import MADV_DONTNEED, MADV_FREE

MADV_REMOVE = 9
PROT_EXEC, MAP_ANONYMOUS = 4, 0x20
DLOPEN_RESCAN_S = 1.0       # after an executable file mapping: look for new libraries at every poll


class Mappings:
    """`intern(ev)` names a sampled event's stack; `last_pcs()` the native pcs of the last one
    interned; `mapped_code(t)` is told when a target maps code (a library being loaded)."""

    def __init__(self, max_rows: int, intern: Callable[[Event], int], last_pcs: Callable[[], tuple[int, ...]],
                 mapped_code: Callable[[Target], None], wall: Callable[[int], dt.datetime]):
        self.max_rows = max_rows
        self.intern, self.last_pcs, self.mapped_code, self.wall = intern, last_pcs, mapped_code, wall
        self.rows: list[dict] = []
        self.dropped = 0            # rows over max_rows this interval

    def drain(self) -> list[dict]:
        out, self.rows = self.rows, []
        return out

    def on_event(self, t: Target, ev: Event) -> None:
        op, ok = ev.op, ev.ret >= 0 or ev.ret < -4095
        if t.injection is not None and t.injection.owns(ev.ret if op == VmOp.MMAP else ev.addr):
            return                          # the injected sampler's own mappings, made by us
        sid = self.intern(ev) if ev.weight else None
        t.vm_sampled = t.vm_sampled or bool(ev.weight)
        if sid is not None and op == VmOp.MMAP and t.injection is not None \
                and t.injection.under_python_wrapper(self.last_pcs()):
            ev.weight = 0                   # pymalloc's arena: its objects are sampled as `python`
        if ok and op != VmOp.MADVISE:
            t.sample = None                         # its smaps breakdown is read again (snapshot.py)
        if ok and op == VmOp.MMAP:
            t.table.unmap(ev.ret, ev.size)          # whatever was mapped there is gone
            if ev.weight:
                t.table.map(ev.ret, ev.size, ev.weight, sid, ev.ts_ns)
        elif ok and op == VmOp.MUNMAP:
            t.table.unmap(ev.addr, ev.size)
        if ok and op == VmOp.MMAP and ev.arg & PROT_EXEC and not (ev.arg >> 32) & MAP_ANONYMOUS:
            # a library is being loaded (dlopen of libcudart, libcuda): look for it at every poll
            # for a moment, not only at the next snapshot; its samples come after this event (one
            # ring buffer, in order), and their stacks need the new maps
            t.rescan_until = max(t.rescan_until, time.monotonic() + DLOPEN_RESCAN_S)
            self.mapped_code(t)
        elif ok and op == VmOp.MREMAP:
            t.table.move(ev.addr, ev.size, ev.ret, ev.arg)
            t.table.unmap(ev.addr, ev.size)
            if ev.weight:
                t.table.map(ev.ret, ev.arg, ev.weight, sid, ev.ts_ns)
        elif ok and op == VmOp.MADVISE and ev.arg & 0xFFFFFFFF in (MADV_DONTNEED, MADV_FREE, MADV_REMOVE):
            t.table.unmap(ev.addr, ev.size, (FAULT,))  # the pages leave RSS, the mapping stays
        elif ok and op == VmOp.BRK and t.vm.brk_range and ev.ret < t.vm.brk_range[1]:
            t.table.unmap(ev.ret, t.vm.brk_range[1] - ev.ret, (FAULT,))   # the heap shrank
        event = t.vm.classify(op, ev.addr, ev.size, ev.arg, ev.ret)
        if len(self.rows) >= self.max_rows:
            self.dropped += 1
            return
        self.rows.append(rows.vm_row(ev, event, self.wall(ev.ts_ns), sid))
