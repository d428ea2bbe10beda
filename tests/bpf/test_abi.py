"""Each C ABI against its Python side, by the same rules: bpf/abi.h against sampler/bpf/abi.py
(the BPF programs), and sampler/inprocess/sampling.h + inject_abi.h against sampler/inprocess/abi.py
(the injected sampler and the preload shim): every enum member, constant and struct field, parsed
from the headers (no compiler needed), in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cheader import C_TYPES, DEFINE, c_layout, parse_header, strip_comments

from sampler.bpf import abi as bpf_abi
from sampler.inprocess import abi as inprocess_abi

ROOT = Path(bpf_abi.__file__).resolve().parent.parent.parent
# name: (the mirror module, its headers in include order)
ABIS = {
    "bpf": (bpf_abi, ("abi.h",)),
    "inprocess": (inprocess_abi, ("sampling.h", "inject_abi.h")),
}
# where each ABI's headers and the C files that include them live
C_DIRS = {"bpf": ROOT / "bpf", "inprocess": Path(inprocess_abi.__file__).resolve().parent}


def _header(abi) -> str:
    return "".join((C_DIRS[abi] / h).read_text() for h in ABIS[abi][1])


HEADERS = {abi: _header(abi) for abi in ABIS}
PARSED = {abi: parse_header(text) for abi, text in HEADERS.items()}   # (defines, enums, structs)
ENUM_CASES = [(abi, name) for abi in ABIS for name in sorted(PARSED[abi][1])]
LAYOUT_CASES = [(abi, layout) for abi, (module, _) in ABIS.items() for layout in module.LAYOUTS]


@pytest.mark.parametrize("abi", ABIS)
def test_every_define_has_the_same_value_in_python(abi):
    module, defines = ABIS[abi][0], PARSED[abi][0]
    assert len(defines) == len(DEFINE.findall(strip_comments(HEADERS[abi])))    # the parser read each one
    for name, value in defines.items():
        assert getattr(module, name) == value, name


@pytest.mark.parametrize(("abi", "c_name"), ENUM_CASES, ids=[f"{a}-{n}" for a, n in ENUM_CASES])
def test_every_enum_matches_member_for_member(abi, c_name):
    module, enums = ABIS[abi][0], PARSED[abi][1]
    assert c_name in module.ENUMS, f"enum {c_name} of {abi}'s headers has no Python side in ENUMS"
    cls, prefix = module.ENUMS[c_name]
    assert {prefix + m.name: int(m) for m in cls} == enums[c_name]


@pytest.mark.parametrize("abi", ABIS)
def test_no_python_enum_without_a_c_enum(abi):
    assert set(ABIS[abi][0].ENUMS) == set(PARSED[abi][1])


@pytest.mark.parametrize(("abi", "layout"), LAYOUT_CASES, ids=[f"{a}-{x.name}" for a, x in LAYOUT_CASES])
def test_every_struct_has_the_same_fields_types_offsets_and_size(abi, layout):
    structs = PARSED[abi][2]
    offsets, size, _ = c_layout(layout.name, structs)
    c_decls = structs[layout.name]
    if layout.tail is not None:           # a trailing data array: not part of the fixed record
        assert c_decls[-1][0] == layout.tail
        size = offsets.pop(layout.tail)
        c_decls = c_decls[:-1]
    assert [f for f, _ in layout.fields] == [f for f, _, _ in c_decls]
    assert [_py_type(t) for _, t in layout.fields] == [_c_type(t, n) for _, t, n in c_decls]
    assert layout.offsets == offsets
    assert layout.struct.size == size


def _py_type(ftype) -> tuple[str, int]:
    """(struct format character or struct name, count) of a Layout field."""
    inner, n = (ftype, 1) if isinstance(ftype, str) else ftype
    return (inner if isinstance(inner, str) else inner.name), n


def _c_type(ctype: str, count: int) -> tuple[str, int]:
    return (ctype.split()[1] if ctype.startswith("struct ") else C_TYPES[ctype]), count


@pytest.mark.parametrize("abi", ABIS)
def test_every_struct_of_the_header_has_a_layout(abi):
    assert {x.name for x in ABIS[abi][0].LAYOUTS} == set(PARSED[abi][2])


def test_the_parser_sees_what_the_compiler_would():
    """The parser itself, on a header whose layout is known."""
    d, e, s = parse_header("""
        #ifndef GUARD_H
        #define GUARD_H
        #define A (1ULL << 4)
        #define B (A * 2 + 1)
        #define F(x) ((x) + 1)
        #define C (1u << 3)
        enum x { X_ONE = 1, X_TWO, X_TEN = 10, X_ELEVEN, };
        struct inner { u16 a; u8 b; };
        struct outer { u8 c; struct inner i[2]; u64 d; u8 tail[B]; };
        #define S ((size_t)C * (sizeof(struct outer) + 1))
        #endif
    """)
    assert d == {"A": 16, "B": 33, "C": 8, "S": 520}
    assert e == {"x": {"X_ONE": 1, "X_TWO": 2, "X_TEN": 10, "X_ELEVEN": 11}}
    offsets, size, align = c_layout("outer", s)
    assert offsets == {"c": 0, "i": 2, "d": 16, "tail": 24} and (size, align) == (64, 8)


@pytest.mark.parametrize("abi", ABIS)
def test_nothing_else_redefines_the_abi(abi):
    """The values live in the mirror module alone: no other module, nor a C file beside the
    headers, spells them again."""
    module = ABIS[abi][0]
    defines, enums, _ = PARSED[abi]
    mirror = Path(module.__file__).resolve()
    pattern = re.compile(r"^\s*(?:#define\s+|enum\s+\w+\s*\{[^}]*\b)("
                         + "|".join(map(re.escape, defines)) + r")\b", re.M)
    for c in C_DIRS[abi].glob("*.c"):
        assert not pattern.search(strip_comments(c.read_text())), c
    names = {*defines, *(m for members in enums.values() for m in members)}
    assign = re.compile(r"^(" + "|".join(map(re.escape, names)) + r")(?:\s*,\s*\w+)*\s*=\s*(?:\d|0x|-|\()", re.M)
    for py in (ROOT / "sampler").rglob("*.py"):
        if py.resolve() != mirror:
            assert not assign.search(py.read_text()), py
