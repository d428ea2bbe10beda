"""The recording loop: targets -> BPF events -> outstanding tables -> Parquet every interval."""

from __future__ import annotations

import bisect
import contextlib
import datetime as dt
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from sampler import __version__
from sampler.bpf import preflight
from sampler.bpf.abi import Counter, EvFlag, EvType, ProcOp, Source, TargetFlag, VmOp
from sampler.bpf.events import decode
from sampler.bpf.loader import BpfProbes, ProbeConfig
from sampler.control import probe_cost
from sampler.control.governor import Governor
from sampler.control.sample_rate import SampleRate
from sampler.control.weights import chunk_size, sample_terms
from sampler.dataset.schema import (
    FRAMES,
    GPU,
    GPU_EVENTS,
    MALLOC_ARENAS,
    OUTSTANDING,
    PROCESSES,
    RECORDER,
    RECORDINGS,
    SCHEMA_VERSION,
    STACKS,
    TARGETS,
    VM_EVENTS,
)
from sampler.dataset.writer import DatasetWriter
from sampler.errors import EnvironmentProblem, TargetGone
from sampler.gpu.cuda import GpuTracer
from sampler.probes import usdt
from sampler.probes.allocators import AllocatorLib, Family, find_allocators
from sampler.proc.arenas import arena_rows
from sampler.proc.cgroups import cgroup_id
from sampler.proc.maps import Mapping, open_path, read_maps
from sampler.proc.memory import sample_process
from sampler.proc.process import LaunchedCommand, ProcessInfo, check_pid, is_process, read_info
from sampler.proc.smaps import ARENA, HEAP
from sampler.python.targets import PythonTargets
from sampler.record.outstanding import FAULT, MALLOC, MMAP, TORCH, ProcessTable
from sampler.record.vm_events import MADV_DONTNEED, MADV_FREE, VmClassifier
from sampler.stacks.symbolize import Symbolizer
from sampler.stacks.table import COMPLETE, StackTable
from sampler.stacks.unwind import Unwinder

_VM_NAME = {op.value: op.name.lower() for op in VmOp}
MADV_REMOVE = 9
PROT_EXEC, MAP_ANONYMOUS = 4, 0x20
# Tiers (processes.tier).
ATTACH, PRELOAD, RSS, SYSCALLS = "attach", "preload", "rss", "syscalls"
GOVERNOR_TICK_S = 1.0
SAMPLING_TICK_S = 0.25     # a burst of samples fills the ring buffer within a second


@dataclass
class RecordOptions:
    out: str
    pids: list[int] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    duration: float | None = None
    interval: float = 10.0
    sample_mean: int = 512 * 1024
    children: bool = False
    allocators: tuple[Family, ...] = ()
    syscalls_only: bool = False
    probe_mode: str = "auto"
    live_max: int = 262144
    max_frames: int = 127                 # native frames unwound per stack
    stack_bytes: int = 16 << 10           # user stack copied per sampled event
    python: bool = True                   # read Python frames of CPython targets
    interpreter_frames: bool = False      # keep libpython frames between Python frames
    unwind_cache: str | None = None       # directory for the per-build-id unwind tables
    vm_events_per_interval: int = 20000
    vm_events_per_s: int = 2000           # unsampled syscall events sent per process (BPF budget)
    max_samples_per_s: int = 2000         # per process: its mean is raised above (0: no cap)
    rss: bool = False                     # always-on tier: sampled page faults, no uprobes
    fault_period: int = 61                # one fault sampled in this many (prime: no aliasing
                                          # with loops that fault a power of two of pages)
    cgroups: list[str] = field(default_factory=list)   # always-on tier for these cgroups
    all_processes: bool = False           # always-on tier for every process
    preload: bool = False                 # start the command with the preload shim
    cpu_budget: float = 0.03              # governor: fraction of one CPU per process (0: off)
    probe_cost_ns: float | None = None    # per probe hit; None: calibrate at start-up
    ringbuf_bytes: int = 32 << 20         # BPF ring buffer (mapped twice: counts 2x in RSS)
    daemon: bool = False                  # sampler/service/daemon.py: runs without targets, adds its own
    quiet: bool = False
    argv: str = ""
    gpu: bool = True                      # trace CUDA calls and sample NVML (sampler/gpu/cuda.py)


@dataclass
class _Target:
    info: ProcessInfo
    table: ProcessTable = field(default_factory=ProcessTable)
    # (path, build_id) -> the library as attached, None when attaching failed (not retried).
    # Attachments outlive exec: uprobes are bound to the file and the task.
    attached: dict[tuple, AllocatorLib | None] = field(default_factory=dict)
    libs: list[AllocatorLib] = field(default_factory=list)   # probed libraries mapped now
    modes: dict[str, str] = field(default_factory=dict)  # function -> session | perf
    failures: list[str] = field(default_factory=list)    # why probes could not be attached
    vm: VmClassifier = field(default_factory=VmClassifier)
    rescan_until: float = 0.0
    warned: bool = False                                 # "no probeable allocator" said once
    py_checked: bool = False                             # Python detection done for this image
    drops: tuple[int, int, int, int] = (0, 0, 0, 0)      # lost events, live table full, vm
                                                         # suppressed, samples drawn (BPF counts)
    reconciled: int = 0                                  # vm suppressed at the last reconciliation
    tier: str = ATTACH
    usdt: set[tuple] = field(default_factory=set)        # files whose otel_memory probes are attached
    usdt_labels: list[str] = field(default_factory=list)
    duty: float = 1.0                                    # governor: malloc weights are divided by it
    coverage: float | None = None                        # of the last interval
    hits: int = 0                                        # probe hits at the last snapshot
    hit_rate: float = 0.0                                # per second, last interval
    allocs_on: bool = True                               # allocation probes attached (governor)


class Recorder:
    def __init__(self, opts: RecordOptions):
        self.opts = opts
        self.host = socket.gethostname()
        self.started = dt.datetime.now(dt.timezone.utc)
        self.recording_id = f"{self.started:%Y%m%dT%H%M%SZ}-{os.getpid()}"
        self.targets: dict[int, _Target] = {}
        self.finished: list[tuple[ProcessInfo, str]] = []
        self._stop = False
        self._vm_rows: list[dict] = []
        self._vm_dropped = 0
        self._events = 0
        self._mono_to_wall_ns = time.time_ns() - time.monotonic_ns()
        self._gone: set[int] = set()           # host-wide pids that exited before adoption
        self._fault_period_used = opts.rss or opts.all_processes or bool(opts.cgroups)
        self._proc = psutil.Process()
        self.launched: LaunchedCommand | None = None
        # Set by the daemon (sampler/service/daemon.py) before run(): how files are written, and what runs
        # once BPF is loaded, at every poll and after every interval's snapshot.
        self.writer_factory: Callable[[str, str], DatasetWriter] = DatasetWriter
        self.on_start: Callable[[], None] | None = None
        self.on_tick: Callable[[float], None] | None = None
        self.on_snapshot: Callable[[], None] | None = None

    # ----------------------------------------------------------------------------------------
    def run(self) -> int:
        o = self.opts
        preflight.check_all()
        infos = [check_pid(p) for p in dict.fromkeys(o.pids)]
        if o.command:
            env = None
            if o.preload:
                from sampler.inprocess.preload import preload_env
                env = preload_env(o.sample_mean)
            self.launched = LaunchedCommand(o.command, env)
            infos.append(read_info(self.launched.pid))
        try:
            return self._record(infos)
        finally:
            if self.launched is not None:   # a command we started ends with its recording
                self.launched.stop()

    def _record(self, infos: list[ProcessInfo]) -> int:
        o = self.opts
        self.probes = BpfProbes(ProbeConfig(o.sample_mean, live_max=o.live_max, mode=o.probe_mode,
                                            stack_bytes=o.stack_bytes, ringbuf_bytes=o.ringbuf_bytes,
                                            vm_events_per_s=o.vm_events_per_s,
                                            cache_dir=_cache_dir(None, "bpf")))
        self.sample_rate = SampleRate(o.max_samples_per_s)
        self.symbolizer = Symbolizer()
        self.python = PythonTargets(self.probes) if o.python else None
        self.unwinder = Unwinder(_cache_dir(o.unwind_cache))
        self.stacks = StackTable(self.symbolizer, self.unwinder, self.python, o.max_frames,
                                 interpreter_frames=o.interpreter_frames)
        self._samples = self._complete = 0
        self._hints: dict[int, int | None] = {}
        self.writer = self.writer_factory(o.out, self.recording_id)
        self.gpu: GpuTracer | None = None
        if o.gpu:
            from sampler.gpu.nvml import Nvml
            self.gpu = GpuTracer(self.probes, Nvml(), o.vm_events_per_interval)
        self._gpu_said = False
        self.governor: Governor | None = None
        self._cost_ns: float | None = None
        self._cgroup_ids = [cgroup_id(c) for c in o.cgroups]
        if o.rss or o.all_processes or o.cgroups:
            self.probes.enable_faults(o.fault_period, o.all_processes, self._cgroup_ids)
        if o.cpu_budget > 0 and not (o.rss or o.syscalls_only):
            self._cost_ns, link_ns, how = (
                (o.probe_cost_ns, probe_cost.DEFAULT_LINK_NS, "given") if o.probe_cost_ns
                else probe_cost.calibrate(self.probes, _cache_dir(o.unwind_cache, "")))
            self.governor = Governor(o.cpu_budget, self._cost_ns, link_ns=link_ns)
            if not o.quiet:
                print(f"allocsampler: probe cost {self._cost_ns / 1000:.2f} us per hit, +{link_ns / 1000:.2f} us "
                      f"per other target probed on the same library ({how}); budget "
                      f"{100 * o.cpu_budget:g}% of a CPU per process", file=sys.stderr)
        self._write_recording(ended=None)
        self.probes.open_events(self._on_event)
        try:
            if self.on_start is not None:
                self.on_start()
            for info in infos:
                self._add_target(info)
            if not self.targets and (o.all_processes or o.cgroups or o.daemon):
                pass                    # processes join as they fault
            elif not self.targets:
                raise TargetGone(f"every target exited while being attached ({', '.join(str(i.pid) for i in infos)}): "
                                 "nothing to record")
            if not any(t.libs or t.usdt for t in self.targets.values()) and not o.syscalls_only \
                    and not o.rss and not self.launched and self.targets:
                t = next(iter(self.targets.values()))
                if t.failures:
                    raise EnvironmentProblem(f"pid {t.info.pid} ({t.info.comm}): {t.failures[0]}")
                raise EnvironmentProblem(
                    f"pid {t.info.pid} ({t.info.comm}): no probeable allocator (statically linked or "
                    "stripped: no malloc symbol in any mapped file); name the allocator library with "
                    "--allocator LIB[:PREFIX], or record only mmap/brk with --syscalls-only")
            if self.launched:
                self.launched.resume()
            self._loop()
        finally:
            self._finish()
        return 0

    def _loop(self) -> None:
        o = self.opts
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        deadline = time.monotonic() + o.duration if o.duration else None
        next_snap = time.monotonic() + o.interval
        self._last_snap = time.monotonic()
        self._last_counters = self.probes.counters()
        self._last_cpu = sum(self._proc.cpu_times()[:2])
        self._next_gov = time.monotonic() + GOVERNOR_TICK_S
        self._next_sampling = time.monotonic() + SAMPLING_TICK_S
        host_wide = o.all_processes or bool(o.cgroups)
        while not self._stop and (self.targets or host_wide or o.daemon):
            self.probes.poll(100)
            now = time.monotonic()
            self._rescan(now)
            self._reap_launched()
            if self.on_tick is not None:
                self.on_tick(now)
            if self.governor is not None:
                observe = now >= self._next_gov
                self._govern(now, observe)
                if observe:
                    self._next_gov = now + GOVERNOR_TICK_S
            if now >= self._next_sampling:
                self._tune_sampling(now)
                self._next_sampling = now + SAMPLING_TICK_S
            if deadline is not None and now >= deadline:
                break
            if now >= next_snap:
                self._rescan(now, every=True)
                self._snapshot()
                if self.on_snapshot is not None:
                    self.on_snapshot()
                next_snap += o.interval
                if next_snap < now:
                    next_snap = now + o.interval

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    # the daemon's calls (sampler/service/daemon.py) ---------------------------------------------------
    def add_process(self, info: ProcessInfo, tier: str) -> bool:
        """Start recording a process the daemon selected; False when it exited meanwhile."""
        if tier == RSS:
            self.probes.enable_faults(self.opts.fault_period)
            self._fault_period_used = True
        self._add_target(info, tier)
        return info.pid in self.targets

    def remove_process(self, pid: int, event: str = "exit", detail: str = "") -> None:
        """Stop recording a process (it exited, or no longer matches): its last outstanding rows,
        a `targets` row, probes detached."""
        t = self.targets.get(pid)
        if t is None:
            return
        self._write(OUTSTANDING, self._outstanding_rows(t, self._wall_now()))
        self._target_row(t, event, detail)
        self._drop_target(pid, detail or event, exited=event == "exit")

    def note(self, pid: int, event: str, detail: str) -> None:
        """A `targets` row about a recorded process."""
        if (t := self.targets.get(pid)) is not None:
            self._target_row(t, event, detail)

    def raise_detail(self, pid: int, until: float, sample_mean: int | None = None) -> bool:
        """Pre-OOM capture until `until` (monotonic): the process is sampled at `sample_mean` or
        the next power-of-two fraction of the recording's mean below it (the sample-rate cap
        still applies), and a duty-cycled attach-tier process gets its allocation probes all the
        time (the governor waits). Returns whether anything changed."""
        t = self.targets.get(pid)
        if t is None:
            return False
        changed = False
        if sample_mean and sample_mean < self.opts.sample_mean:
            shift = -math.ceil(math.log2(self.opts.sample_mean / sample_mean))
            new = self.sample_rate.lower(pid, shift, until)
            if new is not None:
                self._set_shift(t, new, self.sample_rate.why(pid))
                changed = True
        if self.governor is not None and t.tier == ATTACH:
            actions = self.governor.pin(pid, time.monotonic(), until)
            self._apply(t, actions)
            changed |= bool(actions)
        return changed

    def snapshot_now(self) -> None:
        """An extra snapshot of every target (an interval shorter than the others)."""
        self._snapshot()

    def idle(self, seconds: float) -> None:
        """Pause reading events (the daemon's own CPU budget): the ring buffer fills meanwhile
        (a full one counts lost events); governed probes are still switched on time."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            if self.governor is not None:
                observe = now >= self._next_gov
                self._govern(now, observe)
                if observe:
                    self._next_gov = now + GOVERNOR_TICK_S
            if now >= self._next_sampling:      # the cap matters most while events wait
                self._tune_sampling(now)
                self._next_sampling = now + SAMPLING_TICK_S
            time.sleep(min(0.05, end - now))

    # targets ----------------------------------------------------------------------------------
    def _add_target(self, info: ProcessInfo, tier: str | None = None) -> None:
        pid = info.pid
        tier = tier or (RSS if self.opts.rss else SYSCALLS if self.opts.syscalls_only else ATTACH)
        t = self.targets[pid] = _Target(info, tier=tier)
        self.probes.add_target(pid, TargetFlag.SYSCALLS | (TargetFlag.FAULTS if tier == RSS else 0))
        if self.governor is not None and tier == ATTACH:
            self.governor.add(pid, time.monotonic())
        self.sample_rate.add(pid, time.monotonic())
        try:
            self._attach_gpu(t, self._attach_allocators(t))
        except ProcessLookupError:
            self._drop_target(pid, "exited while being attached", exited=True)
            return
        self._detect_python(t, final=True)
        self._target_row(t, "attach", self._attach_detail(t))

    def _detect_python(self, t: _Target, final: bool) -> None:
        """Start reading Python frames when the target runs CPython. Right after an exec the
        interpreter may not be initialized yet: retried quietly until `final`."""
        if self.python is None or t.py_checked:
            return
        why = self.python.add(t.info.pid)
        if self.python.known(t.info.pid) or final:
            t.py_checked = True
            if why:
                self._warn(t, why)

    def _attach_allocators(self, t: _Target) -> list[Mapping] | None:
        """Returns the maps it read, for _attach_gpu (None: this tier reads none)."""
        pid = t.info.pid
        if t.tier in (RSS, SYSCALLS):
            return None
        libs, maps = find_allocators(pid, self.opts.allocators)
        if self._attach_usdt(t, maps) or t.tier == PRELOAD:
            return maps
        for lib in libs:
            ident = (lib.path, lib.build_id)
            if ident in t.attached:
                continue
            t.attached[ident] = None
            try:
                modes, failed = self.probes.attach(pid, lib)
            except OSError as e:
                if not os.path.exists(f"/proc/{pid}"):
                    raise ProcessLookupError(pid) from None
                modes, failed = {}, {p.name: str(e) for p in lib.points}
            t.modes.update(modes)
            for why in dict.fromkeys(failed.values()):
                names = ", ".join(n for n, w in failed.items() if w == why)
                t.failures.append(f"could not probe {names} in {lib.path}: {why}")
                self._warn(t, t.failures[-1])
            if modes:
                t.attached[ident] = lib
        t.libs = [a for lib in libs if (a := t.attached.get((lib.path, lib.build_id)))]
        if not libs and not t.libs and not t.rescan_until and not t.warned:
            t.warned = True
            self._warn(t, "no probeable allocator (statically linked or stripped: no malloc symbol in "
                          "any mapped file); only mmap/brk are recorded. Name the allocator library "
                          "with --allocator LIB[:PREFIX].")
        return maps

    def _attach_gpu(self, t: _Target, maps: list[Mapping] | None) -> bool:
        """CUDA runtime/driver probes and PyTorch's USDT probes, in every tier (CUDA calls are
        rare). `maps`: as _attach_allocators read them, None to read them here. Returns whether new
        ones were attached. ProcessLookupError: the process is gone."""
        if self.gpu is None:
            return False
        if t.tier in (RSS, SYSCALLS) and t.info.pid in self.gpu.targets and not t.rescan_until:
            return False        # host-wide tiers: rescan only when the process maps new code
        new, warnings = self.gpu.scan(t.info.pid, read_maps(t.info.pid) if maps is None else maps)
        for w in warnings:
            self._warn(t, w)
        if new and not self._gpu_said and not self.opts.quiet and not self.gpu.nvml.ok:
            self._gpu_said = True         # the one line about the missing driver, when it matters
            print(f"allocsampler: {self.gpu.status}", file=sys.stderr)
        return new

    def _attach_usdt(self, t: _Target, maps) -> bool:
        """Preload tier: a process carrying otel_memory probes samples its own allocations. Its
        allocator uprobes would count them again: they are dropped. Returns whether it has them."""
        found = []
        seen = set()
        for m in maps:
            ident = (m.dev, m.inode, m.path)
            if not m.executable or not m.path.startswith("/") or ident in seen or ident in t.usdt:
                continue
            seen.add(ident)
            probes = usdt.memory_probes(open_path(t.info.pid, m))
            if probes:
                found.append((ident, m, probes))
        if not found:
            return False
        if t.tier == ATTACH:
            self._leave_attach(t, PRELOAD, f"carries otel_memory USDT probes ({found[0][1].path}): "
                                           "recorded from its own samples, no allocator uprobes")
        for ident, m, probes in found:
            try:
                self.probes.attach_usdt(t.info.pid, open_path(t.info.pid, m), probes)
            except OSError as e:
                if not os.path.exists(f"/proc/{t.info.pid}"):
                    raise ProcessLookupError(t.info.pid) from None
                t.failures.append(f"could not attach the otel_memory probes of {m.path}: {e}")
                self._warn(t, t.failures[-1])
                continue
            t.usdt.add(ident)
            t.usdt_labels += [f"{p.label} (usdt, multi)" for p in probes]
        return True

    def _leave_attach(self, t: _Target, tier: str, why: str) -> None:
        """Move a target out of the attach tier: its allocator probes go, and with them the
        sampled blocks whose frees could no longer be seen."""
        pid = t.info.pid
        self.probes.detach_probes(pid)
        self.probes.forget_live(pid, t.table.drop_malloc())
        t.attached.clear()
        t.libs = []
        t.modes = {}
        t.duty, t.coverage = 1.0, None
        t.tier = tier
        if self.governor is not None:
            self.governor.forget(pid)
        if tier == RSS:
            self.probes.add_target(pid, TargetFlag.SYSCALLS | TargetFlag.FAULTS)
            self.probes.enable_faults(self.opts.fault_period)
            self._fault_period_used = True
        self._target_row(t, "tier", f"{tier}: {why}")

    def _attach_detail(self, t: _Target) -> str:
        skipped = [f"{name} ({why})" for lib in t.libs for name, why in lib.skipped]
        return ("not probed: " + "; ".join(skipped)) if skipped else ""

    def _rescan(self, now: float, every: bool = False) -> None:
        """After an exec the new image maps its libraries a moment later; dlopen can add an
        allocator any time. Rescan recent execs at every poll, `every` target once per interval."""
        for t in list(self.targets.values()):
            if t.rescan_until and now >= t.rescan_until:
                t.rescan_until = 0.0        # the exec window is over: warn if still nothing
            if every or t.rescan_until:
                n = len(t.libs)
                try:
                    new_gpu = self._attach_gpu(t, self._attach_allocators(t))
                except ProcessLookupError:
                    continue
                self._detect_python(t, final=not t.rescan_until)
                if len(t.libs) > n or new_gpu:
                    self._target_row(t, "attach", self._attach_detail(t))

    def _adopt(self, pid: int) -> _Target | None:
        """A process selected host-wide (--all, --cgroup) that the fault program saw first."""
        if pid in self._gone:
            return None
        try:
            info = read_info(pid)
        except ProcessLookupError:
            self._gone.add(pid)
            return None
        self._add_target(info, RSS)
        return self.targets.get(pid)

    def _govern(self, now: float, observe: bool) -> None:
        """Feed probe hits to the governor (`observe`: once a second) and apply what it decides
        (every poll: duty-cycle phases are a fraction of a second)."""
        hits = self.probes.hits() if observe else {}
        if observe:
            self._price_shared_links()
        for pid, t in list(self.targets.items()):
            if t.tier != ATTACH:
                continue
            if observe:
                self.governor.observe(pid, now, hits.get(pid, (0, 0)))
            actions = self.governor.tick(pid, now)
            if actions:
                self._apply(t, actions)

    def _tune_sampling(self, now: float) -> None:
        """The sample-rate cap (sampler/control/sample_rate.py), at every SAMPLING_TICK_S: samples drawn
        per process, counted in BPF (what user space reads lags behind under a burst)."""
        drops = self.probes.drops()
        for pid, t in list(self.targets.items()):
            t.drops = drops.get(pid, t.drops)
            new = self.sample_rate.observe(pid, now, t.drops[3])
            if new is not None:
                self._set_shift(t, new, self.sample_rate.why(pid))

    def _set_shift(self, t: _Target, shift: int, why: str) -> None:
        self.probes.set_sample_shift(t.info.pid, shift)
        self._target_row(t, "sampling", f"sample mean {self.sample_mean(t.info.pid)} bytes ({why})")

    def sample_mean(self, pid: int) -> int:
        """The process's sampling mean now (bytes)."""
        return round(self.opts.sample_mean * 2.0 ** self.sample_rate.shift(pid))

    def _price_shared_links(self) -> None:
        """A hit also runs the links of the other targets on the same library: tell the governor
        how many there are for each target (the most over its libraries)."""
        users: dict[tuple, int] = {}
        for t in self.targets.values():
            for lib in t.libs:
                users[(lib.path, lib.build_id)] = users.get((lib.path, lib.build_id), 0) + 1
        for pid, t in self.targets.items():
            if t.tier == ATTACH:
                self.governor.sharing(pid, max((users[(lib.path, lib.build_id)] - 1 for lib in t.libs), default=0))

    def _apply(self, t: _Target, actions) -> None:
        """Bring the allocation probes to the governor's state. Order matters for the weights:
        probes are paused before the ring buffer is drained and the duty changed, and resumed
        after."""
        pid = t.info.pid
        st = self.governor.states.get(pid)
        want_on = st is not None and st.on
        if t.allocs_on and not want_on:
            self.probes.pause_allocs(pid)
            t.allocs_on = False
        for a in actions:
            if a.kind == "rss":
                self.probes.drain()
                self._leave_attach(t, RSS, a.reason)
                return
            if a.kind == "duty":
                self.probes.drain()
                t.duty = self.governor.duty(pid)
                self._target_row(t, "governor", a.reason)
        if want_on and not t.allocs_on:
            for lib in t.libs:
                with contextlib.suppress(OSError):      # exiting: its exit event follows
                    self.probes.attach(pid, lib, allocs_only=True)
            t.allocs_on = True

    def _drop_target(self, pid: int, why: str, exited: bool = False) -> None:
        t = self.targets.pop(pid, None)
        # an exited process makes no more hits: its links may close in the background
        self.probes.detach(pid, wait=not exited)
        if self.governor is not None:
            self.governor.forget(pid)
        if self.gpu is not None:
            self.gpu.forget(pid)
        self.sample_rate.forget(pid)
        if t is None:
            return
        self.probes.forget_live(pid, t.table.live_addresses())
        self.stacks.forget(pid)
        if self.python is not None:
            self.python.forget(pid)
        if self._hints.pop(pid, None) is not None:
            self.probes.set_stack_hint(pid, None)
        self.finished.append((t.info, why))

    def _warn(self, t: _Target, msg: str) -> None:
        self._target_row(t, "warning", msg)
        if not self.opts.quiet:
            print(f"allocsampler: warning: pid {t.info.pid} ({t.info.comm}): {msg}", file=sys.stderr)

    def _reap_launched(self) -> None:
        if self.launched is None or self.launched.pid not in self.targets:
            return
        if self.launched.poll() is not None:
            self.probes.drain()
            self._exit(self.launched.pid)

    def _exit(self, pid: int, write_rows: bool = True) -> None:
        t = self.targets.get(pid)
        if t is None:
            return
        if write_rows:    # not when the interval's snapshot already has its rows
            self._write(OUTSTANDING, self._outstanding_rows(t, self._wall_now()))
        status = ""
        if self.launched and self.launched.pid == pid:
            # the exit tracepoint fires just before the parent can reap it
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = f"exit status {self.launched.proc.wait(2)}"
        self._target_row(t, "exit", status)
        self._drop_target(pid, status or "exited", exited=True)

    # events -----------------------------------------------------------------------------------
    def _on_event(self, raw: bytes) -> None:
        self._events += 1
        ev = decode(raw)
        t = self.targets.get(ev.pid)
        if t is None and (ev.source != Source.FAULT or (t := self._adopt(ev.pid)) is None):
            return
        if ev.flags & EvFlag.PY_MISS and self.python is not None:
            self.python.refresh(ev.pid)        # a thread started since the last walk
        if ev.type == EvType.ALLOC:
            if ev.source == Source.FAULT:
                t.table.map(ev.addr, ev.size, ev.weight, self._intern(ev), ev.ts_ns, FAULT)
            elif ev.source == Source.TORCH:         # not governed: no duty
                t.table.alloc(ev.addr, ev.size, ev.weight, self._intern(ev), ev.ts_ns, TORCH)
            else:
                t.table.alloc(ev.addr, ev.size, ev.weight / t.duty, self._intern(ev), ev.ts_ns)
        elif ev.type == EvType.FREE:
            t.table.free(ev.addr, ev.arg)
        elif ev.type == EvType.VM:
            self._on_vm(t, ev)
        elif ev.type == EvType.PROC:
            self._on_proc(t, ev)
        elif ev.type == EvType.CUDA and self.gpu is not None:
            self.gpu.on_event(t.table, ev, self._intern, self._wall)

    def _on_vm(self, t: _Target, ev) -> None:
        op, ok = ev.op, ev.ret >= 0 or ev.ret < -4095
        sid = self._intern(ev) if ev.weight else None
        if ok and op == VmOp.MMAP:
            t.table.unmap(ev.ret, ev.size)          # whatever was mapped there is gone
            if ev.weight:
                t.table.map(ev.ret, ev.size, ev.weight, sid, ev.ts_ns)
        elif ok and op == VmOp.MUNMAP:
            t.table.unmap(ev.addr, ev.size)
        if ok and op == VmOp.MMAP and ev.arg & PROT_EXEC and not (ev.arg >> 32) & MAP_ANONYMOUS:
            # a library is being loaded (dlopen of libcudart, libcuda): look for it at every poll
            # for a moment, not only at the next snapshot
            t.rescan_until = max(t.rescan_until, time.monotonic() + 1.0)
        elif ok and op == VmOp.MREMAP:
            t.table.move(ev.addr, ev.size, ev.ret, ev.arg)
            t.table.unmap(ev.addr, ev.size)
            if ev.weight:
                t.table.map(ev.ret, ev.arg, ev.weight, sid, ev.ts_ns)
        elif ok and op == VmOp.MADVISE and ev.arg & 0xFFFFFFFF in (MADV_DONTNEED, MADV_FREE, MADV_REMOVE):
            t.table.unmap(ev.addr, ev.size, (FAULT,))  # the pages leave RSS, the mapping stays
        elif ok and op == VmOp.BRK and t.vm.brk_range and ev.ret < t.vm.brk_range[1]:
            t.table.unmap(ev.ret, t.vm.brk_range[1] - ev.ret, (FAULT,))   # the heap shrank
        event = t.vm.classify(op, ev.addr, ev.size, ev.arg, ev.ret)
        if len(self._vm_rows) >= self.opts.vm_events_per_interval:
            self._vm_dropped += 1
            return
        prot = flags = advice = new_length = None
        if op in (VmOp.MMAP, VmOp.MPROTECT):
            prot = ev.arg & 0xFFFFFFFF
            flags = (ev.arg >> 32) if op == VmOp.MMAP else None
        elif op == VmOp.MADVISE:
            advice = ev.arg & 0xFFFFFFFF
        elif op == VmOp.MREMAP:
            new_length = ev.arg
        self._vm_rows.append({
            "ts": self._wall(ev.ts_ns), "pid": ev.pid, "tid": ev.tid, "op": _VM_NAME.get(op, str(op)),
            "event": event,
            "addr": _i64(ev.addr), "length": _i64(ev.size), "prot": _i32(prot), "flags": _i32(flags),
            "advice": _i32(advice), "new_length": _i64(new_length) if new_length is not None else None,
            "result": ev.ret, "sampled_weight": float(ev.weight) if ev.weight else None,
            "stack_id": sid,
        })

    def _intern(self, ev) -> int:
        sid = self.stacks.intern(ev)
        self._samples += 1
        self._complete += self.stacks.last_stop == COMPLETE
        hint = self.stacks.stack_hint(ev.pid, self.opts.stack_bytes)
        if hint != self._hints.get(ev.pid):       # copy only what this process's walks need
            self._hints[ev.pid] = hint
            self.probes.set_stack_hint(ev.pid, hint)
        return sid

    def _on_proc(self, t: _Target, ev) -> None:
        if ev.op == ProcOp.FORK:
            child = ev.addr
            if self.opts.children and child not in self.targets and is_process(child):
                with contextlib.suppress(ProcessLookupError):
                    self._add_target(read_info(child))
        elif ev.op == ProcOp.EXEC:
            if ev.addr != ev.pid:
                # exec from a non-leader thread: the old leader task, to which the probe links
                # were bound, is gone; attach again to the new image
                self.probes.detach_probes(ev.pid)
                t.attached.clear()
            self.probes.forget_live(t.info.pid, t.table.live_addresses())
            self.probes.forget_mappings(t.info.pid)
            t.table.clear()
            t.vm = VmClassifier()
            self.probes.detach_gpu(ev.pid)       # the new image maps its own CUDA, if any
            if self.gpu is not None:
                self.gpu.forget(ev.pid)
            if t.tier == PRELOAD:        # the new image may not carry the probes: start over
                self.probes.detach_probes(ev.pid)
                t.usdt.clear()
                t.usdt_labels = []
                t.attached.clear()
                t.tier = ATTACH
                if self.governor is not None:
                    self.governor.add(ev.pid, time.monotonic())
            self.stacks.forget(t.info.pid)
            if self.python is not None:
                self.python.forget(t.info.pid)
            t.py_checked = False
            try:
                t.info = read_info(t.info.pid)
            except ProcessLookupError:
                return
            # Attachments stay: uprobes are bound to the library file and the task, and follow
            # it into the new image. Rescan for libraries that the new image adds.
            t.rescan_until = time.monotonic() + 5.0
            self._target_row(t, "exec", "")
        elif ev.op == ProcOp.EXIT:
            self._exit(t.info.pid)

    # snapshots --------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        now = self._wall_now()
        mono = time.monotonic()
        interval = mono - self._last_snap
        self._last_snap = mono
        drops = self.probes.drops()
        out_rows: list[dict] = []
        proc_rows: list[dict] = []
        arenas: list[dict] = []
        hits = self.probes.hits()
        if self.gpu is not None:
            self.gpu.sample()
        for pid, t in list(self.targets.items()):
            t.drops = drops.get(pid, t.drops)
            if self.governor is not None and t.tier == ATTACH:
                t.coverage, actions = self.governor.interval(pid, mono, hits.get(pid, (0, 0)))
                self._apply(t, actions)
            elif t.tier == ATTACH:
                t.coverage = 1.0
            else:
                t.coverage = None
            h = sum(hits.get(pid, (0, 0)))
            t.hit_rate, t.hits = (h - t.hits) / interval if interval > 0 else 0.0, h
            if self.python is not None:
                self.python.refresh(pid, force=True)
            out_rows += self._outstanding_rows(t, now, interval)
            try:
                proc_rows.append(self._process_row(t, now, arenas))
            except ProcessLookupError:
                self._exit(pid, write_rows=False)
        self._write(OUTSTANDING, out_rows)
        self._write(PROCESSES, proc_rows)
        self._write(MALLOC_ARENAS, arenas)
        self._write_stacks(now)
        self._write(VM_EVENTS, [{**r, "recording_id": self.recording_id, "host": self.host}
                                for r in self._vm_rows])
        self._vm_rows = []
        if self.gpu is not None:
            base = {"ts": now, "recording_id": self.recording_id, "host": self.host}
            self._write(GPU, [{**base, **r} for r in self.gpu.device_rows()])
            self._write(GPU_EVENTS, [{**r, "recording_id": self.recording_id, "host": self.host}
                                     for r in self.gpu.drain_rows()])
        self._write_recorder_row(now, interval)

    def _outstanding_rows(self, t: _Target, now: dt.datetime, interval: float | None = None) -> list[dict]:
        if interval is None:
            interval = time.monotonic() - self._last_snap
        common = {"ts": now, "recording_id": self.recording_id, "host": self.host,
                  "interval_s": interval, "pid": t.info.pid, "comm": t.info.comm}
        mono_now = time.monotonic_ns()
        return [{**common, **r} for r in t.table.snapshot(mono_now)]

    def _process_row(self, t: _Target, now: dt.datetime, arenas: list[dict]) -> dict:
        s = sample_process(t.info.pid)
        b = s.breakdown
        t.vm.learn_regions(b.regions)
        if t.drops[2] > t.reconciled:       # unmaps may have gone unseen: trust the mappings
            t.reconciled = t.drops[2]
            t.table.keep_mapped([(r[0], r[1]) for r in b.regions])
        heap_live, arena_live, live_var = _live_by_region(t.table, b.regions)
        arenas += [{"ts": now, "recording_id": self.recording_id, "host": self.host, **r}
                   for r in arena_rows(t.info.pid, b.regions, t.table)]
        mb, ms = t.table.totals(MALLOC)
        mmb, mms = t.table.totals(MMAP)
        return {
            "ts": now, "recording_id": self.recording_id, "host": self.host, "pid": t.info.pid,
            "comm": s.comm, "rss": s.rss, "pss": s.pss, "uss": s.uss, "swap": s.swap, "vms": s.vms,
            "threads": s.threads, "memory_limit": s.memory_limit,
            "heap_rss": b.heap_rss, "heap_size": b.heap_size, "heap_swap": b.heap_swap,
            "arena_rss": b.arena_rss, "arena_size": b.arena_size, "arena_swap": b.arena_swap,
            "arena_heaps": b.arena_heaps, "arenas": b.arenas, "anon_rss": b.anon_rss,
            "file_rss": b.file_rss, "stack_rss": b.stack_rss,
            "heap_live_bytes": heap_live, "arena_live_bytes": arena_live,
            "heap_arena_live_stderr_bytes": live_var ** 0.5,
            "malloc_outstanding_bytes": mb, "malloc_outstanding_stderr_bytes": ms,
            "mmap_outstanding_bytes": mmb, "mmap_outstanding_stderr_bytes": mms,
            "lost_events": t.drops[0], "dropped_samples": t.drops[1], "vm_events_suppressed": t.drops[2],
            "sample_mean_bytes": self.sample_mean(t.info.pid),
            "stack_collisions": self.stacks.collisions,
            "tier": t.tier, "alloc_coverage": t.coverage,
            "probe_hits_per_s": t.hit_rate if t.tier == ATTACH else None,
            "probe_cpu_estimate": (t.hit_rate * self.governor.cost(t.info.pid) * 1e-9
                                   if t.tier == ATTACH and self.governor is not None else None),
            **(self.gpu.process_columns(t.info.pid, t.table) if self.gpu is not None else {}),
        }

    def _write_stacks(self, now: dt.datetime) -> None:
        stack_rows, frame_rows = [], []
        base = {"ts": now, "recording_id": self.recording_id, "host": self.host}
        for st in self.stacks.drain_new():
            labels = [_label(f) for f in st.frames]
            stack_rows.append({**base, "stack_id": st.stack_id, "n_frames": len(st.frames),
                               "truncated": st.truncated, "site": labels[0] if labels else None,
                               "summary": " < ".join(labels), "unwind_stop": st.unwind_stop,
                               "python_frames": sum(f.kind == "python" for f in st.frames)})
            for depth, f in enumerate(st.frames):
                frame_rows.append({**base, "stack_id": st.stack_id, "depth": depth,
                                   "function": f.function, "module": f.module, "path": f.path,
                                   "offset": None if f.kind == "python" else _i64(f.offset),
                                   "build_id": f.build_id, "file": f.file, "line": f.line, "kind": f.kind,
                                   "inlined": f.inline})
        self._write(STACKS, stack_rows)
        self._write(FRAMES, frame_rows)

    def _write_recorder_row(self, now: dt.datetime, interval: float) -> None:
        c = self.probes.counters()
        last, self._last_counters = self._last_counters, c
        d = [a - b for a, b in zip(c, last, strict=True)]
        cpu = sum(self._proc.cpu_times()[:2])
        cpu_d, self._last_cpu = cpu - self._last_cpu, cpu
        self._write(RECORDER, [{
            "ts": now, "recording_id": self.recording_id, "host": self.host, "interval_s": interval,
            "targets": len(self.targets), "events": self._events,
            "probe_hits": sum(d[Counter.HITS:Counter.HITS + 32]),
            "vm_hits": sum(d[Counter.VM_HITS:Counter.VM_HITS + 16]),
            "samples": d[Counter.SAMPLED], "lost_events": d[Counter.LOST_EVENTS],
            "dropped_samples": d[Counter.LIVE_FULL],
            "pending_full": d[Counter.PENDING_FULL], "stack_errors": d[Counter.STACK_ERR],
            "python_thread_misses": d[Counter.PY_MISS], "stacks_unwound": self._samples,
            "stacks_complete": self._complete,
            "live_entries": sum(len(t.table.blocks) for t in self.targets.values()),
            "cpu_s": cpu_d, "rss": self._proc.memory_info().rss, "vm_events_dropped": self._vm_dropped,
            "vm_events_suppressed": d[Counter.VM_SUPPRESSED],
            "sampled_faults": d[Counter.FAULTS], "cuda_calls": d[Counter.CUDA_CALLS],
        }])
        self._events = 0
        self._vm_dropped = 0
        self._samples = self._complete = 0
        self.unwinder.save()

    def _target_row(self, t: _Target, event: str, detail: str) -> None:
        i = t.info
        self._write(TARGETS, [{
            "ts": self._wall_now(), "recording_id": self.recording_id, "host": self.host,
            "pid": i.pid, "event": event, "comm": i.comm, "exe": i.exe, "cmdline": i.cmdline,
            "ppid": i.ppid, "allocators": [f"{lib.family}:{lib.path}" for lib in t.libs]
                                         + (self.gpu.libraries(i.pid) if self.gpu is not None else []),
            "probes": [f"{p.name}+{p.site.offset} ({'emulated' if p.site.emulated else 'stepped'}, "
                       f"{t.modes.get(p.name, 'not attached')})" for lib in t.libs for p in lib.points]
                      + t.usdt_labels + (self.gpu.labels(i.pid) if self.gpu is not None else []),
            "detail": detail,
        }])

    def _write_recording(self, ended: dt.datetime | None) -> None:
        o = self.opts
        self._write(RECORDINGS, [{
            "recording_id": self.recording_id, "host": self.host, "started": self.started,
            "ended": ended, "schema_version": SCHEMA_VERSION,
            "sampler_version": __version__, "sample_mean_bytes": o.sample_mean,
            "interval_s": o.interval, "probe_mode": "session" if self.probes.session else "perf",
            "kernel": os.uname().release, "argv": o.argv,
            "cpu_budget": o.cpu_budget if self.governor is not None else 0.0,
            "probe_cost_ns": self._cost_ns,
            "fault_period": o.fault_period if self._fault_period_used else None,
            "gpu_status": self.gpu.status if getattr(self, "gpu", None) is not None else "off (--no-gpu)",
        }], name=self.recording_id, day=self.started.date())

    def _write(self, table, rows: list[dict], **kw) -> None:
        self.writer.write(table, rows, **kw)

    def _finish(self) -> None:
        probes = getattr(self, "probes", None)
        if probes is None:
            return
        try:
            probes.drain()
            if hasattr(self, "_last_counters"):
                self._snapshot()
            for pid in list(self.targets):
                t = self.targets[pid]
                self._target_row(t, "detach", "recording ended")
                self._drop_target(pid, "recording ended", exited=True)     # nothing reads on
            self._write_recording(ended=dt.datetime.now(dt.timezone.utc))
        finally:
            if getattr(self, "gpu", None) is not None:
                self.gpu.close()
            probes.close()

    def _wall(self, mono_ns: int) -> dt.datetime:
        return dt.datetime.fromtimestamp((mono_ns + self._mono_to_wall_ns) / 1e9, dt.timezone.utc)

    def _wall_now(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)


