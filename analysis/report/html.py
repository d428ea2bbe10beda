"""The HTML report: one self-contained file (inline CSS, SVG and script; nothing is fetched).

Findings ranked by severity, then per process: top stacks over time, the memory breakdown,
glibc heap/arena resident vs live, and flame graphs of outstanding bytes and of growth.

Python prepares the numbers and text (here, sections.py, gpu.py); the markup is in
templates/*.html.j2, rendered by Jinja2 with autoescaping, so text is escaped wherever a template
puts it. The only Markup is the SVG of charts.py and flamegraph.py (they escape their own labels)
and the page's own CSS and script.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import html
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jinja2
import numpy as np
import pandas as pd
import pyarrow.dataset as pds
from markupsafe import Markup

from analysis.dataset import Dataset, read_table
from analysis.findings import Finding
from analysis.frames import Frame, Stacks, frame_text, naming_hint, stack_frames, trim_frames
from analysis.report import gpu, sections
from analysis.report.charts import seconds
from analysis.units import fmt_duration, fmt_utc
from sampler.dataset.sources import GPU_SOURCES
from sampler.units import fmt_bytes

DETAIL_LABELS = {"growth_bytes_per_hour": "growth", "outstanding_bytes": "outstanding",
                 "time_to_oom_hours": "time to OOM", "resident_bytes": "resident", "live_bytes": "live",
                 "bloat_bytes": "bloat", "trimmable_bytes": "trimmable", "first_seen": "first seen",
                 "last_seen": "last seen"}
FOLD_PROCESSES = 15              # a longer process list is folded: it would push the charts far down

Advice = str | list["Advice"]     # a recommendation: a sentence, or a list of them (nested lists nest)


@dataclass(frozen=True)
class Header:
    root: str
    when: str                    # the time window
    processes: int
    findings: str                # counts by kind


@dataclass(frozen=True)
class Recordings:
    heads: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class PidLink:
    """A process named in a table: a link to its section when it is charted."""

    pid: int
    text: str
    linked: bool


@dataclass(frozen=True)
class StackList:
    shown: tuple[str, ...]       # the interesting frames (analysis.frames.trim_frames)
    hidden: int                  # how many were left out of `shown`
    frames: tuple[str, ...]      # all of them
    note: str | None = None      # how to name its unnamed frames (analysis.frames.naming_hint)


@dataclass(frozen=True)
class FindingRow:
    level: str                   # high | mid | low (the severity's colour)
    severity: str
    confidence: str              # percent
    kind: str
    who: PidLink
    summary: str
    numbers: tuple[tuple[str, str], ...]    # (label, value) chips
    stack: StackList | None
    advice: Advice | None


@dataclass(frozen=True)
class ProcessRow:
    who: PidLink
    comm: str
    cmd: str
    rss: str
    limit: str
    findings: str


@dataclass(frozen=True)
class ProcessSection:
    pid: int
    comm: str
    cmd: str
    meta: str                    # RSS, arenas, findings, joined
    top: sections.TopStacks
    memory: sections.Chart
    arenas: sections.Chart
    layouts: list[sections.Chart]
    gpu: gpu.ProcessGpu | None
    flames: list[sections.FlameGraph]


def render_html(ds: Dataset, findings: list[Finding], *, title: str | None = None,
                max_processes: int = 20, interpreter_frames: bool = False) -> str:
    """The report as one HTML document. Processes are charted in order of their worst finding,
    then of peak RSS; at most `max_processes` of them. `interpreter_frames`: CPython's own
    frames between two Python frames shown in each finding's stack (every frame is under its
    "all frames" either way)."""
    title = title or f"allocsampler report: {ds.root.name or ds.root}"
    findings = sorted(findings, key=lambda f: -f.severity)
    pids = _process_order(ds, findings)
    stacks = stack_frames(ds.frames)
    charted = pids[:max_processes]
    tables = _ByPid(ds, charted)
    return _env().get_template("report.html.j2").render(
        title=title, style=_inline("report.css"), script=_inline("report.js"),
        header=_header(ds, findings, pids),
        findings=[_finding_row(f, set(charted), interpreter_frames) for f in findings],
        processes=[_process_row(tables, pid, set(charted), findings) for pid in pids],
        fold_processes=len(pids) > FOLD_PROCESSES,
        recordings=_recordings(ds), devices=gpu.devices_section(ds),
        sections=[_process_section(tables, pid, stacks, [f for f in findings if f.pid == pid]) for pid in charted],
        not_charted=len(pids) - len(charted))


@functools.cache
def _env() -> jinja2.Environment:
    # finalize escapes as the standard library does (&quot; and &#x27; for quotes, where Markupsafe
    # writes &#34; and &#39;): the same five characters escaped, and the report's text unchanged.
    # Templates therefore compose text in Python, not with `~`, `join` or `format`, which escape
    # the Markupsafe way.
    return jinja2.Environment(loader=jinja2.PackageLoader("analysis.report", "templates"), autoescape=True,
                              finalize=_escape, undefined=jinja2.StrictUndefined, trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True)


def _escape(v: Any) -> Any:
    return v if hasattr(v, "__html__") else Markup(html.escape(str(v)))


@dataclass(frozen=True)
class Inline:
    """The page's own style or script, inlined (the report fetches nothing), and the hash by
    which its Content-Security-Policy allows it and nothing else."""

    text: Markup
    sha256: str                  # base64, as CSP writes it


@functools.cache
def _inline(name: str) -> Inline:
    text = "\n" + resources.files("analysis.report").joinpath("templates", name).read_text()
    return Inline(Markup(text), base64.b64encode(hashlib.sha256(text.encode()).digest()).decode())


# --- header ------------------------------------------------------------------------------------

def _window(ds: Dataset) -> tuple[pd.Timestamp, pd.Timestamp] | None:
    ts = [df["ts"] for df in (ds.outstanding, ds.processes) if "ts" in df and len(df)]
    return (min(t.min() for t in ts), max(t.max() for t in ts)) if ts else None


def _header(ds: Dataset, findings: list[Finding], pids: list[int]) -> Header:
    win = _window(ds)
    when = "no data"
    if win is not None:
        end = fmt_utc(win[1], "%H:%M:%S" if fmt_utc(win[0], "%F") == fmt_utc(win[1], "%F") else "%Y-%m-%d %H:%M:%S")
        when = f"{fmt_utc(win[0])} – {end} ({fmt_duration((win[1] - win[0]).total_seconds())})"
    kinds = pd.Series([f.kind for f in findings]).value_counts()
    counts = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"
    return Header(str(ds.root), when, len(pids), counts)


def _recordings(ds: Dataset) -> Recordings | None:
    """The recordings that the report's rows come from: one row each, the columns it has."""
    rec = ds.recordings
    if rec.empty or "recording_id" not in rec:
        return None
    used = set()
    for df in (ds.outstanding, ds.processes, ds.targets):
        if "recording_id" in df:
            used |= set(df["recording_id"].astype(str))
    if used:
        rec = rec[rec["recording_id"].astype(str).isin(used)]
    cols = (("recording_id", "recording", str), ("host", "host", str), ("started", "started", fmt_utc),
            ("ended", "ended", fmt_utc), ("interval_s", "interval", lambda v: f"{v:g} s"),
            ("sample_mean_bytes", "sample mean", fmt_bytes), ("probe_mode", "probes", str),
            ("kernel", "kernel", str), ("sampler_version", "version", str))
    cols = tuple(c for c in cols if c[0] in rec)
    return Recordings(tuple(h for _, h, _ in cols),
                      tuple(tuple(_safe(f, r[c]) for c, _, f in cols) for _, r in rec.iterrows()))


