"""Stacks: from what BPF captured for an event to a stable stack id and symbolized frames.

This is the one seam between capture and the rest: BPF sends registers, a copy of the top of the
user stack and the thread's raw Python frames; here the native stack is unwound with the
binaries' CFI (sampler/stacks/unwind.py), symbolized, and merged with the Python frames the way
py-spy --native does: each interpreter eval frame is replaced by the Python frames it ran.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import partial

from sampler.bpf.abi import EvFlag, UwStop
from sampler.bpf.events import Event
from sampler.proc.process import exe_path
from sampler.python.codeobj import PyFrame
from sampler.python.targets import PythonTargets
from sampler.stacks.symbolize import Frame, Place, Symbolizer
from sampler.stacks.unwind import Regs, Unwinder, UnwindResult

# plain ints: `int & IntFlag` builds a flag object per event
_FIRST_IS_IP = int(EvFlag.FIRST_IS_IP)
_STACK_ERR = int(EvFlag.STACK_ERR)
_SITE_MODULE = int(EvFlag.SITE_MODULE)
_CONT_BP_UNKNOWN = int(EvFlag.CONT_BP_UNKNOWN)
_CONT_IMPRECISE = int(EvFlag.CONT_IMPRECISE)

# The walk reached the thread's entry: the stack is complete.
COMPLETE = "entry"
# stacks.unwind_stop of the walks that ended in BPF (sampler/stacks/unwind.py's names)
_BPF_STOPS = {UwStop.ENTRY: COMPLETE, UwStop.NO_CFI: "no_cfi", UwStop.BAD_FRAME: "bad_frame",
              UwStop.READ: "unreadable"}


@dataclass(frozen=True)
class Stack:
    stack_id: int
    frames: tuple[Frame, ...]
    truncated: bool
    first_seen_ns: int
    unwind_stop: str            # sampler/stacks/unwind.py UnwindResult.stop, or "no_stack"


class StackTable:
    def __init__(self, symbolizer: Symbolizer, unwinder: Unwinder, python: PythonTargets | None = None,
                 max_frames: int = 127, interpreter_frames: bool = False, memo_size: int = 100_000):
        self.symbolizer = symbolizer
        self.unwinder = unwinder
        self.python = python
        self.max_frames = max_frames
        self.interpreter_frames = interpreter_frames   # keep libpython frames between Python frames
        self.memo_size = memo_size
        self._memo: OrderedDict[tuple, int] = OrderedDict()     # (pid, ip?, pcs, py) -> id
        self._by_id: dict[int, tuple] = {}                       # id -> content key
        self._new: list[tuple] = []      # (id, places and Python frames, truncated, ts, stop): named at drain
        self.collisions = 0
        self.in_bpf = self.handed_over = 0                       # walks that ended in BPF / went on here
        self.last_stop = ""                                      # unwind stop of the last intern
        self.last_pcs: tuple[int, ...] = ()                      # its return addresses
        self._depth: dict[int, int] = {}   # pid -> deepest complete walk (bytes); -1: a copy was short
        self._exe: dict[int, str] = {}     # pid -> main executable
        # pid -> its address space, in memo keys: a fork shares its parent's until it execs or
        # exits, and a pid that comes back (exec, reuse) gets a new one
        self._spaces: dict[int, int] = {}
        self._next_space = 0

    def intern(self, ev: Event) -> int:
        first_is_ip = bool(ev.flags & _FIRST_IS_IP)
        if ev.pcs and ev.stop < UwStop.NO_TABLE:
            pcs, stop = ev.pcs, _BPF_STOPS.get(ev.stop, "bad_frame")     # walked in BPF to its end
            self.in_bpf += 1
        elif ev.pcs:
            pcs, stop = self._go_on(ev)                       # handed over: go on from its last frame
            self.handed_over += 1
        elif ev.stack and not ev.flags & _STACK_ERR:
            res = self.unwinder.unwind(partial(self.symbolizer.locate, ev.pid), Regs(ev.ip, ev.sp, ev.bp),
                                       _restore_return_address(ev), self.max_frames)
            pcs, stop = res.pcs, res.stop
            self._learn_depth(ev.pid, res)
        else:
            pcs, stop = (), "no_stack"
        self.last_stop, self.last_pcs = stop, pcs
        memo_key = (self._space(ev.pid), first_is_ip, pcs, ev.py)
        sid = self._memo.get(memo_key)
        if sid is not None:
            self._memo.move_to_end(memo_key)
            return sid
        native = self.symbolizer.places(ev.pid, pcs, first_is_ip) if pcs else []
        skip = 0
        if ev.flags & _SITE_MODULE and native:
            skip = self._site_frames(ev.pid, native)
        elif first_is_ip and len(native) > 1 and native[0].module.startswith("libc."):
            skip = 1            # a syscall: the ip is in libc's wrapper; its caller is the site
        pyframes = self.python.frames(ev.pid, ev.py) if self.python is not None and ev.py else []
        merged = self._merge(ev.pid, native[skip:], pcs[skip:], first_is_ip and not skip, pyframes)
        # identity from places, names later (drain_new): nothing here reads a symbol table or DWARF
        content = tuple(x.key if isinstance(x, Place) else (x.file, x.function, x.line) for x in merged)
        sid = _hash(content)
        while (known := self._by_id.get(sid)) is not None and known != content:
            self.collisions += 1                     # never merge distinct stacks silently
            sid = _hash((sid, content))
        if known is None:
            self._by_id[sid] = content
            if not self._new:
                self.symbolizer.expect_names()      # the name worker starts now, not at the snapshot
            self._new.append((sid, tuple(merged), stop != COMPLETE, ev.ts_ns, stop))
        if any(isinstance(x, Place) and x.module == "[unknown]" for x in merged) or (ev.py and not pyframes):
            return sid                  # resolve again next time: a library or code may appear
        self._memo[memo_key] = sid
        if len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)
        return sid

    def _go_on(self, ev: Event) -> tuple[tuple[int, ...], str]:
        """The pcs BPF walked, then user space's walk from the last of them over the stack copied
        there (its rbp unknown where BPF could not restore it)."""
        walked = ev.pcs[:-1]
        if ev.stop == UwStop.DEEP and len(ev.pcs) >= self.max_frames:
            return ev.pcs[:self.max_frames], "max_frames"    # as deep as kept: BPF copied nothing
        if not ev.stack or ev.flags & _STACK_ERR:
            return ev.pcs, "stack_end"
        bp = None if ev.flags & _CONT_BP_UNKNOWN else ev.bp
        res = self.unwinder.unwind(partial(self.symbolizer.locate, ev.pid), Regs(ev.pcs[-1], ev.sp, bp),
                                   _restore_return_address(ev), max(1, self.max_frames - len(walked)),
                                   precise=not ev.flags & _CONT_IMPRECISE)
        self._learn_depth(ev.pid, res)
        return walked + res.pcs, res.stop

    def _learn_depth(self, pid: int, res: UnwindResult) -> None:
        """Copy sizes follow the deepest complete walk (stack_hint)."""
        d = self._depth.get(pid, 0)
        if res.stop == "stack_end":
            self._depth[pid] = -1
        elif res.stop == COMPLETE and d >= 0 and res.used > d:
            self._depth[pid] = res.used

    def _merge(self, pid: int, native: list[Place], pcs: tuple[int, ...], first_is_ip: bool,
               pyframes: list[PyFrame]) -> list[Place | PyFrame]:
        """Native frames with each interpreter eval frame replaced by the Python frames it ran
        (up to the next entry frame); interpreter frames between Python frames are hidden."""
        proc = self.python.process(pid) if self.python is not None else None
        if proc is None or not pyframes:
            return list(native)
        out: list[Place | PyFrame] = []
        i, inside = 0, False
        for k, (f, pc) in enumerate(zip(native, pcs, strict=True)):
            addr = pc if (k == 0 and first_is_ip) else pc - 1
            if _in(proc.eval_ranges, addr):
                inside = True
                while i < len(pyframes):
                    out.append(pyframes[i])
                    i += 1
                    if pyframes[i - 1].entry:
                        break
                continue
            if inside and not self.interpreter_frames and _in(proc.module_ranges, addr):
                continue
            out.append(f)
        out.extend(pyframes[i:])   # the native walk ended early
        return out

    def _site_frames(self, pid: int, native: list[Place]) -> int:
        """Frames to drop for a USDT probe in an allocator library (the preload shim, an
        allocator build): all of that library's innermost frames, so that the stack starts at
        the allocator's caller as in the attach tier. Probes in the main executable keep theirs."""
        exe = self._exe.get(pid)
        if exe is None:
            exe = self._exe[pid] = exe_path(pid) or ""
        path = native[0].path
        if not path or path == exe:
            return 0
        n = 0
        while n < len(native) - 1 and native[n].path == path:
            n += 1
        return n

    def stack_hint(self, pid: int, maximum: int) -> int | None:
        """Stack bytes worth copying for `pid`: its deepest complete walk plus a margin, in
        1 KiB steps; None (the maximum) until a walk completed or after a copy was too short."""
        d = self._depth.get(pid, 0)
        if d <= 0:
            return None
        return min(maximum, max(2048, -(-(d + max(2048, d // 4)) // 1024) * 1024))

    def prune(self, live_pids: set[int], shed: int = 0) -> None:
        """`shed` >= 1 (memory is short): the memo goes (stack ids stay stable: they are hashes)."""
        if shed >= 1:
            self._memo.clear()

    def _space(self, pid: int) -> int:
        space = self._spaces.get(pid)
        if space is None:
            space = self._spaces[pid] = self._next_space
            self._next_space += 1
        return space

    def fork(self, parent: int, child: int) -> None:
        """`child` was forked from `parent`: its stacks resolve like the parent's (same memo)."""
        self._spaces[child] = self._space(parent)
        self.symbolizer.fork(parent, child)
        if parent in self._exe:
            self._exe[child] = self._exe[parent]
        if parent in self._depth:
            self._depth[child] = self._depth[parent]

    def forget(self, pid: int) -> None:
        """The process exec'd or exited: its addresses mean something else now (its memo entries
        are never hit again, and age out)."""
        self.symbolizer.forget(pid)
        self._depth.pop(pid, None)
        self._exe.pop(pid, None)
        self._spaces.pop(pid, None)

    def drain_new(self) -> list[Stack]:
        """The stacks first seen since the last call, named now (symbol tables and DWARF are read
        here, at the snapshot, not per sample)."""
        new, self._new = self._new, []
        self.symbolizer.prepare([x for _, merged, *_ in new for x in merged if isinstance(x, Place)])
        out = []
        for sid, merged, truncated, ts, stop in new:
            frames = []
            for x in merged:
                if isinstance(x, Place):
                    f = self.symbolizer.describe(x)
                    frames += [*f.inlined, replace(f, inlined=())]
                else:
                    frames.append(_python_frame(x))
            out.append(Stack(sid, tuple(frames), truncated, ts, stop))
        return out


def _restore_return_address(ev: Event) -> bytes:
    """The stack copy with the original return address where a pending return probe has put its
    trampoline (an event inside a sampled allocation call: glibc's mmap of a large block)."""
    off = ev.ra_slot - ev.sp
    if not ev.ra_slot or not 0 <= off <= len(ev.stack) - 8:
        return ev.stack
    return ev.stack[:off] + struct.pack("<Q", ev.ra) + ev.stack[off + 8:]


def _python_frame(p: PyFrame) -> Frame:
    return Frame(p.function, os.path.basename(p.file), p.file, p.line or 0, None, p.file, p.line, "python")


def _in(ranges: list[tuple[int, int]], addr: int) -> bool:
    """Whether addr lies in one of the sorted, disjoint [lo, hi) ranges."""
    i = bisect.bisect_right(ranges, (addr, float("inf"))) - 1
    return i >= 0 and addr < ranges[i][1]


def _hash(content) -> int:
    h = hashlib.blake2b(repr(content).encode(), digest_size=8).digest()
    return struct.unpack("<q", h)[0]
