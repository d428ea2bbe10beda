"""Decoding of the records that the BPF programs put in the ring buffer.

Layout mirrors `struct ev_hdr` / `struct ev_stack` in sampler/bpf/common.h: a 64-byte header, and for
stack records the user registers, the Python frames and a copy of the top of the user stack.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

HEADER = struct.Struct("<BBHIIHHQQQQQQ")
assert HEADER.size == 64
STACK_HEAD = struct.Struct("<QQQQQHHI")    # ip, sp, bp, ra_slot, ra, stack_len, npy, pad


class EvType(enum.IntEnum):
    ALLOC = 1
    FREE = 2
    VM = 3
    PROC = 4
    CUDA = 5            # a CUDA runtime/driver call (sampler/bpf/cuda.bpf.c; sampler/gpu/cuda.py)


class Source(enum.IntEnum):
    MALLOC = 1
    MMAP = 2
    FAULT = 3
    CUDA = 4            # EV_CUDA records: the layer (runtime)
    CUDA_DRIVER = 5     # (driver)
    TORCH = 6           # sampled tensors of PyTorch's caching allocator (tagged addresses)


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
FLAG_PY_MISS = 8
FLAG_PY_TRUNC = 16
FLAG_SITE_MODULE = 32


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
    ip: int = 0             # user registers at the event (ip: a return address unless FLAG_FIRST_IS_IP)
    sp: int = 0
    bp: int = 0
    ra_slot: int = 0        # nonzero: the stack word there is a uretprobe trampoline standing for ra
    ra: int = 0
    py: tuple[tuple[int, int], ...] = ()    # Python frames, innermost first: (code | entry << 56, instr)
    stack: bytes = b""      # user stack bytes from sp


def decode(raw: bytes) -> Event:
    (etype, source, op, pid, tid, _, flags, ts, addr, size, weight, arg, ret) = HEADER.unpack_from(raw)
    # syscall return values are signed longs
    if ret >= 1 << 63:
        ret -= 1 << 64
    ev = Event(etype, source, op, pid, tid, flags, ts, addr, size, weight, arg, ret)
    if len(raw) >= HEADER.size + STACK_HEAD.size:
        ev.ip, ev.sp, ev.bp, ev.ra_slot, ev.ra, stack_len, npy, _ = STACK_HEAD.unpack_from(raw, HEADER.size)
        off = HEADER.size + STACK_HEAD.size
        npy = min(npy, (len(raw) - off) // 16)
        words = struct.unpack_from(f"<{2 * npy}Q", raw, off)
        ev.py = tuple(zip(words[::2], words[1::2], strict=True))
        off += 16 * npy
        ev.stack = bytes(raw[off : off + stack_len])
    return ev