def _safe(f: Callable[[Any], str], v: Any) -> str:
    if v is None or (not isinstance(v, str | list) and pd.isna(v)):
        return "–"
    return f(v)


def _process_row(tables: _ByPid, pid: int, charted: set[int], findings: list[Finding]) -> ProcessRow:
    p = tables.rows("processes", pid)
    n = sum(f.pid == pid for f in findings)
    rss = f"{fmt_bytes(p['rss'].iloc[-1])} (peak {fmt_bytes(p['rss'].max())})" if "rss" in p and len(p) else "–"
    limit = fmt_bytes(p["memory_limit"].iloc[-1]) if "memory_limit" in p and len(p) else "–"
    return ProcessRow(PidLink(pid, str(pid), pid in charted), _comm(tables, pid), _cmdline(tables, pid), rss, limit,
                      str(n or ""))


LAYOUT_COLUMNS = ["ts", "pid", "allocator", "rss", "free_resident_bytes", "pinned_bytes"]


class _ByPid:
    """The per-process tables cut by pid once, each part in time order (reports of many
    processes would otherwise filter the whole table again for every chart)."""

    def __init__(self, ds: Dataset, charted: list[int]):
        self.parts: dict[str, dict[int, pd.DataFrame]] = {}
        self.empty: dict[str, pd.DataFrame] = {}
        arenas = read_table(ds.root, "malloc_arenas", filter=pds.field("pid").isin(charted), columns=LAYOUT_COLUMNS) \
            if charted else pd.DataFrame(columns=LAYOUT_COLUMNS)
        for name in ("processes", "outstanding", "targets", "malloc_arenas"):
            df = arenas if name == "malloc_arenas" else getattr(ds, name)
            self.empty[name] = df.iloc[0:0]
            groups = df.groupby("pid", sort=False) if "pid" in df and len(df) else ()
            self.parts[name] = {int(pid): g.sort_values("ts", kind="stable") if "ts" in g else g
                                for pid, g in groups}

    def rows(self, name: str, pid: int) -> pd.DataFrame:
        return self.parts[name].get(pid, self.empty[name])


