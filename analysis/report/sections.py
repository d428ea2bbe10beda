"""The chart sections of one process in the HTML report: top stacks over time, memory by kind,
glibc heap/arena resident vs live, the allocators' pages in use vs pinned, flame graphs (the GPU
ones: analysis/report/gpu.py).

Each function gives the numbers and text of a section; templates/process.html.j2 lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from markupsafe import Markup

from analysis.frames import Stacks, frame_text, trim_frames
from analysis.report import flamegraph
from analysis.report.charts import Series, chart, seconds, thin
from analysis.units import fmt_utc
from sampler.units import fmt_bytes

TOP_STACKS = 8
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
# memory parts of the breakdown chart, bottom first; absent columns are left out
MEMORY_PARTS = (("heap_rss", "heap (brk)", "#4e79a7"), ("arena_rss", "glibc arenas", "#f28e2b"),
                ("anon_rss", "other anonymous", "#76b7b2"), ("file_rss", "file-backed", "#bab0ac"),
                ("stack_rss", "thread stacks", "#b07aa1"))       # GPU memory: its own chart (analysis/report/gpu.py)


@dataclass(frozen=True)
class Key:
    """A legend entry under a chart: a colour swatch (or the dashed line of a total) and its text."""

    text: str
    color: str | None = None
    dash: bool = False


@dataclass(frozen=True)
class Chart:
    """A titled chart and its legend; without a chart, `empty` says why."""

    title: str
    empty: str = ""
    svg: Markup | None = None
    keys: tuple[Key, ...] = ()


@dataclass(frozen=True)
class StackRow:
    """A stack in the legend of the top-stacks chart."""

    color: str
    source: str
    at_end: str                # bytes ± 2 standard errors
    change: str                # signed, over the window
    short: str                 # a few interesting frames
    full: str                  # all frames (the tooltip)


@dataclass(frozen=True)
class TopStacks:
    title: str
    svg: Markup | None = None  # None: no sampled allocations
    rows: tuple[StackRow, ...] = ()


@dataclass(frozen=True)
class FlameGraph:
    what: str                  # outstanding | growth
    source: str
    note: str                  # the time or span it shows
    total: str
    svg: Markup


def stack_label(stacks: Stacks, sid: int) -> tuple[str, str]:
    """(short label, full summary) of a stack for legends."""
    frames = stacks.get(int(sid))
    if not frames:
        return "[no stack]", f"stack {sid}"
    shown, _ = trim_frames(frames, keep=3)
    return " < ".join(shown), " < ".join(frame_text(f) for f in frames)


def top_stacks(o: pd.DataFrame, times: np.ndarray, stacks: Stacks,
               title: str = "Top stacks: outstanding bytes") -> TopStacks:
    need = {"ts", "source", "stack_id", "outstanding_bytes"}
    if o.empty or not need <= set(o.columns):
        return TopStacks(title)
    times = times[thin(len(times))]             # the chart shows no more: pivot no more
    o = o.assign(t=seconds(o["ts"]))
    o = o[np.isin(o["t"].to_numpy(), times)].assign(source=lambda d: d["source"].astype(str))
    if "outstanding_stderr_bytes" not in o:
        o = o.assign(outstanding_stderr_bytes=0.0)
    # a stack without a row in a snapshot had nothing live: zero
    final = o[o["t"] == times[-1]].groupby(["source", "stack_id"])["outstanding_bytes"].sum()
    peak = o.groupby(["source", "stack_id"])["outstanding_bytes"].max()
    rank = pd.DataFrame({"peak": peak, "final": final.reindex(peak.index).fillna(0)})
    rank = rank[rank["peak"] > 0].sort_values(["final", "peak"], ascending=False).head(TOP_STACKS)
    if rank.empty:
        return TopStacks(title)
    keys = list(rank.index)
    sub = o[pd.MultiIndex.from_frame(o[["source", "stack_id"]]).isin(keys)]
    sub = sub.assign(var=sub["outstanding_stderr_bytes"].fillna(0) ** 2)
    g = sub.groupby(["t", "source", "stack_id"])[["outstanding_bytes", "var"]].sum().unstack(["source", "stack_id"])
    val = g["outstanding_bytes"].reindex(index=times, columns=keys).fillna(0)
    err = np.sqrt(g["var"].reindex(index=times, columns=keys).fillna(0))
    series, rows = [], []
    for i, key in enumerate(keys):
        color = PALETTE[i % len(PALETTE)]
        short, full = stack_label(stacks, key[1])
        y, e = val[key].to_numpy(), err[key].to_numpy()
        series.append(Series(f"{key[0]}: {short}", color, y, np.maximum(y - 2 * e, 0), y + 2 * e))
        rows.append(StackRow(color, key[0], f"{fmt_bytes(y[-1])} ± {fmt_bytes(2 * e[-1])}", _signed(y[-1] - y[0]),
                             short, full))
    return TopStacks(title, chart(times, series, label="top stacks by outstanding bytes"), tuple(rows))


def _signed(v: float) -> str:
    return ("+" if v >= 0 else "−") + fmt_bytes(abs(v))


def memory_breakdown(p: pd.DataFrame) -> Chart:
    head = Chart("Memory by kind", "No process measurements.")
    parts = [(c, label, color) for c, label, color in MEMORY_PARTS if c in p and p[c].notna().any()]
    if p.empty or not parts or "ts" not in p:
        return head
    t = seconds(p["ts"])
    series = [Series(label, color, p[c].fillna(0).to_numpy(dtype=float)) for c, label, color in parts]
    total = Series("RSS", "#222", p["rss"].to_numpy(dtype=float)) if "rss" in p else None
    keys = [Key(f"{s.label} {fmt_bytes(s.y[-1])}", s.color) for s in reversed(series)]
    if total is not None:
        keys.insert(0, Key(f"RSS {fmt_bytes(total.y[-1])}", dash=True))
    svg = chart(t, series, width=570, stacked=True, total=total, label="memory by kind")
    return Chart(head.title, svg=svg, keys=tuple(keys))


def arena_chart(p: pd.DataFrame) -> Chart:
    head = Chart("glibc heap + arenas: resident vs live", "No heap measurements.")
    if p.empty or not {"ts", "heap_rss", "arena_rss"} <= set(p.columns):
        return head
    t = seconds(p["ts"])
    resident = (p["heap_rss"].fillna(0) + p["arena_rss"].fillna(0)).to_numpy(dtype=float)
    series = [Series("resident (heap + arenas)", "#f28e2b", resident, fill=True)]
    keys = [Key(f"resident {fmt_bytes(resident[-1])}", "#f28e2b")]
    if {"heap_live_bytes", "arena_live_bytes"} <= set(p.columns):
        live = (p["heap_live_bytes"].fillna(0) + p["arena_live_bytes"].fillna(0)).to_numpy(dtype=float)
        err = p["heap_arena_live_stderr_bytes"].fillna(0).to_numpy(dtype=float) \
            if "heap_arena_live_stderr_bytes" in p else np.zeros(len(live))
        series.append(Series("estimated live", "#4e79a7", live, np.maximum(live - 2 * err, 0), live + 2 * err))
        keys += [Key(f"estimated live {fmt_bytes(live[-1])}", "#4e79a7"),
                 Key(f"gap {fmt_bytes(max(resident[-1] - live[-1], 0))}")]
    return Chart(head.title, svg=chart(t, series, width=570, label="arena resident vs live"), keys=tuple(keys))


# the allocators whose layout the recorder reads (table malloc_arenas), and how their rows are named
LAYOUTS = (("glibc", "glibc heap pages"), ("pymalloc", "CPython object arenas (pymalloc)"))


def layout_charts(a: pd.DataFrame) -> list[Chart]:
    """Per allocator whose layout was read (malloc_arenas rows with free bytes): its resident
    bytes split into in use, pinned (free bytes on pages that also hold live ones) and other free
    resident bytes (whole free pages: what a trim or an empty arena returns), at each read."""
    if a.empty or not {"ts", "rss", "free_resident_bytes", "pinned_bytes"} <= set(a.columns):
        return []
    a = a.assign(allocator=a["allocator"].fillna("glibc").astype(str) if "allocator" in a else "glibc")
    out = []
    for name, title in LAYOUTS:
        rows = a[a["allocator"] == name]
        # a read counts when every arena of it was read (its free bytes and pinned pages known)
        g = rows.assign(ok=rows["free_resident_bytes"].notna() & rows["pinned_bytes"].notna()).groupby("ts")
        per = g.agg(ok=("ok", "all"), rss=("rss", "sum"), free=("free_resident_bytes", "sum"),
                    pinned=("pinned_bytes", "sum"))
        per = per[per["ok"]]
        if per.empty:
            continue
        t = seconds(per.index.to_series())
        rss, free = per["rss"].to_numpy(float), per["free"].to_numpy(float)
        pinned = np.minimum(per["pinned"].to_numpy(float), free)
        series = [Series("in use", "#4e79a7", np.maximum(rss - free, 0)), Series("pinned", "#e15759", pinned),
                  Series("other free resident", "#bab0ac", free - pinned)]
        keys = [Key(f"resident {fmt_bytes(rss[-1])}", dash=True),
                *(Key(f"{s.label} {fmt_bytes(s.y[-1])}", s.color) for s in reversed(series))]
        svg = chart(t, series, width=570, stacked=True, total=Series("resident", "#222", rss),
                    label=f"{title}: in use, pinned, free")
        out.append(Chart(f"{title}: in use vs pinned ({len(per)} reads)", svg=svg, keys=tuple(keys)))
    return out


def flame_graphs(o: pd.DataFrame, times: np.ndarray, stacks: Stacks) -> list[FlameGraph]:
    """Per source: the bytes outstanding at the end of the window, and the growth over it."""
    if o.empty or not {"ts", "source", "stack_id", "outstanding_bytes"} <= set(o.columns):
        return []
    o = o.assign(t=seconds(o["ts"]), source=o["source"].astype(str))
    first, last = times[0], times[-1]
    end = o[o["t"] == last].groupby(["source", "stack_id"])["outstanding_bytes"].sum()
    start = o[o["t"] == first].groupby(["source", "stack_id"])["outstanding_bytes"].sum()
    growth = end.sub(start, fill_value=0).clip(lower=0)
    t_last, t_first = fmt_utc(pd.Timestamp(last, unit="s")), fmt_utc(pd.Timestamp(first, unit="s"))
    out = []
    for what, values, note in (("outstanding", end, f"at the end of the window ({t_last})"),
                               ("growth", growth, f"from {t_first} to {t_last}, stacks that grew")):
        for source in sorted(values.index.get_level_values(0).unique()) if len(values) else []:
            v = values.loc[source]
            if v.sum() <= 0:
                continue
            root = flamegraph.tree_from_values(v, stacks, f"all {source}")
            out.append(FlameGraph(what, source, note, fmt_bytes(root.value),
                                  flamegraph.render_svg(root, growth=what == "growth", what=what)))
    return out
