"""ELF images: segments, symbols and PLT stubs of one binary.

Headers and notes come from reader.ElfReader; symbol tables and relocations are read as raw bytes
with numpy, names decoded lazily: iterating a big symbol table with pyelftools takes tens of seconds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from sampler import files
from sampler.binary import debuginfod
from sampler.binary.reader import (
    MALFORMED,
    MAX_SECTION_BYTES,
    PT_LOAD,
    SHT_NOBITS,
    ElfFormatError,
    ElfReader,
    FileBytes,
    Section,
    SectionTooLarge,
    format_errors,
    open_regular,
)

# Separate debug files, found by build-id as <root>/.build-id/<xx>/<rest>.debug, and by
# .gnu_debuglink as <root>/<the binary's directory>/<name>.
DEBUG_ROOTS: tuple[str, ...] = ("/usr/lib/debug",)
# A .gnu_debuglink section: a file name, NUL, padding to 4 bytes and a CRC32. Longer is malformed.
DEBUGLINK_MAX = 4096
NAME_MAX = 255
# A debug file named by a .gnu_debuglink is read whole for its CRC: bigger ones are not.
DEBUG_FILE_MAX = 4 << 30
CRC_CHUNK = 16 << 20
# A symbol name is read up to this many bytes (C++ names run to a few hundred; a file could make
# every name megabytes long).
MAX_SYMBOL_NAME = 1024
# Images cached process-wide: older ones are let go past this (their fds close when unused).
MAX_IMAGES = 1024
MAX_CLAIMS = 4  # distinct files kept per build-id
# A debug file debuginfod was asked for when an image was opened arrives later (it is downloaded
# off the caller's thread): the image looks again when names are first needed, then at most this often.
DEBUGINFOD_RECHECK_S = 5.0

SYM_DTYPE = np.dtype(
    [
        ("st_name", "<u4"),
        ("st_info", "u1"),
        ("st_other", "u1"),
        ("st_shndx", "<u2"),
        ("st_value", "<u8"),
        ("st_size", "<u8"),
    ]
)
RELA_DTYPE = np.dtype([("r_offset", "<u8"), ("r_info", "<u8"), ("r_addend", "<i8")])
SHT_PROGBITS = 1
SHT_SYMTAB = 2
SHT_RELA = 4
SHT_DYNSYM = 11
SHT_GNU_VERSYM = 0x6FFFFFFF

STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL = 0
STB_GLOBAL = 1
STB_WEAK = 2
SHN_UNDEF = 0
SHN_LORESERVE = 0xFF00  # SHN_ABS, SHN_COMMON...: no section, not code
VERSYM_HIDDEN = 0x8000  # a non-default (compat) symbol version
R_X86_64_64 = 1
R_X86_64_GLOB_DAT = 6
R_X86_64_JUMP_SLOT = 7
R_X86_64_RELATIVE = 8

ENDBR64 = b"\xf3\x0f\x1e\xfa"
BND = b"\xf2"  # MPX prefix, left in PLTs by old toolchains
JMP_RIP = b"\xff\x25"  # jmp *disp32(%rip)
PLT_SECTIONS = (".plt", ".plt.sec", ".plt.got")


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int
    size: int


class _File:
    """An ELF file mapped read-only, with its section and PT_LOAD tables and build-id."""

    def __init__(self, elf: ElfReader):
        self.path = elf.path
        self.elf_type = elf.elf_type
        self.sections = elf.sections
        self.loads = [seg for seg in elf.segments if seg.type == PT_LOAD]
        self.build_id = elf.build_id()
        self.elf = elf

    def array(self, sec: Section, dtype: np.dtype) -> np.ndarray:
        # NOBITS sections (stripped data in debug files) have no bytes in the file.
        data = self.elf.data(sec)
        return np.frombuffer(data, dtype, len(data) // dtype.itemsize)

    def symtabs(self) -> list[_SymTab]:
        found = [i for i in range(len(self.sections)) if self.is_symtab(i)]
        if len(found) > MAX_SYMTABS:    # headers can all point at the same bytes: each kept table costs
            raise ElfFormatError(f"{self.path}: {len(found)} symbol tables, over {MAX_SYMTABS}")
        tabs = []
        for i in found:
            # a table too big to read: the others still name what they cover
            with contextlib.suppress(SectionTooLarge):
                tabs.append(self.symtab(i))
        return [t for t in tabs if t.count > 1]  # entry 0 is always the null symbol

    def is_symtab(self, i: int) -> bool:
        """Section i is a symbol table this module can read, with a string table."""
        sec = self.sections[i]
        return (
            sec.type in (SHT_SYMTAB, SHT_DYNSYM)
            and sec.entsize == SYM_DTYPE.itemsize
            and sec.link < len(self.sections)
        )

    def symtab(self, i: int) -> _SymTab:
        versym = next((s for s in self.sections if s.type == SHT_GNU_VERSYM and s.link == i), None)
        return _SymTab(self, self.sections[i], self.sections[self.sections[i].link], versym)


KEEP_SYMS_BYTES = 4 << 20  # symbol tables up to this size are kept whole
MAX_SYMTABS = 8            # per file: .symtab and .dynsym (a debug file has its own)


class _SymTab:
    """One symbol table (.symtab or .dynsym) with its string table."""

    def __init__(self, file: _File, sec: Section, strtab: Section, versym: Section | None):
        self.file = file
        self.is_symtab = sec.type == SHT_SYMTAB
        self._sec = sec
        if sec.file_size > MAX_SECTION_BYTES:
            raise SectionTooLarge(f"{file.elf.path}: symbol table of {sec.file_size} bytes, over {MAX_SECTION_BYTES}")
        self.count = sec.file_size // SYM_DTYPE.itemsize
        self._syms = file.array(sec, SYM_DTYPE) if sec.file_size <= KEEP_SYMS_BYTES else None
        # what naming reads, kept; the rest of a big table is read again, in pieces, when a
        # whole-table pass needs it (libtorch_cpu's .symtab: 12.7 MiB, of which these columns are 2.5)
        names, infos = [], []
        for _, piece in self.pieces():
            names.append(piece["st_name"])
            infos.append(piece["st_info"])
        self.st_name = np.concatenate(names) if names else np.empty(0, np.uint32)
        self.st_info = np.concatenate(infos) if infos else np.empty(0, np.uint8)
        self.versym = file.array(versym, np.dtype("<u2")) if versym else None
        self._strtab_sec = strtab
        self._strtab: bytes | None = None

    @property
    def syms(self) -> np.ndarray:
        """The whole table (read again from the file when it was not kept: take it once per pass)."""
        return self._syms if self._syms is not None else self.file.array(self._sec, SYM_DTYPE)

    def pieces(self) -> Iterator[tuple[int, np.ndarray]]:
        """(index of its first entry, entries) of the table in pieces of at most KEEP_SYMS_BYTES
        when it was not kept: a whole-table pass never holds a big table at once."""
        if self._syms is not None:
            yield 0, self._syms
            return
        per = KEEP_SYMS_BYTES // SYM_DTYPE.itemsize
        for first in range(0, self.count, per):
            yield first, self._read_entries(first, min(per, self.count - first))

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """The entries at `idx` (a few: read one by one when the table was not kept)."""
        if self._syms is not None:
            return self._syms[idx]
        return np.concatenate([np.empty(0, SYM_DTYPE), *(self._read_entries(int(i), 1) for i in idx)])

    def _read_entries(self, first: int, n: int) -> np.ndarray:
        size = SYM_DTYPE.itemsize
        self.file.elf.budget.charge(n * size, self.file.elf.path, "a symbol table piece")
        raw = self.file.elf.read_at(self._sec.offset + first * size, n * size)
        if len(raw) != n * size:
            raise ElfFormatError(f"{self.file.elf.path}: symbol table truncated since read")
        return np.frombuffer(raw, SYM_DTYPE)

    @property
    def strtab(self) -> bytes:
        """The whole string table, read when a name is searched for (`find`). Naming symbols reads
        only their own names: libtorch_cpu's .strtab is 76 MiB, of which a stack names a few."""
        if self._strtab is None:
            self._strtab = bytes(self.file.elf.data(self._strtab_sec))
        return self._strtab

    def raw_name(self, i: int) -> str:
        """The name as stored, at most MAX_SYMBOL_NAME bytes; .symtab names of versioned symbols
        carry '@VER' or '@@VER'."""
        lo = int(self.st_name[i])
        if self._strtab is not None:
            cap = lo + MAX_SYMBOL_NAME
            hi = self._strtab.find(b"\0", lo, cap)
            return self._strtab[lo : hi if hi >= 0 else cap].decode("utf-8", "replace")
        sec = self._strtab_sec
        if lo >= sec.file_size:
            return ""
        raw = self.file.elf.read_at(sec.offset + lo, min(MAX_SYMBOL_NAME, sec.file_size - lo))
        hi = raw.find(b"\0")
        return raw[: hi if hi >= 0 else len(raw)].decode("utf-8", "replace")

    def name(self, i: int) -> str:
        return self.raw_name(i).split("@", 1)[0]

    def compat(self, i: int) -> bool:
        """A non-default symbol version, kept only for old binaries (glibc's cfree)."""
        if self.versym is not None and i < len(self.versym):
            return bool(self.versym[i] & VERSYM_HIDDEN)
        raw = self.raw_name(i)
        return "@" in raw and "@@" not in raw

    def find(self, name: str) -> np.ndarray:
        """Rows named `name` or `name@VERSION`."""
        needle = name.encode()
        strtab, hi = self.strtab, len(self.strtab)
        offsets = []
        # Linkers share string tails ("free" inside "cfree"), so any occurrence followed by
        # NUL or '@' can be a symbol's name, not only those that start a string.
        pos = strtab.find(needle)
        while pos >= 0:
            end = pos + len(needle)
            if end < hi and strtab[end] in (0, ord("@")):
                offsets.append(pos)
            pos = strtab.find(needle, pos + 1)
        if not offsets:
            return np.empty(0, np.intp)
        return np.flatnonzero(np.isin(self.st_name, np.array(offsets, np.uint32)))

    @staticmethod
    def defined(syms: np.ndarray) -> np.ndarray:
        """Which of the entries `syms` (of `syms` or `rows`) are defined here."""
        shndx = syms["st_shndx"]
        return (shndx != SHN_UNDEF) & (shndx < SHN_LORESERVE)

    @staticmethod
    def functions(syms: np.ndarray) -> np.ndarray:
        """Which of the entries `syms` are functions defined here."""
        stype = syms["st_info"] & 0xF
        is_func = (stype == STT_FUNC) | (stype == STT_GNU_IFUNC)
        return _SymTab.defined(syms) & is_func & (syms["st_value"] != 0)


