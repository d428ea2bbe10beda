"""The dataset of a real recording: plain pandas / pyarrow reads it, it reaches disk within an
interval, and it survives kill -9 of the recorder."""

from __future__ import annotations

import signal
import time

import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sampler.dataset.schema import SCHEMA_VERSION, TABLES
from sampler.dataset.writer import DatasetWriter

pytestmark = pytest.mark.bpf


def test_plain_pandas_and_pyarrow_read_a_recording(workload, record):
    w = workload()
    rec = record("--pid", str(w.pid), "-i", "1")
    rec.wait_attached()
    attached = time.time()
    w.call("leak_malloc", 8 * 1024, 4096)
    w.call("leak_mmap", 8, 1 << 20)
    rec.wait_snapshot(attached + 1)
    # data reaches disk within one interval plus a few seconds
    assert time.time() - attached < 1 + 5
    code, _, err = rec.stop()
    assert code == 0, err
    out = rec.out
    for name in ("outstanding", "stacks", "frames", "processes", "vm_events", "targets", "recorder", "recordings"):
        df = pd.read_parquet(out / name)
        assert len(df) > 0, name
        assert "date" in df.columns                    # Hive partition column
        expected = [c.name for c in TABLES[name].columns]
        assert list(df.columns[: len(expected)]) == expected, name
    table = ds.dataset(out / "outstanding", format="parquet", partitioning="hive").to_table()
    assert table.schema.metadata[b"allocsampler.schema_version"] == str(SCHEMA_VERSION).encode()
    # stacks are stored once and join
    o = pd.read_parquet(out / "outstanding")
    s = pd.read_parquet(out / "stacks")
    assert s["stack_id"].is_unique
    joined = o.merge(s[["stack_id", "summary"]], on="stack_id", how="left")
    assert joined["summary"].notna().all()
    assert joined["summary"].str.contains("leak_malloc").any()
    p = pd.read_parquet(out / "processes")
    assert (p["pid"] == w.pid).all() and (p["rss"] > 0).all()
    assert (p["heap_live_bytes"] + p["arena_live_bytes"]).max() > 16 << 20
    vm = pd.read_parquet(out / "vm_events")
    assert {"mmap", "munmap"} & set(vm["op"].astype(str))
    assert vm["stack_id"].notna().any()
    # the weight that BPF computed for each sampled mmap is the formula's (table interpolation)
    from sampler.control.weights import unbiased_weight
    sampled = vm[vm["sampled_weight"].notna() & (vm["op"] == "mmap")]
    assert len(sampled) > 0
    for length, weight in zip(sampled["length"], sampled["sampled_weight"], strict=True):
        assert weight == pytest.approx(unbiased_weight(length, 512 << 10), rel=1e-3)


def test_survives_kill_minus_9(workload, record):
    w = workload()
    rec = record("--pid", str(w.pid), "-i", "0.3")
    rec.wait_attached()
    deadline = time.time() + 3
    while time.time() < deadline:
        w.call("leak_malloc", 1024, 4096)
        w.call("churn", 4096, 1024)
    rec.proc.send_signal(signal.SIGKILL)
    rec.proc.wait()
    files = list(rec.out.glob("*/host=*/date=*/*.parquet"))
    assert len(files) > 10
    for f in files:                                   # every file reads, none is partial
        pq.read_table(f)
    for name in ("outstanding", "processes", "stacks"):
        assert len(pd.read_parquet(rec.out / name)) > 0
    assert w.call("leak_malloc", 1, 64) == 64, "the target was harmed"
    # leftovers of the killed writer are removed by the next one
    for tmp in rec.out.glob("*/host=*/date=*/.*.tmp"):
        assert tmp.name.startswith(".")
    DatasetWriter(rec.out, "next")
    assert not list(rec.out.glob("*/host=*/date=*/.*.tmp"))
    rows = pd.read_parquet(rec.out / "recordings")
    assert rows["ended"].isna().all(), "a killed recording has no end time"


