"""Source file, line and inlined calls of native addresses, from DWARF (.debug_info, .debug_line).

Debug info of big binaries runs to gigabytes, so everything is lazy: the compilation unit (CU) of an
address comes from a sorted index of .debug_aranges (of CU top DIEs for CUs it lacks), and only that
CU's line program and the DIEs on the way to the address are parsed. pyelftools parses the DIEs, through
dwarf_info.DwarfInfo (CUs and caches this module can let go); line programs are decoded here, 4x faster
than through its per-row objects. Uncompressed sections are read from the file on demand (pread, no
mapping: see reader.FileBytes); compressed ones (SHF_COMPRESSED, .zdebug_*) are inflated once, each up to
reader.MAX_INFLATED bytes and within the file's reader.Budget, into unlinked cache files (INFLATED_HELD_MAX
for all files together). Every walk is bounded: children in offset order (dwarf_info), line programs
to MAX_LINE_PROGRAM bytes and MAX_LINE_ROWS rows, DIEs per CU to DIE_BUDGET.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from elftools.dwarf.compileunit import CompileUnit
from elftools.dwarf.ranges import BaseAddressEntry

from sampler import files
from sampler.binary.dwarf_info import SECTIONS as _DWARF_SECTIONS
from sampler.binary.dwarf_info import DwarfInfo, Span
from sampler.binary.elf import ElfImage
from sampler.binary.leb128 import sleb as _sleb
from sampler.binary.leb128 import uleb as _uleb
from sampler.binary.reader import SHT_NOBITS, ElfFormatError, ElfReader, FileBytes, OverBudget

# .debug_<name> sections read: those pyelftools parses, and the aranges indexed here.
_SECTIONS = (*_DWARF_SECTIONS, "aranges")

# DIEs whose code ranges nest: the path from a function to an address goes through them.
_SCOPES = frozenset(
    ("DW_TAG_subprogram", "DW_TAG_inlined_subroutine", "DW_TAG_lexical_block", "DW_TAG_try_block", "DW_TAG_catch_block")
)
# Where functions are defined besides the CU itself: namespaces (clang), functions and blocks
# (nested functions, local classes), and the classes local to them (C++ lambdas).
_CONTAINERS = frozenset(("DW_TAG_namespace", "DW_TAG_module"))
_LOCAL_SCOPES = frozenset(("DW_TAG_subprogram", "DW_TAG_lexical_block"))
_TYPES = frozenset(("DW_TAG_class_type", "DW_TAG_structure_type", "DW_TAG_union_type"))
_ADDR_FORMS = frozenset(("DW_FORM_addr", "DW_FORM_addrx", "DW_FORM_addrx1", "DW_FORM_addrx2", "DW_FORM_addrx3",
                         "DW_FORM_addrx4", "DW_FORM_GNU_addr_index"))

MEMO_SIZE = 65536  # addresses remembered per image
UNIT_CACHE = 16  # parsed CUs kept per image
DIE_BUDGET = 50_000  # parsed DIEs kept per image, about 60 MiB
MAX_LINE_PROGRAM = 32 << 20  # bytes of one CU's line program (real ones: under a few MiB)
MAX_LINE_ROWS = 2_000_000  # rows decoded from one line program
MAX_WALK = 1_000_000  # DIEs visited indexing one CU's functions


@dataclass(frozen=True, slots=True)
class SourceFrame:
    function: str | None  # DW_AT_name, or the C++ mangled linkage name where there is one: demangle it
    file: str | None
    line: int | None


class LineTables:
    """File/line and inlined frames of the addresses of one ELF image, from its DWARF."""

    # By image, not build-id: a file claiming another's build-id must not supply its lines (images
    # of identical files are one ElfImage).
    _cache: dict[ElfImage, LineTables | None] = {}
    _cache_lock = threading.Lock()
    CACHE_MAX = 256         # files whose line tables are kept

    @classmethod
    def prune(cls, shed: int = 0) -> None:
        """Bound the per-file tables: all go above CACHE_MAX, or at `shed` 2 (memory is short)."""
        with cls._cache_lock:
            if shed >= 2 or len(cls._cache) > cls.CACHE_MAX:
                cls._cache.clear()

    def __init__(self, path: str, sections: dict[str, Span]):
        self.path = path
        self._sections = sections
        self._dwarf = DwarfInfo(sections)
        self._cus = _CuIndex(self._dwarf, sections["aranges"].data() if "aranges" in sections else None)
        self._units: OrderedDict[int, _Unit] = OrderedDict()
        self._memo: OrderedDict[int, tuple[SourceFrame, ...]] = OrderedDict()
        # pyelftools reads through shared stream positions.
        self._lock = threading.Lock()

    @classmethod
    def for_image(cls, img: ElfImage) -> LineTables | None:
        """The DWARF of `img` itself, else of its separate debug file; None when neither has any."""
        key = img
        with cls._cache_lock:
            if key in cls._cache:
                return cls._cache[key]
        tables, transient = None, False
        # both files as opened (and the debug file verified) with the image, read through the fds
        # it holds: their paths may name other files since
        for path, source in ((img.path, img.elf), (img.debug_path, img.debug_elf)):
            if not path or source is None:
                continue
            try:
                found = read_sections(source)
                if found is not None:
                    sections, held = found
                    try:
                        tables = cls(path, sections)
                    except BaseException:
                        _release(held)
                        raise
                    weakref.finalize(tables, _release, held)    # what it inflated is let go with it
                    break
            except OSError:
                transient = True  # e.g. /proc/PID/map_files of a process that exited: try again later
            except Exception:
                pass  # a malformed file: no usable DWARF
        if tables is None and transient:
            return None
        with cls._cache_lock:
            return cls._cache.setdefault(key, tables)

    def lookup(self, vaddr: int) -> list[SourceFrame]:
        """Innermost first: the inlined calls containing vaddr (each with the file/line where the code
        at vaddr is, then the call sites: DW_AT_call_file/DW_AT_call_line of each inlined_subroutine),
        ending with the outermost (the real function, named by its DW_TAG_subprogram) and its
        file/line. [] when unknown."""
        with self._lock:
            frames = self._memo.get(vaddr)
            if frames is not None:
                self._memo.move_to_end(vaddr)
                return list(frames)
            try:
                frames = tuple(self._resolve(vaddr))
            except Exception:
                frames = ()  # malformed or unsupported DWARF: unknown, as documented
            self._memo[vaddr] = frames
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
            return list(frames)

    def _resolve(self, pc: int) -> list[SourceFrame]:
        cu_offset = self._cus.find(pc)
        if cu_offset is None:
            return []
        unit = self._unit(cu_offset)
        file, line = unit.line_at(pc)
        chain = unit.scopes(pc)
        if not chain:
            return [SourceFrame(None, file, line)] if file or line else []
        frames = []
        for die in reversed(chain):
            frames.append(SourceFrame(_name(die), file, line))
            if die.tag == "DW_TAG_inlined_subroutine":
                attrs = die.attributes
                file = unit.file(_int(attrs.get("DW_AT_call_file")))
                line = _int(attrs.get("DW_AT_call_line")) or None
        return frames

    def _unit(self, cu_offset: int) -> _Unit:
        unit = self._units.pop(cu_offset, None)
        if unit is None:
            # A CU of our own, not the DWARFInfo's cached one, so that its DIEs go when it does.
            unit = _Unit(self._dwarf, self._dwarf.parse_cu(cu_offset), self._sections)
        self._units[cu_offset] = unit
        # Parsed DIEs (~1 KiB each) are most of the memory: few units, fewer when they are big.
        while len(self._units) > 1 and (
            len(self._units) > UNIT_CACHE or sum(u.dies() for u in self._units.values()) > DIE_BUDGET
        ):
            self._units.popitem(last=False)[1].drop()
        return unit


class _Unit:
    """One CU: its line table as sorted arrays, its file names and an index of its functions."""

    def __init__(self, dwarf: DwarfInfo, cu: CompileUnit, sections: dict[str, Span]):
        self.dwarf = dwarf
        self.cu = cu
        top = cu.get_top_DIE()
        self.top = top
        self.base = _int(top.attributes.get("DW_AT_low_pc"))  # of DWARF 4 range lists
        self.comp_dir = _str(top.attributes.get("DW_AT_comp_dir")) or ""
        self.files: list[str | None] = []
        self.addr = np.empty(0, np.uint64)
        self.rows = np.empty((0, 2), np.int64)  # (file, line); file -1 ends a sequence
        if "DW_AT_stmt_list" in top.attributes and "line" in sections:
            try:
                prog = dwarf.line_program(cu)
                self.files = self._file_names(prog.header)
                sec = sections["line"]
                start, end = prog.program_start_offset, min(prog.program_end_offset, sec.size)
                end = min(end, start + MAX_LINE_PROGRAM)
                self.addr, self.rows = _decode_line_program(sec.buf[sec.start + start : sec.start + end], prog.header)
            except Exception:
                pass  # a malformed line program: functions and inlined calls, without lines
        self._funcs: _Intervals | None = None
        self._deep = False

    def _file_names(self, hdr: Any) -> list[str | None]:
        # DWARF 5 numbers files and directories from 0, directory 0 being the compilation directory;
        # before, from 1, directory 0 meaning the CU's DW_AT_comp_dir. Relative directories are
        # relative to the compilation directory.
        dirs = [_text(d) for d in hdr.get("include_directory", ())]
        v5 = hdr["version"] >= 5
        base = dirs[0] if v5 and dirs else self.comp_dir
        sub = dirs[1:] if v5 else dirs  # sub[i] is directory i + 1

        def path(entry: Any) -> str | None:
            name = _text(entry.name)
            d = entry.dir_index or 0
            directory = sub[d - 1] if 0 < d <= len(sub) else ""
            return os.path.normpath(os.path.join(base, directory, name)) if name else None

        names = [path(e) for e in hdr.get("file_entry", ())]
        return names if v5 else [None, *names]

    def dies(self) -> int:
        return self.dwarf.parsed_dies(self.cu)

    def drop(self) -> None:
        self.dwarf.forget_abbrevs(self.cu)

    def file(self, index: int) -> str | None:
        return self.files[index] if 0 <= index < len(self.files) else None

    def line_at(self, pc: int) -> tuple[str | None, int | None]:
        i = int(np.searchsorted(self.addr, np.uint64(pc), "right")) - 1
        if i < 0 or self.rows[i, 0] < 0:  # before the first row, or past the end of a sequence
            return None, None
        file, line = (int(v) for v in self.rows[i])
        return self.file(file), line or None  # line 0: code of no source line

    def scopes(self, pc: int) -> list[Any]:
        """The function containing pc, then the inlined calls down to pc, outermost first."""
        if self._funcs is None:
            self._funcs = self._index_functions(deep=False)
        offset = self._funcs.find(pc)
        if offset is None and not self._deep:
            self._deep = True
            self._funcs = self._index_functions(deep=True)
            offset = self._funcs.find(pc)
        if offset is None:
            return []
        die = self.cu.get_DIE_from_refaddr(offset)
        chain = [die]
        while (die := self._inner_scope(die, pc)) is not None:
            if die.tag == "DW_TAG_subprogram":  # a nested function (GNU C) is a frame of its own
                chain = [die]
            elif die.tag == "DW_TAG_inlined_subroutine":
                chain.append(die)
        return chain

    def _index_functions(self, deep: bool) -> _Intervals:
        """Code ranges of the functions of the CU. Most are children of the CU; the deep scan, for
        addresses that these miss, also finds those of namespaces (clang), of local classes (C++
        lambdas, in the abstract instance of their function) and nested functions."""
        lo, hi, off = [], [], []
        parents = [self.top]
        walked = 0
        while parents:
            parent = parents.pop()
            local = parent.tag in _LOCAL_SCOPES
            for die in parent.iter_children():
                walked += 1
                if walked > MAX_WALK:
                    raise ElfFormatError(f"{self.cu.cu_offset:#x}: over {MAX_WALK} DIEs")
                tag = die.tag
                if tag == "DW_TAG_subprogram":
                    if "DW_AT_declaration" in die.attributes:
                        continue  # no code, nothing defined inside
                    for a, b in self.ranges(die):
                        lo.append(a)
                        hi.append(b)
                        off.append(die.offset)
                nests = tag in _CONTAINERS or tag in _LOCAL_SCOPES or local and tag in _TYPES
                if deep and nests and die.has_children:
                    parents.append(die)
        return _Intervals(lo, hi, off)

    def _inner_scope(self, die: Any, pc: int) -> Any | None:
        """The child scope of `die` whose code holds pc, looking into blocks that have no ranges."""
        for child in die.iter_children():
            if child.tag not in _SCOPES:
                continue
            ranges = self.ranges(child)
            if any(a <= pc < b for a, b in ranges):
                return child
            if not ranges and child.tag == "DW_TAG_lexical_block" and child.has_children:
                inner = self._inner_scope(child, pc)
                if inner is not None:
                    return inner
        return None

    def ranges(self, die: Any) -> list[tuple[int, int]]:
        return _ranges(self.dwarf, self.cu, self.base, die)


def _ranges(dwarf: DwarfInfo, cu: CompileUnit, base: int, die: Any) -> list[tuple[int, int]]:
    """Code ranges of a DIE; `base` is the CU's low_pc, the base of DWARF 4 range lists."""
    attrs = die.attributes
    low, high = attrs.get("DW_AT_low_pc"), attrs.get("DW_AT_high_pc")
    if low is not None and high is not None:
        # DWARF 4+: high_pc of a constant form is the size.
        out = [(low.value, high.value if high.form in _ADDR_FORMS else low.value + high.value)]
    elif "DW_AT_ranges" in attrs and (lists := dwarf.range_lists()) is not None:
        out = []
        try:
            for e in lists.get_range_list_at_offset(attrs["DW_AT_ranges"].value, cu=cu):
                if isinstance(e, BaseAddressEntry):
                    base = e.base_address
                elif e.is_absolute:
                    out.append((e.begin_offset, e.end_offset))
                else:
                    out.append((base + e.begin_offset, base + e.end_offset))
        except Exception:
            return []  # a malformed list: this DIE only, not the whole CU, is lost
    else:
        return []
    # Linkers leave the code they discarded at 0 (ld) or at -1 or -2 (lld).
    return [(a, b) for a, b in out if 0 < a < b < 1 << 64]