def preferred_names(entries: Iterable[tuple[_SymTab, int]]) -> list[str]:
    """Names of symbols sharing an address, the one callers write first: exported, current
    version, fewest leading '_'."""
    ranked = []
    for tab, row in entries:
        name = tab.name(row)
        bind = int(tab.st_info[row]) >> 4
        ranked.append(((bind == STB_LOCAL, tab.compat(row), len(name) - len(name.lstrip("_"))), name))
    ranked.sort(key=lambda r: r[0])
    return list(dict.fromkeys(name for _, name in ranked))


def _joined(pieces: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """The pieces joined then put in `order`; `pieces` is emptied on the way."""
    whole = np.concatenate(pieces)
    pieces.clear()
    return whole[order]


class _FuncIndex:
    """Function symbols of all tables, sorted by address, grouped by start address. Kept per image
    for the recording's life: ~30 bytes per function (libtorch_cpu has ~400,000)."""

    def __init__(self, tables: list[_SymTab]):
        empty = np.empty(0, np.uint64)
        starts, sizes, ends_cap = [empty], [empty], [empty]
        tab_ids, rows = [np.empty(0, np.uint8)], [np.empty(0, np.uint32)]
        for t, tab in enumerate(tables):
            # A zero-size symbol never reaches past the end of its section.
            sec_end = np.array([x.addr + x.size for x in tab.file.sections] or [0], np.uint64)
            for first, syms in tab.pieces():
                idx = np.flatnonzero(tab.functions(syms))
                starts.append(syms["st_value"][idx])
                sizes.append(syms["st_size"][idx])
                ends_cap.append(sec_end[np.minimum(syms["st_shndx"][idx], len(sec_end) - 1)])
                tab_ids.append(np.full(len(idx), t, np.uint8))
                rows.append((idx + first).astype(np.uint32))     # MAX_SECTION_BYTES bounds a table's rows
        # one column at a time, each list of pieces dropped once joined: a transient of a column or two
        start = np.concatenate(starts)
        del starts
        order = np.argsort(start, kind="stable")
        start = start[order]
        self.tab = _joined(tab_ids, order)
        self.row = _joined(rows, order)
        size = _joined(sizes, order)
        cap = _joined(ends_cap, order)
        del order

        # Group symbols sharing a start address (aliases); group g is members [lo[g], lo[g + 1]).
        first = np.ones(len(start), bool)
        first[1:] = start[1:] != start[:-1]
        self.lo = np.append(np.flatnonzero(first), len(start)).astype(np.uint32)
        groups = self.lo[:-1]
        self.ustart = start[groups]
        usize = np.maximum.reduceat(size, groups) if len(groups) else empty
        ucap = np.minimum.reduceat(cap, groups) if len(groups) else empty
        del start, size, cap, first
        self.sized = usize > 0
        next_start = np.append(self.ustart[1:], np.uint64(2**64 - 1))
        self.uend = np.where(self.sized, self.ustart + usize, np.minimum(next_start, ucap))
        # Highest end of any sized symbol up to each group: finds functions enclosing others.
        self.cover = np.maximum.accumulate(np.where(self.sized, self.uend, np.uint64(0)))
        # Addresses of a library fit 32 bits (libtorch_cpu: ~340,000 groups, 4 MiB less)
        top = max(int(self.uend.max()), int(self.cover[-1])) if len(self.uend) else 0
        self.limit = 1 << 32 if top < 1 << 32 else 1 << 64
        if self.limit == 1 << 32:
            self.ustart, self.uend, self.cover = (a.astype(np.uint32) for a in (self.ustart, self.uend, self.cover))

    def members(self, g: int) -> range:
        """Positions of group g's symbols in `tab` and `row`."""
        return range(int(self.lo[g]), int(self.lo[g + 1]))

    def group_at(self, vaddr: int) -> int | None:
        if not 0 <= vaddr < self.limit:     # past every end
            return None
        v = self.ustart.dtype.type(vaddr)
        g = int(np.searchsorted(self.ustart, v, "right")) - 1
        if g < 0:
            return None
        if self.sized[g] and self.uend[g] > v:
            return g
        if self.cover[g] > v:  # inside a sized function that starts earlier and encloses g
            return int(np.flatnonzero(self.sized[:g] & (self.uend[:g] > v))[-1])
        if not self.sized[g] and self.uend[g] > v:
            return g
        return None

    def group_of_start(self, value: int) -> int | None:
        if not 0 <= value < self.limit:
            return None
        g = int(np.searchsorted(self.ustart, self.ustart.dtype.type(value), "left"))
        return g if g < len(self.ustart) and int(self.ustart[g]) == value else None


MAX_SYMBOL_MEMO = 4096     # names whose definitions an image remembers (a fixed set in practice)


class ElfImage:
    """One ELF file: path, debug_path, build_id, elf_type ('DYN', 'EXEC'), has_symtab.

    Cached process-wide by file identity (files.identity), and shared between files
    with the same build-id only when their contents are identical (a digest of the whole file,
    taken only then): anyone can write a file that claims another's build-id, and nothing read
    from it may describe the other. Symbols come from the separate debug file's .symtab when there
    is one, then the file's own .symtab and .dynsym; addresses and code always come from the file itself.
    """

    _by_file: dict[files.FileIdentity, ElfImage] = {}
    _by_build_id: dict[str, list[ElfImage]] = {}  # a few per build-id: anyone can claim one
    _lock = threading.Lock()

    def __init__(self, main: _File, debug: _File | None):
        if debug is not None:
            debug.elf.budget = main.elf.budget      # one budget for what naming the file reads
        self.path = main.path
        self.debug_path = debug.path if debug else None
        self.build_id = main.build_id
        self.elf_type = main.elf_type
        self._main = main
        self._debug = debug
        self._symtabs: list[_SymTab] | None = None       # read when a name is first asked for
        self._index: _FuncIndex | None = None
        self._names: dict[int, list[str]] = {}
        self._symbols: dict[str, Symbol | None] = {}     # symbol()'s answers: asked per process, per fork
        self._plt: dict[int, str] | None = None
        self._digest: str | None = None
        # debuginfod was asked for the debug file and has not answered: looked for again (_late_debug)
        self._debug_recheck_at = 0.0 if debug is None and main.build_id and debuginfod.pending(main.build_id) else None

    @property
    def _tables(self) -> list[_SymTab]:
        """Symbol tables in search order for names: debug .symtab, own .symtab, .dynsym (read on
        first use: a stack's identity needs the ELF headers only)."""
        if self._symtabs is None:
            self._late_debug()
            tables = (self._debug.symtabs() if self._debug else []) + self._main.symtabs()
            self._symtabs = sorted(tables, key=lambda t: not t.is_symtab)
        return self._symtabs

    def _late_debug(self) -> None:
        """Attach the debug file debuginfod was asked for, once it is in the cache: looked for at
        most every DEBUGINFOD_RECHECK_S (the first time at once) while debuginfod may still give it;
        a request refused by a limit is made again here. Names read before are dropped."""
        at = self._debug_recheck_at
        if at is None or time.monotonic() < at:
            return
        self._debug_recheck_at = time.monotonic() + DEBUGINFOD_RECHECK_S
        found = ask_debuginfod(self._main)
        if found is None:
            if not debuginfod.pending(self.build_id):
                self._debug_recheck_at = None
            return
        self._debug_recheck_at = None
        self._debug = _File(found)
        self.debug_path = self._debug.path
        self._symtabs, self._index, self._names, self._symbols = None, None, {}, {}

    @property
    def has_symtab(self) -> bool:
        return any(t.is_symtab for t in self._tables)

    def digest(self) -> str:
        """A digest of the whole file (read in chunks, once): two images with equal digests and
        sizes hold the same bytes."""
        if self._digest is None:
            self._digest = file_digest(self._main.elf)
        return self._digest

    @classmethod
    def forget(cls) -> None:
        """Drop the process-wide caches (tests; memory pressure)."""
        with cls._lock:
            cls._by_file.clear()
            cls._by_build_id.clear()

    @classmethod
    def _remember(cls, cache: dict, key: object, value: object) -> None:
        cache.pop(key, None)
        cache[key] = value
        while len(cache) > MAX_IMAGES:  # oldest first: dicts keep insertion order
            del cache[next(iter(cache))]

    @classmethod
    @format_errors
    def open(cls, path: str, seen_as: str | None = None, root: str = "", debug: str | None = None) -> ElfImage:
        """The image of the file at `path`. `seen_as` is its path as its process names it (default
        `path`) and `root` what reaches that process's root from here (/proc/PID/root): where a
        .gnu_debuglink's file is looked for, when the image is first opened. `debug`: its debug
        file as the caller found and verified it (the recorder's descriptor, for its name worker),
        used instead of looking when its build-id is the file's."""
        fd = open_regular(path)
        try:
            st = os.fstat(fd)
            key = files.identity(st)
            with cls._lock:
                img = cls._by_file.get(key)
            if img is not None:
                return img
            main = _File(ElfReader.from_fd(fd, path))
        finally:
            os.close(fd)
        bid = main.build_id
        with cls._lock:
            claims = list(cls._by_build_id.get(bid, ())) if bid else []
        size = len(main.elf.buf)
        same_size = [c for c in claims if len(c._main.elf.buf) == size]
        digest = file_digest(main.elf) if same_size else None
        # the same bytes under another inode (a copy, another mount namespace): the same image
        img = next((c for c in same_size if c.digest() == digest), None)
        if img is None:
            given = given_debug_file(debug, main.build_id) if debug else None
            img = cls(main, given or find_debug_file(main, seen_as or path, root))
            img._digest = digest
        with cls._lock:
            if bid and img not in claims:
                cls._remember(cls._by_build_id, bid, [*claims[-(MAX_CLAIMS - 1):], img])
            cls._remember(cls._by_file, key, img)
        return img

    # Addresses

    def loads(self) -> list[tuple[int, int, int]]:
        """The PT_LOAD segments as (file offset, vaddr, file size)."""
        return [(seg.offset, seg.vaddr, seg.filesz) for seg in self._main.loads]

    def file_offset_to_vaddr(self, off: int) -> int | None:
        for seg in self._main.loads:
            if seg.offset <= off < seg.offset + seg.filesz:
                return seg.vaddr + off - seg.offset
        return None

    def vaddr_to_file_offset(self, vaddr: int) -> int | None:
        for seg in self._main.loads:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return seg.offset + vaddr - seg.vaddr
        return None

    def read_vaddr(self, vaddr: int, n: int) -> bytes:
        """Up to `n` bytes of file contents at `vaddr`, stopping at the end of its segment."""
        for seg in self._main.loads:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                off = seg.offset + vaddr - seg.vaddr
                return self._main.elf.read_at(off, min(n, seg.offset + seg.filesz - off))
        raise ValueError(f"{self.path}: vaddr {vaddr:#x} is not backed by the file")

    def section(self, name: str) -> tuple[int, memoryview | bytes] | None:
        """(sh_addr, contents) of section `name` of the file itself, read anew (keep what is used).

        `.debug_frame` is not loaded at run time, so strip moves it to the separate debug file:
        it is looked up there too.
        """
        files = [self._main.elf]
        if name == ".debug_frame" and self._debug:
            files.append(self._debug.elf)
        for f in files:
            for sec in f.sections:
                if sec.name == name and sec.type != SHT_NOBITS:
                    return sec.addr, f.data(sec)
        return None

    def section_in_file(self, name: str) -> tuple[int, int, Callable[[int, int], bytes]] | None:
        """(sh_addr, size, read) of section `name` of the file itself, left in the file:
        `read(offset, n)` gives up to n of its bytes from `offset` (fewer past its end). Sections
        over MAX_SECTION_BYTES raise SectionTooLarge, as `section` does."""
        for sec in self._main.sections:
            if sec.name == name and sec.type != SHT_NOBITS:
                if sec.file_size > MAX_SECTION_BYTES:
                    raise SectionTooLarge(f"{self.path}: {name} of {sec.file_size} bytes, over {MAX_SECTION_BYTES}")
                return sec.addr, sec.file_size, functools.partial(_read_part, self._main.elf, sec.offset, sec.file_size)
        return None

    # Symbols

    def symbol(self, name: str) -> Symbol | None:
        """The definition of `name`; a GLOBAL/WEAK function wins over other kinds and bindings."""
        self._late_debug()
        if name in self._symbols:
            return self._symbols[name]
        found = self._symbol(name)
        if len(self._symbols) < MAX_SYMBOL_MEMO:
            self._symbols[name] = found
        return found

    def _symbol(self, name: str) -> Symbol | None:
        best, best_rank = None, None
        for t, tab in enumerate(self._tables):
            found = tab.find(name)
            entries = tab.rows(found)
            for i, entry, defined in zip(found.tolist(), entries, tab.defined(entries).tolist(), strict=True):
                if not defined:
                    continue
                info = int(entry["st_info"])
                func = info & 0xF in (STT_FUNC, STT_GNU_IFUNC)
                local = info >> 4 == STB_LOCAL
                rank = (not (func and not local), tab.compat(i), not func, local, t)
                if best_rank is None or rank < best_rank:
                    best, best_rank = (i, entry), rank
        if best is None:
            return None
        _, entry = best
        return Symbol(name, int(entry["st_value"]), int(entry["st_size"]))

    def aliases(self, value: int) -> list[str]:
        """Names of all functions starting at `value`, the preferred one first."""
        self._late_debug()
        g = self.index.group_of_start(value)
        return [] if g is None else self._group_names(g)

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(function containing `vaddr`, offset into it), or None when no symbol covers it. A
        symbol without a size (hand-written assembly) covers up to the next one only where a
        .symtab lists the static functions too: in a stripped file's .dynsym the next export may
        be far past its end, so there it names its first byte alone."""
        self._late_debug()
        idx = self.index
        g = idx.group_at(vaddr)
        if g is None or (not idx.sized[g] and vaddr != int(idx.ustart[g]) and not self.has_symtab):
            return None
        return self._group_names(g)[0], vaddr - int(idx.ustart[g])

    @property
    def elf(self) -> ElfReader:
        """The file itself, as opened (read through its fd: the path may name another file since)."""
        return self._main.elf

    @property
    def debug_elf(self) -> ElfReader | None:
        """The separate debug file, as read and verified when the image was opened (its path may
        hold another file since)."""
        return self._debug.elf if self._debug else None

    @property
    def index(self) -> _FuncIndex:
        if self._index is None:
            try:
                self._index = _FuncIndex(self._tables)
            except MALFORMED:
                self._index = _FuncIndex([])
        return self._index

    def _group_names(self, g: int) -> list[str]:
        names = self._names.get(g)
        if names is None:
            idx = self.index
            names = preferred_names((self._tables[idx.tab[k]], int(idx.row[k])) for k in idx.members(g))
            self._names[g] = names
        return names

    # PLT

    @format_errors
    def plt_targets(self) -> dict[int, str]:
        """PLT stub address -> name of the function it jumps to through the GOT."""
        if self._plt is None:
            self._plt = self._decode_plt()
        return self._plt

    def _decode_plt(self) -> dict[int, str]:
        main = self._main
        stub_slot: dict[int, int] = {}
        for sec in main.sections:
            if sec.name not in PLT_SECTIONS or sec.type != SHT_PROGBITS:
                continue
            stride = sec.entsize if sec.entsize in (8, 16) else 16
            code = bytes(main.elf.data(sec))
            for pos in range(0, len(code) - 5, stride):
                # Stubs: [endbr64;] [bnd] jmp *GOT(%rip). endbr64 with IBT (.plt.sec, .plt.got);
                # lazy .plt entries then only push and jump to PLT0, and do not match.
                p = pos + 4 if code[pos : pos + 4] == ENDBR64 else pos
                if code[p : p + 1] == BND:
                    p += 1
                if code[p : p + 2] == JMP_RIP and p + 6 <= len(code):
                    disp = int.from_bytes(code[p + 2 : p + 6], "little", signed=True)
                    slot = sec.addr + p + 6 + disp
                    if 0 <= slot < 1 << 64:  # else a malformed jump
                        stub_slot[sec.addr + pos] = slot
        if not stub_slot:
            return {}
        slot_name = self._got_slot_names(np.array(sorted(set(stub_slot.values())), np.uint64))
        return {stub: slot_name[slot] for stub, slot in stub_slot.items() if slot in slot_name}

    def _got_slot_names(self, slots: np.ndarray) -> dict[int, str]:
        """GOT slot -> symbol, from JUMP_SLOT (.rela.plt) and GLOB_DAT (.rela.dyn, .plt.got)."""
        return dict(_got_bindings(self._main, slots))


def _got_relocs(f: _File, words: bool = False) -> Iterator[tuple[_SymTab, np.ndarray, np.ndarray]]:
    """(its .dynsym, r_offset, symbol index) of each relocation table's JUMP_SLOT and GLOB_DAT
    entries: the GOT slots the dynamic linker binds to a symbol by name. `words`: its R_X86_64_64
    entries of addend 0 too: data words the dynamic linker fills with a symbol's address at load (a
    function pointer initialised with it, `void *(*lib_malloc)(size_t) = malloc;`), which hold that
    address and nothing else."""
    for sec in f.sections:
        if sec.type != SHT_RELA or not (sec.link < len(f.sections) and f.is_symtab(sec.link)):
            continue
        dynsym = f.symtab(sec.link)
        rela = f.array(sec, RELA_DTYPE)
        rtype = rela["r_info"] & 0xFFFFFFFF
        sym = rela["r_info"] >> np.uint64(32)
        slot = (rtype == R_X86_64_JUMP_SLOT) | (rtype == R_X86_64_GLOB_DAT)
        if words:
            slot |= (rtype == R_X86_64_64) & (rela["r_addend"] == 0)
        keep = slot & (sym != 0)
        keep &= sym < dynsym.count  # else a malformed relocation
        yield dynsym, rela["r_offset"][keep], sym[keep]


def _got_bindings(f: _File, slots: np.ndarray) -> Iterator[tuple[int, str]]:
    """(r_offset, symbol name) of the JUMP_SLOT and GLOB_DAT relocations at `slots`.
    A file's own definitions count too: glibc calls its malloc through its GOT (strdup, stdio)."""
    for dynsym, offs, syms in _got_relocs(f):
        hit = np.isin(offs, slots)
        for off, s in zip(offs[hit].tolist(), syms[hit].tolist(), strict=True):
            yield off, dynsym.name(s)


