"""Retention, compaction and crash recovery of a dataset directory, on real Parquet written by
DatasetWriter with the real schemas (no BPF). Crashes are real kill -9s of child processes."""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, tmpfs_at

from analysis.dataset import latest_outstanding, load, read_table
from sampler.dataset import retention as R
from sampler.dataset.schema import FRAMES, OUTSTANDING, PROCESSES, RECORDINGS, STACKS, TABLES
from sampler.dataset.writer import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, DatasetWriter, DiskFull

UTC = dt.timezone.utc
T0 = dt.datetime(2024, 3, 1, tzinfo=UTC)
REC_A = "20240301T000000Z-4242"
REC_B = "20240301T000000Z-123456"       # a 6-digit pid: its name must not parse as a sequence number
# A column whose value is unique per row, to tell rows seen once from rows seen twice.
UNIQUE = {"outstanding": "outstanding_bytes", "processes": "rss", "stacks": "stack_id", "frames": "offset"}
COMPACTED = ("outstanding", "processes", "stacks", "frames")
HOST = "h"


class Data:
    """A dataset written interval by interval, and what every table must hold."""

    def __init__(self, root: Path, **modes):
        self.root = root
        self.modes = modes
        self.expected: dict[str, list] = {t: [] for t in UNIQUE}
        self._n = itertools.count()
        self._stack = itertools.count(1000)

    def recording(self, rec: str, start: dt.datetime, intervals: int, step: dt.timedelta, rows: int = 20,
                  ) -> DatasetWriter:
        w = DatasetWriter(self.root, rec, host=HOST, **self.modes)
        self._put(w.write(RECORDINGS, [{"recording_id": rec, "host": "h", "started": start, "schema_version": 3,
                                        "interval_s": step.total_seconds(), "probe_mode": "session"}],
                          name=rec, day=start.date()), start)
        for k in range(intervals):
            self.interval(w, start + k * step, rows)
        return w

    def interval(self, w: DatasetWriter, ts: dt.datetime, rows: int = 20) -> None:
        rec = w.recording_id
        common = {"ts": ts, "recording_id": rec, "host": "h"}
        sid = next(self._stack)
        stacks = [{**common, "stack_id": sid, "n_frames": 2, "truncated": False, "site": f"f{sid} (m)",
                   "summary": f"f{sid} (m) < main (m)", "unwind_stop": "entry", "python_frames": 0}]
        frames = [{**common, "stack_id": sid, "depth": d, "function": f"f{sid}" if d == 0 else "main",
                   "module": "m", "offset": next(self._n), "kind": "native", "inlined": False} for d in range(2)]
        out = [{**common, "interval_s": 10.0, "pid": 100 + i % 3, "comm": "svc", "source": "malloc",
                "stack_id": sid - i % 3, "outstanding_bytes": float(next(self._n)), "live_samples": 1}
               for i in range(rows)]
        procs = [{**common, "pid": 100 + p, "comm": "svc", "rss": next(self._n)} for p in range(3)]
        for table, data in ((STACKS, stacks), (FRAMES, frames), (OUTSTANDING, out), (PROCESSES, procs)):
            self.expected[table.name] += [r[UNIQUE[table.name]] for r in data]
            self._put(w.write(table, data, day=ts.date()), ts)

    @staticmethod
    def _put(path: Path, ts: dt.datetime) -> None:     # the file's age is its interval's
        os.utime(path, (ts.timestamp(), ts.timestamp()))

    def check_exactly_once(self) -> None:
        """Every visible file reads, and every reader sees each row exactly once."""
        for f in self.root.glob("*/host=*/date=*/*.parquet"):
            pq.read_table(f)
        for t in COMPACTED:
            assert seen(self.root, t) == sorted(self.expected[t]), t


def seen(root: Path, table: str) -> list:
    """The rows of a table (their unique column) as pyarrow.dataset, analysis.dataset and DuckDB
    see them; they must agree."""
    col = UNIQUE[table]
    path = root / table
    if not list(path.glob("host=*/date=*/*.parquet")):
        return []
    arrow = ds.dataset(path, format="parquet", partitioning="hive").to_table(columns=[col]).column(0).to_pylist()
    ours = read_table(root, table, columns=[col])[col].tolist()
    duck = [r[0] for r in duckdb.sql(f"SELECT \"{col}\" FROM read_parquet('{path}/*/*/*.parquet', "
                                     "hive_partitioning=true)").fetchall()]
    assert sorted(arrow) == sorted(ours) == sorted(duck), table
    return sorted(arrow)


