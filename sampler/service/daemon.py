"""`allocsampler daemon`: record the processes a configuration selects, for months.

One long-running Recorder (sampler/record/recorder.py) with no targets of its own; this module adds
and removes them, and keeps the host safe around it:

- Discovery (sampler/service/discovery.py): every `rescan_s` seconds /proc is scanned and each
  process is matched against the [[targets]] tables.
- Writing: through DaemonWriter (sampler/service/writer.py), a DatasetWriter with private modes
  (0750/0640) that stops writing, without failing, while the disk is full (DiskState, or a write
  that hit ENOSPC) or the dataset is over its budget, and resumes on its own; stacks first seen
  meanwhile are kept (bounded) and written then. `targets` rows are written once per interval.
- Retention (enforce) every few seconds, compaction and analysis in a child process
  (sampler/service/children.py).
- With [upload]: sealing compaction and an upload child every interval_s (sampler/service/upload.py);
  retention keeps what is not uploaded yet, within max_backlog_bytes.
  Findings go to the `findings` table and one log line each when new.
- Pre-OOM capture (sampler/service/preoom.py).
- Its own bounds: CPU (sampler/service/budget.py: above `cpu_percent` the per-process sample
  cap halves, raising the busiest processes' sampling means; at the cap's floor the daemon
  stops reading events for a moment, and the ring buffer counts what that loses) and memory (a 16 MiB
  ring buffer, a 64k-entry live table, pandas kept out, caches pruned every interval and dropped
  near `max_rss`; above it, no new targets until it is back under).
- Metrics (sampler/service/metrics.py) filled from the rows it writes; a status file for
  `allocsampler status` (DATA_DIR/.status.json, rewritten atomically every interval).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter, OrderedDict, deque
from pathlib import Path

from sampler import files, heap
from sampler.dataset.schema import int64
from sampler.dataset.sources import ALLOCATION_TIERS
from sampler.dataset.writer import use_system_allocator
from sampler.environ import python_module
from sampler.errors import EnvironmentProblem
from sampler.proc.process import own_rss, rss_bytes
from sampler.record.options import RecorderHooks
from sampler.service.budget import CpuBudget
from sampler.service.children import CHILD_TIMEOUT_S, Children, Result
from sampler.service.config import Config, format_size
from sampler.service.config import load as load_config
from sampler.service.discovery import Discovery
from sampler.service.preoom import PRE_OOM_CHECK_S, PreOom
from sampler.service.upload import Uploads
from sampler.service.watchdog import Watchdog
from sampler.service.writer import DaemonWriter
from sampler.text import printable

RINGBUF_BYTES = 8 << 20         # the recorder's default
LIVE_MAX = 65536                # sampled live blocks (32 GiB of sampled heap at 512K): ~25 MB of Python at most
STATUS_FILE = ".status.json"
STATUS_VERSION = 1
DISK_CHECK_S = 5.0               # statvfs; a write that hits ENOSPC pauses at once anyway
_MiB = 1 << 20


def log(msg: str) -> None:
    """One line on stderr (the journal under systemd)."""
    print(f"allocsampler: {printable(' '.join(msg.split()))}", file=sys.stderr, flush=True)


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


class Daemon(RecorderHooks):
    """The daemon is the recording's hooks: its writer, and what runs at start, every poll and every snapshot."""

    def __init__(self, cfg: Config, config_path: str):
        self.cfg = cfg
        self.config_path = config_path
        self.root = Path(cfg.daemon.data_dir)
        self.rec = None
        self.dataset: DaemonWriter | None = None    # the recording's writer (made through its hooks)
        self._cap_changed = float("-inf")
        self.sampling_squeezed = 0          # times the sample cap was lowered for the CPU budget
        self.metrics = None
        self.server = None
        self.discovery: Discovery | None = None
        self.disk = None
        self.over_budget = 0
        self._disk_paused_said: str | None = None
        self.pauses = 0
        self._pause_logged = self._resume_logged = -1e9
        self._write_errors: dict[str, float] = {}
        self.jobs = Children(self._job_args, log)
        self.uploads = Uploads(cfg.upload, self.root, log) if cfg.upload is not None else None
        self.findings_seen: OrderedDict[tuple, float] = OrderedDict()
        self.last_findings: list[dict] = []
        self.analysis_state: dict = {}
        self.compaction_state: dict = {}
        self.pre_oom = PreOom(cfg.analysis, cfg.daemon.sample_bytes, log)
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

    # -- start and stop ----------------------------------------------------------------------
    def run(self) -> int:
        _keep_pandas_out()
        use_system_allocator()
        from sampler.dataset.retention import DiskState, ensure_private, recover
        from sampler.dataset.writer import PRIVATE_DIR_MODE
        from sampler.record.options import RecordOptions
        from sampler.record.recorder import Recorder
        from sampler.service.metrics import MetricsServer, MetricsState

        os.umask(0o027)
        d = self.cfg.daemon
        try:
            ensure_private(self.root, dir_mode=PRIVATE_DIR_MODE)
        except files.UnsafePath as e:
            raise EnvironmentProblem(f"daemon.data_dir = {str(self.root)!r}: {e}") from None
        except OSError as e:
            raise EnvironmentProblem(f"daemon.data_dir = {str(self.root)!r}: cannot create it or make it private "
                                     f"({e.strerror or e}): choose a local directory root can write") from None
        for line in recover(self.root):
            log(f"recovery: {line}")
        if self.uploads is not None:
            self._probe_upload()
        self.disk = DiskState(self.root, floor_bytes=self.cfg.retention.min_free_bytes,
                              retry_s=min(300.0, max(5.0, 10 * d.interval_s)))
        self.metrics = MetricsState(stall_after_s=max(60.0, 3 * d.interval_s))
        self.metrics.update_health(live_capacity=LIVE_MAX)
        self.watchdog = Watchdog.from_env()
        if self.cfg.metrics.enabled:
            m = self.cfg.metrics
            self.server = MetricsServer(self.metrics, m.host, m.port).start()
            if not m.loopback_only:
                log(f"metrics listen on {m.listen}, not loopback: process names and pids are visible to "
                    "whoever reaches the port")
        opts = RecordOptions(
            out=str(self.root), interval=d.interval_s, sample_mean=d.sample_bytes, live_max=LIVE_MAX,
            fault_period=d.fault_period, cpu_budget=d.cpu_budget_percent / 100, ringbuf_bytes=RINGBUF_BYTES,
            attach_mode=d.attach_mode, python_objects=d.python_objects,
            max_samples_per_s=d.max_samples_per_s, vm_events_per_s=d.vm_events_per_s,
            daemon=True, quiet=True, argv=" ".join(sys.argv), max_targets=d.max_targets)
        log(f"daemon starting: config {self.config_path}, data in {self.root}, "
            f"{len(self.cfg.targets)} target tables, metrics "
            f"{'on http://' + self.cfg.metrics.listen + '/metrics' if self.server else 'off'}")
        t0 = time.monotonic()
        self._t0 = t0
        try:
            self.rec = rec = Recorder(opts, hooks=self)     # BPF loaded
            self.discovery = Discovery(self.cfg, rec)
            code = rec.run()
        finally:
            self.watchdog.stopping()
            self.jobs.stop()
            if self.server is not None:
                self.server.stop()
            self._write_status(state="stopped")
        log(f"daemon stopped after {time.monotonic() - t0:.0f} s (recording {rec.recording_id})")
        return code

    # -- the recording's hooks ---------------------------------------------------------------
    def writer(self, root: str, recording_id: str, host: str) -> DaemonWriter:
        self.dataset = DaemonWriter(self, root, recording_id, host)
        return self.dataset

    def started(self) -> None:
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
        self.watchdog.ready(f"recording {rec.recording_id}")

    def tick(self, now: float) -> None:
        self.metrics.heartbeat(now)
        self.watchdog.pet(now)
        due = self._due
        if now >= due["scan"]:
            full = now >= due["full_scan"]
            if full:
                due["full_scan"] = now + 60.0
            self._scan(now, full)
            due["scan"] = now + self.cfg.daemon.rescan_s
        if now >= due["pre_oom"]:
            self.pre_oom.check(now, self.rec, self.discovery.start_of)
            due["pre_oom"] = now + PRE_OOM_CHECK_S
        if now >= due["disk"]:
            self._update_disk(now)
            due["disk"] = now + DISK_CHECK_S
        if now >= due["retention"]:
            self._retention()
            due["retention"] = now + max(5.0, self.cfg.daemon.interval_s)
        if now >= due["analysis"] and self.cfg.analysis.every_s:
            self.jobs.queue("analyze")
            due["analysis"] = now + self.cfg.analysis.every_s
        if self.uploads is not None and self.uploads.due(now):
            self.jobs.queue("upload")
        if now >= due["compact"]:
            self.jobs.queue("compact")
            due["compact"] = now + min(max(self.cfg.retention.compact_after_s, 1.0), 3600.0)
        if (result := self.jobs.poll(now)) is not None:
            self._job_done(result)
        self._cpu_budget(now)

    def _cpu_budget(self, now: float) -> None:
        """Over the CPU budget, sampling means rise first (the per-process sample cap halves, once
        a second at most, so that the busiest processes' means go up); events are dropped (reading
        paused) only when the cap is at its floor, or while the debt keeps growing meanwhile.
        Comfortably under budget again, the cap doubles back every 10 s."""
        owed = self.cpu.owed()
        if owed > 0:
            if now >= self._cap_changed + 1.0:
                cap = self.rec.sampling_cap(f"the daemon is over its CPU budget of {self.cfg.daemon.cpu_percent:g}%")
                if cap is not None:
                    self._cap_changed = now
                    self.sampling_squeezed += 1
                    log(f"over its CPU budget ({self.cfg.daemon.cpu_percent:g}%): per-process sample cap "
                        f"lowered to {cap:g}/s, so that sampling means rise before any event is dropped")
                    return
            if now < self._cap_changed + 1.0 and owed < 0.5:
                return                      # the last change has not had time to act
            pause = min(owed, 2.0)
            self.cpu.throttled_s += pause
            self.rec.idle(pause)
        elif self.cpu.allowance > 0.8 * self.cpu.cap and now >= self._cap_changed + 10.0:
            cap = self.rec.sampling_cap(None)
            if cap is not None:
                self._cap_changed = now
                log(f"back within its CPU budget: per-process sample cap raised to {cap:g}/s")

    def target_failed(self, pid: int, comm: str, why: str) -> None:
        log(f"target pid {pid} ({printable(comm)}): {printable(why)}; no longer recorded")

    def snapshot_done(self) -> None:
        limit = self.cfg.daemon.max_rss
        now = time.monotonic()
        if now - self._trimmed_at > 30:
            heap.trim()                   # freed heap back to the system
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
                     if tier in ALLOCATION_TIERS else None)
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
            w = self.dataset
            w.flush_held()
            if w.held_dropped:
                log(f"{w.held_dropped} stack rows first seen while paused were not kept (bounded)")
                w.held_dropped = 0
            with contextlib.suppress(Exception):
                self.rec.write_recording()      # in case it could not be written at start
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
                          keep_recordings={self.rec.recording_id},
                          backlog=self.uploads.plan if self.uploads is not None else None)
        except OSError as e:
            self.write_failed("retention", e)
            return
        if self.uploads is not None:
            self.uploads.retention_done(rep)
            self.metrics.set_upload(self.uploads.health())
        self._dataset_bytes = rep.total_bytes
        if rep.deleted and (rep.expired or len(rep.deleted) > 50 or not getattr(self, "_said_retention", False)):
            self._said_retention = True
            log(f"retention: deleted {len(rep.deleted)} files ({rep.deleted_bytes / _MiB:.1f} MiB, {rep.expired} "
                f"past max_age_days); dataset {rep.total_bytes / _MiB:.1f} MiB of {format_size(r.max_bytes)}")
        self.over_budget = rep.over_budget_bytes
        self._said_pause()
        self.metrics.update_health(dataset_bytes=rep.total_bytes)

    # -- children: analysis and compaction -------------------------------------------------------
    def _job_args(self, kind: str) -> tuple[list[str], float]:
        if kind == "analyze":
            return ([str(self.root), "--window", str(self.cfg.analysis.window_s)],
                    min(CHILD_TIMEOUT_S, max(60.0, self.cfg.analysis.every_s)))
        if kind == "upload":
            return self.uploads.job_args()
        # with [upload], compaction seals: its merged files are final, what is uploaded
        seal = ["--seal"] if self.uploads is not None else []
        return [str(self.root), "--older-than", str(self.cfg.retention.compact_after_s), *seal], CHILD_TIMEOUT_S

    def _probe_upload(self) -> None:
        """One request to the store before recording: refused credentials or a missing bucket stop
        the daemon (exit 3, one line); an unreachable store is said once and retried later."""
        u = self.uploads
        argv = python_module("sampler.service.children", str(os.getpid()), "probe", *u.probe_args())
        timeout = min(30.0, u.cfg.timeout_s)
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                               cwd="/")
        except subprocess.TimeoutExpired:
            log(f"upload: {u.cfg.uri} did not answer within {timeout:g} s; recording goes on and closed files "
                f"are kept (up to upload.max_backlog_bytes, {format_size(u.cfg.max_backlog_bytes)}) and uploaded "
                "when it answers")
            return
        lines = p.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit status {p.returncode}"
        if p.returncode == 3:
            raise EnvironmentProblem(why)
        if p.returncode != 0:
            log(f"upload: {u.cfg.uri} cannot be reached now ({why}): check upload.uri, upload.endpoint and the "
                f"network; recording goes on and closed files are kept (up to upload.max_backlog_bytes, "
                f"{format_size(u.cfg.max_backlog_bytes)}) and uploaded when it can be reached")

    def _job_done(self, r: Result) -> None:
        state, doc = r.state, r.doc
        if r.kind == "upload":
            self.uploads.done(doc, state, time.monotonic(), r.wall)
            self.metrics.set_upload(self.uploads.health())
            return
        if r.kind == "analyze":
            if doc is not None:
                state["findings"] = self._findings(doc, r.wall)
                state["max_rss_bytes"] = doc.get("max_rss_bytes")
            self.analysis_state = state
            return
        rep = doc or {}
        state.update(rep)
        if rep.get("merged_files"):
            before, after = rep["bytes_before"] / _MiB, rep["bytes_after"] / _MiB
            log(f"compaction: {rep['merged_files']} files merged into {rep['new_files']} "
                f"({before:.1f} -> {after:.1f} MiB) in {rep['seconds']:.1f} s")
        for skipped in rep.get("skipped", [])[:3]:
            log(f"compaction: skipped {skipped}")
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
            rows.append({"ts": ts, "pid": int(f.get("pid") or 0), "comm": str(f.get("comm") or ""),
                         "kind": str(f.get("kind") or ""), "severity": _float(f.get("severity")),
                         "confidence": _float(f.get("confidence")), "summary": f.get("summary"),
                         "source": f.get("source"), "stack_id": _int64(f.get("stack_id")), "new": new,
                         "window_s": float(self.cfg.analysis.window_s),
                         "details": json.dumps(f, separators=(",", ":"), default=str)})
        if rows:
            self.dataset.write(FINDINGS, rows)
        self.last_findings = [{k: f.get(k) for k in ("kind", "pid", "comm", "severity", "summary")}
                              for f in found[:20]]
        return len(found)

    # -- memory -------------------------------------------------------------------------------
    def _memory(self) -> int:
        """The RSS the bound applies to (own_rss: measured only when RSS nears the bound)."""
        rss = self.rss_raw = rss_bytes()
        return own_rss(rss) if rss > 0.85 * self.cfg.daemon.max_rss else rss

    def _prune_caches(self, level: int) -> None:
        """The recorder's caches are sized for a recording of minutes, not for months of process
        churn: pruned every interval (level 0), their memos dropped near max_rss (1), what is
        costly to rebuild dropped above it (2); then gc and malloc_trim give the memory back."""
        if self.rec is None:
            return
        self.rec.prune(level)
        if level >= 1:
            gc.collect()
            heap.trim()

    # -- status ---------------------------------------------------------------------------------
    def _write_status(self, state: str = "running") -> None:
        rec = self.rec
        targets = []
        if rec is not None:
            for pid, comm, tier in rec.recorded():
                row = self.last_proc_rows.get(pid, {})
                k = self.discovery.known.get(pid) if self.discovery else None
                rule = k.rule if k is not None else None
                targets.append({
                    "pid": pid, "comm": comm, "tier": tier,
                    "rule": (f"targets[{rule}] {self.cfg.targets[rule].describe()}" if rule is not None else None),
                    "configured_tier": self.cfg.targets[rule].tier if rule is not None else None,
                    "since": _iso(k.since) if k is not None and k.since else None,
                    "rss_bytes": row.get("rss"), "alloc_coverage": row.get("alloc_coverage"),
                    "probe_cpu_estimate": row.get("probe_cpu_estimate"),
                    # the recorder's own time on it, over the last interval
                    "recorder_cpu_percent": _percent(row.get("recorder_cpu_s"), self.cfg.daemon.interval_s),
                    "pre_oom": pid in self.pre_oom.windows})
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
                       "sample_cap_per_s": rec.sample_cap if rec is not None else None,
                       "sample_cap_lowered": self.sampling_squeezed,
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
        if self.uploads is not None:
            doc["upload"] = self.uploads.status(time.monotonic())
        with contextlib.suppress(OSError), files.atomic_file(self.root / STATUS_FILE, 0o640, durable=False) as f:
            f.write(json.dumps(doc, default=str).encode())


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


def _percent(seconds: float | None, interval_s: float) -> float | None:
    return None if seconds is None else round(100 * seconds / max(interval_s, 1e-3), 2)


def _float(v) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _int64(v) -> int | None:
    try:
        return int64(int(v))
    except (TypeError, ValueError):
        return None


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def run(config_path: str) -> int:
    """`allocsampler daemon --config PATH`: UsageError (exit 2) for a bad configuration, before
    anything is loaded."""
    cfg = load_config(config_path)
    return Daemon(cfg, config_path).run()