def _read_part(elf: ElfReader, base: int, size: int, offset: int, n: int) -> bytes:
    """Up to `n` bytes from `offset` of the `size` bytes at file offset `base` (a whole section's
    read charged to the file's budget)."""
    n = min(n, size - offset)
    if offset < 0 or n <= 0:
        return b""
    elf.budget.charge(n, elf.path, f"a read at {base + offset:#x}")
    return elf.read_at(base + offset, n)


@format_errors
def import_slots(elf: ElfReader, names: set[str]) -> list[tuple[int, str]]:
    """(r_offset, name) of the words through which the file calls `names`: its JUMP_SLOT and
    GLOB_DAT relocations that bind to them, and its R_X86_64_64 ones of addend 0 (function pointers
    in its data initialised with them: libxml2's xmlMalloc, jansson's do_malloc), read from this
    file's own tables, never a cache, in table order. The names' symbols are looked up first:
    libtorch_cpu has ~100,000 such slots."""
    out = []
    for dynsym, offs, syms in _got_relocs(_File(elf), words=True):
        rows = {name: dynsym.find(name) for name in sorted(names)}
        want = np.concatenate([np.empty(0, np.intp), *rows.values()]).astype(np.uint64)
        hit = np.flatnonzero(np.isin(syms, want))
        name_of = {int(r): name for name, found in rows.items() for r in found}
        out += [(off, name_of[s]) for off, s in zip(offs[hit].tolist(), syms[hit].tolist(), strict=True)]
    return out


