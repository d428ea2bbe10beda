"""The recording loop: targets -> BPF events -> outstanding tables -> Parquet every interval.

The recorder keeps the loop, the lifecycle of the recording and of each target, and the dispatch
of events. build.py creates everything it runs with before the loop exists; attach.py decides the
probes of each tier, overhead.py carries out the governor and the sample-rate cap, mappings.py
keeps the books of memory-mapping syscalls, snapshot.py writes every interval's rows. A
long-running owner (the daemon) adds its work through RecorderHooks and talks to the recording
through the methods below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from typing import NamedTuple

from sampler import environ, heap
from sampler.bpf import preflight
from sampler.bpf.abi import EvFlag, EvType, Fn, ProcOp, Source
from sampler.bpf.events import Event, decode
from sampler.errors import EXIT_ENVIRONMENT, EnvironmentProblem, TargetGone
from sampler.gpu import cuda
from sampler.probes import allocators
from sampler.proc.process import LaunchedCommand, ProcessInfo, check_pid, descendants, read_info
from sampler.record.attach import NO_ALLOCATOR
from sampler.record.build import build
from sampler.record.options import RecorderHooks, RecordOptions
from sampler.record.outstanding import FAULT, MALLOC, PYTHON, TORCH
from sampler.record.snapshot import snapshot_interval
from sampler.record.target import ATTACH, RSS, SYSCALLS, Target
from sampler.stacks.table import COMPLETE
from sampler.text import printable

_PY_MISS = int(EvFlag.PY_MISS)    # a plain int: `int & IntFlag` builds a flag object per event

# Records are read in batches: the programs wake the reader once an eighth of the ring buffer
# waits, else every POLL_MS (BUSY_POLL_MS while placements or unwind rows are on their way); the
# loop's own work (placements, rescans, hooks, controls) runs at most every TICK_S otherwise.
POLL_MS, BUSY_POLL_MS, TICK_S = 100, 5, 0.05
# A target's rescans (maps, new libraries, Python): at most one per RESCAN_MIN_S, and spaced by ten
# times what the last one cost, so that a process that keeps mapping code cannot take the loop.
RESCAN_MIN_S, RESCAN_COST_FACTOR = 0.1, 10.0
# The interval's look at every target for libraries its mapping events did not announce: only where
# some of those events may have gone unseen (suppressed over its budget, or lost), while it has no
# probes yet or its Python is not known, and at least every LOOK_S (10 processes of a server, each
# read three times a second, were a sixth of the recorder's time under pgbench).
LOOK_S = 60.0


class Recorded(NamedTuple):
    """A recorded process, as the daemon sees it."""

    pid: int
    comm: str
    tier: str


class Recorder:
    """Built in one step: the checks, BPF and every collaborator (build.py) are done when the
    constructor returns, and `run()` records. Raises what the checks and the load raise."""

    def __init__(self, opts: RecordOptions, hooks: RecorderHooks | None = None):
        self.opts = opts
        self.hooks = hooks or RecorderHooks()
        self.host = socket.gethostname()
        self.started = dt.datetime.now(dt.timezone.utc)
        # unique across hosts: two that share a name (clones, containers) may start one in the same second
        self.recording_id = f"{self.started:%Y%m%dT%H%M%SZ}-{os.getpid()}-{secrets.token_hex(3)}"
        self.targets: dict[int, Target] = {}
        self.finished: list[tuple[ProcessInfo, str]] = []     # (process, why) for the CLI's summary
        self.failed: dict[int, str] = {}       # pid -> why recording it failed (not tried again)
        self.launched: LaunchedCommand | None = None
        self._stop = False
        self._hints: dict[int, int | None] = {}
        self._gone: set[int] = set()           # host-wide pids that exited before adoption
        heap.fixed_mmap_threshold()
        preflight.check_all()
        self._infos = [check_pid(p) for p in dict.fromkeys(opts.pids)]
        # from the start: a stop asked for while loading or attaching ends the recording cleanly once
        # attached (slots restored), and is not lost where the caller left SIGINT ignored (a shell's
        # background job)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        p = self.parts = build(opts, self.hooks, self.recording_id, self.host, self.started, self._intern)
        self.probes, self.stacks, self.python, self.gpu = p.probes, p.stacks, p.python, p.gpu
        self.attacher, self.controls, self.snapshots = p.attacher, p.controls, p.snapshots

    # ----------------------------------------------------------------------------------------
    def run(self) -> int:
        o = self.opts
        infos = list(self._infos)
        try:
            if o.command:
                env = environ.user_environ()
                if o.preload:
                    from sampler.inprocess.preload import preload_env
                    env = preload_env(o.sample_mean, env)
                self.launched = LaunchedCommand(o.command, env)
                infos.append(read_info(self.launched.pid))
            return self._record(infos)
        finally:
            if self.launched is not None:   # a command we started ends with its recording
                self.launched.stop()

    def _record(self, infos: list[ProcessInfo]) -> int:
        o = self.opts
        try:
            self.snapshots.write_recording(ended=None)
            self.probes.open_events(self._on_event)
            self.hooks.started()
            for info in infos:
                self._add_target(info)
            if o.children:                  # forked before: no event will name them
                self._add_descendants()
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
                if (t := self.targets.get(self.launched.pid)) is not None and t.held:
                    self.attacher.holds.resumed(t)
            self._loop()
        finally:
            self._finish()
        return EXIT_ENVIRONMENT if self.snapshots.disk_full is not None else 0

    def _loop(self) -> None:
        o = self.opts
        start = time.monotonic()
        deadline = start + o.duration if o.duration else None
        next_snap = start + snapshot_interval(0.0, o.interval)
        self.snapshots.begin(start)
        tables = self.parts.tables
        host_wide = o.all_processes or bool(o.cgroups)
        next_tick = start
        while not self._stopping() and (self.targets or host_wide or o.daemon):
            # while a placement or unwind rows are on their way, the loop comes back for them soon:
            # walks and redirection start as soon as they arrive
            busy = self.attacher.busy or (tables is not None and tables.busy)
            self.probes.poll(BUSY_POLL_MS if busy else POLL_MS)
            now = time.monotonic()
            if now >= next_tick or busy:    # on the loop's own clock, not per batch of records
                next_tick = now + TICK_S
                if tables is not None:
                    tables.poll()
                self.attacher.poll(self.targets, self._fail)
                self._rescan(now)
                self._reap_launched()
                self.hooks.tick(now)
                self.controls.tick(now, self.targets)
                self.snapshots.flush(now)
            if deadline is not None and now >= deadline:
                break
            if now >= next_snap:
                self._rescan(now, every=True)
                self._snapshot()
                self.hooks.snapshot_done()
                next_snap += snapshot_interval(next_snap - start, o.interval)
                if next_snap < now:
                    next_snap = now + snapshot_interval(now - start, o.interval)

    def _stopping(self) -> bool:
        return self._stop or self.snapshots.disk_full is not None

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def _snapshot(self, only: frozenset[int] | None = None) -> None:
        self.snapshots.snapshot(self.targets, lambda pid: self._exit(pid, write_rows=False), self._fail, only)

    # the daemon's calls (sampler/service/daemon.py) -----------------------------------------
    def add_process(self, info: ProcessInfo, tier: str, family: bool = False) -> bool:
        """Start recording a process the daemon selected (`family`: its forks too, from their
        fork); False when it exited meanwhile. One recorded already (a family's fork) stays as is."""
        if info.pid not in self.targets:
            self._add_target(info, tier, family=family)
            if family and info.pid in self.targets:     # forked before: no event will name them
                self._add_descendants()
        return info.pid in self.targets

    def takes_forks_of(self, pid: int) -> bool:
        """The forks of `pid` are recorded from their fork (BPF registers them, its fork event adds them)."""
        t = self.targets.get(pid)
        return t is not None and t.family

    def remove_process(self, pid: int, event: str = "exit", detail: str = "") -> None:
        """Stop recording a process (it exited, or no longer matches): its last outstanding rows,
        a `targets` row, probes detached."""
        t = self.targets.get(pid)
        if t is None:
            return
        self.snapshots.last_rows(t, exiting=event == "exit")
        self.snapshots.target_row(t, event, detail)
        self._drop_target(pid, detail or event, exited=event == "exit")

    def recording(self, pid: int) -> bool:
        """Whether `pid` is recorded now."""
        return pid in self.targets

    def recorded(self) -> list[Recorded]:
        return [Recorded(pid, t.info.comm, t.tier) for pid, t in self.targets.items()]

    def recorded_count(self) -> int:
        return len(self.targets)

    def failed_on(self, pid: int) -> bool:
        """Whether recording `pid` failed on something it supplied (it is not tried again)."""
        return pid in self.failed

    @property
    def governed(self) -> bool:
        """Whether the attach tier's governor duty-cycles probes (a CPU budget is set)."""
        return self.parts.governor is not None

    def note(self, pid: int, event: str, detail: str) -> None:
        """A `targets` row about a recorded process."""
        if (t := self.targets.get(pid)) is not None:
            self.snapshots.target_row(t, event, detail)

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
        """The per-process sample-rate cap in force (samples/s)."""
        return self.controls.sample_rate.cap

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

    def write_recording(self) -> None:
        """The `recordings` row again (the daemon: in case it could not be written at start)."""
        self.snapshots.write_recording(ended=None)

    def prune(self, shed: int = 0) -> None:
        """Bound every cache that keeps per-process or per-file state across intervals (for
        recordings of months): what belongs to processes no longer recorded goes, each cache
        keeps to its size bound; `shed` 1 (memory near its bound) drops the memos, 2 (above it)
        also what is costly to rebuild (DWARF line tables, allocator plans, demangled names)."""
        live = set(self.targets)
        p = self.parts
        p.symbolizer.prune(live, shed)
        p.unwinder.prune(p.symbolizer.images())
        self.stacks.prune(live, shed)
        if self.python is not None:
            self.python.prune(live)
        allocators.plans.prune(shed)
        cuda.plans.prune(shed)

    # targets ----------------------------------------------------------------------------------
    def _add_target(self, info: ProcessInfo, tier: str | None = None, parent: Target | None = None,
                    family: bool = False) -> None:
        """`parent`: the target the kernel's fork event says this one was forked from: a sampler
        placed there came with the fork, and is adopted rather than placed again. `family`: its
        forks are recorded too (always under --children)."""
        tier = tier or (RSS if self.opts.rss else SYSCALLS if self.opts.syscalls_only else ATTACH)
        t = self.targets[info.pid] = Target(info, tier=tier)
        t.family = family or self.opts.children or (parent is not None and parent.family)
        if parent is not None and t.family:     # a family spends its root's syscall-event budget
            t.budget = parent.forks_budget
        if parent is not None:
            t.parent = parent.pid
            if parent.injection is not None:
                t.inherits = (parent.injection.base, parent.injection.inode)
        if self._holds_exec(t):
            self.attacher.holds.launcher(t)
        self.controls.add(t)
        try:
            self.attacher.attach(t)
            if self.parts.tables is not None:
                self.parts.tables.track(info.pid)
        except ProcessLookupError:
            self._drop_target(info.pid, "exited while being attached", exited=True)
        except Exception as e:  # noqa: BLE001
            self._fail(info.pid, "attaching", e)

    def _holds_exec(self, t: Target) -> bool:
        """The launcher of the command we started, which is to get the injected sampler: its exec
        is held so that the command's image is placed into before its first allocation."""
        o = self.opts
        return (self.launched is not None and t.pid == self.launched.pid and t.tier == ATTACH
                and o.attach_mode != "uprobe" and not o.preload)

    def _add_descendants(self) -> None:
        """The live descendants of family targets (one pass over /proc): forked before they were
        recorded, so no fork event will name them."""
        for pid, ppid in descendants({p for p, t in self.targets.items() if t.family}):
            if pid not in self.targets and ppid in self.targets:
                with contextlib.suppress(ProcessLookupError):
                    self._add_target(read_info(pid), parent=self.targets[ppid])

    def _add_child(self, pid: int, parent: Target, fork_ns: int) -> bool:
        """A fork of a target, which BPF registered at the fork: until it execs it is a copy of
        its parent (identity included), and a fork of an injected or preloaded parent takes its
        sampler or shim over without reading anything from its files (Attacher.adopt_fork): a few hundred
        microseconds, so that a server forking per connection stays cheap to record. It may have
        exited already: its events until then are still recorded. Returns whether it is recorded."""
        info = dataclasses.replace(parent.info, pid=pid, ppid=parent.pid)
        t = Target(info, family=True, budget=parent.forks_budget, exe_columns=parent.exe_columns)
        t.parent = parent.pid
        if not self.attacher.adopt_fork(t, parent, fork_ns):
            try:
                info = read_info(pid)
            except ProcessLookupError:
                return False
            self._add_target(info, parent=parent)
            return pid in self.targets
        self.targets[pid] = t
        self.controls.add(t)
        self.stacks.fork(parent.pid, pid)
        if self.parts.tables is not None:
            self.parts.tables.fork(parent.pid, pid, fork_ns)
        return True

    def _rescan(self, now: float, every: bool = False) -> None:
        """After an exec the new image maps its libraries a moment later; dlopen can add an
        allocator any time. Rescan recent execs at every poll, `every` target once per interval."""
        for t in list(self.targets.values()):
            if t.rescan_until and now >= t.rescan_until:
                t.rescan_until = 0.0        # the exec window is over: warn if still nothing
            # a target that keeps mapping code (hostile or not) is rescanned at a pace that keeps
            # the rescans' own cost under a tenth of the loop's time
            if (t.rescan_until or every and self._look_due(t, now)) and now >= t.next_rescan:
                try:
                    self.attacher.rescan(t)
                except Exception as e:  # noqa: BLE001
                    self._fail(t.pid, "looking for its libraries", e)
                    continue
                t.next_rescan = now + max(RESCAN_MIN_S, RESCAN_COST_FACTOR * (time.monotonic() - now))
                t.looked = (now, t.drops[0], t.drops[2])

    def _look_due(self, t: Target, now: float) -> bool:
        """The interval's look at `t` (LOOK_S)."""
        at, lost, suppressed = t.looked
        return (now - at >= LOOK_S or (lost, suppressed) != (t.drops[0], t.drops[2])
                or (self.python is not None and not t.py_checked)
                or not (t.libs or t.usdt or t.injection or t.tier in (RSS, SYSCALLS)))

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

    def _drop_target(self, pid: int, why: str, exited: bool = False, restore: bool = False,
                     bpf_gone: bool = False) -> None:
        """`restore`: the process goes on in the image it was recorded in (the recording ended, or
        failed on it): its redirected slots get their functions back, before the probes go."""
        t = self.targets.pop(pid, None)
        if t is not None:
            self.attacher.release(t, restore)
        # an exited process makes no more hits: its links may close in the background
        self.probes.detach(pid, wait=not exited, mappings=t is None or t.vm_sampled, bpf_gone=bpf_gone)
        self.controls.forget(pid)
        if self.gpu is not None:
            self.gpu.forget(pid)
        if t is None:
            return
        self.probes.forget_live(pid, t.table.live_addresses())
        self.stacks.forget(pid)
        if self.parts.tables is not None:
            self.parts.tables.untrack(pid, bpf_gone)
        if self.python is not None:
            self.python.forget(pid, bpf_gone)
        if self._hints.pop(pid, None) is not None:
            self.probes.set_stack_hint(pid, None)
        if not self.opts.daemon:            # the CLI's end-of-recording summary: not kept for months
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
        self.snapshots.target_row(t, "failed", why + "; no longer recorded")
        if not self.opts.quiet:
            print(f"allocsampler: error: pid {pid} ({printable(t.info.comm)}): {printable(why)}; no longer recorded",
                  file=sys.stderr)
        self.hooks.target_failed(pid, t.info.comm, why)
        try:
            self._drop_target(pid, why, restore=True)
        except Exception:  # noqa: BLE001  (detaching what we could; the pid is out of `targets` already)
            self.targets.pop(pid, None)

    def _reap_launched(self) -> None:
        if self.launched is None or self.launched.pid not in self.targets:
            return
        if self.launched.poll() is not None:
            self.probes.drain()
            self._exit(self.launched.pid)

    def _exit(self, pid: int, write_rows: bool = True, bpf_gone: bool = False) -> None:
        """`bpf_gone`: from its exit event (BPF dropped its entries at the exit: proc.bpf.c)."""
        t = self.targets.get(pid)
        if t is None:
            return
        if write_rows:    # not when the interval's snapshot already has its rows
            self.snapshots.last_rows(t, exiting=True)
        status = ""
        if self.launched and self.launched.pid == pid:
            # the exit tracepoint fires just before the parent can reap it
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = f"exit status {self.launched.proc.wait(2)}"
        self.snapshots.target_row(t, "exit", status)
        self._drop_target(pid, status or "exited", exited=True, bpf_gone=bpf_gone)

    # events -----------------------------------------------------------------------------------
    def _on_event(self, raw: bytes) -> None:
        self.snapshots.counts.events += 1
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
        if ev.flags & _PY_MISS and self.python is not None:
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
            self.parts.mappings.on_event(t, ev)
        elif ev.type == EvType.PROC:
            self._on_proc(t, ev)
        elif ev.type == EvType.CUDA and self.gpu is not None:
            self.gpu.on_event(t.table, ev, self._intern, self.snapshots.clock.wall)

    def _intern(self, ev: Event) -> int:
        sid = self.stacks.intern(ev)
        n = self.snapshots.counts
        n.samples += 1
        n.complete += self.stacks.last_stop == COMPLETE
        hint = self.stacks.stack_hint(ev.pid, self.opts.stack_bytes)
        if hint != self._hints.get(ev.pid):       # copy only what this process's walks need
            self._hints[ev.pid] = hint
            self.probes.set_stack_hint(ev.pid, hint)
        return sid

    def _on_proc(self, t: Target, ev: Event) -> None:
        if ev.op == ProcOp.FORK:         # a process, not a thread (BPF tells them apart)
            if t.family and ev.addr not in self.targets:
                n = self.snapshots.counts
                n.children_forked += 1
                if len(self.targets) >= self.opts.max_targets:
                    n.children_skipped += 1     # its BPF entry goes at its exit; nothing of it is read here
                elif self._add_child(ev.addr, t, ev.ts_ns):
                    n.children_recorded += 1
                else:
                    n.children_skipped += 1
        elif ev.op == ProcOp.EXEC:
            t.exe_columns = None            # another image
            t.sample, t.main_arena = None, 0  # and other mappings
            self.attacher.exec_(t, from_thread=ev.addr != ev.pid)
            self.stacks.forget(t.pid)
            if self.parts.tables is not None:
                self.parts.tables.changed(t.pid, exec_=True)
            try:
                t.info = read_info(t.pid)
            except ProcessLookupError:
                return
            self.snapshots.target_row(t, "exec", "")
        elif ev.op == ProcOp.EXIT:
            self._exit(t.pid, bpf_gone=True)
        elif ev.op == ProcOp.ENTRY:
            self.attacher.entered(t)

    # ----------------------------------------------------------------------------------------
    def _finish(self) -> None:
        try:
            self.probes.drain()
            if self.snapshots.started:
                self._snapshot()
            for pid in list(self.targets):
                t = self.targets[pid]
                self.snapshots.target_row(t, "detach", "recording ended")
                self._drop_target(pid, "recording ended", exited=True, restore=True)     # nothing reads on
            pending, helpers = self.attacher.finish()
            if (pending or helpers) and not self.opts.quiet:
                print(f"allocsampler: {pending} process(es) keep the injected sampler's slots (it forwards "
                      f"correctly), {helpers} placement helper(s) still at work: left to end on their own",
                      file=sys.stderr)
            self.snapshots.flush()
            self.snapshots.write_recording(ended=dt.datetime.now(dt.timezone.utc))
        finally:
            try:
                self.snapshots.flush()          # what a failure above left held
            finally:
                self.parts.close()
