"""`allocsampler daemon`: record the processes a configuration selects, for months.

One long-running Recorder (sampler/record/recorder.py) with no targets of its own; this module adds and
removes them, and keeps the host safe around it:

- Discovery: every `rescan_s` seconds /proc is scanned and each process is matched against the
  [[targets]] tables (Config.target_for). Processes are known by (pid, start time), so a reused
  pid is a new process; a process is evaluated again when its name or command line changes (exec).
  Exits are reported by the kernel at once (sched_process_exit); the scan is the safety net.
- Writing: through `_Writer`, a DatasetWriter with private modes (0750/0640) that stops writing,
  without failing, while the disk is full (DiskState, or a write that hit ENOSPC) or the dataset
  is over its budget, and resumes on its own; stacks first seen meanwhile are kept (bounded) and
  written then. `targets` rows are written once per interval, not one file each.
- Retention (enforce) every few seconds, compaction and analysis in a child process (pyarrow's
  merge buffers and pandas never enter the daemon's memory; the child dies with the daemon).
  Findings go to the `findings` table and one log line each when new.
- Pre-OOM capture: a recorded process whose cgroup nears its memory limit gets a snapshot at once,
  full probe coverage for a window and a snapshot at its end.
- Its own bounds: CPU (a token bucket over the process's CPU time: above `cpu_percent` the daemon
  stops reading events for a moment; the ring buffer counts what that loses) and memory (a 16 MiB
  ring buffer, a 64k-entry live table, pandas kept out, caches pruned every interval and dropped
  near `max_rss`; above it, no new targets until it is back under).
- Metrics (sampler/service/metrics.py) filled from the rows it writes; a status file for
  `allocsampler status` (DATA_DIR/.status.json, rewritten atomically every interval).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from sampler.errors import EnvironmentProblem
from sampler.proc.cgroups import cgroup_memory_levels, memory_pressure
from sampler.proc.process import ProcView, own_rss, read_cmdline, read_stat, rss_bytes
from sampler.service.config import ALWAYS_ON, Config, Target, format_size
from sampler.service.config import load as load_config

RINGBUF_BYTES = 16 << 20        # half the recorder's default: it is mapped twice, so it counts 2x in RSS
LIVE_MAX = 65536                # sampled live blocks (32 GiB of sampled heap at 512K): ~25 MB of Python at most
STACK_HOLD = 20_000             # stacks kept while writing is paused (their frames: up to 20 x)
TARGETS_FLUSH = 5_000           # targets rows buffered at most before a write
STATUS_FILE = ".status.json"
STATUS_VERSION = 1
PRE_OOM_CHECK_S = 1.0
PRE_OOM_AGAIN_S = 300.0
DISK_CHECK_S = 5.0               # statvfs; a write that hits ENOSPC pauses at once anyway
CPU_BURST_S = 3.0               # the CPU budget may be spent ahead by this many seconds' worth
MAX_ADDS_PER_SCAN = 64          # processes attached per scan; the rest wait for the next (events flow)
CHILD_TIMEOUT_S = 600
PF_KTHREAD = 0x00200000
_MiB = 1 << 20


def log(msg: str) -> None:
    """One line on stderr (the journal under systemd)."""
    print(f"allocsampler: {' '.join(msg.split())}", file=sys.stderr, flush=True)


# --- keeping pandas out ------------------------------------------------------------------------

class _NoPandas:
    """pyarrow imports pandas the first time it builds an array, to check whether the input is a
    pandas object: ~45 MB of RSS for nothing in the daemon. Blocked here; analysis runs in a child."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (kept out of the daemon)", name=name)
        return None


def _keep_pandas_out() -> None:
    if "pandas" not in sys.modules and not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


# --- discovery -----------------------------------------------------------------------------------

def recorder_tier(rule: Target) -> str:
    """The recorder's tier for a configured one. attach and preload-aware are one tier there: a
    process that carries otel_memory probes is recorded through them in both (probing its
    allocator as well would count each sample twice)."""
    return "rss" if rule.tier == ALWAYS_ON else "attach"


@dataclass
class Known:
    start: int
    sig: tuple[str, str]             # (comm, cmdline) when last evaluated
    rule: int | None                 # index of the [[targets]] table that selected it
    recorded: bool = False
    since: float = 0.0               # wall time it was added
    readds: int = 0                  # times added again after the recorder dropped it alive


