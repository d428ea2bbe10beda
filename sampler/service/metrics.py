"""Prometheus metrics endpoint of the daemon, exposed with prometheus-client.

The daemon fills a `MetricsState` once per interval (per-process and GPU figures) and more often
(recorder health). `StateCollector` turns a snapshot of it into the families of `FAMILIES` (one
table), prometheus_client's `generate_latest` writes them in text format 0.0.4, and
`MetricsServer` serves that on `GET /metrics`, and nothing else.

Cardinality is bounded by construction: per-process series carry the pid and at most one label
from a small fixed set (tier, source, GPU memory kind), never a stack; and only the top
`max_processes` processes by RSS get series, the rest are counted in
`allocsampler_processes_omitted`. The process name (comm, which the target chooses and may change
at will) is only on `allocsampler_process_info{pid,comm} 1`, so a renaming process replaces one
series, not one per gauge; join it where a name is wanted:
`allocsampler_process_rss_bytes * on(pid) group_left(comm) allocsampler_process_info`.
GPU device series carry only the device index. Counters are cumulative since
`allocsampler_start_time_seconds`; take `rate()` of them for per-second figures (events/s is
`rate(allocsampler_events_total[1m])`).

The server runs as root and may listen beyond loopback, so a client gets little: one request per
connection, read and answered within `timeout_s` in all (a slowloris is cut off, not waited for),
at most `max_connections` at a time (beyond that the oldest one still sending its request is
dropped, or the new one refused when all are being answered), and a rendering only when the state
changed since the last one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sampler.dataset.sources import FAULT, MALLOC, MMAP, PYTHON, TIERS
from sampler.errors import EnvironmentProblem

# What generate_latest writes (our names are all legacy-valid). Spelt out: prometheus-client 0.22+
# points its CONTENT_TYPE_LATEST at version=1.0.0, and older ones lack CONTENT_TYPE_PLAIN_0_0_4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
DEFAULT_MAX_PROCESSES = 200
DEFAULT_TIMEOUT_S = 10.0        # Prometheus's default scrape_timeout: past it the scraper has gone
DEFAULT_MAX_CONNECTIONS = 8     # a Prometheus pair and a few curls
PREFIX = "allocsampler_"
MAX_COMM = 128                  # characters; psutil's name() can be a whole argv[0], any length

# The closed label sets (schema.md: processes.tier, outstanding.source).
SOURCES = (MALLOC, PYTHON, MMAP, FAULT)
GPU_KINDS = ("used", "reserved", "pinned", "allocated")   # processes.gpu_<kind>_bytes (schema.md)


@dataclass(frozen=True)
class Estimate:
    """A Horvitz-Thompson estimate and one standard error, bytes."""
    bytes: float
    stderr_bytes: float


@dataclass(frozen=True)
class ProcessMetrics:
    """One target at the last snapshot. Frozen (mappings are read-only copies), so a snapshot of
    the state can share these objects with the daemon thread instead of copying them."""
    pid: int
    comm: str
    tier: str                                       # one of TIERS
    rss_bytes: int
    growth_bytes_per_second: float | None = None    # trend over the daemon's window; None: too few points
    outstanding: Mapping[str, Estimate] = field(default_factory=dict)   # source (SOURCES) -> estimate
    arena_bloat_bytes: float | None = None          # glibc heap/arena bytes resident but not live
    gpu_memory_bytes: Mapping[str, float] = field(default_factory=dict)  # kind (GPU_KINDS) -> bytes
    gpu_memory_stderr_bytes: Mapping[str, float] = field(default_factory=dict)  # of the estimated kinds
    memory_limit_bytes: int | None = None           # smallest cgroup limit or host RAM
    sample_mean_bytes: int | None = None            # its sampling mean now (sampler/control/sample_rate.py)

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier {self.tier!r} not in {TIERS}")
        if not set(self.outstanding) <= set(SOURCES):
            raise ValueError(f"outstanding sources {sorted(self.outstanding)} not in {SOURCES}")
        if not set(self.gpu_memory_bytes) | set(self.gpu_memory_stderr_bytes) <= set(GPU_KINDS):
            raise ValueError(f"GPU memory kinds {sorted({*self.gpu_memory_bytes, *self.gpu_memory_stderr_bytes})} "
                             f"not in {GPU_KINDS}")
        for name in ("outstanding", "gpu_memory_bytes", "gpu_memory_stderr_bytes"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class DeviceMetrics:
    """One GPU at the last snapshot, as the driver (NVML) reports it: a `gpu` table row."""
    index: int                          # NVML device index: the only label
    total_bytes: int
    used_bytes: int
    reserved_bytes: int | None = None   # the driver's own reserve; None without nvmlMemory_v2
    processes: int | None = None        # processes with memory on the device


@dataclass
class RecorderHealth:
    """The recorder's own state. `*_total` fields are cumulative since the daemon started."""
    events_total: int = 0                 # ring-buffer records read
    lost_events_total: int = 0            # ring buffer full
    samples_total: int = 0                # sampling decisions that chose an allocation
    dropped_samples_total: int = 0        # samples not tracked: live table full
    vm_events_dropped_total: int = 0      # vm_events rows over the per-interval cap
    vm_events_suppressed_total: int = 0   # syscall events BPF did not send (per-process budget)
    live_entries: int = 0                 # sampled live blocks tracked in the BPF live table
    live_capacity: int = 0                # its max entries (0: unknown)
    cpu_seconds_total: float = 0.0        # own user + system CPU
    resident_memory_bytes: int = 0        # own RSS (bcc's LLVM included)
    targets: Mapping[str, int] = field(default_factory=dict)   # tier -> processes recorded
    last_snapshot_timestamp: float | None = None               # Unix seconds of the last interval written
    dataset_bytes: int | None = None      # disk usage of the output directory
    writing_paused: bool = False          # disk full or over budget: snapshots are not written


