"""Loading an allocsampler dataset (the directory given to `record --out`) into pandas."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds

from sampler.schema import TABLES


def read_table(root: str | Path, name: str, *, filter=None, columns: list[str] | None = None) -> pd.DataFrame:
    """One table as a DataFrame (empty, with the schema's columns, when nothing was written).

    `filter` is a pyarrow.dataset expression, e.g. `ds.field("pid") == 1234`."""
    table = TABLES[name]
    path = Path(root) / name
    if not path.is_dir() or not any(path.glob("date=*/*.parquet")):
        return table.schema.empty_table().to_pandas()
    dataset = ds.dataset(path, format="parquet", partitioning="hive")
    return dataset.to_table(filter=filter, columns=columns).to_pandas()


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