class Discovery:
    """Which processes to record: /proc scans matched against the configuration.

    `rec` needs targets (pid -> anything), add_process(info, tier) -> bool and
    remove_process(pid, event, detail); tests pass a fake recorder and a fake /proc."""

    def __init__(self, cfg: Config, rec, *, proc: str = "/proc", self_pid: int | None = None,
                 max_targets: int | None = None, read_info=None):
        from sampler.proc.process import read_info as _read_info

        self.cfg, self.rec, self.proc = cfg, rec, proc
        self.read_info = read_info or _read_info
        self.self_pid = os.getpid() if self_pid is None else self_pid
        self.max_targets = max_targets or cfg.daemon.max_targets
        self.known: dict[int, Known] = {}
        self.paused = False              # memory: no new targets
        self.left_out = 0                # processes selected but not recorded (max_targets, memory)
        self._said_full = False
        self.scans = 0

    def scan(self, full: bool = False) -> list[str]:
        """One pass over /proc; returns log lines. `full` re-evaluates every process (cgroup or
        user changes are not visible in the name and command line)."""
        self.scans += 1
        lines: list[str] = []
        try:
            pids = sorted(int(d) for d in os.listdir(self.proc) if d.isdigit())
        except OSError:
            return lines
        present = set(pids)
        adds = 0
        left_out = 0
        for pid in pids:
            if pid == self.self_pid:
                continue
            st = read_stat(pid, self.proc)
            if st is None or st.flags & PF_KTHREAD or st.ppid == self.self_pid:
                continue                            # gone, a kernel thread, or our own child
            k = self.known.get(pid)
            if k is not None and k.start != st.start:      # the pid was reused: the old one ended
                if k.recorded and pid in self.rec.targets:
                    self.rec.remove_process(pid, "exit", "exited (its pid was reused)")
                    lines.append(f"target pid {pid} exited (pid reused)")
                k = None
            if st.state in "ZX":
                if k is not None and k.recorded and pid in self.rec.targets:
                    self.rec.remove_process(pid, "exit", "exited")
                    k.recorded = False
                continue
            cmdline = read_cmdline(pid, self.proc)
            if cmdline is None:
                continue
            sig = (st.comm, cmdline)
            readds = k.readds if k is not None else 0
            if k is not None and k.recorded and pid not in self.rec.targets:
                # alive, yet dropped by the recorder: a failed attach, or the exit event of the
                # pid's previous process read late. Tried again, twice at most.
                k.recorded = False
                if k.readds >= 2:
                    k.sig = sig
                    continue
                readds += 1
            elif k is not None and k.sig == sig and (not full or k.readds >= 2):
                continue
            view = ProcView.read(pid, self.proc)
            if view is None:
                continue
            rule = next((i for i, t in enumerate(self.cfg.targets) if t.matches(view)), None)
            was = k.rule if k is not None and k.recorded and pid in self.rec.targets else None
            if was is not None:
                if rule == was or (rule is not None and self.cfg.targets[rule].tier == self.cfg.targets[was].tier):
                    k.sig, k.rule = sig, rule
                    continue
                why = (f"exec: now {st.comm!r}, no target table selects it" if rule is None else
                       f"exec: now selected by targets[{rule}] at tier {self.cfg.targets[rule].tier}")
                self.rec.remove_process(pid, "detach", why)
                lines.append(f"target pid {pid} ({st.comm}) detached: {why}")
                k.recorded = False
            k = self.known[pid] = Known(st.start, sig, rule, readds=readds)
            if rule is None:
                continue
            if adds >= MAX_ADDS_PER_SCAN:
                del self.known[pid]                 # evaluated again at the next scan
                continue
            if self.paused or len(self.rec.targets) >= self.max_targets:
                left_out += 1
                del self.known[pid]
                continue
            try:
                info = self.read_info(pid)
            except ProcessLookupError:
                continue
            if (again := read_stat(pid, self.proc)) is None or again.start != st.start:
                del self.known[pid]                 # reused while we looked: next scan
                continue
            adds += 1
            target = self.cfg.targets[rule]
            tier = recorder_tier(target)
            if self.rec.add_process(info, tier):
                k.recorded, k.since = True, time.time()
                self.rec.note(pid, "select", f"targets[{rule}] ({target.describe()}): tier {target.tier}")
                lines.append(f"target pid {pid} ({info.comm}) added: targets[{rule}] "
                             f"({target.describe()}), tier {target.tier}")
        for pid in [p for p in self.known if p not in present]:
            k = self.known.pop(pid)
            if k.recorded and pid in self.rec.targets:
                self.rec.remove_process(pid, "exit", "exited")
                lines.append(f"target pid {pid} exited")
        self.left_out = left_out
        if left_out and not self._said_full:
            why = "memory above max_rss" if self.paused else f"max_targets = {self.max_targets} reached"
            lines.append(f"{left_out} selected processes are not recorded ({why}); they are added when "
                         "room is back")
            self._said_full = True
        elif not left_out:
            self._said_full = False
        return lines

    def rule_of(self, pid: int) -> int | None:
        k = self.known.get(pid)
        return k.rule if k is not None and k.recorded else None


# --- CPU budget ----------------------------------------------------------------------------------

class CpuBudget:
    """A token bucket over the process's CPU time (all threads): `fraction` of a CPU per second of
    wall time, at most `burst_s` seconds' worth saved up."""

    def __init__(self, fraction: float, burst_s: float = CPU_BURST_S):
        self.fraction = fraction
        self.cap = fraction * burst_s
        self.allowance = self.cap
        self.t, self.cpu = time.monotonic(), time.process_time()
        self.throttled_s = 0.0

    def owed(self) -> float:
        """Seconds to stop working for, to be back within the budget (0: within it)."""
        now, cpu = time.monotonic(), time.process_time()
        self.allowance = min(self.cap, self.allowance + (now - self.t) * self.fraction - (cpu - self.cpu))
        self.t, self.cpu = now, cpu
        return -self.allowance / self.fraction if self.allowance < 0 else 0.0


# --- the dataset writer --------------------------------------------------------------------------