@dataclass(frozen=True)
class UploadHealth:
    """The daemon's [upload] (sampler/service/upload.py); `*_total` since the daemon started, but
    lost files, which count since the dataset's first upload."""
    backlog_files: int = 0                # not uploaded yet (sealed or not)
    backlog_bytes: int = 0
    backlog_oldest_age_seconds: float | None = None
    uploaded_files_total: int = 0
    uploaded_bytes_total: int = 0
    failures_total: int = 0               # upload runs that failed
    lost_files_total: int = 0             # deleted before they could be uploaded
    lost_bytes_total: int = 0
    last_success_timestamp: float | None = None


@dataclass
class MetricsState:
    """What /metrics shows. The daemon writes through the methods (they take the lock and bump
    `generation`, by which the server knows to render again); the server renders `snapshot()`, a
    copy, so a slow scrape never holds the lock."""
    processes: list[ProcessMetrics] = field(default_factory=list)
    devices: list[DeviceMetrics] = field(default_factory=list)
    health: RecorderHealth = field(default_factory=RecorderHealth)
    upload: UploadHealth | None = None    # None without [upload]: no upload families at all
    max_processes: int = DEFAULT_MAX_PROCESSES
    start_time: float = field(default_factory=time.time)
    stall_after_s: float = 60.0           # the loop counts as stalled without a heartbeat this long
    generation: int = field(default=0, init=False, compare=False)
    loop_heartbeat: float = field(default_factory=time.monotonic, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def set_processes(self, processes: Iterable[ProcessMetrics]) -> None:
        """Replace the per-process figures (once per interval): exited processes disappear."""
        procs = list(processes)
        with self._lock:
            self.processes = procs
            self.generation += 1

    def set_devices(self, devices: Iterable[DeviceMetrics]) -> None:
        """Replace the GPU figures (once per interval): none when NVML is not there."""
        devs = list(devices)
        with self._lock:
            self.devices = devs
            self.generation += 1

    def set_upload(self, upload: UploadHealth) -> None:
        with self._lock:
            self.upload = upload
            self.generation += 1

    def update_health(self, **changes: object) -> None:
        """Set health fields by name, e.g. update_health(resident_memory_bytes=..., writing_paused=True)."""
        with self._lock:
            self.health = dataclasses.replace(self.health, **changes)  # TypeError on an unknown name
            self.generation += 1

    def add_interval(self, *, events: int = 0, lost_events: int = 0, samples: int = 0,
                     dropped_samples: int = 0, vm_events_dropped: int = 0,
                     vm_events_suppressed: int = 0) -> None:
        """Add one `recorder` row's per-interval counts to the cumulative counters."""
        with self._lock:
            h = self.health
            self.health = dataclasses.replace(
                h, events_total=h.events_total + events, lost_events_total=h.lost_events_total + lost_events,
                samples_total=h.samples_total + samples,
                dropped_samples_total=h.dropped_samples_total + dropped_samples,
                vm_events_dropped_total=h.vm_events_dropped_total + vm_events_dropped,
                vm_events_suppressed_total=h.vm_events_suppressed_total + vm_events_suppressed)
            self.generation += 1

    def heartbeat(self, now: float) -> None:
        """From the recording loop, at every poll (monotonic `now`). One float store: no lock, and
        no new rendering (the health lines are computed when served)."""
        self.loop_heartbeat = now

    def snapshot(self) -> MetricsState:
        with self._lock:
            return MetricsState(processes=list(self.processes), devices=list(self.devices),
                                health=dataclasses.replace(self.health, targets=dict(self.health.targets)),
                                upload=self.upload, max_processes=self.max_processes, start_time=self.start_time)


# --- families ------------------------------------------------------------------------------------

Value = float | int | bool | None
Scope = Literal["daemon", "process", "device", "upload"]


@dataclass(frozen=True)
class _Daemon:
    """What the daemon-wide families read: the health and the figures of the snapshot as a whole."""
    health: RecorderHealth
    start_time: float
    omitted: int


@dataclass(frozen=True)
class Family:
    """One published family. `get` reads one object of `scope` (a `_Daemon`, a `ProcessMetrics`, a
    `DeviceMetrics`): a value, or {value of `label`: value} for a family with one more label. None
    is no sample: an unknown figure is absent, never a made-up 0."""
    name: str                   # after PREFIX; a counter's ends in _total
    help: str
    get: Callable[[Any], Value | Mapping[str, Value]]
    scope: Scope = "daemon"
    label: str | None = None
    kind: Literal["gauge", "counter"] = "gauge"

    @property
    def labels(self) -> tuple[str, ...]:
        ids = {"daemon": (), "process": ("pid",), "device": ("device",), "upload": ()}[self.scope]
        return (*ids, self.label) if self.label else ids

    def new(self) -> Metric:
        # CounterMetricFamily keeps the name without _total and the text format adds it back to the
        # HELP, TYPE and sample lines: the exposed names are the same as those given here.
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        return cls(PREFIX + self.name, self.help, labels=self.labels)

    def samples(self, obj: Any) -> Iterator[tuple[list[str], float]]:
        ids = [] if self.scope in ("daemon", "upload") else [str(obj.pid if self.scope == "process" else obj.index)]
        v = self.get(obj)
        for key, x in v.items() if isinstance(v, Mapping) else [(None, v)]:
            if x is not None:
                yield (ids if key is None else [*ids, key]), float(x)


def mask_unprintable(comm: str) -> str:
    """comm as a label value. The target chooses it (prctl PR_SET_NAME, argv[0]); the library
    escapes backslash, quote and newline, the only escapes of the format, so every other character
    that is not printable (control characters, line separators, undecodable bytes arriving as
    surrogate escapes, which would not even encode) becomes "?", as ps shows them: nothing that
    splits the text into lines (str.splitlines splits on \\r, \\x1c, \\x85, \\u2028...) can be
    fooled into reading a forged sample."""
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in comm[:MAX_COMM])


