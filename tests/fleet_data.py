"""Multi-host datasets for the fleet tests, made of real recordings: each copy of a recording's
files becomes another host's data on another day (recording_id rewritten, every timestamp
shifted by whole days), written in the schema-6 layout (<table>/host=<h>/date=<d>/, the host in
the path only) or the older one (<table>/date=<d>/, the host in a `host` column of the rows)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sampler.dataset.layout import host_key, parse_day, partition_dir
from sampler.dataset.schema import HOST, TABLES


def data_files(table_dir: Path) -> list[Path]:
    """A table's files in either layout."""
    return sorted([*table_dir.glob("host=*/date=*/*.parquet"), *table_dir.glob("date=*/*.parquet")])


def copy_recording(src: Path, root: Path, host: str, days: int = 0, *, old_layout: bool = False) -> list[Path]:
    """Write the dataset at `src` into `root` as host `host`'s, `days` later. Returns the files."""
    written = []
    shift = pa.scalar(dt.timedelta(days=days), pa.duration("us"))
    for table_dir in sorted(p for p in src.iterdir() if p.name in TABLES):
        for f in data_files(table_dir):
            t = pq.read_table(f, partitioning=None)
            if "host" in t.column_names:
                t = t.drop_columns(["host"])
            old_id = str(t.column("recording_id")[0]) if "recording_id" in t.column_names and len(t) else ""
            new_id = f"{old_id}-{host_key(host)}-{days}"
            for i, field in enumerate(t.schema):
                col = t.column(i)
                if field.name == "recording_id":
                    col = pa.array([new_id] * len(t), pa.string()).dictionary_encode().cast(field.type)
                elif pa.types.is_timestamp(field.type) and days:
                    col = pc.add(col, shift).cast(field.type)
                t = t.set_column(i, field, col)
            day = parse_day(f.parent.name) + dt.timedelta(days=days)
            if old_layout:      # schema 5: the host in the rows, no host= directory
                t = t.append_column(pa.field(HOST.name, HOST.type),
                                    pa.array([host] * len(t), pa.string()).dictionary_encode().cast(HOST.type))
                part = root / table_dir.name / f"date={day.isoformat()}"
            else:
                part = partition_dir(root, table_dir.name, host, day)
            out = part / f.name.replace(old_id, new_id) if old_id else part / f"{new_id}-{f.name}"
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, out, compression="zstd")
            written.append(out)
    return written


def recording_day(src: Path) -> dt.date:
    """The (first) day directory of a recording's outstanding table."""
    return min(parse_day(f.parent.name) for f in data_files(src / "outstanding"))


def fleet_plan(a: Path, b: Path, c: Path) -> dict[str, tuple[Path, list[int], bool]]:
    """host -> (recording, day offsets, old layout). `db 1` (a space: its host= name is `db_1`)
    is in the older layout, as a host not yet upgraded would have uploaded it."""
    return {"web-1": (a, [0, 1, 2], False), "web-2": (b, [0, 1], False), "db 1": (b, [1], True),
            "batch-7": (c, [0, 1], False)}


def synthetic_recording(out: Path) -> Path:
    """scripts/bench_analysis.py's --quick dataset (2 processes x 2 h, a leak, a cache, churn and
    steady pools each): hours of data with findings, which the seconds-long recordings lack."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_analysis import QUICK, write
    write(out, QUICK["processes"], QUICK["hours"], QUICK["stacks"], 10)
    return out


def build_fleet(root: Path, plan: dict[str, tuple[Path, list[int], bool]], *, only_days: set[int] | None = None,
                hosts: set[str] | None = None, old_layout: bool | None = None) -> Path:
    """The fleet of `plan` under `root` (optionally only some days and hosts, or all in one layout)."""
    for host, (src, days, old) in plan.items():
        if hosts is None or host in hosts:
            for d in days:
                if only_days is None or d in only_days:
                    copy_recording(src, root, host, d, old_layout=old if old_layout is None else old_layout)
    return root


GARBAGE = b"not a parquet file: a reader that opens this fails"


def add_garbage(root: Path, day0: dt.date) -> list[Path]:
    """Unreadable files where a selection of hosts `web-*` and the day day0+1 must never look: a
    host `spam` (every table), web-1's day0+3 (every table: after the window's day and its write
    lag) and day0-1 (the time series: before the window)."""
    from analysis.source import CATALOGS

    made = []
    for table in TABLES:
        for host, offset in (("spam", 1), ("web-1", 3), ("web-1", -1)):
            if offset < 0 and table in CATALOGS:
                continue        # catalogs of earlier days are needed: stacks first seen then
            f = partition_dir(root, table, host, day0 + dt.timedelta(days=offset)) / "garbage.parquet"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(GARBAGE)
            made.append(f)
    return made


def window_args(day0: dt.date) -> list[str]:
    """The selection the pruning tests make: hosts web-*, the whole day day0+1."""
    day = day0 + dt.timedelta(days=1)
    return ["--host", "web-*", "--since", day.isoformat(), "--until", f"{day.isoformat()}T23:59:59.999999"]


# -- an S3-protocol server on localhost ------------------------------------------------------------

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
QUIET = {"AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}   # no instance-metadata probing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3 server as a subprocess on a free port; yields its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
