"""The GPU sections of the HTML report: one process's GPU memory as the driver, the probes and the
caching allocator see it, and the devices as NVML saw them (markup: templates/gpu.html.j2)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from markupsafe import Markup

from analysis.dataset import Dataset
from analysis.detect.gpu import devices
from analysis.frames import Stacks
from analysis.report.charts import Series, chart, seconds
from analysis.report.sections import PALETTE, Key, TopStacks, top_stacks
from sampler.dataset.sources import GPU_SOURCES
from sampler.units import fmt_bytes

# processes columns of the memory chart: (column, label, colour)
MEMORY_COLUMNS = (("gpu_used_bytes", "used (NVML)", "#222"), ("gpu_reserved_bytes", "reserved (CUDA calls)", "#59a14f"),
                  ("gpu_allocated_bytes", "allocated (tensors)", "#4e79a7"),
                  ("gpu_pinned_bytes", "pinned host", "#b07aa1"))


@dataclass(frozen=True)
class ProcessGpu:
    svg: Markup | None               # memory over time; None without GPU columns
    keys: tuple[Key, ...]
    stacks: TopStacks | None         # top stacks of the GPU sources; None without any


@dataclass(frozen=True)
class Device:
    device: str
    name: str
    used_last: str
    used_peak: str
    total: str
    svg: Markup


def process_charts(p: pd.DataFrame, o: pd.DataFrame, times: np.ndarray, stacks: Stacks) -> ProcessGpu | None:
    """One process's GPU charts: memory as the driver, the probes and the caching allocator see
    it, and the top stacks of GPU sources. None without GPU data."""
    cols = [c for c in MEMORY_COLUMNS if c[0] in p and p[c[0]].notna().any()]
    has_stacks = "source" in o and o["source"].astype(str).isin(GPU_SOURCES).any()
    if not cols and not has_stacks:
        return None
    svg, keys = None, []
    if cols and "ts" in p:
        t = seconds(p["ts"])
        series = []
        for c, label, color in cols:
            y = p[c].to_numpy(dtype=float)
            lo = hi = None
            if c == "gpu_allocated_bytes" and "gpu_allocated_stderr_bytes" in p:
                e = np.nan_to_num(p["gpu_allocated_stderr_bytes"].to_numpy(dtype=float))
                lo, hi = np.maximum(np.nan_to_num(y) - 2 * e, 0), np.nan_to_num(y) + 2 * e
            series.append(Series(label, color, np.nan_to_num(y), lo, hi))
            last = y[~np.isnan(y)][-1] if (~np.isnan(y)).any() else 0.0
            keys.append(Key(f"{label} {fmt_bytes(last)}", color))
        svg = chart(t, series, label="GPU memory")
    top = None
    if has_stacks:
        g = o[o["source"].astype(str).isin(GPU_SOURCES)]
        top = top_stacks(g, times, stacks, title="Top stacks: GPU memory")
    return ProcessGpu(svg, tuple(keys), top)


def devices_section(ds: Dataset) -> list[Device]:
    """The devices as NVML saw them: used against total memory, per device."""
    g = devices(ds)
    out = []
    for i, (dev, d) in enumerate(g.groupby("device", observed=True) if len(g) else ()):
        d = d.groupby("ts", observed=True)[["used_bytes", "total_bytes"]].max().reset_index()
        color = PALETTE[i % len(PALETTE)]
        name = g[g["device"] == dev]["name"].astype(str).iloc[-1]
        svg = chart(seconds(d["ts"]), [Series("used", color, d["used_bytes"].to_numpy(dtype=float), fill=True),
                                       Series("total", "#999", d["total_bytes"].to_numpy(dtype=float))],
                    label=f"GPU {dev} memory")
        out.append(Device(str(dev), name, fmt_bytes(d["used_bytes"].iloc[-1]), fmt_bytes(d["used_bytes"].max()),
                          fmt_bytes(d["total_bytes"].iloc[-1]), svg))
    return out