def _per(mapping_of: Callable[[ProcessMetrics], Mapping[str, Any]], keys: tuple[str, ...],
         f: Callable[[Any], Value] = float) -> Callable[[ProcessMetrics], dict[str, Value]]:
    """A getter of {key: f(value)} over a closed label set, in its fixed order."""
    return lambda p: {k: f(v) for k in keys if (v := mapping_of(p).get(k)) is not None}


_out = attrgetter("outstanding")
_gpu, _gpu_se = attrgetter("gpu_memory_bytes"), attrgetter("gpu_memory_stderr_bytes")

# The published families, in exposition order.
FAMILIES: tuple[Family, ...] = (
    Family("up", "1 while the allocsampler daemon runs and serves metrics.", lambda d: 1),
    Family("start_time_seconds", "Start of the daemon, Unix seconds (counters count from here).",
           attrgetter("start_time")),
    Family("process_info", "1 for each process with per-process series: its name (comm), which a process may "
           "change at will, is here rather than on every series. Join on pid for a name.",
           lambda p: {mask_unprintable(p.comm): 1}, "process", "comm"),
    Family("process_rss_bytes", "Resident set size of a recorded process.",
           lambda p: {p.tier: p.rss_bytes}, "process", "tier"),
    Family("process_memory_limit_bytes",
           "Memory limit that applies to the process: the smallest cgroup limit or host RAM.",
           attrgetter("memory_limit_bytes"), "process"),
    Family("process_growth_bytes_per_second",
           "Trend of the process's memory over the daemon's analysis window (negative: shrinking).",
           attrgetter("growth_bytes_per_second"), "process"),
    Family("process_outstanding_bytes", "Estimated bytes allocated and not freed, by source (malloc, python, mmap, "
           "fault). Sources overlap: never add them.", _per(_out, SOURCES, attrgetter("bytes")), "process", "source"),
    Family("process_outstanding_stderr_bytes", "One standard error of allocsampler_process_outstanding_bytes.",
           _per(_out, SOURCES, attrgetter("stderr_bytes")), "process", "source"),
    Family("process_arena_bloat_bytes", "glibc heap and arena bytes resident although no live allocation holds them.",
           attrgetter("arena_bloat_bytes"), "process"),
    Family("process_gpu_memory_bytes",
           "GPU memory of the process by kind: used (the driver's figure), reserved (device memory of the "
           "traced CUDA calls; with PyTorch, its caching allocator's reserve), pinned (page-locked host memory "
           "of the traced CUDA calls), allocated (estimated live PyTorch tensors). Kinds overlap: never add them.",
           _per(_gpu, GPU_KINDS), "process", "kind"),
    Family("process_gpu_memory_stderr_bytes",
           "One standard error of allocsampler_process_gpu_memory_bytes, for the estimated kinds (allocated).",
           _per(_gpu_se, GPU_KINDS), "process", "kind"),
    Family("process_sample_mean_bytes", "Sampling mean of a recorded process now: the configured one times a power "
           "of two, raised when its samples come too fast, lowered during a pre-OOM capture.",
           attrgetter("sample_mean_bytes"), "process"),
    Family("processes_omitted", "Recorded processes without per-process series (beyond the top processes by RSS).",
           attrgetter("omitted")),
    Family("gpu_memory_total_bytes", "Memory of a GPU device (NVML).", attrgetter("total_bytes"), "device"),
    Family("gpu_memory_used_bytes",
           "Memory in use on a GPU device, all processes (and the driver's reserve without nvmlMemory_v2).",
           attrgetter("used_bytes"), "device"),
    Family("gpu_memory_reserved_bytes", "Memory the driver reserves for itself on a GPU device.",
           attrgetter("reserved_bytes"), "device"),
    Family("gpu_processes", "Processes with memory on a GPU device.", attrgetter("processes"), "device"),
    # every tier, zeros included: a series that vanishes cannot be alerted on
    Family("targets", "Processes being recorded, by tier.",
           lambda d: {t: d.health.targets.get(t, 0) for t in TIERS}, label="tier"),
    Family("events_total", "Ring-buffer records read.", attrgetter("health.events_total"), kind="counter"),
    Family("lost_events_total", "Ring-buffer records lost because the buffer was full.",
           attrgetter("health.lost_events_total"), kind="counter"),
    Family("samples_total", "Sampling decisions that chose an allocation.",
           attrgetter("health.samples_total"), kind="counter"),
    Family("dropped_samples_total",
           "Sampled allocations not tracked because the live table was full (estimates run low).",
           attrgetter("health.dropped_samples_total"), kind="counter"),
    Family("vm_events_dropped_total", "vm_events rows not written because of the per-interval cap.",
           attrgetter("health.vm_events_dropped_total"), kind="counter"),
    Family("vm_events_suppressed_total", "Syscall events (mmap, munmap, brk, madvise, mprotect) not sent by BPF "
           "because their process was over its per-second budget (vm_events_per_s).",
           attrgetter("health.vm_events_suppressed_total"), kind="counter"),
    Family("live_table_fill_ratio", "Entries of the BPF live-allocation table over its capacity.",
           lambda d: d.health.live_entries / d.health.live_capacity if d.health.live_capacity > 0 else None),
    Family("live_table_entries", "Sampled live allocations tracked in the BPF live table.",
           attrgetter("health.live_entries")),
    Family("cpu_seconds_total", "CPU time (user + system) the daemon used.",
           attrgetter("health.cpu_seconds_total"), kind="counter"),
    Family("resident_memory_bytes", "Resident memory of the daemon.", attrgetter("health.resident_memory_bytes")),
    Family("dataset_bytes", "Disk space the dataset uses.", attrgetter("health.dataset_bytes")),
    Family("writing_paused", "1 while writing is paused (disk full or over budget), else 0.",
           attrgetter("health.writing_paused")),
    Family("last_snapshot_timestamp_seconds", "When the last interval was written, Unix seconds.",
           attrgetter("health.last_snapshot_timestamp")),
    # [upload] only
    Family("upload_backlog_files", "Dataset files not uploaded yet (sealed or still to be sealed by compaction).",
           attrgetter("backlog_files"), "upload"),
    Family("upload_backlog_bytes", "Disk usage of the files not uploaded yet.", attrgetter("backlog_bytes"), "upload"),
    Family("upload_backlog_oldest_age_seconds", "Age of the oldest file not uploaded yet.",
           attrgetter("backlog_oldest_age_seconds"), "upload"),
    Family("upload_files_total", "Files uploaded.", attrgetter("uploaded_files_total"), "upload", kind="counter"),
    Family("upload_bytes_total", "Bytes uploaded.", attrgetter("uploaded_bytes_total"), "upload", kind="counter"),
    Family("upload_failures_total", "Upload runs that failed (retried with backoff).",
           attrgetter("failures_total"), "upload", kind="counter"),
    Family("upload_lost_files_total", "Files deleted before they could be uploaded (the backlog over "
           "upload.max_backlog_bytes), since the dataset's first upload.", attrgetter("lost_files_total"), "upload",
           kind="counter"),
    Family("upload_lost_bytes_total", "Disk usage of the files lost that way.", attrgetter("lost_bytes_total"),
           "upload", kind="counter"),
    Family("upload_last_success_timestamp_seconds", "When an upload run last succeeded, Unix seconds.",
           attrgetter("last_success_timestamp"), "upload"),
)


