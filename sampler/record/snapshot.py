"""Every interval's rows: the snapshotter owns the writer, the recording's clocks and counters,
and turns the targets' state into rows (rows.py) of every table.

What it learns while measuring a target goes back to the loop through callbacks: `gone(pid)` (it
exited meanwhile: its teardown's rows are written here) and `fail(pid, what, error)`.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from sampler import __version__
from sampler.bpf.abi import Counter
from sampler.bpf.loader import BpfProbes
from sampler.control.governor import Governor
from sampler.dataset.schema import (
    FRAMES,
    GPU,
    GPU_EVENTS,
    MALLOC_ARENAS,
    OUTSTANDING,
    PROCESSES,
    RECORDER,
    RECORDINGS,
    STACKS,
    TARGETS,
    VM_EVENTS,
    Table,
)
from sampler.dataset.sources import PYTHON
from sampler.dataset.writer import DatasetWriter, DiskFull
from sampler.gpu.cuda import GpuTracer
from sampler.proc.arenas import PinMap, arena_rows
from sampler.proc.exe_identity import ExeIdentities
from sampler.proc.memory import sample_process
from sampler.proc.pymalloc import pymalloc_row
from sampler.proc.smaps import MAX_HEAP_PIECES
from sampler.python.targets import PythonTargets
from sampler.record import rows
from sampler.record.mappings import Mappings
from sampler.record.options import RecordOptions
from sampler.record.overhead import Controls
from sampler.record.target import Target
from sampler.stacks.kernel_tables import KernelTables
from sampler.stacks.table import StackTable
from sampler.stacks.unwind import Unwinder
from sampler.text import printable

# Adaptive snapshot interval (no --interval): elapsed / ADAPTIVE_SNAPSHOTS within [MIN, MAX], so a
# recording of 10 s or more has >= 8 snapshots (what every check of docs/findings.md needs) and a
# long one settles at one per 10 s.
ADAPTIVE_MIN_S, ADAPTIVE_MAX_S, ADAPTIVE_SNAPSHOTS = 1.0, 10.0, 8


def snapshot_interval(elapsed: float, fixed: float | None) -> float:
    """Seconds to the next snapshot, `elapsed` seconds into the recording."""
    if fixed:
        return fixed
    return min(ADAPTIVE_MAX_S, max(ADAPTIVE_MIN_S, elapsed / ADAPTIVE_SNAPSHOTS))


ROWS_FLUSH_S = 1.0      # targets rows and last outstanding rows are written together at most this often
SAMPLE_REUSE_S = 30.0   # a process's smaps breakdown kept while its RSS stays put (proc/memory.py), this long at most

class Clock:
    """Event times (monotonic ns, as BPF stamps them) on the wall clock of the recording's start."""

    def __init__(self) -> None:
        self._mono_to_wall_ns = time.time_ns() - time.monotonic_ns()

    def wall(self, mono_ns: int) -> dt.datetime:
        return dt.datetime.fromtimestamp((mono_ns + self._mono_to_wall_ns) / 1e9, dt.timezone.utc)

    @staticmethod
    def now() -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)


@dataclass
class Recording:
    """Who this recording is, for its `recordings` row."""

    recording_id: str
    host: str
    started: dt.datetime
    probe_mode: str
    cpu_budget: float                 # 0: no governor
    probe_cost_ns: float | None


@dataclass
class Counts:
    """What the loop counts between two recorder rows."""

    events: int = 0
    samples: int = 0
    complete: int = 0               # of them, stacks walked to their end
    children_forked: int = 0        # forks of family targets
    children_recorded: int = 0
    children_skipped: int = 0