@format_errors
def data_slot_values(elf: ElfReader, slots: set[int]) -> dict[int, int]:
    """The link-time value that each of `slots` (vaddrs of pointers, e.g. GOT entries) gets from its
    relocation, where the file alone says it: RELATIVE (the addend), or GLOB_DAT/64 to a data symbol
    the file defines itself (its value plus the addend). Add the load bias, as to any vaddr."""
    f = _File(elf)
    want = np.array(sorted(slots), np.uint64)
    out: dict[int, int] = {}
    for sec in f.sections:
        if sec.type != SHT_RELA:
            continue
        rela = f.array(sec, RELA_DTYPE)
        hit = np.isin(rela["r_offset"], want)
        if not hit.any():
            continue
        dynsym = f.symtab(sec.link) if sec.link < len(f.sections) and f.is_symtab(sec.link) else None
        syms = dynsym.syms if dynsym is not None else None
        defined = dynsym.defined(syms) if syms is not None else None
        for off, info, addend in zip(rela["r_offset"][hit].tolist(), rela["r_info"][hit].tolist(),
                                     rela["r_addend"][hit].tolist(), strict=True):
            rtype, sym = info & 0xFFFFFFFF, info >> 32
            if rtype == R_X86_64_RELATIVE:
                out[off] = addend % (1 << 64)
            elif rtype in (R_X86_64_GLOB_DAT, R_X86_64_64) and syms is not None and 0 < sym < len(syms) \
                    and defined[sym] and syms["st_value"][sym]:
                out[off] = (int(syms["st_value"][sym]) + addend) % (1 << 64)
    return out


