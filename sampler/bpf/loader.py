"""Loading the BPF programs (compiled by bcc, kept by sampler/bpf/objcache.py) and attaching them
to targets.

One BPF object holds all programs (bpf/*.c) so that they share the sampled-live table, the
countdown and the ring buffer. Syscall and sched tracepoints are attached once, host-wide,
and filter on the `targets` map; allocator uprobes are attached per target process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import sampler.bpf as bpf_sources
from sampler import files
from sampler.bpf import btf, objcache, preflight, tracefs, uprobe_multi
from sampler.bpf.abi import SHIFT_MAX, SHIFT_MIN, USDT_SPECS, UW_FRAMES, UW_MAPS, Counter, Fn, TargetFlag
from sampler.bpf.objcache import PROG_KPROBE, PROG_PERF_EVENT, PROG_TRACEPOINT, runtime
from sampler.bpf.ringbuf import RingReader
from sampler.errors import EnvironmentProblem

SOURCES = ("alloc.bpf.c", "usdt.bpf.c", "cuda.bpf.c", "vm.bpf.c", "fault.bpf.c", "proc.bpf.c", "walk.bpf.c")
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS = 1, 2

_PERF_ENTRY = {fn: f"{fn.name.lower()}_enter" for fn in Fn if fn <= Fn.DELETE}
_REFUSED = {
    "maps": "could not write the BPF maps ({})",
    "tracepoints": "could not attach the syscall and sched tracepoints ({}): check that tracefs is mounted "
                   "and this kernel has them",
    "programs": "the kernel rejected a BPF program ({}): this kernel may lack uprobe_multi/session support; "
                "try --probe-mode perf",
}


@dataclass(frozen=True)
class ProbeConfig:
    sample_mean: int = 512 * 1024
    stack_bytes: int = 16 << 10   # user stack copied per sampled event (multiple of 1 KiB)
    py_max: int = 96              # Python frames captured per sampled event
    live_max: int = 262144
    ringbuf_bytes: int = 8 << 20    # a burst of sampled stacks (1-16 KiB each) must fit
    mode: str = "auto"            # auto | session | perf
    vm_events_per_s: int = 2000   # unsampled syscall records per process and ~1 s window (0: all)
    cache_dir: Path | None = None  # compiled programs kept across runs (sampler/bpf/objcache.py)
    # native unwinding in BPF (sampler/stacks/kernel_tables.py): rows of all loaded files (8 bytes
    # each; libtorch_cpu has ~2.6M) and processes walked in BPF (8 KiB of uw_maps each)
    unwind_rows: int = 8 << 20
    unwind_pages: int = 1 << 20     # their page index (4 bytes per 4 KiB of code)
    unwind_procs: int = 512
    verify_unwind: bool = False   # tests: also copy every stack from the sample's registers
    max_frames: int = 127         # native frames kept per stack: a walk this deep is not handed over
    # `weight_tab`: S/p in units of the mean, Q20 (sampler/control/weights.py weight_table(), the one
    # weight formula); required to load
    weight_table: tuple[int, ...] = ()


class UprobePoint(Protocol):
    """One allocator function's probe site, as the layers above plan it (sampler/probes/allocators.py)."""

    name: str
    fn: Fn
    file_offset: int        # of the probe site
    delegates: bool

    @property
    def cookie(self) -> int: ...

    @property
    def entry_offset(self) -> int: ...     # file offset of the function's entry: its return probe


class UprobeLibrary(Protocol):
    path: str               # as the process sees it (messages)
    attach_path: str        # openable from here
    points: Sequence[UprobePoint]


class UsdtSite(NamedTuple):
    """A USDT probe site to attach: where, its semaphore (0: none) and its packed `usdt_spec`
    (sampler/probes/usdt.py pack_spec)."""

    file_offset: int
    semaphore: int
    spec: bytes


@dataclass
class _Attachment:
    links: list[tuple[int, bool]] = field(default_factory=list)        # link fd, allocation probes
    perf: list[tuple[int, bytes, bool]] = field(default_factory=list)  # perf fd, event name, allocation
    specs: list[int] = field(default_factory=list)                     # usdt_specs slots its links use


@dataclass
class _Family:
    """One link on a file's probe sites for every process that maps it (the injected sampler's
    memfd, shared by a family's forks), kept while a member is attached through it."""
    fd: int
    specs: list[int]
    members: set[int] = field(default_factory=set)