def _top_processes(procs: list[ProcessMetrics], n: int) -> tuple[list[ProcessMetrics], int]:
    """The n largest by RSS (pid breaks ties, so the set is stable); one entry per pid, so a pid
    reused within an interval cannot produce duplicate series."""
    seen: set[int] = set()
    unique = []
    for p in sorted(procs, key=lambda p: (-p.rss_bytes, p.pid)):
        if p.pid not in seen:
            seen.add(p.pid)
            unique.append(p)
    n = max(0, n)
    return unique[:n], len(unique) - len(unique[:n])


class StateCollector(Collector):
    """The families of a `MetricsState`, from one snapshot per collection (the lock is held only to copy)."""

    def __init__(self, state: MetricsState):
        self.state = state

    def describe(self) -> Iterable[Metric]:
        # The names, for the registry's duplicate check, without collecting.
        return [f.new() for f in FAMILIES]

    def collect(self) -> Iterator[Metric]:
        s = self.state.snapshot()
        procs, omitted = _top_processes(s.processes, s.max_processes)
        objs: dict[Scope, list[Any]] = {
            "daemon": [_Daemon(s.health, s.start_time, omitted)],
            "process": procs,
            "device": sorted({d.index: d for d in s.devices}.values(), key=lambda d: d.index),  # one per index
            "upload": [s.upload] if s.upload is not None else [],
        }
        for f in FAMILIES:
            if f.scope == "upload" and s.upload is None:
                continue            # without [upload], the exposition is as it always was
            m = f.new()
            for obj in objs[f.scope]:
                for labels, v in f.samples(obj):
                    m.add_metric(labels, v)
            yield m


