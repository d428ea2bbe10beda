"""Reading C headers that both sides of an ABI include (bpf/abi.h, sampler/inprocess/
sampling.h and inject_abi.h): #defines, enums and structs, and their x86-64 layout, without a
compiler (tests/test_abi.py)."""

from __future__ import annotations

import re
import struct

C_TYPES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "s8": "b", "s16": "h", "s32": "i", "s64": "q",
           "uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q", "int32_t": "i", "int64_t": "q",
           "uintptr_t": "Q"}


# An object-like macro with a value (not an include guard, not a function-like macro): (name, value).
DEFINE = re.compile(r"^[ \t]*#define[ \t]+([A-Z_][A-Z0-9_]*)[ \t]+(.+?)[ \t]*$", re.M)


def strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


_CAST = re.compile(r"\(\s*(?:size_t|" + "|".join(C_TYPES) + r")\s*\)")


def _eval(expr: str, names: dict[str, int], structs: dict[str, list] | None = None) -> int:
    """An integer constant expression; `sizeof(struct x)` only once the structs are known."""
    expr = _CAST.sub("", expr)
    if structs is not None:
        expr = re.sub(r"\bsizeof\s*\(\s*struct\s+(\w+)\s*\)", lambda m: str(c_layout(m.group(1), structs)[1]), expr)
    expr = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)
    expr = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda m: str(names[m.group(0)]), expr)
    assert re.fullmatch(r"[\s\d()+\-*<>x0-9a-fA-F]*", expr), expr
    return int(eval(expr))  # noqa: S307 (digits and operators only, checked above)


def parse_header(text: str) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, list]]:
    """(#defines, enums {name: {member: value}}, structs {name: [(field, type, count)]})."""
    text = strip_comments(text)
    defines: dict[str, int] = {}
    later = []                      # those that need the structs (sizeof), or are no integer constant
    for name, expr in re.findall(DEFINE, text):
        try:
            defines.setdefault(name, _eval(expr, defines))
        except (AssertionError, KeyError, SyntaxError):
            later.append((name, expr))
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
    for name, expr in later:
        try:
            defines.setdefault(name, _eval(expr, defines, structs))
        except (AssertionError, KeyError, SyntaxError):
            continue                # not an integer constant (a pointer cast, a string): not ABI here
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
