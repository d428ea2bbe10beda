"""C structs mirrored in Python: a struct's fields, their offsets and its size under x86-64's C ABI
(natural alignment), and a `struct.Struct` that packs and unpacks it.

Each ABI the project shares with C code has one module that mirrors its header with these:
sampler/bpf/abi.py (bpf/abi.h, the BPF programs) and sampler/inprocess/abi.py
(sampler/inprocess/inject_abi.h and sampling.h, the injected sampler and the preload shim).
tests/bpf/test_abi.py parses each header and checks its mirror against it, by one set of rules.
This module imports nothing of the project, so that any layer may use it.
"""

from __future__ import annotations

import struct


class Layout:
    """A C struct as (field, type) pairs, laid out with C's natural alignment (x86-64): `.struct`
    packs and unpacks it, `.offsets` is what the test compares with the header. A type is a
    struct format character, `(char, n)` for an array, or `(Layout, n)` for an array of structs.
    Fields named `pad` become padding bytes in `.struct`."""

    def __init__(self, name: str, fields: list[tuple[str, object]], *, tail: str | None = None):
        self.name = name
        self.fields = fields
        self.tail = tail                # a trailing variable-length array (not in .struct)
        fmt, off, align = "<", 0, 1
        self.offsets: dict[str, int] = {}
        for fname, ftype in fields:
            size, falign, code = _field(ftype)
            pad = -off % falign
            fmt += f"{pad}x" if pad else ""
            off += pad
            self.offsets[fname] = off
            fmt += f"{size}x" if fname == "pad" else code
            off += size
            align = max(align, falign)
        end = off + (-off % align)
        fmt += f"{end - off}x" if end > off else ""
        self.align = align
        self.struct = struct.Struct(fmt)
        assert self.struct.size == end, (name, fmt)


def _field(ftype) -> tuple[int, int, str]:
    """(size, alignment, format) of a field type."""
    if isinstance(ftype, str):
        size = struct.calcsize("<" + ftype)
        return size, size, ftype
    inner, n = ftype
    if isinstance(inner, Layout):
        return inner.struct.size * n, inner.align, "".join(inner.struct.format[1:] for _ in range(n))
    size = struct.calcsize("<" + inner)
    return size * n, size, f"{n}{inner}"