# The stack walk's program for each kind of caller (program type, attach type): walk.bpf.c.
_WALKERS = {(PROG_KPROBE, 0): "kprobe", (PROG_KPROBE, uprobe_multi.BPF_TRACE_UPROBE_MULTI): "multi",
            (PROG_KPROBE, uprobe_multi.BPF_TRACE_UPROBE_SESSION): "session", (PROG_TRACEPOINT, 0): "tracepoint",
            (PROG_PERF_EVENT, 0): "perf"}

USDT_SPECS_PER_FILE = 16        # distinct argument layouts of one file's memory probes
USDT_SPECS_PER_TARGET = 64


class _UsdtSpecs:
    """The `usdt_specs` slots: one per distinct argument layout, shared by the links that use it and
    freed with the last of them (reused only after a grace period: a hit in flight may still read
    it). Layouts reserved at load (the project's own samplers') are never freed, so that no file's
    probes can crowd them out."""

    GRACE_S = 5.0

    def __init__(self, table):
        self.table = table
        self.ids: dict[bytes, int] = {}
        self.refs: dict[int, int] = {}
        self.free = list(range(USDT_SPECS - 1, -1, -1))
        self.cooling: list[tuple[float, int]] = []
        self.reserved: set[int] = set()

    def take(self, value: bytes) -> int:
        idx = self.ids.get(value)
        if idx is None:
            now = time.monotonic()
            while self.cooling and self.cooling[0][0] <= now:
                self.free.append(self.cooling.pop(0)[1])
            if not self.free:
                raise OSError(errno.ENOSPC, "too many distinct USDT argument layouts in use")
            idx = self.ids[value] = self.free.pop()
            self.table[ctypes.c_int(idx)] = self.table.Leaf.from_buffer_copy(value)
        self.refs[idx] = self.refs.get(idx, 0) + 1
        return idx

    def drop(self, slots: list[int]) -> None:
        for idx in slots:
            n = self.refs.get(idx, 0) - 1
            if n > 0 or idx in self.reserved:
                self.refs[idx] = max(n, 1)
                continue
            self.refs.pop(idx, None)
            value = next((v for v, i in self.ids.items() if i == idx), None)
            if value is not None:
                del self.ids[value]
                self.cooling.append((time.monotonic() + self.GRACE_S, idx))


_EINVAL_HINT = ("the kernel refused the uprobe (EINVAL): most likely another tool holds a uprobe at "
                "the same place with a different ref_ctr_offset, as bcc <= 0.30 Python tools such "
                "as memleak-bpfcc do (iovisor/bcc#5236, 'ref_ctr_offset mismatch' in dmesg); stop "
                "that tool and record again")


def program_source(cfg: ProbeConfig) -> tuple[str, list[str]]:
    """The C text and compile flags of the BPF object (what objcache caches by)."""
    # One translation unit: bcc rewrites map operations only in the main file, not in
    # included headers, so common.h is pasted in rather than #included.
    text = "\n".join(bpf_sources.source(s) for s in ("abi.h", "common.h", *SOURCES))
    # map sizes are given at load (objcache.BpfObject), so they are not compile flags
    cflags = [
        f"-DSAMPLE_MEAN={cfg.sample_mean}ULL",
        f"-DSTACK_BYTES={cfg.stack_bytes}",
        f"-DPY_MAX={cfg.py_max}",
        f"-DVM_EVENTS_PER_S={cfg.vm_events_per_s}",
        "-Wno-unused-function",
    ]
    if _exit_has_group_dead():
        cflags.append("-DEXIT_HAS_GROUP_DEAD")
    if cfg.verify_unwind:
        cflags.append("-DUW_VERIFY")
    if cfg.max_frames <= UW_FRAMES:
        cflags.append("-DUW_DEEP_FINAL")
    cflags += _uretprobe_flags()
    return text, cflags