class _Intervals:
    """Address ranges -> value, sorted by start; nested or overlapping ranges resolve to the latest start."""

    def __init__(self, lo: list[int] | np.ndarray, hi: list[int] | np.ndarray, val: list[int] | np.ndarray):
        lo, hi, val = (np.asarray(x, np.uint64) for x in (lo, hi, val))
        order = np.argsort(lo, kind="stable")
        self.lo, self.hi, self.val = lo[order], hi[order], val[order]
        self.cover = np.maximum.accumulate(self.hi) if len(self.hi) else self.hi

    def find(self, pc: int) -> int | None:
        v = np.uint64(pc)
        i = int(np.searchsorted(self.lo, v, "right")) - 1
        if i < 0 or self.cover[i] <= v:
            return None
        if self.hi[i] > v:
            return int(self.val[i])
        hit = np.flatnonzero(self.hi[:i] > v)  # all start at or before pc
        return int(self.val[hit[-1]]) if len(hit) else None

    def merged(self, other: _Intervals) -> _Intervals:
        return _Intervals(*(np.concatenate((getattr(self, k), getattr(other, k))) for k in ("lo", "hi", "val")))


class _CuIndex:
    """Address -> offset of its CU in .debug_info: .debug_aranges first; the CUs it does not list are
    indexed by the ranges of their top DIE, once, when an address misses."""

    def __init__(self, dwarf: DwarfInfo, aranges: memoryview | None):
        self.dwarf = dwarf
        lo, hi, off = _parse_aranges(aranges) if aranges is not None else ([], [], [])
        self.known = set(np.unique(off).tolist())
        self.index = _Intervals(lo, hi, off)
        self.complete = False

    def find(self, pc: int) -> int | None:
        found = self.index.find(pc)
        if found is None and not self.complete:
            self.complete = True
            self.index = self.index.merged(self._scan_unlisted())
            found = self.index.find(pc)
        return found

    def _scan_unlisted(self) -> _Intervals:
        lo, hi, off = [], [], []
        offset, size = 0, self.dwarf.info_size
        try:
            while offset < size:
                # Not iter_CUs(): the DWARFInfo would keep every CU it parsed.
                cu = self.dwarf.parse_cu(offset)
                if offset not in self.known:
                    top = cu.get_top_DIE()
                    for a, b in _ranges(self.dwarf, cu, _int(top.attributes.get("DW_AT_low_pc")), top):
                        lo.append(a)
                        hi.append(b)
                        off.append(offset)
                offset += cu.size
        except Exception:
            pass  # a malformed CU: the ones after it cannot be found
        return _Intervals(lo, hi, off)


