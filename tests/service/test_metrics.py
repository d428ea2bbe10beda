"""The Prometheus endpoint: the exposition text checked by a strict parser of the 0.0.4 text
format, the cardinality cap and name churn, and a real server on an ephemeral port, with what it
does against slow, flooding and busy clients."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import select
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sampler.dataset.schema import CUDA, CUDA_DRIVER, CUDA_HOST, GPU, PROCESSES, RECORDER, TORCH
from sampler.errors import EnvironmentProblem
from sampler.gpu.cuda import GpuTracer, _GpuTarget
from sampler.gpu.nvml import DeviceMemory, NvmlSample
from sampler.record.outstanding import ProcessTable
from sampler.service.config import Config
from sampler.service.daemon import Daemon
from sampler.service.metrics import (
    CONTENT_TYPE,
    GPU_KINDS,
    MAX_COMM,
    SOURCES,
    DeviceMetrics,
    Estimate,
    MetricsServer,
    MetricsState,
    ProcessMetrics,
    RecorderHealth,
    StateCollector,
    UploadHealth,
    render,
)

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
VALUE_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}

# The published metric list: name -> (type, label names of its samples).
FAMILIES = {
    "allocsampler_up": ("gauge", ()),
    "allocsampler_start_time_seconds": ("gauge", ()),
    "allocsampler_process_info": ("gauge", ("pid", "comm")),     # the only series with comm
    "allocsampler_process_rss_bytes": ("gauge", ("pid", "tier")),
    "allocsampler_process_memory_limit_bytes": ("gauge", ("pid",)),
    "allocsampler_process_growth_bytes_per_second": ("gauge", ("pid",)),
    "allocsampler_process_outstanding_bytes": ("gauge", ("pid", "source")),
    "allocsampler_process_outstanding_stderr_bytes": ("gauge", ("pid", "source")),
    "allocsampler_process_arena_bloat_bytes": ("gauge", ("pid",)),
    "allocsampler_process_sample_mean_bytes": ("gauge", ("pid",)),
    "allocsampler_process_gpu_memory_bytes": ("gauge", ("pid", "kind")),
    "allocsampler_process_gpu_memory_stderr_bytes": ("gauge", ("pid", "kind")),
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
    assert value(fams, "allocsampler_process_rss_bytes", pid="101", tier="attach") == 3 << 30
    # names only on the info series: quotes, backslashes and newlines in comm survive the round
    # trip; undecodable bytes become "?"
    assert series(fams, "allocsampler_process_info") == {
        (("comm", "python3"), ("pid", "101")): 1, (("comm", WEIRD_COMM), ("pid", "202")): 1,
        (("comm", "bad?name"), ("pid", "303")): 1}
    assert value(fams, "allocsampler_process_rss_bytes", pid="202", tier="rss") == 1 << 20
    assert value(fams, "allocsampler_process_rss_bytes", pid="303", tier="preload") == 7
    assert value(fams, "allocsampler_process_outstanding_bytes", pid="101", source="malloc") == 1.5e9
    assert value(fams, "allocsampler_process_outstanding_stderr_bytes", pid="202", source="fault") == 1e5
    assert value(fams, "allocsampler_process_growth_bytes_per_second", pid="101") == 12345.5
    assert value(fams, "allocsampler_process_gpu_memory_bytes", pid="101", kind="used") == 8 << 30
    # unknown figures are absent, never a made-up 0
    assert len(series(fams, "allocsampler_process_growth_bytes_per_second")) == 1
    assert len(series(fams, "allocsampler_process_arena_bloat_bytes")) == 1
    assert len(series(fams, "allocsampler_process_gpu_memory_bytes")) == 2
    assert len(series(fams, "allocsampler_process_outstanding_bytes")) == 3
    assert value(fams, "allocsampler_events_total") == 1500
    assert value(fams, "allocsampler_lost_events_total") == 3
    assert value(fams, "allocsampler_samples_total") == 75
    assert value(fams, "allocsampler_vm_events_suppressed_total") == 100_000
    assert value(fams, "allocsampler_process_sample_mean_bytes", pid="101") == 4 << 20
    assert len(series(fams, "allocsampler_process_sample_mean_bytes")) == 1
    assert value(fams, "allocsampler_live_table_fill_ratio") == 0.25
    assert value(fams, "allocsampler_cpu_seconds_total") == 12.25
    assert value(fams, "allocsampler_writing_paused") == 1
    assert value(fams, "allocsampler_last_snapshot_timestamp_seconds") == 1_700_000_600.5
    # every tier has a series, so "no target in tier X" is a 0 and not a missing series
    assert series(fams, "allocsampler_targets") == {
        (("tier", "inject"),): 0, (("tier", "attach"),): 1, (("tier", "preload"),): 1, (("tier", "rss"),): 1,
        (("tier", "syscalls"),): 0}


def _processes_row(pid: int, comm: str, now: dt.datetime, tracer: GpuTracer, table: ProcessTable) -> dict:
    """A `processes` row as Recorder._process_row builds it: every schema column (the ones these
    tests do not need are null), the GPU ones from GpuTracer.process_columns."""
    row = dict.fromkeys(c.name for c in PROCESSES.columns)
    row.update(ts=now, recording_id="r1", pid=pid, comm=comm, rss=5 << 30, tier="attach",
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
    ids = {"pid": "101"}
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


UPLOAD_FAMILIES = {
    "allocsampler_upload_backlog_files": ("gauge", ()),
    "allocsampler_upload_backlog_bytes": ("gauge", ()),
    "allocsampler_upload_backlog_oldest_age_seconds": ("gauge", ()),
    "allocsampler_upload_files_total": ("counter", ()),
    "allocsampler_upload_bytes_total": ("counter", ()),
    "allocsampler_upload_failures_total": ("counter", ()),
    "allocsampler_upload_lost_files_total": ("counter", ()),
    "allocsampler_upload_lost_bytes_total": ("counter", ()),
    "allocsampler_upload_last_success_timestamp_seconds": ("gauge", ()),
}


def test_upload_families_only_with_upload():
    """Without [upload] the exposition is as before (no upload families, not even empty ones); with
    it, the backlog, uploads, failures and lost files; unknown values are no sample."""
    assert not any(n.startswith("allocsampler_upload") for n in parse(render(MetricsState())))
    state = MetricsState()
    state.set_upload(UploadHealth(backlog_files=12, backlog_bytes=3 << 20, backlog_oldest_age_seconds=90.5,
                                  uploaded_files_total=40, uploaded_bytes_total=1 << 30, failures_total=3,
                                  lost_files_total=2, lost_bytes_total=1 << 20))
    fams = parse(render(state))
    assert {n: (f["type"]) for n, f in fams.items() if n.startswith("allocsampler_upload")} == \
        {n: t for n, (t, _) in UPLOAD_FAMILIES.items()}
    assert (value(fams, "allocsampler_upload_backlog_files"), value(fams, "allocsampler_upload_failures_total"),
            value(fams, "allocsampler_upload_lost_bytes_total")) == (12, 3, 1 << 20)
    assert series(fams, "allocsampler_upload_last_success_timestamp_seconds") == {}


def test_special_float_values():
    state = MetricsState()
    state.set_processes([ProcessMetrics(pid=1, comm="x", tier="attach", rss_bytes=1,
                                        growth_bytes_per_second=float("-inf"),
                                        outstanding={"malloc": Estimate(float("nan"), float("inf"))})])
    text = render(state)
    assert 'allocsampler_process_growth_bytes_per_second{pid="1"} -Inf\n' in text
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
    assert len(series(fams, "allocsampler_process_info")) == 200
    assert all(dict(k)["comm"] != "reused" for k in series(fams, "allocsampler_process_info"))

    state.max_processes = 0
    fams = parse(render(state))
    assert series(fams, "allocsampler_process_rss_bytes") == {}
    assert value(fams, "allocsampler_processes_omitted") == 250


def test_comm_control_characters_and_quotes_are_escaped():
    """The format's escapes for backslash, quote and newline; "?" for every other character that
    is not printable; long names cut. Nothing in the text but line ends splits a line, for any
    line splitter (str.splitlines, as `allocsampler status` reads it, splits on \\r, \\x85, \\u2028...)."""
    comm = 'q"\\\n' + "\r\t\x00\x1b\x7f\x85\u2028\x1c\u200b\udcfe" + "é名" + "x" * 300
    state = MetricsState()
    state.set_processes([ProcessMetrics(pid=7, comm=comm, tier="attach", rss_bytes=1)])
    text = render(state)
    assert all(c == "\n" or c.isprintable() for c in text)
    assert text.splitlines() == text.split("\n")[:-1]
    shown = 'q"\\\n' + "?" * 10 + "é名" + "x" * (MAX_COMM - 16)
    assert len(shown) == MAX_COMM
    assert series(parse(text), "allocsampler_process_info") == {(("comm", shown), ("pid", "7")): 1}
    # the library's own parser reads the same
    (info,) = [f for f in text_string_to_metric_families(text) if f.name == "allocsampler_process_info"]
    assert [s.labels for s in info.samples] == [{"pid": "7", "comm": shown}]


def test_renaming_does_not_grow_series():
    """A process that renames itself changes its one info series; every other series stays the same."""
    def series_keys(suffix: str) -> set[tuple]:
        state = sample_state()
        state.set_processes([dataclasses.replace(p, comm=p.comm + suffix) for p in state.processes])
        return {(name, key) for name, f in parse(render(state)).items() for key in f["samples"]}

    before, after = series_keys(""), series_keys("-renamed")
    assert len(before) == len(after)
    changed = before ^ after
    assert {name for name, _ in changed} == {"allocsampler_process_info"} and len(changed) == 2 * 3


def test_series_are_bounded():
    """Whatever the number of targets: at most max_processes processes with series, a fixed number
    each, the largest by RSS; the others counted."""
    full = dict(growth_bytes_per_second=1.0, outstanding={s: Estimate(1, 1) for s in SOURCES}, arena_bloat_bytes=1,
                gpu_memory_bytes=dict.fromkeys(GPU_KINDS, 1), gpu_memory_stderr_bytes=dict.fromkeys(GPU_KINDS, 1),
                memory_limit_bytes=1, sample_mean_bytes=1)
    state = MetricsState(max_processes=50)
    state.set_processes(ProcessMetrics(pid=i, comm=f"p{i}", tier="attach", rss_bytes=i, **full) for i in range(1000))
    fams = parse(render(state))
    per_process = [n for n in fams if n.startswith("allocsampler_process_")]
    pids = {dict(k)["pid"] for n in per_process for k in series(fams, n)}
    assert pids == {str(i) for i in range(950, 1000)}
    # info, rss, limit, growth, 4 sources x 2, bloat, 4 GPU kinds x 2, sample mean
    assert sum(len(series(fams, n)) for n in per_process) == 50 * 22
    assert value(fams, "allocsampler_processes_omitted") == 950


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

        # only GET /metrics: every other path and method is a 404
        for path, method in (("/", "GET"), ("/nope", "GET"), ("/metricsx", "GET"), ("/metrics", "HEAD"),
                             ("/metrics", "POST"), ("/metrics", "PUT")):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(base + path, method=method, data=b"x" * 10),
                                       timeout=5)
            assert e.value.code == 404, (path, method)

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


def closed_by_server(s: socket.socket, wait: float) -> bool:
    """Whether the server closes `s` within `wait` s (end of stream or reset; a refusal's 503 is read past)."""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([s], [], [], left)[0]:
            return False
        try:
            if not s.recv(4096):
                return True
        except ConnectionResetError:
            return True
    return False


def raw_get(port: int) -> bytes:
    """A scrape's reply as bytes; b"" when the server reset the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
        return reply


def test_slowloris_is_cut_off_and_does_not_block_a_scrape():
    with MetricsServer(sample_state(), port=0, timeout_s=1.0) as server:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            status, _, body = get(f"http://127.0.0.1:{server.port}/metrics")       # answered meanwhile
            assert status == 200 and value(parse(body), "allocsampler_up") == 1
            assert time.monotonic() - t0 < 0.5
            # a header byte every 0.1 s, never ending the head: a timeout per read would never fire,
            # the connection's deadline does
            closed_after = None
            while closed_after is None and time.monotonic() - t0 < 5:
                try:
                    slow.sendall(b"X")
                except OSError:
                    closed_after = time.monotonic() - t0
                if closed_by_server(slow, 0.1):
                    closed_after = time.monotonic() - t0
            assert closed_after is not None and 0.9 < closed_after < 2.5, closed_after


def test_oversized_request_is_dropped():
    with MetricsServer(MetricsState(), port=0) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as s:
        t0 = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(64):
                s.sendall(b"X-Filler: " + b"a" * 1000 + b"\r\n")
                time.sleep(0.01)
        assert closed_by_server(s, 1) and time.monotonic() - t0 < 2


def test_connection_flood_is_dropped_quickly_and_a_scrape_still_works():
    """Idle connections beyond the cap are closed at once, oldest first, long before the timeout;
    a scrape during the flood gets its answer."""
    cap, extra = 4, 12
    with MetricsServer(sample_state(), port=0, timeout_s=30, max_connections=cap) as server:
        flood = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(cap + extra)]
        try:
            t0 = time.monotonic()
            closed: set[int] = set()
            while len(closed) < extra and time.monotonic() - t0 < 2:
                closed |= {i for i, s in enumerate(flood) if i not in closed and closed_by_server(s, 0.01)}
            assert closed == set(range(extra)), closed         # the oldest, at once
            assert not any(closed_by_server(s, 0.2) for s in flood[extra:])

            t1 = time.monotonic()
            status, _, body = get(f"http://127.0.0.1:{server.port}/metrics")
            assert status == 200 and value(parse(body), "allocsampler_samples_total") == 75
            assert time.monotonic() - t1 < 2
            assert closed_by_server(flood[extra], 1)           # the oldest idle one made room
        finally:
            for s in flood:
                s.close()


class GatedState(MetricsState):
    """A state whose snapshot waits for `gate`: scrapes that stay busy as long as a test wants."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.waiting, self._count = threading.Event(), 0, threading.Lock()

    def snapshot(self) -> MetricsState:
        with self._count:
            self.waiting += 1
        self.gate.wait(10)
        return super().snapshot()


def test_beyond_the_cap_a_connection_is_refused_while_all_are_answering():
    state = GatedState()
    with MetricsServer(state, port=0, timeout_s=10, max_connections=2) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        statuses: list[int] = []
        busy = [threading.Thread(target=lambda: statuses.append(get(url)[0])) for _ in range(2)]
        for t in busy:
            t.start()
        try:
            deadline = time.monotonic() + 5
            while state.waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state.waiting == 2
            t0 = time.monotonic()
            reply = raw_get(server.port)
            assert reply in (b"", b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            assert time.monotonic() - t0 < 1
        finally:
            state.gate.set()
            for t in busy:
                t.join()
        assert statuses == [200, 200]
        assert raw_get(server.port).startswith(b"HTTP/1.1 200 OK\r\n")     # slots free again


def test_rendered_once_per_state_change(monkeypatch):
    """Scrapes between two writes of the state share one rendering (the loop's heartbeat age
    aside: it is computed when served)."""
    calls = []
    collect = StateCollector.collect

    def counted(self):
        calls.append(1)
        return collect(self)

    monkeypatch.setattr(StateCollector, "collect", counted)
    state = sample_state()
    with MetricsServer(state, port=0) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        def rendered() -> str:
            return "\n".join(ln for ln in get(url)[2].splitlines() if "loop_heartbeat_age" not in ln)

        assert rendered() == rendered() and len(calls) == 1
        state.add_interval(samples=1)
        assert value(parse(get(url)[2]), "allocsampler_samples_total") == 76 and len(calls) == 2