def test_arena_growth_is_recognised(workload, record):
    """A thread's first malloc gets it its own glibc arena: the recording shows the heap
    reservation, its trims and growth, and the live bytes located in arena heaps."""
    w = workload()
    rec = record("--pid", str(w.pid), "-i", "1")
    rec.wait_attached()
    truth = w.call("leak_malloc", 20 * 1024, 4096, thread=True)       # 80 MiB in a new arena
    rec.wait_snapshot(time.time() + 1.5)
    code, _, err = rec.stop()
    assert code == 0, err
    vm = pd.read_parquet(rec.out / "vm_events")
    events = set(vm["event"].astype(str))
    assert {"heap_reserve", "heap_reserve_trim", "heap_grow"} <= events, events
    p = pd.read_parquet(rec.out / "processes").iloc[-1]
    assert p["arena_heaps"] >= 2 and p["arenas"] >= 1
    assert p["arena_rss"] >= truth * 0.9
    assert p["arena_live_bytes"] == pytest.approx(truth * 4112 / 4096, rel=0.25)


def test_exit_rows_and_a_teardown_snapshot_are_kept_apart_from_the_running_state(tmp_path):
    """Rows written at a process's exit, and a last snapshot within 3 s of it that lost most of what
    the one before held (finalization had begun), are the teardown; older data without the
    `exiting` column reads as running; a reader that selected one source still splits."""
    from analysis.dataset import latest_outstanding, split_exit

    t0 = pd.Timestamp("2026-11-25T00:00:00Z")
    rows = []
    for pid, series, exit_at in ((1, [100, 200, 10], 11.5), (2, [50, 60, 70], None)):
        for i, mib in enumerate(series):
            rows.append({"ts": t0 + pd.Timedelta(seconds=5 * i), "recording_id": "r", "host": "h", "pid": pid,
                         "comm": "p", "source": "mmap", "stack_id": 7, "outstanding_bytes": mib * 2.0 ** 20,
                         "outstanding_stderr_bytes": 0.0, "exiting": False})
        if exit_at is not None:
            rows.append({**rows[-1], "ts": t0 + pd.Timedelta(seconds=exit_at), "outstanding_bytes": 0.0,
                         "exiting": True})
    out = pd.DataFrame(rows)
    running, teardown = split_exit(out)
    assert sorted(running[running["pid"] == 1]["outstanding_bytes"] / 2 ** 20) == [100, 200]
    assert len(running[running["pid"] == 2]) == 3 and len(teardown) == 2
    running, _ = split_exit(out.drop(columns="source"))
    assert len(running) == 5
    assert len(split_exit(out.drop(columns="exiting"))[0]) == len(out)

    w = DatasetWriter(str(tmp_path), "r", host="h")
    w.write(TABLES["outstanding"], [{k: v for k, v in r.items() if k not in ("recording_id", "host")} for r in rows])
    last = latest_outstanding(tmp_path)
    assert dict(zip(last["pid"], last["outstanding_bytes"] / 2 ** 20, strict=True)) == {1: 200, 2: 70}


WRITER_WITHOUT_PANDAS = """
import sys
from sampler.dataset.schema import TABLES
from sampler.dataset.writer import DatasetWriter, leave_pandas_unloaded
import pyarrow.parquet as pq
leave_pandas_unloaded()
w = DatasetWriter(sys.argv[1], "r1", host="h")
table = TABLES["recordings"]
path = w.write(table, [{"recording_id": "r1", "argv": "x"}])
print("pandas" in sys.modules, flush=True)
print(pq.read_table(path).to_pandas()["argv"].tolist(), "pandas" in sys.modules)
"""


def test_the_writer_leaves_pandas_unloaded_until_something_reads_into_pandas(tmp_path):
    """The recorder writes rows without importing pandas (44 MiB of its RSS); a later to_pandas()
    in the same process still works."""
    import subprocess
    import sys

    from conftest import ROOT
    out = subprocess.run([sys.executable, "-c", WRITER_WITHOUT_PANDAS, str(tmp_path / "ds")], capture_output=True,
                         text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False", "['x'] True"]
