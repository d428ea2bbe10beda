"""USDT notes: argument specs, and the probes found in real files (the shim, glibc)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from sampler.bpf.abi import Fn, Source
from sampler.inprocess.preload import shim_path
from sampler.probes import usdt


@pytest.mark.parametrize("text, want", [
    ("8@%rdi", usdt.UsdtArg(usdt.ARG_REG, 8, False, usdt.PT_REGS["rdi"])),
    ("-4@%eax", usdt.UsdtArg(usdt.ARG_REG, 4, True, usdt.PT_REGS["rax"])),
    ("8@%r12", usdt.UsdtArg(usdt.ARG_REG, 8, False, usdt.PT_REGS["r12"])),
    ("4@%r9d", usdt.UsdtArg(usdt.ARG_REG, 4, False, usdt.PT_REGS["r9"])),
    ("-4@$5", usdt.UsdtArg(usdt.ARG_CONST, 4, True, value=5)),
    ("8@-16(%rbp)", usdt.UsdtArg(usdt.ARG_DEREF, 8, False, usdt.PT_REGS["rbp"], -16)),
    ("8@(%rax)", usdt.UsdtArg(usdt.ARG_DEREF, 8, False, usdt.PT_REGS["rax"], 0)),
])
def test_argument_specs(text, want):
    assert usdt.parse_arg(text) == want


@pytest.mark.parametrize("text", ["3@%rdi", "8@%xmm0", "8@foo", "8@8(%rax,%rbx,2)"])
def test_unsupported_arguments_are_refused(text):
    with pytest.raises(usdt.UsdtError):
        usdt.parse_arg(text)


def test_spec_layout_matches_the_bpf_struct():
    spec = usdt.pack_spec((usdt.parse_arg("8@%rdi"), usdt.parse_arg("-4@$3")), usdt_kind := 1)
    assert len(spec) == usdt.SPEC.size == 3 * 16 + 16
    fields = usdt.SPEC.unpack(spec)
    assert fields[:5] == (0, usdt.PT_REGS["rdi"], usdt.ARG_REG, 8, 0)
    assert fields[5:10] == (3, 0, usdt.ARG_CONST, 4, 1)
    assert fields[-4:] == (2, usdt_kind, Fn.USDT_ALLOC, Source.MALLOC)     # what its records carry


def _readelf_notes(path: str) -> list[tuple[str, str, int, str]]:
    """(provider, name, pc, args) of each stapsdt note, as binutils reads them."""
    text = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
    out = []
    for m in re.finditer(r"Provider: (\S+)\s+Name: (\S+)\s+Location: (0x[0-9a-f]+).*?Arguments: ([^\n]*)",
                         text, re.S):
        out.append((m[1], m[2], int(m[3], 16), m[4].strip()))
    return out


def test_the_shim_carries_the_memory_contract():
    path = str(shim_path())
    probes = usdt.memory_probes(path)
    assert {p.name for p in probes} == {"alloc", "free", "unfree"}
    want = {(prov, name, pc) for prov, name, pc, _ in _readelf_notes(path)}
    assert {(p.provider, p.name, p.pc) for p in probes} <= want
    alloc = next(p for p in probes if p.name == "alloc")
    assert [a.size for a in alloc.args] == [8, 8, 8] and not alloc.semaphore
    with open(path, "rb") as f:                       # the probe site is a nop in the file
        f.seek(alloc.file_offset)
        assert f.read(1) == b"\x90"


def test_other_providers_are_read_but_are_not_the_memory_contract(tmp_path):
    """A binary with its own probes (a semaphore, constants, memory operands) is parsed like
    readelf parses it, and is not taken for an allocator emitting the memory contract."""
    src = tmp_path / "demo.c"
    src.write_text("#define _SDT_HAS_SEMAPHORES 1\n#include <sys/sdt.h>\n"
                   "unsigned short demo_hello_semaphore __attribute__((section(\".probes\")));\n"
                   "unsigned short otel_memory_free_semaphore __attribute__((section(\".probes\")));\n"
                   "int main(int argc, char **argv) {\n"
                   "    DTRACE_PROBE3(demo, hello, argc, argv[1], 7);\n"
                   "    DTRACE_PROBE1(otel_memory, free, argv);\n"      # half the contract only
                   "    return 0;\n}\n")
    exe = tmp_path / "demo"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    found = usdt.read_probes(str(exe))
    notes = _readelf_notes(str(exe))
    assert sorted((p.provider, p.name, p.pc) for p in found) == sorted(n[:3] for n in notes)
    hello = next(p for p in found if p.name == "hello")
    assert hello.semaphore > 0 and len(hello.args) == 3
    assert hello.args[1].kind == usdt.ARG_DEREF and hello.args[1].value == 8
    assert hello.args[2] == usdt.UsdtArg(usdt.ARG_CONST, 4, True, value=7)
    assert usdt.memory_probes(str(exe)) == []


REMAPPER = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
def place(path, at=None):
    fd = os.open(path, os.O_RDONLY)
    flags = mmap.MAP_PRIVATE | (0x10 if at else 0)               # MAP_FIXED
    addr = libc.mmap(at, 4096, mmap.PROT_READ | mmap.PROT_EXEC, flags, fd, 0)
    os.close(fd)
    return addr
addr = place(sys.argv[1])
print(hex(addr), flush=True)
sys.stdin.readline()
place(sys.argv[2], addr)                                         # another file at the same range
print("remapped", flush=True)
sys.stdin.readline()
"""


def test_probes_are_parsed_from_and_attached_through_one_descriptor(tmp_path):
    """A range remapped with another file after its probes were found: the pinned descriptor still
    reads the file it was opened on, and a mapping seen before the remap is refused as stale (never
    resolved again by path: probes would land on another inode)."""
    import sys

    from sampler.proc.maps import pinned, read_maps
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * 4096)
    p = subprocess.Popen([sys.executable, "-c", REMAPPER, str(shim_path()), str(other)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        addr = int(p.stdout.readline(), 16)
        m = next(x for x in read_maps(p.pid) if x.start == addr)
        with pinned(p.pid, m) as path:
            assert usdt.memory_probes(path)                        # the shim's contract
            p.stdin.write("remap\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "remapped"
            assert usdt.memory_probes(path)                        # still the shim, not the new file
            assert os.stat(path).st_ino == m.inode
        with pytest.raises(OSError, match="remapped"), pinned(p.pid, m):
            pass
    finally:
        p.kill()
        p.wait()


def test_a_semaphore_outside_writable_data_is_not_used(tmp_path):
    """A probe whose semaphore points into code (the kernel would increment it there): dropped."""
    src = tmp_path / "sem.c"
    src.write_text(r"""
#include <sys/sdt.h>
__extension__ unsigned short otel_memory_alloc_semaphore __attribute__((unused, section(".text")));
__extension__ unsigned short otel_memory_free_semaphore __attribute__((unused, section(".probes")));
int main(int argc, char **argv) {
    if (otel_memory_alloc_semaphore) STAP_PROBE3(otel_memory, alloc, argc, 8, 8);
    if (otel_memory_free_semaphore) STAP_PROBE1(otel_memory, free, argv);
    return 0;
}
""")
    exe = tmp_path / "sem"
    subprocess.run(["gcc", "-O1", "-DSDT_USE_VARIADIC", "-D_SDT_HAS_SEMAPHORES=1", "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    names = {(p.name, p.semaphore != 0) for p in usdt.read_probes(str(exe))}
    assert ("free", True) in names                                 # .probes: writable data
    assert not any(n == "alloc" for n, _ in names), names          # in .text: refused
