"""Stacks: from the raw addresses in an event to a stable stack id and symbolized frames.

This is the one seam between stack capture and the rest: `StackTable.intern` takes what the
BPF side captured (today: frame-pointer addresses) and a later unwinder (DWARF, Python frames)
replaces `_addresses` without touching callers.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from .events import FLAG_FIRST_IS_IP, Event
from .symbolize import Frame, Symbolizer, module_key


@dataclass(frozen=True)
class Stack:
    stack_id: int
    frames: tuple[Frame, ...]
    truncated: bool
    first_seen_ns: int


class StackTable:
    def __init__(self, symbolizer: Symbolizer, max_frames: int, memo_size: int = 100_000):
        self.symbolizer = symbolizer
        self.max_frames = max_frames
        self.memo_size = memo_size
        self._memo: OrderedDict[tuple, int] = OrderedDict()     # (pid, flags, addrs) -> id
        self._by_id: dict[int, tuple] = {}                       # id -> content key
        self._new: list[Stack] = []
        self._ra_memo: dict[tuple[int, int], bool] = {}
        self.collisions = 0

    def intern(self, ev: Event) -> int:
        addrs, first_is_ip = self._addresses(ev)
        memo_key = (ev.pid, first_is_ip, addrs)
        sid = self._memo.get(memo_key)
        if sid is not None:
            self._memo.move_to_end(memo_key)
            return sid
        frames = tuple(self.symbolizer.frames(ev.pid, addrs, first_is_ip)) if addrs else ()
        content = tuple(module_key(f) for f in frames)
        sid = _hash(content)
        while (known := self._by_id.get(sid)) is not None and known != content:
            self.collisions += 1                     # never merge distinct stacks silently
            sid = _hash((sid, content))
        if known is None:
            self._by_id[sid] = content
            self._new.append(Stack(sid, frames, len(addrs) >= self.max_frames, ev.ts_ns))
        if any(f.module == "[unknown]" for f in frames):
            return sid                  # symbolize again next time: the library may appear
        self._memo[memo_key] = sid
        if len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)
        return sid

    def _addresses(self, ev: Event) -> tuple[tuple[int, ...], bool]:
        """The stack's addresses, innermost first, and whether the first is an ip (not a return
        address). Innermost is the call site of the allocation function whenever it is known."""
        # bpf_get_stack may end with zero or garbage-low entries when the FP chain breaks
        frames = ev.frames
        n = len(frames)
        while n and frames[n - 1] < 4096:
            n -= 1
        frames = frames[:n]
        first_is_ip = bool(ev.flags & FLAG_FIRST_IS_IP)
        # At a syscall the ip is in a leaf wrapper (mmap64, munmap ...) and the frame-pointer
        # walk skips its caller; the word at sp is that caller's return address when the
        # instruction before it is a call. It replaces the wrapper's frame, as for malloc.
        ra = ev.sp_word
        if first_is_ip and frames and ra and self._is_return_address(ev.pid, ra):
            rest = frames[2:] if len(frames) > 1 and frames[1] == ra else frames[1:]
            return (ra, *rest), False
        return frames, first_is_ip

    def _is_return_address(self, pid: int, addr: int) -> bool:
        key = (pid, addr)
        known = self._ra_memo.get(key)
        if known is None:
            known = self._ra_memo[key] = _follows_call(pid, addr)
            if len(self._ra_memo) > self.memo_size:
                self._ra_memo.pop(next(iter(self._ra_memo)))
        return known

    def forget(self, pid: int) -> None:
        """The process exec'd or exited: its addresses mean something else now."""
        self.symbolizer.forget(pid)
        for k in [k for k in self._memo if k[0] == pid]:
            del self._memo[k]

    def drain_new(self) -> list[Stack]:
        new, self._new = self._new, []
        return new


def _follows_call(pid: int, addr: int) -> bool:
    """Whether the bytes before `addr` in the process end with an x86-64 call instruction."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr - 7)
            b = f.read(7)
    except (OSError, OverflowError, ValueError):
        return False
    if len(b) < 7:
        return False
    return (b[2] == 0xE8                                        # call rel32
            or (b[1] == 0xFF and b[2] in (0x15, 0x14))          # call *disp32(%rip), *(%reg,...)
            or (b[5] == 0xFF and 0xD0 <= b[6] <= 0xD7)          # call *%reg
            or (b[4] == 0xFF and (b[5] & 0x38) == 0x10)         # call *disp8(%reg)
            or (b[1] == 0xFF and (b[2] & 0xF8) == 0x90))        # call *disp32(%reg)


def _hash(content) -> int:
    h = hashlib.blake2b(repr(content).encode(), digest_size=8).digest()
    return struct.unpack("<q", h)[0]