def _parse_aranges(data: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, CU offsets) of the address ranges of each CU in .debug_aranges."""
    lo, hi, off = [np.empty(0, np.uint64)], [np.empty(0, np.uint64)], [np.empty(0, np.uint64)]
    pos = 0
    while pos + 4 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "little")
        at, offset_size = pos + 4, 4
        if length == 0xFFFFFFFF:  # 64-bit DWARF
            length = int.from_bytes(data[pos + 4 : pos + 12], "little")
            at, offset_size = pos + 12, 8
        end = at + length
        if length == 0 or end > len(data):
            break
        info = int.from_bytes(data[at + 2 : at + 2 + offset_size], "little")
        addr_size, seg_size = data[at + 2 + offset_size], data[at + 3 + offset_size]
        if addr_size == 8 and seg_size == 0:
            # (address, length) pairs, from the first multiple of 16 bytes past the header.
            first = pos + (at + 4 + offset_size - pos + 15) // 16 * 16
            pairs = np.frombuffer(data, "<u8", (end - first) // 16 * 2, first).reshape(-1, 2)
            start, stop = pairs[:, 0], pairs[:, 0] + pairs[:, 1]
            keep = (start > 0) & (stop > start)  # drops the terminator, discarded code, overflows
            lo.append(start[keep])
            hi.append(stop[keep])
            off.append(np.full(int(keep.sum()), info, np.uint64))
        pos = end
    return np.concatenate(lo), np.concatenate(hi), np.concatenate(off)


def _decode_line_program(code: bytes, hdr: Any) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, (file, line) rows) sorted by address; a row of file -1 ends a sequence."""
    min_len = hdr["minimum_instruction_length"]
    line_base, line_range, opcode_base = hdr["line_base"], hdr["line_range"], hdr["opcode_base"]
    arg_counts = hdr["standard_opcode_lengths"]
    const_add = (255 - opcode_base) // line_range * min_len
    addrs: list[int] = []
    rows: list[int] = []
    addr, file, line = 0, 1, 1
    seq = 0  # index of the current sequence's first row
    pos, n = 0, len(code)
    while pos < n:
        op = code[pos]
        pos += 1
        if len(addrs) > MAX_LINE_ROWS:
            raise ElfFormatError(f"a line program of over {MAX_LINE_ROWS} rows")
        if op >= opcode_base:  # special opcode: advance address and line, append a row
            adj = op - opcode_base
            addr += adj // line_range * min_len
            line += line_base + adj % line_range
            addrs.append(addr)
            rows += (file, line)
        elif op == 0:  # extended opcode
            size, pos = _uleb(code, pos)
            sub = code[pos] if size else 0
            if sub == 1:  # end_sequence
                addrs.append(addr)
                rows += (-1, 0)
                if addrs[seq] == 0 or addr >> 64:  # code the linker discarded (see _ranges)
                    del addrs[seq:], rows[2 * seq :]
                seq = len(addrs)
                addr, file, line = 0, 1, 1
            elif sub == 2:  # set_address
                addr = int.from_bytes(code[pos + 1 : pos + size], "little")
            pos += size
        elif op == 1:  # copy
            addrs.append(addr)
            rows += (file, line)
        elif op == 2:  # advance_pc
            v, pos = _uleb(code, pos)
            addr += v * min_len
        elif op == 3:  # advance_line
            v, pos = _sleb(code, pos)
            line += v
        elif op == 4:  # set_file
            file, pos = _uleb(code, pos)
        elif op == 8:  # const_add_pc
            addr += const_add
        elif op == 9:  # fixed_advance_pc
            addr += int.from_bytes(code[pos : pos + 2], "little")
            pos += 2
        else:  # set_column, set_isa, flags and unknown opcodes: skip their LEB128 operands
            for _ in range(arg_counts[op - 1] if op - 1 < len(arg_counts) else 0):
                _, pos = _uleb(code, pos)
    del addrs[seq:], rows[2 * seq :]  # a sequence without its end: malformed
    a = np.array(addrs, np.uint64)
    r = np.array(rows, np.int64).reshape(-1, 2)
    # By address; at one address a sequence's end before the next one's rows, then program order,
    # so that the last row at or below an address describes it.
    order = np.lexsort((np.arange(len(a)), r[:, 0] >= 0, a))
    return a[order], r[order]


