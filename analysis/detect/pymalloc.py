"""pymalloc bloat: CPython's small-object arenas kept resident by a few surviving objects.

pymalloc returns a 1 MiB arena only when every object in it is gone, and never a page of one that
is not: objects that outlive many short-lived ones allocated beside them keep whole arenas
resident (the recorder's `pymalloc` rows of `malloc_arenas`, sampler/proc/pymalloc.py, measure it
exactly from the pool headers). A finding needs

- pinned >= max(min_bloat, min_ratio x the arenas' resident bytes) in >= min_windows consecutive
  snapshots (the last such run), and
- in use flat over the run (a Theil-Sen rise of the exact in-use bytes above 10% of the pinned
  bytes is growth: persistent_growth's business).

It names the stacks whose sampled objects are charged the most of it (outstanding.pinned_bytes,
source python, at least twice their standard error). severity = 100 x pinned / memory_limit
(50 without a limit), times the confidence, which reaches 1 at twice min_windows snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.dataset as pds

from analysis.dataset import Dataset, read_table
from analysis.detect.arenas import PinningFinding, pinning_sites, pinning_text
from analysis.detect.stats import theil_sen
from analysis.findings import Finding
from sampler.units import fmt_bytes

PROCESS_COLUMNS = ("ts", "recording_id", "pid", "comm", "rss", "memory_limit")      # what it reads of `processes`


@dataclass
class PymallocBloat(PinningFinding):
    """`pymalloc_bloat`: CPython's object arenas keep much more resident than their objects use."""

    kind: str = field(default="pymalloc_bloat", init=False)

    def facts(self) -> list[str]:
        d = self.details
        return [f"arenas {d['arenas']}, resident {fmt_bytes(d['resident_bytes'])}, in use "
                f"{fmt_bytes(d['in_use_bytes'])}, pinned {fmt_bytes(d['pinned_bytes'])}"]


def detect_pymalloc_bloat(ds: Dataset, *, min_bloat: int = 128 << 20, min_ratio: float = 0.5,
                          min_windows: int = 2) -> list[Finding]:
    """pymalloc_bloat findings, one per process and recording at most."""
    if ds.processes.empty:
        return []
    rows = read_table(ds.root, "malloc_arenas", filter=(pds.field("allocator") == "pymalloc")
                      & pds.field("pid").isin(ds.processes["pid"].unique()))
    if rows.empty:
        return []
    rows["recording_id"] = rows["recording_id"].astype(str)
    limits = ds.processes.assign(recording_id=ds.processes["recording_id"].astype(str)) \
        .groupby(["recording_id", "pid"], observed=True)[["memory_limit", "comm"]].last()
    out = []
    for (rec, pid), p in rows.groupby(["recording_id", "pid"], observed=True):
        f = _detect(ds, p.sort_values("ts"), str(rec), int(pid), limits, min_bloat, min_ratio, min_windows)
        if f is not None:
            out.append(f)
    return out


def _detect(ds: Dataset, p: pd.DataFrame, rec: str, pid: int, limits: pd.DataFrame, min_bloat: int,
            min_ratio: float, min_windows: int) -> Finding | None:
    pinned = p["pinned_bytes"].to_numpy(float)
    resident = p["rss"].to_numpy(float)
    used = p["in_use_bytes"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        over = pinned >= np.maximum(min_bloat, min_ratio * resident)
    ends = np.flatnonzero(np.diff(np.concatenate(([0], over.astype(np.int8), [0]))))
    runs = [(a, b) for a, b in zip(ends[::2], ends[1::2], strict=True) if b - a >= min_windows]
    if not runs:
        return None
    first, stop = runs[-1]
    last = stop - 1
    t = (p["ts"] - p["ts"].iloc[0]).dt.total_seconds().to_numpy()
    rise = theil_sen(t[first:stop], used[first:stop]) * (t[last] - t[first]) if stop - first >= 2 else 0.0
    if rise > 0.1 * pinned[last]:
        return None                       # the objects grow: a leak, not bloat
    row = p.iloc[last]
    key = (rec, pid)
    limit = float(limits.loc[key, "memory_limit"]) if key in limits.index else 0.0
    comm = str(limits.loc[key, "comm"]) if key in limits.index else "?"
    limit = limit if limit > 0 else 0.0
    b, r, u = float(pinned[last]), float(resident[last]), float(used[last])
    n = stop - first
    confidence = 0.5 + 0.5 * min(1.0, n / (2 * min_windows))
    severity = (min(100.0, 100.0 * b / limit) if limit else 50.0) * confidence
    sites = pinning_sites(ds, rec, pid, row["ts"], source="python")
    recommendation = _recommend(b, sites)
    summary = (f"CPython's small-object arenas keep {fmt_bytes(b)} resident that no object uses ({b / r:.0%} of "
               f"{fmt_bytes(r)} in {int(row['heaps'])} arenas of 1 MiB; objects in use {fmt_bytes(u)}) in {n} "
               f"scan{'s' if n > 1 else ''}" + (f"; {pinning_text(sites[0])}" if sites else "")
               + f"; {recommendation.split(';')[0]}.")
    return PymallocBloat(pid, comm, severity, confidence, summary, {
        "resident_bytes": r, "in_use_bytes": u, "pinned_bytes": b, "arenas": int(row["heaps"]),
        "pinning_sites": sites, "windows": n, "first_seen": p["ts"].iloc[first], "last_seen": p["ts"].iloc[last],
        "memory_limit_bytes": limit or None, "recommendation": recommendation, "recording_id": rec,
        "evidence": f"pinned >= max({fmt_bytes(min_bloat)}, {min_ratio:.0%} of resident) in {n} consecutive "
                    f"snapshots; objects in use flat ({fmt_bytes(u - float(used[first]))} over the run); measured "
                    f"from the pool headers of every arena.",
    })


def _recommend(pinned: float, sites: list[dict]) -> str:
    text = []
    if sites:
        names = ", ".join(s["site"] for s in sites)
        text.append(f"create what {names} keep{'s' if len(sites) == 1 else ''} before the short-lived objects "
                    f"around them, or in a phase of its own (load long-lived data first, then serve), so "
                    f"that the arenas the short-lived objects empty can be given back")
    else:
        text.append("objects that outlive the short-lived ones allocated beside them keep whole arenas: "
                    "record with --python-objects to see which code creates them")
    text.append("or run under PYTHONMALLOC=malloc, which puts small objects in glibc's heap, where whole free "
                "pages can be returned (malloc_trim); measure the result, it costs some speed")
    return "; ".join(text)
