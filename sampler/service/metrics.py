"""Prometheus metrics endpoint of the daemon: text exposition format 0.0.4, no third-party client.

The daemon fills a `MetricsState` once per interval (per-process and GPU figures) and more often
(recorder health); `MetricsServer` serves `render(state.snapshot())` on `GET /metrics`.

Cardinality is bounded by construction: per-process series carry only pid, comm and a label
from a small fixed set (tier, source, GPU memory kind), never a stack; and only the top
`max_processes` processes by RSS get series, the rest are counted in
`allocsampler_processes_omitted`. GPU device series carry only the device index. Counters are
cumulative since `allocsampler_start_time_seconds`; take `rate()` of them for per-second figures
(events/s is `rate(allocsampler_events_total[1m])`).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import socket
import socketserver
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType

from sampler.errors import EnvironmentProblem

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
DEFAULT_MAX_PROCESSES = 200

# The closed label sets (schema.md: processes.tier, outstanding.source).
TIERS = ("attach", "preload", "rss", "syscalls")
SOURCES = ("malloc", "mmap", "fault")
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


@dataclass
class MetricsState:
    """What /metrics shows. The daemon writes through the methods (they take the lock); the server
    renders `snapshot()`, a copy, so a slow scrape never holds the lock."""
    processes: list[ProcessMetrics] = field(default_factory=list)
    devices: list[DeviceMetrics] = field(default_factory=list)
    health: RecorderHealth = field(default_factory=RecorderHealth)
    max_processes: int = DEFAULT_MAX_PROCESSES
    start_time: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def set_processes(self, processes: Iterable[ProcessMetrics]) -> None:
        """Replace the per-process figures (once per interval): exited processes disappear."""
        procs = list(processes)
        with self._lock:
            self.processes = procs

    def set_devices(self, devices: Iterable[DeviceMetrics]) -> None:
        """Replace the GPU figures (once per interval): none when NVML is not there."""
        devs = list(devices)
        with self._lock:
            self.devices = devs

    def update_health(self, **changes: object) -> None:
        """Set health fields by name, e.g. update_health(resident_memory_bytes=..., writing_paused=True)."""
        with self._lock:
            self.health = dataclasses.replace(self.health, **changes)  # TypeError on an unknown name

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

    def snapshot(self) -> MetricsState:
        with self._lock:
            return MetricsState(processes=list(self.processes), devices=list(self.devices),
                                health=dataclasses.replace(self.health, targets=dict(self.health.targets)),
                                max_processes=self.max_processes, start_time=self.start_time)


# --- exposition format ---------------------------------------------------------------------------

def escape_label_value(v: str) -> str:
    # comm is attacker-controlled (prctl PR_SET_NAME): it may hold quotes, backslashes, newlines or
    # undecodable bytes (surrogate escapes), none of which may break the line format.
    v = v.encode("utf-8", "replace").decode("utf-8")
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(v: float | int | bool) -> str:
    if isinstance(v, bool | int):
        return str(int(v))
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Family:
    def __init__(self, name: str, kind: str, help_: str):
        assert kind in ("counter", "gauge")
        assert (kind == "counter") == name.endswith("_total"), name
        self.name, self.kind, self.help = name, kind, help_
        self.samples: list[str] = []

    def add(self, value: float | int | bool | None, **labels: str | int) -> None:
        if value is None:            # unknown is no sample, never a made-up 0
            return
        if labels:
            ls = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels.items())
            self.samples.append(f"{self.name}{{{ls}}} {format_value(value)}")
        else:
            self.samples.append(f"{self.name} {format_value(value)}")

    def lines(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}", *self.samples]


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


def render(state: MetricsState) -> str:
    """The exposition text of `state` (pure: pass a snapshot when other threads write to it)."""
    fams: dict[str, _Family] = {}

    def fam(name: str, kind: str, help_: str) -> _Family:
        f = fams[name] = _Family("allocsampler_" + name, kind, help_)
        return f

    up = fam("up", "gauge", "1 while the allocsampler daemon runs and serves metrics.")
    start = fam("start_time_seconds", "gauge", "Start of the daemon, Unix seconds (counters count from here).")
    rss = fam("process_rss_bytes", "gauge", "Resident set size of a recorded process.")
    limit = fam("process_memory_limit_bytes", "gauge",
                "Memory limit that applies to the process: the smallest cgroup limit or host RAM.")
    growth = fam("process_growth_bytes_per_second", "gauge",
                 "Trend of the process's memory over the daemon's analysis window (negative: shrinking).")
    out = fam("process_outstanding_bytes", "gauge",
              "Estimated bytes allocated and not freed, by source (malloc, mmap, fault). "
              "Sources overlap: never add them.")
    out_se = fam("process_outstanding_stderr_bytes", "gauge",
                 "One standard error of allocsampler_process_outstanding_bytes.")
    bloat = fam("process_arena_bloat_bytes", "gauge",
                "glibc heap and arena bytes resident although no live allocation holds them.")
    gpu = fam("process_gpu_memory_bytes", "gauge",
              "GPU memory of the process by kind: used (the driver's figure), reserved (device memory of the "
              "traced CUDA calls; with PyTorch, its caching allocator's reserve), pinned (page-locked host memory "
              "of the traced CUDA calls), allocated (estimated live PyTorch tensors). Kinds overlap: never add them.")
    gpu_se = fam("process_gpu_memory_stderr_bytes", "gauge",
                 "One standard error of allocsampler_process_gpu_memory_bytes, for the estimated kinds (allocated).")
    mean = fam("process_sample_mean_bytes", "gauge",
               "Sampling mean of a recorded process now: the configured one times a power of two, raised "
               "when its samples come too fast, lowered during a pre-OOM capture.")
    omitted = fam("processes_omitted", "gauge",
                  "Recorded processes without per-process series (beyond the top processes by RSS).")
    dev_total = fam("gpu_memory_total_bytes", "gauge", "Memory of a GPU device (NVML).")
    dev_used = fam("gpu_memory_used_bytes", "gauge",
                   "Memory in use on a GPU device, all processes (and the driver's reserve without nvmlMemory_v2).")
    dev_reserved = fam("gpu_memory_reserved_bytes", "gauge", "Memory the driver reserves for itself on a GPU device.")
    dev_procs = fam("gpu_processes", "gauge", "Processes with memory on a GPU device.")
    targets = fam("targets", "gauge", "Processes being recorded, by tier.")
    events = fam("events_total", "counter", "Ring-buffer records read.")
    lost = fam("lost_events_total", "counter", "Ring-buffer records lost because the buffer was full.")
    samples = fam("samples_total", "counter", "Sampling decisions that chose an allocation.")
    dropped = fam("dropped_samples_total", "counter",
                  "Sampled allocations not tracked because the live table was full (estimates run low).")
    vm_dropped = fam("vm_events_dropped_total", "counter",
                     "vm_events rows not written because of the per-interval cap.")
    vm_suppressed = fam("vm_events_suppressed_total", "counter",
                        "Syscall events (mmap, munmap, brk, madvise, mprotect) not sent by BPF because "
                        "their process was over its per-second budget (vm_events_per_s).")
    fill = fam("live_table_fill_ratio", "gauge", "Entries of the BPF live-allocation table over its capacity.")
    live = fam("live_table_entries", "gauge", "Sampled live allocations tracked in the BPF live table.")
    cpu = fam("cpu_seconds_total", "counter", "CPU time (user + system) the daemon used.")
    mem = fam("resident_memory_bytes", "gauge", "Resident memory of the daemon.")
    disk = fam("dataset_bytes", "gauge", "Disk space the dataset uses.")
    paused = fam("writing_paused", "gauge", "1 while writing is paused (disk full or over budget), else 0.")
    last = fam("last_snapshot_timestamp_seconds", "gauge", "When the last interval was written, Unix seconds.")

    up.add(1)
    start.add(state.start_time)
    shown, n_omitted = _top_processes(state.processes, state.max_processes)
    for p in shown:
        ids = {"pid": p.pid, "comm": p.comm}
        rss.add(p.rss_bytes, **ids, tier=p.tier)
        limit.add(p.memory_limit_bytes, **ids)
        growth.add(p.growth_bytes_per_second, **ids)
        for source in SOURCES:
            if (e := p.outstanding.get(source)) is not None:
                out.add(e.bytes, **ids, source=source)
                out_se.add(e.stderr_bytes, **ids, source=source)
        bloat.add(p.arena_bloat_bytes, **ids)
        mean.add(p.sample_mean_bytes, **ids)
        for kind in GPU_KINDS:
            gpu.add(p.gpu_memory_bytes.get(kind), **ids, kind=kind)
            gpu_se.add(p.gpu_memory_stderr_bytes.get(kind), **ids, kind=kind)
    omitted.add(n_omitted)
    for d in sorted({d.index: d for d in state.devices}.values(), key=lambda d: d.index):   # one per index
        dev_total.add(d.total_bytes, device=d.index)
        dev_used.add(d.used_bytes, device=d.index)
        dev_reserved.add(d.reserved_bytes, device=d.index)
        dev_procs.add(d.processes, device=d.index)

    h = state.health
    for tier in TIERS:       # every tier, zeros included: a series that vanishes cannot be alerted on
        targets.add(h.targets.get(tier, 0), tier=tier)
    events.add(h.events_total)
    lost.add(h.lost_events_total)
    samples.add(h.samples_total)
    dropped.add(h.dropped_samples_total)
    vm_dropped.add(h.vm_events_dropped_total)
    vm_suppressed.add(h.vm_events_suppressed_total)
    fill.add(h.live_entries / h.live_capacity if h.live_capacity > 0 else None)
    live.add(h.live_entries)
    cpu.add(h.cpu_seconds_total)
    mem.add(h.resident_memory_bytes)
    disk.add(h.dataset_bytes)
    paused.add(h.writing_paused)
    last.add(h.last_snapshot_timestamp)

    return "".join(line + "\n" for f in fams.values() for line in f.lines())


# --- HTTP server ---------------------------------------------------------------------------------

_INDEX = (b"<!doctype html><html><head><title>allocsampler</title></head><body>"
          b'<h1>allocsampler</h1><p><a href="/metrics">metrics</a></p></body></html>\n')


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "allocsampler"

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _respond(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            status, ctype, data = 200, CONTENT_TYPE, render(self.server.state.snapshot()).encode("utf-8")
        elif path == "/":
            status, ctype, data = 200, "text/html; charset=utf-8", _INDEX
        else:
            status, ctype, data = 404, "text/plain; charset=utf-8", b"not found: try /metrics\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass   # a scrape every 15 s would flood the daemon's log


class _Server(ThreadingHTTPServer):
    daemon_threads = True     # a stuck client must not keep the daemon from exiting
    state: MetricsState

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN: a DNS lookup that can hang start-up on
        # an isolated host, for a name only used in CGI variables.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves /metrics from a daemon thread. Bind at start(): errors are EnvironmentProblem."""

    def __init__(self, state: MetricsState, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        self.state, self.host, self._port = state, host, port
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
            server = cls((self.host, self._port), _Handler)
        except OSError as e:
            raise EnvironmentProblem(_bind_error(self.host, self._port, e)) from None
        server.state = self.state
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="allocsampler-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (the port is free on return). Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
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
