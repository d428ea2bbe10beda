"""pyelftools' DWARF parser over sections of our own, and the one place that uses its internals.

dwarf_lines.py asks pyelftools for CUs and their DIEs (public API: DIE attributes, children, references,
range lists, line program headers). Its public API keeps every CU it parses, every line program and
every abbreviation table for the life of the DWARFInfo, and debug info of big binaries runs to
gigabytes, so dwarf_lines parses CUs of its own and lets them go. That takes four internals, used by
DwarfInfo below and nowhere else; pyproject.toml bounds pyelftools to the releases checked to have them,
and tests/binary/test_dwarf_lines.py::test_pyelftools_internals fails on one that lacks them:

- DWARFInfo._parse_CU_at_offset(offset): a CU that is not added to the DWARFInfo's CU cache;
- CompileUnit._dielist: the DIEs a CU has parsed so far, counted against a memory budget;
- DWARFInfo._linetable_cache (by DW_AT_stmt_list): dwarf_lines decodes line programs itself, 4x faster
  than through pyelftools' per-row objects, and drops the program pyelftools parsed;
- DWARFInfo._abbrevtable_cache (by debug_abbrev_offset): gcc gives each CU its own table, dropped with
  the CU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from elftools.dwarf.compileunit import CompileUnit
from elftools.dwarf.dwarfinfo import DebugSectionDescriptor, DwarfConfig, DWARFInfo
from elftools.dwarf.lineprogram import LineProgram
from elftools.dwarf.ranges import RangeLists, RangeListsPair

from sampler.binary.reader import ElfFormatError, FileBytes

# Children of one DIE walked at most (a CU's DIEs number in the hundreds of thousands at most).
MAX_CHILDREN = 1 << 20

# The .debug_<name> sections pyelftools reads.
SECTIONS = ("info", "abbrev", "str", "line", "ranges", "addr", "str_offsets", "line_str", "rnglists")


class Span(NamedTuple):
    """The bytes of one section: a range of the file (read on demand), or inflated contents."""

    buf: FileBytes | bytes
    start: int
    size: int

    def data(self) -> memoryview:
        """The whole section in memory (FileBytes caps the size read)."""
        if isinstance(self.buf, FileBytes):
            return memoryview(self.buf.read(self.start, self.size))
        return memoryview(self.buf)[self.start : self.start + self.size]


class _Stream:
    """A read-only file over a section, for pyelftools, which reads a few bytes at a time: sections
    read on demand go through a window of WINDOW bytes, read with one pread when a read leaves it."""

    __slots__ = ("_buf", "_file", "_start", "_end", "_pos", "_win", "_win_lo")
    WINDOW = 64 << 10

    def __init__(self, sec: Span):
        self._buf, self._start, self._end = sec.buf, sec.start, sec.start + sec.size
        self._file = sec.buf if isinstance(sec.buf, FileBytes) else None
        self._pos = sec.start  # absolute, so that a read is one slice of the buffer
        self._win, self._win_lo = b"", 0

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self._pos = pos + (self._start if whence == os.SEEK_SET else self._pos if whence == os.SEEK_CUR else self._end)
        return self._pos - self._start

    def tell(self) -> int:
        return self._pos - self._start

    def read(self, n: int = -1) -> bytes:
        start = self._pos
        end = self._end if n is None or n < 0 else min(start + n, self._end)
        if end <= start:
            return b""
        self._pos = end
        lo = self._win_lo
        if lo <= start and end <= lo + len(self._win):
            return self._win[start - lo : end - lo]
        if self._file is None:
            return self._buf[start:end]
        if end - start >= self.WINDOW:
            return self._file.read(start, end - start)
        self._win, self._win_lo = self._file.read(start, min(self.WINDOW, self._end - start)), start
        return self._win[: end - start]


class DwarfInfo:
    """A DWARFInfo whose CUs, DIEs and caches the caller can let go (see the module's docstring)."""

    def __init__(self, sections: dict[str, Span]):
        def desc(name: str) -> DebugSectionDescriptor | None:
            sec = sections.get(name)
            return None if sec is None else DebugSectionDescriptor(_Stream(sec), f".debug_{name}", 0, sec.size, 0)

        # ElfReader only reads 64-bit little-endian files. No CFI section is given: the unwinder
        # decodes CFI itself (sampler/stacks/cfi.py).
        config = DwarfConfig(little_endian=True, machine_arch="x64", default_address_size=8)
        unused = dict.fromkeys(("debug_aranges_sec", "debug_frame_sec", "eh_frame_sec", "debug_loc_sec",
                                "debug_pubtypes_sec", "debug_pubnames_sec", "debug_loclists_sec", "debug_sup_sec",
                                "gnu_debugaltlink_sec", "debug_types_sec"))
        self._info = DWARFInfo(config=config, **unused, **{f"debug_{n}_sec": desc(n) for n in SECTIONS})
        self._range_lists = self._info.range_lists()  # a new, stateless reader at each call: made once

    @property
    def info_size(self) -> int:
        return self._info.debug_info_sec.size

    def parse_cu(self, offset: int) -> CompileUnit:
        """The CU at `offset` in .debug_info, parsed anew: not get_CU_at(), whose cache would keep it.
        Its children are walked through guarded_children: pyelftools follows DW_AT_sibling wherever
        it points, and one pointing back at or before itself loops forever."""
        cu = self._info._parse_CU_at_offset(offset)
        cu.iter_DIE_children = guarded_children(cu)  # also what pyelftools recurses through
        return cu

    @staticmethod
    def parsed_dies(cu: CompileUnit) -> int:
        return len(cu._dielist)

    def line_program(self, cu: CompileUnit) -> LineProgram | None:
        """The CU's line program: its header and bounds, for dwarf_lines to decode; not kept here."""
        prog = self._info.line_program_for_CU(cu)
        if prog is not None:
            self._info._linetable_cache.pop(cu.get_top_DIE().attributes["DW_AT_stmt_list"].value, None)
        return prog

    def forget_abbrevs(self, cu: CompileUnit) -> None:
        """Drop the cached abbreviations of a CU let go."""
        self._info._abbrevtable_cache.pop(cu["debug_abbrev_offset"], None)

    def range_lists(self) -> RangeLists | RangeListsPair | None:
        return self._range_lists


def guarded_children(cu: CompileUnit) -> Any:
    """CompileUnit.iter_DIE_children of `cu`, refusing (ElfFormatError) a child that is not past the
    one before it, lies outside the CU, or is one too many: every walk ends."""
    unguarded = CompileUnit.iter_DIE_children.__get__(cu)
    end = cu.cu_offset + cu.size

    def iter_children(die: Any) -> Iterator[Any]:
        last = die.offset
        for n, child in enumerate(unguarded(die)):
            if not last < child.offset < end or n >= MAX_CHILDREN:
                raise ElfFormatError(f"DIE at {child.offset:#x}: a child out of order (DW_AT_sibling?)")
            last = child.offset
            yield child

    return iter_children
