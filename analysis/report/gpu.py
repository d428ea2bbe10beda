"""The GPU sections of the HTML report: one process's GPU memory as the driver, the probes and the
caching allocator see it, and the devices as NVML saw them."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from analysis.dataset import Dataset
from analysis.detect.gpu import devices
from analysis.frames import Stacks
from analysis.report.charts import Series, chart, seconds
from analysis.report.sections import top_stacks
from analysis.units import fmt_bytes
from sampler.dataset.sources import GPU_SOURCES


def process_charts(p: pd.DataFrame, o: pd.DataFrame, times: np.ndarray, stacks: Stacks) -> str:
    """One process's GPU charts for the HTML report: memory as the driver, the probes and the
    caching allocator see it, and the top stacks of GPU sources. Empty without GPU data."""
    cols = [("gpu_used_bytes", "used (NVML)", "#222"), ("gpu_reserved_bytes", "reserved (CUDA calls)", "#59a14f"),
            ("gpu_allocated_bytes", "allocated (tensors)", "#4e79a7"), ("gpu_pinned_bytes", "pinned host", "#b07aa1")]
    cols = [c for c in cols if c[0] in p and p[c[0]].notna().any()]
    has_stacks = "source" in o and o["source"].astype(str).isin(GPU_SOURCES).any()
    if not cols and not has_stacks:
        return ""
    out = ["<h3>GPU memory</h3>"]
    if cols and "ts" in p:
        t = seconds(p["ts"])
        series, keys = [], []
        for c, label, color in cols:
            y = p[c].to_numpy(dtype=float)
            lo = hi = None
            if c == "gpu_allocated_bytes" and "gpu_allocated_stderr_bytes" in p:
                e = np.nan_to_num(p["gpu_allocated_stderr_bytes"].to_numpy(dtype=float))
                lo, hi = np.maximum(np.nan_to_num(y) - 2 * e, 0), np.nan_to_num(y) + 2 * e
            series.append(Series(label, color, np.nan_to_num(y), lo, hi))
            last = y[~np.isnan(y)][-1] if (~np.isnan(y)).any() else 0.0
            keys.append(f'<span><i style="background:{color}"></i>{html.escape(label)} {fmt_bytes(last)}</span>')
        out.append(chart(t, series, label="GPU memory") + f'<div class="keys">{"".join(keys)}</div>')
        out.append('<p class="note">Reserved: outstanding device memory of the traced CUDA calls (the larger of '
                   "the runtime and driver views); allocated: live tensors of PyTorch's caching allocator (sampled, "
                   "±2 standard errors); used: the driver's figure, which also holds the context.</p>")
    if has_stacks:
        g = o[o["source"].astype(str).isin(GPU_SOURCES)]
        out.append(top_stacks(g, times, stacks, head="<h3>Top stacks: GPU memory</h3>"))
    return "\n".join(out)


def devices_section(ds: Dataset) -> str:
    """The devices as NVML saw them: used against total memory, per device."""
    g = devices(ds)
    if g.empty:
        return ""
    palette = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
    out = ["<h2>GPU devices</h2>"]
    rows = []
    for i, (dev, d) in enumerate(g.groupby("device", observed=True)):
        d = d.groupby("ts", observed=True)[["used_bytes", "total_bytes"]].max().reset_index()
        color = palette[i % len(palette)]
        t = seconds(d["ts"])
        label = f"device {dev}"
        name = g[g["device"] == dev]["name"].astype(str).iloc[-1]
        out.append(f"<h3>{html.escape(label)}: {html.escape(name)}</h3>")
        out.append(chart(t, [Series("used", color, d["used_bytes"].to_numpy(dtype=float), fill=True),
                             Series("total", "#999", d["total_bytes"].to_numpy(dtype=float))],
                         label=f"GPU {dev} memory"))
        rows.append(f"<tr><td>{dev}</td><td>{html.escape(name)}</td><td>{fmt_bytes(d['used_bytes'].iloc[-1])}</td>"
                    f"<td>{fmt_bytes(d['used_bytes'].max())}</td><td>{fmt_bytes(d['total_bytes'].iloc[-1])}</td></tr>")
    out.insert(1, '<table class="list"><tr><th>device</th><th>name</th><th>used (last)</th><th>peak used</th>'
                  f'<th>total</th></tr>{"".join(rows)}</table>')
    return "\n".join(out)
