"""The HTML report: one self-contained file (inline CSS, SVG and script; nothing is fetched).

Findings ranked by severity, then per process: top stacks over time, the memory breakdown,
glibc heap/arena resident vs live, and flame graphs of outstanding bytes and of growth.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
from typing import Any

import numpy as np
import pandas as pd

from analysis.dataset import Dataset
from analysis.findings import Finding
from analysis.frames import Stacks, frame_text, stack_frames, trim_frames
from analysis.report import gpu
from analysis.report.charts import seconds
from analysis.report.sections import arena_chart, flame_graphs, memory_breakdown, top_stacks
from analysis.units import fmt_bytes, fmt_duration, fmt_utc
from sampler.dataset.sources import GPU_SOURCES

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
    stacks = stack_frames(ds.frames)
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

def _window(ds: Dataset) -> tuple[pd.Timestamp, pd.Timestamp] | None:
    ts = [df["ts"] for df in (ds.outstanding, ds.processes) if "ts" in df and len(df)]
    return (min(t.min() for t in ts), max(t.max() for t in ts)) if ts else None


def _header(ds: Dataset, findings: list[Finding], pids: list[int]) -> str:
    win = _window(ds)
    when = "no data"
    if win is not None:
        end = fmt_utc(win[1], "%H:%M:%S" if fmt_utc(win[0], "%F") == fmt_utc(win[1], "%F") else "%Y-%m-%d %H:%M:%S")
        when = f"{fmt_utc(win[0])} – {end} ({fmt_duration((win[1] - win[0]).total_seconds())})"
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
    cols = (("recording_id", "recording", str), ("host", "host", str), ("started", "started", fmt_utc),
            ("ended", "ended", fmt_utc), ("interval_s", "interval", lambda v: f"{v:g} s"),
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
        return f"{v:,}" if isinstance(v, int) else f"{v:.3g}"
    if isinstance(v, str) and key.endswith(("_seen", "_at", "_time")):
        try:
            return fmt_utc(pd.Timestamp(v))
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


def _stack_html(frames: list[dict[str, Any]]) -> str:
    shown, hidden = trim_frames(frames)
    items = "".join(f"<li>{html.escape(s)}</li>" for s in shown)
    out = f'<ol class="stack">{items}</ol>'
    if hidden:
        full = "".join(f"<li>{html.escape(frame_text(f))}</li>" for f in frames)
        out += f'<details><summary>all {len(frames)} frames</summary><ol class="stack">{full}</ol></details>'
    return out


# --- per process -------------------------------------------------------------------------------

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
    host = o[~o["source"].astype(str).isin(GPU_SOURCES)] if "source" in o else o
    out.append(top_stacks(host, times, stacks))
    out.append('<div class="two">')
    out.append(f"<div>{memory_breakdown(p)}</div><div>{arena_chart(p)}</div></div>")
    out.append(gpu.process_charts(p, o, times, stacks))
    out.append(flame_graphs(o, times, stacks))
    out.append("</section>")
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
