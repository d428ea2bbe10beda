"""GPU memory without BPF: the CUDA probe table and library plans, the outstanding table's CUDA
and VMM accounting, NVML through a fake pynvml, the GPU findings and report sections, and the
PyTorch memory snapshot import."""

from __future__ import annotations

import datetime as dt
import pickle
import subprocess
import types
from pathlib import Path

import pandas as pd
import pytest
from conftest import WORKLOADS
from gpu_data import torch_snapshot

from analysis import analyze, dataset
from analysis.dataset import read_table
from analysis.report.html import render_html
from sampler.binary.elf import ElfImage
from sampler.bpf.abi import EvType
from sampler.bpf.events import Event
from sampler.dataset.schema import GPU, PROCESSES, RECORDINGS
from sampler.dataset.torch_import import import_snapshot
from sampler.dataset.writer import DatasetWriter
from sampler.errors import UsageError
from sampler.gpu import cuda
from sampler.gpu.nvml import Nvml
from sampler.record.outstanding import ProcessTable

MiB = 1 << 20


# --- probe table and plans ---------------------------------------------------------------------

def test_cookies_carry_function_convention_source_and_flags():
    c = cuda.cookie(cuda.FUNCTIONS[cuda.FN_ID["cudaMallocPitch"] - 1])
    assert c & 0xFF == cuda.FN_ID["cudaMallocPitch"] and (c >> 8) & 0xF == cuda.CV_PITCH
    assert (c >> 12) & 0xF == cuda.SRC_CUDA and c & cuda.CK_STACK and not c & cuda.CK_NULL_SKIP
    free = cuda.cookie(cuda.FUNCTIONS[cuda.FN_ID["cuMemFree_v2"] - 1])
    assert (free >> 12) & 0xF == cuda.SRC_CUDA_DRIVER and free & cuda.CK_NULL_SKIP and not free & cuda.CK_STACK
    assert cuda.by_id(cuda.FN_ID["cuMemCreate"]).source == "cuda-driver"
    assert cuda.by_id(cuda.FN_ID["cuMemHostAlloc"]).source == "cuda-driver-host"
    assert cuda.by_id(cuda.FN_ID["cudaHostRegister"]).source == "cuda-host"
    assert cuda.by_id(0) is None and cuda.by_id(255) is None


@pytest.mark.parametrize("name, layer", [
    ("libcudart.so.12", "cuda"), ("libcudart.so.12.4.127", "cuda"), ("libcudart.so", "cuda"),
    ("libcudart-9335f6a2.so.12", "cuda"), ("libcuda.so.1", "cuda-driver"), ("libcuda.so.535.104.05", "cuda-driver"),
    ("libcudart_static.a", None), ("libcudadevrt.a", None), ("libcudnn.so.9", None), ("libcuda_stub.so", None),
])
def test_library_names(name, layer):
    assert cuda.layer_of_file(f"/x/{name}") == layer


def _cc(src: str, out: Path, *flags: str) -> Path:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", *flags, "-o", str(out), str(c)], check=True)
    return out


def test_plan_finds_every_function_and_skips_one_that_calls_another(tmp_path):
    drv = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(drv), str(WORKLOADS / "cudastub_driver.c")], check=True)
    plan = cuda.plan_library(ElfImage.open(str(drv)), cuda.CUDA_DRIVER, str(drv))
    want = {f.name for f in cuda.FUNCTIONS if f.layer == cuda.CUDA_DRIVER}
    assert {p.name for p in plan.points} == want and not plan.skipped
    # cudaMallocHost calling the exported cudaHostAlloc (through the PLT) would count twice: not probed
    rt = _cc("int cudaHostAlloc(void **p, unsigned long n, unsigned f) { *p = (void *)n; return f; }\n"
             "int cudaMallocHost(void **p, unsigned long n) { return cudaHostAlloc(p, n, 0) + 1; }\n",
             tmp_path / "libcudart.so.12")
    plan = cuda.plan_library(ElfImage.open(str(rt)), cuda.CUDA, str(rt))
    assert [p.name for p in plan.points] == ["cudaHostAlloc"]
    assert plan.skipped == [("cudaMallocHost", "calls cudaHostAlloc, which is probed")]


# --- outstanding accounting --------------------------------------------------------------------

