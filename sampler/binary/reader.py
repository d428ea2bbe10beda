"""Reading the structure of an ELF file: its section and program headers, section contents and notes.

The one place that parses ELF headers: elf.py (symbols), dwarf_lines.py (debug sections) and
probes/usdt.py (probe notes) all read through ElfReader. The files belong to other users and may be
anything, so every count, offset and size read from one is checked against the file before it is used;
a malformed file raises ElfFormatError, never struct.error, IndexError or a read past its end.
Only 64-bit little-endian files are read (the sampler runs on x86-64).

Files are read with pread into private memory (FileBytes), never mapped: a target can truncate a
file it owns, and touching a mapping past the new end kills the reader with SIGBUS. Only the
sections asked for are read, each at most MAX_SECTION_BYTES.
"""

from __future__ import annotations

import os
import struct
import weakref
import zlib
from collections.abc import Callable, Iterator
from functools import wraps
from typing import NamedTuple, ParamSpec, TypeVar

import numpy as np

from sampler import files

SHDR_DTYPE = np.dtype(
    [
        ("sh_name", "<u4"),
        ("sh_type", "<u4"),
        ("sh_flags", "<u8"),
        ("sh_addr", "<u8"),
        ("sh_offset", "<u8"),
        ("sh_size", "<u8"),
        ("sh_link", "<u4"),
        ("sh_info", "<u4"),
        ("sh_addralign", "<u8"),
        ("sh_entsize", "<u8"),
    ]
)
PHDR_DTYPE = np.dtype(
    [
        ("p_type", "<u4"),
        ("p_flags", "<u4"),
        ("p_offset", "<u8"),
        ("p_vaddr", "<u8"),
        ("p_paddr", "<u8"),
        ("p_filesz", "<u8"),
        ("p_memsz", "<u8"),
        ("p_align", "<u8"),
    ]
)
EHDR_SIZE = 64
CHDR_SIZE = 24  # Elf64_Chdr: ch_type, ch_reserved, ch_size, ch_addralign
NHDR_SIZE = 12  # Elf64_Nhdr: n_namesz, n_descsz, n_type

SHT_NULL = 0
SHT_NOBITS = 8
SHN_XINDEX = 0xFFFF  # e_shstrndx: the real index is in section 0's sh_link
PN_XNUM = 0xFFFF  # e_phnum: the real count is in section 0's sh_info
PT_NULL = 0
PT_LOAD = 1
PT_NOTE = 4
SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1
NT_GNU_BUILD_ID = 3
E_TYPES = {0: "NONE", 1: "REL", 2: "EXEC", 3: "DYN", 4: "CORE"}

# Bounds on what a file may ask of us. ELF counts are 16-bit unless extended through section 0; no
# binary we symbolize has more than a few thousand sections.
MAX_SECTIONS = 65535
MAX_SEGMENTS = 65535
# Compressed sections are inflated into memory: a declared size above this is refused, and the stream is
# never inflated past the size it declares (a zlib bomb stops there).
MAX_INFLATED = 256 << 20
INFLATE_PIECE = 1 << 20
# A file is opened up to this size (debug files of big binaries run to gigabytes; only the sections
# used are read); one section is read into memory up to MAX_SECTION_BYTES (libtorch_cpu's biggest
# read, .strtab, is 72 MiB).
MAX_FILE_BYTES = 16 << 30
MAX_SECTION_BYTES = 256 << 20
# What one file (with its separate debug file) may have read into memory or inflated, all its sections
# and symbol tables together: a file of many compressed sections, each under MAX_INFLATED, or of many
# symbol tables cannot take the recorder past its memory ceiling (a unit's MemoryMax) this way.
# libtorch_cpu, the biggest file we read, is charged 119 MiB (symbols, PLT and CFI).
FILE_BUDGET = 320 << 20
CHARGED_FROM = 64 << 10  # smaller reads are blocks and single names, not tables kept
MAX_NOTES = 4096  # per note section or segment (libc's stapsdt: ~60)
MAX_NAME_TABLE = 1 << 20  # .shstrtab: a few KiB in practice
MAX_SECTION_NAME = 1024


