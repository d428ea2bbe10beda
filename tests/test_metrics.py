"""The Prometheus endpoint: the exposition text checked by a strict parser of the 0.0.4 text
format, the cardinality cap, and a real server on an ephemeral port."""

from __future__ import annotations

import datetime as dt
import re
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

from sampler.dataset.schema import CUDA, CUDA_DRIVER, CUDA_HOST, GPU, PROCESSES, RECORDER, TORCH
from sampler.errors import EnvironmentProblem
from sampler.gpu.cuda import GpuTracer, _GpuTarget
from sampler.gpu.nvml import DeviceMemory, NvmlSample
from sampler.record.outstanding import ProcessTable
from sampler.service.config import Config
from sampler.service.daemon import Daemon
from sampler.service.metrics import (
    CONTENT_TYPE,
    DeviceMetrics,
    Estimate,
    MetricsServer,
    MetricsState,
    ProcessMetrics,
    RecorderHealth,
    render,
)

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
VALUE_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}

# The published metric list: name -> (type, label names of its samples).
FAMILIES = {
    "allocsampler_up": ("gauge", ()),
    "allocsampler_start_time_seconds": ("gauge", ()),
    "allocsampler_process_rss_bytes": ("gauge", ("pid", "comm", "tier")),
    "allocsampler_process_memory_limit_bytes": ("gauge", ("pid", "comm")),
    "allocsampler_process_growth_bytes_per_second": ("gauge", ("pid", "comm")),
    "allocsampler_process_outstanding_bytes": ("gauge", ("pid", "comm", "source")),
    "allocsampler_process_outstanding_stderr_bytes": ("gauge", ("pid", "comm", "source")),
    "allocsampler_process_arena_bloat_bytes": ("gauge", ("pid", "comm")),
    "allocsampler_process_sample_mean_bytes": ("gauge", ("pid", "comm")),
    "allocsampler_process_gpu_memory_bytes": ("gauge", ("pid", "comm", "kind")),
    "allocsampler_process_gpu_memory_stderr_bytes": ("gauge", ("pid", "comm", "kind")),
    "allocsampler_processes_omitted": ("gauge", ()),
    "allocsampler_gpu_memory_total_bytes": ("gauge", ("device",)),
    "allocsampler_gpu_memory_used_bytes": ("gauge", ("device",)),
    "allocsampler_gpu_memory_reserved_bytes": ("gauge", ("device",)),
    "allocsampler_gpu_processes": ("gauge", ("device",)),
    "allocsampler_targets": ("gauge", ("tier",)),
    "allocsampler_events_total": ("counter", ()),
    "allocsampler_lost_events_total": ("counter", ()),
    "allocsampler_samples_total": ("counter", ()),
    "allocsampler_dropped_samples_total": ("counter", ()),
    "allocsampler_vm_events_dropped_total": ("counter", ()),
    "allocsampler_vm_events_suppressed_total": ("counter", ()),
    "allocsampler_live_table_fill_ratio": ("gauge", ()),
    "allocsampler_live_table_entries": ("gauge", ()),
    "allocsampler_cpu_seconds_total": ("counter", ()),
    "allocsampler_resident_memory_bytes": ("gauge", ()),
    "allocsampler_dataset_bytes": ("gauge", ()),
    "allocsampler_writing_paused": ("gauge", ()),
    "allocsampler_last_snapshot_timestamp_seconds": ("gauge", ()),
}


def _labels(s: str, line: str) -> tuple[dict[str, str], str]:
    """Parse `name="value",...}` (after the opening brace); returns the labels and the rest."""
    labels: dict[str, str] = {}
    i = 0
    while True:
        if s[i] == "}":
            return labels, s[i + 1:]
        m = LABEL_NAME.match(s, i)
        assert m and not m.group().startswith("__"), f"bad label name: {line!r}"
        name = m.group()
        i = m.end()
        assert s[i:i + 2] == '="', f"expected =\" after {name}: {line!r}"
        i += 2
        value = []
        while s[i] != '"':
            if s[i] == "\\":
                assert s[i + 1] in VALUE_ESCAPES, f"bad escape in {line!r}"
                value.append(VALUE_ESCAPES[s[i + 1]])
                i += 2
            else:
                value.append(s[i])
                i += 1
        i += 1
        assert name not in labels, f"label {name} twice: {line!r}"
        labels[name] = "".join(value)
        if s[i] == ",":
            i += 1
        else:
            assert s[i] == "}", f"expected , or }}: {line!r}"