def exported_function(elf: ElfReader, name: str) -> int | None:
    """The st_value of `name` as a defined, global or weak, non-IFUNC function of the file's .dynsym
    (what the dynamic linker binds others to); None when the file does not export it."""
    found = dynsym_entry(elf, name)
    return found[1] if found else None


@format_errors
def dynsym_entry(elf: ElfReader, name: str) -> tuple[int, int] | None:
    """(vaddr of st_value in the loaded .dynsym, st_value) of `name` as a defined, global or weak,
    non-IFUNC, current-version function: the entry the dynamic linker reads to bind others to it."""
    f = _File(elf)
    for i in range(len(f.sections)):
        sec = f.sections[i]
        if sec.type != SHT_DYNSYM or not f.is_symtab(i) or not sec.addr:
            continue
        tab = f.symtab(i)
        found = tab.find(name)
        entries = tab.rows(found)
        for row, entry, defined in zip(found.tolist(), entries, tab.defined(entries).tolist(), strict=True):
            info = int(entry["st_info"])
            if (defined and info & 0xF == STT_FUNC and info >> 4 in (STB_GLOBAL, STB_WEAK)
                    and not tab.compat(row) and entry["st_value"]):
                return sec.addr + row * SYM_DTYPE.itemsize + 8, int(entry["st_value"])
    return None


