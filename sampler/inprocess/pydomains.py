"""Where CPython keeps its allocator domains, read from its code: the input of the injected sampler's
Python-object redirection (sampler/inprocess/inject.py).

Python objects of up to 512 bytes come from pymalloc and never reach malloc. Every request goes
through a domain's `PyMemAllocatorEx {ctx, malloc, calloc, realloc, free}`: file-static variables
in 3.10-3.11 (`_PyObject`, `_PyMem`, `_PyMem_Raw` in obmalloc.c), `_PyRuntime.allocators` in 3.12+;
none of them is a symbol of a stripped build. Their addresses are in the code of the exported
entry points instead: `PyObject_Malloc(n)` is `_PyObject.malloc(_PyObject.ctx, n)`, so its first
instructions load the struct's `ctx` and `malloc` fields RIP-relative (with LTO, also as a compare
that inlines pymalloc when the pointer is the default: changing the pointer only skips that).
A domain is the one address A that PyX_Malloc/Calloc/Realloc/Free all load, each with its own
field at A + 8/16/24/32: five loads that agree, which no unrelated code matches by chance. No
per-version table; a build where they do not agree is not redirected (reported, never guessed).

The file is the target's (any process can map a file called *python* that exports PyObject_Malloc),
and decoding it runs capstone, native code: it runs in a child of its own that drops to the
privileges of a uid no process has (decoder_uid), with its memory and CPU bounded, before it reads a byte of the file
(`python -m sampler.inprocess.pydomains FD`), never in the root recorder.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from sampler import environ, files
from sampler.binary.elf import data_slot_values, exported_function
from sampler.binary.reader import PT_LOAD, ElfFormatError, ElfReader, open_regular

if TYPE_CHECKING:
    import capstone

DOMAINS = ("raw", "mem", "obj")
FIELDS = ("ctx", "malloc", "calloc", "realloc", "free")
_ENTRY = {"raw": "PyMem_Raw", "mem": "PyMem_", "obj": "PyObject_"}
_FUNCS = ("Malloc", "Calloc", "Realloc", "Free")
_WINDOW = 128          # bytes decoded at each entry point (the loads come first)


@dataclass(frozen=True)
class Domains:
    """Link-time addresses (add the load bias) of the three domains' PyMemAllocatorEx."""

    raw: int
    mem: int
    obj: int

    def get(self, domain: str) -> int:
        return getattr(self, domain)


def locate(path: str) -> Domains | None:
    """The domains of the CPython in `path` (an executable or libpython), None when it is not one or
    its code does not say (cached by the file's identity). Decoded apart (see the module doc)."""
    try:
        fd = open_regular(path)
    except (OSError, ElfFormatError):
        return None
    try:
        st = os.fstat(fd)
        key = files.identity(st)
        if key not in _found:
            if len(_found) >= 64:
                _found.pop(next(iter(_found)))
            # a file that does not export the entry points (an extension module, most files called
            # *python*) is answered here, by the bounded reader, without starting a child
            _found[key] = _decode_apart(fd) if _exports_entry(fd, path) else None
        return _found[key]
    finally:
        os.close(fd)


_found: dict[tuple, Domains | None] = {}        # by the file's identity


def _exports_entry(fd: int, path: str) -> bool:
    try:
        elf = ElfReader.from_fd(fd, path)
    except (OSError, ElfFormatError):
        return False
    try:
        return exported_function(elf, "PyObject_Malloc") is not None
    except (OSError, ElfFormatError):
        return False
    finally:
        elf.buf.close()


NOBODY = 65534
# The decoder's own uid: one of systemd's dynamic range that no process runs as (neither nobody,
# which the processes it reads may be, and which could then stop or trace it, nor anyone's).
DYNAMIC_UIDS = range(65519, 65519 - 64, -1)
DECODER_AS = 1 << 30            # the decoding child's address space
DECODER_CPU_S = 10
DECODER_TIMEOUT_S = 10.0


def decoder_uid() -> int:
    """A uid of DYNAMIC_UIDS that no process has, real, effective or saved (nobody's when every one
    of them is taken)."""
    taken: set[int] = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status", "rb") as f:
                    line = next((ln for ln in f.read(4096).splitlines() if ln.startswith(b"Uid:")), b"")
                taken.update(int(x) for x in line.split()[1:4])
            except (OSError, ValueError):
                continue
    return next((u for u in DYNAMIC_UIDS if u not in taken), NOBODY)