def _comm(tables: _ByPid, pid: int) -> str:
    for name in ("processes", "outstanding", "targets"):
        r = tables.rows(name, pid)
        if len(r) and "comm" in r:
            return str(r["comm"].iloc[-1])
    return "?"


def _cmdline(tables: _ByPid, pid: int) -> str:
    t = tables.rows("targets", pid)
    if "cmdline" not in t:
        return ""
    cmd = t["cmdline"].dropna()
    return str(cmd.iloc[-1]) if len(cmd) else ""


def _process_order(ds: Dataset, findings: list[Finding]) -> list[int]:
    pids: set[int] = set()
    for df in (ds.processes, ds.outstanding):
        if "pid" in df:
            pids |= {int(p) for p in df["pid"].unique()}
    worst = {}
    for f in findings:
        worst[f.pid] = max(worst.get(f.pid, -1.0), f.severity)
    peak = ds.processes.groupby("pid")["rss"].max().to_dict() \
        if {"pid", "rss"} <= set(ds.processes.columns) and len(ds.processes) else {}
    return sorted(pids, key=lambda p: (-worst.get(p, -1.0), -peak.get(p, 0), p))


# --- findings ----------------------------------------------------------------------------------

def _finding_row(f: Finding, charted: set[int], interpreter_frames: bool = False) -> FindingRow:
    frames = f.stack()
    advice = f.recommendation()
    return FindingRow(
        "high" if f.severity >= 70 else "mid" if f.severity >= 40 else "low", f"{f.severity:.0f}",
        f"{100 * f.confidence:.0f}", f.kind, PidLink(f.pid, f"{f.comm} ({f.pid})", f.pid in charted), f.summary,
        _numbers(f.numbers()), _stack_list(frames, interpreter_frames) if frames else None,
        _advice(advice) if advice else None)


