"""Attach at in-process cost: the preload shim's sampling placed into a running process, no restart.

1. Placement (place.c, a separate helper process): one thread is stopped with PTRACE_SEIZE +
   PTRACE_INTERRUPT and executes memfd_create, mmap and close at a `syscall` instruction of its
   vDSO; the sampler's code (inject.c, built freestanding) goes into the memfd, mapped private and
   read+exec (uprobes can sit in it), its data anonymous right after; the thread gets its
   registers back and runs on. No code of ours runs in the target, no thread, no file in its
   namespace, no dlopen.
2. Configuration: the data (`inj`, inject_abi.h) is written through /proc/PID/mem: the functions
   to forward to, the sampling mean and cap, the vDSO's clock. Its magic is written last.
3. The recorder attaches its otel_memory USDT program to the sampler's probe sites (the preload
   tier's path: same events, same stacks, same Parquet), then
4. Redirection: each GOT slot of the process's objects that binds to the allocator's malloc family
   gets the sampler's function, with one aligned 8-byte write through /proc/PID/mem (the kernel
   copies it in one store: a concurrent call sees the old or the new function, never a mix;
   tests/test_inject.py measures it). Objects loaded later are redirected when they appear.
Detaching restores every slot that still holds our function. The code stays mapped (a thread may be
between loading a slot and returning from it, and copies of slots taken as function pointers keep
calling in): it keeps forwarding correctly for the process's life, its probe sites trap for nobody.
A later recorder finds it by its memfd name and magic and adopts it instead of placing a second.

Everything read from the target (its maps, its files, its memory) is checked before it is used: a
slot is redirected only when it holds the allocator's function (or its own lazy-binding stub), and
restored only while it still holds ours.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sampler.binary.elf import SHT_RELA, ElfImage, dynsym_entry, exported_function, import_slots
from sampler.binary.reader import PT_LOAD, ElfFormatError, ElfReader
from sampler.bpf.abi import Layout
from sampler.errors import EnvironmentProblem
from sampler.inprocess import build as builder
from sampler.inprocess import pydomains
from sampler.probes.allocators import FAMILIES
from sampler.proc.maps import Mapping, open_path, read_maps

MEMFD_NAME = "/memfd:allocsampler"
PLACE_TIMEOUT_S = 10.0

# inject_abi.h (tests/test_inject.py checks these against the header) --------------------------
INJ_MAGIC = 0x31504D53434F4C41
INJ_VERSION = 1
INJ_DATA_OFFSET = 0x20000
INJ_SLOTS_LOG2 = 14
INJ_SLOT_SHIFT = 16
INJ_PY_SMALL = 512
FUNCTIONS = ("malloc", "free", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign", "valloc",
             "pvalloc")                    # enum inj_fn, in order
INJ_NFN = len(FUNCTIONS)
PY_DOMAINS = ("mem", "obj")                # enum inj_py_domain
SMP_THREAD = Layout("smp_thread", [("remaining", "Q"), ("mean", "Q"), ("rng", "Q"), ("seeded", "Q")])
SMP_PROCESS = Layout("smp_process", [(n, "Q") for n in (
    "base_mean", "cur_mean", "max_per_s", "win_start", "win_count", "mean_changes", "sampled", "freed", "dropped",
    "weight_bits", "var_bits", "seed_counter")])
INJ_PY_ALLOCATOR = Layout("inj_py_allocator", [(n, "Q") for n in ("ctx", "malloc", "calloc", "realloc", "free")])
INJ_DATA = Layout("inj_data", [
    ("magic", "Q"), ("version", "I"), ("pad", "I"), ("owner", "Q"), ("clock", "Q"), ("real", ("Q", INJ_NFN)),
    ("py", (INJ_PY_ALLOCATOR, len(PY_DOMAINS))), ("reserved", ("Q", 8)), ("proc", (SMP_PROCESS, 1)),
], tail="slots")                           # then one SMP_THREAD per slot

CFLAGS = ("-O2", "-g", "-ffreestanding", "-fPIC", "-fno-plt", "-fvisibility=hidden", "-fno-stack-protector",
          "-fno-builtin", "-fasynchronous-unwind-tables", "-fcf-protection=none", "-Wall", "-Wextra",
          "-nostdlib", "-shared", f"-Wl,-T,{builder.HERE / 'inject.ld'}", "-Wl,--build-id",
          "-Wl,--eh-frame-hdr", "-Wl,-z,noexecstack", "-Wl,-z,norelro", "-Wl,--hash-style=gnu")
SAMPLER = builder.Artifact("the injected sampler", "allocsampler-inject.so", "inject.c", CFLAGS,
                           ("sampling.h", "inject_abi.h", "inject.ld"))
PLACE = builder.Artifact("the placement helper", "allocsampler-place", "place.c", ("-O2", "-Wall", "-Wextra"))


class Refused(Exception):
    """Injection is impossible or refused for this process: the message says why, in one line.
    `transient`: it may work a moment later (an image that an exec has not finished mapping)."""

    def __init__(self, why: str, transient: bool = False):
        super().__init__(why)
        self.transient = transient


def built() -> tuple[Path, Path]:
    """(the sampler's code file, the placement helper), built when missing or stale."""
    return builder.build(SAMPLER), builder.build(PLACE)


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

    @classmethod
    def of(cls, path: Path) -> CodeLayout:
        img = ElfImage.open(str(path))
        elf = ElfReader.open(str(path))
        data_end = max(s.vaddr + s.memsz for s in elf.segments if s.type == PT_LOAD)
        entries = {}
        for name in (*FUNCTIONS, *(f"py_{d}_{f}" for d in PY_DOMAINS for f in ("malloc", "calloc", "realloc", "free"))):
            sym = img.symbol(f"as_{name}")
            if sym is None:
                raise EnvironmentProblem(f"{path} lacks as_{name}: rebuild it (python -m sampler.inprocess.build)")
            entries[name] = sym.value
        data, table = img.symbol("inj"), img.symbol("inj_table")
        if data is None or table is None or path.stat().st_size > INJ_DATA_OFFSET:
            raise EnvironmentProblem(f"{path} is not a sampler this recorder knows: rebuild it")
        py = elf.section(".inj_py")
        if py is None:
            raise EnvironmentProblem(f"{path} lacks .inj_py: rebuild it (python -m sampler.inprocess.build)")
        if any(s.type == SHT_RELA and s.file_size for s in elf.sections):
            raise EnvironmentProblem(f"{path} has relocations, which nothing would apply in the target: "
                                     "rebuild it (python -m sampler.inprocess.build)")
        return cls(path, INJ_DATA_OFFSET, (data_end + 4095) & ~4095, data.value, table.value, entries,
                   (py.addr, py.addr + py.size))


@dataclass
class Slot:
    addr: int
    name: str
    original: int                   # what it held (the function, or its object's lazy stub)
    path: str                       # the object it belongs to


@dataclass
class Injection:
    """The sampler in one process, and the slots it redirects."""

    pid: int
    base: int
    layout: CodeLayout
    originals: dict[str, int]
    adopted: bool = False
    stop_ns: int | None = None      # how long the placing thread was stopped
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

    @property
    def allocator(self) -> str:
        """`family:path` of the library the sampler forwards malloc to (as `targets.allocators` says)."""
        with contextlib.suppress(OSError, ProcessLookupError):
            m = next((x for x in read_maps(self.pid) if x.start <= self.originals["malloc"] < x.end), None)
            if m is not None:
                base = os.path.basename(m.path)
                family = next((f.name for f in FAMILIES if f.library.search(base)), "other")
                return f"{family}:{m.path}"
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

    def redirect(self) -> int:
        """Redirect the slots of objects not looked at yet; returns how many slots changed. An object
        still being loaded (its data not mapped, or not relocated yet) is looked at again next time.
        The first call also points the allocator's exported symbols at the sampler, so that objects
        loaded later (dlopen) bind to it from their first call, before any rescan."""
        maps = read_maps(self.pid)
        changed = 0
        owner = self._owner_of_malloc(maps)
        with _Memory(self.pid) as mem:
            if not self.symbols:
                self._bind_symbols(mem, maps)
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
                try:
                    done = [self._redirect_one(mem, bias + off, name, m.path, own) for off, name in found]
                except OSError:
                    continue            # its data is not mapped yet
                if None not in done:
                    self.seen.add(obj)
                changed += sum(d for d in done if d)
            changed += self._redirect_python(mem, maps)
        return changed

    def _redirect_python(self, mem: _Memory, maps: list[Mapping]) -> int:
        """CPython's object and mem domains (pymalloc) go through the sampler's as_py_* functions:
        their small objects never reach malloc. Each field is written only while it holds what was
        read (an 8-byte write each: free first, malloc last, so that nothing is sampled before its
        free is seen); a domain that is hooked (tracemalloc, PYTHONMALLOC=debug, an embedder's
        allocator) or backed by malloc (PYTHONMALLOC=malloc: sampled there) is left alone. Looked
        at on every rescan: an interpreter that was starting sets its allocators once more."""
        if self.python is None:
            self.python = self._find_python(maps) or ""
        if not self.python:
            return 0
        path, bias, doms, own = self.python
        raw = _fields(mem, bias + doms.raw)
        changed, done = 0, []
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
                        done.append(name)
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
            mem.write(keep, struct.pack("<5Q", *cur))
            for j in (4, 3, 2, 1):                      # free, realloc, calloc, malloc
                f = pydomains.FIELDS[j]
                if mem.u64(addr + 8 * j) != cur[j]:
                    break                               # changed under us: the rest stays as it is
                mem.write_u64(addr + 8 * j, self.wrapper(f"py_{name}_{f}"))
                self.py_fields[addr + 8 * j] = Slot(addr + 8 * j, f"py_{name}_{f}", cur[j], path)
                changed += 1
            done.append(name)
        if done and not self.python_objects:        # adopted from a recorder that sampled them
            self._restore_python(mem)
            done = []
        if done:
            self._say(f"CPython objects sampled in the {' and '.join(done)} domain{'s' * (len(done) > 1)} ({path})")
        elif not self.python_objects:
            self._say("CPython objects are not sampled apart from malloc (--python-objects samples them; "
                      "optimised CPython builds inline pymalloc only while it is the domain's allocator: "
                      "an allocation-heavy Python loop ran ~10% slower, docs/performance.md)")
        return changed

    def _restore_python(self, mem: _Memory) -> int:
        """The domains' fields that hold our functions get back CPython's; returns how many."""
        restored = 0
        order = {"malloc": 0, "calloc": 1, "realloc": 2, "free": 3}   # free last: see _redirect_python
        for s in sorted(self.py_fields.values(), key=lambda x: order[x.name.rsplit("_", 1)[1]]):
            with contextlib.suppress(OSError):
                if mem.u64(s.addr) == self.wrapper(s.name):
                    mem.write_u64(s.addr, s.original)
                    restored += 1
        self.py_fields.clear()
        return restored

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

    def _redirect_one(self, mem: _Memory, addr: int, name: str, path: str,
                      own: list[tuple[int, int]]) -> int | None:
        """1 when the slot was redirected, 0 when not (ours already, or bound elsewhere), None when
        it is not relocated yet."""
        if addr % 8 or addr in self.slots or name not in self.originals:
            return 0
        value = mem.u64(addr)
        wrapper = self.wrapper(name)
        if value == wrapper:                        # redirected by an earlier recorder: ours now
            self.slots[addr] = Slot(addr, name, self.originals[name], path)
            return 0
        lazy = any(lo <= value < hi for lo, hi in own)
        if value != self.originals[name] and not lazy:
            if value < 1 << 32:
                return None                         # not relocated yet (0, or a link-time offset)
            self.skipped.append(f"{name} in {os.path.basename(path)} is bound to {value:#x}, not the allocator")
            return 0
        mem.write_u64(addr, wrapper)
        self.slots[addr] = Slot(addr, name, value, path)
        return 1

    def _imports(self, obj: tuple, m: Mapping) -> list[tuple[int, str]] | None:
        """The object's slots for our functions (read from its file once); None: not readable."""
        if obj not in self.imports:
            try:
                self.imports[obj] = import_slots(ElfReader.open(open_path(self.pid, m)), set(FUNCTIONS))
            except (OSError, ElfFormatError):
                return None
        return self.imports[obj]

    def _bind_symbols(self, mem: _Memory, maps: list[Mapping]) -> None:
        """The allocator's .dynsym values (st_value, relative to its load bias) of each function we
        redirect become our function's: the dynamic linker binds every later lookup, a dlopen'ed
        object's relocations and a lazy slot's first call alike, to the sampler. Checked against the
        file and the resolved function before anything is written."""
        if self.symbol_plan is None:
            self.symbol_plan = self._plan_symbols(maps)
        for addr, name, value, path, bias in self.symbol_plan:
            ours = (self.wrapper(name) - bias) % (1 << 64)
            with contextlib.suppress(OSError):
                if mem.u64(addr) in (value, ours):
                    mem.write_u64(addr, ours)
                    self.symbols[addr] = Slot(addr, name, value, path)

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
        that bound to it through our symbols), get back what they held; returns how many slots."""
        restored = 0
        try:
            mem = _Memory(self.pid)
        except OSError:
            return 0                                # the process is gone: nothing to restore
        with mem:
            restored += self._restore_python(mem)
            for s in self.symbols.values():
                with contextlib.suppress(OSError):
                    mem.write_u64(s.addr, s.original)
            with contextlib.suppress(OSError, ProcessLookupError):
                self._find_slots(mem)
            for s in self.slots.values():
                with contextlib.suppress(OSError):
                    if mem.u64(s.addr) == self.wrapper(s.name):
                        mem.write_u64(s.addr, s.original)
                        restored += 1
        self.slots.clear()
        self.symbols.clear()
        self.py_fields.clear()
        self.python = None
        self.seen.clear()
        return restored

    def _find_slots(self, mem: _Memory) -> None:
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
                    if addr not in self.slots and name in self.originals and wrappers.get(mem.u64(addr)) == name:
                        self.slots[addr] = Slot(addr, name, self.originals[name], m.path)

    def set_mean(self, mean: int) -> None:
        """The sampling mean from now on (the recorder's sample-rate control, pre-OOM capture); the
        sampler's own cap may raise it again. Gaps drawn before keep their mean and their weights."""
        proc = self.base + self.layout.data + INJ_DATA.offsets["proc"]
        with _Memory(self.pid) as mem:
            mem.write_u64(proc + SMP_PROCESS.offsets["base_mean"], mean)
            mem.write_u64(proc + SMP_PROCESS.offsets["cur_mean"], mean)

    def counters(self) -> dict[str, int]:
        """The sampler's own counts (smp_process), read from the process."""
        with _Memory(self.pid) as mem:
            raw = mem.read(self.base + self.layout.data + INJ_DATA.offsets["proc"], SMP_PROCESS.struct.size)
        return dict(zip((n for n, _ in SMP_PROCESS.fields), SMP_PROCESS.struct.unpack(raw), strict=True))

    def _owner_of_malloc(self, maps: list[Mapping]) -> tuple | None:
        m = next((x for x in maps if x.file_backed and x.start <= self.originals.get("malloc", 0) < x.end), None)
        return (m.dev, m.inode, m.path) if m is not None else None


def inject(pid: int, sample_mean: int, max_samples_per_s: int, python_objects: bool = False) -> Injection:
    """Place (or adopt) the sampler in `pid` and configure it; the slots are redirected by
    Injection.redirect(), once the recorder's probes are on the sampler (CPython's object allocator
    too with `python_objects`). Raises Refused."""
    code, helper = built()
    layout = CodeLayout.of(code)
    try:
        maps = read_maps(pid)
    except ProcessLookupError:
        raise Refused("the process exited") from None
    originals = _originals(pid, maps)
    if "malloc" not in originals or "free" not in originals:
        raise Refused("no dynamically linked malloc and free to redirect (a static binary, or an allocator "
                      "this recorder does not know)", transient=True)
    base = _existing(pid, maps, layout)
    adopted, stop_ns = base is not None, None
    if base is None:
        base, stop_ns = place(pid, helper, layout)
    inj = Injection(pid, base, layout, originals, adopted=adopted, stop_ns=stop_ns, python_objects=python_objects)
    _configure(inj, sample_mean, max_samples_per_s, maps)
    return inj


# -- the steps ------------------------------------------------------------------------------------

def place(pid: int, helper: Path, layout: CodeLayout) -> tuple[int, int]:
    """Map a new sampler into `pid` with the placement helper (no configuration, no redirection:
    inject() does those; scripts/bench_overhead.py times placements with it). Returns (its base,
    how long the thread was stopped in ns). Raises Refused."""
    try:
        r = subprocess.run([str(helper), str(pid), str(layout.path), hex(layout.code_span), hex(layout.total_span)],
                           capture_output=True, text=True, timeout=PLACE_TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise Refused(f"placing the sampler took over {PLACE_TIMEOUT_S:g} s") from None
    line = (r.stdout.strip().splitlines() or [""])[-1]
    parts = line.split()
    if r.returncode != 0 or len(parts) != 4 or parts[0] != "ok":
        raise Refused(line.removeprefix("error ") or f"the placement helper failed ({r.stderr.strip()[:200]})")
    return int(parts[1], 16), int(parts[3])


def _existing(pid: int, maps: list[Mapping], layout: CodeLayout) -> int | None:
    """The base of a sampler an earlier recorder placed (found by its memfd name and magic, the
    same code: a different build is refused rather than mixed with)."""
    for m in maps:
        if m.path.startswith(MEMFD_NAME) and m.offset == 0 and m.executable:
            with _Memory(pid) as mem:
                if mem.u64(m.start + layout.data) != INJ_MAGIC:
                    continue
                with open(layout.path, "rb") as f:
                    ours = f.read(4096)
                if mem.read(m.start, len(ours)) != ours:
                    raise Refused("an earlier recorder's sampler of another build is in the process; restart it "
                                  "to replace it, or record with --attach-mode uprobe")
            return m.start
    return None


def _configure(inj: Injection, sample_mean: int, max_samples_per_s: int, maps: list[Mapping]) -> None:
    data = inj.base + inj.layout.data
    o = INJ_DATA.offsets
    proc = data + o["proc"]
    p = SMP_PROCESS.offsets
    with _Memory(inj.pid) as mem:
        mem.write_u64(data + o["owner"], os.getpid())
        mem.write_u64(data + o["clock"], _vdso_clock(inj.pid, maps) or 0)
        for i, name in enumerate(FUNCTIONS):
            mem.write_u64(data + o["real"] + 8 * i, inj.originals.get(name, 0))
        if not inj.adopted:
            mem.write_u64(proc + p["base_mean"], sample_mean)
            mem.write_u64(proc + p["cur_mean"], sample_mean)
        mem.write_u64(proc + p["max_per_s"], max_samples_per_s)
        mem.write(data + o["version"], struct.pack("<I", INJ_VERSION))
        mem.write_u64(data + o["magic"], INJ_MAGIC)


def _originals(pid: int, maps: list[Mapping]) -> dict[str, int]:
    """The allocator function each name binds to in this process: what the dynamic linker wrote into
    the GOT slots it resolved (GLOB_DAT slots always are; JUMP_SLOTs once called), else the
    definition exported by the library that provides malloc, else by libc."""
    resolved: dict[str, int] = {}
    with _Memory(pid) as mem:
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


def _vdso_clock(pid: int, maps: list[Mapping]) -> int | None:
    """The target's __vdso_clock_gettime: the vDSO is the kernel's, the same bytes in every process
    (checked against ours), at the target's own address."""
    theirs = next((m for m in maps if m.path == "[vdso]"), None)
    mine = next((m for m in read_maps(os.getpid()) if m.path == "[vdso]"), None)
    if theirs is None or mine is None or theirs.end - theirs.start != mine.end - mine.start:
        return None
    with _Memory(os.getpid()) as me, _Memory(pid) as them:
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
    """/proc/PID/mem, for aligned reads and 8-byte writes."""

    def __init__(self, pid: int):
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)

    def __enter__(self) -> _Memory:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def read(self, addr: int, n: int) -> bytes:
        data = os.pread(self.fd, n, addr)
        if len(data) != n:
            raise OSError(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def write(self, addr: int, data: bytes) -> None:
        if os.pwrite(self.fd, data, addr) != len(data):
            raise OSError(f"short write at {addr:#x}")

    def write_u64(self, addr: int, value: int) -> None:
        # One aligned 8-byte write: the kernel copies it with one store (see the module doc).
        assert addr % 8 == 0
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