class ElfFormatError(ValueError):
    """The file is not an ELF image this module can read (64-bit little-endian), or is malformed."""


class SectionTooLarge(ElfFormatError):
    """A section over MAX_SECTION_BYTES: refused, while the rest of the file stays readable."""


class OverBudget(ElfFormatError):
    """A read or an inflation that would take a file past its Budget: refused before it is made."""


class Budget:
    """Bytes one file (and its debug file: ElfImage gives both one Budget) has read into memory or
    inflated so far, charged before each read of a section or table piece and each inflation."""

    def __init__(self, limit: int = FILE_BUDGET):
        self.limit = limit
        self.used = 0

    def charge(self, n: int, path: str, what: str) -> None:
        if n < CHARGED_FROM:
            return
        if self.used + n > self.limit:
            raise OverBudget(f"{path}: {what} of {n} bytes is over the file's budget ({self.used} of "
                             f"{self.limit} bytes used)")
        self.used += n


P = ParamSpec("P")
R = TypeVar("R")
# What malformed bytes make Python or numpy raise. MemoryError too: sizes are capped, so one means a
# file asked for more than its share. OSError (the file gone, EIO) is not the file's format.
MALFORMED = (ValueError, IndexError, KeyError, struct.error, OverflowError,
             MemoryError, RecursionError, UnicodeDecodeError, zlib.error, TypeError, AssertionError)


