"""The ring-buffer records (sampler/bpf/events.py) decoded: a walk handed over with its stack copy,
a walk that ended in BPF, and a record without a stack."""

from __future__ import annotations

import struct

from sampler.bpf.abi import EvType, UwStop
from sampler.bpf.events import HEADER, STACK, decode

T = 512 << 10


def test_event_decoding():
    stack = bytes(range(40))
    # a walk handed over (UwStop.NO_MAP) after 3 pcs: Python frames, pcs, then the copy
    raw = STACK.pack(EvType.ALLOC, 1, 1, 42, 43, 0, 123, 0xABC, 64, T, 0, 2**64 - 12,
                     0x1111, 0x7FF000, 0x7FF100, 0x7FF008, 0x4444, len(stack), 2, 3, UwStop.NO_MAP)
    raw += struct.pack("<4Q", 0xA | 1 << 56, 0xB, 0xC, 0xD) + struct.pack("<3Q", 0x1111, 0x2222, 0x3333) + stack
    ev = decode(raw)
    assert (ev.pid, ev.tid, ev.addr, ev.size, ev.weight, ev.ret) == (42, 43, 0xABC, 64, T, -12)
    assert (ev.ip, ev.sp, ev.bp, ev.ra_slot, ev.ra) == (0x1111, 0x7FF000, 0x7FF100, 0x7FF008, 0x4444)
    assert ev.py == ((0xA | 1 << 56, 0xB), (0xC, 0xD)) and ev.stack == stack
    assert ev.pcs == (0x1111, 0x2222, 0x3333) and ev.stop == UwStop.NO_MAP
    # a walk that ended in BPF: pcs and no copy
    raw = STACK.pack(EvType.ALLOC, 1, 1, 42, 43, 0, 123, 0xABC, 64, T, 0, 0, 0x1111, 0x7FF000, 0x7FF100, 0, 0,
                     0, 0, 2, UwStop.ENTRY) + struct.pack("<2Q", 0x1111, 0x2222)
    walked = decode(raw)
    assert walked.pcs == (0x1111, 0x2222) and walked.stack == b"" and walked.py == ()
    small = decode(HEADER.pack(EvType.FREE, 1, 11, 42, 43, 0, 1, 0xABC, 0, 0, 0, 0))
    assert small.stack == b"" and small.py == () and small.ip == 0