def given_debug_file(path: str, build_id: str | None) -> _File | None:
    """The debug file at `path` when it is one of `build_id` (or either has none)."""
    try:
        debug = _File(open_untrusted(path, DEBUG_FILE_MAX))
    except (OSError, ElfFormatError):
        return None
    return debug if not (build_id and debug.build_id) or debug.build_id == build_id else None


def find_debug_file(main: _File, seen_as: str, root: str = "") -> _File | None:
    """The separate debug file of `main`, verified to belong to it: by build-id under DEBUG_ROOTS,
    else through its .gnu_debuglink (CRC and build-id checked), else from debuginfod's cache (only
    where $DEBUGINFOD_URLS is set, and for the files ask_debuginfod allows; one not cached yet is
    downloaded in the background and attached later: ElfImage._late_debug)."""
    bid = main.build_id
    found = build_id_debug_file(bid) if bid else None
    if found is None:
        link = debuglink(main.elf)
        if link is not None:
            found = debuglink_file(link, bid, debuglink_dirs(os.path.dirname(seen_as), root))
    if found is None:
        elf = ask_debuginfod(main)
        found = _File(elf) if elf is not None else None
    return found


def ask_debuginfod(main: _File) -> ElfReader | None:
    """debuginfod.debug_file of `main` (cached, else queued), for a file with a build-id and no
    .symtab of its own that root alone can change (owned by root, writable by nobody else): another
    user's file would make root download what they chose, so theirs only with
    $ALLOCSAMPLER_DEBUGINFOD_ANY=1, each owner then a requester with its own limit (root's files
    have the global limits only). Bytes in memory have no owner to check: with the opt-in only."""
    if not main.build_id or not debuginfod.servers() or any(s.type == SHT_SYMTAB for s in main.sections):
        return None
    buf = main.elf.buf
    try:
        st = os.fstat(buf.fd) if isinstance(buf, FileBytes) else None
    except OSError:
        return None
    if st is not None and st.st_uid == 0 and not st.st_mode & 0o022:
        requester = None
    elif debuginfod.any_file():
        requester = st.st_uid if st is not None else -1
    else:
        return None
    return debuginfod.debug_file(main.build_id, requester)