def registry(state: MetricsState) -> CollectorRegistry:
    """A private registry holding only `state`'s collector. Not the global one, and none of the
    library's default collectors: their process_* figures repeat our cpu_seconds_total,
    resident_memory_bytes and start_time_seconds under other names (and would describe whichever
    process renders, not the state), and python_info/GC figures tell an operator nothing."""
    r = CollectorRegistry()
    r.register(StateCollector(state))
    return r


def render(state: MetricsState) -> str:
    """The exposition text of `state` (from one snapshot of it)."""
    return generate_latest(registry(state)).decode("utf-8")


# --- HTTP server ---------------------------------------------------------------------------------

MAX_REQUEST_HEAD = 8192      # bytes of request line and headers; a scraper sends a few hundred
_NOT_FOUND = b"not found: only GET /metrics\n"
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Connections:
    """The open connections, for the cap: admitted in the accept thread, marked busy by their
    handler once the request is in, forgotten when closed."""

    def __init__(self, cap: int):
        self.cap = cap
        self._lock = threading.Lock()
        self._busy: dict[socket.socket, bool] = {}     # insertion order: oldest first

    def admit(self, sock: socket.socket) -> bool:
        """Make room for `sock`: at the cap, drop the oldest connection still sending its request
        (a slowloris, or a flood of idle connections, cannot lock a scraper out, whose request comes
        at once); refuse `sock` only when every slot is answering a request."""
        with self._lock:
            if len(self._busy) >= self.cap:
                idle = next((s for s, busy in self._busy.items() if not busy), None)
                if idle is None:
                    return False
                del self._busy[idle]
                _shut(idle)                 # its handler's recv returns at once and it ends
            self._busy[sock] = False
            return True

    def answering(self, sock: socket.socket) -> bool:
        """Mark `sock` busy; False when it was dropped meanwhile."""
        with self._lock:
            if sock not in self._busy:
                return False
            self._busy[sock] = True
            return True

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.pop(sock, None)

    def drop_all(self) -> None:
        with self._lock:
            for s in self._busy:
                _shut(s)
            self._busy.clear()


