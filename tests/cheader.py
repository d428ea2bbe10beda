"""Reading C headers that both sides of an ABI include (sampler/bpf/abi.h, sampler/inprocess/
inject_abi.h): #defines, enums and structs, and their x86-64 layout, without a compiler."""

from __future__ import annotations

import re
import struct

C_TYPES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "s8": "b", "s16": "h", "s32": "i", "s64": "q",
           "uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q", "int32_t": "i", "int64_t": "q",
           "uintptr_t": "Q"}


def strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def _eval(expr: str, names: dict[str, int]) -> int:
    expr = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)(?:ULL|UL|U|LL|L)\b", r"\1", expr)
    expr = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda m: str(names[m.group(0)]), expr)
    assert re.fullmatch(r"[\s\d()+\-*<>x0-9a-fA-F]*", expr), expr
    return int(eval(expr))  # noqa: S307 (digits and operators only, checked above)


def parse_header(text: str) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, list]]:
    """(#defines, enums {name: {member: value}}, structs {name: [(field, type, count)]})."""
    text = strip_comments(text)
    defines: dict[str, int] = {}
    for name, expr in re.findall(r"^\s*#define\s+([A-Z_][A-Z0-9_]*)\s+(.+?)\s*$", text, flags=re.M):
        try:
            defines.setdefault(name, _eval(expr, defines))
        except (AssertionError, KeyError, SyntaxError):
            continue                # not an integer constant (sizeof, a cast, a string): not ABI here
    enums: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"enum\s+(\w+)\s*\{(.*?)\}\s*;", text, flags=re.S):
        members, nxt = {}, 0
        for item in filter(None, (s.strip() for s in body.split(","))):
            member, _, value = (s.strip() for s in item.partition("="))
            nxt = _eval(value, {**defines, **members}) if value else nxt
            members[member] = nxt
            nxt += 1
        enums[name] = members
    structs: dict[str, list] = {}
    attributes = r"(?:__attribute__\s*\(\(.*?\)\))?"
    for name, body in re.findall(r"struct\s+(\w+)\s*\{([^{}]*)\}\s*" + attributes + r"\s*;", text, flags=re.S):
        fields = []
        for decl in filter(None, (s.strip() for s in body.split(";"))):
            m = re.fullmatch(r"(struct\s+\w+|\w+)\s+(\w+)\s*(?:\[(.+)\])?", decl)
            assert m, decl
            ctype, field, count = m.groups()
            consts = {**defines, **{k: v for members in enums.values() for k, v in members.items()}}
            fields.append((field, ctype, _eval(count, consts) if count else 1))
        structs[name] = fields
    return defines, enums, structs


def c_layout(name: str, structs: dict[str, list]) -> tuple[dict[str, int], int, int]:
    """(field offsets, size, alignment) of a parsed struct with x86-64 natural alignment."""
    off, align, offsets = 0, 1, {}
    for field, ctype, count in structs[name]:
        if ctype.startswith("struct "):
            _, size, falign = c_layout(ctype.split()[1], structs)
        else:
            size = falign = struct.calcsize(C_TYPES[ctype])
        off += -off % falign
        offsets[field] = off
        off += size * count
        align = max(align, falign)
    return offsets, off + -off % align, align
