"""The HTML report: one self-contained file (inline CSS, SVG and script; nothing is fetched).

Findings ranked by severity, then per process: top stacks over time, the memory breakdown,
glibc heap/arena resident vs live, and flame graphs of outstanding bytes and of growth.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.dataset import Dataset
from analysis.detect import gpu
from analysis.findings import Finding
from analysis.report import flamegraph
from analysis.report.charts import Series, chart, seconds, thin
from sampler.units import fmt_bytes

TOP_STACKS = 8
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
# memory parts of the breakdown chart, bottom first; absent columns are left out
MEMORY_PARTS = (("heap_rss", "heap (brk)", "#4e79a7"), ("arena_rss", "glibc arenas", "#f28e2b"),
                ("anon_rss", "other anonymous", "#76b7b2"), ("file_rss", "file-backed", "#bab0ac"),
                ("stack_rss", "thread stacks", "#b07aa1"))       # GPU memory: its own chart (analysis/detect/gpu.py)
# frames that say nothing about who allocated: the allocator's own and the program's entry
ALLOCATOR_MODULES = re.compile(r"^(libc\.so|libc-|libstdc\+\+|libjemalloc|libtcmalloc|libmimalloc|ld-linux)")
ENTRY_FUNCTIONS = {"_start", "__libc_start_main", "__libc_start_call_main", "__libc_start_main_impl",
                   "start_thread", "clone", "clone3", "__clone3"}
SHOWN_FRAMES = 6
DETAIL_LABELS = {"growth_bytes_per_hour": "growth", "outstanding_bytes": "outstanding",
                 "time_to_oom_hours": "time to OOM", "resident_bytes": "resident", "live_bytes": "live",
                 "bloat_bytes": "bloat", "trimmable_bytes": "trimmable", "first_seen": "first seen",
                 "last_seen": "last seen"}
HIDDEN_DETAILS = {"frames", "recommendation", "recommendations"}


def render_html(ds: Dataset, findings: list[Finding], *, title: str | None = None,
                max_processes: int = 20) -> str:
    """The report as one HTML document. Processes are charted in order of their worst finding,
    then of peak RSS; at most `max_processes` of them."""
    title = title or f"allocsampler report: {ds.root.name or ds.root}"
    findings = sorted(findings, key=lambda f: -f.severity)
    pids = _process_order(ds, findings)
    stacks = flamegraph.stack_frames(ds.frames)
    tables = _ByPid(ds)
    charted = pids[:max_processes]
    sections = [_process_section(tables, pid, stacks, [f for f in findings if f.pid == pid]) for pid in charted]
    if len(pids) > max_processes:
        sections.append(f'<p class="note">{len(pids) - max_processes} more processes are not charted: '
                        "restrict the report to fewer processes.</p>")
    if not pids:
        sections.append('<p class="empty">No process data in this window.</p>')
    body = "\n".join([f"<h1>{html.escape(title)}</h1>", _header(ds, findings, pids),
                      "<h2>Findings</h2>", _findings_table(findings, set(charted)),
                      _processes_table(tables, pids, set(charted), findings),
                      _recordings(ds), gpu.devices_section(ds), *sections])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n{_CSP}\n'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f'<body>{body}<div id="tip"></div><script>{_JS}</script></body></html>\n')


# --- header ------------------------------------------------------------------------------------

def _ts(v: Any, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return "–"
    t = pd.Timestamp(v)
    t = t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")
    return t.strftime(fmt) + " UTC"


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _window(ds: Dataset) -> tuple[pd.Timestamp, pd.Timestamp] | None:
    ts = [df["ts"] for df in (ds.outstanding, ds.processes) if "ts" in df and len(df)]
    return (min(t.min() for t in ts), max(t.max() for t in ts)) if ts else None


def _header(ds: Dataset, findings: list[Finding], pids: list[int]) -> str:
    win = _window(ds)
    when = "no data"
    if win is not None:
        end = _ts(win[1], "%H:%M:%S" if _ts(win[0], "%F") == _ts(win[1], "%F") else "%Y-%m-%d %H:%M:%S")
        when = f"{_ts(win[0])} – {end} ({_duration((win[1] - win[0]).total_seconds())})"
    kinds = pd.Series([f.kind for f in findings]).value_counts()
    counts = ", ".join(f"{n} {html.escape(k)}" for k, n in kinds.items()) or "none"
    return ('<table class="meta">'
            f"<tr><th>dataset</th><td><code>{html.escape(str(ds.root))}</code></td></tr>"
            f"<tr><th>time window</th><td>{when}</td></tr>"
            f"<tr><th>processes</th><td>{len(pids)}</td></tr>"
            f"<tr><th>findings</th><td>{counts}</td></tr></table>")


def _recordings(ds: Dataset) -> str:
    rec = ds.recordings
    if rec.empty or "recording_id" not in rec:
        return ""
    used = set()
    for df in (ds.outstanding, ds.processes, ds.targets):
        if "recording_id" in df:
            used |= set(df["recording_id"].astype(str))
    if used:
        rec = rec[rec["recording_id"].astype(str).isin(used)]
    cols = (("recording_id", "recording", str), ("host", "host", str), ("started", "started", _ts),
            ("ended", "ended", _ts), ("interval_s", "interval", lambda v: f"{v:g} s"),
            ("sample_mean_bytes", "sample mean", fmt_bytes), ("probe_mode", "probes", str),
            ("kernel", "kernel", str), ("sampler_version", "version", str))
    cols = tuple(c for c in cols if c[0] in rec)
    rows = ["<tr>" + "".join(f"<td>{html.escape(_safe(f, r[c]))}</td>" for c, _, f in cols) + "</tr>"
            for _, r in rec.iterrows()]
    head = "".join(f"<th>{h}</th>" for _, h, _ in cols)
    return f'<h2>Recordings</h2><table class="list"><tr>{head}</tr>{"".join(rows)}</table>'


def _safe(f, v) -> str:
    if v is None or (not isinstance(v, str | list) and pd.isna(v)):
        return "–"
    return f(v)


def _processes_table(tables: _ByPid, pids: list[int], charted: set[int], findings: list[Finding]) -> str:
    if not pids:
        return ""
    rows = []
    for pid in pids:
        p = tables.rows("processes", pid)
        cmd = _cmdline(tables, pid)
        n = sum(f.pid == pid for f in findings)
        rss = f"{fmt_bytes(p['rss'].iloc[-1])} (peak {fmt_bytes(p['rss'].max())})" if "rss" in p and len(p) else "–"
        limit = fmt_bytes(p["memory_limit"].iloc[-1]) if "memory_limit" in p and len(p) else "–"
        rows.append(f"<tr><td>{_pid_link(pid, charted)}</td><td>{html.escape(_comm(tables, pid))}</td>"
                    f'<td><span class="cmd" title="{html.escape(cmd)}">{html.escape(cmd)}</span></td><td>{rss}</td>'
                    f"<td>{limit}</td><td>{n or ''}</td></tr>")
    table = ('<table class="list"><tr><th>pid</th><th>comm</th><th>command</th><th>RSS (last)</th>'
             f'<th>memory limit</th><th>findings</th></tr>{"".join(rows)}</table>')
    # a long list would push the charts far down: folded, one click away
    fold = "" if len(pids) <= 15 else f'<details><summary>all {len(pids)} processes</summary>{table}</details>'
    return f"<h2>Processes</h2>{fold or table}"


class _ByPid:
    """The per-process tables cut by pid once, each part in time order (reports of many
    processes would otherwise filter the whole table again for every chart)."""

    def __init__(self, ds: Dataset):
        self.parts: dict[str, dict[int, pd.DataFrame]] = {}
        self.empty: dict[str, pd.DataFrame] = {}
        for name in ("processes", "outstanding", "targets"):
            df = getattr(ds, name)
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

def _pid_link(pid: int, charted: set[int], text: str | None = None) -> str:
    text = html.escape(text or str(pid))
    return f'<a href="#pid-{pid}">{text}</a>' if pid in charted else text


def _findings_table(findings: list[Finding], charted: set[int]) -> str:
    if not findings:
        return '<p class="empty">No findings: no persistent growth or arena bloat was detected.</p>'
    rows = []
    for f in findings:
        sev = "high" if f.severity >= 70 else "mid" if f.severity >= 40 else "low"
        d = f.details
        where = ""
        if isinstance(d.get("frames"), list) and d["frames"]:
            where = _stack_html(d["frames"])
        rec = d.get("recommendation", d.get("recommendations"))
        if rec:
            where += f'<div class="rec"><b>What to do:</b> {_rich(rec)}</div>'
        rows.append(
            f'<tr><td><span class="sev {sev}">{f.severity:.0f}</span>'
            f'<div class="conf">conf. {100 * f.confidence:.0f}%</div></td>'
            f'<td><span class="kind">{html.escape(f.kind)}</span><br>'
            f"{_pid_link(f.pid, charted, f'{f.comm} ({f.pid})')}</td>"
            f'<td><div class="summary">{html.escape(f.summary)}</div>{_numbers(d)}</td><td>{where}</td></tr>')
    return ('<table class="findings"><tr><th>severity</th><th>kind / process</th><th>finding</th>'
            f'<th>where / what to do</th></tr>{"".join(rows)}</table>')


def _numbers(d: dict[str, Any]) -> str:
    """The scalar details as label: value chips, a value's standard error beside it."""
    chips = []
    keys = [k for k in DETAIL_LABELS if k in d] + sorted(k for k in d if k not in DETAIL_LABELS)
    for k in keys:
        if k in HIDDEN_DETAILS or "_stderr_" in k:
            continue
        text = format_detail(k, d[k])
        err = d.get(k.replace("_bytes", "_stderr_bytes")) if k.endswith("_bytes") else None
        if isinstance(err, int | float) and math.isfinite(err) and err > 0:
            text += f" ± {fmt_bytes(err)}"
        label = DETAIL_LABELS.get(k, k.replace("_", " ").removesuffix(" bytes"))
        chips.append(f'<span class="num"><span class="k">{html.escape(label)}</span> {html.escape(text)}</span>')
    return f'<div class="nums">{"".join(chips)}</div>' if chips else ""


