"""LEB128 integers, as DWARF (CFI, line programs, DIEs) encodes them."""

from __future__ import annotations

MAX_BYTES = 10          # 70 bits: any 64-bit value; a longer run comes from a damaged or hostile file


def _leb(b: bytes | memoryview, p: int, signed: bool) -> tuple[int, int]:
    v = shift = 0
    for _ in range(MAX_BYTES):
        byte = b[p]
        p += 1
        v |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return (v - (1 << shift) if signed and byte & 0x40 else v), p
    raise ValueError(f"LEB128 longer than {MAX_BYTES} bytes at offset {p - MAX_BYTES}")


def uleb(b: bytes | memoryview, p: int) -> tuple[int, int]:
    """(value, position after it) of the unsigned LEB128 at b[p]; ValueError past MAX_BYTES."""
    return _leb(b, p, False)


def sleb(b: bytes | memoryview, p: int) -> tuple[int, int]:
    """(value, position after it) of the signed LEB128 at b[p]; ValueError past MAX_BYTES."""
    return _leb(b, p, True)
