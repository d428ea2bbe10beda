"""ElfReader on files made here byte by byte: what it reads, and the one clean error for truncated,
malformed and hostile ones (sizes and counts past the file, zlib bombs)."""

from __future__ import annotations

import os
import random
import struct
import tracemalloc
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import WORKLOADS, compile_c

from sampler.binary import reader
from sampler.binary.dwarf_lines import LineTables
from sampler.binary.elf import ElfImage
from sampler.binary.reader import ElfFormatError, ElfReader
from sampler.probes import usdt

SHT_PROGBITS, SHT_STRTAB, SHT_NOTE = 1, 3, 7
EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
SHDR = struct.Struct("<IIQQQQIIQQ")
PHDR = struct.Struct("<IIQQQQQQ")


@dataclass
class Sec:
    name: str
    type: int
    data: bytes
    flags: int = 0
    addr: int = 0


def note(owner: bytes, ntype: int, desc: bytes) -> bytes:
    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("<III", len(owner) + 1, len(desc), ntype) + pad(owner + b"\0") + pad(desc)


def elf_bytes(sections: list[Sec], note_segment: str | None = None) -> bytes:
    """A 64-bit little-endian ET_DYN file: header, one PT_NOTE program header over the section named
    `note_segment` if given, the sections' bytes, .shstrtab, then the section headers."""
    names = b"\0"
    name_at = []
    for sec in [*sections, Sec(".shstrtab", SHT_STRTAB, b"")]:
        name_at.append(len(names))
        names += sec.name.encode() + b"\0"
    sections = [*sections, Sec(".shstrtab", SHT_STRTAB, names)]
    phnum = 1 if note_segment else 0
    pos = EHDR.size + phnum * PHDR.size
    body, offsets = b"", []
    for sec in sections:
        offsets.append(pos + len(body))
        body += sec.data + b"\0" * (-len(sec.data) % 8)
    shoff = pos + len(body)
    out = bytearray(EHDR.pack(b"\x7fELF\x02\x01\x01" + b"\0" * 9, 3, 62, 1, 0, EHDR.size if phnum else 0, shoff,
                              0, EHDR.size, PHDR.size, phnum, SHDR.size, len(sections) + 1, len(sections)))
    for i, sec in enumerate(sections):
        if sec.name == note_segment:
            out += PHDR.pack(4, 4, offsets[i], sec.addr, sec.addr, len(sec.data), len(sec.data), 4)
    out += body + SHDR.pack(*[0] * 10)  # section 0
    for sec, at, off in zip(sections, name_at, offsets, strict=True):
        out += SHDR.pack(at, sec.type, sec.flags, sec.addr, off, len(sec.data), 0, 0, 1, 0)
    return bytes(out)


def sample_file() -> bytearray:
    """Writable, for the tests to break."""
    return bytearray(elf_bytes(
        [
            Sec(".note.gnu.build-id", SHT_NOTE, note(b"GNU", 3, bytes.fromhex("0123456789abcdef")), addr=0x200),
            Sec(".text", SHT_PROGBITS, b"\x90" * 32, addr=0x1000),
        ],
        note_segment=".note.gnu.build-id",
    ))


def shdr_at(data: bytes, index: int) -> int:
    return struct.unpack_from("<Q", data, 0x28)[0] + index * SHDR.size


def write(tmp_path: Path, data: bytes, name: str = "f") -> str:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def test_reads_sections_segments_and_notes(tmp_path):
    elf = ElfReader.open(write(tmp_path, sample_file()))
    assert elf.elf_type == "DYN"
    assert [s.name for s in elf.sections] == ["", ".note.gnu.build-id", ".text", ".shstrtab"]
    text = elf.section(".text")
    assert (text.addr, bytes(elf.data(text))) == (0x1000, b"\x90" * 32)
    assert [s.type for s in elf.segments] == [reader.PT_NOTE]
    assert elf.build_id() == "0123456789abcdef"
    assert list(elf.notes(elf.segments[0])) == [reader.Note(b"GNU", 3, bytes.fromhex("0123456789abcdef"))]


