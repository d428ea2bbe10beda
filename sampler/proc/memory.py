"""One memory sample of a process: psutil totals, the cgroup memory limit and the smaps breakdown."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


SAME_RSS = (1 << 20, 0.01)   # resident size within max(1 MiB, 1%) of the last sample's: the same memory


def sample_process(pid: int, previous: ProcessSample | None = None) -> ProcessSample:
    """Sample `pid`; ProcessLookupError when it is gone.

    psutil takes uss/pss/swap from smaps_rollup (a kernel-side sum, ~7x cheaper than reading
    smaps), so smaps itself is read once, by memory_breakdown. Both walk every page table of the
    process: with `previous` (its last full sample, which the caller keeps only for so long), a
    process whose resident size has not moved beyond SAME_RSS keeps that sample's breakdown,
    pss/uss/swap and limit, with its rss, vms, threads and name read now (statm: cheap). The
    recorder's largest cost on a busy server's steady processes was reading smaps again.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            comm = proc.name()
            threads = proc.num_threads()
            if previous is not None:
                now = proc.memory_info()
                if abs(now.rss - previous.rss) <= max(SAME_RSS[0], SAME_RSS[1] * previous.rss):
                    return replace(previous, comm=comm, rss=now.rss, vms=now.vms, threads=threads)
            mem = proc.memory_full_info()
    except psutil.NoSuchProcess as e:
        raise ProcessLookupError(f"process {pid} is gone") from e
    return ProcessSample(
        pid=pid, comm=comm, rss=mem.rss, pss=mem.pss, uss=mem.uss, swap=mem.swap, vms=mem.vms,
        threads=threads, memory_limit=memory_limit(pid), breakdown=memory_breakdown(pid),
    )
