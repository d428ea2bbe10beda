"""Top stacks by outstanding bytes: the `top` command and the recorder's closing summary."""

from __future__ import annotations

from pathlib import Path

from analysis.dataset import latest_outstanding, read_table
from sampler.text import printable
from sampler.units import fmt_bytes


def top_stacks(root: str | Path, pids: list[int] | None = None, n: int = 10):
    df = latest_outstanding(root, pids)
    if df.empty:
        return df
    df = df[df["outstanding_bytes"] > 0].sort_values("outstanding_bytes", ascending=False)
    return df.groupby(["recording_id", "pid"], observed=True, sort=False).head(n)


def format_top(df, width: int = 160) -> list[str]:
    lines = []
    for (pid, comm), g in df.groupby(["pid", "comm"], observed=True, sort=False):
        lines.append(f"pid {pid} ({printable(comm)}): top stacks by outstanding bytes at {g['ts'].max():%H:%M:%S}")
        for i, r in enumerate(g.itertuples(), 1):
            est = f"{fmt_bytes(r.outstanding_bytes)} ± {fmt_bytes(r.outstanding_stderr_bytes)}"
            summary = printable(r.summary) if isinstance(r.summary, str) and r.summary else "[no stack]"
            text = f"{i:3d}. {est:>22}  {r.source:<6} {summary}"
            lines.append(text if len(text) <= width else text[: width - 3] + "...")
    return lines


def print_top(root: str | Path, pids: list[int] | None = None, n: int = 10) -> None:
    df = top_stacks(root, pids, n)
    if df.empty:
        print(f"no outstanding allocations recorded in {root}")
        return
    print("\n".join(format_top(df)))


def print_summary(root: str | Path, recording_id: str, finished) -> None:
    """What the recorder prints when it ends: where the data is, each target, top stacks."""
    procs = read_table(root, "processes")
    procs = procs[procs["recording_id"] == recording_id] if not procs.empty else procs
    print(f"\ndataset: {Path(root).resolve()}  (recording {recording_id})")
    for info, why in finished:
        pid = info.pid
        p = procs[procs["pid"] == pid] if not procs.empty else procs
        rss = f"peak RSS {fmt_bytes(p['rss'].max())}, last {fmt_bytes(p['rss'].iloc[-1])}" if len(p) else ""
        print(f"pid {pid} ({printable(info.comm)}): {printable(why)}; {rss}")
    df = top_stacks(root, None, 5)
    if not df.empty:
        df = df[df["recording_id"] == recording_id]
        print("\n".join(format_top(df)))
    print(f"\nmore: allocsampler top {root}   |   pandas.read_parquet('{root}/outstanding')")