def _name(die: Any) -> str | None:
    """The name of a function, through abstract origins and declarations: its C++ mangled linkage
    name (qualified, with parameter types) when it has one, else DW_AT_name. C linkage names are
    not used: they are asm labels (glibc's __GI___libc_malloc for __libc_malloc)."""
    name = None
    try:
        for _ in range(8):  # chains are short; a cycle in bad DWARF must not hang
            attrs = die.attributes
            for key in ("DW_AT_linkage_name", "DW_AT_MIPS_linkage_name"):
                linkage = _str(attrs.get(key))
                if linkage is not None and linkage.startswith("_Z"):
                    return linkage
            name = name or _str(attrs.get("DW_AT_name"))
            ref = next((k for k in ("DW_AT_abstract_origin", "DW_AT_specification") if k in attrs), None)
            if ref is None:
                break
            die = die.get_DIE_from_attribute(ref)
    except Exception:
        pass  # a reference into a file we do not have (dwz's, split DWARF): keep what was found
    return name


def _str(attr: Any) -> str | None:
    # Strings of forms pyelftools cannot resolve (a dwz file's) stay integers.
    return _text(attr.value) if attr is not None and isinstance(attr.value, (bytes, str)) else None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else ""  # an unresolved string form stays an integer


def _int(attr: Any) -> int:
    return attr.value if attr is not None and isinstance(attr.value, int) else 0