def _numbers(d: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The numbers as (label, value) chips, a value's standard error beside it."""
    chips = []
    keys = [k for k in DETAIL_LABELS if k in d] + sorted(k for k in d if k not in DETAIL_LABELS)
    for k in keys:
        if "_stderr_" in k:
            continue
        text = format_detail(k, d[k])
        err = d.get(k.replace("_bytes", "_stderr_bytes")) if k.endswith("_bytes") else None
        if isinstance(err, int | float) and math.isfinite(err) and err > 0:
            text += f" ± {fmt_bytes(err)}"
        chips.append((DETAIL_LABELS.get(k, k.replace("_", " ").removesuffix(" bytes")), text))
    return tuple(chips)


def format_detail(key: str, v: Any) -> str:
    """A finding detail with its unit, judged from the key's name (`*_bytes`, `*_hours`, ...)."""
    if hasattr(v, "item") and not isinstance(v, list | dict | str):      # numpy scalars
        v = v.item()
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, dt.datetime | pd.Timestamp):
        return fmt_utc(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if key.endswith("_bytes_per_hour"):
            return f"{fmt_bytes(v)}/h"
        if key.endswith("_bytes"):
            return fmt_bytes(v)
        if key.endswith("_hours"):
            return fmt_duration(v * 3600)
        if key.endswith("_s"):
            return fmt_duration(v)
        if isinstance(v, int) and key.endswith(("_id", "_ids", "pid", "pids")):
            return str(v)                   # a name, not a count
        return f"{v:,}" if isinstance(v, int) else f"{v:.3g}"
    if isinstance(v, str) and key.endswith(("_seen", "_at", "_time")):
        try:
            return fmt_utc(pd.Timestamp(v))
        except ValueError:
            return v
    if isinstance(v, dict):           # e.g. region_growth_bytes: {"heap_rss": ..., "anon_rss": ...}
        text = ", ".join(f"{_label(k)} {format_detail(k if _unit(k) else key, x)}" for k, x in v.items())
    elif isinstance(v, list):
        text = ", ".join(format_detail(key, x) if not isinstance(x, dict) else f"({format_detail(key, x)})"
                         for x in v)
    else:
        return str(v)
    return text if len(text) <= 160 else text[:159] + "…"


def _unit(key: str) -> bool:
    return key.endswith(("_bytes", "_bytes_per_hour", "_hours", "_s"))


def _label(key: str) -> str:
    """A dict key as a word: heap_rss -> heap, arena_live_bytes -> arena live."""
    for suffix in ("_rss", "_bytes_per_hour", "_bytes", "_hours", "_s"):
        key = key.removesuffix(suffix)
    return key.replace("_", " ")


def _advice(v: Any) -> Advice:
    """A recommendation: a sentence, a list of them, or dicts of fields (one line each)."""
    if isinstance(v, list):
        return [_advice(x) for x in v]
    if isinstance(v, dict):
        return "; ".join(f"{k}: {format_detail(str(k), x)}" for k, x in v.items())
    return str(v)


def _stack_list(frames: list[Frame], interpreter_frames: bool = False) -> StackList:
    shown, hidden = trim_frames(frames, interpreter=interpreter_frames)
    return StackList(tuple(shown), hidden, tuple(frame_text(f) for f in frames), naming_hint([frames]))


# --- per process -------------------------------------------------------------------------------

def _process_section(tables: _ByPid, pid: int, stacks: Stacks, findings: list[Finding]) -> ProcessSection:
    p = tables.rows("processes", pid)
    o = tables.rows("outstanding", pid)
    meta = []
    if len(p) and "rss" in p:
        meta.append(f"RSS {fmt_bytes(p['rss'].iloc[0])} → {fmt_bytes(p['rss'].iloc[-1])}")
    if len(p) and "arenas" in p and pd.notna(p["arenas"].iloc[-1]):
        n = int(p["arenas"].iloc[-1])
        meta.append(f"{n} glibc arena{'s' * (n != 1)} besides the main one")
    if findings:
        meta.append(f"{len(findings)} finding{'s' * (len(findings) > 1)}: " + ", ".join(f.kind for f in findings))
    times = np.unique(np.concatenate([seconds(df["ts"]) for df in (p, o) if "ts" in df and len(df)] or [[]]))
    host = o[~o["source"].astype(str).isin(GPU_SOURCES)] if "source" in o else o
    return ProcessSection(pid, _comm(tables, pid), _cmdline(tables, pid), " · ".join(meta),
                          sections.top_stacks(host, times, stacks), sections.memory_breakdown(p),
                          sections.arena_chart(p), sections.layout_charts(tables.rows("malloc_arenas", pid)),
                          gpu.process_charts(p, o, times, stacks),
                          sections.flame_graphs(o, times, stacks))