def parse(text: str) -> dict[str, dict]:
    """A strict reading of the text format: families {name: {type, help, samples: {labels: value}}}.
    Every sample follows its family's HELP and TYPE, a family's lines are contiguous, counters end
    in _total, values are floats, no series repeats."""
    assert text.endswith("\n")
    fams: dict[str, dict] = {}
    current = None
    for line in text[:-1].split("\n"):
        assert line and line == line.strip(), f"blank or padded line: {line!r}"
        if line.startswith("#"):
            kw, name, rest = (line.split(" ", 3) + [""])[1:4]
            assert kw in ("HELP", "TYPE"), f"stray comment: {line!r}"
            assert METRIC_NAME.fullmatch(name), line
            if name != current:
                assert name not in fams, f"family {name} split or repeated"
                fams[name] = {"type": None, "help": None, "samples": {}}
                current = name
            f = fams[name]
            assert not f["samples"], f"{kw} after samples: {line!r}"
            if kw == "TYPE":
                assert f["type"] is None and rest in ("counter", "gauge"), line
                if rest == "counter":
                    assert name.endswith("_total"), f"counter without _total: {name}"
                f["type"] = rest
            else:
                assert f["help"] is None and rest, line
                assert "\n" not in rest
                f["help"] = rest
            continue
        m = METRIC_NAME.match(line)
        assert m, f"bad sample: {line!r}"
        name, rest = m.group(), line[m.end():]
        assert name == current, f"sample of {name} outside its family"
        f = fams[name]
        assert f["type"] and f["help"], f"{name}: sample before HELP and TYPE"
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            labels, rest = _labels(rest[1:], line)
        assert rest.startswith(" "), line
        parts = rest[1:].split(" ")
        assert len(parts) == 1, f"unexpected timestamp or junk: {line!r}"
        value = float(parts[0])     # also 'NaN', '+Inf', '-Inf'
        key = tuple(sorted(labels.items()))
        assert key not in f["samples"], f"duplicate series: {line!r}"
        f["samples"][key] = value
    return fams


def series(fams: dict, name: str) -> dict[tuple, float]:
    return fams[name]["samples"]


def value(fams: dict, name: str, **labels: str) -> float:
    return series(fams, name)[tuple(sorted(labels.items()))]


WEIRD_COMM = 'a"b\\c\nd{e}=,'


def sample_state() -> MetricsState:
    state = MetricsState(start_time=1_700_000_000.0)
    state.set_processes([
        ProcessMetrics(pid=101, comm="python3", tier="attach", rss_bytes=3 << 30,
                       growth_bytes_per_second=12345.5,
                       outstanding={"malloc": Estimate(1.5e9, 2.5e7), "mmap": Estimate(4e8, 1e6)},
                       arena_bloat_bytes=2e8, gpu_memory_bytes={"used": 8 << 30, "reserved": 6e9},
                       memory_limit_bytes=16 << 30, sample_mean_bytes=4 << 20),
        ProcessMetrics(pid=202, comm=WEIRD_COMM, tier="rss", rss_bytes=1 << 20,
                       outstanding={"fault": Estimate(5e5, 1e5)}),
        ProcessMetrics(pid=303, comm="bad\udcffname", tier="preload", rss_bytes=7),
    ])
    state.add_interval(events=1000, lost_events=3, samples=50, dropped_samples=1, vm_events_dropped=2,
                       vm_events_suppressed=70_000)
    state.add_interval(events=500, samples=25, vm_events_suppressed=30_000)
    state.update_health(live_entries=2500, live_capacity=10000, cpu_seconds_total=12.25,
                        resident_memory_bytes=150 << 20, targets={"attach": 1, "rss": 1, "preload": 1},
                        last_snapshot_timestamp=1_700_000_600.5, dataset_bytes=1 << 30, writing_paused=True)
    return state


def assert_published(fams: dict) -> None:
    """Exactly the published families, each sample with exactly its family's labels."""
    assert {n: (f["type"], f["help"] is not None) for n, f in fams.items()} == \
        {n: (t, True) for n, (t, _) in FAMILIES.items()}
    for name, f in fams.items():
        for key in f["samples"]:
            assert tuple(k for k, _ in key) == tuple(sorted(FAMILIES[name][1])), (name, key)