def test_extended_section_numbering(tmp_path):
    """e_shnum 0 and e_shstrndx SHN_XINDEX: the counts are in section 0 (files of 65280+ sections)."""
    data = sample_file()
    shnum, shstrndx = struct.unpack_from("<HH", data, 0x3C)
    struct.pack_into("<HH", data, 0x3C, 0, reader.SHN_XINDEX)
    struct.pack_into("<Q", data, shdr_at(data, 0) + 0x20, shnum)  # sh_size
    struct.pack_into("<I", data, shdr_at(data, 0) + 0x28, shstrndx)  # sh_link
    assert [s.name for s in ElfReader(bytes(data)).sections][-1] == ".shstrtab"


def u16(off: int, value: int):
    return lambda d: struct.pack_into("<H", d, off, value)


def u64(off: int, value: int):
    return lambda d: struct.pack_into("<Q", d, off, value)


def shdr_field(index: int, field_off: int, value: int, fmt: str = "<Q"):
    return lambda d: struct.pack_into(fmt, d, shdr_at(d, index) + field_off, value)


MALFORMED = {
    "not ELF": lambda d: d.__setitem__(slice(0, 4), b"MZ\0\0"),
    "32-bit": lambda d: d.__setitem__(4, 1),
    "big-endian": lambda d: d.__setitem__(5, 2),
    "section table past the end": u64(0x28, 1 << 40),
    "too many sections": lambda d: (u16(0x3C, 0)(d), shdr_field(0, 0x20, 70000)(d)),
    "section header size": u16(0x3A, 40),
    "name table index": u16(0x3E, 99),
    "section past the end": shdr_field(2, 0x20, 1 << 62),  # .text's sh_size
    "section offset past the end": shdr_field(2, 0x18, 1 << 62),
    "section past the address space": shdr_field(2, 0x10, (1 << 64) - 8),
    "name past its table": shdr_field(2, 0, 1 << 20, "<I"),
    "program headers past the end": u64(0x20, 1 << 40),
    "program header size": u16(0x36, 32),
    "segment past the end": lambda d: struct.pack_into("<Q", d, EHDR.size + 0x20, 1 << 50),
    "note past its segment": lambda d: struct.pack_into("<I", d, struct.unpack_from("<Q", d, EHDR.size + 8)[0] + 4,
                                                         1 << 20),
}


@pytest.mark.parametrize("how", MALFORMED)
def test_malformed_headers_raise_elf_format_error(tmp_path, how):
    data = sample_file()
    MALFORMED[how](data)
    path = write(tmp_path, data)
    with pytest.raises(ElfFormatError):
        ElfReader.open(path).build_id()
    with pytest.raises(ElfFormatError):
        ElfImage.open(path)
    assert usdt.read_probes(path) == ()


def test_truncated_files_raise_elf_format_error(tmp_path):
    data = sample_file()
    for size in [0, 3, 16, 63, *range(64, len(data), 7)]:
        path = write(tmp_path, data[:size], f"cut{size}")
        with pytest.raises(ElfFormatError):
            ElfReader.open(path)
        with pytest.raises(ElfFormatError):
            ElfImage.open(path)
        assert usdt.read_probes(path) == ()


def test_random_corruption_raises_only_elf_format_error(tmp_path, monkeypatch):
    """Bytes of a real binary's headers, and of what they point to, overwritten at random: read, or refused
    cleanly. SEED and N in the environment search further."""
    by_build_id: dict[str, ElfImage] = {}
    monkeypatch.setattr(ElfImage, "_by_build_id", by_build_id)  # each copy read for itself
    binary = compile_c(WORKLOADS / "inline_chain.c", tmp_path / "chain", "-O2")
    good = bytearray(binary.read_bytes())
    shoff, phoff = struct.unpack_from("<Q", good, 0x28)[0], struct.unpack_from("<Q", good, 0x20)[0]
    shnum, phnum = struct.unpack_from("<H", good, 0x3C)[0], struct.unpack_from("<H", good, 0x38)[0]
    spans = [(0x10, 0x40), (phoff, phoff + phnum * PHDR.size), (shoff, shoff + shnum * SHDR.size)]
    # and what the headers point to: symbols, relocations, notes, PLT stubs
    spans += [(s.offset, s.offset + s.size) for s in ElfReader(bytes(good)).sections
              if s.size and (s.name.startswith((".note", ".rela", ".plt")) or s.name in (".dynsym", ".symtab"))]
    rng = random.Random(int(os.environ.get('SEED', 7)))
    N = int(os.environ.get('N', 300))
    refused = 0
    for i in range(N):
        data = bytearray(good)
        lo, hi = rng.choice(spans)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(lo, hi)
            data[at : at + 2] = rng.choice([b"\xff\xff", b"\0\0", rng.randbytes(2)])
        path = write(tmp_path, data, f"c{i}")
        by_build_id.clear()
        try:
            img = ElfImage.open(path)
        except ElfFormatError:
            refused += 1
        else:
            img.plt_targets()
            main = img.symbol("main")
            img.lookup(main.value if main else 0)
        usdt.read_probes(path)
    assert 0 < refused < N