def _decode_apart(fd: int) -> Domains | None:
    try:
        # it imports as root, then drops to a uid of its own (_decode): the code is found as the recorder's was
        r = subprocess.run(environ.python_module("sampler.inprocess.pydomains", str(fd), str(decoder_uid())),
                           pass_fds=(fd,), capture_output=True, text=True, timeout=DECODER_TIMEOUT_S, cwd="/",
                           env={**environ.worker_environ(), "PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return None
    parts = r.stdout.split()
    if r.returncode != 0 or len(parts) != 3:
        return None
    try:
        return Domains(*(int(x, 16) for x in parts))
    except ValueError:
        return None


def find(elf: ElfReader) -> Domains | None:
    """The domains, read from the code of the exported entry points (in the decoding child)."""
    try:
        if exported_function(elf, "PyObject_Malloc") is None:
            return None
        found = {d: _domain(elf, _ENTRY[d]) for d in DOMAINS}
    except (OSError, ElfFormatError):
        return None
    if None in found.values():
        return None
    return Domains(**found)  # type: ignore[arg-type]


def _domain(elf: ElfReader, prefix: str) -> int | None:
    loads = []
    for f in _FUNCS:
        at = exported_function(elf, prefix + f)
        code = _code(elf, at) if at is not None else None
        if code is None:
            return None
        loads.append(_loads(code, at))
    slots = {x[1] for refs in loads for x in refs if x[0] == "via"}
    values = data_slot_values(elf, slots) if slots else {}
    resolved = [{x[1] if x[0] == "at" else values[x[1]] + x[2] for x in refs if x[0] == "at" or x[1] in values}
                for refs in loads]
    common = set.intersection(*resolved)
    found = [a for a in common if all(a + 8 * (i + 1) in resolved[i] for i in range(4))]
    return found[0] if len(found) == 1 else None


def _code(elf: ElfReader, vaddr: int) -> bytes | None:
    for s in elf.segments:
        if s.type == PT_LOAD and s.vaddr <= vaddr < s.vaddr + s.filesz:
            start = vaddr - s.vaddr
            return elf.read_at(s.offset + start, min(_WINDOW, s.filesz - start))  # the window alone
    return None


@lru_cache(maxsize=1)
def _disassembler() -> capstone.Cs:
    import capstone  # in the decoding child only (the recorder never maps it for this)

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def _full(name: str) -> str:
    """The 64-bit register a register name is part of (eax, ax, al -> rax; r8d -> r8)."""
    if name.startswith("r") and name[1:2].isdigit():
        return name.rstrip("dwb")
    core = name.lstrip("er")
    if core in ("ax", "bx", "cx", "dx", "al", "bl", "cl", "dl", "ah", "bh", "ch", "dh"):
        return f"r{core[0]}x"
    return "r" + core.removesuffix("l")


def _loads(code: bytes, vaddr: int) -> list[tuple]:
    """The memory operands of `code` (decoded linearly up to the first return) whose address is
    known statically: ("at", A) for RIP-relative ones, ("via", S, d) for [reg + d] where reg was
    loaded from the pointer at S (a GOT entry: PIC code reaches _PyRuntime through one)."""
    from capstone import x86_const as x86

    out: list[tuple] = []
    via: dict[str, int] = {}          # register -> the slot it was loaded from
    md = _disassembler()
    for insn in md.disasm(code, vaddr):
        loaded = None
        for op in insn.operands:
            if op.type != x86.X86_OP_MEM or op.mem.index != 0:
                continue
            if op.mem.base == x86.X86_REG_RIP:
                a = insn.address + insn.size + op.mem.disp
                out.append(("at", a))
                if insn.id == x86.X86_INS_MOV and op.size == 8 and insn.operands[0].type == x86.X86_OP_REG:
                    loaded = (_full(md.reg_name(insn.operands[0].reg)), a)
            elif op.mem.base and (r := _full(md.reg_name(op.mem.base))) in via:
                out.append(("via", via[r], op.mem.disp))
        for reg in insn.regs_access()[1]:
            via.pop(_full(md.reg_name(reg)), None)
        if loaded is not None:
            via[loaded[0]] = loaded[1]
        if insn.id == x86.X86_INS_RET:
            break
    return out


def _decode(fd: int, uid: int = NOBODY) -> int:
    """The decoding child: everything imported (as its parent's user: the install may be readable by
    root alone), then the privileges of `uid` (decoder_uid) and bounds, and only then the file behind
    `fd` (opened by the recorder)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    resource.setrlimit(resource.RLIMIT_AS, (DECODER_AS, DECODER_AS))
    resource.setrlimit(resource.RLIMIT_CPU, (DECODER_CPU_S, DECODER_CPU_S))
    try:
        doms = find(ElfReader.from_fd(fd, "target"))
    except (OSError, ElfFormatError):
        doms = None
    if doms is None:
        print("none")
        return 1
    print(f"{doms.raw:x} {doms.mem:x} {doms.obj:x}")
    return 0


if __name__ == "__main__":
    sys.exit(_decode(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else NOBODY))
