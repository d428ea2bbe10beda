"""Which allocator functions to probe in a process, and where.

An allocator library is libc, a known allocator (jemalloc, tcmalloc, mimalloc) or one the user
names; its probe points are the malloc-family functions it defines, placed by
`probe_sites.choose_site`. Two rules keep counts exact:
- symbols at one address (glibc's memalign and aligned_alloc) are probed once;
- a function that itself calls or tail-jumps to another probed function (glibc's reallocarray
  does `jmp realloc@plt`) is not probed: that other probe already sees its bytes;
- except glibc's realloc and memalign family, which hand only some calls to malloc/free
  (realloc(NULL, n), realloc(p, 0), alignment <= 16): they are probed with the `delegates`
  flag, and the BPF entry program leaves exactly those calls to the inner probe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sampler.binary.elf import ElfImage, Symbol
from sampler.bpf.abi import FNF_DELEGATES, Fn
from sampler.probes.plans import PlanCache
from sampler.proc.maps import Mapping, open_path, read_maps
from sampler.proc.process import exe_path

if TYPE_CHECKING:
    from sampler.probes.sites import ProbeSite

# glibc functions that hand some calls to malloc or free (bpf/alloc.bpf.c: delegated()).
MAX_BODY = 1 << 20  # bytes of an allocator entry point read (they run to a few KiB)
GLIBC_DELEGATING = frozenset({Fn.REALLOC, Fn.MEMALIGN, Fn.ALIGNED_ALLOC, Fn.POSIX_MEMALIGN})


# Registers each function's BPF program reads at the probe site (x86-64 SysV arguments).
_READS: dict[Fn, frozenset[str]] = {
    Fn.MALLOC: frozenset({"rdi"}),
    Fn.CALLOC: frozenset({"rdi", "rsi"}),
    Fn.REALLOC: frozenset({"rdi", "rsi"}),
    Fn.REALLOCARRAY: frozenset({"rdi", "rsi", "rdx"}),
    Fn.POSIX_MEMALIGN: frozenset({"rdi", "rdx"}),
    Fn.ALIGNED_ALLOC: frozenset({"rsi"}),
    Fn.MEMALIGN: frozenset({"rsi"}),
    Fn.VALLOC: frozenset({"rdi"}),
    Fn.PVALLOC: frozenset({"rdi"}),
    Fn.NEW: frozenset({"rdi"}),
    Fn.FREE: frozenset({"rdi"}),
    Fn.DELETE: frozenset({"rdi"}),
}

C_NAMES: dict[str, Fn] = {
    "malloc": Fn.MALLOC, "calloc": Fn.CALLOC, "realloc": Fn.REALLOC,
    "reallocarray": Fn.REALLOCARRAY, "posix_memalign": Fn.POSIX_MEMALIGN,
    "aligned_alloc": Fn.ALIGNED_ALLOC, "memalign": Fn.MEMALIGN, "valloc": Fn.VALLOC,
    "pvalloc": Fn.PVALLOC, "free": Fn.FREE,
}
# C++ operators, probed only in allocator libraries that define them (libstdc++'s call malloc).
# Only the nothrow `new` variants: a return probe replaces the return address with the kernel's
# trampoline, which has no unwind information, so a std::bad_alloc thrown through a probed
# throwing `new` would reach std::terminate and kill the target.
CXX_NAMES: dict[str, Fn] = {
    **{n: Fn.NEW for n in (
        "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t", "_ZnwmSt11align_val_tRKSt9nothrow_t",
        "_ZnamSt11align_val_tRKSt9nothrow_t")},
    **{n: Fn.DELETE for n in (
        "_ZdlPv", "_ZdaPv", "_ZdlPvm", "_ZdaPvm", "_ZdlPvSt11align_val_t", "_ZdaPvSt11align_val_t",
        "_ZdlPvmSt11align_val_t", "_ZdaPvmSt11align_val_t", "_ZdlPvRKSt9nothrow_t",
        "_ZdaPvRKSt9nothrow_t")},
}
THROWING_NEW = ("_Znwm", "_Znam", "_ZnwmSt11align_val_t", "_ZnamSt11align_val_t", "tc_new", "tc_newarray")
TCMALLOC_EXTRA: dict[str, Fn] = {
    "tc_new_nothrow": Fn.NEW, "tc_newarray_nothrow": Fn.NEW,
    "tc_delete": Fn.DELETE, "tc_deletearray": Fn.DELETE, "tc_delete_nothrow": Fn.DELETE,
    "tc_deletearray_nothrow": Fn.DELETE, "tc_cfree": Fn.FREE,
}


@dataclass(frozen=True)
class Family:
    """A kind of allocator library: how to recognise it and which names it exports."""

    name: str
    library: re.Pattern[str]          # matched against the library's basename
    prefixes: tuple[str, ...]         # applied to the C names
    cxx: bool


FAMILIES = (
    Family("glibc", re.compile(r"^libc\.so(\.\d+)?$|^libc-2\.\d+\.so$"), ("",), cxx=False),
    Family("jemalloc", re.compile(r"^libjemalloc"), ("", "je_"), cxx=True),
    Family("tcmalloc", re.compile(r"^libtcmalloc"), ("", "tc_"), cxx=True),
    Family("mimalloc", re.compile(r"^libmimalloc"), ("", "mi_"), cxx=True),
)


def parse_allocator_spec(spec: str) -> Family:
    """`NAME[:PREFIX]` from the command line: a library basename prefix and a symbol prefix."""
    name, _, prefix = spec.partition(":")
    if not name:
        raise ValueError(f"allocator spec {spec!r}: expected LIBRARY[:PREFIX], e.g. libjemalloc:je_")
    prefixes = ("", prefix) if prefix else ("",)
    return Family(f"user:{name}", re.compile("^" + re.escape(name)), prefixes, cxx=True)


@dataclass(frozen=True)
class ProbePoint:
    name: str
    fn: Fn
    vaddr: int           # function start in the ELF's address space
    site: ProbeSite
    file_offset: int     # of the probe site, as uprobes want it
    delegates: bool = False

    @property
    def cookie(self) -> int:
        return int(self.fn) | (FNF_DELEGATES if self.delegates else 0)

    @property
    def entry_offset(self) -> int:
        """File offset of the function's entry (where its return probe goes)."""
        return self.file_offset - self.site.offset


