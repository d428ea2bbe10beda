"""Files the recorder writes or trusts: atomic replacement, private caches and outputs, locks.

Everything here runs as root next to files that other users may control, so: no link is followed,
a cache file is trusted only when it is a regular file owned by us and writable by nobody else
(checked on the open descriptor, not the path), and a file is replaced by writing a temporary
beside it and renaming it over, so that a reader or a crash never sees half of one.

Outputs (recordings, reports, exports) are private by default (directories 0700, files 0600) and
go only where no other user can swap them: every directory on the way is ours or root's, and one
that others may write to is sticky (/tmp); an existing output directory must be ours and writable
by nobody else. A refusal is an `UnsafePath`: one line naming the cause and the fix.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sampler.errors import EnvironmentProblem

log = logging.getLogger(__name__)

OUTPUT_DIR_MODE = 0o700
OUTPUT_FILE_MODE = 0o600


class UnsafePath(EnvironmentProblem, OSError):
    """A path another user could control (a link, their file or directory, one they may write
    to). An OSError too, so that writers that survive I/O errors (the daemon's) survive this."""

    def __init__(self, message: str):
        EnvironmentProblem.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """File descriptor 2 is `path` for a while (what starts meanwhile keeps it: a JVM's log), then
    what it was; for C libraries and children that write there, not through sys.stderr."""
    import sys

    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


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
    dot-name with our pid and a random part, created O_EXCL|O_NOFOLLOW (a planted link or file is never written
    through), and removed on any error."""
    path = Path(path)
    # unguessable: nobody can plant it beforehand (a planted one makes O_EXCL fail, not follow)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
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
    there could be planted or read by others, so it is not used; nor is one under a directory
    another user could change (check_ancestors: they could swap ours for theirs)."""
    path = Path(path)
    try:
        check_ancestors(path)
    except UnsafePath:
        return None
    if create:
        with contextlib.suppress(OSError):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and is_private(st) else None


FileIdentity = tuple[int, int, int, int, int]


def identity(st: os.stat_result) -> FileIdentity:
    """What tells one file's contents from another's without reading them: device and inode,
    plus size, mtime and ctime. An inode number is reused once its file is deleted (and btrfs
    subvolumes repeat them), but a new file gets a new ctime, which no user can set."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def cache_dir(sub: str, path: str | None = None) -> Path | None:
    """Where unwind tables, compiled BPF programs, the probe cost and fetched debug files persist
    across runs: the given directory, else `sub` of $ALLOCSAMPLER_CACHE_DIR or of a root-only
    default (all of them describe the binaries and the kernel, not the targets, so one cache
    serves every recording). None when it cannot be made ours alone (nothing is cached then)."""
    root = os.environ.get("ALLOCSAMPLER_CACHE_DIR") or "/var/cache/allocsampler"
    return private_dir(path if path else os.path.join(root, sub))


def is_magic_link(path: str | os.PathLike) -> bool:
    """/proc/PID/map_files/<range>, or /proc/PID/fd/N of a descriptor opened through one (ours, or
    the recorder's from its name worker: only our own or our parent's descriptors): links the kernel
    resolves to the inode itself, not through a path anyone can change; the kinds of link a
    target's file is opened through."""
    parts = os.fspath(path).split("/")
    if len(parts) != 5 or parts[:2] != ["", "proc"]:
        return False
    if parts[3] == "map_files":
        return True
    return parts[3] == "fd" and parts[4].isdigit() and (
        parts[2] == "self" or parts[2].isdigit() and int(parts[2]) in (os.getpid(), os.getppid()))


def split_proc_root(path: str | os.PathLike) -> tuple[str, str] | None:
    """('/proc/PID/root', the rest) of a path inside a process's root (how a target's files, a
    container's included, are named from here), else None."""
    parts = os.fspath(path).split("/", 4)
    if len(parts) == 5 and parts[:2] == ["", "proc"] and parts[3] == "root" and (
            parts[2].isdigit() or parts[2] == "self") and parts[4]:
        return "/".join(parts[:4]), parts[4]
    return None


# openat2(2), Linux 5.6: 437 on every architecture (the syscall table is shared since 5.1)
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
OPENAT2_RETRIES = 4         # EAGAIN: a rename or mount raced a '..' walk
_warned_enosys = False


class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(dirfd, path, {flags, 0, resolve}): an fd, or OSError (ENOSYS before Linux 5.6)."""
    how = OpenHow(flags, 0, resolve)
    for _ in range(OPENAT2_RETRIES):
        fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), os.fsencode(path),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def open_in_root(root: str, path: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """open_untrusted of `path` resolved inside `root` (a process's /proc/PID/root), never out of
    it: the kernel resolves an absolute link on the way, or '..', against the magic link's
    target (RESOLVE_IN_ROOT), where a plain open of /proc/PID/root/<path> would resolve them
    against ours, so a container could have root open any of the host's files. No magic link
    (/proc/self/...) is followed inside. Raises OSError (ENOSYS: no openat2, nothing opened)
    or ValueError."""
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pathfd = openat2(rootfd, path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                         RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise
        # never the plain open instead: it is the escape this refuses
        message = (f"{root}/{path} is not opened: resolving it inside the process's root needs "
                   "openat2 (Linux 5.6, not blocked by seccomp)")
        global _warned_enosys
        if not _warned_enosys:
            _warned_enosys = True
            log.warning("%s; files inside other processes' roots are not read", message)
        raise OSError(errno.ENOSYS, message) from e
    finally:
        os.close(rootfd)
    return open_regular_at(pathfd, f"{root}/{path}", max_bytes)


def open_regular_at(pathfd: int, path: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """The file behind an O_PATH descriptor (closed here) opened for reading, as open_untrusted
    returns it: refused unless a regular file before anything opens it (a device's open has side
    effects), reopened through the descriptor (the same inode, whatever `path` names now)."""
    try:
        st = os.fstat(pathfd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise ValueError(f"{path} is {kind}")
        fd = os.open(f"/proc/self/fd/{pathfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(pathfd)
    try:
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(st2.st_mode):
            raise ValueError(f"{path} changed while opened")
        if st2.st_size > max_bytes:
            raise ValueError(f"{path} is {st2.st_size} bytes, over the {max_bytes} expected at most")
    except BaseException:
        os.close(fd)
        raise
    return fd, st2


def open_untrusted(path: str | os.PathLike, max_bytes: int) -> tuple[int, os.stat_result]:
    """(read-only fd, its fstat) of a file another user may control, the one open policy for
    them: a last component that is a link is refused (but for map_files' magic links), anything
    but a regular file is refused before it is opened for reading (O_PATH first: device files
    have side effects on open), and so is a file over `max_bytes`. A path under /proc/PID/root
    is resolved inside that root (open_in_root). Raises OSError or ValueError."""
    in_root = split_proc_root(path)
    if in_root is not None:
        return open_in_root(*in_root, max_bytes)
    magic = is_magic_link(path)
    pathfd = os.open(path, os.O_PATH | os.O_CLOEXEC | (0 if magic else os.O_NOFOLLOW))
    return open_regular_at(pathfd, os.fspath(path), max_bytes)


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


# -- outputs ---------------------------------------------------------------------------------------

def _owner(st: os.stat_result) -> str:
    return f"uid {st.st_uid}"


def check_ancestors(path: str | os.PathLike) -> None:
    """Raise UnsafePath unless every existing directory above `path` is ours or root's and, when
    others may write to it, sticky: otherwise its owner (or anyone) could rename our output away
    and put a link in its place between our check and our write."""
    here = Path(os.path.abspath(path)).parent
    for d in (here, *here.parents):
        try:
            st = os.stat(d)             # links above the output are the admin's layout: followed
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafePath(f"{d} belongs to {_owner(st)}, who could replace {path} with a link: "
                             "write under a directory you or root own")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(f"{d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), who could "
                             f"replace {path} with a link: write under a directory only you can change")


def check_own_dir(path: str | os.PathLike, what: str = "output directory") -> None:
    """Raise UnsafePath unless `path` is a real directory (not a link), ours, writable by nobody else."""
    st = os.stat(path, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} {path} is a symbolic link: give the directory it points to, "
                         "or a new path")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} exists and is not a directory: give a new path")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{what} {path} belongs to {_owner(st)}, not to us: give a new path "
                         "(it is created private)")
    if st.st_mode & 0o022:
        raise UnsafePath(f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                         f"run chmod go-w {path}, or give a new path")
    if st.st_mode & stat.S_ISGID and st.st_gid != os.getegid():
        raise UnsafePath(f"{what} {path} is setgid to group {st.st_gid}: what we write there would belong "
                         f"to that group; run chmod g-s {path}, or give a new path")


def output_dir(path: str | os.PathLike, mode: int = OUTPUT_DIR_MODE, what: str = "output directory") -> Path:
    """`path` as an output directory: created with exactly `mode` (missing parents too) when it is
    not there, else checked by check_own_dir; its ancestors by check_ancestors. Raises UnsafePath,
    or OSError when it cannot be created."""
    path = Path(path)
    check_ancestors(path)
    missing = []
    d = path
    while not os.path.lexists(d):
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        try:
            m.mkdir(mode=0o700)
            os.chmod(m, mode)           # exactly: the umask does not apply
        except FileExistsError:         # created meanwhile by someone else: checked below
            pass
    check_own_dir(path, what)
    return path


def subdir(root: Path, name: str, mode: int) -> Path:
    """root/name as a real directory of ours (created with `mode`): a link or another user's
    directory planted inside a dataset is refused, not written through. Raises UnsafePath."""
    d = root / name
    try:
        d.mkdir(mode=0o700)
        os.chmod(d, mode)
    except FileExistsError:
        pass
    st = os.stat(d, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
            ("not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by {_owner(st)}")
        raise UnsafePath(f"{d} is {kind}: remove it (data is never written through it)")
    return d


def check_output_file(path: str | os.PathLike) -> None:
    """Raise UnsafePath unless `path` may be (re)written by us: absent, or a regular file of ours
    (a link there would be replaced, not followed, but it says someone meddled: refused)."""
    check_ancestors(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link: remove it or give another file name")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} exists and is not a regular file: give another file name")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to {_owner(st)}: remove it or give another file name")


def write_output(path: str | os.PathLike, data: bytes, mode: int = OUTPUT_FILE_MODE) -> None:
    """A report or export: checked by check_output_file, written beside it (O_EXCL|O_NOFOLLOW)
    with `mode` and renamed over it. Raises UnsafePath or OSError."""
    check_output_file(path)
    write_atomic(path, data, mode)


# -- locks -----------------------------------------------------------------------------------------

def open_lock(path: str | os.PathLike) -> int:
    """An fd to flock: `path` created 0600 if missing, never through a link, and used only when it
    is a regular file of ours (another user's lock file could block every write). Raises
    UnsafePath or OSError."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafePath(f"lock file {path} is not a regular file of ours ({_owner(st)}, mode "
                             f"{stat.S_IMODE(st.st_mode):o}): remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd
