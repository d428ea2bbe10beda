"""The recording loop: targets -> BPF events -> outstanding tables -> Parquet every interval.

The recorder owns the loop and the lifecycle of a recording and of each target; attach.py decides
the probes of each tier, control.py carries out the governor and the sample-rate cap, rows.py
builds the tables' rows. A long-running owner (the daemon) adds its work through RecorderHooks.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import psutil

from sampler import __version__, files
from sampler.bpf import preflight
from sampler.bpf.abi import EvFlag, EvType, Fn, ProcOp, Source, VmOp
from sampler.bpf.events import Event, decode
from sampler.bpf.loader import BpfProbes, ProbeConfig
from sampler.control import probe_cost, weights
from sampler.control.governor import Governor
from sampler.control.sample_rate import SampleRate
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
    Table,
)
from sampler.dataset.writer import DatasetWriter, DiskFull
from sampler.errors import EXIT_ENVIRONMENT, EnvironmentProblem, TargetGone
from sampler.gpu import cuda
from sampler.gpu.cuda import GpuTracer
from sampler.inprocess import inject, preload
from sampler.probes import allocators, usdt
from sampler.probes.allocators import Family
from sampler.proc.arenas import arena_rows
from sampler.proc.cgroups import cgroup_id
from sampler.proc.exe_identity import ExeIdentities
from sampler.proc.memory import sample_process
from sampler.proc.process import LaunchedCommand, ProcessInfo, check_pid, is_process, read_info
from sampler.python.targets import PythonTargets
from sampler.record import rows
from sampler.record.attach import NO_ALLOCATOR, Attacher
from sampler.record.control import Controls
from sampler.record.outstanding import FAULT, MALLOC, PYTHON, TORCH
from sampler.record.target import ATTACH, RSS, SYSCALLS, Target
from sampler.record.vm_events import MADV_DONTNEED, MADV_FREE
from sampler.stacks.kernel_tables import KernelTables
from sampler.stacks.symbolize import Symbolizer
from sampler.stacks.table import COMPLETE, StackTable
from sampler.stacks.table_worker import TableWorker
from sampler.stacks.unwind import Unwinder
from sampler.text import printable

MADV_REMOVE = 9
PROT_EXEC, MAP_ANONYMOUS = 4, 0x20
DLOPEN_RESCAN_S = 1.0       # after an executable file mapping: look for new libraries at every poll
# Adaptive snapshot interval (no --interval): elapsed / ADAPTIVE_SNAPSHOTS within [MIN, MAX], so a
# recording of 10 s or more has >= 8 snapshots (what every check of docs/findings.md needs) and a
# long one settles at one per 10 s.
ADAPTIVE_MIN_S, ADAPTIVE_MAX_S, ADAPTIVE_SNAPSHOTS = 1.0, 10.0, 8
# A target's rescans (maps, new libraries, Python): at most one per RESCAN_MIN_S, and spaced by ten
# times what the last one cost, so that a process that keeps mapping code cannot take the loop.
RESCAN_MIN_S, RESCAN_COST_FACTOR = 0.1, 10.0


def snapshot_interval(elapsed: float, fixed: float | None) -> float:
    """Seconds to the next snapshot, `elapsed` seconds into the recording."""
    if fixed:
        return fixed
    return min(ADAPTIVE_MAX_S, max(ADAPTIVE_MIN_S, elapsed / ADAPTIVE_SNAPSHOTS))


@dataclass
class RecordOptions:
    out: str
    pids: list[int] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    duration: float | None = None
    interval: float | None = None         # None: adaptive (snapshot_interval)
    sample_mean: int = 512 * 1024
    children: bool = False
    allocators: tuple[Family, ...] = ()
    syscalls_only: bool = False
    probe_mode: str = "auto"
    attach_mode: str = "auto"             # auto | inject | uprobe (sampler/record/attach.py)
    python_objects: bool = False          # inject tier: CPython's object allocator too
    live_max: int = 262144
    max_frames: int = 127                 # native frames unwound per stack
    stack_bytes: int = 16 << 10           # user stack copied per sampled event
    python: bool = True                   # read Python frames of CPython targets
    interpreter_frames: bool = False      # keep libpython frames between Python frames
    unwind_cache: str | None = None       # directory for the per-build-id unwind tables
    unwind: str = "bpf"                   # bpf: native stacks walked in BPF from compact tables
                                          # (sampler/stacks/kernel_tables.py); user: copied and unwound here
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


class RecorderHooks:
    """What a long-running owner of a recording (the daemon) adds to it. The defaults do nothing."""

    def writer(self, root: str, recording_id: str, host: str) -> DatasetWriter:
        return DatasetWriter(root, recording_id, host=host)

    def started(self) -> None:
        """BPF is loaded; no target is attached yet."""

    def tick(self, now: float) -> None:
        """After every poll of the ring buffer (`now`: monotonic)."""

    def snapshot_done(self) -> None:
        """After every interval's snapshot."""

    def target_failed(self, pid: int, comm: str, why: str) -> None:
        """A target was dropped because recording it failed (`why`: one line)."""


class Recorder:
    def __init__(self, opts: RecordOptions, hooks: RecorderHooks | None = None):
        self.opts = opts
        self.hooks = hooks or RecorderHooks()
        self.host = socket.gethostname()
        self.started = dt.datetime.now(dt.timezone.utc)
        # unique across hosts: two that share a name (clones, containers) may start one in the same second
        self.recording_id = f"{self.started:%Y%m%dT%H%M%SZ}-{os.getpid()}-{secrets.token_hex(3)}"
        self.exe_ids = ExeIdentities()
        self.targets: dict[int, Target] = {}
        self.finished: list[tuple[ProcessInfo, str]] = []     # (process, why) for the CLI's summary
        self.launched: LaunchedCommand | None = None
        self._stop = False
        self.disk_full: DiskFull | None = None     # the write that ended the recording
        self._snap_at: dict[int, float] = {}       # pid -> its last snapshot (monotonic)
        self._vm_rows: list[dict] = []
        self._vm_dropped = 0
        self._events = 0
        self._samples = self._complete = 0
        self._last_walks: tuple[int, int, float] = (0, 0, 0.0)
        self._hints: dict[int, int | None] = {}
        self._mono_to_wall_ns = time.time_ns() - time.monotonic_ns()
        self._gone: set[int] = set()           # host-wide pids that exited before adoption
        self.failed: dict[int, str] = {}       # pid -> why recording it failed (not tried again)
        self._proc = psutil.Process()
        self._cost_ns: float | None = None
        self.probes: BpfProbes | None = None

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

    def _load(self) -> None:
        """BPF and everything that reads what it sends."""
        o = self.opts
        self.probes = BpfProbes(ProbeConfig(o.sample_mean, live_max=o.live_max, mode=o.probe_mode,
                                            stack_bytes=o.stack_bytes, ringbuf_bytes=o.ringbuf_bytes,
                                            vm_events_per_s=o.vm_events_per_s, cache_dir=cache_dir("bpf"),
                                            max_frames=o.max_frames, weight_table=tuple(weights.weight_table())))
        self.symbolizer = Symbolizer()
        self.python = PythonTargets(self.probes) if o.python else None
        self.unwinder = Unwinder(cache_dir("unwind", o.unwind_cache))
        self.tables: KernelTables | None = None
        if o.unwind == "bpf":
            self.tables = KernelTables(self.probes, TableWorker(cache_dir("unwind", o.unwind_cache)))
        self.stacks = StackTable(self.symbolizer, self.unwinder, self.python, o.max_frames,
                                 interpreter_frames=o.interpreter_frames)
        self.writer = self.hooks.writer(o.out, self.recording_id, self.host)
        self.gpu: GpuTracer | None = None
        if o.gpu:
            from sampler.gpu.nvml import Nvml
            self.gpu = GpuTracer(self.probes, Nvml(), o.vm_events_per_interval)
        self.governor: Governor | None = None
        if o.cpu_budget > 0 and not (o.rss or o.syscalls_only):
            self._cost_ns, link_ns, how = (
                (o.probe_cost_ns, probe_cost.DEFAULT_LINK_NS, "given") if o.probe_cost_ns
                else probe_cost.calibrate(self.probes, cache_dir("", o.unwind_cache)))
            self.governor = Governor(o.cpu_budget, self._cost_ns, link_ns=link_ns)
            if not o.quiet:
                print(f"allocsampler: probe cost {self._cost_ns / 1000:.2f} us per hit, +{link_ns / 1000:.2f} us "
                      f"per other target probed on the same library ({how}); budget "
                      f"{100 * o.cpu_budget:g}% of a CPU per process", file=sys.stderr)
        self.attacher = Attacher(self.probes, allocators=o.allocators, fault_period=o.fault_period,
                                 fault_all=o.all_processes, fault_cgroups=[cgroup_id(c) for c in o.cgroups],
                                 gpu=self.gpu, python=self.python, governor=self.governor,
                                 note=self._target_row, warn=self._warn, quiet=o.quiet,
                                 attach_mode=o.attach_mode, sample_mean=o.sample_mean,
                                 max_samples_per_s=o.max_samples_per_s, python_objects=o.python_objects,
                                 mapped_code=lambda t: self._mapped_code(t, now=True))
        self.controls = Controls(self.probes, self.governor, SampleRate(o.max_samples_per_s), o.sample_mean,
                                 self.attacher, self._target_row)
        if o.rss or o.all_processes or o.cgroups:
            self.attacher.enable_faults()
        elif o.attach_mode != "uprobe" and not o.syscalls_only:
            self.probes.load_usdt()
            # the injected sampler's and the shim's argument layouts: no file's probes crowd them out
            own = (inject.built()[0], preload.shim_path())
            self.probes.reserve_usdt([s.spec for path in own for s in usdt.memory_sites(usdt.memory_probes(str(path)))])

    def _record(self, infos: list[ProcessInfo]) -> int:
        o = self.opts
        # from the start: a stop asked for while loading or attaching ends the recording cleanly once
        # attached (slots restored), and is not lost where the caller left SIGINT ignored (a shell's
        # background job)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._load()
        self._write_recording(ended=None)
        self.probes.open_events(self._on_event)
        try:
            self.hooks.started()
            for info in infos:
                self._add_target(info)
            self.attacher.settle(self.targets, self._fail)
            if not self.targets and not (o.all_processes or o.cgroups or o.daemon):
                raise TargetGone(f"every target exited while being attached ({', '.join(str(i.pid) for i in infos)}): "
                                 "nothing to record")
            if self.targets and not any(t.libs or t.usdt for t in self.targets.values()) and not o.syscalls_only \
                    and not o.rss and not self.launched:
                t = next(iter(self.targets.values()))
                if t.failures:
                    raise EnvironmentProblem(f"pid {t.pid} ({t.info.comm}): {t.failures[0]}")
                raise EnvironmentProblem(
                    f"pid {t.pid} ({t.info.comm}): {NO_ALLOCATOR}; name the allocator library with "
                    "--allocator LIB[:PREFIX], or record only mmap/brk with --syscalls-only")
            if self.launched:
                self.launched.resume()
            self._loop()
        finally:
            self._finish()
        return EXIT_ENVIRONMENT if self.disk_full is not None else 0

    def _loop(self) -> None:
        o = self.opts
        start = time.monotonic()
        deadline = start + o.duration if o.duration else None
        next_snap = start + snapshot_interval(0.0, o.interval)
        self._last_snap = self._prev_full = start
        self._last_counters = self.probes.counters()
        self._last_cpu = sum(self._proc.cpu_times()[:2])
        host_wide = o.all_processes or bool(o.cgroups)
        while not self._stop and (self.targets or host_wide or o.daemon):
            self.probes.poll(100)
            if self.tables is not None:
                self.tables.poll()
            now = time.monotonic()
            self.attacher.poll(self.targets, self._fail)
            self._rescan(now)
            self._reap_launched()
            self.hooks.tick(now)
            self.controls.tick(now, self.targets)
            if deadline is not None and now >= deadline:
                break
            if now >= next_snap:
                self._rescan(now, every=True)
                self._snapshot()
                self.hooks.snapshot_done()
                next_snap += snapshot_interval(next_snap - start, o.interval)
                if next_snap < now:
                    next_snap = now + snapshot_interval(now - start, o.interval)

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    # the daemon's calls (sampler/service/daemon.py) -----------------------------------------
    def add_process(self, info: ProcessInfo, tier: str) -> bool:
        """Start recording a process the daemon selected; False when it exited meanwhile."""
        self._add_target(info, tier)
        return info.pid in self.targets

    def remove_process(self, pid: int, event: str = "exit", detail: str = "") -> None:
        """Stop recording a process (it exited, or no longer matches): its last outstanding rows,
        a `targets` row, probes detached."""
        t = self.targets.get(pid)
        if t is None:
            return
        self._write(OUTSTANDING, self._outstanding_rows(t, exiting=event == "exit"))
        self._target_row(t, event, detail)
        self._drop_target(pid, detail or event, exited=event == "exit")

    def note(self, pid: int, event: str, detail: str) -> None:
        """A `targets` row about a recorded process."""
        if (t := self.targets.get(pid)) is not None:
            self._target_row(t, event, detail)

    def raise_detail(self, pid: int, until: float, sample_mean: int | None = None) -> bool:
        """Pre-OOM capture (see Controls.raise_detail); False when nothing changed."""
        t = self.targets.get(pid)
        return t is not None and self.controls.raise_detail(t, until, sample_mean)

    def sample_mean(self, pid: int) -> int:
        """The process's sampling mean in BPF now (an in-process sampler has its own: `sampling` rows)."""
        return self.controls.sample_mean(pid)

    def snapshot_now(self, pids: Collection[int] | None = None) -> None:
        """An extra snapshot of these targets (default: every one); their interval is shorter."""
        self._snapshot(None if pids is None else frozenset(pids))

    @property
    def sample_cap(self) -> float | None:
        """The per-process sample-rate cap in force (samples/s), None before loading."""
        controls = getattr(self, "controls", None)
        return controls.sample_rate.cap if controls is not None else None

    def sampling_cap(self, squeeze: str | None) -> float | None:
        """The daemon's CPU budget: `squeeze` (why) halves the per-process sample-rate cap, None
        doubles it back toward the configured one. Returns the new cap, None when it could not
        change (at its floor: only then does the daemon pause reading events)."""
        rate = self.controls.sample_rate
        changed = rate.squeeze(squeeze) if squeeze is not None else rate.relax()
        return rate.cap if changed else None

    def idle(self, seconds: float) -> None:
        """Pause reading events (the daemon's own CPU budget): the ring buffer fills meanwhile
        (a full one counts lost events); governed probes and the sample-rate cap keep their clock."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            self.controls.tick(now, self.targets)
            time.sleep(min(0.05, end - now))

    def prune(self, shed: int = 0) -> None:
        """Bound every cache that keeps per-process or per-file state across intervals (for
        recordings of months): what belongs to processes no longer recorded goes, each cache
        keeps to its size bound; `shed` 1 (memory near its bound) drops the memos, 2 (above it)
        also what is costly to rebuild (DWARF line tables, allocator plans, demangled names)."""
        live = set(self.targets)
        self.symbolizer.prune(live, shed)
        self.unwinder.prune(self.symbolizer.images())
        self.stacks.prune(live, shed)
        if self.python is not None:
            self.python.prune(live)
        allocators.plans.prune(shed)
        cuda.plans.prune(shed)

    # targets ----------------------------------------------------------------------------------
    def _add_target(self, info: ProcessInfo, tier: str | None = None) -> None:
        tier = tier or (RSS if self.opts.rss else SYSCALLS if self.opts.syscalls_only else ATTACH)
        t = self.targets[info.pid] = Target(info, tier=tier)
        self.controls.add(t)
        try:
            self.attacher.attach(t)
            if self.tables is not None:
                self.tables.track(info.pid)
        except ProcessLookupError:
            self._drop_target(info.pid, "exited while being attached", exited=True)
        except Exception as e:  # noqa: BLE001
            self._fail(info.pid, "attaching", e)

    def _rescan(self, now: float, every: bool = False) -> None:
        """After an exec the new image maps its libraries a moment later; dlopen can add an
        allocator any time. Rescan recent execs at every poll, `every` target once per interval."""
        for t in list(self.targets.values()):
            if t.rescan_until and now >= t.rescan_until:
                t.rescan_until = 0.0        # the exec window is over: warn if still nothing
            # a target that keeps mapping code (hostile or not) is rescanned at a pace that keeps
            # the rescans' own cost under a tenth of the loop's time
            if (every or t.rescan_until) and now >= t.next_rescan:
                try:
                    self.attacher.rescan(t)
                except Exception as e:  # noqa: BLE001
                    self._fail(t.pid, "looking for its libraries", e)
                    continue
                t.next_rescan = now + max(RESCAN_MIN_S, RESCAN_COST_FACTOR * (time.monotonic() - now))

    def _adopt(self, pid: int) -> Target | None:
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

    def _drop_target(self, pid: int, why: str, exited: bool = False, restore: bool = False) -> None:
        """`restore`: the process goes on in the image it was recorded in (the recording ended, or
        failed on it): its redirected slots get their functions back, before the probes go."""
        t = self.targets.pop(pid, None)
        if t is not None:
            self.attacher.release(t, restore)
        # an exited process makes no more hits: its links may close in the background
        self.probes.detach(pid, wait=not exited)
        self.controls.forget(pid)
        if self.gpu is not None:
            self.gpu.forget(pid)
        if t is None:
            return
        self.probes.forget_live(pid, t.table.live_addresses())
        self.stacks.forget(pid)
        if self.tables is not None:
            self.tables.untrack(pid)
        if self.python is not None:
            self.python.forget(pid)
        if self._hints.pop(pid, None) is not None:
            self.probes.set_stack_hint(pid, None)
        self.finished.append((t.info, why))

    def _fail(self, pid: int, what: str, e: Exception) -> None:
        """Recording this target failed on something it supplied (a malformed file, memory that
        changed under us, a bug its input triggers): it is dropped with one `targets` row and one
        line, the other targets and the loop go on, and it is not tried again."""
        t = self.targets.get(pid)
        if t is None:
            return
        why = f"recording failed while {what}: {type(e).__name__}: {str(e)[:200]}"
        self.failed[pid] = why
        self._target_row(t, "failed", why + "; no longer recorded")
        if not self.opts.quiet:
            print(f"allocsampler: error: pid {pid} ({printable(t.info.comm)}): {printable(why)}; no longer recorded",
                  file=sys.stderr)
        self.hooks.target_failed(pid, t.info.comm, why)
        try:
            self._drop_target(pid, why, restore=True)
        except Exception:  # noqa: BLE001  (detaching what we could; the pid is out of `targets` already)
            self.targets.pop(pid, None)

    def _warn(self, t: Target, msg: str) -> None:
        self._target_row(t, "warning", msg)
        if not self.opts.quiet:
            print(f"allocsampler: warning: pid {t.pid} ({printable(t.info.comm)}): {printable(msg)}", file=sys.stderr)

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
            self._write(OUTSTANDING, self._outstanding_rows(t, exiting=True))
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
        t0 = time.perf_counter()
        try:
            self._handle(t, ev)
        except ProcessLookupError:
            pass                                # gone while we looked: its exit event follows
        except Exception as e:  # noqa: BLE001  (what the target supplied broke it: that target alone goes)
            self._fail(t.pid, "reading its events", e)
        t.recorder_s += time.perf_counter() - t0

    def _handle(self, t: Target, ev: Event) -> None:
        if ev.flags & EvFlag.PY_MISS and self.python is not None:
            self.python.refresh(ev.pid)        # a thread started since the last walk
        if ev.type == EvType.ALLOC:
            if ev.source == Source.FAULT:
                # in a sampled mapping: the mapping's stack (one cause, not a second one at first touch)
                sid = t.table.mapping_stack(ev.addr)
                t.table.map(ev.addr, ev.size, ev.weight, self._intern(ev) if sid is None else sid, ev.ts_ns, FAULT)
            elif ev.source == Source.TORCH:         # not governed: no duty
                t.table.alloc(ev.addr, ev.size, ev.weight, self._intern(ev), ev.ts_ns, TORCH)
            else:
                t.table.alloc(ev.addr, ev.size, ev.weight / t.duty, self._intern(ev), ev.ts_ns,
                              PYTHON if ev.source == Source.PYTHON else MALLOC)
        elif ev.type == EvType.FREE:
            if ev.op == Fn.USDT_UNFREE:
                t.table.unfree(ev.addr, ev.arg)
            else:
                t.table.free(ev.addr, ev.arg)
        elif ev.type == EvType.VM:
            self._on_vm(t, ev)
        elif ev.type == EvType.PROC:
            self._on_proc(t, ev)
        elif ev.type == EvType.CUDA and self.gpu is not None:
            self.gpu.on_event(t.table, ev, self._intern, self._wall)

    def _mapped_code(self, t: Target, now: bool = False) -> None:
        """`t` mapped code: symbols and unwind tables read again (`now`: at once, for code its walks
        need from the start: the injected sampler)."""
        self.symbolizer.mapped_code(t.pid)
        if self.tables is not None:
            if now:
                self.tables.refresh(t.pid)
            else:
                self.tables.changed(t.pid)

    def _on_vm(self, t: Target, ev: Event) -> None:
        op, ok = ev.op, ev.ret >= 0 or ev.ret < -4095
        if t.injection is not None and t.injection.owns(ev.ret if op == VmOp.MMAP else ev.addr):
            return                          # the injected sampler's own mappings, made by us
        sid = self._intern(ev) if ev.weight else None
        if sid is not None and op == VmOp.MMAP and t.injection is not None \
                and t.injection.under_python_wrapper(self.stacks.last_pcs):
            ev.weight = 0                   # pymalloc's arena: its objects are sampled as `python`
        if ok and op == VmOp.MMAP:
            t.table.unmap(ev.ret, ev.size)          # whatever was mapped there is gone
            if ev.weight:
                t.table.map(ev.ret, ev.size, ev.weight, sid, ev.ts_ns)
        elif ok and op == VmOp.MUNMAP:
            t.table.unmap(ev.addr, ev.size)
        if ok and op == VmOp.MMAP and ev.arg & PROT_EXEC and not (ev.arg >> 32) & MAP_ANONYMOUS:
            # a library is being loaded (dlopen of libcudart, libcuda): look for it at every poll
            # for a moment, not only at the next snapshot; its samples come after this event (one
            # ring buffer, in order), and their stacks need the new maps
            t.rescan_until = max(t.rescan_until, time.monotonic() + DLOPEN_RESCAN_S)
            self._mapped_code(t)
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
        self._vm_rows.append(rows.vm_row(ev, event, self._wall(ev.ts_ns), sid))

    def _intern(self, ev: Event) -> int:
        sid = self.stacks.intern(ev)
        self._samples += 1
        self._complete += self.stacks.last_stop == COMPLETE
        hint = self.stacks.stack_hint(ev.pid, self.opts.stack_bytes)
        if hint != self._hints.get(ev.pid):       # copy only what this process's walks need
            self._hints[ev.pid] = hint
            self.probes.set_stack_hint(ev.pid, hint)
        return sid

    def _on_proc(self, t: Target, ev: Event) -> None:
        if ev.op == ProcOp.FORK:
            child = ev.addr
            if self.opts.children and child not in self.targets and is_process(child):
                with contextlib.suppress(ProcessLookupError):
                    self._add_target(read_info(child))
        elif ev.op == ProcOp.EXEC:
            self.attacher.exec_(t, from_thread=ev.addr != ev.pid)
            self.stacks.forget(t.pid)
            if self.tables is not None:
                self.tables.changed(t.pid, exec_=True)
            try:
                t.info = read_info(t.pid)
            except ProcessLookupError:
                return
            self._target_row(t, "exec", "")
        elif ev.op == ProcOp.EXIT:
            self._exit(t.pid)

    # snapshots --------------------------------------------------------------------------------
    def _snapshot(self, only: frozenset[int] | None = None) -> None:
        """Rows of every target, or of `only` (pre-OOM: one process, not all; the recorder row,
        which covers all of them, waits for the next full snapshot)."""
        now = self._wall_now()
        mono = time.monotonic()
        interval = mono - self._last_snap
        if only is None:
            self._last_snap = mono
            self._snap_at = {p: v for p, v in self._snap_at.items() if p in self.targets}
        since = interval
        drops = self.probes.drops()
        out_rows: list[dict] = []
        proc_rows: list[dict] = []
        arenas: list[dict] = []
        hits = self.probes.hits()
        if self.gpu is not None:
            self.gpu.sample()
        for pid, t in list(self.targets.items()):
            if only is not None and pid not in only:
                continue
            # each target's own interval: a scoped snapshot shortened only its own
            interval = mono - self._snap_at.get(pid, mono - since)
            self._snap_at[pid] = mono
            t.drops = drops.get(pid, t.drops)
            self.controls.interval(t, mono, hits)
            h = sum(hits.get(pid, (0, 0)))
            t.hit_rate, t.hits = (h - t.hits) / interval if interval > 0 else 0.0, h
            t0 = time.perf_counter()
            try:
                if t.injection is not None:
                    self._note_sampler_mean(t)
                if self.python is not None:
                    self.python.refresh(pid, force=True)
                n_arenas = len(arenas)
                proc_rows.append(self._process_row(t, now, arenas))
            except ProcessLookupError:      # it exited meanwhile: what is left is its teardown's
                out_rows += self._outstanding_rows(t, now, interval, exiting=True)
                self._exit(pid, write_rows=False)
                continue
            except Exception as e:  # noqa: BLE001
                del arenas[n_arenas:]
                self._fail(pid, "measuring it", e)
                continue
            out_rows += self._outstanding_rows(t, now, interval)
            proc_rows[-1]["recorder_cpu_s"] = t.recorder_s + time.perf_counter() - t0
            t.recorder_s = 0.0
        self._write(OUTSTANDING, out_rows)
        self._write(PROCESSES, proc_rows)
        self._write(MALLOC_ARENAS, arenas)
        stack_rows, frame_rows = rows.stack_rows(self.stacks.drain_new(), now)
        self._write(STACKS, stack_rows)
        self._write(FRAMES, frame_rows)
        self._write(VM_EVENTS, self._vm_rows)
        self._vm_rows = []
        if only is not None:
            return
        if self.gpu is not None:
            self._write(GPU, [{"ts": now, **r} for r in self.gpu.device_rows()])
            self._write(GPU_EVENTS, self.gpu.drain_rows())
        self._write_recorder_row(now, mono - self._prev_full)
        self._prev_full = mono

    def _note_sampler_mean(self, t: Target) -> None:
        """A `sampling` row when the injected sampler's own rate cap changed its mean."""
        try:
            c = t.injection.counters()
        except OSError:
            return
        if t.sampler_mean is not None and c["cur_mean"] != t.sampler_mean:
            why = "over" if c["cur_mean"] > t.sampler_mean else "back under"
            self._target_row(t, "sampling", f"in-process sample mean {c['cur_mean']} bytes ({why} the cap of "
                                            f"{c['max_per_s']} samples/s, in the process)")
        t.sampler_mean = c["cur_mean"]

    def _outstanding_rows(self, t: Target, now: dt.datetime | None = None,
                          interval: float | None = None, exiting: bool = False) -> list[dict]:
        if interval is None:
            interval = time.monotonic() - self._last_snap
        return rows.outstanding_rows(t, now or self._wall_now(), interval, time.monotonic_ns(), exiting=exiting)

    def _process_row(self, t: Target, now: dt.datetime, arenas: list[dict]) -> dict:
        s = sample_process(t.pid)
        regions = s.breakdown.regions
        t.vm.learn_regions(regions)
        if t.drops[2] > t.reconciled:       # unmaps may have gone unseen: trust the mappings
            t.reconciled = t.drops[2]
            t.table.keep_mapped([(r[0], r[1]) for r in regions])
        arenas += [{"ts": now, **r} for r in arena_rows(t.pid, regions, t.table.live_blocks())]
        return rows.process_row(
            t, now, s, sample_mean=self.sample_mean(t.pid), stack_collisions=self.stacks.collisions,
            probe_cost_ns=self.governor.cost(t.pid) if self.governor is not None else None,
            gpu=self.gpu.process_columns(t.pid, t.table) if self.gpu is not None else {})

    def _write_recorder_row(self, now: dt.datetime, interval: float) -> None:
        c = self.probes.counters()
        last, self._last_counters = self._last_counters, c
        cpu = sum(self._proc.cpu_times()[:2])
        cpu_d, self._last_cpu = cpu - self._last_cpu, cpu
        st = self.stacks
        walks = (st.in_bpf, st.handed_over, self.tables.worker.cpu_seconds() if self.tables is not None else 0.0)
        in_bpf, handed, worker_s = (a - b for a, b in zip(walks, self._last_walks, strict=True))
        self._last_walks = walks
        self._write(RECORDER, [rows.recorder_row(
            now, interval, [a - b for a, b in zip(c, last, strict=True)],
            targets=len(self.targets), events=self._events, stacks_unwound=self._samples,
            stacks_complete=self._complete, live_entries=sum(len(t.table.blocks) for t in self.targets.values()),
            cpu_s=cpu_d, rss=self._proc.memory_info().rss, vm_events_dropped=self._vm_dropped,
            stacks_in_bpf=in_bpf, stacks_handed_over=handed, unwind_worker_cpu_s=worker_s,
            unwind_rows=self.tables.rows_used if self.tables is not None else None)])
        self._events = 0
        self._vm_dropped = 0
        self._samples = self._complete = 0
        self.unwinder.save()

    def _target_row(self, t: Target, event: str, detail: str) -> None:
        gpu = self.gpu
        row = rows.target_row(t, self._wall_now(), event, detail,
                              gpu_libraries=gpu.libraries(t.pid) if gpu is not None else [],
                              gpu_labels=gpu.labels(t.pid) if gpu is not None else [])
        if event in ("attach", "exec"):
            row.update(self.exe_ids.of(t.pid, t.info.exe).columns())
        self._write(TARGETS, [row])

    def _write_recording(self, ended: dt.datetime | None) -> None:
        o = self.opts
        self._write(RECORDINGS, [{
            "recording_id": self.recording_id, "host": self.host, "started": self.started,
            "ended": ended, "schema_version": SCHEMA_VERSION,
            "sampler_version": __version__, "sample_mean_bytes": o.sample_mean,
            "interval_s": o.interval or ADAPTIVE_MAX_S, "probe_mode": "session" if self.probes.session else "perf",
            "kernel": os.uname().release, "argv": o.argv,
            "cpu_budget": o.cpu_budget if self.governor is not None else 0.0,
            "probe_cost_ns": self._cost_ns,
            "fault_period": o.fault_period if self.attacher.faults_used else None,
            "gpu_status": self.gpu.status if self.gpu is not None else "off (--no-gpu)",
        }], name=self.recording_id, day=self.started.date())

    def write_recording(self) -> None:
        """The `recordings` row again (the daemon: in case it could not be written at start)."""
        self._write_recording(ended=None)

    def _write(self, table: Table, rows: list[dict], **kw) -> None:
        """A full or read-only disk ends the recording cleanly (said once; files already written
        stay valid: each is renamed into place whole). The daemon's writer never raises it: it pauses."""
        if self.disk_full is not None:
            return
        try:
            self.writer.write(table, rows, **kw)
        except DiskFull as e:
            self.disk_full = e
            self._stop = True
            print(f"allocsampler: error: cannot write to {self.opts.out} ({e.strerror}): the recording ends; "
                  "what was written before stays readable", file=sys.stderr)

    def _finish(self) -> None:
        if self.probes is None:
            return
        try:
            self.probes.drain()
            if hasattr(self, "_last_counters"):
                self._snapshot()
            for pid in list(self.targets):
                t = self.targets[pid]
                self._target_row(t, "detach", "recording ended")
                self._drop_target(pid, "recording ended", exited=True, restore=True)     # nothing reads on
            self._write_recording(ended=dt.datetime.now(dt.timezone.utc))
        finally:
            if getattr(self, "attacher", None) is not None:
                self.attacher.close()
            if getattr(self, "gpu", None) is not None:
                self.gpu.close()
            if getattr(self, "tables", None) is not None:
                self.tables.close()
            self.probes.close()

    def _wall(self, mono_ns: int) -> dt.datetime:
        return dt.datetime.fromtimestamp((mono_ns + self._mono_to_wall_ns) / 1e9, dt.timezone.utc)

    def _wall_now(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)


def cache_dir(sub: str, path: str | None = None):
    """files.cache_dir: where unwind tables, compiled BPF programs and the probe cost persist."""
    return files.cache_dir(sub, path)