def test_cuda_blocks_are_exact_and_a_free_never_removes_a_later_allocation():
    t = ProcessTable()
    t.gpu_alloc("cuda", 0x1000, 4 * MiB, 7, ts_ns=100)
    t.gpu_alloc("cuda-driver", 0x1000, 4 * MiB, 8, ts_ns=101)     # the same memory, the other layer
    assert t.totals("cuda") == (4 * MiB, 0.0) and t.totals("cuda-driver") == (4 * MiB, 0.0)
    assert not t.gpu_free("cuda", 0x1000, started_ns=50)          # started before the allocation returned
    assert t.gpu_free("cuda", 0x1000, started_ns=150)
    assert not t.gpu_free("cuda", 0x1000, started_ns=160)         # a double free, or unknown
    assert t.totals("cuda") == (0.0, 0.0) and t.totals("cuda-driver")[0] == 4 * MiB
    rows = {r["source"]: r for r in t.snapshot(200)}
    assert rows["cuda"]["freed_bytes"] == 4 * MiB and rows["cuda"]["outstanding_stderr_bytes"] == 0


def test_vmm_physical_memory_goes_when_released_and_unmapped():
    t = ProcessTable()
    for h in (1, 2, 3):
        t.gpu_alloc("cuda-driver", h, 2 * MiB, 9, ts_ns=10, handle=True)
    t.gpu_alloc("cuda-driver", 1, MiB, 5, ts_ns=11)               # a device pointer equal to a handle
    assert t.vmm_map(0x10_0000, 2 * MiB, 1) is False and t.vmm_map(0x30_0000, 2 * MiB, 2) is False
    assert not t.vmm_map(0x50_0000, 2 * MiB, 99)                  # unknown handle
    assert t.vmm_release(1, started_ns=20) is False               # still mapped
    assert t.vmm_unmap(0x30_0000, 2 * MiB) is False               # handle 2 not released yet
    assert t.vmm_release(2, started_ns=30) is True
    assert t.totals("cuda-driver")[0] == 2 * 2 * MiB + MiB         # handles 1 (mapped) and 3, the pointer
    assert t.vmm_unmap(0x0, 1 << 30) is True                      # unmaps handle 1: gone
    assert t.totals("cuda-driver")[0] == 2 * MiB + MiB
    assert t.gpu_free("cuda-driver", 1, started_ns=40)            # the pointer, not the handle
    assert t.totals("cuda-driver")[0] == 2 * MiB
    t.clear()
    assert not t.gpu and not t.vmm_refs and not t.vmm_maps


def test_failed_calls_and_address_reservations_count_nothing():
    t = ProcessTable()
    fn = cuda.by_id(cuda.FN_ID["cudaMalloc"])
    assert not cuda.apply_call(t, fn, False, 0xdead0000, MiB, 0, 1, 2, 3)
    reserve = cuda.by_id(cuda.FN_ID["cuMemAddressReserve"])
    assert not cuda.apply_call(t, reserve, True, 0x7000_0000, 1 << 30, 0, 1, 2, 3)
    assert not t.stats and not t.gpu


class _Probes:
    def __init__(self):
        self.attached = []

    def attach_cuda(self, pid, path, offsets, cookies):
        self.attached.append((pid, path, len(offsets)))

    def attach_torch(self, pid, path, probes):
        self.attached.append((pid, path, len(probes)))


def _ev(fn: str, ret: int = 0, addr: int = 0, size: int = 0, arg: int = 0, ts: int = 1000, started: int = 900,
        pid: int = 42) -> Event:
    src = cuda.SRC_CUDA if fn.startswith("cuda") else cuda.SRC_CUDA_DRIVER
    return Event(EvType.CUDA, src, cuda.FN_ID[fn], pid, pid, 0, ts, addr, size, started, arg, ret)