# Compressed sections


def compressed(name: str, stream: bytes, declared: int, gnu: bool = False) -> Sec:
    if gnu:  # .zdebug_*: "ZLIB", the size big-endian, the stream
        return Sec(name.replace(".debug_", ".zdebug_"), SHT_PROGBITS, b"ZLIB" + declared.to_bytes(8, "big") + stream)
    chdr = struct.pack("<IIQQ", reader.ELFCOMPRESS_ZLIB, 0, declared, 1)
    return Sec(name, SHT_PROGBITS, chdr + stream, flags=reader.SHF_COMPRESSED)


@pytest.mark.parametrize("gnu", [False, True], ids=["SHF_COMPRESSED", "zdebug"])
def test_compressed_section_inflates_to_its_declared_size(gnu):
    text = b"debug info " * 1000
    elf = ElfReader(elf_bytes([compressed(".debug_info", zlib.compress(text), len(text), gnu)]))
    assert elf.contents(elf.sections[1]) == text


@pytest.mark.parametrize("gnu", [False, True], ids=["SHF_COMPRESSED", "zdebug"])
def test_zlib_bomb_stops_at_its_declared_size(tmp_path, gnu):
    """32 MiB of zeros in 32 KiB of stream, declared as 4 KiB: refused after inflating 4 KiB + 1."""
    bomb = zlib.compress(bytes(32 << 20), 9)
    assert len(bomb) < 64 << 10
    path = write(tmp_path, elf_bytes([compressed(".debug_info", bomb, 4096, gnu), Sec(".debug_abbrev", 1, b"\0")]))
    elf = ElfReader.open(path)
    tracemalloc.start()
    try:
        with pytest.raises(ElfFormatError, match="declared"):
            elf.contents(elf.sections[1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert LineTables.for_image(ElfImage.open(path)) is None


def test_declared_size_above_the_cap_is_refused_without_inflating(monkeypatch):
    text = b"x" * 5000
    elf = ElfReader(elf_bytes([compressed(".debug_info", zlib.compress(text), len(text))]))
    monkeypatch.setattr(reader, "MAX_INFLATED", 4096)
    monkeypatch.setattr(zlib, "decompressobj", None)  # would raise TypeError if called
    with pytest.raises(ElfFormatError, match="above"):
        elf.contents(elf.sections[1])


@pytest.mark.parametrize("declared", [4999, 5001])
def test_stream_of_another_size_than_declared_is_refused(declared):
    text = b"x" * 5000
    elf = ElfReader(elf_bytes([compressed(".debug_info", zlib.compress(text), declared)]))
    with pytest.raises(ElfFormatError):
        elf.contents(elf.sections[1])


def test_corrupt_stream_and_truncated_header_are_refused():
    elf = ElfReader(elf_bytes([compressed(".debug_info", b"not zlib at all", 100),
                               Sec(".debug_line", SHT_PROGBITS, b"short", flags=reader.SHF_COMPRESSED)]))
    for sec in elf.sections[1:3]:
        with pytest.raises(ElfFormatError):
            elf.contents(sec)


def test_unknown_compression_is_left_unread():
    zstd = 2  # ELFCOMPRESS_ZSTD
    sec = Sec(".debug_info", SHT_PROGBITS, struct.pack("<IIQQ", zstd, 0, 10, 1) + b"?" * 10,
              flags=reader.SHF_COMPRESSED)
    elf = ElfReader(elf_bytes([sec]))
    assert elf.contents(elf.sections[1]) is None
