"""One memory sample of a process: psutil totals, the cgroup memory limit and the smaps breakdown."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import psutil

from sampler.proc.smaps import MemoryBreakdown, memory_breakdown

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


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


def memory_limit(pid: int) -> int:
    """Smallest memory limit over the process's cgroup and its ancestors, capped by MemTotal.

    cgroup v2 `memory.max` wins; cgroup v1 `memory.limit_in_bytes` is used only when no v2
    limit is set (hybrid hosts keep the memory controller on v1).
    """
    limits = _cgroup_limits(pid, "cgroup2", "memory.max") or _cgroup_limits(
        pid, "cgroup", "memory.limit_in_bytes"
    )
    return min([*limits, _mem_total()])


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _cgroup_limits(pid: int, fstype: str, limit_file: str) -> list[int]:
    """Finite limits in `limit_file` from the process's cgroup up to the mount's root."""
    return [limit for _, limit in cgroup_limit_dirs(pid, fstype, limit_file)]


def cgroup_limit_dirs(pid: int, fstype: str, limit_file: str) -> list[tuple[str, int]]:
    """(cgroup directory, limit) of each cgroup from the process's own up to the mount's root
    whose `limit_file` holds a finite limit (a missing or unreadable file: none there)."""
    directory = _cgroup_dir(pid, fstype)
    if directory is None:
        return []
    mount_point, cgroup_dir = directory
    out = []
    while True:
        try:
            with open(os.path.join(cgroup_dir, limit_file)) as f:
                value = f.read().strip()
            if value != "max":
                out.append((cgroup_dir, int(value)))
        except (OSError, ValueError):  # the root cgroup, or no memory controller here
            pass
        if cgroup_dir == mount_point or not cgroup_dir.startswith(mount_point):
            return out
        cgroup_dir = os.path.dirname(cgroup_dir)


def _cgroup_dir(pid: int, fstype: str) -> tuple[str, str] | None:
    """(mount point, directory of the process's cgroup) for the memory hierarchy of `fstype`."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except FileNotFoundError as e:
        raise ProcessLookupError(f"process {pid} is gone") from e
    # 'ID:controllers:path'; v2 is '0::path', v1 lists the controllers of its hierarchy
    wanted = "" if fstype == "cgroup2" else "memory"
    paths = [p for _, ctl, p in (line.split(":", 2) for line in lines) if wanted in ctl.split(",")]
    if not paths:
        return None
    path = paths[0]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # 'ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTS [TAGS...] - FSTYPE SOURCE SUPER_OPTS'
            fields, _, tail = line.partition(" - ")
            mount_fstype, _source, super_opts = tail.split()[:3]
            if mount_fstype != fstype or (wanted and wanted not in super_opts.split(",")):
                continue
            root, mount_point = (_unescape(x) for x in fields.split()[3:5])
            # A bind mount of a sub-tree only shows cgroups under its root.
            rel = os.path.relpath(path, root)
            if rel == ".":
                return mount_point, mount_point
            if not rel.startswith(".."):
                return mount_point, os.path.join(mount_point, rel)
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes ('\\040')."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)