class BpfProbes:
    def __init__(self, cfg: ProbeConfig):
        if not cfg.weight_table:
            raise ValueError("ProbeConfig.weight_table is empty: pass sampler.control.weights.weight_table()")
        self.cfg = cfg
        self.session = cfg.mode == "session" or (cfg.mode == "auto" and uprobe_multi.session_supported())
        text, cflags = program_source(cfg)
        page = os.sysconf("SC_PAGE_SIZE")
        pages = max(1, cfg.ringbuf_bytes // page)
        pages = 1 << (pages.bit_length() - 1)          # ring buffers are a power of two
        sizes = {"live": cfg.live_max, "events": pages * page, "uw_rows": cfg.unwind_rows,
                 "uw_pages": cfg.unwind_pages, "uw_procs": cfg.unwind_procs, "uw_maps": cfg.unwind_procs * UW_MAPS}
        self._attached: dict[int, _Attachment] = {}
        self._families: dict[tuple, _Family] = {}     # file identity -> its family's link
        self._exited_mappings: set[int] = set()        # exited processes whose vm_live entries go at the next poll
        self._hits_pids: set[int] = set()               # processes given a pid_hits entry (_ensure_hits)
        self._gpu_links: dict[int, list[int]] = {}      # CUDA and pytorch probes: kept across tiers
        self._entry_links: dict[int, int] = {}          # held processes' entry points (hold_at_entry)
        self._specs: _UsdtSpecs | None = None
        self._gpu_specs: dict[int, list[int]] = {}
        self._faults_on = False
        self._seq = 0
        self._closing: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._ring: RingReader | None = None
        self._closers: list[threading.Thread] = []
        self.swept = tracefs.sweep_stale_events()     # what SIGKILLed recorders left (no uprobe PMU)
        try:
            self._load(text, cflags, sizes)
        except OSError:
            # only from a cached spec this kernel refuses (a kernel rebuilt under the same name):
            # compile once more
            objcache.forget(text, cflags, cfg.cache_dir)
            self._load(text, cflags, sizes)

    def _load(self, text: str, cflags: list[str], sizes: dict[str, int]) -> None:
        """Compile (or take from the cache), create the maps, attach the tracepoints and load the
        allocator programs. Raises EnvironmentProblem, or OSError when the kernel refuses a
        program of a cached spec."""
        try:
            with files.stderr_to(os.devnull):   # clang's warnings about foreign kernel headers are noise
                spec, self.compiled = objcache.build(text, cflags, self.cfg.cache_dir)
        except Exception as e:
            raise EnvironmentProblem(
                f"could not compile the BPF programs ({e}); check the kernel headers under "
                f"/lib/modules/{os.uname().release}/build: {preflight.headers_fix()}") from None
        _release_compiler_memory()      # also when loaded: LLVM's static initializers touch ~40 MiB
        try:
            self.bpf = objcache.BpfObject(spec, sizes)
        except OSError as e:
            raise EnvironmentProblem(f"could not create the BPF maps ({e})") from None
        # The allocator programs of the probe mode are loaded now, so that a kernel refusing them
        # fails here with advice; session mode's perf-mode fallback, USDT and CUDA when first
        # needed (most processes need none of them).
        stage = "maps"
        try:
            tab = self.bpf["weight_tab"]
            for i, v in enumerate(self.cfg.weight_table):
                tab[ctypes.c_int(i)] = ctypes.c_uint64(v)
            self._targets = self.bpf["targets"]
            self._live = self.bpf["live"]
            self.bpf["rb_wake"][ctypes.c_int(1)] = ctypes.c_uint64(max(4096, sizes["events"] // 8))
            stage = "tracepoints"
            self._walker(PROG_TRACEPOINT)
            self.bpf.attach_tracepoints()
            stage = "programs"
            if not self.session:
                # perf mode's programs, so that a kernel refusing them fails here with advice;
                # session mode's come at the first uprobe-tier attach (_session_progs)
                for name in {*_PERF_ENTRY.values(), *(n.replace("_enter", "_d_enter") for n in _PERF_ENTRY.values()
                                                      if not n.startswith(("free", "delete"))), "alloc_return"}:
                    self._load_prog(name, PROG_KPROBE)
        except OSError as e:
            self.bpf.close()
            if not self.compiled:
                raise               # a cached spec: __init__ compiles once more
            raise EnvironmentProblem(_REFUSED[stage].format(e)) from None
        except BaseException:
            self.bpf.close()
            raise

    def _walker(self, prog_type: int, attach_type: int = 0) -> None:
        """The stack walk's program for callers of this kind (walk.bpf.c), loaded once: a tail call
        needs its caller's program type and attach type."""
        kind = _WALKERS[(prog_type, attach_type)]
        self.bpf.tail_call(f"walk_{kind}", 0, f"walker_{kind}", prog_type, attach_type)

    def _load_prog(self, name: str, prog_type: int, attach_type: int = 0) -> int:
        """Load a program (once), after the stack walk's program of its kind."""
        self._walker(prog_type, attach_type)
        return self.bpf.load_func(name, prog_type, attach_type)

    # targets -------------------------------------------------------------------------------
    def add_target(self, pid: int, flags: int = TargetFlag.SYSCALLS, budget: int = 0) -> None:
        """Trace a process's syscalls (and with TargetFlag.FAULTS its sampled page faults).
        `budget`: the process whose syscall-event budget it spends (a family's root), 0: its own."""
        key = ctypes.c_uint32(pid)
        try:
            v = self._targets[key]
        except KeyError:
            v = self._targets.Leaf()
        v.flags = flags | (v.flags & TargetFlag.FORKED)     # its place in its family's caps (proc.bpf.c)
        v.budget = budget
        self._targets[key] = v

    def set_sample_shift(self, pid: int, shift: int) -> None:
        """A process's sampling mean becomes SAMPLE_MEAN * 2^shift, for every source: written to
        `targets` (syscalls, tensors) and to each CPU's `pid_hits` entry (allocator probes)."""
        shift = max(SHIFT_MIN, min(SHIFT_MAX, shift))
        key = ctypes.c_uint32(pid)
        with contextlib.suppress(KeyError):
            v = self._targets[key]
            v.shift = shift
            self._targets[key] = v
        self._ensure_hits(pid)
        tab = self.bpf["pid_hits"]
        with contextlib.suppress(KeyError):
            # read-modify-write of every CPU's entry: hits counted in between are lost, a few
            # out of the governor's per-second rates
            vs = tab[key]
            for v in vs:
                v.shift = shift
            tab[key] = vs

    def attach(self, pid: int, lib: UprobeLibrary, allocs_only: bool = False) -> tuple[dict[str, str], dict[str, str]]:
        """Attach the allocator probes of one library for one process (`allocs_only`: only the
        allocation functions, the governor resuming after a pause).

        Returns (mode per probed function: 'session' or 'perf', reason per function that could
        not be probed). A session link covers all functions at once; when the kernel refuses it,
        each function is tried alone, then as a classic uprobe. Raises OSError when the process
        is gone."""
        att = self._attached.setdefault(pid, _Attachment())
        self._ensure_hits(pid)
        modes: dict[str, str] = {}
        failed: dict[str, str] = {}
        rest = [p for p in lib.points if not (allocs_only and p.fn.frees)]
        progs = self._session_progs() if self.session else None
        if progs is not None:
            rest = []
            allocs = [p for p in lib.points if not p.fn.frees]
            frees = [] if allocs_only else [p for p in lib.points if p.fn.frees]
            for prog_fd, points, session in ((progs[0], allocs, True), (progs[1], frees, False)):
                groups = [points, *([p] for p in points)] if len(points) > 1 else [points]
                for group in groups if points else ():
                    try:
                        att.links.append((uprobe_multi.attach(
                            prog_fd, lib.attach_path, [p.file_offset for p in group],
                            [p.cookie for p in group], pid, session=session), session))
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        if len(group) == 1:
                            rest.append(group[0])
                        continue
                    modes.update((p.name, "session") for p in group)
                    if group is points:
                        break       # all in one link: no per-function retries
        for p in rest:
            try:
                self._attach_perf(att, pid, lib, p)
                modes[p.name] = "perf"
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                failed[p.name] = _EINVAL_HINT
        return modes, failed

    def _session_progs(self) -> tuple[int, int] | None:
        """Session mode's allocation and free programs, loaded at the first uprobe-tier attach: a
        recording of injected samplers never needs them (~0.1 s of verifier CPU at every start,
        2026-11-28). None, and perf mode from then on, when the kernel refuses them."""
        try:
            return (self._load_prog("alloc_session", PROG_KPROBE, uprobe_multi.BPF_TRACE_UPROBE_SESSION),
                    self._load_prog("free_multi", PROG_KPROBE, uprobe_multi.BPF_TRACE_UPROBE_MULTI))
        except OSError:
            self.session = False
            return None

    def _attach_perf(self, att: _Attachment, pid: int, lib: UprobeLibrary, p: UprobePoint) -> None:
        """Classic uprobe (+ uretprobe for allocation functions) through libbcc, passing
        ref_ctr_offset = 0 explicitly: bcc 0.26's Python binding omits that argument and the
        kernel then sees stack garbage (iovisor/bcc#5236)."""
        name = _PERF_ENTRY[p.fn].replace("_enter", "_d_enter") if p.delegates else _PERF_ENTRY[p.fn]
        probes = [(name, 0, p.file_offset)]
        if not p.fn.frees:
            probes.append(("alloc_return", 1, p.entry_offset))
        for prog, kind, offset in probes:
            prog_fd = self._load_prog(prog, PROG_KPROBE)
            ev = f"{tracefs.EVENT_PREFIX}{os.getpid()}_{pid}_{kind}_{offset:x}_{len(att.perf)}_{self._seq}".encode()
            self._seq += 1
            with files.stderr_to(os.devnull):   # libbcc prints its own line; ours (with the cause) replaces it
                fd = runtime().bpf_attach_uprobe(prog_fd, kind, ev, lib.attach_path.encode(), offset, pid, 0)
            if fd < 0:
                err = ctypes.get_errno() or errno.EINVAL
                raise OSError(err, f"uprobe at {lib.path}:{offset:#x}: {os.strerror(err)}")
            att.perf.append((fd, ev, not p.fn.frees))

    def _multi_prog(self, name: str) -> int:
        """usdt_memory (the otel_memory and pytorch probes, told apart by usdt_spec.kind) or
        cuda_call, loaded for uprobe_multi links."""
        return self._load_prog(name, PROG_KPROBE, uprobe_multi.BPF_TRACE_UPROBE_MULTI)

    def load_usdt(self) -> None:
        """Load the USDT program now (the verifier takes ~0.5 s), not at the first attach: injected
        samplers need it at once, before the process they went into allocates."""
        self._multi_prog("usdt_memory")

    def reserve_usdt(self, specs: Sequence[bytes]) -> None:
        """The argument layouts of the project's own samplers' probe sites: never crowded out."""
        for spec in specs:
            self._spec_table().reserved.add(self._spec_table().take(spec))

    def attach_usdt(self, pid: int, attach_path: str, sites: Sequence[UsdtSite], family: tuple | None = None) -> None:
        """Attach the preload tier's program to a file's otel_memory probe sites for one process.
        `family`: the file's identity when the sites are a family's (a --children target's):
        one link for every process that maps the file, made for its first member, so that a fork
        samples from its first call; its sites' specs carry USDT_FAMILY_LINK (memory_sites(...,
        family=True): usdt_memory counts only the family's targets through it). Raises OSError
        (the process is gone, the kernel refuses, or the file's or the process's probes have too
        many distinct argument layouts)."""
        if family is not None:
            fam = self._families.get(family)
            if fam is None:
                cookies = self._take_specs(sites, [], attach_path)
                refs = [s.semaphore for s in sites]
                try:
                    fd = uprobe_multi.attach(self._multi_prog("usdt_memory"), attach_path,
                                             [s.file_offset for s in sites], cookies, 0, session=False,
                                             ref_ctr_offsets=refs if any(refs) else None)
                except OSError:
                    self._spec_table().drop(cookies)
                    raise
                fam = self._families[family] = _Family(fd, cookies)
            fam.members.add(pid)
            return
        att = self._attached.setdefault(pid, _Attachment())
        cookies = self._take_specs(sites, att.specs, attach_path)
        refs = [s.semaphore for s in sites]
        try:
            fd = uprobe_multi.attach(self._multi_prog("usdt_memory"), attach_path, [s.file_offset for s in sites],
                                     cookies, pid, session=False, ref_ctr_offsets=refs if any(refs) else None)
        except OSError:
            self._spec_table().drop(cookies)
            raise
        att.links.append((fd, False))
        att.specs += cookies

    def has_family(self, family: tuple) -> bool:
        """The file (its identity) has a family's link."""
        return family in self._families

    def join_family(self, family: tuple, pid: int) -> bool:
        """`pid` (a fork of a member) is covered by the family's link, if it has one."""
        fam = self._families.get(family)
        if fam is not None:
            fam.members.add(pid)
        return fam is not None

    def _take_specs(self, sites: Sequence[UsdtSite], held: list[int], path: str) -> list[int]:
        """One `usdt_specs` slot per site (taken: dropped again when its link goes); bounded per
        file and per process."""
        values = [s.spec for s in sites]
        if len(set(values)) > USDT_SPECS_PER_FILE:
            raise OSError(errno.ENOSPC, f"{len(set(values))} distinct argument layouts in the memory probes of "
                                        f"{path}, over {USDT_SPECS_PER_FILE}: not attached")
        if len(set(held)) + len(set(values)) > USDT_SPECS_PER_TARGET:
            raise OSError(errno.ENOSPC, f"over {USDT_SPECS_PER_TARGET} distinct USDT argument layouts in one process")
        taken: list[int] = []
        try:
            for v in values:
                taken.append(self._spec_table().take(v))
        except OSError:
            self._spec_table().drop(taken)
            raise
        return taken

    def _spec_table(self) -> _UsdtSpecs:
        if self._specs is None:
            self._specs = _UsdtSpecs(self.bpf["usdt_specs"])
        return self._specs

    def attach_cuda(self, pid: int, attach_path: str, offsets: list[int], cookies: list[int]) -> None:
        """Trace CUDA calls of one library for one process (sampler/gpu/cuda.py): one link at the
        functions' entries, one at their returns. Raises OSError."""
        links = self._gpu_links.setdefault(pid, [])
        prog = self._multi_prog("cuda_call")
        entry = uprobe_multi.attach(prog, attach_path, offsets, cookies, pid, session=False)
        try:
            links.append(uprobe_multi.attach(prog, attach_path, offsets, cookies, pid,
                                             session=False, retprobe=True))
        except OSError:
            os.close(entry)
            raise
        links.append(entry)

    def attach_torch(self, pid: int, attach_path: str, sites: Sequence[UsdtSite]) -> None:
        """PyTorch's pytorch:malloc/free USDT sites of one file for one process (their semaphore
        is raised while attached). Raises OSError."""
        held = self._gpu_specs.setdefault(pid, [])
        cookies = self._take_specs(sites, held, attach_path)
        refs = [s.semaphore for s in sites]
        try:
            self._gpu_links.setdefault(pid, []).append(uprobe_multi.attach(
                self._multi_prog("usdt_memory"), attach_path, [s.file_offset for s in sites], cookies, pid,
                session=False, ref_ctr_offsets=refs if any(refs) else None))
        except OSError:
            self._spec_table().drop(cookies)
            raise
        held += cookies

    def hold_at_entry(self, pid: int, attach_path: str, offset: int) -> None:
        """Stop a TGT_HOLD process at its image's entry point (`offset` in the file) with a
        PROC_ENTRY event (proc.bpf.c hold_entry), until release_entry. Raises OSError (a kernel
        without uprobe_multi links among the reasons)."""
        self.release_entry(pid)
        self._entry_links[pid] = uprobe_multi.attach(self._multi_prog("hold_entry"), attach_path, [offset], [0],
                                                     pid, session=False)

    def release_entry(self, pid: int) -> None:
        if (fd := self._entry_links.pop(pid, None)) is not None:
            self._close_later(fd)       # closing waits for a grace period: not while the process is held

    def detach_gpu(self, pid: int) -> None:
        for fd in self._gpu_links.pop(pid, ()):
            os.close(fd)
        self._spec_table().drop(self._gpu_specs.pop(pid, []))

    def pause_allocs(self, pid: int) -> None:
        """Detach a process's allocation probes, keep its free probes (the governor's off phase:
        frees of blocks sampled before must still be seen)."""
        att = self._attached.get(pid)
        if att is None:
            return
        keep_links, keep_perf = [], []
        for fd, is_alloc in att.links:
            if is_alloc:
                os.close(fd)
            else:
                keep_links.append((fd, is_alloc))
        for fd, ev, is_alloc in att.perf:
            if is_alloc:
                runtime().bpf_close_perf_event_fd(fd)
                runtime().bpf_detach_uprobe(ev)
            else:
                keep_perf.append((fd, ev, is_alloc))
        att.links, att.perf = keep_links, keep_perf

    def detach_probes(self, pid: int, wait: bool = True) -> None:
        """Close a process's allocator probes, keep it a target (re-attach after an exec).
        `wait=False` (the process has exited): links are closed by background threads, as closing
        one waits for an RCU grace period (~40 ms per link here) that would otherwise stall the
        event loop."""
        for key, fam in list(self._families.items()):
            fam.members.discard(pid)
            if not fam.members:             # its last member: the family's link goes
                del self._families[key]
                if wait:
                    os.close(fam.fd)
                else:
                    self._close_later(fam.fd)
                self._spec_table().drop(fam.specs)
        att = self._attached.pop(pid, None)
        if att:
            for fd, _ in att.links:
                if wait:
                    os.close(fd)
                else:
                    self._close_later(fd)
            self._spec_table().drop(att.specs)
            for fd, ev, _ in att.perf:
                runtime().bpf_close_perf_event_fd(fd)
                runtime().bpf_detach_uprobe(ev)      # a tracefs event exists only without the PMU

    def _close_later(self, fd: int) -> None:
        # Several closers: concurrent closes share grace periods (60 links: 2.4 s by one thread,
        # 0.3 s by 16), and one closer fell behind a storm of exits on a slower machine.
        if len(self._closers) < _CLOSERS and self._closing.qsize() >= len(self._closers):
            t = threading.Thread(target=_close_fds, args=(self._closing,), name="link-closer", daemon=True)
            t.start()
            self._closers.append(t)
        self._closing.put(fd)

    def detach(self, pid: int, wait: bool = True, mappings: bool = True, bpf_gone: bool = False) -> None:
        """Close a process's probes and stop tracing its syscalls (`wait`: see detach_probes).
        `mappings=False`: it has no sampled mapping in `vm_live` (none was reported, and none of
        its events was lost), whose walk is then saved: most of a fork storm's exits.
        `bpf_gone`: its exit event came (BPF dropped its `targets` entry at the exit)."""
        self.detach_probes(pid, wait)
        self.detach_gpu(pid)
        self.release_entry(pid)
        key = ctypes.c_uint32(pid)
        if not mappings:
            with contextlib.suppress(KeyError):
                mappings = self.bpf["drops"][key].lost_events > 0
        # drops too: its entries are created by BPF and would fill the map over a long run; the
        # others only where they exist (a fork storm's exits make few syscalls)
        tabs = [] if bpf_gone else [self._targets]
        if pid in self._hits_pids:
            self._hits_pids.discard(pid)
            tabs.append(self.bpf["pid_hits"])
        for tab in (*tabs, self.bpf["drops"]):
            with contextlib.suppress(KeyError):
                del tab[key]
        if mappings and wait:
            self.forget_mappings(pid)
        elif mappings:
            self._exited_mappings.add(pid)      # one walk of vm_live for a poll's exits (fork storms)

    def forget_mappings(self, *pids: int) -> None:
        """Drop processes' sampled mappings from `vm_live` (they exited or exec'd); walks the
        table, which holds only sampled mappings (few)."""
        tab = self.bpf["vm_live"]
        for k in [k for k in tab if k.pid in pids]:
            with contextlib.suppress(KeyError):
                del tab[k]

    # governor ------------------------------------------------------------------------------
    def _ensure_hits(self, pid: int) -> None:
        self._hits_pids.add(pid)
        tab = self.bpf["pid_hits"]
        key = ctypes.c_uint32(pid)
        try:
            tab[key]
        except KeyError:
            vs = tab.Leaf()             # zero on every CPU, with the process's shift
            try:
                shift = self._targets[key].shift
            except KeyError:
                shift = 0
            for v in vs:
                v.shift = shift
            tab[key] = vs

    def hits(self) -> dict[int, tuple[int, int]]:
        """pid -> (allocation probe hits, free probe hits) so far, summed over CPUs."""
        return {k.value: (sum(v.alloc for v in vs), sum(v.free for v in vs))
                for k, vs in self.bpf["pid_hits"].items()}

    # page faults -----------------------------------------------------------------------------
    def enable_faults(self, period: int, select_all: bool = False, cgroup_ids=()) -> None:
        """Start sampling user page faults on every CPU (once), one in `period`. Processes are
        those added with TargetFlag.FAULTS, or all, or those in the given cgroups (v2 ids)."""
        cfg = self.bpf["fault_cfg"]
        mode = 1 if select_all else 2 if cgroup_ids else 0
        cfg[ctypes.c_int(0)] = ctypes.c_uint64(mode)
        cfg[ctypes.c_int(1)] = ctypes.c_uint64(os.getpid())
        cgs = self.bpf["fault_cgroups"]
        for cg in cgroup_ids:
            cgs[ctypes.c_uint64(cg)] = ctypes.c_uint32(1)
        if self._faults_on:
            return
        try:
            self._walker(PROG_PERF_EVENT)
            self.bpf.attach_perf_event("on_page_fault", PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS, period)
        except Exception as e:
            raise EnvironmentProblem(f"could not open the page-fault perf event ({e}): check "
                                     "/proc/sys/kernel/perf_event_paranoid and that perf events exist "
                                     "in this kernel (CONFIG_PERF_EVENTS)") from None
        self._faults_on = True

    # CPython targets ------------------------------------------------------------------------
    def set_python(self, pid: int, layout: bytes | None) -> None:
        """The frame-chain layout of a CPython process (sampler/python/runtime.PyLayout), or None."""
        tab = self.bpf["pyprocs"]
        tab.put(tab.Key(pid), None if layout is None else tab.Leaf.from_buffer_copy(layout))

    def set_python_threads(self, add: dict[int, int], remove=()) -> None:
        """Thread id -> PyThreadState address, for the BPF Python walk."""
        tab = self.bpf["pythreads"]
        for tid in remove:
            tab.put(tab.Key(tid), None)
        for tid, tstate in add.items():
            tab.put(tab.Key(tid), tab.Leaf(tstate))

    def set_stack_hint(self, pid: int, nbytes: int | None) -> None:
        """Stack bytes to copy per sample of `pid` (None: the configured maximum)."""
        tab = self.bpf["stack_hint"]
        tab.put(tab.Key(pid), None if nbytes is None else tab.Leaf(nbytes))

    def forget_live(self, pid: int, addrs) -> None:
        """Drop sampled-live entries of a process that exited or exec'd."""
        key = self._live.Key()
        key.pid = pid
        for a in addrs:
            key.addr = a
            with contextlib.suppress(KeyError):
                del self._live[key]

    def forget_pid(self, pid: int) -> None:
        """Drop every sampled-live entry of a process whose events were never read (the probe
        cost calibration's child); walks the table."""
        for k in [k for k in self._live if k.pid == pid]:
            with contextlib.suppress(KeyError):
                del self._live[k]

    # events and counters -------------------------------------------------------------------
    def open_events(self, handle: Callable[[bytes], None]) -> None:
        events = self.bpf["events"]
        self._ring = RingReader(events.fd, events.max_entries)
        self._handle = handle

    def poll(self, timeout_ms: int) -> None:
        """Read what is there, then wait up to `timeout_ms` for the programs to wake the reader
        (they do once an eighth of the ring buffer waits: common.h rb_flags) and read again: one
        pass per batch of records, not per record. Under a burst faster than Python reads, a read
        stops after the time budget (else no snapshot and no stop would come); the rest is read at
        the next call, which then does not wait."""
        if self._exited_mappings:
            exited, self._exited_mappings = self._exited_mappings, set()
            self.forget_mappings(*exited)
        deadline = time.monotonic() + max(timeout_ms, 50) / 1000
        if not self._ring.read(self._handle, deadline):
            self._ring.wait(timeout_ms)
            self._ring.read(self._handle, deadline)

    def drain(self, budget_s: float = 1.0) -> None:
        """Read what is in the ring buffer now (bounded in time, like poll)."""
        self._ring.read(self._handle, time.monotonic() + budget_s)

    def counters(self) -> list[int]:
        tab = self.bpf["counters"]
        return [sum(tab[ctypes.c_int(i)]) for i in range(Counter.N)]

    def drops(self) -> dict[int, tuple[int, int, int, int]]:
        """pid -> (lost events, samples not tracked because the live table was full, unsampled
        syscall events not sent because the process was over its budget, samples drawn)."""
        return {k.value: (v.lost_events, v.live_full, v.vm_suppressed, v.sampled)
                for k, v in self.bpf["drops"].items()}

    def forget_drops(self, pids: list[int]) -> None:
        """Drop the accounting entries of processes no longer recorded (BPF creates them: a
        family's root keeps one while its forks spend its budget, after its own exit)."""
        tab = self.bpf["drops"]
        for pid in pids:
            with contextlib.suppress(KeyError):
                del tab[ctypes.c_uint32(pid)]

    def close(self) -> None:
        members = (m for f in self._families.values() for m in f.members)
        for pid in {*self._attached, *self._gpu_links, *self._entry_links, *members}:
            self.detach(pid)
        for _ in self._closers:
            self._closing.put(None)
        for t in self._closers:
            t.join()
        if self._ring is not None:
            self._ring.close()
        self.bpf.close()


_CLOSERS = 16


def _close_fds(fds: queue.SimpleQueue) -> None:
    while (fd := fds.get()) is not None:
        os.close(fd)              # releases the GIL while the kernel waits


MADV_PAGEOUT = 21


def _release_compiler_memory() -> None:
    """After the compile (or the load from the cache) of a recording, give back what clang/LLVM held:
    freed heap (malloc_trim) and the compiler libraries' resident pages (~80 MiB of the recorder's
    RSS after a compile, ~40 MiB after merely loading libbcc, whose LLVM runs static initializers).
    MADV_PAGEOUT only reclaims (clean file pages are dropped, anything else would go to swap), so
    it never changes memory contents; LLVM pages come back from the page cache if bcc compiles
    again."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with contextlib.suppress(AttributeError):
        libc.malloc_trim(0)
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or not os.path.basename(parts[5]).startswith(("libLLVM", "libclang")):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        libc.madvise(lo, hi - lo, MADV_PAGEOUT)      # errors (old kernels: EINVAL) are harmless


# Where the kernel keeps a thread's pending uretprobes (their trampolines in its stack), by BTF.
_URETPROBE_MEMBERS = {"task_struct": ("utask",), "uprobe_task": ("return_instances",),
                      "return_instance": ("stack", "orig_ret_vaddr", "next")}


def _uretprobe_flags() -> list[str]:
    """-D flags with the offsets that let capture_user (common.h) restore the return address any
    uretprobe replaced (another tool's too); none when the kernel's BTF lacks one of them."""
    off = btf.struct_offsets(_URETPROBE_MEMBERS)
    names = [(s, m) for s, ms in _URETPROBE_MEMBERS.items() for m in ms]
    if any(k not in off for k in names):
        return []
    return [f"-DRI_{s.upper()}_{m.upper()}={off[s, m]}" for s, m in names]


def _exit_has_group_dead() -> bool:
    base = tracefs.root()
    try:
        return base is not None and "group_dead" in (base / "events/sched/sched_process_exit/format").read_text()
    except OSError:
        return False
