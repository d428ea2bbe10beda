"""Top stacks by outstanding bytes (or by the free heap pages their live chunks pin): the `top`
command and the recorder's closing summary."""

from __future__ import annotations

from pathlib import Path

from analysis.dataset import latest_outstanding, read_table
from sampler.text import printable
from sampler.units import fmt_bytes


def top_stacks(root: str | Path, pids: list[int] | None = None, n: int = 10, pinned: bool = False):
    """Each process's last snapshot, its `n` largest stacks by outstanding bytes, or with `pinned`
    by pinned bytes (outstanding.pinned_bytes: free bytes of the heap pages their chunks pin) at
    the last snapshot that charged them."""
    df = latest_outstanding(root, pids, pinned)
    if df.empty:
        return df
    key = "pinned_bytes" if pinned else "outstanding_bytes"
    df = df[df[key] > 0].sort_values(key, ascending=False)
    return df.groupby(["recording_id", "pid"], observed=True, sort=False).head(n)


def format_top(df, width: int = 160, pinned: bool = False) -> list[str]:
    lines = []
    what = "pinned heap pages" if pinned else "outstanding bytes"
    for (pid, comm), g in df.groupby(["pid", "comm"], observed=True, sort=False):
        lines.append(f"pid {pid} ({printable(comm)}): top stacks by {what} at {g['ts'].max():%H:%M:%S}")
        for i, r in enumerate(g.itertuples(), 1):
            est = f"{fmt_bytes(r.outstanding_bytes)} ± {fmt_bytes(r.outstanding_stderr_bytes)}"
            if pinned:      # free bytes kept resident, then the live bytes that keep them
                est = f"{fmt_bytes(r.pinned_bytes)} ± {fmt_bytes(r.pinned_stderr_bytes)} on {est}"
            summary = printable(r.summary) if isinstance(r.summary, str) and r.summary else "[no stack]"
            text = f"{i:3d}. {est:>22}  {r.source:<6} {summary}"
            lines.append(text if len(text) <= width else text[: width - 3] + "...")
    return lines


def print_top(root: str | Path, pids: list[int] | None = None, n: int = 10, pinned: bool = False) -> None:
    df = top_stacks(root, pids, n, pinned)
    if df.empty:
        print(f"no pinned heap pages charged to a stack in {root} (glibc heaps whose free lists the recorder "
              f"read, with sampled live chunks on such pages)" if pinned
              else f"no outstanding allocations recorded in {root}")
        return
    if pinned:
        print("free bytes of resident glibc heap pages that each stack's live chunks keep from being "
              "returned (± standard error), on its live bytes")
    print("\n".join(format_top(df, pinned=pinned)))


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
