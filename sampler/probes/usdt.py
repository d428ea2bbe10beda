"""USDT (SystemTap SDT) probes: finding them in mapped files and describing their arguments.

The preload tier's contract is the OpenTelemetry eBPF profiler's: a process that samples its own
allocations calls `otel_memory:alloc(ptr, size, weighted_bytes)` and `otel_memory:free(ptr)` for
sampled blocks only. Any process carrying those probes (our shim, an allocator build, the
application) is recorded through them without further set-up.

A probe is a nop at `pc`, described by a `.note.stapsdt` note whose argument string says where
each argument lives at that nop ("8@%rdi -4@$5 8@16(%rbp)"). Arguments are turned into specs the
BPF side reads from the registers (sampler/bpf/usdt.bpf.c; same layout as `struct usdt_spec`).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from functools import lru_cache

from sampler.bpf.abi import USDT_MAX_ARGS, USDT_SPEC, UsdtArgKind

PROVIDER = "otel_memory"
NT_STAPSDT = 3

# Offsets in the x86-64 `struct pt_regs` that uprobe programs get.
PT_REGS = {
    "r15": 0, "r14": 8, "r13": 16, "r12": 24, "rbp": 32, "rbx": 40, "r11": 48, "r10": 56,
    "r9": 64, "r8": 72, "rax": 80, "rcx": 88, "rdx": 96, "rsi": 104, "rdi": 112, "rip": 128,
    "rsp": 152,
}
_ALIASES = {
    **{f"e{r}x": f"r{r}x" for r in "abcd"}, **{f"{r}x": f"r{r}x" for r in "abcd"},
    **{f"{r}l": f"r{r}x" for r in "abcd"},
    **{f"e{r}": f"r{r}" for r in ("si", "di", "bp", "sp", "ip")}, **{r: f"r{r}" for r in ("si", "di", "bp", "sp")},
    **{f"{r}l": f"r{r}" for r in ("si", "di", "bp", "sp")},
    **{f"r{n}{s}": f"r{n}" for n in range(8, 16) for s in ("d", "w", "b")},
}

ARG_CONST, ARG_REG, ARG_DEREF = UsdtArgKind.CONST, UsdtArgKind.REG, UsdtArgKind.DEREF
SPEC = USDT_SPEC.struct
MAX_ARGS = USDT_MAX_ARGS


class UsdtError(ValueError):
    pass


@dataclass(frozen=True)
class UsdtArg:
    kind: int          # ARG_CONST | ARG_REG | ARG_DEREF
    size: int          # bytes, 1/2/4/8
    signed: bool
    reg_off: int = 0   # offset of the register in pt_regs
    value: int = 0     # constant, or displacement of a dereference


@dataclass(frozen=True)
class UsdtProbe:
    provider: str
    name: str
    pc: int            # link-time address of the nop
    file_offset: int   # where a uprobe is attached
    semaphore: int     # file offset of the semaphore (a uprobe ref_ctr_offset), 0: none
    args: tuple[UsdtArg, ...]

    @property
    def label(self) -> str:
        return f"{self.provider}:{self.name}@{self.file_offset:#x}"


_ARG = re.compile(r"^(-?)(\d+)@(?:\$(-?\d+)|%(\w+)|(-?\d*)\(%(\w+)\))$")


def parse_arg(text: str) -> UsdtArg:
    """One argument spec, e.g. '8@%rdi', '-4@$5', '8@-16(%rbp)'."""
    m = _ARG.match(text)
    if not m:
        raise UsdtError(f"unsupported USDT argument {text!r}")
    sign, size, const, reg, disp, base = m.groups()
    size_i = int(size)
    if size_i not in (1, 2, 4, 8):
        raise UsdtError(f"unsupported USDT argument size in {text!r}")
    if const is not None:
        return UsdtArg(ARG_CONST, size_i, bool(sign), value=int(const))
    name = reg or base
    full = _ALIASES.get(name, name)
    if full not in PT_REGS:
        raise UsdtError(f"unsupported USDT register in {text!r}")
    if reg:
        return UsdtArg(ARG_REG, size_i, bool(sign), PT_REGS[full])
    return UsdtArg(ARG_DEREF, size_i, bool(sign), PT_REGS[full], int(disp) if disp not in ("", "-") else 0)


def pack_spec(args: tuple[UsdtArg, ...], kind: int) -> bytes:
    """The BPF map value for one probe site: its arguments and what it reports (`kind`)."""
    if len(args) > MAX_ARGS:
        raise UsdtError(f"{len(args)} USDT arguments; at most {MAX_ARGS} are read")
    fields: list[int] = []
    for i in range(MAX_ARGS):
        a = args[i] if i < len(args) else UsdtArg(ARG_CONST, 8, False)
        fields += [a.value, a.reg_off, a.kind, a.size, int(a.signed)]
    return SPEC.pack(*fields, len(args), kind)


def _sections(fd: int) -> dict[str, tuple[int, int, int]] | None:
    # A header-only reader rather than elf.ElfImage: every executable mapping of every target is
    # checked for notes, and ElfImage also loads symbol tables and looks for debug files.
    """name -> (sh_addr, sh_offset, sh_size) of a 64-bit little-endian ELF file, else None."""
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    if not shoff or shentsize != 64 or not shnum or shstrndx >= shnum:
        return None
    raw = os.pread(fd, shnum * 64, shoff)
    if len(raw) < shnum * 64:
        return None
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", raw, i * 64) for i in range(shnum)]
    strtab = os.pread(fd, hdrs[shstrndx][5], hdrs[shstrndx][4])
    out = {}
    for name_off, _type, _flags, addr, off, size, *_ in hdrs:
        end = strtab.find(b"\0", name_off)
        out[strtab[name_off:end].decode(errors="replace")] = (addr, off, size)
    return out


def read_probes(path: str) -> tuple[UsdtProbe, ...]:
    """USDT probes of a file (empty when it has none or is not an ELF file). Cached by identity."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return _read_probes(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4096)
