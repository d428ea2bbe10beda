"""Member offsets of kernel structs, read from the kernel's BTF (/sys/kernel/btf/vmlinux).

bcc compiles against the kernel headers, which do not declare every struct the programs need to
read (uprobes' `return_instance` is private to the kernel on many versions); the running kernel's
BTF describes them all, so their offsets are passed to the compiler instead.
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
_MAGIC = 0xEB9F
_STRUCT = 4
# Bytes after the 12-byte common type header, by kind: fixed, and per vlen entry.
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_ENTRY = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


def struct_offsets(wanted: dict[str, tuple[str, ...]], path: Path = VMLINUX) -> dict[tuple[str, str], int]:
    """Byte offsets of direct members: {(struct, member): offset} for those found in `wanted`
    ({struct: members}); missing structs or members (or no BTF) are simply absent."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    if len(data) < 24:
        return {}
    magic, _, _, hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data)
    if magic != _MAGIC:
        return {}
    types, strs = hdr_len + type_off, hdr_len + str_off
    names = {name.encode() for name in wanted}
    found: dict[tuple[str, str], int] = {}
    p, end = types, types + type_len
    while p + 12 <= end:
        name_off, info, _ = struct.unpack_from("<III", data, p)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        p += 12
        if kind == _STRUCT and vlen and name_off and _name(data, strs + name_off) in names:
            sname = _name(data, strs + name_off).decode()
            members = set(wanted[sname])
            bitfields = info >> 31
            for i in range(vlen):
                m_name, _, m_off = struct.unpack_from("<III", data, p + 12 * i)
                mname = _name(data, strs + m_name).decode()
                bits = m_off & 0xFFFFFF if bitfields else m_off
                if mname in members and (sname, mname) not in found and bits % 8 == 0:
                    found[sname, mname] = bits // 8
        p += _FIXED.get(kind, 0) + _PER_ENTRY.get(kind, 0) * vlen
    return found


def _name(data: bytes, at: int) -> bytes:
    return data[at:data.index(b"\0", at)]
