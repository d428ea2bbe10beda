"""sampler/bpf/abi.h against its Python side, sampler/bpf/abi.py: every enum member, constant and
struct field, parsed from the header (no compiler needed), in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cheader import c_layout, parse_header, strip_comments

import sampler.bpf as bpf_sources
from sampler.bpf import abi

HEADER = bpf_sources.source("abi.h")
DEFINES, ENUMS, STRUCTS = parse_header(HEADER)


def test_every_define_has_the_same_value_in_python():
    assert len(DEFINES) == len(re.findall(r"^\s*#define\s+[A-Z_][A-Z0-9_]*\s", strip_comments(HEADER), re.M))
    for name, value in DEFINES.items():
        assert getattr(abi, name) == value, name


@pytest.mark.parametrize("c_name", sorted(ENUMS))
def test_every_enum_matches_member_for_member(c_name):
    assert c_name in abi.ENUMS, f"enum {c_name} of abi.h has no Python side in abi.ENUMS"
    cls, prefix = abi.ENUMS[c_name]
    assert {prefix + m.name: int(m) for m in cls} == ENUMS[c_name]


def test_no_python_enum_without_a_c_enum():
    assert set(abi.ENUMS) == set(ENUMS)


@pytest.mark.parametrize("layout", abi.LAYOUTS, ids=lambda x: x.name)
def test_every_struct_has_the_same_fields_offsets_and_size(layout):
    offsets, size, _ = c_layout(layout.name, STRUCTS)
    c_fields = [f for f, _, _ in STRUCTS[layout.name]]
    if layout.tail is not None:           # a trailing data array: not part of the fixed record
        assert c_fields[-1] == layout.tail
        size = offsets.pop(layout.tail)
        c_fields = c_fields[:-1]
    assert [f for f, _ in layout.fields] == c_fields
    assert layout.offsets == offsets
    assert layout.struct.size == size


def test_every_struct_of_the_header_has_a_layout():
    assert {x.name for x in abi.LAYOUTS} == set(STRUCTS)


def test_the_parser_sees_what_the_compiler_would():
    """The parser itself, on a header whose layout is known."""
    d, e, s = parse_header("""
        #define A (1ULL << 4)
        #define B (A * 2 + 1)
        enum x { X_ONE = 1, X_TWO, X_TEN = 10, X_ELEVEN, };
        struct inner { u16 a; u8 b; };
        struct outer { u8 c; struct inner i[2]; u64 d; u8 tail[B]; };
    """)
    assert d == {"A": 16, "B": 33} and e == {"x": {"X_ONE": 1, "X_TWO": 2, "X_TEN": 10, "X_ELEVEN": 11}}
    offsets, size, align = c_layout("outer", s)
    assert offsets == {"c": 0, "i": 2, "d": 16, "tail": 24} and (size, align) == (64, 8)


def test_nothing_else_redefines_the_abi():
    """The values live in abi.py alone: no module or BPF program spells them again."""
    root = Path(bpf_sources.__file__).resolve().parent.parent.parent
    pattern = re.compile(r"^\s*(?:#define\s+|enum\s+\w+\s*\{[^}]*\b)("
                         + "|".join(map(re.escape, DEFINES)) + r")\b", re.M)
    for c in (root / "sampler" / "bpf").glob("*.c"):
        assert not pattern.search(strip_comments(c.read_text())), c
    names = {*DEFINES, *(m for members in ENUMS.values() for m in members)}
    assign = re.compile(r"^(" + "|".join(map(re.escape, names)) + r")(?:\s*,\s*\w+)*\s*=\s*(?:\d|0x|-|\()", re.M)
    for py in (root / "sampler").rglob("*.py"):
        if py.name != "abi.py":
            assert not assign.search(py.read_text()), py