@dataclass
class AllocatorLib:
    family: str
    path: str            # as the process sees it
    attach_path: str     # openable from here (container / replaced files)
    build_id: str | None
    points: list[ProbePoint] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)    # (name, why)

    @property
    def allocs(self) -> list[ProbePoint]:
        return [p for p in self.points if not p.fn.frees]

    @property
    def frees(self) -> list[ProbePoint]:
        return [p for p in self.points if p.fn.frees]


def _candidates(image: ElfImage, family: Family) -> dict[str, Fn]:
    names: dict[str, Fn] = {}
    for prefix in family.prefixes:
        for base, fn in C_NAMES.items():
            names[prefix + base] = fn
    if family.cxx:
        names.update(CXX_NAMES)
    if family.name == "tcmalloc":
        names.update(TCMALLOC_EXTRA)
    return {n: fn for n, fn in names.items() if image.symbol(n) is not None}


def own_probes(image: ElfImage, names: Collection[str], skipped: list[tuple[str, str]], *,
               may_forward: Collection[str] = (), sizeless: bool = False) -> Iterator[tuple[Symbol, bytes]]:
    """Of `names` (all defined by `image`), in order, the functions that need a probe of their
    own, with their code; each one left out is appended to `skipped` with the reason.

    Shared by the malloc family and the CUDA layers, so both count a call once: a symbol at the
    address of one already yielded is an alias (its calls reach that probe), and a function that
    calls or tail-jumps to another of `names` is left to that one's probe -- unless it is in
    `may_forward` (it hands only some calls on, and its probe leaves those to the other).
    A symbol of size 0 has no code to check: skipped, or with `sizeless` yielded with b""."""
    # here: its disassembler (capstone, ~9 MiB) only for processes probed with uprobes
    from sampler.probes import sites

    plt = image.plt_targets()
    seen: dict[int, str] = {}
    for name in names:
        sym = image.symbol(name)
        assert sym is not None
        if sym.value in seen:
            skipped.append((name, f"alias of {seen[sym.value]}"))
            continue
        # a symbol's size is the file's word: an entry point's code is read up to MAX_BODY
        body = image.read_vaddr(sym.value, min(sym.size, MAX_BODY)) if sym.size else b""
        if not body and not sizeless:
            skipped.append((name, "no code (size 0)"))
            continue
        others = {n for n in names if n != name}
        called = sites.forwards_to(body, sym.value, plt, image.aliases, others) if body else set()
        if called and name not in may_forward:
            skipped.append((name, f"calls {', '.join(sorted(called))}, which is probed"))
            continue
        seen[sym.value] = name
        yield sym, body


