"""cgroups of a process: memory limits and usage (v2, else the v1 memory controller) and v2 ids.

Everything is read from /proc and the cgroup file systems, which the process's owner may shape
(delegated cgroups): values are parsed defensively and a failure means "no limit known".
"""

from __future__ import annotations

import os
import re

from sampler.errors import UsageError

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def memory_limit(pid: int) -> int:
    """Smallest memory limit over the process's cgroup and its ancestors, capped by MemTotal.

    cgroup v2 `memory.max` wins; cgroup v1 `memory.limit_in_bytes` is used only when no v2
    limit is set (hybrid hosts keep the memory controller on v1).
    """
    limits = _cgroup_limits(pid, "cgroup2", "memory.max") or _cgroup_limits(
        pid, "cgroup", "memory.limit_in_bytes"
    )
    return min([*limits, mem_total()])


def mem_total() -> int:
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


def cgroup_memory_levels(pid: int) -> list[tuple[str, int]]:
    """(usage file, limit) of each cgroup from the process's own up to the root that has a memory
    limit: v2 memory.current/memory.max, else v1 memory.usage_in_bytes/limit_in_bytes."""
    host = mem_total()
    for fstype, limit_file, usage_file in (("cgroup2", "memory.max", "memory.current"),
                                           ("cgroup", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        try:
            dirs = cgroup_limit_dirs(pid, fstype, limit_file)
        except (ProcessLookupError, OSError, ValueError):
            return []
        out = [(os.path.join(d, usage_file), limit) for d, limit in dirs
               if 0 < limit < host and os.path.exists(os.path.join(d, usage_file))]
        if out:
            return out
    return []


def memory_pressure(levels: list[tuple[str, int]]) -> tuple[float, int, int] | None:
    """(usage / limit, usage, limit) of the tightest level; None when nothing could be read."""
    best = None
    for path, limit in levels:
        try:
            with open(path) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if best is None or usage / limit > best[0]:
            best = (usage / limit, usage, limit)
    return best


def cgroup2_root() -> str | None:
    """Mount point of the cgroup v2 hierarchy (/sys/fs/cgroup, or .../unified on hybrid hosts)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    return left.split()[4]
    except OSError:
        pass
    return None


def cgroup_id(path: str) -> int:
    """The cgroup v2 id of a cgroup (its directory's inode), from a path in the v2 hierarchy or
    relative to it (e.g. system.slice/foo.service)."""
    root = cgroup2_root()
    if root is None:
        raise UsageError("--cgroup needs the cgroup v2 hierarchy, and none is mounted: mount -t cgroup2 "
                         "none /sys/fs/cgroup/unified, or select processes with --pid")
    full = path if path.startswith(root + "/") or path == root else os.path.join(root, path.lstrip("/"))
    if not os.path.isdir(full) or not os.path.exists(os.path.join(full, "cgroup.procs")):
        raise UsageError(f"no such cgroup: {path} (expected a directory of the cgroup v2 hierarchy at "
                         f"{root}, e.g. system.slice/NAME.service)")
    return os.stat(full).st_ino
