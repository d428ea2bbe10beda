"""USDT (SystemTap SDT) probes: finding them in mapped files and describing their arguments.

The preload tier's contract is the OpenTelemetry eBPF profiler's: a process that samples its own
allocations calls `otel_memory:alloc(ptr, size, weighted_bytes)` and `otel_memory:free(ptr)` for
sampled blocks only. Any process carrying those probes (our shim, an allocator build, the
application) is recorded through them without further set-up.

A probe is a nop at `pc`, described by a `.note.stapsdt` note whose argument string says where
each argument lives at that nop ("8@%rdi -4@$5 8@16(%rbp)"). Arguments are turned into specs the
BPF side reads from the registers (bpf/usdt.bpf.c; same layout as `struct usdt_spec`).
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from sampler import files
from sampler.binary.reader import PT_LOAD, ElfFormatError, ElfReader, Segment, format_errors, open_regular
from sampler.bpf.abi import USDT_FAMILY_LINK, USDT_MAX_ARGS, USDT_SPEC, Fn, Source, UsdtArgKind, UsdtKind
from sampler.bpf.loader import UsdtSite

PROVIDER = "otel_memory"
# The probes recorded as allocations: (provider, name) -> (argument count, what it reports). The
# otel_memory pair is the contract; allocsampler's are the injected sampler's (inject.c) and the
# shim's extensions: CPython's small objects, and the undo of a free (a realloc that failed).
MEMORY_PROBES = {
    (PROVIDER, "alloc"): (3, UsdtKind.ALLOC),
    (PROVIDER, "free"): (1, UsdtKind.FREE),
    ("allocsampler", "pyalloc"): (3, UsdtKind.PY_ALLOC),
    ("allocsampler", "unfree"): (1, UsdtKind.UNFREE),
}
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


# What each kind of site reports: the fn_id and ev_source of its records.
REPORTS = {
    UsdtKind.ALLOC: (Fn.USDT_ALLOC, Source.MALLOC), UsdtKind.FREE: (Fn.USDT_FREE, Source.MALLOC),
    UsdtKind.TORCH_ALLOC: (Fn.TORCH_ALLOC, Source.TORCH), UsdtKind.TORCH_FREE: (Fn.TORCH_FREE, Source.TORCH),
    UsdtKind.PY_ALLOC: (Fn.PY_ALLOC, Source.PYTHON), UsdtKind.UNFREE: (Fn.USDT_UNFREE, Source.MALLOC),
}


def pack_spec(args: tuple[UsdtArg, ...], kind: int, family: bool = False) -> bytes:
    """The BPF map value for one probe site: its arguments and what it reports (`kind`);
    `family`: a family's link (USDT_FAMILY_LINK: it counts only --children targets)."""
    if len(args) > MAX_ARGS:
        raise UsdtError(f"{len(args)} USDT arguments; at most {MAX_ARGS} are read")
    fields: list[int] = []
    for i in range(MAX_ARGS):
        a = args[i] if i < len(args) else UsdtArg(ARG_CONST, 8, False)
        fields += [a.value, a.reg_off, a.kind, a.size, int(a.signed)]
    fn, source = REPORTS[UsdtKind(kind)]
    return SPEC.pack(*fields, len(args), kind, fn | (USDT_FAMILY_LINK if family else 0), source)


# Files whose probes are remembered, by identity: (device, inode, size, mtime). Not by path: a
# map_files path names a mapping, not a file, and a path may name another file since.
PROBE_CACHE = 4096
MAX_ARG_STRING = 1024  # a probe's argument string (a dozen operands: under 200 bytes)
_probes: OrderedDict[tuple[int, int, int, int], tuple[UsdtProbe, ...]] = OrderedDict()
_probes_lock = threading.Lock()


def read_probes(path: str) -> tuple[UsdtProbe, ...]:
    """USDT probes of a file (empty when it has none, is not an ELF file, or is malformed).
    Cached by identity."""
    try:
        fd = open_regular(path)
    except (OSError, ElfFormatError):
        return ()
    try:
        st = os.fstat(fd)
        key = files.identity(st)
        with _probes_lock:
            found = _probes.get(key)
        if found is None:
            try:
                found = _parse_probes(ElfReader.from_fd(fd, path))
            except ElfFormatError:
                found = ()
            with _probes_lock:
                _probes[key] = found
                if len(_probes) > PROBE_CACHE:
                    _probes.popitem(last=False)
        return found
    except OSError:
        return ()
    finally:
        os.close(fd)


@format_errors
def _parse_probes(elf: ElfReader) -> tuple[UsdtProbe, ...]:
    # ElfReader, not elf.ElfImage: every executable mapping of every target is checked for notes, and
    # ElfImage also loads symbol tables and looks for debug files.
    sec = elf.section(".note.stapsdt")
    notes = list(elf.notes(sec)) if sec is not None else []
    loads = [seg for seg in elf.segments if seg.type == PT_LOAD]
    base_sec = elf.section(".stapsdt.base")
    probes = []
    for owner, ntype, desc in notes:
        if ntype != NT_STAPSDT or owner != b"stapsdt" or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc)
        provider, name, argstr = (desc[24:].split(b"\0", 3) + [b"", b"", b""])[:3]
        if len(provider) > 255 or len(name) > 255 or len(argstr) > MAX_ARG_STRING:
            continue
        if base_sec and base:          # prelinked: move pc and semaphore with .stapsdt.base
            pc += base_sec.addr - base
            if sem:
                sem += base_sec.addr - base
        file_off = _file_offset(loads, pc)
        # a semaphore the kernel increments must lie in the file's writable data (a forged one
        # elsewhere would make it write into code or read-only data)
        sem_off = _file_offset([s for s in loads if s.flags & PF_W], sem) if sem else 0
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


PF_W = 2


def _file_offset(loads: list[Segment], vaddr: int) -> int | None:
    return next((s.offset + vaddr - s.vaddr for s in loads if s.vaddr <= vaddr < s.vaddr + s.filesz), None)


def memory_probes(path: str) -> list[UsdtProbe]:
    """The memory probe sites of a file (MEMORY_PROBES; a probe may be inlined at several); [] unless
    otel_memory's alloc and free are both there with the contract's arguments (alloc: 3, free: 1)."""
    found = [p for p in read_probes(path) if MEMORY_PROBES.get((p.provider, p.name), (-1,))[0] == len(p.args)]
    names = {(p.provider, p.name) for p in found}
    return found if {(PROVIDER, "alloc"), (PROVIDER, "free")} <= names else []


def memory_kind(probe: UsdtProbe) -> int:
    """What a site of memory_probes() reports (`usdt_spec.kind`)."""
    return MEMORY_PROBES[(probe.provider, probe.name)][1]


def memory_sites(probes: list[UsdtProbe], family: bool = False) -> list[UsdtSite]:
    """memory_probes() as the loader attaches them (`family`: as a family's link)."""
    return [UsdtSite(p.file_offset, p.semaphore, pack_spec(p.args, memory_kind(p), family)) for p in probes]