class Snapshots:
    def __init__(self, opts: RecordOptions, recording: Recording, writer: DatasetWriter, clock: Clock, *,
                 probes: BpfProbes,
                 stacks: StackTable, unwinder: Unwinder, tables: KernelTables | None, python: PythonTargets | None,
                 gpu: GpuTracer | None, governor: Governor | None, controls: Controls, mappings: Mappings,
                 faults_used: Callable[[], bool]):
        self.opts, self.recording, self.writer, self.clock = opts, recording, writer, clock
        self.now = clock.now
        self.probes, self.stacks, self.unwinder, self.tables = probes, stacks, unwinder, tables
        self.python, self.gpu, self.governor, self.controls = python, gpu, governor, controls
        self.mappings, self.faults_used = mappings, faults_used
        self.counts = Counts()
        self.exe_ids = ExeIdentities()
        self.disk_full: DiskFull | None = None     # the write that ended the recording
        self._proc = psutil.Process()
        self._snap_at: dict[int, float] = {}       # pid -> its last snapshot (monotonic)
        self._heaps_said: set[int] = set()         # pids whose heaps' budgets were said to have left some out
        self._last_walks: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
        self._last_snap = self._prev_full = 0.0
        self._last_counters: list[int] = []
        self._last_cpu = 0.0
        self.started = False                       # begin() was called: the loop runs
        self._held: dict[str, tuple[Table, list[dict]]] = {}    # rows written together (flush)
        self._flushed_at = 0.0

    # clocks -----------------------------------------------------------------------------------
    def begin(self, mono: float) -> None:
        """The loop starts: intervals are counted from `mono`."""
        self._last_snap = self._prev_full = mono
        self._last_counters = self.probes.counters()
        self._last_cpu = sum(self._proc.cpu_times()[:2])
        self.started = True

    # rows written as things happen ------------------------------------------------------------
    def write_recording(self, ended: dt.datetime | None) -> None:
        o, r = self.opts, self.recording
        row = rows.recording_row(
            r.recording_id, r.host, r.started, ended, sampler_version=__version__, sample_mean=o.sample_mean,
            interval_s=o.interval or ADAPTIVE_MAX_S, probe_mode=r.probe_mode, argv=o.argv,
            cpu_budget=r.cpu_budget, probe_cost_ns=r.probe_cost_ns,
            fault_period=o.fault_period if self.faults_used() else None,
            gpu_status=self.gpu.status if self.gpu is not None else "off (--no-gpu)")
        self.write(RECORDINGS, [row], name=r.recording_id, day=r.started.date())

    def target_row(self, t: Target, event: str, detail: str) -> None:
        gpu = self.gpu
        row = rows.target_row(t, self.now(), event, detail,
                              gpu_libraries=gpu.libraries(t.pid) if gpu is not None else [],
                              gpu_labels=gpu.labels(t.pid) if gpu is not None else [])
        if event in ("attach", "exec"):
            if t.exe_columns is None:
                t.exe_columns = self.exe_ids.of(t.pid, t.info.exe).columns()
            row.update(t.exe_columns)
        self._hold(TARGETS, [row])

    def last_rows(self, t: Target, exiting: bool) -> None:
        """A target's outstanding rows as it stops being recorded (`exiting`: it exited)."""
        self._hold(OUTSTANDING, self._outstanding_rows(t, exiting=exiting))

    def _hold(self, table: Table, out: list[dict]) -> None:
        if out:
            self._held.setdefault(table.name, (table, []))[1].extend(out)

    def flush(self, mono: float | None = None) -> None:
        """The rows written as things happen (`targets`, a process's last `outstanding` rows), one
        file per table: from the loop at most every ROWS_FLUSH_S (`mono`), else now. A fork storm's
        hundreds of children a second make a few files, not four each."""
        if mono is not None and mono - self._flushed_at < ROWS_FLUSH_S:
            return
        self._flushed_at = time.monotonic() if mono is None else mono
        held, self._held = self._held, {}
        for table, out in held.values():
            self.write(table, out)

    def write(self, table: Table, out: list[dict], **kw) -> None:
        """A full or read-only disk ends the recording cleanly (said once; files already written
        stay valid: each is renamed into place whole). The daemon's writer never raises it: it pauses."""
        if self.disk_full is not None:
            return
        try:
            self.writer.write(table, out, **kw)
        except DiskFull as e:
            self.disk_full = e
            print(f"allocsampler: error: cannot write to {self.opts.out} ({e.strerror}): the recording ends; "
                  "what was written before stays readable", file=sys.stderr)

    # the interval's snapshot ------------------------------------------------------------------
    def snapshot(self, targets: dict[int, Target], gone: Callable[[int], None],
                 fail: Callable[[int, str, Exception], None], only: frozenset[int] | None = None) -> None:
        """Rows of every target, or of `only` (pre-OOM: one process, not all; the recorder row,
        which covers all of them, waits for the next full snapshot)."""
        self.flush()                        # exit rows before the interval's: a reader sees both
        now = self.now()
        mono = time.monotonic()
        interval = mono - self._last_snap
        if only is None:
            self._last_snap = mono
            self._snap_at = {p: v for p, v in self._snap_at.items() if p in targets}
            self._heaps_said &= targets.keys()
        since = interval
        drops = self.probes.drops()
        if only is None:        # a family's root that exited while its forks spend its budget
            self.probes.forget_drops([pid for pid in drops
                                      if pid not in targets and not os.path.exists(f"/proc/{pid}")])
        out_rows: list[dict] = []
        proc_rows: list[dict] = []
        arenas: list[dict] = []
        hits = self.probes.hits()
        if self.gpu is not None:
            self.gpu.sample()
        for pid, t in list(targets.items()):
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
                gone(pid)
                continue
            except Exception as e:  # noqa: BLE001
                del arenas[n_arenas:]
                fail(pid, "measuring it", e)
                continue
            out_rows += self._outstanding_rows(t, now, interval)
            proc_rows[-1]["recorder_cpu_s"] = t.recorder_s + time.perf_counter() - t0
            t.recorder_s = 0.0
        # the stacks first: a reader (or an upload, which seals files by age) that sees an
        # outstanding row finds its stack
        stack_rows, frame_rows = rows.stack_rows(self.stacks.drain_new(), now)
        self.write(STACKS, stack_rows)
        self.write(FRAMES, frame_rows)
        self.write(OUTSTANDING, out_rows)
        self.write(PROCESSES, proc_rows)
        self.write(MALLOC_ARENAS, arenas)
        self.write(VM_EVENTS, self.mappings.drain())
        if only is not None:
            return
        if self.gpu is not None:
            self.write(GPU, [{"ts": now, **r} for r in self.gpu.device_rows()])
            self.write(GPU_EVENTS, self.gpu.drain_rows())
        self._recorder_row(now, mono - self._prev_full, targets)
        self._prev_full = mono

    def _note_sampler_mean(self, t: Target) -> None:
        """A `sampling` row when the injected sampler's own rate cap changed its mean."""
        try:
            c = t.injection.counters()
        except OSError:
            return
        if t.sampler_mean is not None and c["cur_mean"] != t.sampler_mean:
            why = "over" if c["cur_mean"] > t.sampler_mean else "back under"
            self.target_row(t, "sampling", f"in-process sample mean {c['cur_mean']} bytes ({why} the cap of "
                                           f"{c['max_per_s']} samples/s, in the process)")
        t.sampler_mean = c["cur_mean"]

    def _outstanding_rows(self, t: Target, now: dt.datetime | None = None,
                          interval: float | None = None, exiting: bool = False) -> list[dict]:
        if interval is None:
            interval = time.monotonic() - self._last_snap
        return rows.outstanding_rows(t, now or self.now(), interval, time.monotonic_ns(), exiting=exiting)

    def _process_row(self, t: Target, now: dt.datetime, arenas: list[dict]) -> dict:
        # the last breakdown stands while no mapping syscall changed the layout (mappings.py drops
        # it at each; one not sent over the process's budget counts too) and RSS stayed put
        mono = time.monotonic()
        fresh = t.sample is None or mono - t.sampled_at >= SAMPLE_REUSE_S or t.sampled_drops != t.drops[2]
        s = sample_process(t.pid, None if fresh else t.sample)
        if s.breakdown is not (t.sample.breakdown if t.sample is not None else None):
            t.sample, t.sampled_at, t.sampled_drops = s, mono, t.drops[2]
        regions = s.breakdown.regions
        t.vm.learn_regions(regions)
        if t.drops[2] > t.reconciled:       # unmaps may have gone unseen: trust the mappings
            t.reconciled = t.drops[2]
            t.table.keep_mapped([(r[0], r[1]) for r in regions])
        # the allocators' layouts, read from outside when their pace allows (sampler/control/pacing.py)
        pins: list[PinMap] = []
        notes = [f"{s.breakdown.heaps_unread:,} pieces of 64 MiB that may be glibc heaps not read (over "
                 f"{MAX_HEAP_PIECES} a snapshot): counted as anonymous memory"] if s.breakdown.heaps_unread else []
        walk = t.glibc_pace.due(time.monotonic())
        cpu = time.thread_time()
        glibc = [{"ts": now, "allocator": "glibc", **r}
                 for r in arena_rows(t.pid, regions, t.table.live_blocks(), pins=pins, walk=walk, notes=notes,
                                     main_hint=t.main_arena)]
        t.main_arena = next((r["arena"] for r in glibc if r["main"]), 0)
        arenas += glibc
        in_use = [r.get("in_use_bytes") for r in glibc]     # each arena's, when its free lists were read
        if walk:
            t.glibc_pace.done(time.monotonic(), time.thread_time() - cpu)
        if notes and t.pid not in self._heaps_said:     # what the heap budgets left out, said once
            self._heaps_said.add(t.pid)
            self.target_row(t, "warning", "; ".join(notes))
            if not self.opts.quiet:
                print(f"allocsampler: warning: pid {t.pid} ({printable(t.info.comm)}): {'; '.join(notes)}",
                      file=sys.stderr)
        marks = (float(s.rss), t.table.totals(PYTHON)[0])
        scan = self.python is not None and self.python.known(t.pid) and t.pymalloc_pace.due(time.monotonic(), marks)
        if scan:
            cpu = time.thread_time()
            py = pymalloc_row(t.pid, regions, pins)
            t.pymalloc_pace.done(time.monotonic(), time.thread_time() - cpu, py is not None, marks)
            if py is not None:
                arenas.append({"ts": now, "pid": t.pid, **py})
        # charged at the snapshots that read a layout: each finding reads its own's (analysis/detect/)
        t.pinned = t.table.pinned(pins) if walk or scan else {}
        return rows.process_row(
            t, now, s, sample_mean=self.controls.sample_mean(t.pid), stack_collisions=self.stacks.collisions,
            malloc_in_use=sum(in_use) if in_use and None not in in_use else None,
            probe_cost_ns=self.governor.cost(t.pid) if self.governor is not None else None,
            gpu=self.gpu.process_columns(t.pid, t.table) if self.gpu is not None else {})

    def _recorder_row(self, now: dt.datetime, interval: float, targets: dict[int, Target]) -> None:
        c = self.probes.counters()
        last, self._last_counters = self._last_counters, c
        cpu = sum(self._proc.cpu_times()[:2])
        cpu_d, self._last_cpu = cpu - self._last_cpu, cpu
        st, n = self.stacks, self.counts
        walks = (st.in_bpf, st.handed_over, self.tables.worker.cpu_seconds() if self.tables is not None else 0.0,
                 st.symbolizer.worker_cpu_seconds())
        in_bpf, handed, worker_s, namer_s = (a - b for a, b in zip(walks, self._last_walks, strict=True))
        self._last_walks = walks
        counters = [a - b for a, b in zip(c, last, strict=True)]
        self.write(RECORDER, [rows.recorder_row(
            now, interval, counters,
            targets=len(targets), events=n.events, stacks_unwound=n.samples,
            stacks_complete=n.complete, live_entries=sum(len(t.table.blocks) for t in targets.values()),
            cpu_s=cpu_d, rss=self._proc.memory_info().rss, vm_events_dropped=self.mappings.dropped,
            stacks_in_bpf=in_bpf, stacks_handed_over=handed, unwind_worker_cpu_s=worker_s, name_worker_cpu_s=namer_s,
            # forks past the family caps were counted in BPF, never sent (proc.bpf.c)
            children_forked=n.children_forked + counters[Counter.FAMILY_FULL],
            children_recorded=n.children_recorded, children_skipped=n.children_skipped + counters[Counter.FAMILY_FULL],
            unwind_rows=self.tables.rows_used if self.tables is not None else None)])
        self.counts = Counts()
        self.mappings.dropped = 0
        self.unwinder.save()
