"""ElfImage on real binaries: libc, libpython and libraries compiled here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import capstone
import pytest

from sampler.binary import elf
from sampler.binary.elf import ElfImage
from sampler.binary.reader import ElfFormatError

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"

# Hand-placed symbols, so that sizes and gaps are exact (offsets from sized_fn):
#   0 sized_fn (size 2) | 2..16 padding | 16 zero_fn (no size) | 32 outer_fn (size 32)
#   containing 40 inner_label (no size) and 48 inner_fn (size 8) | 64 tail_zero (no size, last).
SYMS_SRC = r"""
__asm__(
    ".text\n"
    ".globl sized_fn\n.type sized_fn,@function\n"
    "sized_fn:\n ret\n nop\n.size sized_fn, 2\n"
    ".skip 14, 0xcc\n"
    ".globl zero_fn\n.type zero_fn,@function\n"
    "zero_fn:\n.skip 16, 0x90\n"
    ".globl outer_fn\n.type outer_fn,@function\n"
    "outer_fn:\n.skip 8, 0x90\n"
    ".type inner_label,@function\n"
    "inner_label:\n.skip 8, 0x90\n"
    ".type inner_fn,@function\n"
    "inner_fn:\n.skip 8, 0x90\n.size inner_fn, 8\n"
    ".skip 8, 0x90\n"
    ".size outer_fn, 32\n"
    ".globl tail_zero\n.type tail_zero,@function\n"
    "tail_zero:\n ret\n");