def test_render_is_strict_exposition_format():
    assert_published(parse(render(sample_state())))


def test_render_values_and_escaping():
    fams = parse(render(sample_state()))
    assert value(fams, "allocsampler_up") == 1
    assert value(fams, "allocsampler_process_rss_bytes", pid="101", comm="python3", tier="attach") == 3 << 30
    # quotes, backslashes and newlines in comm survive the round trip; undecodable bytes become "?"
    assert value(fams, "allocsampler_process_rss_bytes", pid="202", comm=WEIRD_COMM, tier="rss") == 1 << 20
    assert value(fams, "allocsampler_process_rss_bytes", pid="303", comm="bad?name", tier="preload") == 7
    assert value(fams, "allocsampler_process_outstanding_bytes", pid="101", comm="python3", source="malloc") == 1.5e9
    assert value(fams, "allocsampler_process_outstanding_stderr_bytes", pid="202", comm=WEIRD_COMM,
                 source="fault") == 1e5
    assert value(fams, "allocsampler_process_growth_bytes_per_second", pid="101", comm="python3") == 12345.5
    assert value(fams, "allocsampler_process_gpu_memory_bytes", pid="101", comm="python3", kind="used") == 8 << 30
    # unknown figures are absent, never a made-up 0
    assert len(series(fams, "allocsampler_process_growth_bytes_per_second")) == 1
    assert len(series(fams, "allocsampler_process_arena_bloat_bytes")) == 1
    assert len(series(fams, "allocsampler_process_gpu_memory_bytes")) == 2
    assert len(series(fams, "allocsampler_process_outstanding_bytes")) == 3
    assert value(fams, "allocsampler_events_total") == 1500
    assert value(fams, "allocsampler_lost_events_total") == 3
    assert value(fams, "allocsampler_samples_total") == 75
    assert value(fams, "allocsampler_vm_events_suppressed_total") == 100_000
    assert value(fams, "allocsampler_process_sample_mean_bytes", pid="101", comm="python3") == 4 << 20
    assert len(series(fams, "allocsampler_process_sample_mean_bytes")) == 1
    assert value(fams, "allocsampler_live_table_fill_ratio") == 0.25
    assert value(fams, "allocsampler_cpu_seconds_total") == 12.25
    assert value(fams, "allocsampler_writing_paused") == 1
    assert value(fams, "allocsampler_last_snapshot_timestamp_seconds") == 1_700_000_600.5
    # every tier has a series, so "no target in tier X" is a 0 and not a missing series
    assert series(fams, "allocsampler_targets") == {
        (("tier", "attach"),): 1, (("tier", "preload"),): 1, (("tier", "rss"),): 1, (("tier", "syscalls"),): 0}


def _processes_row(pid: int, comm: str, now: dt.datetime, tracer: GpuTracer, table: ProcessTable) -> dict:
    """A `processes` row as Recorder._process_row builds it: every schema column (the ones these
    tests do not need are null), the GPU ones from GpuTracer.process_columns."""
    row = dict.fromkeys(c.name for c in PROCESSES.columns)
    row.update(ts=now, recording_id="r1", host="h", pid=pid, comm=comm, rss=5 << 30, tier="attach",
               memory_limit=64 << 30, **tracer.process_columns(pid, table))
    assert set(row) == {c.name for c in PROCESSES.columns}
    return row