def _shut(sock: socket.socket) -> None:
    # shutdown, not close: the handler thread still owns the socket and closes it itself, so its
    # file descriptor cannot be reused under it.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _read_head(sock: socket.socket, deadline: float) -> bytes | None:
    """The request line and headers; None when the client closed, sent too much or was not done by
    the deadline. One deadline for the whole head, not a timeout per recv that every dribbled byte
    would restart."""
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:     # at most MAX_REQUEST_HEAD: rescanning is cheap
        left = deadline - time.monotonic()
        if left <= 0 or len(head) > MAX_REQUEST_HEAD:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:                     # timed out, reset, or dropped by _Connections.admit
            return None
        if not chunk:
            return None
        head += chunk
    return head


def _wants_metrics(head: bytes) -> bool:
    method, _, rest = head.split(b"\n", 1)[0].rstrip(b"\r").partition(b" ")
    target, _, version = rest.partition(b" ")
    return method == b"GET" and target.split(b"?", 1)[0] == b"/metrics" and version.startswith(b"HTTP/1.")


def loop_health(state: MetricsState, now: float) -> bytes:
    """The loop's liveness, computed when served (the rest of the exposition is rendered once per
    change): a loop stuck in one target's file shows here while the server thread still answers."""
    age = max(0.0, now - state.loop_heartbeat)
    return (f"# HELP {PREFIX}loop_heartbeat_age_seconds Seconds since the recording loop last ran.\n"
            f"# TYPE {PREFIX}loop_heartbeat_age_seconds gauge\n{PREFIX}loop_heartbeat_age_seconds {age:.3f}\n"
            f"# HELP {PREFIX}loop_healthy 1 while the recording loop runs, 0 once it has not run for "
            f"{state.stall_after_s:g} s (stalled: systemd's watchdog restarts the daemon).\n"
            f"# TYPE {PREFIX}loop_healthy gauge\n{PREFIX}loop_healthy {int(age < state.stall_after_s)}\n").encode()


