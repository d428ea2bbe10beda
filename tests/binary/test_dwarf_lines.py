"""Source lines and inlined frames from DWARF, on programs compiled here and on libc's debug file."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from capstone import CS_ARCH_X86, CS_MODE_64, Cs
from conftest import WORKLOADS, compile_c
from elftools.elf.elffile import ELFFile

from sampler.binary import dwarf_lines
from sampler.binary.dwarf_info import DwarfInfo
from sampler.binary.dwarf_lines import LineTables, SourceFrame
from sampler.binary.elf import ElfImage
from sampler.binary.reader import SHF_COMPRESSED, FileBytes

SRC = WORKLOADS / "inline_chain.c"


def marker_line(tag: str) -> int:
    """The line of the source that carries the comment /* @tag */."""
    lines = [i for i, text in enumerate(SRC.read_text().splitlines(), 1) if f"/* @{tag} */" in text]
    assert len(lines) == 1, tag
    return lines[0]


def build(tmp: Path, variant: str, *flags: str) -> Path:
    # Each variant differs in a string, so that it has a build-id of its own: images and line
    # tables are cached by build-id.
    return compile_c(SRC, tmp / variant, "-O2", f'-DVARIANT="{variant}"', *flags)


def calls_to(img: ElfImage, caller: str, callee: str) -> list[tuple[int, int]]:
    """(address, size) of each direct call from `caller` to `callee`."""
    fn, target = img.symbol(caller), img.symbol(callee).value
    md = Cs(CS_ARCH_X86, CS_MODE_64)
    return [(i.address, i.size) for i in md.disasm(img.read_vaddr(fn.value, fn.size), fn.value)
            if i.mnemonic == "call" and i.op_str == hex(target)]


def expected_chain() -> list[SourceFrame]:
    src = str(SRC)
    return [
        SourceFrame("leaf", src, marker_line("leaf-call")),
        SourceFrame("middle", src, marker_line("middle-call")),
        SourceFrame("outer", src, marker_line("outer-call")),
    ]


@pytest.fixture(scope="module")
def chain_bin(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("dwarf"), "plain")


def test_inlined_calls_innermost_first(chain_bin):
    img = ElfImage.open(str(chain_bin))
    tables = LineTables.for_image(img)
    assert tables is not None and tables.path == str(chain_bin)
    [(call, size)] = calls_to(img, "outer", "touch")
    assert tables.lookup(call) == expected_chain()
    # The symbolizer asks for the byte before a return address: the same call.
    assert tables.lookup(call + size - 1) == expected_chain()
    assert tables.lookup(0) == []


def test_function_not_inlined(chain_bin):
    img = ElfImage.open(str(chain_bin))
    [(call, _)] = calls_to(img, "main", "outer")
    assert LineTables.for_image(img).lookup(call) == [SourceFrame("main", str(SRC), marker_line("main-call"))]


def test_nested_function_is_a_frame_of_its_own(chain_bin):
    img = ElfImage.open(str(chain_bin))
    nested = next(name for name in ("nested", "nested.0") if img.symbol(name))
    [(call, _)] = calls_to(img, nested, "touch")
    assert LineTables.for_image(img).lookup(call) == [SourceFrame("nested", str(SRC), marker_line("nested-call"))]


def test_cached_per_build_id_and_memoised(chain_bin):
    img = ElfImage.open(str(chain_bin))
    tables = LineTables.for_image(img)
    assert LineTables.for_image(img) is tables
    [(call, _)] = calls_to(img, "outer", "touch")
    first = tables.lookup(call)
    first.clear()  # callers get their own list
    assert tables.lookup(call) == expected_chain()


@pytest.mark.parametrize("flags", [("-gdwarf-4",), ("-gdwarf-5",), ("-gz",)], ids=["dwarf4", "dwarf5", "zlib"])
def test_dwarf_versions_and_compressed_sections(tmp_path, flags):
    binary = build(tmp_path, "v" + flags[0].strip("-"), *flags)
    if flags == ("-gz",):
        assert section_flags(binary, ".debug_info") & SHF_COMPRESSED
    img = ElfImage.open(str(binary))
    [(call, _)] = calls_to(img, "outer", "touch")
    assert LineTables.for_image(img).lookup(call) == expected_chain()


@pytest.mark.parametrize("cache", ["private", "none"])
def test_inflated_sections_are_kept_in_a_file_of_the_cache(tmp_path, monkeypatch, cache):
    """Inflated DWARF is read back from an unlinked file of the cache directory (off the heap), and
    gives the same frames; with no private cache directory it stays in memory."""
    root = tmp_path / "cache"
    if cache == "none":
        root.mkdir(mode=0o777)
        root.chmod(0o777)                   # not ours alone: no cache
    monkeypatch.setenv("ALLOCSAMPLER_CACHE_DIR", str(root))
    monkeypatch.setattr(dwarf_lines, "SPILL_BYTES", 0)
    binary = build(tmp_path, f"spill-{cache}", "-gz")
    img = ElfImage.open(str(binary))
    [(call, _)] = calls_to(img, "outer", "touch")
    tables = LineTables.for_image(img)
    assert tables.lookup(call) == expected_chain()
    info = tables._sections["info"].buf                            # compressed in the file
    assert isinstance(info, FileBytes if cache == "private" else bytes), type(info)
    assert info is not img.elf.buf
    if cache == "private":
        assert list((root / "inflated").iterdir()) == []         # unlinked: nothing left behind


def test_gnu_zdebug_sections(tmp_path):
    plain = build(tmp_path, "zdebug-src")
    binary = tmp_path / "zdebug"
    subprocess.run(["objcopy", "--compress-debug-sections=zlib-gnu", str(plain), str(binary)], check=True)
    assert section_flags(binary, ".zdebug_info") is not None
    img = ElfImage.open(str(binary))
    [(call, _)] = calls_to(img, "outer", "touch")
    assert LineTables.for_image(img).lookup(call) == expected_chain()


def test_without_aranges_cus_are_found_by_their_ranges(tmp_path):
    with_aranges = build(tmp_path, "aranges-src")
    binary = tmp_path / "no-aranges"
    subprocess.run(["objcopy", "--remove-section=.debug_aranges", str(with_aranges), str(binary)], check=True)
    assert section_flags(binary, ".debug_aranges") is None
    img = ElfImage.open(str(binary))
    [(call, _)] = calls_to(img, "outer", "touch")
    assert LineTables.for_image(img).lookup(call) == expected_chain()


def test_no_debug_info_gives_none(tmp_path):
    binary = build(tmp_path, "stripped", "-g0")
    subprocess.run(["strip", str(binary)], check=True)
    img = ElfImage.open(str(binary))
    assert img.debug_path is None
    assert LineTables.for_image(img) is None


@pytest.mark.parametrize(
    "section", [".debug_info", ".debug_abbrev", ".debug_line", ".debug_aranges", ".debug_str", ".debug_rnglists"]
)
def test_malformed_dwarf_never_raises(tmp_path, section):
    binary = build(tmp_path, "corrupt" + section)
    img = ElfImage.open(str(binary))
    pcs = [a + k for a, size in calls_to(img, "outer", "touch") + calls_to(img, "main", "outer") for k in range(size)]
    rng = random.Random(section)
    with open(binary, "r+b") as f:
        sec = ELFFile(f).get_section_by_name(section)
        f.seek(sec["sh_offset"])
        f.write(rng.randbytes(sec["sh_size"]))
    tables = LineTables.for_image(img)
    for pc in pcs + [0, 1, 2**64 - 1]:
        frames = tables.lookup(pc) if tables else []
        assert all(isinstance(fr, SourceFrame) for fr in frames)


def test_pyelftools_internals(chain_bin):
    """The pyelftools internals that dwarf_info.DwarfInfo uses (see its docstring) do what it expects
    in the installed release: a release that changes them fails here, not in production."""
    dwarf = DwarfInfo(dwarf_lines.read_sections(str(chain_bin))[0])
    info = dwarf._info
    cu = dwarf.parse_cu(0)
    assert not info._cu_cache  # parsed anew, not kept
    top = cu.get_top_DIE()
    assert dwarf.parsed_dies(cu) == 1
    children = list(top.iter_children())
    assert dwarf.parsed_dies(cu) > len(children) > 1
    prog = dwarf.line_program(cu)
    assert prog is not None and prog.program_end_offset > prog.program_start_offset
    assert not info._linetable_cache
    assert cu["debug_abbrev_offset"] in info._abbrevtable_cache
    dwarf.forget_abbrevs(cu)
    assert not info._abbrevtable_cache


def section_flags(binary: Path, name: str) -> int | None:
    """sh_flags of section `name`, None when there is none."""
    with open(binary, "rb") as f:
        sec = ELFFile(f).get_section_by_name(name)
        return None if sec is None else sec["sh_flags"]


# libc, through its separate debug file (libc6-dbg)


def libc_image() -> ElfImage:
    with open("/proc/self/maps") as f:
        path = next(line.split()[-1] for line in f if re.search(r"/libc\.so\.6$", line.strip()))
    img = ElfImage.open(path)
    if img.debug_path is None:
        pytest.skip("libc6-dbg is not installed")
    return img


def test_libc_malloc_from_debug_file():
    img = libc_image()
    tables = LineTables.for_image(img)
    assert tables is not None and tables.path == img.debug_path
    malloc = img.symbol("malloc")
    frames = tables.lookup(malloc.value)
    assert frames and frames[-1].function in img.aliases(malloc.value)
    assert os.path.basename(frames[-1].file) == "malloc.c" and frames[-1].line > 0


def test_libc_agrees_with_addr2line():
    """Lines and inlined depth of addresses spread over libc, against binutils' addr2line -i."""
    if not shutil.which("addr2line"):
        pytest.skip("binutils is not installed")
    img = libc_image()
    tables = LineTables.for_image(img)
    names = ["malloc", "free", "calloc", "realloc", "_int_malloc", "_int_free", "printf", "__vfprintf_internal",
             "fopen", "qsort", "strtod", "getaddrinfo", "regcomp", "pthread_create", "memalign"]
    pcs = []
    for name in names:
        sym = img.symbol(name)
        if sym is not None and sym.size:
            pcs += [sym.value + sym.size * k // 4 for k in range(4)]
    out = subprocess.run(["addr2line", "-i", "-a", "-e", img.debug_path, *map(hex, pcs)],
                         check=True, capture_output=True, text=True).stdout
    expected: dict[int, list[int | None]] = {}
    for line in out.splitlines():
        if line.startswith("0x"):
            pc = int(line, 16)
            expected[pc] = []
        else:
            number = line.rpartition(":")[2].split()[0]
            expected[pc].append(int(number) if number.isdigit() and number != "0" else None)
    assert len(expected) == len(pcs) > 40
    assert sum(len(lines) > 1 for lines in expected.values()) > 5  # inlined calls are covered
    for pc in pcs:
        assert [f.line for f in tables.lookup(pc)] == expected[pc], hex(pc)
