"""Time-series charts of bytes as inline SVG: lines with error bands and stacked areas.

Axes: UTC clock time on x, bytes on y from zero (memory charts must not exaggerate change).
Each chart carries its downsampled data as JSON for the report's hover read-out.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from markupsafe import Markup

MAX_POINTS = 500                 # per series: enough for a 1200 px wide chart
HEIGHT = 240
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 10, 34

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
               172800, 604800)


@dataclass
class Series:
    label: str
    color: str
    y: np.ndarray
    lo: np.ndarray | None = None     # error band, drawn under the line
    hi: np.ndarray | None = None
    fill: bool = False               # shade the area under the line


def seconds(ts: pd.Series) -> np.ndarray:
    """Timestamps as float seconds since the epoch (naive ones are taken as UTC)."""
    ts = pd.to_datetime(ts)
    if ts.dt.tz is None:
        ts = ts.dt.tz_localize("UTC")
    return ((ts - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(dtype=float)


def byte_ticks(vmax: float, n: int = 5) -> tuple[list[float], str, int]:
    """Tick values from 0 covering vmax, in one binary unit with 1-2-5 steps: (ticks, unit, scale)."""
    vmax = max(vmax, 1024.0)                     # all zero: still a readable axis
    unit, scale = next((u, s) for u, s in _UNITS if vmax >= s)
    top = vmax / scale
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    count = math.ceil(top / step - 1e-9)
    return [i * step * scale for i in range(count + 1)], unit, scale


def _num(v: float) -> str:
    return f"{v:.10g}" if v == int(v) else f"{v:.3g}"


def time_ticks(t0: float, t1: float, n: int = 8) -> tuple[list[float], str]:
    """Ticks on round clock times and the strftime format that shows them."""
    span = max(t1 - t0, 1e-9)
    step = next((s for s in _TIME_STEPS if span / s <= n), _TIME_STEPS[-1])
    first = math.ceil(t0 / step) * step
    ticks = [first + i * step for i in range(int((t1 - first) / step + 1e-6) + 1)]
    if step >= 86400:
        fmt = "%m-%d"
    elif step >= 60:
        fmt = "%H:%M" if t1 - t0 < 86400 else "%m-%d %H:%M"
    else:
        fmt = "%H:%M:%S"
    return ticks, fmt


def thin(n: int) -> np.ndarray:
    """Indices of at most MAX_POINTS of n samples, evenly spread, first and last included."""
    if n <= MAX_POINTS:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, MAX_POINTS).round().astype(int))


def _path(xs: np.ndarray, ys: np.ndarray) -> str:
    return "M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))


def _utc(t: float, fmt: str) -> str:
    return pd.Timestamp(t, unit="s", tz="UTC").strftime(fmt)


def chart(t: np.ndarray, series: list[Series], *, width: int = 1160, stacked: bool = False,
          total: Series | None = None, label: str = "") -> Markup:
    """An <svg> chart of byte series over time `t` (epoch seconds, ascending).

    stacked: series are stacked areas (bottom first); `total` is then drawn as a dashed line.
    Markup: every text in it is escaped here, so templates insert it as it is."""
    if len(t) == 0 or not series:
        return Markup('<p class="empty">no data</p>')
    idx = thin(len(t))
    t = t[idx]
    ys = [np.nan_to_num(s.y[idx].astype(float)) for s in series]
    tops = np.cumsum(ys, axis=0) if stacked else np.array(ys)
    highs = [tops.max()]
    highs += [np.nanmax(s.hi[idx]) for s in series if s.hi is not None and not stacked]
    if total is not None:
        highs.append(np.nanmax(total.y[idx]))
    yt, unit, scale = byte_ticks(float(np.nanmax(highs)))
    ymax = yt[-1]
    t0, t1 = float(t[0]), float(t[-1])
    if t1 - t0 < 1:                                   # one snapshot: give it some room
        t0, t1 = t0 - 1, t1 + 1
    plot_w, plot_h = width - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(v: np.ndarray) -> np.ndarray:
        return LEFT + (v - t0) / (t1 - t0) * plot_w

    def py(v: np.ndarray) -> np.ndarray:
        return TOP + plot_h - np.clip(v, 0, None) / ymax * plot_h

    xs = px(t)
    out = [f'<svg class="chart" viewBox="0 0 {width} {HEIGHT}" width="100%" role="img" '
           f'aria-label="{html.escape(label)}">']
    for v in yt:                                      # grid and y labels
        y = py(np.array(v))
        out.append(f'<line class="grid" x1="{LEFT}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="ytick" x="{LEFT - 6}" y="{y + 4:.1f}">{_num(v / scale)} {unit}</text>')
    ticks, fmt = time_ticks(t0, t1, max(3, plot_w // 110))      # room for "01-02 03:04" labels
    for v in ticks:
        x = px(np.array(v))
        out.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}"/>'
                   f'<text class="xtick" x="{x:.1f}" y="{TOP + plot_h + 17}">{_utc(v, fmt)}</text>')
    day = _utc(t0, "%Y-%m-%d") + ("" if _utc(t0, "%F") == _utc(t1, "%F") else " – " + _utc(t1, "%Y-%m-%d"))
    out.append(f'<text class="xlabel" x="{width - RIGHT}" y="{HEIGHT - 3}">time (UTC, {day})</text>')
    base = np.zeros(len(t))
    for s, y, top in zip(series, ys, tops, strict=True):
        title = f"<title>{html.escape(s.label)}</title>"
        if stacked:
            poly = _path(np.concatenate([xs, xs[::-1]]), np.concatenate([py(top), py(base)[::-1]]))
            out.append(f'<path d="{poly}Z" fill="{s.color}" fill-opacity="0.8" stroke="{s.color}">{title}</path>')
            base = top
            continue
        if s.fill:
            poly = _path(np.concatenate([xs, xs[::-1]]), np.concatenate([py(y), py(np.zeros(len(t)))]))
            out.append(f'<path d="{poly}Z" fill="{s.color}" fill-opacity="0.18" stroke="none"/>')
        if s.lo is not None and s.hi is not None:
            lo, hi = np.nan_to_num(s.lo[idx]), np.nan_to_num(s.hi[idx])
            band = _path(np.concatenate([xs, xs[::-1]]), np.concatenate([py(hi), py(lo)[::-1]]))
            out.append(f'<path class="band" d="{band}Z" fill="{s.color}" fill-opacity="0.16" stroke="none"/>')
        out.append(f'<path class="line" d="{_path(xs, py(y))}" stroke="{s.color}">{title}</path>')
        if len(t) == 1:
            out.append(f'<circle cx="{xs[0]:.1f}" cy="{py(y)[0]:.1f}" r="3" fill="{s.color}"/>')
    if total is not None:
        out.append(f'<path class="line total" d="{_path(xs, py(np.nan_to_num(total.y[idx])))}" '
                   f'stroke="{total.color}"><title>{html.escape(total.label)}</title></path>')
    out.append(f'<line class="axis" x1="{LEFT}" x2="{width - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}"/>')
    hover = {"x0": LEFT, "x1": width - RIGHT, "t0": t0, "t1": t1, "t": [round(float(v), 3) for v in t],
             "s": [{"l": s.label, "c": s.color, "y": [round(float(v)) for v in y]}
                   for s, y in zip(series, ys, strict=True)]}
    if total is not None:
        hover["s"].append({"l": total.label, "c": total.color,
                           "y": [round(float(v)) for v in np.nan_to_num(total.y[idx])]})
    out.append(f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{TOP + plot_h}" visibility="hidden"/></svg>')
    # a raw-text <script> next to the svg: inside svg it would be parsed as markup
    data = json.dumps(hover, separators=(",", ":")).replace("<", "\\u003c")
    return Markup(f'<div class="chartbox">{"".join(out)}<script type="application/json">{data}</script></div>')
