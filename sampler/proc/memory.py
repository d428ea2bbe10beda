"""One memory sample of a process: psutil totals, the cgroup memory limit and the smaps breakdown."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from sampler.proc.cgroups import memory_limit
from sampler.proc.smaps import MemoryBreakdown, memory_breakdown


@dataclass
class ProcessSample:
    """Bytes from psutil (rss/vms from statm, pss/uss/swap from smaps_rollup) plus the breakdown."""

    pid: int
    comm: str  # psutil's name(): comm, completed from cmdline when the kernel truncated it
    rss: int
    pss: int
    uss: int
    swap: int
    vms: int
    threads: int
    memory_limit: int  # bytes: the tightest cgroup limit, at most the host's MemTotal
    breakdown: MemoryBreakdown


def sample_process(pid: int) -> ProcessSample:
    """Sample `pid`; ProcessLookupError when it is gone.

    psutil takes uss/pss/swap from smaps_rollup (a kernel-side sum, ~7x cheaper than reading
    smaps), so smaps itself is read once, by memory_breakdown.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            comm = proc.name()
            mem = proc.memory_full_info()
            threads = proc.num_threads()
    except psutil.NoSuchProcess as e:
        raise ProcessLookupError(f"process {pid} is gone") from e
    return ProcessSample(
        pid=pid, comm=comm, rss=mem.rss, pss=mem.pss, uss=mem.uss, swap=mem.swap, vms=mem.vms,
        threads=threads, memory_limit=memory_limit(pid), breakdown=memory_breakdown(pid),
    )
