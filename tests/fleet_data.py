"""Multi-host datasets for the fleet tests, made of real recordings: each copy of a recording's
files becomes another host's data on another day (host and recording_id rewritten, every
timestamp shifted by whole days), written in the schema-6 layout (<table>/host=<h>/date=<d>/)
or the older one (<table>/date=<d>/)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analysis.source import partition_dir
from sampler.dataset.schema import TABLES


def copy_recording(src: Path, root: Path, host: str, days: int = 0, *, old_layout: bool = False) -> list[Path]:
    """Write the dataset at `src` into `root` as host `host`'s, `days` later. Returns the files."""
    written = []
    shift = pa.scalar(dt.timedelta(days=days), pa.duration("us"))
    for table_dir in sorted(p for p in src.iterdir() if p.name in TABLES):
        for f in sorted(table_dir.glob("date=*/*.parquet")):
            t = pq.read_table(f, partitioning=None)
            old_id = str(t.column("recording_id")[0]) if "recording_id" in t.column_names and len(t) else ""
            new_id = f"{old_id}-{host}-{days}"
            for i, field in enumerate(t.schema):
                col = t.column(i)
                if field.name == "host":
                    col = pa.array([host] * len(t), pa.string()).dictionary_encode().cast(field.type)
                elif field.name == "recording_id":
                    col = pa.array([new_id] * len(t), pa.string()).dictionary_encode().cast(field.type)
                elif pa.types.is_timestamp(field.type) and days:
                    col = pc.add(col, shift).cast(field.type)
                t = t.set_column(i, field, col)
            day = dt.date.fromisoformat(f.parent.name.split("=", 1)[1]) + dt.timedelta(days=days)
            table = table_dir.name
            part = f"{table}/date={day.isoformat()}" if old_layout else partition_dir(table, host, day)
            out = root / part / f.name.replace(old_id, new_id) if old_id else root / part / f"{new_id}-{f.name}"
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, out, compression="zstd")
            written.append(out)
    return written


def recording_day(src: Path) -> dt.date:
    """The (first) day directory of a recording's outstanding table."""
    return min(dt.date.fromisoformat(p.name.split("=", 1)[1]) for p in (src / "outstanding").glob("date=*"))