def _make_writer(daemon: Daemon, root: str, recording_id: str):
    from sampler.dataset.schema import FRAMES, RECORDER, RECORDINGS, STACKS, TARGETS
    from sampler.dataset.writer import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, DatasetWriter, DiskFull

    class _Writer(DatasetWriter):
        """Observes every row for the metrics; skips writing while paused; never raises for a full
        disk or an I/O error (the recording goes on in memory)."""

        def __init__(self):
            super().__init__(root, recording_id, dir_mode=PRIVATE_DIR_MODE, file_mode=PRIVATE_FILE_MODE)
            self.targets_rows: list[dict] = []
            self.held: dict[str, list] = {STACKS.name: [], FRAMES.name: []}
            self.held_dropped = 0
            self.skipped_rows = 0

        def write(self, table, rows, **kw):
            if len(rows) == 0:
                return None
            daemon.observe(table, rows)
            if table is TARGETS:                 # one file per interval, not per event
                self.targets_rows += rows
                if len(self.targets_rows) < TARGETS_FLUSH:
                    return None
                rows, self.targets_rows = self.targets_rows, []
            elif table in (RECORDER, RECORDINGS):
                self.flush_targets()
            if daemon.writing_paused:
                if table.name in self.held:
                    held = self.held[table.name]
                    if len(self.held[STACKS.name]) < STACK_HOLD:
                        held += rows
                    else:
                        self.held_dropped += len(rows)
                else:
                    self.skipped_rows += len(rows)
                return None
            return self._write(table, rows, **kw)

        def _write(self, table, rows, **kw):
            try:
                return super().write(table, rows, **kw)
            except DiskFull as e:
                daemon.disk_full(e)
            except OSError as e:
                daemon.write_failed(table.name, e)
            if table.name in self.held:
                self.held[table.name] += rows
            else:
                self.skipped_rows += len(rows)
            return None

        def flush_targets(self) -> None:
            if self.targets_rows:
                rows, self.targets_rows = self.targets_rows, []
                if daemon.writing_paused:
                    self.skipped_rows += len(rows)
                else:
                    self._write(TARGETS, rows)

        def flush_held(self) -> None:
            """After a pause: the stacks first seen meanwhile (outstanding rows reference them)."""
            for name, table in ((STACKS.name, STACKS), (FRAMES.name, FRAMES)):
                rows, self.held[name] = self.held[name], []
                if rows and not daemon.writing_paused:
                    self._write(table, rows)
                elif rows:
                    self.held[name] = rows

    return _Writer()


# --- child processes -----------------------------------------------------------------------------

@dataclass
class _Child:
    kind: str
    proc: subprocess.Popen
    out: object            # a temporary file: its stdout
    err: object
    started: float
    deadline: float
    info: dict = field(default_factory=dict)


