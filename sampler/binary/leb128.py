"""LEB128 integers, as DWARF (CFI, line programs, DIEs) encodes them."""

from __future__ import annotations


def uleb(b: bytes | memoryview, p: int) -> tuple[int, int]:
    """(value, position after it) of the unsigned LEB128 at b[p]."""
    v = shift = 0
    while True:
        byte = b[p]
        p += 1
        v |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return v, p


def sleb(b: bytes | memoryview, p: int) -> tuple[int, int]:
    """(value, position after it) of the signed LEB128 at b[p]."""
    v = shift = 0
    while True:
        byte = b[p]
        p += 1
        v |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return (v - (1 << shift) if byte & 0x40 else v), p