def build_id_debug_file(build_id: str) -> _File | None:
    for root in DEBUG_ROOTS:
        path = os.path.join(root, ".build-id", build_id[:2], build_id[2:] + ".debug")
        try:
            debug = _File(ElfReader.open(path))
        except (OSError, ElfFormatError):
            continue
        if debug.build_id == build_id:
            return debug
    return None


@format_errors
def debuglink(elf: ElfReader) -> tuple[str, int] | None:
    """(file name, CRC32) of the file's .gnu_debuglink; None without one or when the name could
    leave the directories it is looked for in."""
    sec = elf.section(".gnu_debuglink")
    if sec is None or not 0 < sec.file_size <= DEBUGLINK_MAX:
        return None
    data = bytes(elf.data(sec))
    end = data.find(b"\0")
    crc_at = (end + 4) & ~3  # the name's NUL, then padding to 4 bytes
    if not 0 < end <= NAME_MAX or crc_at + 4 > len(data):
        return None
    name = os.fsdecode(data[:end])
    if "/" in name or name in (".", ".."):
        return None
    return name, int.from_bytes(data[crc_at : crc_at + 4], "little")


def debuglink_dirs(binary_dir: str, root: str = "") -> list[str]:
    """Where gdb looks for a debuglink's file: the binary's directory, its .debug/, and the
    binary's directory under each debug root."""
    here = root + binary_dir
    return [here, os.path.join(here, ".debug")] + [os.path.join(r, binary_dir.lstrip("/")) for r in DEBUG_ROOTS]