def test_tracer_rows_and_process_columns():
    tr = cuda.GpuTracer(_Probes(), nvml=None)
    tr.targets[42] = cuda._GpuTarget(cuda=True)
    t = ProcessTable()
    stacks = iter(range(100, 200))
    wall = lambda ns: dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc)     # noqa: E731
    tr.on_event(t, _ev("cudaMalloc", addr=0x5000, size=3 * MiB), lambda ev: next(stacks), wall)
    tr.on_event(t, _ev("cudaMalloc", ret=2, size=1 << 41), lambda ev: next(stacks), wall)
    tr.on_event(t, _ev("cudaHostAlloc", addr=0x9000, size=MiB), lambda ev: next(stacks), wall)
    tr.on_event(t, _ev("cudaFree", addr=0x5000, size=77, ts=3000, started=2000), lambda ev: 0, wall)
    tr.on_event(t, _ev("cuMemMap", addr=0x7000, size=MiB, arg=0x1234), lambda ev: next(stacks), wall)
    rows = tr.drain_rows()
    assert [(r["function"], r["result"], r["counted"]) for r in rows] == [
        ("cudaMalloc", 0, True), ("cudaMalloc", 2, False), ("cudaHostAlloc", 0, True), ("cudaFree", 0, True),
        ("cuMemMap", 0, False)]
    assert rows[1]["error"] == "cudaErrorMemoryAllocation" and rows[1]["stack_id"] is not None
    assert rows[3]["stack_id"] is None and rows[3]["size"] is None and rows[3]["duration_us"] == 1.0
    assert rows[4]["handle"] == 0x1234 and rows[0]["source"] == "cuda" and rows[2]["source"] == "cuda-host"
    cols = tr.process_columns(42, t)
    assert cols == {"gpu_used_bytes": None, "gpu_reserved_bytes": 0.0, "gpu_pinned_bytes": float(MiB),
                    "gpu_allocated_bytes": None, "gpu_allocated_stderr_bytes": None}
    assert tr.process_columns(7, t)["gpu_reserved_bytes"] is None          # no CUDA in that process


# --- NVML ----------------------------------------------------------------------------------------

class _NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(*, init_error: int | None = None, devices: int = 2):
    m = types.SimpleNamespace(NVMLError=_NVMLError, NVML_ERROR_LIBRARY_NOT_FOUND=12, nvmlMemory_v2=0x2000028)

    def init():
        if init_error is not None:
            raise _NVMLError(init_error)
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: devices
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"

    def mem(h, version=None):
        assert version == m.nvmlMemory_v2
        return types.SimpleNamespace(total=80 << 30, used=(10 + h) << 30, reserved=512 * MiB, free=0)
    m.nvmlDeviceGetMemoryInfo = mem
    proc = types.SimpleNamespace
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [proc(pid=100, usedGpuMemory=(2 + h) << 30),
                                                         proc(pid=200, usedGpuMemory=None)]
    m.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [proc(pid=100, usedGpuMemory=(2 + h) << 30)]
    return m


def test_nvml_devices_and_processes():
    n = Nvml(fake_pynvml())
    assert n.ok and n.status == "nvml: 2 devices, driver 550.54.15"
    s = n.sample()
    assert [(d.index, d.used, d.reserved, d.processes) for d in s.devices] == [
        (0, 10 << 30, 512 * MiB, 2), (1, 11 << 30, 512 * MiB, 2)]
    assert s.used_by_pid == {100: (2 << 30) + (3 << 30)}         # both devices, listed twice on each: once
    assert s.pids == {100, 200}                                   # 200: usage not available
    tr = cuda.GpuTracer(_Probes(), n)
    tr.targets[300] = cuda._GpuTarget(cuda=True)
    tr.sample()
    assert tr.process_columns(100, ProcessTable())["gpu_used_bytes"] == 5 << 30
    assert tr.process_columns(200, ProcessTable())["gpu_used_bytes"] is None
    assert tr.process_columns(300, ProcessTable())["gpu_used_bytes"] == 0      # CUDA loaded, no context
    assert tr.device_rows()[0] == {"device": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3",
                                   "total_bytes": 80 << 30, "used_bytes": 10 << 30, "reserved_bytes": 512 * MiB,
                                   "processes": 2}


def test_no_driver_is_one_line_and_no_samples():
    n = Nvml(fake_pynvml(init_error=12))
    assert not n.ok and n.status.startswith("no NVIDIA driver: libnvidia-ml.so.1 not found")
    assert n.sample().devices == [] and "\n" not in n.status
    real = Nvml()                    # this machine: no driver (or pynvml missing): never raises
    assert real.status and (real.ok or real.sample().devices == [])


# --- findings and report -------------------------------------------------------------------------