def format_detail(key: str, v: Any) -> str:
    """A finding detail with its unit, judged from the key's name (`*_bytes`, `*_hours`, ...)."""
    if hasattr(v, "item") and not isinstance(v, list | dict | str):      # numpy scalars
        v = v.item()
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, dt.datetime | pd.Timestamp):
        return _ts(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if key.endswith("_bytes_per_hour"):
            return f"{fmt_bytes(v)}/h"
        if key.endswith("_bytes"):
            return fmt_bytes(v)
        if key.endswith("_hours"):
            return _duration(v * 3600)
        if key.endswith("_s"):
            return _duration(v)
        return f"{v:,}" if isinstance(v, int) else f"{v:.3g}"
    if isinstance(v, str) and key.endswith(("_seen", "_at", "_time")):
        try:
            return _ts(pd.Timestamp(v))
        except ValueError:
            return v
    if isinstance(v, list | dict):
        text = json.dumps(v, default=str)
        return text if len(text) <= 160 else text[:159] + "…"
    return str(v)


def _rich(v: Any) -> str:
    """A recommendation: a sentence, a list of them, or dicts of fields."""
    if isinstance(v, list):
        return "<ul>" + "".join(f"<li>{_rich(x)}</li>" for x in v) + "</ul>"
    if isinstance(v, dict):
        return "; ".join(f"{html.escape(str(k))}: {html.escape(format_detail(str(k), x))}" for k, x in v.items())
    return html.escape(str(v))


def trim_frames(frames: list[dict[str, Any]], keep: int = SHOWN_FRAMES) -> tuple[list[str], int]:
    """The interesting frames of a stack (innermost first) as text, and how many were left out:
    allocator-internal frames at the top and entry frames at the bottom are dropped, runs of
    unsymbolized frames of one module become one line."""
    def fn(f: dict) -> str | None:
        return _text(f.get("function"))

    lo, hi = 0, len(frames)
    while hi - lo > 1 and ALLOCATOR_MODULES.match(str(frames[lo].get("module") or "")):
        lo += 1
    while hi - lo > 1 and fn(frames[hi - 1]) in ENTRY_FUNCTIONS:
        hi -= 1
    lines: list[str] = []
    run_module, run = None, 0
    for f in frames[lo:hi]:
        module = str(f.get("module") or "?")
        if fn(f) is None:
            if run and module == run_module:
                run += 1
                lines[-1] = f"[{run} frames in {module}]"
            else:
                run_module, run = module, 1
                lines.append(f"{module}+{_hex(f.get('offset'))}" if _finite(f.get("offset")) else f"? ({module})")
            continue
        run = 0
        text = _frame_text(f)
        if f.get("kind") != "python" and _text(f.get("file")):
            line = f.get("line")
            text += f"  {Path(f['file']).name}" + (f":{int(line)}" if _finite(line) else "")
        lines.append(text)
    dropped = len(frames) - (hi - lo)
    return lines[:keep], max(0, len(lines) - keep) + dropped


def _text(v: Any) -> str | None:
    """A non-empty string, else None (frames from DataFrames carry NaN for nulls)."""
    return v if isinstance(v, str) and v else None


def _hex(v: Any) -> str:
    return f"{int(v):#x}" if _finite(v) else "?"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and math.isfinite(v)


def _stack_html(frames: list[dict[str, Any]]) -> str:
    shown, hidden = trim_frames(frames)
    items = "".join(f"<li>{html.escape(s)}</li>" for s in shown)
    out = f'<ol class="stack">{items}</ol>'
    if hidden:
        full = "".join(f"<li>{html.escape(_frame_text(f))}</li>" for f in frames)
        out += f'<details><summary>all {len(frames)} frames</summary><ol class="stack">{full}</ol></details>'
    return out


def _frame_text(f: dict[str, Any]) -> str:
    name = _text(f.get("function")) or _hex(f.get("offset"))
    if f.get("kind") == "python" and _finite(f.get("line")):
        return f"{name} ({f.get('module') or '?'}:{int(f['line'])})"
    return f"{name} ({f.get('module') or '?'})"


# --- per process -------------------------------------------------------------------------------

Stacks = dict[int, list[dict[str, Any]]]       # stack_id -> frames innermost first


def _stack_label(stacks: Stacks, sid: int) -> tuple[str, str]:
    """(short label, full summary) of a stack for legends."""
    frames = stacks.get(int(sid))
    if not frames:
        return "[no stack]", f"stack {sid}"
    shown, _ = trim_frames(frames, keep=3)
    return " < ".join(shown), " < ".join(_frame_text(f) for f in frames)


def _process_section(tables: _ByPid, pid: int, stacks: Stacks, findings: list[Finding]) -> str:
    p = tables.rows("processes", pid)
    o = tables.rows("outstanding", pid)
    comm = _comm(tables, pid)
    meta = []
    cmd = _cmdline(tables, pid)
    if cmd:
        meta.append(f'<code class="cmd" title="{html.escape(cmd)}">{html.escape(cmd)}</code>')
    if len(p) and "rss" in p:
        meta.append(f"RSS {fmt_bytes(p['rss'].iloc[0])} → {fmt_bytes(p['rss'].iloc[-1])}")
    if len(p) and "arenas" in p and pd.notna(p["arenas"].iloc[-1]):
        n = int(p["arenas"].iloc[-1])
        meta.append(f"{n} glibc arena{'s' * (n != 1)} besides the main one")
    if findings:
        meta.append(f"{len(findings)} finding{'s' * (len(findings) > 1)}: "
                    + ", ".join(html.escape(f.kind) for f in findings))
    out = [f'<section id="pid-{pid}"><h2>{html.escape(comm)} (pid {pid})</h2>',
           f'<p class="meta">{" · ".join(meta)}</p>']
    times = np.unique(np.concatenate([seconds(df["ts"]) for df in (p, o) if "ts" in df and len(df)] or [[]]))
    host = o[~o["source"].astype(str).isin(gpu.GPU_SOURCES)] if "source" in o else o
    out.append(_top_stacks(host, times, stacks))
    out.append('<div class="two">')
    out.append(f"<div>{_memory_breakdown(p)}</div><div>{_arena_chart(p)}</div></div>")
    out.append(gpu.process_section(p, o, times, stacks))
    out.append(_flame_graphs(o, times, stacks))
    out.append("</section>")
    return "\n".join(out)


def _top_stacks(o: pd.DataFrame, times: np.ndarray, stacks: Stacks,
                head: str = "<h3>Top stacks: outstanding bytes</h3>") -> str:
    need = {"ts", "source", "stack_id", "outstanding_bytes"}
    if o.empty or not need <= set(o.columns):
        return head + '<p class="empty">No sampled allocations.</p>'
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
        return head + '<p class="empty">No sampled allocations.</p>'
    keys = list(rank.index)
    sub = o[pd.MultiIndex.from_frame(o[["source", "stack_id"]]).isin(keys)]
    sub = sub.assign(var=sub["outstanding_stderr_bytes"].fillna(0) ** 2)
    g = sub.groupby(["t", "source", "stack_id"])[["outstanding_bytes", "var"]].sum().unstack(["source", "stack_id"])
    val = g["outstanding_bytes"].reindex(index=times, columns=keys).fillna(0)
    err = np.sqrt(g["var"].reindex(index=times, columns=keys).fillna(0))
    series, legend = [], []
    for i, key in enumerate(keys):
        color = PALETTE[i % len(PALETTE)]
        short, full = _stack_label(stacks, key[1])
        y, e = val[key].to_numpy(), err[key].to_numpy()
        series.append(Series(f"{key[0]}: {short}", color, y, np.maximum(y - 2 * e, 0), y + 2 * e))
        legend.append(f'<tr><td><i style="background:{color}"></i></td><td>{html.escape(key[0])}</td>'
                      f'<td class="v">{fmt_bytes(y[-1])} ± {fmt_bytes(2 * e[-1])}</td>'
                      f'<td class="v">{_signed(y[-1] - y[0])}</td>'
                      f'<td class="lbl" title="{html.escape(full)}">{html.escape(short)}</td></tr>')
    return (head + chart(times, series, label="top stacks by outstanding bytes")
            + '<table class="legend"><tr><th></th><th>source</th><th>at end (±2 s.e.)</th><th>change</th>'
            + f'<th>stack (innermost first)</th></tr>{"".join(legend)}</table>'
            + '<p class="note">Shaded: ±2 standard errors of the sampling estimate. Sources overlap '
            + "(a large malloc is also an mmap): compare them, never add them.</p>")


def _signed(v: float) -> str:
    return ("+" if v >= 0 else "−") + fmt_bytes(abs(v))


def _memory_breakdown(p: pd.DataFrame) -> str:
    head = "<h3>Memory by kind</h3>"
    parts = [(c, label, color) for c, label, color in MEMORY_PARTS if c in p and p[c].notna().any()]
    if p.empty or not parts or "ts" not in p:
        return head + '<p class="empty">No process measurements.</p>'
    t = seconds(p["ts"])
    series = [Series(label, color, p[c].fillna(0).to_numpy(dtype=float)) for c, label, color in parts]
    total = Series("RSS", "#222", p["rss"].to_numpy(dtype=float)) if "rss" in p else None
    legend = "".join(f'<span><i style="background:{s.color}"></i>{html.escape(s.label)} {fmt_bytes(s.y[-1])}</span>'
                     for s in reversed(series))
    if total is not None:
        legend = f'<span><i class="dash"></i>RSS {fmt_bytes(total.y[-1])}</span>' + legend
    return head + chart(t, series, width=570, stacked=True, total=total, label="memory by kind") + \
        f'<div class="keys">{legend}</div>'


def _arena_chart(p: pd.DataFrame) -> str:
    head = "<h3>glibc heap + arenas: resident vs live</h3>"
    if p.empty or not {"ts", "heap_rss", "arena_rss"} <= set(p.columns):
        return head + '<p class="empty">No heap measurements.</p>'
    t = seconds(p["ts"])
    resident = (p["heap_rss"].fillna(0) + p["arena_rss"].fillna(0)).to_numpy(dtype=float)
    series = [Series("resident (heap + arenas)", "#f28e2b", resident, fill=True)]
    legend = f'<span><i style="background:#f28e2b"></i>resident {fmt_bytes(resident[-1])}</span>'
    if {"heap_live_bytes", "arena_live_bytes"} <= set(p.columns):
        live = (p["heap_live_bytes"].fillna(0) + p["arena_live_bytes"].fillna(0)).to_numpy(dtype=float)
        err = p["heap_arena_live_stderr_bytes"].fillna(0).to_numpy(dtype=float) \
            if "heap_arena_live_stderr_bytes" in p else np.zeros(len(live))
        series.append(Series("estimated live", "#4e79a7", live, np.maximum(live - 2 * err, 0), live + 2 * err))
        legend += (f'<span><i style="background:#4e79a7"></i>estimated live {fmt_bytes(live[-1])}</span>'
                   f"<span>gap {fmt_bytes(max(resident[-1] - live[-1], 0))}</span>")
    return head + chart(t, series, width=570, label="arena resident vs live") + f'<div class="keys">{legend}</div>'


def _flame_graphs(o: pd.DataFrame, times: np.ndarray, stacks: Stacks) -> str:
    if o.empty or not {"ts", "source", "stack_id", "outstanding_bytes"} <= set(o.columns):
        return ""
    o = o.assign(t=seconds(o["ts"]), source=o["source"].astype(str))
    first, last = times[0], times[-1]
    end = o[o["t"] == last].groupby(["source", "stack_id"])["outstanding_bytes"].sum()
    start = o[o["t"] == first].groupby(["source", "stack_id"])["outstanding_bytes"].sum()
    growth = end.sub(start, fill_value=0).clip(lower=0)
    t_last, t_first = _ts(pd.Timestamp(last, unit="s")), _ts(pd.Timestamp(first, unit="s"))
    out = []
    for what, values, note in (("outstanding", end, f"at the end of the window ({t_last})"),
                               ("growth", growth, f"from {t_first} to {t_last}, stacks that grew")):
        for source in sorted(values.index.get_level_values(0).unique()) if len(values) else []:
            v = values.loc[source]
            if v.sum() <= 0:
                continue
            root = flamegraph.tree_from_values(v, stacks, f"all {source}")
            out.append(f"<h3>Flame graph: {what} bytes, {html.escape(source)} <small>{note}; "
                       f"{fmt_bytes(root.value)} in total</small></h3>")
            out.append(flamegraph.render_svg(root, growth=what == "growth", what=what))
    if out:
        out.append('<p class="note">Outermost frame at the top; width is bytes. Hover for details'
                   '<span class="js-only">, click a frame to zoom, click the top bar to reset</span>.</p>')
    return "\n".join(out)


# the browser itself refuses any fetch: the report stays self-contained even if a label had a URL
_CSP = ("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#222;
  max-width:1200px;margin:16px auto;padding:0 16px}
h1{font-size:22px;margin:4px 0 10px}h2{font-size:18px;margin:26px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:16px 0 4px}h3 small{font-weight:normal;color:#666}
section{margin-top:28px}code{font-size:12px}
table{border-collapse:collapse}th{text-align:left;font-weight:600;color:#444}
table.meta th{padding:1px 14px 1px 0}
table.list td,table.list th{padding:3px 10px 3px 0;border-bottom:1px solid #eee;font-size:13px}
.cmd{max-width:520px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;display:inline-block}
table.findings{width:100%}table.findings>tbody>tr>td,table.findings th{padding:8px 10px 8px 0;
  border-bottom:1px solid #e4e4e4;vertical-align:top}
.sev{display:inline-block;min-width:28px;text-align:center;border-radius:4px;padding:1px 4px;color:#fff;
  font-weight:600}.sev.high{background:#c62828}.sev.mid{background:#ef6c00}.sev.low{background:#78909c}
.conf{font-size:11px;color:#777}.kind{font-family:monospace;font-size:12px;background:#eef;padding:0 4px}
.summary{font-weight:500}.nums{margin-top:4px}.num{display:inline-block;margin:2px 10px 0 0;font-size:12.5px}
.num .k{color:#777}ol.stack{margin:0;padding-left:22px;font:12px/1.4 monospace;word-break:break-all}
details summary{font-size:12px;color:#555;cursor:pointer}.rec{margin-top:6px;font-size:13px}
.rec ul{margin:2px 0;padding-left:18px}
.meta{color:#555;font-size:13px}.note{color:#666;font-size:12px;margin:2px 0}.empty{color:#888}
.two{display:grid;grid-template-columns:1fr 1fr;gap:20px}
svg{display:block;overflow:visible}svg text{font-size:11px;fill:#444}
.chart .grid{stroke:#e6e6e6}.chart .axis,.chart .tick{stroke:#888}.chart .ytick{text-anchor:end}
.chart .xtick{text-anchor:middle}.chart .xlabel{text-anchor:end;fill:#777}
.chart .line{fill:none;stroke-width:2}.chart .total{stroke-dasharray:5 3;stroke-width:1.5}
.chart .cursor{stroke:#999;stroke-dasharray:3 3}
table.legend td,table.legend th{padding:1px 10px 1px 0;font-size:12px}table.legend .v{text-align:right;
  white-space:nowrap}table.legend .lbl{font-family:monospace;max-width:720px;overflow:hidden;
  text-overflow:ellipsis;white-space:nowrap}
i{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:-1px;border-radius:2px}
i.dash{border-top:2px dashed #222;height:0;border-radius:0}
.keys{font-size:12px}.keys span{margin-right:14px;white-space:nowrap}
.flame text{font:11px monospace;fill:#222;pointer-events:none}.flame g{cursor:pointer}
.flame g:hover rect{stroke:#333;stroke-width:.8}.flame g.anc rect{opacity:.55}
.js-only{display:none}.js .js-only{display:inline}
#tip{position:fixed;display:none;background:#fff;border:1px solid #bbb;border-radius:4px;padding:5px 8px;
  font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.15);pointer-events:none;max-width:560px;z-index:9}
#tip div{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
"""

# Flame graph zoom and the charts' hover read-out. Labels are re-truncated as in flamegraph.label_for.
_JS = r"""
document.documentElement.classList.add("js");     // shows the hints of what scripts add
const CHAR = 6.6;
function fmtBytes(n) {
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]])
    if (Math.abs(n) >= s) return (n / s).toFixed(1) + " " + u;
  return n.toFixed(0) + " B";
}
function fit(text, w) {
  const n = Math.floor((w - 6) / CHAR);
  return n < 3 ? "" : text.length <= n ? text : text.slice(0, n - 1) + "\u2026";
}
document.querySelectorAll("svg.flame").forEach(svg => {
  const W = +svg.dataset.w, gs = [...svg.querySelectorAll("g.fr")];
  svg.addEventListener("click", ev => {
    const g = ev.target.closest("g.fr");
    if (!g) return;
    const x0 = +g.dataset.x, w0 = +g.dataset.w, d0 = +g.dataset.d, eps = 0.02;
    for (const e of gs) {
      const x = +e.dataset.x, w = +e.dataset.w, d = +e.dataset.d;
      let nx, nw;
      if (d >= d0 && x >= x0 - eps && x + w <= x0 + w0 + eps) { nx = (x - x0) / w0 * W; nw = w / w0 * W; }
      else if (d < d0 && x <= x0 + eps && x + w >= x0 + w0 - eps) { nx = 0; nw = W; }
      else { e.style.display = "none"; continue; }
      e.style.display = "";
      e.classList.toggle("anc", d < d0);
      const r = e.querySelector("rect"), t = e.querySelector("text");
      r.setAttribute("x", nx.toFixed(2)); r.setAttribute("width", Math.max(nw - 0.5, 0.1).toFixed(2));
      t.setAttribute("x", (nx + 3).toFixed(2)); t.textContent = fit(e.dataset.l, nw);
    }
  });
});
const tip = document.getElementById("tip");
document.querySelectorAll(".chartbox").forEach(box => {
  const svg = box.querySelector("svg"), data = JSON.parse(box.querySelector("script").textContent);
  const cursor = svg.querySelector(".cursor");
  svg.addEventListener("mousemove", ev => {
    const pt = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(svg.getScreenCTM().inverse());
    if (pt.x < data.x0 || pt.x > data.x1) { svg.dispatchEvent(new Event("mouseleave")); return; }
    const t = data.t0 + (pt.x - data.x0) / (data.x1 - data.x0) * (data.t1 - data.t0);
    let i = 0;
    for (let k = 1; k < data.t.length; k++) if (Math.abs(data.t[k] - t) < Math.abs(data.t[i] - t)) i = k;
    const x = data.x0 + (data.t[i] - data.t0) / (data.t1 - data.t0) * (data.x1 - data.x0);
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    const when = new Date(data.t[i] * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    tip.replaceChildren(Object.assign(document.createElement("b"), {textContent: when}));
    for (const s of data.s) {
      const row = document.createElement("div"), sw = document.createElement("i");
      sw.style.background = s.c;
      row.append(sw, fmtBytes(s.y[i]) + "  " + s.l);
      tip.append(row);
    }
    tip.style.display = "block";
    tip.style.left = Math.min(ev.clientX + 14, innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  });
  svg.addEventListener("mouseleave", () => {
    tip.style.display = "none";
    cursor.setAttribute("visibility", "hidden");
  });
});
"""
