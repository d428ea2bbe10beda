"""Reading the structure of an ELF file: its section and program headers, section contents and notes.

The one place that parses ELF headers: elf.py (symbols), dwarf_lines.py (debug sections) and
probes/usdt.py (probe notes) all read through ElfReader. The files belong to other users and may be
anything, so every count, offset and size read from one is checked against the file before it is used;
a malformed file raises ElfFormatError, never struct.error, IndexError or a read past its end.
Only 64-bit little-endian files are read (the sampler runs on x86-64).
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

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


class ElfFormatError(ValueError):
    """The file is not an ELF image this module can read (64-bit little-endian), or is malformed."""


def open_regular(path: str) -> int:
    """A read-only fd of `path`. Processes map device files (/dev/nvidia*) whose open() has side
    effects: anything but a regular file is refused before it is opened."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ElfFormatError(f"{path}: not a regular file")
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


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
    """The headers of one ELF file, checked against its size; `buf` holds the whole file."""

    def __init__(self, buf: mmap.mmap | bytes, path: str = "<bytes>"):
        self.buf = buf
        self.path = path
        self._view = memoryview(buf)
        size = len(buf)
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
    def from_fd(cls, fd: int, path: str) -> ElfReader:
        try:
            # mmap dups the fd: the file stays readable after the caller closes it, even deleted.
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise ElfFormatError(f"{path}: {e}") from e
        return cls(mm, path)

    def _table(self, offset: int, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        if offset + count * dtype.itemsize > len(self.buf):
            raise ElfFormatError(f"{self.path}: {what} headers past the end of the file")
        return np.frombuffer(self.buf, dtype, count, offset)

    def _read_sections(self, shoff: int, shnum: int, shstrndx: int) -> list[Section]:
        # Raw headers through numpy: pyelftools' iter_sections() parses every .gnu.hash table on the
        # way (0.27 s for libLLVM).
        if shnum > MAX_SECTIONS:
            raise ElfFormatError(f"{self.path}: {shnum} sections")
        if shstrndx >= shnum:
            raise ElfFormatError(f"{self.path}: section name table {shstrndx} of {shnum}")
        rows = self._table(shoff, shnum, SHDR_DTYPE, "section").tolist()
        names = (0, 0)  # (start, end) of the name table in the file; SHN_UNDEF: no names
        if shstrndx:
            _, typ, _, addr, off, size, *_ = rows[shstrndx]
            in_file = 0 if typ in (SHT_NOBITS, SHT_NULL) else size
            self._check_range(off, in_file, addr, size, "section")
            names = (off, off + in_file)
        out = []
        for name, typ, flags, addr, off, size, link, info, _align, entsize in rows:
            sec = Section(self._name(names, name), typ, flags, addr, off, size, link, info, entsize)
            self._check_range(off, sec.file_size, addr, size, "section")
            out.append(sec)
        return out

    def _name(self, table: tuple[int, int], at: int) -> str:
        lo, hi = table[0] + at, table[1]
        if lo >= hi:
            if at:
                raise ElfFormatError(f"{self.path}: section name at {at} past its table")
            return ""
        end = self.buf.find(b"\0", lo, hi)  # in place: no copy of the table per name
        return self.buf[lo : hi if end < 0 else end].decode("utf-8", "replace")

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
        if addr + mem_size > 1 << 64:  # the symbol index computes ends as uint64
            raise ElfFormatError(f"{self.path}: {what} at {addr:#x} of {mem_size} bytes past the address space")

    def section(self, name: str) -> Section | None:
        """The first section called `name`."""
        return next((s for s in self.sections if s.name == name), None)

    def data(self, part: Section | Segment) -> memoryview:
        """The bytes of a section or segment in the file, in place (empty for NOBITS). Checked when
        the headers were read: they lie in the file."""
        return self._view[part.offset : part.offset + part.file_size]

    def contents(self, sec: Section) -> memoryview | bytes | None:
        """The bytes of a section, inflated where compressed: SHF_COMPRESSED (an Elf64_Chdr, then the
        stream) or GNU's .zdebug_* ("ZLIB", the size as 8 big-endian bytes, then the stream). None for a
        compression this module cannot read: zstd (binutils >= 2.40 can write it) needs a module the
        project lacks."""
        data = self.data(sec)
        if sec.flags & SHF_COMPRESSED:
            if len(data) < CHDR_SIZE:
                raise ElfFormatError(f"{self.path}: {sec.name}: truncated compression header")
            kind, size = int.from_bytes(data[:4], "little"), int.from_bytes(data[8:16], "little")
            return self._inflate(sec, data[CHDR_SIZE:], size) if kind == ELFCOMPRESS_ZLIB else None
        if sec.name.startswith(".zdebug_"):
            if len(data) < 12 or data[:4] != b"ZLIB":
                raise ElfFormatError(f"{self.path}: {sec.name}: no ZLIB header")
            return self._inflate(sec, data[12:], int.from_bytes(data[4:12], "big"))
        return data

    def _inflate(self, sec: Section, stream: memoryview, size: int) -> bytes:
        if size > MAX_INFLATED:
            raise ElfFormatError(f"{self.path}: {sec.name}: {size} bytes inflated, above {MAX_INFLATED}")
        inflater = zlib.decompressobj()
        try:
            # One byte more than declared at most: a stream that goes on past its size is refused
            # without inflating the rest.
            out = inflater.decompress(stream, size + 1)
        except zlib.error as e:
            raise ElfFormatError(f"{self.path}: {sec.name}: {e}") from e
        if len(out) != size or not inflater.eof:
            raise ElfFormatError(f"{self.path}: {sec.name}: inflates to other than its declared {size} bytes")
        return out

    def notes(self, part: Section | Segment) -> Iterator[Note]:
        """The notes of a note section or PT_NOTE segment."""
        data = self.data(part)
        pos, end = 0, len(data)
        # Name and descriptor are padded to 4 bytes; what follows the last whole header is padding.
        while pos + NHDR_SIZE <= end:
            namesz, descsz, ntype = (int.from_bytes(data[pos + i : pos + i + 4], "little") for i in (0, 4, 8))
            name_at = pos + NHDR_SIZE
            desc_at = name_at + (namesz + 3) // 4 * 4
            if name_at + namesz > end or desc_at + descsz > end:
                raise ElfFormatError(f"{self.path}: a note at {part.offset + pos:#x} runs past its container")
            name = bytes(data[name_at : name_at + namesz])
            yield Note(name.split(b"\0", 1)[0], ntype, bytes(data[desc_at : desc_at + descsz]))
            pos = desc_at + (descsz + 3) // 4 * 4

    def build_id(self) -> str | None:
        """The GNU build-id, as hex. PT_NOTE covers the allocated notes; the section is the fallback for
        files whose program headers do not list it. Other note sections (stapsdt: thousands of probes)
        are not read."""
        parts: list[Section | Segment] = [seg for seg in self.segments if seg.type == PT_NOTE]
        parts += [sec for sec in self.sections if sec.name == ".note.gnu.build-id"]
        for part in parts:
            for note in self.notes(part):
                # Note types are per owner: a stapsdt note has the build-id's number too.
                if note.name == b"GNU" and note.type == NT_GNU_BUILD_ID:
                    return note.desc.hex()
        return None