def test_gpu_metrics_from_recorder_rows():
    """The daemon publishes the GPU columns of the recorder's `processes` rows and its `gpu` device
    rows, per process and per device; unknown (null) values are no series."""
    tracer = GpuTracer(probes=None)
    tracer.last = NvmlSample(           # what GpuTracer.sample() keeps of an NVML sample
        devices=[DeviceMemory(0, "GPU-aaaa", "NVIDIA H100", 80 << 30, 9 << 30, 512 << 20, 2),
                 DeviceMemory(1, "GPU-bbbb", "NVIDIA H100", 80 << 30, 0, None, 0)],
        used_by_pid={101: 7 << 30}, pids={101})
    tracer.targets[101] = _GpuTarget(cuda=True, torch=True)
    table = ProcessTable()
    table.gpu_alloc(CUDA, 0x10000, 2 << 30, 1, 1)
    table.gpu_alloc(CUDA_DRIVER, 0x10000, 3 << 30, 1, 1)
    table.gpu_alloc(CUDA_HOST, 0x20000, 256 << 20, 2, 1)
    table.alloc(0x30000, 1 << 20, float(4 << 20), 3, 1, TORCH)         # one sampled tensor
    torch_bytes, torch_se = table.totals(TORCH)
    assert torch_se > 0

    now = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    base = {"ts": now, "recording_id": "r1", "host": "h"}
    daemon = Daemon(Config(targets=()), "")
    daemon.metrics = MetricsState()
    daemon.observe(PROCESSES, [_processes_row(101, "python3", now, tracer, table),
                               _processes_row(202, "cc1", now, tracer, ProcessTable())])   # no CUDA
    daemon.observe(GPU, [{**base, **r} for r in tracer.device_rows()])        # as Recorder._snapshot
    daemon.observe(RECORDER, [{**dict.fromkeys((c.name for c in RECORDER.columns), 0), **base, "interval_s": 10.0}])

    fams = parse(render(daemon.metrics.snapshot()))
    assert_published(fams)
    ids = {"pid": "101", "comm": "python3"}
    assert series(fams, "allocsampler_process_gpu_memory_bytes") == {
        tuple(sorted({**ids, "kind": k}.items())): v
        for k, v in (("used", 7 << 30), ("reserved", 3 << 30), ("pinned", 256 << 20), ("allocated", torch_bytes))}
    assert series(fams, "allocsampler_process_gpu_memory_stderr_bytes") == {
        tuple(sorted({**ids, "kind": "allocated"}.items())): torch_se}
    assert series(fams, "allocsampler_gpu_memory_total_bytes") == {(("device", "0"),): 80 << 30,
                                                                    (("device", "1"),): 80 << 30}
    assert series(fams, "allocsampler_gpu_memory_used_bytes") == {(("device", "0"),): 9 << 30, (("device", "1"),): 0}
    assert series(fams, "allocsampler_gpu_memory_reserved_bytes") == {(("device", "0"),): 512 << 20}
    assert series(fams, "allocsampler_gpu_processes") == {(("device", "0"),): 2, (("device", "1"),): 0}

    # the next interval without NVML (no `gpu` rows): the device series go, they do not linger
    daemon.observe(RECORDER, [{**dict.fromkeys((c.name for c in RECORDER.columns), 0), **base, "interval_s": 10.0}])
    assert series(parse(render(daemon.metrics.snapshot())), "allocsampler_gpu_memory_total_bytes") == {}


def test_closed_gpu_labels():
    with pytest.raises(ValueError, match="GPU"):
        ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=0, gpu_memory_stderr_bytes={"gpu0": 1})
    state = MetricsState()
    state.set_devices([DeviceMetrics(index=3, total_bytes=1, used_bytes=1), DeviceMetrics(3, 2, 2)])
    assert series(parse(render(state)), "allocsampler_gpu_memory_used_bytes") == {(("device", "3"),): 2}


def test_empty_state_renders():
    fams = parse(render(MetricsState()))
    assert value(fams, "allocsampler_up") == 1
    assert value(fams, "allocsampler_processes_omitted") == 0
    assert series(fams, "allocsampler_process_rss_bytes") == {}
    assert series(fams, "allocsampler_live_table_fill_ratio") == {}     # capacity unknown
    assert series(fams, "allocsampler_last_snapshot_timestamp_seconds") == {}
    assert value(fams, "allocsampler_writing_paused") == 0


def test_special_float_values():
    state = MetricsState()
    state.set_processes([ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=1,
                                        growth_bytes_per_second=float("-inf"),
                                        outstanding={"malloc": Estimate(float("nan"), float("inf"))})])
    text = render(state)
    assert 'allocsampler_process_growth_bytes_per_second{pid="1",comm="x"} -Inf\n' in text
    assert 'source="malloc"} NaN\n' in text and 'source="malloc"} +Inf\n' in text
    parse(text)