# Reading the sections


SPILL_BYTES = 256 << 10     # inflated sections from this size on are kept in a file, not in memory
# Inflated bytes held by every image's tables together (in files or memory): a recorded process that
# maps many files, each within its own budget, cannot fill the disk or the heap with them.
INFLATED_HELD_MAX = 1 << 30
# ... and in memory, with no private cache directory to keep them in (libc6-dbg's: 8.5 MiB)
INFLATED_IN_MEMORY_MAX = 64 << 20
_held = [0]
_held_lock = threading.Lock()


def _release(n: int) -> None:
    with _held_lock:
        _held[0] -= n


class _Spill:
    """Inflated contents as they come: in memory up to SPILL_BYTES, then in an unlinked file of the
    cache directory read back on demand as a file's sections are (libc6-dbg's inflate to 8.5 MiB,
    kept for the recording's life): page cache, not the recorder's heap. In memory where there is
    no such directory or no room. Counts what it holds against INFLATED_HELD_MAX."""

    def __init__(self, what: str):
        self.what = what
        self.pieces: list[bytes] = []
        self.fd = -1
        self.size = 0
        self.tried = False              # to make a file

    def write(self, piece: bytes) -> None:
        with _held_lock:
            if _held[0] + len(piece) > INFLATED_HELD_MAX:
                raise OverBudget(f"{self.what}: inflated DWARF of all files over {INFLATED_HELD_MAX} bytes")
            _held[0] += len(piece)
        self.size += len(piece)
        if self.fd < 0 and self.size >= SPILL_BYTES and not self.tried:
            self.tried = True
            self._to_file()
        if self.fd < 0 and self.size > INFLATED_IN_MEMORY_MAX:
            raise OverBudget(f"{self.what}: over {INFLATED_IN_MEMORY_MAX} bytes inflated, and no private cache "
                             "directory to keep them in")
        if self.fd >= 0:
            try:
                _write_all(self.fd, piece)
                return
            except OSError as e:     # a full disk: this file's DWARF is not read
                raise OverBudget(f"{self.what}: no room to keep what was inflated ({e})") from None
        self.pieces.append(piece)

    def _to_file(self) -> None:
        where = files.cache_dir("inflated")
        if where is None:
            return
        try:
            fd = os.open(where, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError:
            return
        try:
            for piece in self.pieces:
                _write_all(fd, piece)
        except OSError:
            os.close(fd)
            return
        self.fd, self.pieces = fd, []

    def result(self) -> FileBytes | bytes:
        if self.fd < 0:
            return b"".join(self.pieces)
        fd, self.fd = self.fd, -1
        try:
            return FileBytes(fd, self.size, self.what)
        finally:
            os.close(fd)        # FileBytes holds its own

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        _release(self.size)


def _write_all(fd: int, data: bytes) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


def read_sections(source: str | ElfReader) -> tuple[dict[str, Span], int] | None:
    """The DWARF sections of a file (inflated where compressed) and the bytes inflated; None when
    it has no .debug_info."""
    elf = ElfReader.open(source) if isinstance(source, str) else source
    out: dict[str, Span] = {}
    spills: list[_Spill] = []
    try:
        for sec in elf.sections:
            key = next((sec.name[len(p) :] for p in (".debug_", ".zdebug_") if sec.name.startswith(p)), "")
            if key not in _SECTIONS or key in out or sec.type == SHT_NOBITS:
                continue
            spill = _Spill(f"{elf.path} {sec.name}")
            spills.append(spill)
            size = elf.inflate_into(sec, spill.write)
            if size is False:       # not compressed: read on demand, in blocks
                out[key] = Span(elf.buf, sec.offset, sec.size)
            elif size is not None:  # None: a compression ElfReader cannot read (zstd)
                out[key] = Span(spill.result(), 0, size)
    except BaseException:
        for spill in spills:
            spill.discard()
        raise
    held = sum(spill.size for spill in spills)
    if "info" in out and "abbrev" in out:
        return out, held
    _release(held)
    return None
