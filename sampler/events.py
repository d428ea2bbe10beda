"""Decoding of the records that the BPF programs put in the ring buffer.

Layout mirrors `struct ev_hdr` / `struct ev_stack` in bpf/common.h: a 64-byte header, and for
stack records the sp word and the frames.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

HEADER = struct.Struct("<BBHIIHHQQQQQQ")
assert HEADER.size == 64


class EvType(enum.IntEnum):
    ALLOC = 1
    FREE = 2
    VM = 3
    PROC = 4


class Source(enum.IntEnum):
    MALLOC = 1
    MMAP = 2


class VmOp(enum.IntEnum):
    MMAP = 1
    MUNMAP = 2
    MREMAP = 3
    BRK = 4
    MADVISE = 5
    MPROTECT = 6


class ProcOp(enum.IntEnum):
    FORK = 1
    EXEC = 2
    EXIT = 3


FLAG_FIRST_IS_IP = 1
FLAG_SAMPLED = 2
FLAG_STACK_ERR = 4


@dataclass(slots=True)
class Event:
    type: int
    source: int
    op: int
    pid: int
    tid: int
    flags: int
    ts_ns: int          # CLOCK_MONOTONIC (bpf_ktime_get_ns)
    addr: int
    size: int
    weight: int
    arg: int
    ret: int
    frames: tuple[int, ...]
    sp_word: int = 0


def decode(raw: bytes) -> Event:
    (etype, source, op, pid, tid, nframes, flags, ts, addr, size, weight, arg, ret) = HEADER.unpack_from(raw)
    frames: tuple[int, ...] = ()
    sp_word = 0
    if len(raw) > HEADER.size:
        (sp_word,) = struct.unpack_from("<Q", raw, HEADER.size)
        nframes = min(nframes, (len(raw) - HEADER.size - 8) // 8)
        frames = struct.unpack_from(f"<{nframes}Q", raw, HEADER.size + 8)
    # syscall return values are signed longs
    if ret >= 1 << 63:
        ret -= 1 << 64
    return Event(etype, source, op, pid, tid, flags, ts, addr, size, weight, arg, ret, frames, sp_word)
