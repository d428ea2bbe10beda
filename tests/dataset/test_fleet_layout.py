"""The fleet layout (schema 6): ROOT/<table>/host=<host>/date=<day>/, datasets of many hosts merged
by plain copy, the layout of schema <= 5 still read, compacted and retained, sealing compaction
(the daemon with [upload]), and the executable's identity in `targets`."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from conftest import allocsampler_cmd

from analysis.dataset import read_table
from sampler.dataset import layout
from sampler.dataset import retention as R
from sampler.dataset.schema import OUTSTANDING, STR, TARGETS
from sampler.dataset.writer import DatasetWriter
from sampler.proc.exe_identity import DpkgDatabase, ExeIdentities

UTC = dt.timezone.utc
T0 = dt.datetime(2024, 3, 1, tzinfo=UTC)


@pytest.mark.parametrize("name, key", [
    ("web-1.prod.example.com", "web-1.prod.example.com"),
    ("ip-10-0-0-7", "ip-10-0-0-7"),
    ("fleet b#2", "fleet_b_2"),
    ("a/b=c%d", "a_b_c_d"),
    ("", "unknown"),
    (None, "unknown"),
    ("x" * 300, "x" * layout.MAX_HOST_KEY),
])
def test_host_key(name, key):
    assert layout.host_key(name) == key


def out_row(pid: int, ts: dt.datetime, value: float) -> dict:
    row = {c.name: None for c in OUTSTANDING.columns}
    row.update(ts=ts, interval_s=10.0, pid=pid, comm="svc", source="malloc", stack_id=7, outstanding_bytes=value)
    del row["recording_id"]
    return row


def write_old_layout(root: Path, day: dt.date, rec: str, values: list[float]) -> list[Path]:
    """Files as a schema-5 recorder wrote them: no host= level, `host` a dictionary column."""
    schema = OUTSTANDING.schema.insert(2, pa.field("host", STR)).with_metadata(
        {b"allocsampler.schema_version": b"5", b"allocsampler.table": b"outstanding"})
    part = root / "outstanding" / f"date={day}"
    part.mkdir(parents=True, exist_ok=True)
    out = []
    for i, v in enumerate(values):
        ts = dt.datetime.combine(day, dt.time(1), UTC) + dt.timedelta(seconds=10 * i)
        rows = [{**out_row(1, ts, v), "recording_id": rec, "host": "old-host"}]
        path = part / f"{rec}-{i + 1:06d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        os.utime(path, (ts.timestamp(), ts.timestamp()))
        out.append(path)
    return out


def test_both_layouts_are_read_compacted_and_retained(tmp_path):
    """A host upgraded in place: its schema-5 partitions beside the new ones. Readers see both
    with the right host, compaction merges each layout's partitions (work areas of both named
    apart), retention deletes old days in both."""
    old_day, new_day = T0.date(), (T0 + dt.timedelta(days=3)).date()
    write_old_layout(tmp_path, old_day, "20240301T000000Z-7", [1.0, 2.0, 3.0])
    w = DatasetWriter(tmp_path, "20240304T000000Z-8-abcdef", host="new host")
    for i, v in enumerate([10.0, 20.0, 30.0]):
        ts = dt.datetime.combine(new_day, dt.time(1), UTC) + dt.timedelta(seconds=10 * i)
        p = w.write(OUTSTANDING, [out_row(2, ts, v)], day=new_day)
        os.utime(p, (ts.timestamp(), ts.timestamp()))
    assert (tmp_path / "outstanding" / "host=new_host" / f"date={new_day}").is_dir()
    assert "host" not in pq.read_schema(p).names           # a partition column, not a file column

    parts = layout.partitions(tmp_path)
    assert {(p.host, p.day) for p in parts} == {(None, old_day), ("new_host", new_day)}
    df = read_table(tmp_path, "outstanding")
    assert sorted(zip(df["host"].astype(str), df["outstanding_bytes"], strict=True)) == [
        ("new_host", 10.0), ("new_host", 20.0), ("new_host", 30.0),
        ("old-host", 1.0), ("old-host", 2.0), ("old-host", 3.0)]
    assert read_table(tmp_path, "targets").columns.tolist()[-1] == "host"     # empty, with the column

    rep = R.compact(tmp_path, older_than_s=0, now=T0 + dt.timedelta(days=4))
    assert sorted(Path(m).name for m, _ in rep.merged) == [
        "20240301T000000Z-7-000001_000003.parquet", "20240304T000000Z-8-abcdef-000001_000003.parquet"]
    assert not rep.skipped and not list((tmp_path / R.STAGING).iterdir())
    assert sorted(read_table(tmp_path, "outstanding")["outstanding_bytes"]) == [1, 2, 3, 10, 20, 30]

    rep = R.enforce(tmp_path, None, 2, now=T0 + dt.timedelta(days=4))
    assert rep.deleted == [f"outstanding/date={old_day}/20240301T000000Z-7-000001_000003.parquet"]
    assert not (tmp_path / "outstanding" / f"date={old_day}").exists()
    rep = R.enforce(tmp_path, None, 0.5, now=T0 + dt.timedelta(days=6))
    assert len(rep.deleted) == 1 and not (tmp_path / "outstanding" / "host=new_host").exists()


def test_sealing_compaction_closes_every_old_file_once(tmp_path):
    """seal=True (the daemon with [upload]): every file older than the threshold ends in a merged
    file, alone if need be, and merged files are never merged again: the set of merged files only
    grows, so each can be uploaded once."""
    w = DatasetWriter(tmp_path, "R-1-aaaaaa", host="h")
    step = dt.timedelta(seconds=10)
    paths = []
    for i in range(5):
        p = w.write(OUTSTANDING, [out_row(1, T0 + i * step, float(i))], day=T0.date())
        os.utime(p, ((T0 + i * step).timestamp(),) * 2)
        paths.append(p)
    now = T0 + 5 * step
    # files 1-2 are old enough: merged; 3-5 not yet
    rep = R.compact(tmp_path, older_than_s=25, now=now, seal=True)
    assert [Path(m).name for m, _ in rep.merged] == ["R-1-aaaaaa-000001_000003.parquet"]
    first = {f.path.name: f.mtime_ns for f in R.dataset_files(tmp_path) if f.merged}
    # later: the merged file stays as it is; a lone old file is sealed on its own (a link: same inode)
    ino = paths[3].stat().st_ino
    rep = R.compact(tmp_path, older_than_s=15, now=now, seal=True)
    assert [Path(m).name for m, _ in rep.merged] == ["R-1-aaaaaa-000004_000004.parquet"]
    sealed = paths[3].with_name("R-1-aaaaaa-000004_000004.parquet")
    assert sealed.stat().st_ino == ino and not paths[3].exists()
    rep = R.compact(tmp_path, older_than_s=0, now=now, seal=True)
    assert [Path(m).name for m, _ in rep.merged] == ["R-1-aaaaaa-000005_000005.parquet"]
    files = R.dataset_files(tmp_path)
    assert all(f.merged for f in files)
    assert {n: m for n, m in ((f.path.name, f.mtime_ns) for f in files) if n in first} == first
    assert R.compact(tmp_path, older_than_s=0, now=now, seal=True).merged == []
    assert sorted(read_table(tmp_path, "outstanding")["outstanding_bytes"]) == [0, 1, 2, 3, 4]
    # without seal, the same merged files would be merged again
    assert len(R.compact(tmp_path, older_than_s=0, now=now).merged) == 1


# -- executable identity --------------------------------------------------------------------------

def dpkg_version(pkg: str) -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True,
                          check=True).stdout


def dpkg_owner(path: str) -> str:
    """dpkg's own answer; /usr-merged files may be listed under /bin."""
    for p in (path, path.removeprefix("/usr")):
        r = subprocess.run(["dpkg-query", "-S", p], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.split(":", 1)[0]
    raise AssertionError(f"dpkg does not know {path}")


def readelf_build_id(path: str) -> str:
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
    return next(line.split()[-1] for line in out.splitlines() if "Build ID" in line)


def test_exe_identity_of_packaged_copied_and_bind_mounted_executables(tmp_path):
    """A packaged executable gets dpkg's package and version; the same bytes copied elsewhere, or
    bind-mounted over the packaged path in another mount namespace (as in a container), get the
    build-id and no package: the host's database does not describe them."""
    sleep = shutil.which("sleep")
    real = os.path.realpath(sleep)
    copy = tmp_path / "sleep"
    shutil.copy(real, copy)
    procs = [subprocess.Popen([real, "30"]), subprocess.Popen([str(copy), "30"]),
             subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               f"mount --bind {copy} {real} && exec {real} 30"])]
    try:
        ids = ExeIdentities()
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{procs[2].pid}/exe") != real and time.monotonic() < deadline:
            time.sleep(0.05)
        got = [ids.of(p.pid, os.readlink(f"/proc/{p.pid}/exe")) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    bid = readelf_build_id(real)
    pkg = dpkg_owner(real)
    assert (got[0].build_id, got[0].package, got[0].version) == (bid, pkg, dpkg_version(pkg))
    assert (got[1].build_id, got[1].package, got[1].version) == (bid, None, None)
    assert (got[2].build_id, got[2].package) == (bid, None)
    t0 = time.perf_counter()
    again = ids.of(os.getpid(), os.readlink("/proc/self/exe"))
    print(f"\n[exe identity] first lookup of a new executable {1e3 * (time.perf_counter() - t0):.0f} ms: {again}")


def test_dpkg_database_usrmerge_and_missing(tmp_path):
    db = DpkgDatabase(str(tmp_path / "none"))
    assert db.owner("/usr/bin/sleep") is None
    info = tmp_path / "dpkg" / "info"
    info.mkdir(parents=True)
    (info / "tool:amd64.list").write_text("/.\n/bin\n/bin/tool\n")
    (tmp_path / "dpkg" / "status").write_text(
        "Package: tool\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1.2-3\n\n"
        "Package: gone\nStatus: deinstall ok config-files\nVersion: 9\n")
    db = DpkgDatabase(str(tmp_path / "dpkg"))
    assert db.owner("/usr/bin/tool") == ("tool", "1.2-3")       # listed as /bin/tool (usrmerge)
    assert db.owner("/usr/bin/other") is None
    assert db.version("gone") is None


# -- many hosts, one prefix -------------------------------------------------------------------------

WORK = "import time\nblocks = [bytearray(1 << 20) for _ in range(24)]\ntime.sleep(30)\n"


def record_as(host: str, out: Path, seconds: int = 4) -> subprocess.Popen:
    """`allocsampler record` of a Python workload in its own UTS namespace named `host`: a real
    recording of a host of that name."""
    become = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
    argv = allocsampler_cmd("record", "-o", str(out), "-q", "-i", "1", "--duration", str(seconds),
                            "--cpu-budget", "0", "--", sys.executable, "-c", WORK)
    return subprocess.Popen(["unshare", "--uts", sys.executable, "-c", become, host, *argv[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.bpf
def test_datasets_of_many_hosts_merge_by_plain_copy(tmp_path, bpf_ready):
    """Three real recordings: two of host `fleet-a` (a restart), one of `fleet b#2`, each in its
    own directory, copied into one with `cp -r`: no file is overwritten, and pyarrow, DuckDB,
    pandas and allocsampler read them as one dataset with `host` as a partition."""
    runs = [("fleet-a", tmp_path / "a1"), ("fleet-a", tmp_path / "a2"), ("fleet b#2", tmp_path / "b")]
    procs = [record_as(h, out) for h, out in runs]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    merged = tmp_path / "fleet"
    merged.mkdir()
    n_files = 0
    for _, out in runs:
        n_files += sum(1 for p in out.rglob("*.parquet"))
        subprocess.run(["cp", "-r", f"{out}/.", str(merged)], check=True)
    assert sum(1 for p in merged.rglob("*.parquet")) == n_files     # nothing overwritten

    per_run = {out.name: read_table(out, "outstanding") for _, out in runs}
    want = sorted((str(h), r) for df in per_run.values() for h, r in zip(df["host"], df["recording_id"], strict=True))
    arrow = ds.dataset(merged / "outstanding", format="parquet", partitioning="hive").to_table(
        columns=["host", "recording_id"]).to_pandas()
    duck = duckdb.sql(f"SELECT host, recording_id FROM read_parquet('{merged}/outstanding/**/*.parquet', "
                      "hive_partitioning = true)").df()
    pand = pd.read_parquet(merged / "outstanding", columns=["host", "recording_id"])
    ours = read_table(merged, "outstanding")
    for df in (arrow, duck, pand, ours):
        assert sorted(zip(df["host"].astype(str), df["recording_id"].astype(str), strict=True)) == want
    assert set(ours["host"].astype(str)) == {"fleet-a", "fleet_b_2"}
    recs = read_table(merged, "recordings")
    assert len(recs) == 3 and recs["recording_id"].is_unique
    assert all(len(str(r).split("-")) == 3 for r in recs["recording_id"])   # time-pid-random
    # the workload's identity: the interpreter and its package, as dpkg knows them
    t = read_table(merged, "targets")
    t = t[t["event"].isin(["attach", "exec"]) & t["exe"].eq(os.path.realpath(sys.executable))]
    # each command's exec, and its attach once the sampler was placed into its image
    assert sorted(t["event"].astype(str)) == ["attach"] * 3 + ["exec"] * 3, read_table(merged, "targets")[
        ["host", "event", "exe"]]
    real = os.path.realpath(sys.executable)
    pkg = dpkg_owner(real)
    assert set(t["exe_build_id"]) == {readelf_build_id(real)}
    assert set(t["exe_package"].astype(str)) == {pkg} and set(t["exe_version"].astype(str)) == {dpkg_version(pkg)}
    assert TARGETS.schema.field("exe_build_id").type == pa.string()
