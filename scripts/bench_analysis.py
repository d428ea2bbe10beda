#!/usr/bin/env python3
"""Time and memory of `analyze` on a synthetic dataset: 50 processes x 24 h at 10 s intervals.

    .venv/bin/python scripts/bench_analysis.py [--processes 50] [--hours 24] [--stacks 10] [--quick]

Each process gets `stacks` stacks: a slow leak, a bounded cache, churn and steady pools, written
through the recorder's own DatasetWriter (one file per table per simulated hour), then
`analysis.analyze.run(load(DIR))` runs in a fresh child process whose wall time and peak RSS are
reported.

Every column is converted to its Arrow type in sampler/dataset/schema.py, so a schema change
breaks this bench loudly (or not at all), and tests/test_benchmarks.py runs its --quick mode
(2 processes x 2 h x 4 stacks: every kind of stack, two files per table; seconds).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sampler.dataset.schema import FRAMES, OUTSTANDING, PROCESSES, STACKS, Table  # noqa: E402
from sampler.dataset.writer import DatasetWriter  # noqa: E402

T = 512 << 10
MiB = 1 << 20
FULL = {"processes": 50, "hours": 24.0, "stacks": 10}
QUICK = {"processes": 2, "hours": 2.0, "stacks": 4}      # stacks 0-3: leak, cache, churn, steady
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


def series(rng, kind: int, n: int, interval: float) -> tuple[np.ndarray, np.ndarray]:
    """Live sample counts and churn per snapshot for one stack."""
    t = np.arange(1, n + 1) * interval
    if kind == 0:                                     # leak: 50 KiB/s
        births = rng.poisson(50 * 1024 * interval / T, n)
        return np.cumsum(births), births
    if kind == 1:                                     # bounded cache of ~200 samples
        births = rng.poisson(2.0, n)
        live = np.minimum(np.cumsum(births), 200 + rng.integers(-10, 10, n))
        return live, births * 2
    if kind == 2:                                     # churn
        births = rng.poisson(30, n)
        return rng.poisson(1, n), births * 2
    return np.full(n, 40 + kind) + 0 * t, np.zeros(n, int)   # steady pools


def arrow(table: Table, df: pd.DataFrame) -> pa.Table:
    """A DataFrame as an Arrow table of the schema: each column converted to the schema's Arrow
    type, not to one guessed from the data (a float64 guess for an all-null column stopped this
    bench when `processes.tier` became a dictionary); absent columns are nulls of that type. A
    column the schema lacks is an error, so a renamed column cannot silently become a null one."""
    if unknown := sorted(set(df.columns) - {c.name for c in table.columns}):
        raise ValueError(f"table {table.name} has no columns {unknown} (sampler/dataset/schema.py)")
    return pa.Table.from_arrays([pa.array(df[c.name], type=c.type) if c.name in df else pa.nulls(len(df), c.type)
                                 for c in table.columns], schema=table.schema)


def write(out: Path, processes: int, hours: float, stacks: int, interval: float) -> int:
    rng = np.random.default_rng(0)
    n = int(hours * 3600 / interval)
    t0 = pd.Timestamp("2026-11-01T00:00:00Z")
    ts = t0 + pd.to_timedelta(np.arange(1, n + 1) * interval, unit="s")
    w = DatasetWriter(out, "bench", host="h")
    frames, stack_rows = [], []
    per_file = int(3600 / interval)
    rows = 0
    for pid in range(1000, 1000 + processes):
        sids = [pid * 100 + k for k in range(stacks)]
        data = {sid: series(rng, k % 4 if k < 4 else 3 + k, n, interval) for k, sid in enumerate(sids)}
        for sid in sids:
            frames.append({"ts": t0, "recording_id": "bench", "stack_id": sid, "depth": 0,
                           "function": f"site_{sid}", "module": "libapp.so", "kind": "native"})
            stack_rows.append({"ts": t0, "recording_id": "bench", "stack_id": sid, "n_frames": 1})
        for lo in range(0, n, per_file):
            hi = min(n, lo + per_file)
            k = hi - lo
            parts = []
            for sid, (live, churn) in data.items():
                parts.append(pd.DataFrame({
                    "ts": ts[lo:hi], "recording_id": "bench", "interval_s": interval, "pid": pid,
                    "comm": f"svc{pid % 7}", "source": "malloc", "stack_id": sid,
                    "outstanding_bytes": live[lo:hi] * float(T),
                    "outstanding_stderr_bytes": np.sqrt(live[lo:hi]) * float(T),
                    "live_samples": live[lo:hi], "alloc_samples": churn[lo:hi], "free_samples": np.zeros(k)}))
            df = pd.concat(parts)
            rows += len(df)
            w.write(OUTSTANDING, arrow(OUTSTANDING, df), day=ts[lo].date())
            w.write(PROCESSES, arrow(PROCESSES, pd.DataFrame({
                "ts": ts[lo:hi], "recording_id": "bench", "pid": pid, "comm": f"svc{pid % 7}",
                "rss": 800 * MiB + np.arange(lo, hi) * 50 * 1024 * interval,
                "memory_limit": 16 << 30})), day=ts[lo].date())
    w.write(FRAMES, arrow(FRAMES, pd.DataFrame(frames)))
    w.write(STACKS, arrow(STACKS, pd.DataFrame(stack_rows)))
    return rows


CHILD = """
import sys, time, resource
sys.path.insert(0, {root!r})
t = time.perf_counter()
from analysis import analyze
ds = analyze.load({out!r})
findings = analyze.run(ds)
dt = time.perf_counter() - t
kinds = {{}}
for f in findings:
    kinds[f.kind] = kinds.get(f.kind, 0) + 1
print(dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, kinds)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, help=f"default {FULL['processes']}, --quick {QUICK['processes']}")
    ap.add_argument("--hours", type=float, help=f"default {FULL['hours']:g}, --quick {QUICK['hours']:g}")
    ap.add_argument("--stacks", type=int, help=f"default {FULL['stacks']}, --quick {QUICK['stacks']}")
    ap.add_argument("--interval", type=float, default=10)
    ap.add_argument("--quick", action="store_true", help="smallest sizes that still exercise every step")
    args = ap.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():      # explicit sizes win over either preset
        if getattr(args, k) is None:
            setattr(args, k, v)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ds"
        t = time.perf_counter()
        rows = write(out, args.processes, args.hours, args.stacks, args.interval)
        print(f"wrote {rows:,} outstanding rows in {time.perf_counter() - t:.0f} s")
        res = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), out=str(out))],
                             capture_output=True, text=True, check=True).stdout.split(maxsplit=2)
        print(f"analyze: {float(res[0]):.1f} s, peak RSS {int(res[1]) / MiB:.0f} MiB, findings {res[2].strip()}")
        if args.quick:
            print(QUICK_NOTE)


if __name__ == "__main__":
    main()