def debuglink_file(link: tuple[str, int], build_id: str | None, dirs: list[str]) -> _File | None:
    """The first file called link's name in `dirs` whose CRC32 is link's and whose build-id, when
    both have one, is `build_id`: any other file there is not this binary's."""
    name, crc = link
    for d in dirs:
        try:
            elf = open_untrusted(os.path.join(d, name), DEBUG_FILE_MAX)
        except (OSError, ElfFormatError):
            continue
        if crc32(elf) != crc:
            continue
        debug = _File(elf)
        if build_id and debug.build_id and debug.build_id != build_id:
            continue
        return debug
    return None


def open_untrusted(path: str, max_bytes: int) -> ElfReader:
    """`path` read as ELF, checked on the descriptor: the last component not a link, a regular
    file (no FIFO waited on) of at most `max_bytes`."""
    fd = open_regular(path, max_bytes)
    try:
        return ElfReader.from_fd(fd, path, max_bytes)
    finally:
        os.close(fd)


def chunks(elf: ElfReader) -> Iterable[bytes]:
    """The whole file, CRC_CHUNK bytes at a time (read anew, never all held)."""
    for at in range(0, len(elf.buf), CRC_CHUNK):
        yield elf.read_at(at, CRC_CHUNK)


def crc32(elf: ElfReader) -> int:
    """The CRC32 of a .gnu_debuglink (zlib's) over the whole file."""
    crc = 0
    for chunk in chunks(elf):
        crc = zlib.crc32(chunk, crc)
    return crc


def file_digest(elf: ElfReader) -> str:
    """SHA-256 of the whole file (OpenSSL's, with the CPU's SHA instructions: about 2 GB/s)."""
    h = hashlib.sha256()
    for chunk in chunks(elf):
        h.update(chunk)
    return h.hexdigest()
