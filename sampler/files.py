"""Files the recorder writes or trusts: atomic replacement and private (root-only) caches.

Everything here runs as root next to files that other users may control, so: no link is followed,
a cache file is trusted only when it is a regular file owned by us and writable by nobody else
(checked on the open descriptor, not the path), and a file is replaced by writing a temporary
beside it and renaming it over, so that a reader or a crash never sees half of one.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o600, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Open a temporary beside `path` for writing; on a clean exit it is flushed, given `mode`,
    fsynced and renamed over `path` (and the directory fsynced when `durable`). The temporary is a
    dot-name with our pid, created O_EXCL|O_NOFOLLOW (a planted link or file is never written
    through), and removed on any error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()                    # left by a killed process that had our pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    with atomic_file(path, mode) as f:
        f.write(data)


def is_private(st: os.stat_result) -> bool:
    """Owned by us and writable by nobody else."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def private_dir(path: str | os.PathLike, *, create: bool = True) -> Path | None:
    """`path` as a directory only we control (created 0700 when missing), else None: a cache
    there could be planted or read by others, so it is not used."""
    path = Path(path)
    if create:
        with contextlib.suppress(OSError):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and is_private(st) else None


def cache_dir(sub: str, path: str | None = None) -> Path | None:
    """Where unwind tables, compiled BPF programs, the probe cost and fetched debug files persist
    across runs: the given directory, else `sub` of $ALLOCSAMPLER_CACHE_DIR or of a root-only
    default (all of them describe the binaries and the kernel, not the targets, so one cache
    serves every recording). None when it cannot be made ours alone (nothing is cached then)."""
    root = os.environ.get("ALLOCSAMPLER_CACHE_DIR") or "/var/cache/allocsampler"
    return private_dir(path if path else os.path.join(root, sub))


def is_magic_link(path: str | os.PathLike) -> bool:
    """/proc/PID/map_files/<range>: a link the kernel resolves to the mapped inode itself, not
    through a path anyone can change; the one kind of link a target's file is opened through."""
    parts = os.fspath(path).split("/")
    return len(parts) == 5 and parts[:2] == ["", "proc"] and parts[3] == "map_files"


def open_untrusted(path: str | os.PathLike, max_bytes: int) -> tuple[int, os.stat_result]:
    """(read-only fd, its fstat) of a file another user may control, the one open policy for
    them: a last component that is a link is refused (but for map_files' magic links), anything
    but a regular file is refused before open() (device files have side effects on open) and
    again on the descriptor (swapped in since: O_NONBLOCK, so a FIFO never blocks), and so is a
    file over `max_bytes`. Raises OSError or ValueError."""
    magic = is_magic_link(path)
    st = os.stat(path, follow_symlinks=magic)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if magic else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size} bytes, over the {max_bytes} expected at most")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_private(path: str | os.PathLike, max_bytes: int) -> int:
    """A read-only fd of a cache file, checked on the descriptor as by open_untrusted, and owned
    by us and writable by nobody else. Raises OSError or ValueError."""
    fd, st = open_untrusted(path, max_bytes)
    if not is_private(st):
        os.close(fd)
        raise ValueError(f"{path} is not ours alone (owner {st.st_uid}, mode {st.st_mode & 0o777:o})")
    return fd


def read_private(path: str | os.PathLike, max_bytes: int) -> bytes:
    """A cache file's bytes, checked as by open_private. Raises OSError or ValueError."""
    with os.fdopen(open_private(path, max_bytes), "rb") as f:
        return f.read(max_bytes + 1)[:max_bytes]