def _live_by_region(table: ProcessTable, regions: list[tuple[int, int, str]]) -> tuple[float, float, float]:
    """Estimated live malloc chunk bytes in [heap] and in arena heaps, and the variance of their sum."""
    starts = [r[0] for r in regions]
    heap = arena = var = 0.0
    for addr, b in table.blocks.items():
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= regions[i][1]:
            continue
        kind = regions[i][2]
        if kind not in (HEAP, ARENA):
            continue
        w = b.size / b.p
        scale = chunk_size(b.size) / b.size if b.size else 1.0
        est = w * scale
        if kind == HEAP:
            heap += est
        else:
            arena += est
        var += sample_terms(b.size, w)[0] * scale * scale
    return heap, arena, var


def _label(f) -> str:
    if f.kind == "python":
        return f"{f.function} ({f.module}:{f.line})" if f.line else f"{f.function} ({f.module})"
    return f"{f.function or hex(f.offset)} ({f.module})"


def _cache_dir(path: str | None, sub: str = "unwind"):
    """Where unwind tables, compiled BPF programs and the probe cost persist across runs: the
    given directory, else `sub` of $ALLOCSAMPLER_CACHE_DIR or of a root-only default (all of
    them describe the binaries and the kernel, not the targets, so one cache serves every
    recording)."""
    from pathlib import Path

    d = Path(path) if path else Path(os.environ.get("ALLOCSAMPLER_CACHE_DIR") or "/var/cache/allocsampler", sub)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return d


def _i64(v: int | None) -> int | None:
    if v is None:
        return None
    return v - (1 << 64) if v >= 1 << 63 else v


def _i32(v: int | None) -> int | None:
    if v is None:
        return None
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v