def _write_gpu_dataset(root: Path, *, n: int = 12) -> None:
    """A process whose cudaMalloc stack grows 64 MiB per interval, whose caching allocator keeps
    4 GiB reserved with 1 GiB of tensors, and whose NVML figure grows 128 MiB per interval more
    than its traced allocations."""
    rec = "r1"
    w = DatasetWriter(root, rec)
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)
    base = {"recording_id": rec, "host": "h"}
    out, procs, gpu = [], [], []
    for i in range(n):
        ts = t0 + dt.timedelta(seconds=10 * i)
        grow = 64 * MiB * (i + 1)
        common = {**base, "ts": ts, "interval_s": 10.0, "pid": 7, "comm": "trainer", "outstanding_stderr_bytes": 0.0,
                  "outstanding_objects": 1.0, "outstanding_stderr_objects": 0.0, "allocated_stderr_bytes": 0.0,
                  "freed_bytes": 0.0, "freed_objects": 0.0, "free_samples": 0, "oldest_age_s": None}
        out.append({**common, "source": "cuda", "stack_id": 11, "outstanding_bytes": float(grow), "live_samples": i + 1,
                    "allocated_bytes": 64.0 * MiB, "allocated_objects": 1.0, "alloc_samples": 1})
        out.append({**common, "source": "cuda", "stack_id": 12, "outstanding_bytes": 4096.0 * MiB, "live_samples": 2,
                    "allocated_bytes": 4096.0 * MiB if i == 0 else 0.0, "allocated_objects": 0.0,
                    "alloc_samples": 2 if i == 0 else 0})
        reserved = 4096.0 * MiB + grow
        procs.append({**base, "ts": ts, "pid": 7, "comm": "trainer", "rss": 1 << 30, "memory_limit": 64 << 30,
                      "gpu_used_bytes": int(reserved + 600 * MiB + 128 * MiB * i), "gpu_reserved_bytes": reserved,
                      "gpu_allocated_bytes": 1024.0 * MiB, "gpu_allocated_stderr_bytes": 8.0 * MiB,
                      "gpu_pinned_bytes": 0.0})
        gpu.append({**base, "ts": ts, "device": 0, "uuid": "GPU-0", "name": "H100", "total_bytes": 80 << 30,
                    "used_bytes": int(reserved) + (2 << 30), "reserved_bytes": 512 * MiB, "processes": 1})
    from sampler.dataset.schema import OUTSTANDING, STACKS
    w.write(OUTSTANDING, out)
    w.write(PROCESSES, procs)
    w.write(GPU, gpu)
    w.write(STACKS, [{**base, "ts": t0, "stack_id": s, "n_frames": 0, "truncated": False, "site": None,
                      "summary": "", "unwind_stop": "entry", "python_frames": 0} for s in (11, 12)])
    w.write(RECORDINGS, [{"recording_id": rec, "host": "h", "started": t0, "schema_version": 4,
                          "gpu_status": "nvml: 1 device, driver 550"}], name=rec)


def test_gpu_findings_and_report(tmp_path, monkeypatch):
    _write_gpu_dataset(tmp_path)
    ds = analyze.load(tmp_path)
    findings = analyze.run(ds)
    kinds = sorted(f.kind for f in findings)
    assert kinds == ["gpu_fragmentation", "gpu_growth", "gpu_unexplained_growth"], [f.summary for f in findings]
    # the same from parts of one process, which hold only the `processes` columns detectors declare
    monkeypatch.setattr(dataset, "PART_ROWS", 1)
    assert analyze.to_document(analyze.run(analyze.load(tmp_path))) == analyze.to_document(findings)
    monkeypatch.undo()
    g = next(f for f in findings if f.kind == "gpu_growth")
    doc = analyze.to_document([g])["findings"][0]
    persistent_keys = {"source", "stack_id", "frames", "growth_bytes_per_hour", "outstanding_bytes",
                       "outstanding_stderr_bytes", "first_seen", "last_seen", "time_to_oom_hours",
                       "time_to_oom_basis", "memory_limit_bytes", "pattern", "classification", "z", "recording_id"}
    assert persistent_keys <= set(doc) and doc["stack_id"] == 11 and doc["source"] == "cuda"
    assert doc["memory_limit_bytes"] == 80 << 30 and doc["time_to_oom_hours"] > 0
    assert abs(doc["growth_bytes_per_hour"] - 64 * MiB * 360) < 0.01 * 64 * MiB * 360
    frag = next(f for f in findings if f.kind == "gpu_fragmentation").details
    assert frag["allocated_bytes"] == 1024 * MiB and frag["reserved_bytes"] == 4096 * MiB + 12 * 64 * MiB
    assert 0.75 < frag["fragmentation_ratio"] < 0.85 and frag["recommendation"]
    un = next(f for f in findings if f.kind == "gpu_unexplained_growth").details
    assert abs(un["unexplained_growth_bytes"] - 11 * 128 * MiB) < 1 * MiB
    page = render_html(ds, findings)
    assert "<h3>GPU memory</h3>" in page and "Top stacks: GPU memory" in page and "GPU devices" in page
    assert "used (NVML)" in page and "allocated (tensors)" in page