def _read_probes(path: str, _dev: int, _ino: int, _size: int, _mtime: int) -> tuple[UsdtProbe, ...]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        secs = _sections(fd)
        if not secs or ".note.stapsdt" not in secs:
            return ()
        _, off, size = secs[".note.stapsdt"]
        notes = os.pread(fd, size, off)
        loads = _loads(fd)
    finally:
        os.close(fd)
    base_sec = secs.get(".stapsdt.base")
    probes = []
    pos = 0
    while pos + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from("<III", notes, pos)
        pos += 12
        owner = notes[pos : pos + namesz]
        pos += (namesz + 3) & ~3
        desc = notes[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        if ntype != NT_STAPSDT or owner.rstrip(b"\0") != b"stapsdt" or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc)
        provider, name, argstr = (desc[24:].split(b"\0") + [b"", b"", b""])[:3]
        if base_sec and base:          # prelinked: move pc and semaphore with .stapsdt.base
            pc += base_sec[0] - base
            if sem:
                sem += base_sec[0] - base
        file_off = _file_offset(loads, pc)
        sem_off = _file_offset(loads, sem) if sem else 0
        if file_off is None or sem_off is None:
            continue
        try:
            args = tuple(parse_arg(a) for a in argstr.decode().split())
        except (UsdtError, UnicodeDecodeError):
            continue                   # a probe we cannot read is not used (e.g. a global's
                                       # rip-relative operand: it needs the load bias)
        probes.append(UsdtProbe(provider.decode(errors="replace"), name.decode(errors="replace"),
                                pc, file_off, sem_off, args))
    return tuple(probes)


def _loads(fd: int) -> list[tuple[int, int, int]]:
    """(vaddr, offset, filesz) of the PT_LOAD segments."""
    head = os.pread(fd, 64, 0)
    phoff, = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    raw = os.pread(fd, phentsize * phnum, phoff)
    out = []
    for i in range(phnum):
        ptype, _flags, off, vaddr, _paddr, filesz = struct.unpack_from("<IIQQQQ", raw, i * phentsize)
        if ptype == 1:
            out.append((vaddr, off, filesz))
    return out


def _file_offset(loads: list[tuple[int, int, int]], vaddr: int) -> int | None:
    return next((o + vaddr - v for v, o, n in loads if v <= vaddr < v + n), None)


def memory_probes(path: str) -> list[UsdtProbe]:
    """The `otel_memory` alloc and free sites of a file (a probe may be inlined at several);
    [] unless both probes are there with the contract's arguments (alloc: 3, free: 1)."""
    found = [p for p in read_probes(path) if p.provider == PROVIDER and p.name in ("alloc", "free")
             and len(p.args) == (3 if p.name == "alloc" else 1)]
    return found if {p.name for p in found} == {"alloc", "free"} else []
