"""Decoding of the records that the BPF programs put in the ring buffer.

Layouts are `struct ev_hdr` / `struct ev_stack` of bpf/abi.h (sampler/bpf/abi.py): a 64-byte
header, and for stack records the user registers, the Python frames, the native pcs walked in BPF
and, where that walk handed over (or did not run), a copy of the user stack from its last frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from sampler.bpf.abi import EV_HDR, EV_STACK

HEADER = EV_HDR.struct
STACK = EV_STACK.struct                 # the header, the registers, stack_len and npy; data follows


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
    ip: int = 0             # user registers at the event (ip: a return address unless EvFlag.FIRST_IS_IP)
    sp: int = 0
    bp: int = 0
    ra_slot: int = 0        # nonzero: the stack word there is a uretprobe trampoline standing for ra
    ra: int = 0
    py: tuple[tuple[int, int], ...] = ()    # Python frames, innermost first: (code | entry << 56, instr)
    pcs: tuple[int, ...] = ()   # native pcs walked in BPF, innermost first (pcs[0] == ip)
    stop: int = 0           # why that walk ended (abi.UwStop); handed over: sp/bp/stack continue it
    stack: bytes = b""      # user stack bytes from sp


def decode(raw: bytes) -> Event:
    if len(raw) >= STACK.size:
        (etype, source, op, pid, tid, flags, ts, addr, size, weight, arg, ret,
         ip, sp, bp, ra_slot, ra, stack_len, npy, npc, stop) = STACK.unpack_from(raw)
    else:
        etype, source, op, pid, tid, flags, ts, addr, size, weight, arg, ret = HEADER.unpack_from(raw)
    # syscall return values are signed longs
    if ret >= 1 << 63:
        ret -= 1 << 64
    ev = Event(etype, source, op, pid, tid, flags, ts, addr, size, weight, arg, ret)
    if len(raw) >= STACK.size:
        ev.ip, ev.sp, ev.bp, ev.ra_slot, ev.ra, ev.stop = ip, sp, bp, ra_slot, ra, stop
        off = STACK.size
        npy = min(npy, (len(raw) - off) // 16)
        if npy:
            words = struct.unpack_from(f"<{2 * npy}Q", raw, off)
            ev.py = tuple(zip(words[::2], words[1::2], strict=True))
            off += 16 * npy
        npc = min(npc, (len(raw) - off) // 8)
        if npc:
            ev.pcs = struct.unpack_from(f"<{npc}Q", raw, off)
            off += 8 * npc
        if stack_len:
            ev.stack = bytes(raw[off : off + stack_len])
    return ev