def plan_library(image: ElfImage, family: Family, path: str, attach_path: str) -> AllocatorLib:
    # here: its disassembler (capstone, ~9 MiB) only for processes probed with uprobes
    from sampler.probes import sites

    lib = AllocatorLib(family.name, path, attach_path, image.build_id)
    if family.name == "static" and image.symbol("malloc") is None:
        return lib      # an executable is an allocator only if it defines malloc itself
    names = _candidates(image, family)
    if family.cxx:
        lib.skipped += [(n, "throws: a return probe would break exception unwinding (not probed)")
                        for n in THROWING_NEW if image.symbol(n) is not None]
    delegating = {n for n, fn in names.items() if family.name == "glibc" and fn in GLIBC_DELEGATING}
    for sym, body in own_probes(image, names, lib.skipped, may_forward=delegating):
        name, fn = sym.name, names[sym.name]
        delegates = name in delegating
        frees = fn.frees
        site = sites.choose_site(body, sym.value, reads=_READS[fn], needs_return=not frees,
                           null_skip="rdi" if frees else None)
        off = image.vaddr_to_file_offset(sym.value + site.offset)
        if off is None:
            lib.skipped.append((name, "not in a loadable segment"))
            continue
        lib.points.append(ProbePoint(name, fn, sym.value, site, off, delegates))
    lib.points.sort(key=lambda p: p.fn)
    return lib


plans: PlanCache[AllocatorLib] = PlanCache()


def find_allocators(pid: int, extra: tuple[Family, ...] = ()) -> tuple[list[AllocatorLib], list[Mapping]]:
    """Allocator libraries mapped by `pid`, and the process's maps.

    Plans are cached per file; the attach path is per process (it goes through /proc/PID).
    The main executable is included when it defines malloc itself (a statically linked
    allocator). Raises ProcessLookupError when the process is gone."""
    maps = read_maps(pid)
    families = (*FAMILIES, *extra)
    libs: list[AllocatorLib] = []
    seen: set[tuple] = set()
    exe = exe_path(pid)
    for m in maps:
        ident = (m.dev, m.inode, m.path)
        if not m.path.startswith("/") or ident in seen:
            continue
        seen.add(ident)
        base = os.path.basename(m.path)
        family = next((f for f in families if f.library.search(base)), None)
        if family is None and m.path == exe:
            family = Family("static", re.compile(""), ("",), cxx=True)
        if family is None:
            continue
        attach = open_path(pid, m)
        plan = plans.get((ident, family.name), attach,
                         lambda image, f=family, m=m, a=attach: plan_library(image, f, m.path, a))
        if plan is not None and plan.points:
            libs.append(replace(plan, attach_path=attach))
    return libs, maps