"""

PLT_SRC = r"""
#include <stdlib.h>
void (*free_ptr)(void *);
void *plt_user(void *p, size_t n) {
    free_ptr = free; /* address taken too: free's stub goes to .plt.got */
    void *q = realloc(p, n);
    free(q);
    return malloc(n);
}
"""

HELPER_SRC = r"""
#ifndef VARIANT
#define VARIANT "plain"
#endif
const char *variant = VARIANT;
static __attribute__((noinline)) int hidden_helper(int x) { __asm__ volatile(""); return x * 5; }
int visible(int x) { return hidden_helper(x) + 1; }
"""


def build(tmp: Path, name: str, src: str, *flags: str) -> Path:
    c = tmp / (name + ".c")
    c.write_text(src)
    out = tmp / name
    subprocess.run(["gcc", "-O2", "-fPIC", "-Wl,--build-id=sha1", *flags, "-o", str(out), str(c)], check=True)
    return out


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def build_id_of(path: Path | str) -> str:
    return re.search(r"Build ID: ([0-9a-f]+)", readelf("-n", str(path))).group(1)


def disasm(img: ElfImage, name: str) -> list[capstone.CsInsn]:
    sym = img.symbol(name)
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return list(md.disasm(img.read_vaddr(sym.value, sym.size), sym.value))


def branch_targets(img: ElfImage, name: str) -> list[int]:
    """Immediate targets of the calls and jumps in function `name`."""
    return [
        int(i.op_str, 16)
        for i in disasm(img, name)
        if i.mnemonic in ("call", "jmp") and i.op_str.startswith("0x")
    ]


# libc


def test_libc_free_matches_readelf():
    img = ElfImage.open(LIBC)
    dynsyms = readelf("--dyn-syms", LIBC)
    row = re.search(r":\s+([0-9a-f]+)\s+(\d+)\s+FUNC\s+GLOBAL\s+DEFAULT\s+\d+ free@@", dynsyms)
    sym = img.symbol("free")
    assert (sym.value, sym.size) == (int(row.group(1), 16), int(row.group(2)))
    assert img.build_id == build_id_of(LIBC)
    assert img.elf_type == "DYN"
    assert img.symbol("no_such_function_anywhere") is None
    # free's aliases include the compat cfree; the lookup prefers the name callers write.
    assert img.lookup(sym.value + 5) == ("free", 5)
    assert {"free", "cfree"} <= set(img.aliases(sym.value))


def test_libc_memalign_aliases():
    img = ElfImage.open(LIBC)
    assert {"memalign", "aligned_alloc"} <= set(img.aliases(img.symbol("memalign").value))
    assert img.symbol("aligned_alloc").value == img.symbol("memalign").value


def test_libc_reallocarray_tail_calls_realloc_plt():
    img = ElfImage.open(LIBC)
    plt = img.plt_targets()
    targets = [t for t in branch_targets(img, "reallocarray") if t in plt]
    assert [plt[t] for t in targets] == ["realloc"]
    # The stub lies outside every function symbol.
    assert img.lookup(targets[0]) is None


def test_libc_debug_file_gives_static_functions():
    bid = build_id_of(LIBC)
    if not os.path.exists(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"):
        pytest.skip("libc6-dbg is not installed")
    img = ElfImage.open(LIBC)
    assert img.has_symtab and img.debug_path
    sym = img.symbol("_int_malloc")  # static in malloc.c: only in the debug .symtab
    assert img.lookup(sym.value + 4) == ("_int_malloc", 4)


# Symbol sizes


def test_symbol_size_rules(tmp_path):
    img = ElfImage.open(str(build(tmp_path, "libsyms.so", SYMS_SRC, "-shared", "-nostdlib")))
    base = img.symbol("sized_fn").value
    assert img.symbol("zero_fn").value == base + 16
    expect = {
        1: ("sized_fn", 1),
        2: None,  # padding after a sized function belongs to nobody
        10: None,
        20: ("zero_fn", 4),  # a zero-size symbol reaches the next symbol
        42: ("outer_fn", 10),  # a sized function wins over a zero-size symbol inside it
        50: ("inner_fn", 2),  # nested sized function
        58: ("outer_fn", 26),  # past the nested one, still in the enclosing one
        64: ("tail_zero", 0),
        66: None,  # a zero-size symbol stops at the end of its section
    }
    assert {off: img.lookup(base + off) for off in expect} == expect
    assert img.lookup(0) is None
    assert img.read_vaddr(base, 4) == b"\xc3\x90\xcc\xcc"


def test_big_symbol_tables_are_read_in_pieces(monkeypatch):
    """A symbol table over KEEP_SYMS_BYTES keeps only the columns naming reads and is read again in
    pieces when needed: names, sizes, enclosing functions and definitions as with the whole table."""
    bid = build_id_of(LIBC)
    if not os.path.exists(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"):
        pytest.skip("libc6-dbg is not installed")

    def answers() -> tuple[list, list]:
        ElfImage.forget()
        img = ElfImage.open(LIBC)
        names = ["malloc", "_int_malloc", "free", "printf", "qsort", "no_such_function"]
        syms = [img.symbol(n) for n in names]
        starts = [s.value for s in syms if s is not None]
        return syms, [img.lookup(v + k) for v in starts for k in (0, 1, 17, 4096)]

    whole = answers()
    monkeypatch.setattr(elf, "KEEP_SYMS_BYTES", 4096)     # 170 symbols a piece
    pieces = answers()
    ElfImage.forget()
    assert pieces == whole and whole[0][1] is not None and whole[0][-1] is None
    assert sum(a is not None for a in whole[1]) > 10


# Segments


@pytest.mark.parametrize("which", ["program", "libpython"])
def test_offsets_match_section_headers(tmp_path, which):
    if which == "program":
        path = build(tmp_path, "prog", "int counter = 1;\nint main(void) { return counter; }\n")
    else:
        path = Path(libpythons()[0])
    img = ElfImage.open(str(path))
    moved = 0
    for line in readelf("-S", str(path)).splitlines():
        # [Nr] Name Type Address Off Size ES Flg ...: the allocated (A) sections with file bytes
        f = line.replace("[ ", "[").split()
        if len(f) < 8 or not f[0][1:-1].isdigit() or "A" not in f[7]:
            continue
        if f[2] == "NOBITS" or int(f[5], 16) == 0:
            continue
        addr, off = int(f[3], 16), int(f[4], 16)
        assert img.vaddr_to_file_offset(addr) == off, f[1]
        assert img.file_offset_to_vaddr(off) == addr, f[1]
        moved += addr != off
    assert moved  # data segments sit at a vaddr different from their file offset
    assert img.file_offset_to_vaddr(os.path.getsize(path) + 1) is None


# PLT


@pytest.mark.parametrize(
    "flags",
    [(), ("-Wl,-z,now",), ("-fcf-protection=full", "-Wl,-z,ibtplt")],
    ids=["lazy-plt", "now", "ibt-plt-sec"],
)
def test_plt_targets(tmp_path, flags):
    img = ElfImage.open(str(build(tmp_path, "libplt.so", PLT_SRC, "-shared", "-O1", *flags)))
    plt = img.plt_targets()
    calls = [plt[t] for t in branch_targets(img, "plt_user") if t in plt]
    assert calls == ["realloc", "free", "malloc"]


# Debug files, cache, errors


def test_separate_debug_file(tmp_path, monkeypatch):
    lib = build(tmp_path, "libdbg.so", HELPER_SRC, "-shared", '-DVARIANT="separate-debug"')
    bid = build_id_of(lib)
    debug = tmp_path / "debug" / ".build-id" / bid[:2] / (bid[2:] + ".debug")
    debug.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(lib), str(debug)], check=True)
    subprocess.run(["strip", str(lib)], check=True)
    monkeypatch.setattr(elf, "DEBUG_ROOTS", (str(tmp_path / "debug"),))

    img = ElfImage.open(str(lib))
    assert img.debug_path == str(debug) and img.has_symtab
    helper = img.symbol("hidden_helper")
    assert img.lookup(helper.value + 1) == ("hidden_helper", 1)
    # Code comes from the main file: the debug file has none.
    assert disasm(img, "hidden_helper")


def test_build_id_shares_only_identical_contents(tmp_path):
    """A file claiming another's build-id (a stripped copy, or a stranger's file) supplies nothing
    for it; an identical copy under another inode is the same image."""
    lib = build(tmp_path, "libfull.so", HELPER_SRC, "-shared", '-DVARIANT="borrow"')
    stripped = tmp_path / "libstripped.so"
    shutil.copy(lib, stripped)
    subprocess.run(["strip", str(stripped)], check=True)
    copy = tmp_path / "libcopy.so"
    shutil.copy(lib, copy)

    full = ElfImage.open(str(lib))
    assert ElfImage.open(str(lib)) is full
    other = ElfImage.open(str(stripped))
    assert other is not full and other.build_id == full.build_id
    assert other.symbol("hidden_helper") is None and not other.has_symtab
    assert full.symbol("hidden_helper") is not None
    assert ElfImage.open(str(copy)) is full


def test_stripped_library_keeps_dynsym(tmp_path):
    lib = build(tmp_path, "libalone.so", HELPER_SRC, "-shared", '-DVARIANT="stripped-alone"')
    subprocess.run(["strip", str(lib)], check=True)
    img = ElfImage.open(str(lib))
    assert not img.has_symtab
    assert img.symbol("hidden_helper") is None
    visible = img.symbol("visible")
    assert img.lookup(visible.value + 1) == ("visible", 1)


def test_not_elf(tmp_path):
    (tmp_path / "text").write_text("not an ELF file\n")
    (tmp_path / "empty").write_bytes(b"")
    for path in (tmp_path / "text", tmp_path / "empty", tmp_path, "/dev/null"):
        with pytest.raises(ElfFormatError):
            ElfImage.open(str(path))


def libpythons() -> list[str]:
    """libpython of this interpreter and of the `python3` on PATH (pyenv builds keep .symtab)."""
    found = []
    code = "import sysconfig as s; print(s.get_config_var('LIBDIR'), s.get_config_var('INSTSONAME'))"
    for exe in dict.fromkeys(filter(None, [sys.executable, shutil.which("python3")])):
        out = subprocess.run(
            [exe, "-c", code],
            capture_output=True,
            text=True,
        ).stdout.split()
        if len(out) == 2 and os.path.exists(os.path.join(*out)):
            found.append(os.path.join(*out))
    return list(dict.fromkeys(found))


def test_index_from_a_fresh_interpreter():
    """Open + symbol index + first lookup with nothing cached. How fast is a benchmark's question,
    not a unit test's: a 0.5 s bound failed here once on a loaded machine (0.58 s for a libpython)."""
    code = (
        "import sys\n"
        "from sampler.binary.elf import ElfImage\n"
        "for p in sys.argv[1:]:\n"
        "    img = ElfImage.open(p)\n"
        "    name = 'free' if 'libc' in p else 'PyObject_Malloc'\n"
        "    found = img.lookup(img.symbol(name).value)\n"
        "    print(found[0] if found else None)\n"
    )
    libs = [LIBC, *libpythons()]
    out = subprocess.run([sys.executable, "-c", code, *libs], check=True, capture_output=True, text=True)
    names = out.stdout.split()
    assert len(names) == len(libs) and all(n != "None" for n in names), (libs, names)


def test_static_stripped_binary_has_no_symbols(tmp_path):
    prog = build(tmp_path, "static", "int main(void) { return 0; }\n", "-static")
    subprocess.run(["strip", str(prog)], check=True)
    img = ElfImage.open(str(prog))
    assert (img.elf_type, img.has_symtab) == ("EXEC", False)
    entry = int(re.search(r"Entry point address:\s+0x([0-9a-f]+)", readelf("-h", str(prog))).group(1), 16)
    assert img.lookup(entry) is None
    assert img.symbol("main") is None and img.aliases(entry) == []
    assert img.plt_targets() == {}  # its .plt holds IRELATIVE stubs only: no names