def files(root: Path, table: str) -> list[Path]:
    return sorted(root.glob(f"{table}/host=*/date=*/*.parquet"))


# -- retention ----------------------------------------------------------------------------------

def test_age_deletes_old_partitions_and_keeps_what_live_data_references(tmp_path):
    d = Data(tmp_path)
    step = dt.timedelta(hours=8)
    d.recording(REC_B, T0, 6, step)                     # days 0-1 only
    d.recording(REC_A, T0, 30, step)                    # days 0-9; its recording row and first stacks: day 0
    now = T0 + dt.timedelta(days=10, hours=1)
    r = R.enforce(tmp_path, None, 5, now)
    # a day goes when its last moment is 5 days old: days 0-4
    days = {p.parent.name for t in ("outstanding", "processes") for p in files(tmp_path, t)}
    assert days == {f"date={T0.date() + dt.timedelta(days=k)}" for k in range(5, 10)}
    assert r.expired == len(r.deleted) and r.deleted_bytes > 0 and r.over_budget_bytes == 0
    assert not (tmp_path / "outstanding" / f"host={HOST}" / f"date={T0.date()}").exists()   # emptied partitions go
    # REC_A still has data: its recording row and its day-0 stacks stay; REC_B's metadata went with its data
    recs = read_table(tmp_path, "recordings")
    assert set(recs["recording_id"].astype(str)) == {REC_A}
    stacks = read_table(tmp_path, "stacks")
    assert set(stacks["recording_id"].astype(str)) == {REC_A} and stacks["date"].astype(str).min() == str(T0.date())
    # the remaining rows still join with their stacks
    assert latest_outstanding(tmp_path)["summary"].notna().all()
    assert R.enforce(tmp_path, None, 5, now).deleted == []


