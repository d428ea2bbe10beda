"""Attach at in-process cost: the preload shim's sampling placed into a running process, no restart.

1. Placement (place.c, a separate helper process): one thread is stopped with PTRACE_SEIZE +
   PTRACE_INTERRUPT and executes memfd_create, mmap and close at a `syscall` instruction of its
   vDSO; the sampler's code (inject.c, built freestanding) goes into the memfd, mapped private and
   read+exec (uprobes can sit in it), its data anonymous right after; the thread gets its
   registers back and runs on. No code of ours runs in the target, no thread, no file in its
   namespace, no dlopen.
2. Configuration: the data (`inj`, inject_abi.h; its Python side: abi.py) is written through
   /proc/PID/mem: the functions to forward to, the sampling mean and cap, the vDSO's clock. Its
   magic is written last.
3. The recorder attaches its otel_memory USDT program to the sampler's probe sites (the preload
   tier's path: same events, same stacks, same Parquet), then
4. Redirection: each GOT slot of the process's objects that binds to the allocator's malloc family
   gets the sampler's function, by one aligned 8-byte compare-and-exchange that a thread of the
   process executes (the helper stops it and runs the sampler's inj_store_run: place.c `store`), so
   a concurrent call sees the old or the new function, never a mix (a copy through /proc/PID/mem is
   a string move and tears on some CPUs; tests/inprocess/test_inject.py measures both). Objects loaded later
   are redirected when they appear.
Detaching restores every slot that still holds our function. The code stays mapped (a thread may be
between loading a slot and returning from it, and copies of slots taken as function pointers keep
calling in): it keeps forwarding correctly for the process's life, its probe sites trap for nobody.
A later recorder adopts it instead of placing a second, only when this host placed it: the placement
is recorded (pid, start time, memfd inode, base) in a root-only directory, and the whole code span
must still be ours. While a recorder records a process with its sampler it holds that process's
lease (a lock beside the record, released by the kernel when the recorder dies): a second recorder
(a daemon's rule that matches a process an engineer records) is refused until the first ends,
rather than reconfiguring the sampler and restoring its slots under the first.

Everything read from the target (its maps, its files, its memory, the helper's remote calls) is
checked before it is used, and nothing root writes can land in another image: the process's memory
is opened once per injection, after its (pid, start time) is checked, and kept (the kernel binds the
descriptor to that image: after an exec or exit every access fails); every word of the process is
written by compare-and-exchange in a thread of the image the helper verified; a slot is redirected
only when it holds the allocator's function (or its own lazy-binding stub), and restored only while
it still holds ours, and never on exit, pid reuse or exec (docs/security.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sampler import files
from sampler.binary.elf import SHT_RELA, ElfImage, dynsym_entry, exported_function, import_slots
from sampler.binary.reader import PT_LOAD, ElfFormatError, ElfReader
from sampler.errors import EnvironmentProblem
from sampler.inprocess import build as builder
from sampler.inprocess import helper as helper_runs
from sampler.inprocess import pydomains
from sampler.inprocess.abi import (
    FUNCTIONS,
    INJ_DATA,
    INJ_DATA_OFFSET,
    INJ_MAGIC,
    INJ_PY_ALLOCATOR,
    INJ_STORE_AFTER_OK,
    INJ_STORE_OPS,
    INJ_VERSION,
    PY_DOMAINS,
    SMP_PROCESS,
)
from sampler.probes.allocators import FAMILIES
from sampler.proc.maps import Mapping, open_path, read_maps
from sampler.proc.process import read_stat

MEMFD_NAME = "/memfd:allocsampler"
PLACE_WAIT_S = helper_runs.PLACE_WAIT_S


class Refused(Exception):
    """Injection is impossible or refused for this process: the message says why, in one line.
    `transient`: it may work a moment later (an image that an exec has not finished mapping)."""

    def __init__(self, why: str, transient: bool = False):
        super().__init__(why)
        self.transient = transient


def built() -> tuple[Path, Path]:
    """(the sampler's code file, the placement helper): prebuilt, or built in a checkout."""
    return builder.path(builder.SAMPLER), builder.path(builder.PLACE)


@dataclass(frozen=True)
class CodeLayout:
    """Where things are in the built sampler (its own ELF, trusted: we built it)."""

    path: Path
    code_span: int                  # the code mapping (INJ_DATA_OFFSET)
    total_span: int                 # code + data
    data: int                       # `inj`, relative to the base
    table: int                      # `inj_table`
    entries: dict[str, int]         # as_* functions
    py_code: tuple[int, int]        # [start, end) of CPython's wrappers (.inj_py), relative to the base
    store_entry: int                # inj_store_run: the writes a stopped thread makes (place.c `store`)
    store: int                      # inj_store, its request and stack
    syscall_at: int                 # the `syscall` instruction those writes' mprotect runs at

    @classmethod
    def of(cls, path: Path) -> CodeLayout:
        img = ElfImage.open(str(path))
        elf = ElfReader.open(str(path))
        data_end = max(s.vaddr + s.memsz for s in elf.segments if s.type == PT_LOAD)
        entries = {}
        for name in (*FUNCTIONS, *(f"py_{d}_{f}" for d in PY_DOMAINS for f in ("malloc", "calloc", "realloc", "free"))):
            sym = img.symbol(f"as_{name}")
            if sym is None:
                raise EnvironmentProblem(f"{path} lacks as_{name}: rebuild it (python -m sampler.inprocess)")
            entries[name] = sym.value
        data, table = img.symbol("inj"), img.symbol("inj_table")
        if data is None or table is None or path.stat().st_size > INJ_DATA_OFFSET:
            raise EnvironmentProblem(f"{path} is not a sampler this recorder knows: rebuild it")
        py = elf.section(".inj_py")
        if py is None:
            raise EnvironmentProblem(f"{path} lacks .inj_py: rebuild it (python -m sampler.inprocess)")
        if any(s.type == SHT_RELA and s.file_size for s in elf.sections):
            raise EnvironmentProblem(f"{path} has relocations, which nothing would apply in the target: "
                                     "rebuild it (python -m sampler.inprocess)")
        run, store, sys3 = (img.symbol(n) for n in ("inj_store_run", "inj_store", "inj_syscall3"))
        if run is None or store is None or sys3 is None:
            raise EnvironmentProblem(f"{path} lacks inj_store_run: rebuild it (python -m sampler.inprocess)")
        text = path.read_bytes()
        syscall_at = text.find(b"\x0f\x05", sys3.value, sys3.value + 32)
        return cls(path, INJ_DATA_OFFSET, (data_end + 4095) & ~4095, data.value, table.value, entries,
                   (py.addr, py.addr + py.size), run.value, store.value, syscall_at)


@dataclass
class Slot:
    addr: int
    name: str
    original: int                   # what it held (the function, or its object's lazy stub)
    path: str                       # the object it belongs to


@dataclass
class _Write:
    """One word to change in the process: written only while it holds `expected`."""

    addr: int
    expected: int
    value: int
    after_ok: bool = False          # only when the write before it was made
    done: Callable[[], None] | None = None   # what the recorder notes once it is made


class StoreFailed(OSError):
    """The helper wrote nothing (the process is gone, another image, no thread to stop...)."""


@dataclass
class Injection:
    """The sampler in one process, and the slots it redirects. `mem` is the process's memory as
    opened when (pid, start) was checked: bound to that image, used for reads and for the
    sampler's own data; the process's words are changed only by `store` (compare-and-exchange in
    a thread of the image that holds our code)."""

    pid: int
    start: int                      # the process's start time (/proc/PID/stat): with the pid, its identity
    base: int
    layout: CodeLayout
    originals: dict[str, int]
    mem: _Memory
    adopted: bool = False
    stop_ns: int | None = None      # how long the placing thread was stopped
    inode: int = 0                  # the sampler's memfd (a fork's child maps the same one)
    inherited: bool = False         # the sampler came with a fork of a process it was placed in
    slots: dict[int, Slot] = field(default_factory=dict)
    symbols: dict[int, Slot] = field(default_factory=dict)   # the allocator's .dynsym values we changed
    seen: set[tuple] = field(default_factory=set)      # objects looked at (dev, inode, path)
    imports: dict[tuple, list[tuple[int, str]]] = field(default_factory=dict)   # their slots, per file
    biases: dict[tuple, int | None] = field(default_factory=dict)
    symbol_plan: list[tuple[int, str, int, str, int]] | None = None
    skipped: list[str] = field(default_factory=list)   # why some slots were left alone
    py_fields: dict[int, Slot] = field(default_factory=dict)  # CPython allocator-domain fields we changed
    python: tuple | str | None = None   # the process's CPython (_find_python), "" when none, None: not looked
    news: list[str] = field(default_factory=list)      # what the recorder should say (drained by it)
    python_objects: bool = False    # redirect CPython's object and mem domains (_redirect_python)
    said: set[str] = field(default_factory=set)
    stores: int = 0                 # helper runs that changed the process's words
    store_ns: int = 0               # how long their threads were stopped, in all
    allocator_label: str = ""       # `allocator`, once found (a fork's child inherits it)
    # CLOCK_MONOTONIC (BPF's clock) once the last change to the process was made: a fork before it
    # may lack the sampler or some slots, so its child is not a copy of this state
    changed_ns: int = 0
    held: bool = False              # the process is stopped by the recorder (a command it started): the
                                    # helper works in that stop (place.c --held)
    verified: bool = True           # the whole code checked at base in the image `mem` reads (a fork's
                                    # child: before the first write of ours, since it may have exec'd)
    lease: _Lease | None = None     # this recorder's hold on (pid, start): no other recorder adopts it

    @property
    def allocator(self) -> str:
        """`family:path` of the library the sampler forwards malloc to (as `targets.allocators` says)."""
        if self.allocator_label:
            return self.allocator_label
        with contextlib.suppress(OSError, ProcessLookupError):
            m = next((x for x in read_maps(self.pid) if x.start <= self.originals["malloc"] < x.end), None)
            if m is not None:
                base = os.path.basename(m.path)
                family = next((f.name for f in FAMILIES if f.library.search(base)), "other")
                self.allocator_label = f"{family}:{m.path}"
                return self.allocator_label
        return "unknown"

    def owns(self, addr: int) -> bool:
        """`addr` lies in the sampler's own mappings (code and data)."""
        return self.base <= addr < self.base + self.layout.total_span

    def under_python_wrapper(self, pcs) -> bool:
        """A stack (return addresses) passes through CPython's wrappers: a mapping made there is
        pymalloc's arena, which holds objects sampled as such."""
        lo, hi = self.base + self.layout.py_code[0], self.base + self.layout.py_code[1]
        return any(lo <= pc <= hi for pc in pcs)

    def wrapper(self, name: str) -> int:
        return self.base + self.layout.entries[name]

    def close(self) -> None:
        self.mem.close()
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def forked(self, pid: int) -> Injection:
        """The same sampler in `pid`, which the kernel's fork event says was forked from this
        process: its memory is a copy of this one's at the fork (sampler, its data and every slot
        written so far), so nothing is read again or written; what differs later (a dlopen, an
        exec) its own rescans and exec handling see, and each of its writes is still a
        compare-and-exchange checked against our code at `base`. Its memory is opened, then its
        identity read: a pid reused in between is another process's, whose parent is not this one
        (and the memory opened is then that of a process gone: every access fails); a child whose
        parent exited meanwhile (a daemon's double fork) was reparented. Raises
        ProcessLookupError when it is gone."""
        try:
            mem = _Memory(pid)
        except OSError:
            raise ProcessLookupError(pid) from None
        st = read_stat(pid)
        if st is None or st.start < self.start or (st.ppid != self.pid and _alive(self.pid, self.start)):
            mem.close()
            raise ProcessLookupError(pid)
        try:
            lease = _Lease.take(pid, st.start)
        except Refused:
            mem.close()
            raise ProcessLookupError(pid) from None     # another recorder's already: not ours to record
        return replace(self, pid=pid, start=st.start, mem=mem, lease=lease, adopted=True, inherited=True, stop_ns=None,
                       slots=dict(self.slots), symbols=dict(self.symbols), seen=set(self.seen),
                       imports=dict(self.imports), biases=dict(self.biases), skipped=list(self.skipped),
                       py_fields=dict(self.py_fields), news=[], said=set(self.said), stores=0, store_ns=0,
                       held=False, verified=False)

    def redirect(self) -> int:
        """Redirect the slots of objects not looked at yet; returns how many slots changed. An object
        still being loaded (its data not mapped, or not relocated yet) is looked at again next time.
        The first call also points the allocator's exported symbols at the sampler, so that objects
        loaded later (dlopen) bind to it from their first call, before any rescan. All of a call's
        writes are made in one stop of one thread."""
        maps = read_maps(self.pid)
        owner = self._owner_of_malloc(maps)
        writes: list[_Write] = []
        looked: list[tuple] = []
        if not self.symbols:
            self._bind_symbols(maps, writes)
        for obj, bias, m in _objects(self.pid, maps, self.biases):
            if obj in self.seen:
                continue
            if m.path.startswith(MEMFD_NAME) or _is_loader(m.path) \
                    or (obj == owner and "libc.so" not in os.path.basename(m.path)):
                self.seen.add(obj)  # the allocator's own calls stay inside it (glibc's: see docs)
                continue
            found = self._imports(obj, m)
            if found is None:
                self.seen.add(obj)
                continue
            own = [(x.start, x.end) for x in maps if (x.dev, x.inode, x.path) == obj]
            planned: list[_Write] = []
            try:
                ready = all([self._redirect_one(bias + off, name, m.path, own, planned) for off, name in found])
            except OSError:
                continue            # its data is not mapped yet
            writes += planned
            if ready:
                looked.append(obj)
        if not self.held:                   # at its entry point CPython has not set its allocators yet
            writes += self._redirect_python(maps)
        changed = self.store(writes)
        self.seen.update(looked)
        return changed

    def store(self, writes: list[_Write]) -> int:
        """Makes the writes (each while its word holds what it expected); returns how many were
        made, after noting each. Raises StoreFailed when the helper made none."""
        made = 0
        for i in range(0, len(writes), INJ_STORE_OPS):
            chunk = writes[i:i + INJ_STORE_OPS]
            answers = _store(self, chunk)
            self.changed_ns = time.monotonic_ns()
            for w, (_seen, done) in zip(chunk, answers, strict=True):
                if done:
                    made += 1
                    if w.done is not None:
                        w.done()
        return made

    def copied_by(self, fork_ns: int) -> bool:
        """A fork made at `fork_ns` (CLOCK_MONOTONIC, as BPF stamps it) copied this state: the
        sampler and every slot changed so far."""
        return self.changed_ns <= fork_ns

    def _redirect_python(self, maps: list[Mapping]) -> list[_Write]:
        """CPython's object and mem domains (pymalloc) go through the sampler's as_py_* functions:
        their small objects never reach malloc. Each field is written only while it holds what was
        read (free first, malloc last, each only once the one before it was written, so that
        nothing is sampled before its free is seen); a domain that is hooked (tracemalloc,
        PYTHONMALLOC=debug, an embedder's allocator) or backed by malloc (PYTHONMALLOC=malloc:
        sampled there) is left alone. Looked at on every rescan: an interpreter that was starting
        sets its allocators once more."""
        if self.python is None:
            self.python = self._find_python(maps) or ""
        if not self.python:
            return []
        mem = self.mem
        path, bias, doms, own = self.python
        raw = _fields(mem, bias + doms.raw)
        writes: list[_Write] = []
        adopted, placing = [], []
        for i, name in enumerate(PY_DOMAINS):
            addr = bias + doms.get(name)
            cur = _fields(mem, addr)
            ours = [self.wrapper(f"py_{name}_{f}") for f in pydomains.FIELDS[1:]]
            keep = self.base + self.layout.data + INJ_DATA.offsets["py"] + i * INJ_PY_ALLOCATOR.struct.size
            if any(v in ours for v in cur[1:]):
                if cur[1:] == ours and addr + 8 not in self.py_fields:     # an earlier recorder's
                    saved = _fields(mem, keep)
                    if saved[0] == cur[0] and all(_within(own, v) for v in saved[1:]):
                        for j, f in enumerate(pydomains.FIELDS[1:], 1):
                            self.py_fields[addr + 8 * j] = Slot(addr + 8 * j, f"py_{name}_{f}", saved[j], path)
                        adopted.append(name)
                continue
            if not self.python_objects:
                continue
            for j in range(1, 5):                       # Python set this domain since: none of it is ours
                self.py_fields.pop(addr + 8 * j, None)
            if cur[0] != 0:
                self._say(f"CPython's {name} allocator is hooked (tracemalloc, PYTHONMALLOC=debug or an "
                          "embedder's): its objects are sampled only when they reach malloc")
                continue
            if cur[1] == raw[1] or not all(_within(own, v) for v in cur[1:]):
                continue                                # malloc-backed (sampled there), or not CPython's own
            self.check_ours()
            mem.write(keep, struct.pack("<5Q", *cur))   # the sampler's own data: what it forwards to
            for k, j in enumerate((4, 3, 2, 1)):        # free, realloc, calloc, malloc
                f = pydomains.FIELDS[j]
                slot = Slot(addr + 8 * j, f"py_{name}_{f}", cur[j], path)
                writes.append(_Write(slot.addr, cur[j], self.wrapper(slot.name), after_ok=k > 0,
                                     done=lambda s=slot: self.py_fields.__setitem__(s.addr, s)))
            placing.append(name)
        if adopted and not self.python_objects:         # adopted from a recorder that sampled them
            self.store(self._restore_python())
            adopted = []
        done = adopted + placing
        if done:
            self._say(f"CPython objects sampled in the {' and '.join(done)} domain{'s' * (len(done) > 1)} ({path})")
        elif not self.python_objects:
            self._say("CPython objects are not sampled apart from malloc (--python-objects samples them; "
                      "optimised CPython builds inline pymalloc only while it is the domain's allocator: "
                      "an allocation-heavy Python loop ran ~10% slower, docs/performance.md)")
        return writes

    def _restore_python(self) -> list[_Write]:
        """The domains' fields that hold our functions get back CPython's (malloc first, free last:
        see _redirect_python)."""
        order = {"malloc": 0, "calloc": 1, "realloc": 2, "free": 3}
        fields = sorted(self.py_fields.values(), key=lambda x: order[x.name.rsplit("_", 1)[1]])
        self.py_fields.clear()
        return [_Write(s.addr, self.wrapper(s.name), s.original) for s in fields]

    def _find_python(self, maps: list[Mapping]) -> tuple | None:
        """(path, bias, domains, its code ranges) of the process's CPython, None without one (or one
        whose objects are not pymalloc's: the reason is said)."""
        for obj, bias, m in _objects(self.pid, maps, self.biases):
            if not _may_be_python(m.path):
                continue
            doms = pydomains.locate(open_path(self.pid, m))
            if doms is None:
                continue
            why = _pymalloc_setting(self.pid)
            if why:
                self._say(f"CPython objects are not sampled apart from malloc ({why})")
                return None
            own = [(x.start, x.end) for x in maps if (x.dev, x.inode, x.path) == obj and x.executable]
            return m.path, bias, doms, own
        return None

    def _say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            self.news.append(line)

    def _redirect_one(self, addr: int, name: str, path: str, own: list[tuple[int, int]],
                      writes: list[_Write]) -> bool:
        """Plans the slot's redirection (a write noted in self.slots once made); False when it is not
        relocated yet (the object is looked at again next time)."""
        if addr % 8 or addr in self.slots or name not in self.originals:
            return True
        value = self.mem.u64(addr)
        wrapper = self.wrapper(name)
        if value == wrapper:                        # redirected by an earlier recorder: ours now
            self.slots[addr] = Slot(addr, name, self.originals[name], path)
            return True
        lazy = any(lo <= value < hi for lo, hi in own)
        if value != self.originals[name] and not lazy:
            if value < 1 << 32:
                return False                        # not relocated yet (0, or a link-time offset)
            self.skipped.append(f"{name} in {os.path.basename(path)} is bound to {value:#x}, not the allocator")
            return True
        slot = Slot(addr, name, value, path)
        writes.append(_Write(addr, value, wrapper, done=lambda: self.slots.__setitem__(addr, slot)))
        return True

    def _imports(self, obj: tuple, m: Mapping) -> list[tuple[int, str]] | None:
        """The object's slots for our functions (read from its file once); None: not readable."""
        if obj not in self.imports:
            try:
                self.imports[obj] = import_slots(ElfReader.open(open_path(self.pid, m)), set(FUNCTIONS))
            except (OSError, ElfFormatError):
                return None
        return self.imports[obj]

    def _bind_symbols(self, maps: list[Mapping], writes: list[_Write]) -> None:
        """The allocator's .dynsym values (st_value, relative to its load bias) of each function we
        redirect become our function's: the dynamic linker binds every later lookup, a dlopen'ed
        object's relocations and a lazy slot's first call alike, to the sampler. Checked against the
        file and the resolved function before anything is written."""
        if self.symbol_plan is None:
            self.symbol_plan = self._plan_symbols(maps)
        for addr, name, value, path, bias in self.symbol_plan:
            ours = (self.wrapper(name) - bias) % (1 << 64)
            slot = Slot(addr, name, value, path)
            with contextlib.suppress(OSError):
                cur = self.mem.u64(addr)
                if cur == ours:
                    self.symbols[addr] = slot
                elif cur == value:
                    writes.append(_Write(addr, value, ours, done=lambda s=slot: self.symbols.__setitem__(s.addr, s)))

    def _plan_symbols(self, maps: list[Mapping]) -> list[tuple[int, str, int, str, int]]:
        """(address of st_value, name, its value in the file, path, bias) for each function's entry."""
        plan = []
        objects = list(_objects(self.pid, maps, self.biases))
        for name in FUNCTIONS:
            target = self.originals.get(name)
            holder = next((x for x in maps if target is not None and x.start <= target < x.end), None)
            obj = next(((o, b, m) for o, b, m in objects
                        if holder is not None and o == (holder.dev, holder.inode, holder.path)), None)
            if obj is None:
                continue
            _o, bias, m = obj
            with contextlib.suppress(OSError, ElfFormatError):
                entry = dynsym_entry(ElfReader.open(open_path(self.pid, m)), name)
                if entry is not None and bias + entry[1] == target and (bias + entry[0]) % 8 == 0:
                    plan.append((bias + entry[0], name, entry[1], m.path, bias))
        return plan

    def restore(self) -> int:
        """The allocator's symbols, then every slot that holds our function (also those of objects
        that bound to it through our symbols), get back what they held, each only while it holds
        ours; returns how many slots. Only for a process that goes on in the same image: never on
        exit, pid reuse or exec (the helper refuses an image without our code anyway)."""
        try:
            self._find_slots()
        except (OSError, ProcessLookupError):
            return 0                                # the process is gone: nothing to restore
        writes = self._restore_python()
        for s in self.symbols.values():
            bias = next((b for a, _n, _v, _p, b in self.symbol_plan or () if a == s.addr), None)
            if bias is not None:
                writes.append(_Write(s.addr, (self.wrapper(s.name) - bias) % (1 << 64), s.original))
        restored = [0]

        def counted() -> None:
            restored[0] += 1
        writes += [_Write(s.addr, self.wrapper(s.name), s.original, done=counted) for s in self.slots.values()]
        self.slots.clear()
        self.symbols.clear()
        self.python = None
        self.seen.clear()
        try:
            self.store(writes)
        except StoreFailed:
            return 0                                # nothing written (gone, exec'd, no thread to stop)
        return restored[0]

    def _find_slots(self) -> None:
        """Slots that hold one of our functions without our having written them (objects loaded since
        the last redirect, bound through our symbols): they get the allocator's function back too."""
        wrappers = {self.wrapper(n): n for n in FUNCTIONS}
        maps = read_maps(self.pid)
        for obj, bias, m in _objects(self.pid, maps, self.biases):
            if obj in self.seen or m.path.startswith(MEMFD_NAME) or _is_loader(m.path):
                continue                # (the objects we redirected: their slots are in self.slots)
            for off, name in self._imports(obj, m) or ():
                addr = bias + off
                with contextlib.suppress(OSError):
                    if addr not in self.slots and name in self.originals and wrappers.get(self.mem.u64(addr)) == name:
                        self.slots[addr] = Slot(addr, name, self.originals[name], m.path)

    def set_mean(self, mean: int) -> None:
        """The sampling mean from now on (the recorder's sample-rate control, pre-OOM capture); the
        sampler's own cap may raise it again. Gaps drawn before keep their mean and their weights.
        Written into the sampler's own data of the image it was placed in (a mean read half-written
        only skews one gap's length: each gap's weight uses the mean it was drawn with)."""
        data = self.base + self.layout.data
        proc = data + INJ_DATA.offsets["proc"]
        self.check_ours()
        if self.mem.u64(data + INJ_DATA.offsets["magic"]) != INJ_MAGIC:
            raise StoreFailed(f"the sampler at {self.base:#x} is gone from process {self.pid}")
        self.mem.write_u64(proc + SMP_PROCESS.offsets["base_mean"], mean)
        self.mem.write_u64(proc + SMP_PROCESS.offsets["cur_mean"], mean)

    def check_ours(self) -> None:
        """Before root writes into the sampler's data through `mem`: the whole code is ours at base in
        the image `mem` reads (a fork's child may have exec'd before its memory was opened). Raises
        StoreFailed."""
        if not self.verified:
            if not _same_code(self.mem, self.base, self.layout):
                raise StoreFailed(f"the sampler's code is not at {self.base:#x} in process {self.pid} (another "
                                  "image): nothing written")
            self.verified = True

    def counters(self) -> dict[str, int]:
        """The sampler's own counts (smp_process), read from the process."""
        raw = self.mem.read(self.base + self.layout.data + INJ_DATA.offsets["proc"], SMP_PROCESS.struct.size)
        return dict(zip((n for n, _ in SMP_PROCESS.fields), SMP_PROCESS.struct.unpack(raw), strict=True))

    def _owner_of_malloc(self, maps: list[Mapping]) -> tuple | None:
        m = next((x for x in maps if x.file_backed and x.start <= self.originals.get("malloc", 0) < x.end), None)
        return (m.dev, m.inode, m.path) if m is not None else None


def inject(pid: int, sample_mean: int, max_samples_per_s: int, python_objects: bool = False,
           parent: tuple[int, int] | None = None, held: bool = False) -> Injection:
    """Place (or adopt) the sampler in `pid` and configure it; the slots are redirected by
    Injection.redirect(), once the recorder's probes are on the sampler (CPython's object allocator
    too with `python_objects`). `parent`: (base, memfd inode) of the sampler in the process the
    kernel's fork event says `pid` was forked from: a sampler there is the inherited one, adopted
    without a placement. `held`: the recorder stopped the process itself (SIGSTOP), a command it
    started, at its entry point; the helper places into that stop. Raises Refused."""
    code, helper = built()
    layout = CodeLayout.of(code)
    st = read_stat(pid)
    if st is None:
        raise Refused("the process exited")
    lease = _Lease.take(pid, st.start)
    try:
        mem = _Memory(pid)
    except OSError as e:
        lease.release()
        raise Refused(f"its memory cannot be opened ({e.strerror})") from None
    try:
        again = read_stat(pid)
        if again is None or again.start != st.start:
            raise Refused("the process exited")     # the memory opened is another process's
        try:
            maps = read_maps(pid)
        except ProcessLookupError:
            raise Refused("the process exited") from None
        originals = _originals(pid, maps, mem)
        if "malloc" not in originals or "free" not in originals:
            raise Refused("no dynamically linked malloc and free to redirect (a static binary, or an allocator "
                          "this recorder does not know)", transient=True)
        found = _existing(pid, st.start, maps, layout, mem, parent)
        if found is None:
            base, stop_ns, inode = place(pid, helper, layout, st.start, held)
            _placed(pid, st.start, base, inode)
            with _PLACED_LOCK:                  # placements run in threads beside the loop
                _PLACED_HERE[(pid, st.start, base, inode)] = stop_ns
                while len(_PLACED_HERE) > PLACED_MAX:
                    del _PLACED_HERE[next(iter(_PLACED_HERE))]
        else:
            base, inode = found
            # placed by this recorder for an image whose exec event it had not read yet: not adopted
            stop_ns = _PLACED_HERE.get((pid, st.start, base, inode))
        adopted = found is not None and stop_ns is None
        inj = Injection(pid, st.start, base, layout, originals, mem, adopted=adopted, stop_ns=stop_ns,
                        inode=inode, inherited=adopted and parent == (base, inode),
                        python_objects=python_objects, held=held, lease=lease)
        _configure(inj, sample_mean, max_samples_per_s, maps)
        inj.changed_ns = time.monotonic_ns()
        if not held:                                # now (its code is decoded apart): redirect() is quick
            inj.python = inj._find_python(maps) or ""
    except BaseException:
        mem.close()
        lease.release()
        raise
    return inj


# -- the steps ------------------------------------------------------------------------------------

def place(pid: int, helper: Path, layout: CodeLayout, start: int, held: bool = False) -> tuple[int, int, int]:
    """Map a new sampler into `pid` (started at `start`) with the placement helper (no
    configuration, no redirection: inject() does those; scripts/bench_overhead.py times
    placements with it). Returns (its base, how long the thread was stopped in ns, the memfd's
    inode). Raises Refused."""
    try:
        parts = helper_runs.run([str(helper), *(["--held"] if held else []), "place", str(pid), str(start),
                                 str(layout.path), hex(layout.code_span), hex(layout.total_span)], pid)[0].split()
    except helper_runs.HelperError as e:
        raise Refused(str(e)) from None
    if len(parts) != 6:
        raise Refused(f"the placement helper answered {' '.join(parts)[:80]!r}")
    return int(parts[1], 16), int(parts[3]), int(parts[4])


def _store(inj: Injection, writes: list[_Write]) -> list[tuple[int, bool]]:
    """(what each word held, whether it was written), in one stop of one thread of the process."""
    if not writes:
        return []
    _code, helper = built()
    lay = inj.layout
    ops = "".join(f"{w.addr:x} {w.expected:x} {w.value:x} {INJ_STORE_AFTER_OK if w.after_ok else 0:x}\n"
                  for w in writes)
    try:
        argv = [str(helper), *(["--held"] if inj.held else []), "store", str(inj.pid), str(inj.start), str(lay.path),
                hex(inj.base), hex(lay.store_entry), hex(lay.store), hex(lay.syscall_at)]
        lines = helper_runs.run(argv, inj.pid, ops)
    except helper_runs.HelperError as e:
        raise StoreFailed(str(e)) from None
    if len(lines) != len(writes) + 1:
        raise StoreFailed(f"the placement helper answered {len(lines) - 1} of {len(writes)} writes")
    inj.stores += 1
    inj.store_ns += int(lines[0].split()[2])
    return [(int(seen, 16), done == "1") for seen, done in (ln.split() for ln in lines[1:])]


def _state_dir() -> Path | None:
    """Where this host notes the samplers it placed (root-only; under /run: a boot's pids)."""
    return files.private_dir(Path(os.environ.get("ALLOCSAMPLER_RUN_DIR") or "/run/allocsampler") / "placed")


PLACED_MAX = 4096
_PLACED_HERE: dict[tuple[int, int, int, int], int] = {}   # (pid, start, base, inode): how long it stopped
_PLACED_LOCK = threading.Lock()


def _placed(pid: int, start: int, base: int, inode: int) -> None:
    """Notes a placement (what _existing will adopt); records of processes gone are dropped."""
    d = _state_dir()
    if d is None:
        return
    with contextlib.suppress(OSError):
        names = os.listdir(d)
        for name in names[:PLACED_MAX] if len(names) >= PLACED_MAX // 2 else ():
            p, _, s = name.removesuffix(LEASE_SUFFIX).partition("-")
            st = read_stat(int(p)) if p.isdigit() else None
            if st is None or str(st.start) != s:
                with contextlib.suppress(OSError):
                    os.unlink(d / name)
        files.write_atomic(d / f"{pid}-{start}", json.dumps({"base": base, "inode": inode}).encode(), 0o600)


LEASE_SUFFIX = ".lease"
_LEASES: dict[tuple[int, int], tuple[int, Path, list[int]]] = {}    # (pid, start): descriptor, file, [holders]


class _Lease:
    """This recorder's hold on a process's sampler: an exclusive flock on `{pid}-{start}.lease` in
    the placements' directory, shared by this recorder's Injections of that process (a re-placement
    after an exec that was not read yet, a fork's child) and released with the last of them, or by
    the kernel when the recorder dies (a later recorder then adopts the sampler)."""

    def __init__(self, key: tuple[int, int] | None):
        self.key = key

    @classmethod
    def take(cls, pid: int, start: int) -> _Lease:
        """Raises Refused (transient: tried again later) when another recorder holds it."""
        key = (pid, start)
        d = _state_dir()
        if d is None:
            return cls(None)                # nowhere to note placements: nothing is adopted either
        with _PLACED_LOCK:
            if (held := _LEASES.get(key)) is not None:
                held[2][0] += 1
                return cls(key)
            path = d / f"{pid}-{start}{LEASE_SUFFIX}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError:
                return cls(None)            # (a full /run) placement notes fail the same way: none adopted
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # a holder that released it unlinked it first: the lock of a file still at the path
                if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                    raise BlockingIOError
            except OSError:
                os.close(fd)
                raise Refused("another allocsampler recording records it with its in-process sampler: not "
                              "touched until that recording ends", transient=True) from None
            _LEASES[key] = (fd, path, [1])
            return cls(key)

    def release(self) -> None:
        key, self.key = self.key, None
        if key is None:
            return
        with _PLACED_LOCK:
            held = _LEASES.get(key)
            if held is None:
                return
            fd, path, holders = held
            holders[0] -= 1
            if holders[0] > 0:
                return
            del _LEASES[key]
            with contextlib.suppress(OSError):
                os.unlink(path)             # before the unlock: a waiter's lock of it is then refused
            os.close(fd)


def _existing(pid: int, start: int, maps: list[Mapping], layout: CodeLayout, mem: _Memory,
              parent: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(base, memfd inode) of a sampler an earlier recorder of this host placed in this process
    (its record: same start time, memfd inode and base) or in the parent it was forked from (the
    parent's base and memfd: a fork keeps both); its whole code ours (a different build is refused
    rather than mixed with). A sampler this host did not place is refused: its base would steer
    every later write."""
    for m in maps:
        if not (m.path.startswith(MEMFD_NAME) and m.offset == 0 and m.executable):
            continue
        with contextlib.suppress(OSError):
            if mem.u64(m.start + layout.data) != INJ_MAGIC:
                continue
        ours = (m.start, m.inode)
        noted = _noted(pid, start) == ours
        # A fork keeps the parent's mappings; no other process can map that memfd without its fd.
        forked = not noted and (parent == ours or _noted_parent(pid) == ours)
        if not noted and not forked:
            raise Refused("a sampler that this host did not place is in the process (a forged or foreign "
                          "memfd called allocsampler): not adopted")
        if not _same_code(mem, m.start, layout):
            raise Refused("an earlier recorder's sampler of another build is in the process; restart it "
                          "to replace it, or record with --attach-mode uprobe")
        if forked:
            _placed(pid, start, *ours)          # its own children, and later recorders, find it noted
        return ours
    return None


def _alive(pid: int, start: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.start == start


def _noted(pid: int, start: int) -> tuple[int, int] | None:
    """(base, memfd inode) of the sampler this host noted placing in (pid, start)."""
    d = _state_dir()
    try:
        note = json.loads(files.read_private(d / f"{pid}-{start}", 4096)) if d is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or not isinstance(note.get("base"), int) or not isinstance(note.get("inode"), int):
        return None
    return note["base"], note["inode"]


def _noted_parent(pid: int) -> tuple[int, int] | None:
    """_noted of the process's parent (the kernel's ppid: forked before the recording began)."""
    st = read_stat(pid)
    parent = read_stat(st.ppid) if st is not None and st.ppid > 1 else None
    return _noted(st.ppid, parent.start) if st is not None and parent is not None else None


def _same_code(mem: _Memory, base: int, layout: CodeLayout) -> bool:
    """The whole code at `base` is ours, but that a recorder's uprobe may have put an int3 over a
    nop (the sampler's USDT probe sites); place.c checks the same."""
    code = layout.path.read_bytes()
    try:
        theirs = mem.read(base, len(code))
    except OSError:
        return False
    if theirs == code:
        return True
    # put the nops back where a uprobe's int3 may be, then compare (a few sites: no byte loop)
    undone = bytearray(theirs)
    at = theirs.find(0xCC)
    while at >= 0:
        if code[at] == 0x90:
            undone[at] = 0x90
        at = theirs.find(0xCC, at + 1)
    return undone == code


def _configure(inj: Injection, sample_mean: int, max_samples_per_s: int, maps: list[Mapping]) -> None:
    """The sampler's own data, through the memory opened for this image (after checking that the
    whole code at base is ours)."""
    data = inj.base + inj.layout.data
    o = INJ_DATA.offsets
    proc = data + o["proc"]
    p = SMP_PROCESS.offsets
    mem = inj.mem
    if not _same_code(mem, inj.base, inj.layout):
        raise Refused(f"the sampler's code is not at {inj.base:#x} (the process changed it or exec'd)")
    try:
        if inj.adopted:             # its saved fields are checked like fresh ones: forwards only to the allocator
            real = struct.unpack(f"<{len(FUNCTIONS)}Q", mem.read(data + o["real"], 8 * len(FUNCTIONS)))
            # Slots redirected before hide the allocator from _originals (a fork of a jemalloc server
            # sees our wrappers and falls back to libc's): what the sampler forwards to stands, as a
            # whole, when each is the definition of its name exported by a mapped object.
            forwards = {n: v for v, n in zip(real, FUNCTIONS, strict=True) if v}
            if "malloc" not in forwards or "free" not in forwards or any(
                    v != inj.originals.get(n) and (_ours(maps, v) or not _in_code(maps, v)
                                                   or not _defines(inj.pid, maps, v, n))
                    for n, v in forwards.items()):
                raise Refused("the adopted sampler forwards to functions that are not the allocator's: not adopted")
            inj.originals = forwards
        mem.write_u64(data + o["owner"], os.getpid())
        mem.write_u64(data + o["clock"], _vdso_clock(inj.pid, maps, mem) or 0)
        for i, name in enumerate(FUNCTIONS):
            mem.write_u64(data + o["real"] + 8 * i, inj.originals.get(name, 0))
        if not inj.adopted:
            mem.write_u64(proc + p["base_mean"], sample_mean)
            mem.write_u64(proc + p["cur_mean"], sample_mean)
        mem.write_u64(proc + p["max_per_s"], max_samples_per_s)
        mem.write(data + o["version"], struct.pack("<I", INJ_VERSION))
        mem.write_u64(data + o["magic"], INJ_MAGIC)
    except OSError as e:
        raise Refused(f"cannot configure the sampler ({e}): the process exec'd or exited") from None


def _originals(pid: int, maps: list[Mapping], mem: _Memory) -> dict[str, int]:
    """The allocator function each name binds to in this process: what the dynamic linker wrote into
    the GOT slots it resolved (GLOB_DAT slots always are; JUMP_SLOTs once called), else the
    definition exported by the library that provides malloc, else by libc."""
    resolved: dict[str, int] = {}
    for obj, bias, m in _objects(pid, maps):
        if m.path.startswith(MEMFD_NAME) or _is_loader(m.path):
            continue
        try:
            found = import_slots(ElfReader.open(open_path(pid, m)), set(FUNCTIONS))
        except (OSError, ElfFormatError):
            continue
        own = [(x.start, x.end) for x in maps if (x.dev, x.inode, x.path) == obj]
        for off, name in found:
            if name in resolved:
                continue
            with contextlib.suppress(OSError):
                v = mem.u64(bias + off)
                if not any(lo <= v < hi for lo, hi in own) and _in_code(maps, v) and not _ours(maps, v) \
                        and _defines(pid, maps, v, name):
                    resolved[name] = v
    owners = []
    if "malloc" in resolved:
        # the offset-0 mapping of malloc's object: _bias measures from there (from its text mapping,
        # every other function of a non-glibc allocator was off by the text's file offset)
        m = next(m for m in maps if m.start <= resolved["malloc"] < m.end)
        owners += [x for x in maps if x.offset == 0 and (x.dev, x.inode, x.path) == (m.dev, m.inode, m.path)][:1]
    owners += [m for m in maps if m.file_backed and os.path.basename(m.path).startswith("libc.so") and m.offset == 0]
    for name in FUNCTIONS:
        if name in resolved:
            continue
        for m in owners:
            bias = _bias(pid, m)
            with contextlib.suppress(OSError, ElfFormatError):
                v = exported_function(ElfReader.open(open_path(pid, m)), name)
                if v is not None and bias is not None:
                    resolved[name] = bias + v
                    break
    return resolved


def _defines(pid: int, maps: list[Mapping], addr: int, name: str) -> bool:
    """`addr` is the definition of `name` that its object exports. A slot can hold something else
    that is not ours either: a non-PIE executable that takes a function's address makes its PLT
    stub the function's canonical address, and every GLOB_DAT slot binds to that stub, which jumps
    through the executable's own slot: forwarding there from a redirected slot would loop."""
    m = next((x for x in maps if x.start <= addr < x.end and x.file_backed), None)
    ident = (m.dev, m.inode, m.path) if m is not None else None
    head = next((x for x in maps if x.offset == 0 and (x.dev, x.inode, x.path) == ident and x.start <= addr), None)
    bias = _bias(pid, head) if head is not None else None
    if bias is None:
        return False
    try:
        v = exported_function(ElfReader.open(open_path(pid, head)), name)
    except (OSError, ElfFormatError):
        return False
    return v is not None and bias + v == addr


def _vdso_clock(pid: int, maps: list[Mapping], them: _Memory) -> int | None:
    """The target's __vdso_clock_gettime: the vDSO is the kernel's, the same bytes in every process
    (checked against ours), at the target's own address."""
    theirs = next((m for m in maps if m.path == "[vdso]"), None)
    mine = next((m for m in read_maps(os.getpid()) if m.path == "[vdso]"), None)
    if theirs is None or mine is None or theirs.end - theirs.start != mine.end - mine.start:
        return None
    with _Memory(os.getpid()) as me:
        image = me.read(mine.start, mine.end - mine.start)
        if them.read(theirs.start, len(image)) != image:
            return None
    with contextlib.suppress(ElfFormatError, ValueError):
        v = exported_function(ElfReader(image, "[vdso]"), "__vdso_clock_gettime")
        if v is not None:
            return theirs.start + v         # the vDSO's vaddrs start at 0
    return None


# -- the process ----------------------------------------------------------------------------------

class _Memory:
    """/proc/PID/mem as opened once: the kernel binds it to the image the process had then, so
    after an exec or exit every access fails instead of reaching the next image."""

    def __init__(self, pid: int):
        self.fd = -1
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)

    def __enter__(self) -> _Memory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, addr: int, n: int) -> bytes:
        data = os.pread(self.fd, n, addr)
        if not data and n:
            # nothing at all: the image this file was bound to is gone (exit or exec)
            raise ProcessLookupError(f"the process image is gone (reading {addr:#x})")
        if len(data) != n:
            raise OSError(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def write(self, addr: int, data: bytes) -> None:
        n = os.pwrite(self.fd, data, addr)
        if n == 0 and data:
            raise ProcessLookupError(f"the process image is gone (writing {addr:#x})")
        if n != len(data):
            raise OSError(f"short write at {addr:#x}")

    def write_u64(self, addr: int, value: int) -> None:
        # Only into the sampler's own data (a copy, not one store: the process's words go through store)
        self.write(addr, struct.pack("<Q", value))


def _objects(pid: int, maps: list[Mapping], biases: dict | None = None):
    """(identity, load bias, first mapping) of each ELF object mapped, in address order; `biases`
    keeps them across calls (per mapping: a file mapped again elsewhere gets its own)."""
    seen: set[tuple] = set()
    biases = {} if biases is None else biases
    for m in maps:
        obj = (m.dev, m.inode, m.path)
        if not m.file_backed or m.offset != 0 or obj in seen:
            continue
        seen.add(obj)
        key = (*obj, m.start)
        if key not in biases:
            biases[key] = _bias(pid, m)
        if biases[key] is not None:
            yield obj, biases[key], m


def _bias(pid: int, m: Mapping) -> int | None:
    """Load bias of the object whose offset-0 mapping is `m`: its start less the page of its first
    PT_LOAD (0 for shared objects and PIE; the link address for a non-PIE executable)."""
    try:
        loads = [s for s in ElfReader.open(open_path(pid, m)).segments if s.type == PT_LOAD]
    except (OSError, ElfFormatError):
        return None
    return m.start - (min(s.vaddr for s in loads) & ~0xFFF) if loads else None


def _fields(mem: _Memory, addr: int) -> list[int]:
    """A PyMemAllocatorEx: ctx, malloc, calloc, realloc, free."""
    return list(struct.unpack("<5Q", mem.read(addr, 40)))


def _may_be_python(path: str) -> bool:
    """An executable or library that can hold CPython (cheap name test before reading the file);
    free-threaded builds (python3.13t) are left out: their objects come from mimalloc."""
    base = os.path.basename(path)
    return "python" in base and not _FREE_THREADED.search(base)


_FREE_THREADED = re.compile(r"python3\.\d+t\b")
ENVIRON_MAX = 1 << 20


def _pymalloc_setting(pid: int) -> str | None:
    """Why CPython's default allocator is not in use, from PYTHONMALLOC in the process's initial
    environment (read bounded); None when it is."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(ENVIRON_MAX)
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(b"PYTHONMALLOC="):
            value = item[len(b"PYTHONMALLOC="):].decode(errors="replace")[:40]
            return None if value in ("", "pymalloc") else f"PYTHONMALLOC={value}"
    return None


def _within(ranges: list[tuple[int, int]], addr: int) -> bool:
    return any(lo <= addr < hi for lo, hi in ranges)


def _in_code(maps: list[Mapping], addr: int) -> bool:
    return any(m.start <= addr < m.end and m.executable and m.file_backed for m in maps)


def _ours(maps: list[Mapping], addr: int) -> bool:
    return any(m.start <= addr < m.end and m.path.startswith(MEMFD_NAME) for m in maps)


def _is_loader(path: str) -> bool:
    return os.path.basename(path).startswith("ld-linux")
