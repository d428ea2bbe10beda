"""GPU memory findings (their charts: analysis/report/gpu.py).

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

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.dataset import Dataset, read_table
from analysis.detect.growth import PersistentGrowth, classify_series, growth_phrase, rate_stderr, time_to_oom_hours
from analysis.detect.stats import bin_series, mann_kendall, normal_sf, theil_sen
from analysis.findings import Finding
from analysis.frames import frames_json, site
from analysis.units import fmt_hours
from sampler.dataset.sources import DEVICE_SOURCES, GPU_SOURCES, HOST_SOURCES, TORCH
from sampler.units import fmt_bytes

MiB = 1 << 20
_WHAT = {**dict.fromkeys(DEVICE_SOURCES, "device memory"), **dict.fromkeys(HOST_SOURCES, "pinned host memory"),
         TORCH: "tensor memory"}
PROCESS_COLUMNS = ("ts", "recording_id", "pid", "comm", "rss", "memory_limit", "gpu_used_bytes", "gpu_reserved_bytes",
                   "gpu_allocated_bytes", "gpu_allocated_stderr_bytes")      # what it reads of `processes`
FRAG_MIN_BYTES = 64 * MiB
FRAG_MIN_RATIO = 0.25
UNEXPLAINED_MIN_BYTES = 64 * MiB


@dataclass
class GpuGrowth(PersistentGrowth):
    """`gpu_growth`: a stack whose GPU allocations keep growing (persistent_growth's fields and facts)."""

    kind: str = field(default="gpu_growth", init=False)

    def next_step(self) -> str:
        return ("The stack allocates GPU memory that is never freed: look for tensors or buffers kept alive "
                "(caches, lists of outputs, graphs held by .grad_fn).")


@dataclass
class GpuFragmentation(Finding):
    """`gpu_fragmentation`: PyTorch's caching allocator reserves much more than its tensors use."""

    kind: str = field(default="gpu_fragmentation", init=False)

    def next_step(self) -> str:
        return "Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or torch.cuda.empty_cache() after peaks."


@dataclass
class GpuUnexplainedGrowth(Finding):
    """`gpu_unexplained_growth`: the driver's figure grows beyond the traced allocations."""

    kind: str = field(default="gpu_unexplained_growth", init=False)

    def next_step(self) -> str:
        return "Memory outside traced CUDA calls: check cudaMallocAsync pools, NCCL, statically linked CUDA runtimes."


def detect_gpu(ds: Dataset, series: pd.DataFrame | None = None) -> list[Finding]:
    """Every GPU finding of a dataset; `series` is analysis.detect.growth.classify_series(ds) when the
    caller has it already."""
    if series is None:
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
        se_h = rate_stderr(r.rate_bytes_per_s, r.tail_z) * 3600
        ttoom, basis = time_to_oom_hours(used, limit, 0.0, r.rate_bytes_per_s) if limit else (None, "")
        frames = frames_json(ds, r.stack_id)
        where = site(frames)
        severity = min(100.0, 100.0 * rate_h * 24 / limit) * r.confidence if limit else 50 * r.confidence
        text = (f"{where} holds {fmt_bytes(r.outstanding_bytes)} of {_WHAT[source]} ({source}) and "
                + growth_phrase(rate_h, r.pattern, r.paused_s, "window", stderr_h=se_h))
        if ttoom is not None:
            whose = "the process reaches its" if host else "the GPU fills its"
            text += f"; {whose} {fmt_bytes(limit)} in {fmt_hours(ttoom)}"
        findings.append(GpuGrowth(
            r.pid, r.comm, severity, r.confidence, text + ".",
            {"source": source, "stack_id": int(r.stack_id), "frames": frames, "growth_bytes_per_hour": rate_h,
             "growth_stderr_bytes_per_hour": se_h,
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
        findings.append(GpuFragmentation(
            int(pid), str(last["comm"]), severity, min(confidence, 0.999),
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
        findings.append(GpuUnexplainedGrowth(
            int(pid), str(last["comm"]), severity,
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