class _Handler(socketserver.BaseRequestHandler):
    """One request per connection, within the server's timeout from accept to the last byte sent.
    The request line is all we need: no header parsing (less to attack), no keep-alive."""
    request: socket.socket
    server: _Server

    def handle(self) -> None:
        deadline = time.monotonic() + self.server.timeout_s
        head = _read_head(self.request, deadline)
        if head is None or not self.server.connections.answering(self.request):
            return
        if _wants_metrics(head):
            status, ctype, body = b"200 OK", CONTENT_TYPE.encode(), self.server.body()
        else:
            status, ctype, body = b"404 Not Found", b"text/plain; charset=utf-8", _NOT_FOUND
        left = deadline - time.monotonic()
        if left <= 0:
            return
        # sendall's timeout bounds the whole send (Python >= 3.5), so a client that reads slowly
        # is cut off at the deadline too.
        self.request.settimeout(left)
        self.request.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True       # a stuck client must not keep the daemon from exiting
    allow_reuse_address = True  # a restarted daemon binds its port at once
    request_queue_size = 32     # admit never blocks: a burst waits in the backlog, not in SYN retries

    def __init__(self, address: tuple[str, int], state: MetricsState, timeout_s: float, max_connections: int):
        self.state, self.timeout_s = state, timeout_s
        self.connections = _Connections(max_connections)
        self._registry = registry(state)
        self._cache: tuple[int, bytes] = (-1, b"")
        super().__init__(address, _Handler)

    def body(self) -> bytes:
        """The exposition, rendered again only when the state changed: a scrape flood costs a copy,
        not a rendering each. The generation is read before the snapshot, so the cached text is never
        older than its key (at worst newer, and rendered again next time)."""
        generation, body = self._cache
        if generation != self.state.generation:
            generation = self.state.generation
            body = generate_latest(self._registry)
            self._cache = (generation, body)
        return body + loop_health(self.state, time.monotonic())

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.connections.admit(request):
            return True
        with contextlib.suppress(OSError):  # best effort, never blocking the accept loop
            request.send(_BUSY, socket.MSG_DONTWAIT)
        return False

    def shutdown_request(self, request: Any) -> None:
        self.connections.forget(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return                  # the client went away or was too slow: not ours to report
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves /metrics from a daemon thread. Bind at start(): errors are EnvironmentProblem."""

    def __init__(self, state: MetricsState, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.state, self.host, self._port = state, host, port
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the one the kernel chose when constructed with port 0)."""
        return self._server.server_address[1] if self._server else self._port

    def start(self) -> MetricsServer:
        if self._server is not None:
            raise RuntimeError("metrics server already started")
        cls = _Server6 if ":" in self.host else _Server
        try:
            server = cls((self.host, self._port), self.state, self.timeout_s, self.max_connections)
        except OSError as e:
            raise EnvironmentProblem(_bind_error(self.host, self._port, e)) from None
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="allocsampler-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end the open connections and close the socket (the port is free on
        return). Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.connections.drop_all()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind_error(host: str, port: int, e: OSError) -> str:
    fix = "set [metrics] listen in the config"
    if e.errno == errno.EADDRINUSE:
        return f"metrics: port {port} in use on {host}: {fix}"
    if e.errno == errno.EACCES:
        return f"metrics: no permission to listen on {host}:{port}: choose a port >= 1024 ({fix})"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"metrics: address {host} is not on this host: {fix}"
    reason = " ".join(str(e.strerror or e).split())     # one line whatever the OS says
    return f"metrics: cannot listen on {host}:{port} ({reason}): {fix}"