class Daemon:
    def __init__(self, cfg: Config, config_path: str):
        self.cfg = cfg
        self.config_path = config_path
        self.root = Path(cfg.daemon.data_dir)
        self.rec = None
        self.metrics = None
        self.server = None
        self.discovery: Discovery | None = None
        self.disk = None
        self.over_budget = 0
        self._disk_paused_said: str | None = None
        self.pauses = 0
        self._pause_logged = self._resume_logged = -1e9
        self._write_errors: dict[str, float] = {}
        self.child: _Child | None = None
        self.pending: list[str] = []
        self.findings_seen: OrderedDict[tuple, float] = OrderedDict()
        self.last_findings: list[dict] = []
        self.analysis_state: dict = {}
        self.compaction_state: dict = {}
        self.pre_oom_levels: dict[int, tuple[int, list[tuple[str, int]], float]] = {}  # pid -> (start, levels, when)
        self.pre_oom_windows: dict[int, float] = {}    # pid -> end (monotonic)
        self.pre_oom_last: dict[tuple[int, int], float] = {}
        self.growth: dict[int, deque] = {}
        self.proc_rows: dict[int, dict] = {}
        self.gpu_rows: dict[int, dict] = {}      # device index -> `gpu` row of this interval
        self.last_proc_rows: dict[int, dict] = {}
        self.out_sums: dict[int, dict[str, list[float]]] = {}
        self.events_per_s = 0.0
        self.cpu_fraction = 0.0                  # of one CPU, over the last minute
        self._cpu_hist: deque = deque()
        self.started_wall = time.time()
        self.started_mono = time.monotonic()
        self.shed_count = 0
        self._last_shed_log = -1e9
        self._shed_at = [0.0, -1e9, -1e9]      # when caches were dropped, by level
        self._trimmed_at = 0.0
        self.rss_raw = 0
        self._rss = 0
        self._dataset_bytes: int | None = None
        self._due: dict[str, float] = {}
        self.stopping = False

    # -- start and stop ----------------------------------------------------------------------
    def run(self) -> int:
        _keep_pandas_out()
        import pyarrow as pa

        # the system allocator: memory that pyarrow frees goes back with malloc_trim (mimalloc keeps it)
        pa.set_memory_pool(pa.system_memory_pool())
        from sampler.dataset.retention import DiskState, ensure_private, recover
        from sampler.dataset.writer import PRIVATE_DIR_MODE
        from sampler.record.recorder import Recorder, RecordOptions
        from sampler.service.metrics import MetricsServer, MetricsState

        os.umask(0o027)
        d = self.cfg.daemon
        try:
            ensure_private(self.root, dir_mode=PRIVATE_DIR_MODE)
        except OSError as e:
            raise EnvironmentProblem(f"daemon.data_dir = {str(self.root)!r}: cannot create it or make it private "
                                     f"({e.strerror or e}): choose a local directory root can write") from None
        for line in recover(self.root):
            log(f"recovery: {line}")
        self.disk = DiskState(self.root, floor_bytes=self.cfg.retention.min_free_bytes,
                              retry_s=min(300.0, max(5.0, 10 * d.interval_s)))
        self.metrics = MetricsState()
        self.metrics.update_health(live_capacity=LIVE_MAX)
        if self.cfg.metrics.enabled:
            m = self.cfg.metrics
            self.server = MetricsServer(self.metrics, m.host, m.port).start()
            if not m.loopback_only:
                log(f"metrics listen on {m.listen}, not loopback: process names and pids are visible to "
                    "whoever reaches the port")
        opts = RecordOptions(
            out=str(self.root), interval=d.interval_s, sample_mean=d.sample_bytes, live_max=LIVE_MAX,
            fault_period=d.fault_period, cpu_budget=d.cpu_budget_percent / 100, ringbuf_bytes=RINGBUF_BYTES,
            max_samples_per_s=d.max_samples_per_s, vm_events_per_s=d.vm_events_per_s,
            daemon=True, quiet=True, argv=" ".join(sys.argv))
        self.rec = rec = Recorder(opts)
        rec.writer_factory = lambda root, rid: _make_writer(self, root, rid)
        rec.on_start = self._on_start
        rec.on_tick = self._on_tick
        rec.on_snapshot = self._on_snapshot
        self.discovery = Discovery(self.cfg, rec)
        log(f"daemon starting: config {self.config_path}, data in {self.root}, "
            f"{len(self.cfg.targets)} target tables, metrics "
            f"{'on http://' + self.cfg.metrics.listen + '/metrics' if self.server else 'off'}")
        t0 = time.monotonic()
        self._t0 = t0
        try:
            code = rec.run()
        finally:
            self.stopping = True
            self._stop_child()
            if self.server is not None:
                self.server.stop()
            self._write_status(state="stopped")
        log(f"daemon stopped after {time.monotonic() - t0:.0f} s (recording {rec.recording_id})")
        return code

    def _on_start(self) -> None:
        rec = self.rec
        now = time.monotonic()
        self._rss = rss_bytes()
        log(f"recording {rec.recording_id}: BPF loaded in {now - self._t0:.1f} s, RSS {self._rss / _MiB:.0f} MiB "
            f"(max_rss {format_size(self.cfg.daemon.max_rss)}), CPU budget {self.cfg.daemon.cpu_percent:g}%")
        self.cpu = CpuBudget(self.cfg.daemon.cpu_percent / 100)
        self._update_disk(now, force=True)
        self._scan(now, full=True)
        a, r = self.cfg.analysis, self.cfg.retention
        self._due = {"scan": now + self.cfg.daemon.rescan_s, "full_scan": now + 60.0, "pre_oom": now,
                     "disk": now + DISK_CHECK_S, "retention": now, "status": now,
                     "analysis": now + min(a.every_s, 60.0),
                     "compact": now + min(r.compact_after_s, 3600.0)}
        self._write_status()

    # -- the loop's hooks ---------------------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        due = self._due
        if now >= due["scan"]:
            full = now >= due["full_scan"]
            if full:
                due["full_scan"] = now + 60.0
            self._scan(now, full)
            due["scan"] = now + self.cfg.daemon.rescan_s
        if now >= due["pre_oom"]:
            self._pre_oom(now)
            due["pre_oom"] = now + PRE_OOM_CHECK_S
        if now >= due["disk"]:
            self._update_disk(now)
            due["disk"] = now + DISK_CHECK_S
        if now >= due["retention"]:
            self._retention()
            due["retention"] = now + max(5.0, self.cfg.daemon.interval_s)
        if now >= due["analysis"] and self.cfg.analysis.every_s:
            self._queue("analyze")
            due["analysis"] = now + self.cfg.analysis.every_s
        if now >= due["compact"]:
            self._queue("compact")
            due["compact"] = now + min(max(self.cfg.retention.compact_after_s, 10.0), 3600.0)
        self._children(now)
        owed = self.cpu.owed()
        if owed > 0:
            pause = min(owed, 2.0)
            self.cpu.throttled_s += pause
            self.rec.idle(pause)

    def _on_snapshot(self) -> None:
        rec = self.rec
        rec.finished.clear()                 # the CLI's end-of-recording summary: not kept for months
        limit = self.cfg.daemon.max_rss
        now = time.monotonic()
        if now - self._trimmed_at > 30:
            _malloc_trim()                   # freed heap back to the system
            self._trimmed_at = now
        self._rss = self._memory()
        # near the bound, caches go: the cheap ones at most every 10 minutes, the costly ones
        # (DWARF line tables, allocator plans) only above it, at most every 5 minutes
        level = 2 if self._rss > limit and now - self._shed_at[2] > 300 else \
            1 if self._rss > 0.9 * limit and now - self._shed_at[1] > 600 else 0
        before = self._rss
        self._prune_caches(level)
        if level:
            self._rss = self._memory()
            for i in range(1, level + 1):
                self._shed_at[i] = now
            self.shed_count += 1
            if now - self._last_shed_log > 600 or level == 2:
                self._last_shed_log = now
                log(f"memory: RSS {before / _MiB:.0f} MiB {'above' if level == 2 else 'near'} max_rss "
                    f"{limit / _MiB:.0f} MiB: caches dropped, now {self._rss / _MiB:.0f} MiB")
        pause = self._rss > limit or (self.discovery.paused and self._rss > 0.85 * limit)
        if pause != self.discovery.paused:
            self.discovery.paused = pause
            log(f"memory: RSS {self._rss / _MiB:.0f} MiB {'above' if pause else 'back under'} max_rss "
                f"{limit / _MiB:.0f} MiB: new targets {'are not added' if pause else 'are added again'}")
        self._write_status()

    # -- discovery ----------------------------------------------------------------------------
    def _scan(self, now: float, full: bool = False) -> None:
        lines = self.discovery.scan(full)
        if len(lines) > 20:
            adds = sum(" added: " in ln for ln in lines)
            exits = sum(" exited" in ln for ln in lines)
            lines = lines[:10] + [f"... and {len(lines) - 10} more target changes in this scan "
                                  f"({adds} added, {exits} exited in all)"]
        for line in lines:
            log(line)

    # -- rows seen by the writer (metrics) ----------------------------------------------------
    def observe(self, table, rows) -> None:
        name = table.name
        if name == "outstanding":
            for r in rows:
                s = self.out_sums.setdefault(r["pid"], {}).setdefault(str(r["source"]), [0.0, 0.0])
                s[0] += r["outstanding_bytes"] or 0.0
                s[1] += (r["outstanding_stderr_bytes"] or 0.0) ** 2
        elif name == "processes":
            for r in rows:
                self.proc_rows[r["pid"]] = r
        elif name == "gpu":
            for r in rows:
                self.gpu_rows[r["device"]] = r
        elif name == "recorder":
            self._interval_done(rows[-1])

    def _interval_done(self, row: dict) -> None:
        from sampler.service.metrics import GPU_KINDS, SOURCES, DeviceMetrics, Estimate, ProcessMetrics

        ts = row["ts"].timestamp()
        procs = []
        tiers: Counter = Counter()
        for pid, r in self.proc_rows.items():
            tier = str(r.get("tier"))
            tiers[tier] += 1
            hist = self.growth.setdefault(pid, deque(maxlen=60))
            hist.append((ts, float(r["rss"])))
            sums = self.out_sums.get(pid, {})
            live = (r.get("heap_live_bytes") or 0.0) + (r.get("arena_live_bytes") or 0.0)
            bloat = (max(0.0, (r.get("heap_rss") or 0) + (r.get("arena_rss") or 0) - live)
                     if tier in ("attach", "preload") else None)
            gpu = {k: float(v) for k in GPU_KINDS if (v := r.get(f"gpu_{k}_bytes")) is not None}
            gpu_se = {k: float(v) for k in GPU_KINDS if (v := r.get(f"gpu_{k}_stderr_bytes")) is not None}
            try:
                procs.append(ProcessMetrics(
                    pid=pid, comm=str(r["comm"]), tier=tier, rss_bytes=int(r["rss"]),
                    growth_bytes_per_second=_slope(hist),
                    outstanding={s: Estimate(v[0], math.sqrt(v[1])) for s, v in sums.items() if s in SOURCES},
                    arena_bloat_bytes=bloat, gpu_memory_bytes=gpu, gpu_memory_stderr_bytes=gpu_se,
                    memory_limit_bytes=r.get("memory_limit"), sample_mean_bytes=r.get("sample_mean_bytes")))
            except (ValueError, TypeError):
                continue             # a tier or source this version does not publish
        for pid in [p for p in self.growth if p not in self.proc_rows]:
            del self.growth[pid]
        self.metrics.set_processes(procs)
        self.metrics.set_devices(DeviceMetrics(index=int(d), total_bytes=r["total_bytes"], used_bytes=r["used_bytes"],
                                               reserved_bytes=r.get("reserved_bytes"), processes=r.get("processes"))
                                 for d, r in self.gpu_rows.items())
        self.metrics.add_interval(events=row["events"], lost_events=row["lost_events"], samples=row["samples"],
                                  dropped_samples=row["dropped_samples"],
                                  vm_events_dropped=row["vm_events_dropped"],
                                  vm_events_suppressed=row.get("vm_events_suppressed") or 0)
        self.events_per_s = row["events"] / row["interval_s"] if row["interval_s"] else 0.0
        now, cpu = time.monotonic(), time.process_time()
        self._cpu_hist.append((now, cpu))
        while len(self._cpu_hist) > 2 and now - self._cpu_hist[1][0] >= 60:
            self._cpu_hist.popleft()             # the last minute
        t0, c0 = self._cpu_hist[0]
        self.cpu_fraction = (cpu - c0) / (now - t0) if now > t0 else 0.0
        self.metrics.update_health(
            live_entries=row["live_entries"], cpu_seconds_total=time.process_time(),
            resident_memory_bytes=row["rss"], targets=dict(tiers), last_snapshot_timestamp=ts,
            dataset_bytes=self._dataset_bytes, writing_paused=self.writing_paused)
        self.last_proc_rows, self.proc_rows, self.out_sums, self.gpu_rows = self.proc_rows, {}, {}, {}

    # -- disk -----------------------------------------------------------------------------------
    @property
    def writing_paused(self) -> bool:
        return bool(self.disk is not None and self.disk.full) or self.over_budget > 0

    def _pause_reason(self) -> str | None:
        if self.disk is not None and self.disk.full:
            free = self.disk.free_bytes
            return (f"the file system of {self.root} is full ({format_size(free) if free is not None else '?'} free, "
                    f"min_free_bytes {format_size(self.cfg.retention.min_free_bytes)})")
        if self.over_budget > 0:
            return (f"the dataset is over retention.max_bytes ({format_size(self.cfg.retention.max_bytes)}) by "
                    f"{self.over_budget / _MiB:.1f} MiB of files too recent or still referenced to delete")
        return None

    def _said_pause(self) -> None:
        """Log a change of the writing state: once, then (a budget that keeps being reached) at
        most every 10 minutes with a count."""
        why = self._pause_reason()
        now = time.monotonic()
        if why is not None and self._disk_paused_said is None:
            self.pauses += 1
            if now - self._pause_logged > 600:
                again = f" (paused {self.pauses - 1} more times since the last message)" if self.pauses > 1 else ""
                log(f"writing paused: {why}; recording goes on in memory and metrics are still served{again}")
                self._pause_logged, self.pauses = now, 0
        elif why is None and self._disk_paused_said is not None:
            if now - self._resume_logged > 600:
                log("writing resumed")
                self._resume_logged = now
            w = self.rec.writer
            w.flush_held()
            if w.held_dropped:
                log(f"{w.held_dropped} stack rows first seen while paused were not kept (bounded)")
                w.held_dropped = 0
            with contextlib.suppress(Exception):
                self.rec._write_recording(ended=None)      # in case it could not be written at start
        if (why is None) != (self._disk_paused_said is None):
            self.metrics.update_health(writing_paused=self.writing_paused)
        self._disk_paused_said = why

    def _update_disk(self, now: float, force: bool = False) -> None:
        try:
            self.disk.update(now)
        except OSError:
            return
        self._said_pause()

    def disk_full(self, e: OSError) -> None:
        self.disk.mark_full()
        self._said_pause()

    def write_failed(self, table: str, e: OSError) -> None:
        now = time.monotonic()
        if now - self._write_errors.get(table, -1e9) > 600:
            self._write_errors[table] = now
            log(f"could not write {table} rows: {e.strerror or e} ({e.filename or self.root}); rows of this "
                "interval are dropped (said once per 10 minutes)")

    def _retention(self) -> None:
        from sampler.dataset.retention import enforce

        r = self.cfg.retention
        try:
            rep = enforce(self.root, r.max_bytes, r.max_age_days,
                          keep_recent_s=max(2.5 * self.cfg.daemon.interval_s, 5.0),
                          keep_recordings={self.rec.recording_id})
        except OSError as e:
            self.write_failed("retention", e)
            return
        self._dataset_bytes = rep.total_bytes
        if rep.deleted and (rep.expired or len(rep.deleted) > 50 or not getattr(self, "_said_retention", False)):
            self._said_retention = True
            log(f"retention: deleted {len(rep.deleted)} files ({rep.deleted_bytes / _MiB:.1f} MiB, {rep.expired} "
                f"past max_age_days); dataset {rep.total_bytes / _MiB:.1f} MiB of {format_size(r.max_bytes)}")
        self.over_budget = rep.over_budget_bytes
        self._said_pause()
        self.metrics.update_health(dataset_bytes=rep.total_bytes)

    # -- children: analysis and compaction -------------------------------------------------------
    def _queue(self, kind: str) -> None:
        if kind not in self.pending and not (self.child and self.child.kind == kind):
            self.pending.append(kind)

    def _children(self, now: float) -> None:
        c = self.child
        if c is not None:
            code = c.proc.poll()
            if code is None:
                if now > c.deadline:
                    c.proc.kill()
                    c.proc.wait()
                    log(f"{c.kind}: child took over {c.deadline - c.started:.0f} s and was stopped")
                    self._close_child()
                return
            try:
                self._child_done(c, code, now)
            finally:
                self._close_child()
        if self.pending and self.child is None and not self.stopping:
            self._start_child(self.pending.pop(0), now)

    def _start_child(self, kind: str, now: float) -> None:
        if kind == "analyze":
            args = ["analyze", str(self.root), "--window", str(self.cfg.analysis.window_s)]
            timeout = min(CHILD_TIMEOUT_S, max(60.0, self.cfg.analysis.every_s))
        else:
            args = ["compact", str(self.root), "--older-than", str(self.cfg.retention.compact_after_s)]
            timeout = CHILD_TIMEOUT_S
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()     # noqa: SIM115 (closed in _close_child)
        try:
            argv = [sys.executable, "-m", "sampler.service.daemon", "--child", str(os.getpid()), *args]
            proc = subprocess.Popen(argv,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
                                    cwd="/")
        except OSError as e:
            out.close()
            err.close()
            log(f"{kind}: could not start a child process: {e.strerror or e}")
            return
        self.child = _Child(kind, proc, out, err, now, now + timeout, {"wall": time.time()})

    def _close_child(self) -> None:
        c, self.child = self.child, None
        if c is not None:
            for f in (c.out, c.err):
                with contextlib.suppress(Exception):
                    f.close()

    def _stop_child(self) -> None:
        if self.child is not None and self.child.proc.poll() is None:
            self.child.proc.kill()
            with contextlib.suppress(Exception):
                self.child.proc.wait(5)
        self._close_child()

    def _child_done(self, c: _Child, code: int, now: float) -> None:
        c.out.seek(0)
        c.err.seek(0)
        text = c.out.read().decode(errors="replace")
        err_lines = c.err.read().decode(errors="replace").strip().splitlines()
        state = {"at": dt.datetime.fromtimestamp(c.info["wall"], dt.timezone.utc).isoformat(timespec="seconds"),
                 "seconds": round(now - c.started, 1), "exit": code}
        if code != 0:
            state["error"] = err_lines[-1] if err_lines else f"exit status {code}"
            log(f"{c.kind}: failed ({state['error']})")
        elif c.kind == "analyze":
            try:
                doc = json.loads(text)
            except ValueError:
                state["error"] = "unreadable output"
                log("analyze: unreadable output from the child")
            else:
                state["findings"] = self._findings(doc, c.info["wall"])
                state["max_rss_bytes"] = doc.get("max_rss_bytes")
        else:
            try:
                rep = json.loads(text)
            except ValueError:
                rep = {}
            state.update(rep)
            if rep.get("merged_files"):
                before, after = rep["bytes_before"] / _MiB, rep["bytes_after"] / _MiB
                log(f"compaction: {rep['merged_files']} files merged into {rep['new_files']} "
                    f"({before:.1f} -> {after:.1f} MiB) in {rep['seconds']:.1f} s")
            for s in rep.get("skipped", [])[:3]:
                log(f"compaction: skipped {s}")
        if c.kind == "analyze":
            self.analysis_state = state
        else:
            self.compaction_state = state

    def _findings(self, doc: dict, wall: float) -> int:
        from sampler.dataset.schema import FINDINGS

        ts = dt.datetime.fromtimestamp(wall, dt.timezone.utc)
        rows = []
        found = doc.get("findings", [])
        for f in found:
            key = (f.get("kind"), f.get("pid"), f.get("comm"), f.get("source"), f.get("stack_id"),
                   f.get("recording_id"))
            new = key not in self.findings_seen
            self.findings_seen[key] = wall
            self.findings_seen.move_to_end(key)
            while len(self.findings_seen) > 10_000:
                self.findings_seen.popitem(last=False)
            if new:
                log(f"finding: {f.get('kind')} pid {f.get('pid')} ({f.get('comm')}), severity "
                    f"{float(f.get('severity') or 0):.0f}, confidence {float(f.get('confidence') or 0):.2f}: "
                    f"{f.get('summary', '')}")
            rows.append({"ts": ts, "recording_id": self.rec.recording_id, "host": self.rec.host,
                         "pid": int(f.get("pid") or 0), "comm": str(f.get("comm") or ""),
                         "kind": str(f.get("kind") or ""), "severity": _float(f.get("severity")),
                         "confidence": _float(f.get("confidence")), "summary": f.get("summary"),
                         "source": f.get("source"), "stack_id": _int64(f.get("stack_id")), "new": new,
                         "window_s": float(self.cfg.analysis.window_s),
                         "details": json.dumps(f, separators=(",", ":"), default=str)})
        if rows:
            self.rec.writer.write(FINDINGS, rows)
        self.last_findings = [{k: f.get(k) for k in ("kind", "pid", "comm", "severity", "summary")}
                              for f in found[:20]]
        return len(found)

    # -- pre-OOM capture ----------------------------------------------------------------------
    def _pre_oom(self, now: float) -> None:
        a = self.cfg.analysis
        rec = self.rec
        for pid, end in list(self.pre_oom_windows.items()):
            if now >= end:
                del self.pre_oom_windows[pid]
                if pid in rec.targets:
                    rec.snapshot_now()
                    rec.note(pid, "pre_oom", "window over: snapshot taken")
                    log(f"pre-OOM: pid {pid} window over, snapshot written")
        if not a.pre_oom:
            return
        for pid in [p for p in self.pre_oom_levels if p not in rec.targets]:
            del self.pre_oom_levels[pid]
        for pid, t in list(rec.targets.items()):
            start = self.discovery.known[pid].start if pid in self.discovery.known else 0
            cached = self.pre_oom_levels.get(pid)
            if cached is None or cached[0] != start or (now - cached[2] > 60):
                cached = self.pre_oom_levels[pid] = (start, cgroup_memory_levels(pid), now)
            levels = cached[1]
            if not levels or pid in self.pre_oom_windows:
                continue
            p = memory_pressure(levels)
            if p is None or p[0] < a.pre_oom_fraction:
                continue
            key = (pid, start)
            if now - self.pre_oom_last.get(key, -1e9) < max(2 * a.pre_oom_window_s, PRE_OOM_AGAIN_S):
                continue                            # still near the limit: again in 5 minutes
            self.pre_oom_last[key] = now
            if len(self.pre_oom_last) > 4096:
                self.pre_oom_last = dict(list(self.pre_oom_last.items())[-2048:])
            ratio, usage, limit = p
            self.pre_oom_windows[pid] = now + a.pre_oom_window_s
            raised = rec.raise_detail(pid, now + a.pre_oom_window_s, a.pre_oom_sample_bytes)
            mean = rec.sample_mean(pid)
            detail = (f"cgroup memory {usage / _MiB:.0f} MiB of its {limit / _MiB:.0f} MiB limit ({100 * ratio:.0f}%, "
                      f"threshold {100 * a.pre_oom_fraction:.0f}%): snapshot now and after {a.pre_oom_window_s:g} s"
                      + (f"; sampled at a {mean} byte mean meanwhile" if mean < self.cfg.daemon.sample_bytes else "")
                      + ("; allocation probes attached all the time meanwhile"
                         if raised and t.tier == "attach" and self.rec.governor is not None else ""))
            rec.note(pid, "pre_oom", detail)
            rec.snapshot_now()
            log(f"pre-OOM: pid {pid} ({t.info.comm}) {detail}")

    # -- memory -------------------------------------------------------------------------------
    def _memory(self) -> int:
        """The RSS the bound applies to (own_rss: measured only when RSS nears the bound)."""
        rss = self.rss_raw = rss_bytes()
        return own_rss(rss) if rss > 0.85 * self.cfg.daemon.max_rss else rss

    def _prune_caches(self, level: int) -> None:
        """The recorder's caches are sized for a recording of minutes, not for months of process
        churn. Level 0 (every interval): what they hold for processes that are gone, and a size
        cap on the per-file ones. 1 (near max_rss): the memos, then gc and malloc_trim. 2 (above
        it): also DWARF line tables, allocator plans and demangled names (costly to rebuild)."""
        from sampler.binary import dwarf_lines
        from sampler.probes import allocators
        from sampler.stacks import symbolize

        rec = self.rec
        sym = getattr(rec, "symbolizer", None)
        unw = getattr(rec, "unwinder", None)
        if sym is None or unw is None:
            return
        with contextlib.suppress(AttributeError, TypeError, RuntimeError):
            live = {id(img) for v in sym._procs.values() for img in v.images.values() if img is not None}
            for d in (unw._tables, unw.cfi._by_image):
                for img in [k for k in d if id(k) not in live]:
                    del d[img]
            for pid in [p for p in sym._procs if p not in rec.targets]:
                del sym._procs[pid]
            if level >= 2 or len(allocators._plan_cache) > 512:
                allocators._plan_cache.clear()
            if level >= 2 or len(dwarf_lines.LineTables._cache) > 256:
                with dwarf_lines.LineTables._cache_lock:
                    dwarf_lines.LineTables._cache.clear()
            if level >= 2:
                symbolize.demangle.cache_clear()
            if level >= 1:
                sym._memo.clear()
                # generations only keep old memo entries apart: with the memo empty they may go
                for pid in [p for p in sym._generations if p not in rec.targets]:
                    del sym._generations[pid]
                rec.stacks._memo.clear()
        if level >= 1:
            gc.collect()
            _malloc_trim()

    # -- status ---------------------------------------------------------------------------------
    def _write_status(self, state: str = "running") -> None:
        rec = self.rec
        targets = []
        if rec is not None and hasattr(rec, "targets"):
            for pid, t in rec.targets.items():
                row = self.last_proc_rows.get(pid, {})
                k = self.discovery.known.get(pid) if self.discovery else None
                rule = k.rule if k is not None else None
                targets.append({
                    "pid": pid, "comm": t.info.comm, "tier": t.tier,
                    "rule": (f"targets[{rule}] {self.cfg.targets[rule].describe()}" if rule is not None else None),
                    "configured_tier": self.cfg.targets[rule].tier if rule is not None else None,
                    "since": _iso(k.since) if k is not None and k.since else None,
                    "rss_bytes": row.get("rss"), "alloc_coverage": row.get("alloc_coverage"),
                    "probe_cpu_estimate": row.get("probe_cpu_estimate"),
                    "pre_oom": pid in self.pre_oom_windows})
        targets.sort(key=lambda x: -(x["rss_bytes"] or 0))
        h = self.metrics.snapshot().health if self.metrics is not None else None
        doc = {
            "version": STATUS_VERSION, "state": state, "pid": os.getpid(), "updated": _iso(time.time()),
            "started": _iso(self.started_wall), "config": self.config_path, "data_dir": str(self.root),
            "recording_id": getattr(rec, "recording_id", None),
            "metrics": f"http://{self.cfg.metrics.listen}/metrics" if self.server is not None else None,
            "interval_s": self.cfg.daemon.interval_s,
            "writing": "paused: " + self._pause_reason() if self.writing_paused else "ok",
            "disk": {"dataset_bytes": self._dataset_bytes, "max_bytes": self.cfg.retention.max_bytes,
                     "free_bytes": self.disk.free_bytes if self.disk is not None else None,
                     "min_free_bytes": self.cfg.retention.min_free_bytes},
            "daemon": {"rss_bytes": self.rss_raw or rss_bytes(), "bounded_rss_bytes": self._rss,
                       "max_rss": self.cfg.daemon.max_rss,
                       "cpu_fraction": round(self.cpu_fraction, 4), "cpu_budget": self.cfg.daemon.cpu_percent / 100,
                       "throttled_s": round(getattr(getattr(self, "cpu", None), "throttled_s", 0.0), 1),
                       "caches_dropped": self.shed_count},
            "health": {"events_per_s": round(self.events_per_s, 1),
                       "events_total": h.events_total if h else 0, "lost_events_total": h.lost_events_total if h else 0,
                       "dropped_samples_total": h.dropped_samples_total if h else 0,
                       "live_entries": h.live_entries if h else 0, "live_capacity": LIVE_MAX},
            "targets_total": len(targets), "targets_left_out": self.discovery.left_out if self.discovery else 0,
            "tiers": dict(Counter(t["tier"] for t in targets)),
            "targets": targets[:100],
            "analysis": self.analysis_state, "compaction": self.compaction_state,
            "findings": self.last_findings,
        }
        path = self.root / STATUS_FILE
        tmp = self.root / f".{STATUS_FILE}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
            with open(fd, "w") as f:
                json.dump(doc, f, default=str)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