def test_per_process_cap():
    state = MetricsState(max_processes=200)
    procs = [ProcessMetrics(pid=1000 + i, comm=f"w{i}", tier="rss", rss_bytes=i * 4096,
                            outstanding={"fault": Estimate(i, 1)}) for i in range(250)]
    procs.append(ProcessMetrics(pid=1000 + 249, comm="reused", tier="rss", rss_bytes=1))  # pid seen twice
    state.set_processes(procs)
    fams = parse(render(state))
    rss = series(fams, "allocsampler_process_rss_bytes")
    assert len(rss) == 200
    assert min(rss.values()) == 50 * 4096            # the 200 largest
    assert len(series(fams, "allocsampler_process_outstanding_bytes")) == 200
    assert value(fams, "allocsampler_processes_omitted") == 50
    assert all(dict(k)["comm"] != "reused" for k in rss)

    state.max_processes = 0
    fams = parse(render(state))
    assert series(fams, "allocsampler_process_rss_bytes") == {}
    assert value(fams, "allocsampler_processes_omitted") == 250


def test_closed_label_sets_and_immutability():
    with pytest.raises(ValueError, match="tier"):
        ProcessMetrics(pid=1, comm="x", tier="everything", rss_bytes=0)
    with pytest.raises(ValueError, match="sources"):
        ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=0, outstanding={"stack_0x1234": Estimate(1, 1)})
    with pytest.raises(ValueError, match="GPU"):
        ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=0, gpu_memory_bytes={"gpu0": 1})
    src = {"malloc": Estimate(1, 1)}
    p = ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=0, outstanding=src)
    src["mmap"] = Estimate(2, 2)                     # the caller's dict is copied
    assert set(p.outstanding) == {"malloc"}
    with pytest.raises(TypeError):
        p.outstanding["mmap"] = Estimate(2, 2)       # type: ignore[index]


def test_state_updates_and_snapshot():
    state = sample_state()
    with pytest.raises(TypeError):
        state.update_health(no_such_field=1)
    snap = state.snapshot()
    before = render(snap)
    state.add_interval(events=1)
    state.update_health(targets={"attach": 5}, writing_paused=False)
    state.set_processes([])
    assert render(snap) == before                    # the copy does not see later writes
    fams = parse(render(state.snapshot()))
    assert value(fams, "allocsampler_events_total") == 1501
    assert value(fams, "allocsampler_targets", tier="attach") == 5
    assert isinstance(state.health, RecorderHealth)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (the extra check only)")
def test_promtool_accepts_output():
    r = subprocess.run(["promtool", "check", "metrics"], input=render(sample_state()),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


# --- server --------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.headers["Content-Type"], r.read().decode("utf-8")


def test_server_serves_metrics():
    state = sample_state()
    server = MetricsServer(state, port=0).start()
    try:
        port = server.port
        assert port > 0
        base = f"http://127.0.0.1:{port}"
        status, ctype, body = get(base + "/metrics")
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert value(parse(body), "allocsampler_samples_total") == 75

        state.add_interval(samples=5)                # the next scrape sees the daemon's writes
        assert value(parse(get(base + "/metrics?x=1")[2]), "allocsampler_samples_total") == 80

        status, ctype, body = get(base + "/")
        assert status == 200 and ctype.startswith("text/html") and 'href="/metrics"' in body

        with pytest.raises(urllib.error.HTTPError) as e:
            get(base + "/nope")
        assert e.value.code == 404

        # scrapes concurrent with a writer thread always see a whole, valid state
        stop = threading.Event()

        def writer():
            i = 0
            while not stop.is_set():
                i += 1
                state.set_processes([ProcessMetrics(pid=p, comm=f"c{p}", tier="attach", rss_bytes=i)
                                     for p in range(i % 50)])
                state.add_interval(events=1)

        t = threading.Thread(target=writer)
        t.start()
        try:
            for _ in range(20):
                parse(get(base + "/metrics")[2])
        finally:
            stop.set()
            t.join()
    finally:
        server.stop()
    server.stop()                                    # idempotent

    # the port is released: nothing answers, and a restarted server binds it again at once
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/metrics")
    with MetricsServer(MetricsState(), port=port) as again:
        assert again.port == port
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200


def test_bind_conflict_is_environment_problem():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EnvironmentProblem) as e:
            MetricsServer(MetricsState(), port=port).start()
    msg = str(e.value)
    assert "\n" not in msg
    assert f"port {port} in use" in msg and "[metrics] listen" in msg


def test_unknown_address_is_environment_problem():
    with pytest.raises(EnvironmentProblem) as e:
        MetricsServer(MetricsState(), host="192.0.2.1", port=0).start()    # TEST-NET-1: not ours
    assert "\n" not in str(e.value) and "[metrics] listen" in str(e.value)
