"""Memory mappings of a process, from /proc/PID/maps."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sampler import files

_DELETED = " (deleted)"


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    dev: str  # 'maj:min' in hex, as the kernel prints it
    inode: int
    path: str  # '' for anonymous memory; pseudo paths such as '[heap]' are kept
    deleted: bool = False

    @property
    def executable(self) -> bool:
        return "x" in self.perms

    @property
    def file_backed(self) -> bool:
        return self.inode != 0 and self.path.startswith("/")


def parse_maps_line(line: str) -> Mapping:
    # The path is the only field that may contain spaces, so split it off last.
    fields = line.rstrip("\n").split(maxsplit=5)
    lo, hi = fields[0].split("-")
    path = fields[5] if len(fields) > 5 else ""
    deleted = path.endswith(_DELETED)
    if deleted:
        path = path[: -len(_DELETED)]
    return Mapping(
        start=int(lo, 16),
        end=int(hi, 16),
        perms=fields[1],
        offset=int(fields[2], 16),
        dev=fields[3],
        inode=int(fields[4]),
        path=path,
        deleted=deleted,
    )


def read_maps(pid: int) -> list[Mapping]:
    """The mappings of `pid`, sorted by address; ProcessLookupError when it is gone."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [parse_maps_line(line) for line in f]
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ProcessLookupError(pid) from e


def open_path(pid: int, m: Mapping) -> str:
    """A path that opens the file behind `m` as the process sees it.

    map_files reaches the mapped inode itself, so it works for deleted or replaced files and
    across mount namespaces; it needs CAP_SYS_ADMIN. /proc/PID/root plus the mapped path is the
    fallback (containers): returned unresolved, since resolving it here (stat, open) would follow
    the process's absolute links and '..' out of its root into ours; sampler.files.open_untrusted
    (reader.open_regular) resolves it inside the root, and opens only a regular file.
    """
    mf = f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"
    try:
        os.stat(mf)  # follows the magic link to the inode (no path walked): needs the capability opening it does
        return mf
    except OSError:
        return f"/proc/{pid}/root{m.path}"


@contextlib.contextmanager
def pinned(pid: int, m: Mapping) -> Iterator[str]:
    """A path bound to the file behind `m` while the block runs: its map_files link opened once,
    under the untrusted-file policy, and checked to be the mapping's inode; /proc/self/fd/N of that
    descriptor is what probes are parsed from and attached through (a path resolved again later
    would reach whatever the process mapped there meanwhile). Raises OSError or ValueError."""
    fd, st = files.open_untrusted(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}", 1 << 40)
    try:
        if st.st_ino != m.inode:
            raise OSError(errno.ESTALE, f"{m.path} was remapped")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def find_mapping(maps: Sequence[Mapping], addr: int) -> Mapping | None:
    """The mapping containing `addr` (maps sorted by start, non-overlapping)."""
    lo, hi = 0, len(maps)
    while lo < hi:
        mid = (lo + hi) // 2
        if maps[mid].start <= addr:
            lo = mid + 1
        else:
            hi = mid
    if lo and addr < maps[lo - 1].end:
        return maps[lo - 1]
    return None