# --- helpers -------------------------------------------------------------------------------------

def _slope(hist: deque) -> float | None:
    """Least-squares slope (bytes/s) of (t, rss) points; None with fewer than 3."""
    if len(hist) < 3:
        return None
    n = len(hist)
    mt = sum(t for t, _ in hist) / n
    my = sum(y for _, y in hist) / n
    var = sum((t - mt) ** 2 for t, _ in hist)
    if var <= 0:
        return None
    return sum((t - mt) * (y - my) for t, y in hist) / var


def _float(v) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _int64(v) -> int | None:
    try:
        v = int(v)
    except (TypeError, ValueError):
        return None
    return v - (1 << 64) if v >= 1 << 63 else v


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def run(config_path: str) -> int:
    """`allocsampler daemon --config PATH`: UsageError (exit 2) for a bad configuration, before
    anything is loaded."""
    cfg = load_config(config_path)
    return Daemon(cfg, config_path).run()


# --- the child: python -m sampler.service.daemon --child PARENT_PID analyze|compact ... -----------------

def _die_with_parent(parent: int) -> None:
    """SIGKILL when the daemon dies (kill -9 included), so a compaction is never left running."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:           # it died before the prctl
        os._exit(1)
    with contextlib.suppress(OSError):
        os.nice(10)


def _child_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sampler.service.daemon --child")
    p.add_argument("parent", type=int)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("analyze")
    a.add_argument("dir")
    a.add_argument("--window", type=float, required=True)
    c = sub.add_parser("compact")
    c.add_argument("dir")
    c.add_argument("--older-than", type=float, required=True)
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    if args.what == "analyze":
        from analysis import analyze
        from analysis.dataset import load

        since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=args.window)
        findings = analyze.run(load(args.dir, since=since))
        print(json.dumps({**analyze.to_document(findings), "max_rss_bytes": _own_peak()}))
        return 0
    from sampler.dataset.retention import compact

    rep = compact(args.dir, args.older_than)
    print(json.dumps({"merged_files": rep.files_before, "new_files": len(rep.merged),
                      "bytes_before": rep.bytes_before, "bytes_after": rep.bytes_after,
                      "seconds": round(rep.seconds, 2), "skipped": rep.skipped, "max_rss_bytes": _own_peak()}))
    return 0


def _own_peak() -> int:
    """This process's peak RSS since its exec: VmHWM, as getrusage's maxrss keeps the RSS of the
    forked daemon from before the exec."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) << 10
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(_child_main(sys.argv[2:]))
    print("usage: allocsampler daemon --config PATH", file=sys.stderr)
    sys.exit(2)