# --- PyTorch snapshot import ---------------------------------------------------------------------

def test_torch_snapshot_import(tmp_path):
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(torch_snapshot()))
    s = import_snapshot(snap, tmp_path / "ds", pid=4242, comm="train")
    assert s.reserved_bytes == 44 * MiB and s.allocated_bytes == 18 * MiB and s.points > 20
    out = read_table(tmp_path / "ds", "outstanding")
    last = out[out["ts"] == out["ts"].max()]
    assert last.groupby("source", observed=True)["outstanding_bytes"].sum().to_dict() == {
        "cuda": 40 * MiB, "cuda-driver": 4 * MiB, "torch": 18 * MiB}
    first = out[out["ts"] == out["ts"].min()]
    assert first.groupby("source", observed=True)["outstanding_bytes"].sum().to_dict() == {"cuda": 20 * MiB}
    procs = read_table(tmp_path / "ds", "processes").sort_values("ts")
    assert procs["gpu_allocated_bytes"].max() <= 18 * MiB + MiB and procs["pid"].eq(4242).all()
    assert procs["gpu_reserved_bytes"].is_monotonic_increasing
    frames = read_table(tmp_path / "ds", "frames")
    assert set(frames[frames["kind"] == "python"]["function"]) == {"py_step", "py_cache", "py_tmp", "py_eval",
                                                                     "py_big"}
    findings = analyze.run(analyze.load(tmp_path / "ds"))
    growth = [f for f in findings if f.kind == "gpu_growth"]
    assert [f.details["frames"][0]["function"] for f in growth] == ["py_cache"], [f.summary for f in findings]
    assert growth[0].details["source"] == "torch"
    frag = [f for f in findings if f.kind == "gpu_fragmentation"]
    assert not frag                                  # 26 MiB unused: under the 64 MiB threshold


def test_torch_snapshot_without_trace_and_hostile_pickles(tmp_path):
    snap = torch_snapshot()
    snap.pop("device_traces")
    p = tmp_path / "notrace.pickle"
    p.write_bytes(pickle.dumps(snap))
    s = import_snapshot(p, tmp_path / "ds", at=dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc))
    assert s.points == 1
    assert read_table(tmp_path / "ds", "processes")["ts"].iloc[0] == pd.Timestamp("2026-01-02", tz="UTC")
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "x": dt.date(2026, 1, 1)}))
    with pytest.raises(UsageError, match="datetime"):
        import_snapshot(evil, tmp_path / "ds2")
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="not a pickle"):
        import_snapshot(tmp_path / "junk.pickle", tmp_path / "ds3")


def test_command_line(tmp_path, capsys):
    from sampler.cli import build_parser, main
    assert build_parser().parse_args(["record", "--no-gpu", "--pid", "1"]).gpu is False
    assert build_parser().parse_args(["record", "--pid", "1"]).gpu is True
    assert build_parser().parse_args(["analyze", "d", "--source", "cuda-driver"]).source == ["cuda-driver"]
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(torch_snapshot()))
    assert main(["import-torch", str(snap), "--out", str(tmp_path / "ds"), "--pid", "9"]) == 0
    assert "reserved 44.0 MiB, allocated 18.0 MiB" in capsys.readouterr().out
    assert main(["import-torch", str(tmp_path / "missing.pickle"), "--out", str(tmp_path / "ds")]) == 2
    assert "cannot read" in capsys.readouterr().err
