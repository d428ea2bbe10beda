"""GPU memory of a real PyTorch CUDA process: the caching allocator's segments through the CUDA
probes, expandable segments through the driver's VMM calls, the tensor view through PyTorch's
USDT probes, and NVML. These need an NVIDIA GPU (and torch with CUDA); without a device they are
skipped, which is the only skip in the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import WORKLOADS

from analysis.dataset import read_table

MiB = 1 << 20


def _nvidia_device() -> bool:
    if not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.bpf,
              pytest.mark.skipif(not _nvidia_device(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def cuda_torch():
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True)
    if out.stdout.strip() != "True":
        pytest.fail(f"a GPU is present but torch cannot use it ({out.stdout.strip()} {out.stderr[-300:]}): "
                    "install torch with CUDA to run the GPU tests")


def test_torch_caching_allocator_expandable_segments_tensors_and_nvml(cuda_torch, gated, record):
    argv = [sys.executable, str(WORKLOADS / "torch_cuda.py")]
    plain = gated(argv, ready="ready")
    expandable = gated(argv, ready="ready", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    rec = record("--pid", str(plain.pid), "--pid", str(expandable.pid), "-i", "1")
    rec.wait_attached(180)
    truth = {}
    for t in (plain, expandable):
        t.go()
        line = t.line()
        while not line.startswith("{"):     # torch may warn on stderr first
            line = t.line()
        truth[t.pid] = json.loads(line)
    code, _, err = rec.stop()
    assert code == 0, err
    for t in (plain, expandable):
        t.go()
        assert t.proc.wait(60) == 0
    out = rec.out
    procs = read_table(out, "processes")
    last = procs.sort_values("ts").groupby("pid").tail(1).set_index("pid")
    o = read_table(out, "outstanding")
    o = o[o["ts"] == o.groupby("pid")["ts"].transform("max")]
    by = o.groupby(["pid", "source"], observed=True)["outstanding_bytes"].sum()
    for pid, want in truth.items():
        reserved = float(last.loc[pid, "gpu_reserved_bytes"])
        # the probes see what the caching allocator reserved (plus any runtime-internal allocations)
        assert want["reserved"] <= reserved <= want["reserved"] + 64 * MiB, (pid, reserved, want)
        assert last.loc[pid, "gpu_used_bytes"] >= want["reserved"]          # NVML: includes the context
    # default allocator: cudaMalloc segments (runtime view, or the driver's when cudart is linked in)
    p = plain.pid
    seen = by.get((p, "cuda"), 0.0) or by.get((p, "cuda-driver"), 0.0)
    assert abs(seen - truth[p]["reserved"]) <= 64 * MiB
    stacks = read_table(out, "stacks")
    mine = o[(o["pid"] == p) & o["source"].astype(str).isin(["cuda", "cuda-driver"])].merge(stacks, on="stack_id")
    assert mine["summary"].str.contains("allocate_tensors").any(), mine["summary"].head().tolist()
    # expandable segments: physical memory through cuMemCreate, address space reserved but not counted
    e = expandable.pid
    assert by.get((e, "cuda-driver"), 0.0) >= truth[e]["reserved"]
    ev = read_table(out, "gpu_events")
    fn = set(ev[ev["pid"] == e]["function"].astype(str))
    assert {"cuMemCreate", "cuMemMap", "cuMemAddressReserve"} <= fn
    assert not ev[(ev["pid"] == e) & (ev["op"] == "reserve")]["counted"].any()
    # the tensor view, when this torch build carries its USDT probes
    libc10 = [a.split(":", 1)[1] for row in read_table(out, "targets")["allocators"] for a in row
              if a.startswith("pytorch:")]
    if libc10:
        for pid, want in truth.items():
            est = float(last.loc[pid, "gpu_allocated_bytes"])
            se = float(last.loc[pid, "gpu_allocated_stderr_bytes"])
            assert abs(est - want["allocated"]) <= 4 * se + 0.02 * want["allocated"], (est, se, want)
    g = read_table(out, "gpu")
    assert len(g) and (g["total_bytes"] > 0).all() and (g["used_bytes"] > 0).all()
    assert read_table(out, "recordings")["gpu_status"].iloc[-1].startswith("nvml:")