def test_size_budget_deletes_oldest_first_and_keeps_the_newest(tmp_path):
    d = Data(tmp_path)
    step = dt.timedelta(hours=6)
    d.recording(REC_A, T0, 24, step)
    now = T0 + 24 * step
    total = R.dataset_bytes(tmp_path)
    before = {f.path: f for f in R.dataset_files(tmp_path)}
    r = R.enforce(tmp_path, total // 2, None, now)
    assert r.total_bytes == R.dataset_bytes(tmp_path) <= total // 2 and r.over_budget_bytes == 0
    assert total - r.deleted_bytes == r.total_bytes
    deleted = [before[tmp_path / p] for p in r.deleted]
    kept = [f for f in R.dataset_files(tmp_path) if f.table not in R.METADATA_TABLES]
    assert deleted and kept
    assert max(f.age_key() for f in deleted) < min(f.age_key() for f in kept)     # oldest first
    last = T0 + 23 * step
    assert {f.table for f in kept if f.mtime == last.timestamp()} == {"outstanding", "processes"}
    assert set(read_table(tmp_path, "recordings")["recording_id"].astype(str)) == {REC_A}


def test_tiny_budget_is_enforced(tmp_path):
    d = Data(tmp_path)
    step = dt.timedelta(seconds=10)
    w = d.recording(REC_A, T0, 12, step)
    now = T0 + 12 * step
    # recent files (two intervals) and the metadata of the recording that owns them survive; the
    # rest is over the budget, and the report says by how much (the daemon stops writing)
    r = R.enforce(tmp_path, 1, None, now, keep_recent_s=2 * step.total_seconds())
    left = R.dataset_files(tmp_path)
    data = [f for f in left if f.table not in R.METADATA_TABLES]
    assert data and all(now.timestamp() - f.mtime < 20 for f in data)
    assert r.over_budget_bytes == r.total_bytes - 1 > 0
    assert {f.table for f in left} == {"outstanding", "processes", "stacks", "frames", "recordings"}
    # the running recording's metadata is kept even when all its data is gone
    r = R.enforce(tmp_path, 1, None, now, keep_recent_s=0, keep_recordings=[REC_A])
    assert {f.table for f in R.dataset_files(tmp_path)} == {"stacks", "frames", "recordings"}
    r = R.enforce(tmp_path, 1, None, now, keep_recent_s=0)
    assert R.dataset_files(tmp_path) == [] and r.total_bytes == 0 and r.over_budget_bytes == 0
    d.interval(w, now)                                  # the writer goes on in the removed partitions
    assert len(read_table(tmp_path, "outstanding")) == 20


# -- compaction ---------------------------------------------------------------------------------

def frames_of(root: Path) -> dict:
    """Everything readers get: every table through pyarrow, and analysis.dataset's views."""
    out = {t: ds.dataset(root / t, format="parquet", partitioning="hive").to_table()
           .to_pandas().sort_values(UNIQUE[t], kind="stable").reset_index(drop=True) for t in COMPACTED}
    loaded = load(root, outstanding_columns=None)
    for t in ("outstanding", "processes", "stacks", "frames", "recordings"):
        out[f"load.{t}"] = getattr(loaded, t).sort_values(list(getattr(loaded, t).columns)[:5],
                                                          kind="stable").reset_index(drop=True)
    out["latest"] = latest_outstanding(root).sort_values("outstanding_bytes").reset_index(drop=True)
    return out


def test_compaction_merges_files_and_readers_see_the_same_rows(tmp_path):
    d = Data(tmp_path, dir_mode=PRIVATE_DIR_MODE, file_mode=PRIVATE_FILE_MODE)
    step = dt.timedelta(seconds=10)
    start = T0 + dt.timedelta(hours=23, minutes=50)     # crosses midnight: two partitions per table
    d.recording(REC_B, start - dt.timedelta(minutes=5), 10, step)
    d.recording(REC_A, start, 80, step)
    now = start + 80 * step
    before = frames_of(tmp_path)
    sources = {f.path: f for f in R.dataset_files(tmp_path)}
    part = tmp_path / "outstanding" / f"host={HOST}" / f"date={start.date()}"
    (part / "_SUCCESS").write_text("")                  # someone else's file: kept
    (part / ".x.parquet.tmp").write_text("partial")     # a killed writer's: dropped with the old files
    r = R.compact(tmp_path, older_than_s=3 * step.total_seconds(), now=now)
    d.check_exactly_once()
    after = frames_of(tmp_path)
    for k, df in before.items():
        assert df.equals(after[k]), k
    # per table, partition and recording one merged file; the last two intervals are too recent
    for t in COMPACTED:
        assert [p.name for p in files(tmp_path, t)] == [
            f"{REC_B}-000001_000010.parquet", f"{REC_A}-000001_000060.parquet",     # day 1
            f"{REC_A}-000061_000078.parquet", f"{REC_A}-000079.parquet", f"{REC_A}-000080.parquet"]  # day 2
    assert r.files_before == 4 * (10 + 60 + 18) and len(r.merged) == 4 * 3 and not r.skipped
    assert r.bytes_after < r.bytes_before
    assert not list((tmp_path / R.STAGING).iterdir())
    assert (part / "_SUCCESS").exists() and not (part / ".x.parquet.tmp").exists()
    for path in (p for t in COMPACTED for p in files(tmp_path, t) if "_" in p.name):
        merged = pq.read_table(path)
        table = path.parent.parent.parent.name
        assert merged.schema.equals(TABLES[table].schema, check_metadata=True)
        rec = R._NAME.fullmatch(path.name)["rec"]
        srcs = [f for f in sources.values() if f.table == table and f.recording == rec and f.path.parent == path.parent
                and not f.path.exists()]
        ts = merged.column("ts").to_pylist()
        assert ts == sorted(ts)
        st = path.stat()
        assert st.st_mode & 0o777 == PRIVATE_FILE_MODE and path.parent.stat().st_mode & 0o777 == PRIVATE_DIR_MODE
        assert st.st_mtime == max(f.mtime for f in srcs)            # keeps the age retention goes by
    # nothing more to do; then the merged file takes in the next hour's files
    assert R.compact(tmp_path, 30, now=now).merged == []
    w = DatasetWriter(tmp_path, REC_A, host=HOST)
    w._seq = {t: 80 for t in COMPACTED}                 # the same recording goes on
    for k in range(80, 90):
        d.interval(w, start + k * step)
    r = R.compact(tmp_path, 0, now=start + 100 * step)
    assert f"{REC_A}-000061_000090.parquet" in [p.name for p in files(tmp_path, "outstanding")]
    d.check_exactly_once()


def test_merged_rows_keep_their_order(tmp_path):
    d = Data(tmp_path)
    d.recording(REC_A, T0, 30, dt.timedelta(seconds=10))
    parts = [pq.read_table(p) for p in files(tmp_path, "frames")]
    R.compact(tmp_path, 0)
    (merged,) = files(tmp_path, "frames")
    assert pq.read_table(merged).equals(pa.concat_tables(parts))     # same rows, same order


def test_compaction_respects_target_size(tmp_path):
    d = Data(tmp_path)
    d.recording(REC_A, T0, 40, dt.timedelta(seconds=10), rows=200)
    sizes = [f.disk_bytes for f in R.dataset_files(tmp_path) if f.table == "outstanding"]
    target = sum(sizes) // 4
    r = R.compact(tmp_path, 0, target_bytes=target)
    out = files(tmp_path, "outstanding")
    assert 4 <= len(out) <= 6 and all(n > 1 for name, n in r.merged if "outstanding" in name)
    d.check_exactly_once()


def test_every_step_of_a_compaction_is_atomic_for_readers(tmp_path, monkeypatch):
    d = Data(tmp_path)
    step = dt.timedelta(seconds=10)
    d.recording(REC_A, T0, 12, step)
    points = Counter()

    def check(point: str) -> None:
        points[point] += 1
        if points[point] <= 3:          # later hits of a point are the same state in another partition
            d.check_exactly_once()

    monkeypatch.setattr(R, "_step", check)
    monkeypatch.setattr(R, "ROW_GROUP_ROWS", 50)
    R.compact(tmp_path, 3 * step.total_seconds(), now=T0 + 12 * step)
    assert {"merge", "merged", "link", "linked", "exchanged", "remove"} <= set(points)
    d.check_exactly_once()


CHILD_COMPACT = """
import os, signal, sys
from sampler.dataset import retention as R
root, point, nth, older, now = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
R.ROW_GROUP_ROWS = int(sys.argv[6])
hits = 0
def step(p):
    global hits
    if p == point:
        hits += 1
        if hits == nth:
            os.kill(os.getpid(), signal.SIGKILL)
R._step = step
print("go", flush=True)
R.compact(root, older, now=now)
"""


def start_compaction(root: Path, point: str = "", nth: int = 1, older: float = 0.0, now: float | None = None,
                     row_group: int = 1 << 18) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD_COMPACT, str(root), point, str(nth), str(older),
                          str(now or time.time()), str(row_group)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "go\n"
    return p


# One kill per step of _compact_partition, each a different state left behind. The dataset below
# has one day partition per table, compacted in the order frames, outstanding, processes, stacks:
# each has 38 old files (one bin) and 2 recent ones (linked), and with 50-row row groups "merge"
# fires once in frames and 12 times in outstanding.
#   merge 3:     outstanding half merged (a temporary in its work area); frames already swapped in
#   merged 1:    frames' merged file in its work area, nothing published yet
#   link 3:      outstanding merged and one of its two recent files linked into the work area
#   linked 2:    outstanding's work area complete (merged file, links, modes), not yet swapped
#   exchanged 1: frames swapped in; its work area holds the old set, no file of it removed yet
#   remove 25:   frames' old set partly removed (25 of its 40 files)
# Other hits of a step leave the same state in another partition (e.g. merged 3 or exchanged 4:
# the same as merged 1 or exchanged 1 in processes or stacks, the partitions before them already
# compacted, which merge 3, link 3 and linked 2 leave too) or with a different count of files
# (remove 1): the same code paths and the same recovery.
@pytest.mark.parametrize("point,nth,table", [("merge", 3, "outstanding"), ("merged", 1, "frames"),
                                             ("link", 3, "outstanding"), ("linked", 2, "outstanding"),
                                             ("exchanged", 1, "frames"), ("remove", 25, "frames")])
def test_kill_9_during_compaction(tmp_path, point, nth, table):
    d = Data(tmp_path)
    step = dt.timedelta(seconds=10)
    d.recording(REC_A, T0, 40, step)
    now = (T0 + 40 * step).timestamp()
    p = start_compaction(tmp_path, point, nth, older=3 * step.total_seconds(), now=now, row_group=50)
    assert p.wait(60) == -signal.SIGKILL
    d.check_exactly_once()                      # before any recovery: readers see old or new, not both
    # killed in the partition the comment above says
    assert [w.name for w in (tmp_path / R.STAGING).iterdir()] == [f"{table}.host={HOST}.date={T0.date()}"]
    done = R.recover(tmp_path)
    assert done and all("interrupted compaction" in line for line in done)
    assert not any((tmp_path / R.STAGING).iterdir())
    d.check_exactly_once()
    r = R.compact(tmp_path, 3 * step.total_seconds(), now=now)
    assert not r.skipped
    d.check_exactly_once()
    for t in COMPACTED:
        assert len(files(tmp_path, t)) == 3, t  # one merged file and the two recent ones


def test_kill_9_at_random_times_during_compaction(tmp_path):
    d = Data(tmp_path)
    step = dt.timedelta(seconds=10)
    w = d.recording(REC_A, T0, 60, step, rows=2000)
    rng = np.random.default_rng(1)
    # kill times are drawn within how long a whole compaction takes on this machine (timed on a
    # copy), so that they land during its work on a fast machine as on a slow one
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-timing")
    timing = start_compaction(tmp_path.parent / f"{tmp_path.name}-timing", row_group=2000)
    t0 = time.monotonic()
    assert timing.wait(60) == 0
    whole = time.monotonic() - t0
    # at least six kills, and on until two of them left work behind: a kill between two partitions,
    # or after a run that a busy machine made quick, leaves nothing to recover (still checked)
    killed_with_work = kills = 0
    while kills < 6 or (killed_with_work < 2 and kills < 24):
        d.interval(w, T0 + (60 + kills) * step, rows=2000)       # new files between runs
        p = start_compaction(tmp_path, row_group=2000)
        time.sleep(float(rng.uniform(0.1, 0.9)) * whole)
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        kills += 1
        d.check_exactly_once()
        killed_with_work += bool(R.recover(tmp_path))
        d.check_exactly_once()
    assert killed_with_work >= 2, f"{kills} kills, {killed_with_work} during a compaction's work"
    R.compact(tmp_path, 0)
    d.check_exactly_once()
    assert all(len(files(tmp_path, t)) == 1 for t in COMPACTED)


# -- writer crash, modes, full disk -------------------------------------------------------------

CHILD_WRITE = """
import sys
import numpy as np, pyarrow as pa
from sampler.dataset.writer import DatasetWriter
from sampler.dataset.schema import OUTSTANDING
n = 1_000_000
rng = np.random.default_rng(0)
cols = {c.name: pa.nulls(n, c.type) for c in OUTSTANDING.columns}
cols["ts"] = pa.array(np.full(n, 1_700_000_000_000_000), pa.timestamp("us", tz="UTC"))
for name in ("outstanding_bytes", "outstanding_stderr_bytes", "allocated_bytes", "freed_bytes"):
    cols[name] = pa.array(rng.random(n))
cols["stack_id"] = pa.array(rng.integers(0, 1 << 62, n))
table = pa.table(cols, schema=OUTSTANDING.schema)
w = DatasetWriter(sys.argv[1], "20240101T000000Z-1")
while True:
    w.write(OUTSTANDING, table)
    print("written", flush=True)
"""


def test_writer_is_atomic_and_partitioned(tmp_path):
    w = DatasetWriter(tmp_path, "rec1")
    row = {c.name: None for c in OUTSTANDING.columns}
    row.update(pid=1, source="malloc", stack_id=5, outstanding_bytes=1.0, recording_id="rec1", host="h")
    path = w.write(OUTSTANDING, [row])
    assert path.parent.name.startswith("date=") and path.parent.parent.name == "host=unknown"
    assert path.parent.parent.parent.name == "outstanding"
    (path.parent / ".junk.parquet.tmp").write_bytes(b"partial")       # a killed writer's leftover
    assert len(pd.read_parquet(tmp_path / "outstanding")) == 1        # readers skip dot-files
    DatasetWriter(tmp_path, "rec2")
    assert not (path.parent / ".junk.parquet.tmp").exists()
    assert pq.read_schema(path).metadata[b"allocsampler.table"] == b"outstanding"
    assert w.write(OUTSTANDING, []) is None


def test_kill_9_of_a_writer_mid_write_leaves_only_whole_files(tmp_path):
    for _ in range(5):          # the kill must land while a file is being written
        p = subprocess.Popen([sys.executable, "-c", CHILD_WRITE, str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "written\n"
        deadline = time.time() + 30
        while not list(tmp_path.glob("*/host=*/date=*/.*.tmp")) and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        temps = list(tmp_path.glob("*/host=*/date=*/.*.tmp"))
        if temps:
            break
    assert temps, "never killed mid-write"
    visible = files(tmp_path, "outstanding")
    assert visible and all(pq.read_metadata(f).num_rows == 1_000_000 for f in visible)
    assert len(read_table(tmp_path, "outstanding", columns=["stack_id"])) == 1_000_000 * len(visible)
    done = R.recover(tmp_path)
    assert len(done) == len(temps) and all("interrupted write" in line for line in done)
    assert not list(tmp_path.glob("*/host=*/date=*/.*")) and R.recover(tmp_path) == []


def test_modes_are_private_whatever_the_umask(tmp_path):
    for umask in (0o077, 0o000):
        root = tmp_path / f"u{umask:o}" / "data"
        old = os.umask(umask)
        try:
            d = Data(root, dir_mode=PRIVATE_DIR_MODE, file_mode=PRIVATE_FILE_MODE)
            d.recording(REC_A, T0, 3, dt.timedelta(seconds=10))
            R.compact(root, 0)
        finally:
            os.umask(old)
        for path in [root.parent, root, *root.rglob("*")]:
            if path.name in (R.STAGING, R.LOCK_FILE, R.MARKER_FILE):     # ours alone
                assert path.stat().st_mode & 0o777 in (0o700, 0o600)
                continue
            assert path.stat().st_mode & 0o777 == (PRIVATE_DIR_MODE if path.is_dir() else PRIVATE_FILE_MODE), path
            assert path.stat().st_uid == 0


def test_ensure_private_fixes_an_existing_tree(tmp_path):
    root = tmp_path / "data"
    d = Data(root)                                      # the writer's defaults: 0755 / 0644
    d.recording(REC_A, T0, 3, dt.timedelta(seconds=10))
    loose = files(root, "outstanding")[0]
    os.chmod(loose, 0o666)
    os.chown(loose, 1234, 4321)
    outside = tmp_path / "outside"
    outside.write_text("x")
    os.chmod(outside, 0o644)
    (root / "link").symlink_to(outside)
    assert R.ensure_private(root) > 0
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        st = path.stat()
        assert st.st_mode & 0o777 == (0o750 if path.is_dir() else 0o640) and st.st_uid == 0, path
    assert loose.stat().st_gid == 4321                  # the group may be given read access
    assert outside.stat().st_mode & 0o777 == 0o644      # symlinks are not followed
    assert R.ensure_private(root) == 0
    R.ensure_private(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").stat().st_mode & 0o777 == 0o750


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (we are root)."""
    with tmpfs_at(tmp_path / "disk", "1M") as mnt:
        yield mnt


def incompressible(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    rows = {c.name: pa.nulls(n, c.type) for c in OUTSTANDING.columns}
    rows["ts"] = pa.array(np.full(n, 1_700_000_000_000_000), pa.timestamp("us", tz="UTC"))
    rows["outstanding_bytes"] = pa.array(rng.random(n))
    return pa.table(rows, schema=OUTSTANDING.schema)


def test_full_disk_raises_disk_full_and_leaves_no_partial_file(tiny_disk):
    d = Data(tiny_disk)
    w = d.recording(REC_A, T0, 3, dt.timedelta(seconds=10))
    with pytest.raises(DiskFull) as e:
        w.write(OUTSTANDING, incompressible(300_000))   # ~2.4 MB
    assert isinstance(e.value, OSError) and e.value.errno == 28
    assert not list(tiny_disk.glob("*/host=*/date=*/.*")), "partial temporary left"
    d.check_exactly_once()                              # what was written before still reads

    state = R.DiskState(tiny_disk, floor_bytes=256 << 10, resume_bytes=512 << 10)
    assert state.update() is False and not state.full
    free = state.free_bytes
    filler = tiny_disk / "filler"
    filler.write_bytes(b"x" * (free - (128 << 10)))
    assert state.update() is True and state.full        # changed: log once
    assert state.update() is False and state.full       # no change: no log
    filler.write_bytes(b"x" * (free - (400 << 10)))
    assert state.update() is False and state.full       # above the floor, below the resume mark
    filler.unlink()
    assert state.update() is True and not state.full
    assert state.mark_full(now=100.0) is True
    assert state.update(now=150.0) is False and state.full          # space seems back: retry later
    assert state.update(now=100.0 + state.retry_s) is True and not state.full


def test_compaction_on_a_full_disk_changes_nothing(tiny_disk):
    d = Data(tiny_disk)
    d.recording(REC_A, T0, 10, dt.timedelta(seconds=10), rows=100)
    filler = tiny_disk / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):     # fill it up
        while True:
            f.write(b"x" * 4096)
    with pytest.raises(DiskFull):
        R.compact(tiny_disk, 0)
    assert not any((tiny_disk / R.STAGING).iterdir())
    d.check_exactly_once()
    filler.unlink()
    assert len(R.compact(tiny_disk, 0).merged) == 4
    d.check_exactly_once()
