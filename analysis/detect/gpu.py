"""GPU memory findings and charts.

- `gpu_growth`: a stack whose CUDA allocations (sources cuda, cuda-driver, their pinned-host
  twins, or PyTorch tensors) keep growing to the end of the window: the persistent-growth
  classification of analysis/detect/growth.py, in the same JSON shape as `persistent_growth`, with the
  device's memory as the limit.
- `gpu_fragmentation`: PyTorch's caching allocator holds much more than its live tensors
  (reserved vs allocated, from the tensor-level view: pytorch USDT probes, or an imported
  memory snapshot).
- `gpu_unexplained_growth`: the driver's per-process figure (NVML) grows beyond the traced
  allocations: memory the probes cannot see.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from analysis.dataset import Dataset, read_table
from analysis.detect.stats import bin_series, mann_kendall, normal_sf, theil_sen
from analysis.findings import Finding
from analysis.units import fmt_hours
from sampler.dataset.schema import DEVICE_SOURCES, GPU_SOURCES, HOST_SOURCES, TORCH
from sampler.units import fmt_bytes

MiB = 1 << 20
_WHAT = {**dict.fromkeys(DEVICE_SOURCES, "device memory"), **dict.fromkeys(HOST_SOURCES, "pinned host memory"),
         TORCH: "tensor memory"}
FRAG_MIN_BYTES = 64 * MiB
FRAG_MIN_RATIO = 0.25
UNEXPLAINED_MIN_BYTES = 64 * MiB


def detect_gpu(ds: Dataset, series: pd.DataFrame | None = None) -> list[Finding]:
    """Every GPU finding of a dataset; `series` is analysis.detect.growth.classify_series(ds) when the
    caller has it already."""
    if series is None:
        from analysis.detect.growth import classify_series
        series = classify_series(ds)
    return gpu_growth(ds, series) + gpu_fragmentation(ds) + gpu_unexplained_growth(ds)


def devices(ds: Dataset) -> pd.DataFrame:
    """The `gpu` table (NVML, per device and interval) in the dataset's time window (read once
    per Dataset)."""
    g = getattr(ds, "_gpu_devices", None)
    if g is None:
        g = read_table(ds.root, "gpu")
        since, until = _window(ds)
        if len(g) and since is not None:
            g = g[(g["ts"] >= since) & (g["ts"] <= until)]
        ds._gpu_devices = g
    return g


def _window(ds: Dataset) -> tuple:
    p = ds.processes
    if p.empty:
        return None, None
    return p["ts"].min(), p["ts"].max()


def _device_total(ds: Dataset) -> float:
    """Memory of the largest device seen (the process's allocations may be on any of them)."""
    g = devices(ds)
    return float(g["total_bytes"].max()) if len(g) and g["total_bytes"].notna().any() else 0.0


def _last_process(ds: Dataset, rec: str, pid: int) -> pd.Series | None:
    p = ds.processes
    p = p[(p["recording_id"] == rec) & (p["pid"] == pid)]
    return p.sort_values("ts").iloc[-1] if len(p) else None


def gpu_growth(ds: Dataset, series: pd.DataFrame) -> list[Finding]:
    from analysis.detect.growth import _site, frames_json, time_to_oom_hours

    findings = []
    if not len(series):
        return findings
    leaks = series[(series["classification"] == "leak") & series["source"].astype(str).isin(GPU_SOURCES)]
    total = _device_total(ds) if len(leaks) else 0.0
    for r in leaks.itertuples():
        source = str(r.source)
        host = source in HOST_SOURCES
        last = _last_process(ds, r.recording_id, r.pid)
        if host:
            limit = float(last["memory_limit"]) if last is not None and pd.notna(last["memory_limit"]) else 0.0
            used = float(last["rss"]) if last is not None and pd.notna(last.get("rss")) else 0.0
        else:
            limit = total
            used = 0.0
            if last is not None:
                for col in ("gpu_used_bytes", "gpu_reserved_bytes"):
                    if col in last and pd.notna(last[col]):
                        used = max(used, float(last[col]))
        rate_h = r.rate_bytes_per_s * 3600
        ttoom, basis = time_to_oom_hours(used, limit, 0.0, r.rate_bytes_per_s) if limit else (None, "")
        frames = frames_json(ds, r.stack_id)
        site = _site(frames)
        severity = min(100.0, 100.0 * rate_h * 24 / limit) * r.confidence if limit else 50 * r.confidence
        text = (f"{site} holds {fmt_bytes(r.outstanding_bytes)} of {_WHAT[source]} ({source}) and grows "
                f"{fmt_bytes(rate_h)}/h to the end of the window"
                + (" in a sawtooth" if r.pattern == "sawtooth" else ""))
        if ttoom is not None:
            whose = "the process reaches its" if host else "the GPU fills its"
            text += f"; {whose} {fmt_bytes(limit)} in {fmt_hours(ttoom)}"
        findings.append(Finding(
            "gpu_growth", r.pid, r.comm, severity, r.confidence, text + ".",
            {"source": source, "stack_id": int(r.stack_id), "frames": frames, "growth_bytes_per_hour": rate_h,
             "outstanding_bytes": r.outstanding_bytes, "outstanding_stderr_bytes": r.outstanding_stderr_bytes,
             "first_seen": r.first_seen, "last_seen": r.last_seen, "time_to_oom_hours": ttoom,
             "time_to_oom_basis": basis or None, "memory_limit_bytes": limit or None, "pattern": r.pattern,
             "classification": "leak", "z": r.z, "recording_id": r.recording_id}))
    return findings


def gpu_fragmentation(ds: Dataset) -> list[Finding]:
    """PyTorch's caching allocator reserves (segments from cudaMalloc or cuMemCreate) much more
    than its tensors use, at the end of the window."""
    p = ds.processes
    need = {"gpu_reserved_bytes", "gpu_allocated_bytes"}
    if p.empty or not need <= set(p.columns):
        return []
    p = p[p["gpu_reserved_bytes"].notna() & p["gpu_allocated_bytes"].notna()]
    total = _device_total(ds) if len(p) else 0.0
    findings = []
    for (rec, pid), g in p.groupby(["recording_id", "pid"], observed=True):
        g = g.sort_values("ts")
        last = g.iloc[-1]
        reserved, allocated = float(last["gpu_reserved_bytes"]), float(last["gpu_allocated_bytes"])
        se = float(last["gpu_allocated_stderr_bytes"]) if "gpu_allocated_stderr_bytes" in g and \
            pd.notna(last["gpu_allocated_stderr_bytes"]) else 0.0
        unused = reserved - allocated
        if reserved <= 0 or unused < max(FRAG_MIN_BYTES, 3 * se) or unused / reserved < FRAG_MIN_RATIO:
            continue
        ratio = unused / reserved
        severity = min(100.0, 200.0 * unused / total) if total else 40.0 * ratio
        confidence = 1.0 - normal_sf(unused / se) if se > 0 else 1.0
        peak = float(g["gpu_reserved_bytes"].max())
        findings.append(Finding(
            "gpu_fragmentation", int(pid), str(last["comm"]), severity, min(confidence, 0.999),
            f"PyTorch's caching allocator reserves {fmt_bytes(reserved)} of GPU memory but its live tensors use "
            f"{fmt_bytes(allocated)}: {100 * ratio:.0f}% ({fmt_bytes(unused)}) is cached but unused "
            "(free blocks in its segments, or segments it keeps).",
            {"reserved_bytes": reserved, "allocated_bytes": allocated, "allocated_stderr_bytes": se,
             "unused_bytes": unused, "fragmentation_ratio": ratio, "peak_reserved_bytes": peak,
             "device_total_bytes": total or None, "first_seen": g["ts"].iloc[0], "last_seen": last["ts"],
             "recording_id": rec,
             "recommendation": [
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow and shrink in place "
                 "instead of leaving partly used blocks behind",
                 "torch.cuda.empty_cache() after a peak (e.g. evaluation) gives unused segments back to the driver",
                 "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N keeps large cached blocks from being split "
                 "for small tensors"]}))
    return findings


def gpu_unexplained_growth(ds: Dataset) -> list[Finding]:
    """NVML's per-process used memory minus the traced device allocations grows: memory outside
    what the probes see (pools of cudaMallocAsync, libraries with CUDA linked in statically, the
    context and its module images, NCCL, cuBLAS/cuDNN workspaces from another allocator)."""
    p = ds.processes
    if p.empty or not {"gpu_used_bytes", "gpu_reserved_bytes"} <= set(p.columns):
        return []
    p = p[p["gpu_used_bytes"].notna() & p["gpu_reserved_bytes"].notna()]
    findings = []
    for (rec, pid), g in p.groupby(["recording_id", "pid"], observed=True):
        if len(g) < 4:
            continue
        g = g.sort_values("ts")
        t = (g["ts"] - g["ts"].iloc[0]).dt.total_seconds().to_numpy()
        used = g["gpu_used_bytes"].to_numpy(float)
        reserved = g["gpu_reserved_bytes"].to_numpy(float)
        gap = used - reserved
        tb, yb, _ = bin_series(t, gap, np.zeros_like(gap), 200)
        if tb[-1] <= tb[0]:
            continue
        slope = theil_sen(tb, yb)
        growth = slope * (tb[-1] - tb[0])
        _, mk_p = mann_kendall(yb)
        if growth < max(UNEXPLAINED_MIN_BYTES, 0.05 * max(used[0], 0.0)) or (len(yb) >= 8 and mk_p >= 0.01):
            continue
        used_growth, explained = float(used[-1] - used[0]), float(reserved[-1] - reserved[0])
        total = _device_total(ds)
        rate_h = slope * 3600
        severity = min(100.0, 100.0 * rate_h * 24 / total) * 0.8 if total else 30.0
        first, last = g.iloc[0], g.iloc[-1]
        findings.append(Finding(
            "gpu_unexplained_growth", int(pid), str(last["comm"]), severity,
            1.0 - (mk_p if len(yb) >= 8 else 0.0),
            f"GPU memory of the process (NVML) grew {fmt_bytes(used_growth)} but traced CUDA allocations grew "
            f"{fmt_bytes(explained)}: {fmt_bytes(growth)} ({fmt_bytes(rate_h)}/h) is memory the probes do not see "
            "(cudaMallocAsync pools, a library with the CUDA runtime linked in statically, NCCL or workspace "
            "buffers, the context's module images).",
            {"gpu_used_growth_bytes": used_growth, "explained_growth_bytes": explained,
             "unexplained_growth_bytes": growth, "unexplained_bytes": float(gap[-1]),
             "growth_bytes_per_hour": rate_h, "first_seen": first["ts"], "last_seen": last["ts"],
             "device_total_bytes": total or None, "recording_id": rec}))
    return findings


# --- report -------------------------------------------------------------------------------------

def process_section(p: pd.DataFrame, o: pd.DataFrame, times: np.ndarray, stacks) -> str:
    """One process's GPU charts for the HTML report: memory as the driver, the probes and the
    caching allocator see it, and the top stacks of GPU sources. Empty without GPU data."""
    from analysis.report.charts import Series, chart, seconds
    from analysis.report.html import _top_stacks

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
        out.append(_top_stacks(g, times, stacks, head="<h3>Top stacks: GPU memory</h3>"))
    return "\n".join(out)


def devices_section(ds: Dataset) -> str:
    """The devices as NVML saw them: used against total memory, per device."""
    from analysis.report.charts import Series, chart, seconds

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
