"""Loading an allocsampler dataset (the directory given to `record --out`) into pandas."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from sampler.dataset.schema import TABLES


def read_table(root: str | Path, name: str, *, filter=None, columns: list[str] | None = None) -> pd.DataFrame:
    """One table as a DataFrame (empty, with the schema's columns, when nothing was written).

    `filter` is a pyarrow.dataset expression, e.g. `ds.field("pid") == 1234`."""
    table = TABLES[name]
    path = Path(root) / name
    if not path.is_dir() or not any(path.glob("date=*/*.parquet")):
        empty = table.schema.empty_table().to_pandas()
        return empty[columns] if columns else empty
    dataset = ds.dataset(path, format="parquet", partitioning="hive")
    return dataset.to_table(filter=filter, columns=columns).to_pandas(self_destruct=True, split_blocks=True)


def latest_outstanding(root: str | Path, pids: list[int] | None = None) -> pd.DataFrame:
    """The last snapshot of each (recording, process), joined with stack summaries."""
    flt = ds.field("pid").isin(pids) if pids else None
    out = read_table(root, "outstanding", filter=flt)
    if out.empty:
        return out
    last = out.groupby(["recording_id", "pid"], observed=True)["ts"].transform("max")
    out = out[out["ts"] == last]
    stacks = read_table(root, "stacks", columns=["stack_id", "site", "summary", "n_frames"])
    stacks = stacks.drop_duplicates("stack_id")
    return out.merge(stacks, on="stack_id", how="left")


@dataclass
class Dataset:
    """The tables of one dataset directory, filtered, as DataFrames."""

    root: Path
    outstanding: pd.DataFrame
    processes: pd.DataFrame
    stacks: pd.DataFrame
    frames: pd.DataFrame
    vm_events: pd.DataFrame
    targets: pd.DataFrame
    recordings: pd.DataFrame
    sources: list[str] | None = None    # the source filter it was loaded with (None: all)

    def frames_of(self, stack_id: int) -> pd.DataFrame:
        return self.frames[self.frames["stack_id"] == stack_id].sort_values("depth")

    def snapshots_with_frames(self) -> pd.DataFrame:
        """Tidy long form: one row per snapshot row and frame of its stack."""
        f = self.frames.drop(columns=["ts", "recording_id", "host", "date"], errors="ignore")
        return self.outstanding.merge(f, on="stack_id", how="left")


def _time_filter(since: dt.datetime | None, until: dt.datetime | None):
    expr = None
    for bound, op in ((since, ">="), (until, "<=")):
        if bound is None:
            continue
        e = ds.field("ts") >= pa.scalar(bound, pa.timestamp("us", tz="UTC")) if op == ">=" else \
            ds.field("ts") <= pa.scalar(bound, pa.timestamp("us", tz="UTC"))
        expr = e if expr is None else expr & e
    return expr


# What the detectors and reports read of `outstanding` (the big table): the rest stays on disk.
OUTSTANDING_COLUMNS = ["ts", "recording_id", "pid", "comm", "source", "stack_id", "outstanding_bytes",
                       "outstanding_stderr_bytes", "live_samples", "alloc_samples", "free_samples"]


def load(root: str | Path, *, pids: list[int] | None = None, sources: list[str] | None = None,
         since: dt.datetime | None = None, until: dt.datetime | None = None,
         outstanding_columns: list[str] | None = OUTSTANDING_COLUMNS) -> Dataset:
    """Read a dataset, keeping only the given processes, sources and time window (and, of the
    outstanding table, the columns analysis uses; None reads all)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no dataset at {root}")
    when = _time_filter(since, until)
    by_pid = ds.field("pid").isin(pids) if pids else None

    def both(*exprs):
        exprs = [e for e in exprs if e is not None]
        if not exprs:
            return None
        out = exprs[0]
        for e in exprs[1:]:
            out = out & e
        return out

    src = ds.field("source").isin(sources) if sources else None
    outstanding = read_table(root, "outstanding", filter=both(when, by_pid, src), columns=outstanding_columns)
    stacks = read_table(root, "stacks").drop_duplicates("stack_id")
    frames = read_table(root, "frames").drop_duplicates(["stack_id", "depth"])
    return Dataset(
        root=root,
        outstanding=outstanding,
        processes=read_table(root, "processes", filter=both(when, by_pid)),
        stacks=stacks,
        frames=frames,
        vm_events=read_table(root, "vm_events", filter=both(when, by_pid)),
        targets=read_table(root, "targets", filter=by_pid),
        recordings=read_table(root, "recordings"),
        sources=sources,
    )