def format_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """A parser's public entry point: whatever malformed input makes the code below it raise comes
    out as ElfFormatError (ElfFormatError itself and OSError pass unchanged)."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ElfFormatError:
            raise
        except MALFORMED as e:
            raise ElfFormatError(f"malformed input: {type(e).__name__}: {e}") from e

    return wrapper


def open_regular(path: str, max_bytes: int = MAX_FILE_BYTES) -> int:
    """A read-only fd of a target's file, under files.open_untrusted's policy (no link but map_files',
    no device or FIFO opened, at most `max_bytes`); anything else is ElfFormatError."""
    try:
        fd, _ = files.open_untrusted(path, max_bytes)
    except ValueError as e:
        raise ElfFormatError(f"{path}: {e}") from e
    return fd


class FileBytes:
    """An open file read by pread into private memory, sliced like bytes. Holds its own fd (closed
    when collected), so later reads reach the same inode whatever its path names since. Small reads
    go through a few cached blocks; a read that comes back short (the file was truncated) is
    ElfFormatError, never SIGBUS."""

    BLOCK = 64 << 10
    BLOCKS = 32

    def __init__(self, fd: int, size: int, path: str, max_read: int = MAX_SECTION_BYTES):
        self.fd = os.dup(fd)  # non-inheritable
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.size = size
        self.path = path
        self.max_read = max_read
        self._blocks: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        self._closer()

    def read(self, offset: int, n: int) -> bytes:
        """Exactly `n` bytes at `offset` (the caller checked them against the size)."""
        if n <= 0:
            return b""
        if n > self.max_read:
            raise SectionTooLarge(f"{self.path}: a read of {n} bytes, over {self.max_read}")
        parts, got = [], 0
        while got < n:
            part = os.pread(self.fd, n - got, offset + got)
            if not part:
                raise ElfFormatError(f"{self.path}: shorter than {offset + n} bytes (truncated while read)")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def __getitem__(self, key: slice | int) -> bytes | int:
        if isinstance(key, int):
            return self[key : key + 1][0] if 0 <= key < self.size else b""[key]
        start, stop, _ = key.indices(self.size)
        if stop <= start:
            return b""
        k = start // self.BLOCK
        if (stop - 1) // self.BLOCK != k:  # across blocks: read directly
            return self.read(start, stop - start)
        blk = self._blocks.get(k)  # dict operations are atomic: no lock on this path
        if blk is None:
            if len(self._blocks) >= self.BLOCKS:
                self._blocks.clear()  # cheaper than an LRU here; a working set refills it at once
            at = k * self.BLOCK
            blk = self._blocks[k] = self.read(at, min(self.BLOCK, self.size - at))
        at = k * self.BLOCK
        return blk[start - at : stop - at]


class Section(NamedTuple):  # a tuple: made thousands of times, 3x faster than a frozen dataclass
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int

    @property
    def file_size(self) -> int:
        """Bytes of the section in the file: none for NOBITS (.bss, stripped data in debug files)."""
        return 0 if self.type in (SHT_NOBITS, SHT_NULL) else self.size


class Segment(NamedTuple):
    type: int
    flags: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int

    @property
    def file_size(self) -> int:
        return 0 if self.type == PT_NULL else self.filesz


class Note(NamedTuple):
    name: bytes  # the owner, without its NUL ("GNU", "stapsdt")
    type: int  # numbered per owner
    desc: bytes


class ElfReader:
    """The headers of one ELF file, checked against its size; `buf` is the file (bytes, or a
    FileBytes read on demand)."""

    @format_errors
    def __init__(self, buf: FileBytes | bytes, path: str = "<bytes>"):
        self.buf = buf
        self.path = path
        self.budget = Budget()
        self._view = memoryview(buf) if isinstance(buf, bytes | bytearray) else None
        size = len(buf)
        buf = bytes(buf[:EHDR_SIZE])  # the header, read once
        if size < EHDR_SIZE or buf[:4] != b"\x7fELF":
            raise ElfFormatError(f"{path}: not an ELF file")
        if buf[4] != 2 or buf[5] != 1:
            raise ElfFormatError(f"{path}: only 64-bit little-endian ELF is supported")
        e_type = int.from_bytes(buf[0x10:0x12], "little")
        self.elf_type = E_TYPES.get(e_type, f"{e_type:#x}")
        phoff, shoff = int.from_bytes(buf[0x20:0x28], "little"), int.from_bytes(buf[0x28:0x30], "little")
        phentsize, phnum = int.from_bytes(buf[0x36:0x38], "little"), int.from_bytes(buf[0x38:0x3A], "little")
        shentsize, shnum = int.from_bytes(buf[0x3A:0x3C], "little"), int.from_bytes(buf[0x3C:0x3E], "little")
        shstrndx = int.from_bytes(buf[0x3E:0x40], "little")

        if shoff and not shnum and not shentsize:
            shoff = 0  # an offset without entry size or count: no section table
        if shoff:
            if shentsize != SHDR_DTYPE.itemsize:
                raise ElfFormatError(f"{path}: section header size {shentsize}")
            # Section 0 holds the counts that do not fit the ELF header (extended numbering).
            first = self._table(shoff, 1, SHDR_DTYPE, "section")[0]
            shnum = shnum or int(first["sh_size"])
            if shstrndx == SHN_XINDEX:
                shstrndx = int(first["sh_link"])
            if phnum == PN_XNUM:
                phnum = int(first["sh_info"])
        self.sections = self._read_sections(shoff, shnum, shstrndx) if shoff and shnum else []
        if phoff and phnum and phentsize != PHDR_DTYPE.itemsize:
            raise ElfFormatError(f"{path}: program header size {phentsize}")
        self.segments = self._read_segments(phoff, phnum) if phoff and phnum else []

    @classmethod
    def open(cls, path: str) -> ElfReader:
        fd = open_regular(path)
        try:
            return cls.from_fd(fd, path)
        finally:
            os.close(fd)

    @classmethod
    def from_fd(cls, fd: int, path: str, max_bytes: int = MAX_FILE_BYTES) -> ElfReader:
        """The file behind `fd` (a regular file: see open_regular); the reader keeps a dup of the fd,
        so the file stays readable after the caller closes it, even deleted."""
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise ElfFormatError(f"{path}: {size} bytes, over {max_bytes}")
        return cls(FileBytes(fd, size, path), path)

    def _table(self, offset: int, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        if offset + count * dtype.itemsize > len(self.buf):
            raise ElfFormatError(f"{self.path}: {what} headers past the end of the file")
        return np.frombuffer(self._bytes(offset, count * dtype.itemsize), dtype, count)

    def _bytes(self, offset: int, n: int) -> memoryview | bytes:
        # a view of in-memory bytes; else what was read (no copy: bytes() of it is free)
        if self._view is not None:
            return self._view[offset : offset + n]
        return self.buf.read(offset, n)

    def _read_sections(self, shoff: int, shnum: int, shstrndx: int) -> list[Section]:
        # Raw headers through numpy: pyelftools' iter_sections() parses every .gnu.hash table on the
        # way (0.27 s for libLLVM).
        if shnum > MAX_SECTIONS:
            raise ElfFormatError(f"{self.path}: {shnum} sections")
        if shstrndx >= shnum:
            raise ElfFormatError(f"{self.path}: section name table {shstrndx} of {shnum}")
        rows = self._table(shoff, shnum, SHDR_DTYPE, "section").tolist()
        names = b""  # the name table; SHN_UNDEF: no names
        if shstrndx:
            _, typ, _, addr, off, size, *_ = rows[shstrndx]
            in_file = 0 if typ in (SHT_NOBITS, SHT_NULL) else size
            self._check_range(off, in_file, addr, size, "section")
            names = bytes(self._bytes(off, min(in_file, MAX_NAME_TABLE)))
        out = []
        for name, typ, flags, addr, off, size, link, info, _align, entsize in rows:
            sec = Section(self._name(names, name), typ, flags, addr, off, size, link, info, entsize)
            self._check_range(off, sec.file_size, addr, size, "section")
            out.append(sec)
        return out

    def _name(self, table: bytes, at: int) -> str:
        if at >= len(table):
            if at:
                raise ElfFormatError(f"{self.path}: section name at {at} past its table")
            return ""
        end = table.find(b"\0", at, at + MAX_SECTION_NAME)
        return table[at : at + MAX_SECTION_NAME if end < 0 else end].decode("utf-8", "replace")

    def _read_segments(self, phoff: int, phnum: int) -> list[Segment]:
        if phnum > MAX_SEGMENTS:
            raise ElfFormatError(f"{self.path}: {phnum} program headers")
        out = []
        for typ, flags, off, vaddr, _paddr, filesz, memsz, _align in self._table(
            phoff, phnum, PHDR_DTYPE, "program"
        ).tolist():
            seg = Segment(typ, flags, off, vaddr, filesz, memsz)
            self._check_range(seg.offset, seg.file_size, seg.vaddr, seg.memsz, "segment")
            out.append(seg)
        return out

    def _check_range(self, offset: int, size: int, addr: int, mem_size: int, what: str) -> None:
        if size and offset + size > len(self.buf):
            raise ElfFormatError(f"{self.path}: {what} at {offset:#x} of {size} bytes past the end of the file")
        if addr + mem_size >= 1 << 64:  # the symbol index computes ends as uint64
            raise ElfFormatError(f"{self.path}: {what} at {addr:#x} of {mem_size} bytes past the address space")

    def section(self, name: str) -> Section | None:
        """The first section called `name`."""
        return next((s for s in self.sections if s.name == name), None)

    def data(self, part: Section | Segment) -> memoryview | bytes:
        """The bytes of a section or segment in the file (empty for NOBITS), read anew at each call:
        keep what is needed. Checked when the headers were read to lie in the file; SectionTooLarge
        over MAX_SECTION_BYTES, ElfFormatError when the file was truncated since."""
        if part.file_size > MAX_SECTION_BYTES:
            raise SectionTooLarge(f"{self.path}: {part.file_size} bytes at {part.offset:#x}, over {MAX_SECTION_BYTES}")
        self.budget.charge(part.file_size, self.path, f"a read at {part.offset:#x}")
        return self._bytes(part.offset, part.file_size)

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to `n` bytes of the file at `offset` (fewer at its end)."""
        n = max(0, min(n, len(self.buf) - offset))
        return bytes(self._bytes(offset, n)) if n else b""

    @format_errors
    def contents(self, sec: Section) -> memoryview | bytes | None:
        """The bytes of a section, inflated where compressed (see inflate_into); None for a
        compression this module cannot read."""
        pieces: list[bytes] = []
        size = self.inflate_into(sec, pieces.append)
        if size is False:
            return self.data(sec)
        return None if size is None else b"".join(pieces)

    @format_errors
    def inflate_into(self, sec: Section, write: Callable[[bytes], object]) -> int | None | bool:
        """Inflate a compressed section into `write`, INFLATE_PIECE bytes at a time (never whole in
        memory here), after charging its declared size to the file's budget: SHF_COMPRESSED (an
        Elf64_Chdr, then the stream) or GNU's .zdebug_* ("ZLIB", the size as 8 big-endian bytes, then
        the stream). Its size; None for a compression this module cannot read (zstd, which binutils
        >= 2.40 can write, needs a module the project lacks); False when it is not compressed."""
        if sec.flags & SHF_COMPRESSED:
            data = self.data(sec)
            if len(data) < CHDR_SIZE:
                raise ElfFormatError(f"{self.path}: {sec.name}: truncated compression header")
            kind, size = int.from_bytes(data[:4], "little"), int.from_bytes(data[8:16], "little")
            if kind != ELFCOMPRESS_ZLIB:
                return None
            return self._inflate(sec, data[CHDR_SIZE:], size, write)
        if sec.name.startswith(".zdebug_"):
            data = self.data(sec)
            if len(data) < 12 or data[:4] != b"ZLIB":
                raise ElfFormatError(f"{self.path}: {sec.name}: no ZLIB header")
            return self._inflate(sec, data[12:], int.from_bytes(data[4:12], "big"), write)
        return False

    def _inflate(self, sec: Section, stream: memoryview | bytes, size: int, write: Callable[[bytes], object]) -> int:
        if size > MAX_INFLATED:
            raise ElfFormatError(f"{self.path}: {sec.name}: {size} bytes inflated, above {MAX_INFLATED}")
        self.budget.charge(size, self.path, f"{sec.name} inflated")
        inflater = zlib.decompressobj()
        total, pending = 0, stream
        try:
            while not inflater.eof:
                # one byte more than declared at most: a stream that goes on past its size is
                # refused without inflating the rest
                piece = inflater.decompress(pending, min(INFLATE_PIECE, size + 1 - total))
                pending = inflater.unconsumed_tail
                total += len(piece)
                if total > size or not piece:
                    break
                write(piece)
        except zlib.error as e:
            raise ElfFormatError(f"{self.path}: {sec.name}: {e}") from e
        if total != size or not inflater.eof:
            raise ElfFormatError(f"{self.path}: {sec.name}: inflates to other than its declared {size} bytes")
        return size

    def notes(self, part: Section | Segment) -> Iterator[Note]:
        """The notes of a note section or PT_NOTE segment (at most MAX_NOTES)."""
        data = self.data(part)
        pos, end, count = 0, len(data), 0
        # Name and descriptor are padded to 4 bytes; what follows the last whole header is padding.
        while pos + NHDR_SIZE <= end:
            count += 1
            if count > MAX_NOTES:
                raise ElfFormatError(f"{self.path}: over {MAX_NOTES} notes at {part.offset:#x}")
            namesz, descsz, ntype = (int.from_bytes(data[pos + i : pos + i + 4], "little") for i in (0, 4, 8))
            name_at = pos + NHDR_SIZE
            desc_at = name_at + (namesz + 3) // 4 * 4
            if name_at + namesz > end or desc_at + descsz > end:
                raise ElfFormatError(f"{self.path}: a note at {part.offset + pos:#x} runs past its container")
            name = bytes(data[name_at : name_at + namesz])
            yield Note(name.split(b"\0", 1)[0], ntype, bytes(data[desc_at : desc_at + descsz]))
            pos = desc_at + (descsz + 3) // 4 * 4

    @format_errors
    def build_id(self) -> str | None:
        """The GNU build-id, as hex. PT_NOTE covers the allocated notes; the section is the fallback for
        files whose program headers do not list it. Other note sections (stapsdt: thousands of probes)
        are not read."""
        parts: list[Section | Segment] = [seg for seg in self.segments if seg.type == PT_NOTE]
        parts += [sec for sec in self.sections if sec.name == ".note.gnu.build-id"]
        for part in parts:
            for note in self.notes(part):
                # Note types are per owner: a stapsdt note has the build-id's number too.
                if note.name == b"GNU" and note.type == NT_GNU_BUILD_ID and len(note.desc) <= 64:
                    return note.desc.hex()
        return None

