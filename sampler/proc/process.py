"""Target processes: checking pids, starting a command stopped before exec, reading identity."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
from dataclasses import dataclass

from sampler.errors import TargetGone, UsageError

# /proc files are written by the kernel, but their contents come from the process (its name, its
# argv, up to ARG_MAX): every read is bounded.
MAX_READ = 64 << 10


def _read(path: str, limit: int = MAX_READ) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


@dataclass(frozen=True)
class Stat:
    comm: str
    state: str
    ppid: int
    flags: int
    start: int          # clock ticks after boot: with the pid, identifies a process


def read_stat(pid: int, proc: str = "/proc") -> Stat | None:
    """Fields of /proc/PID/stat; None when the process is gone."""
    try:
        raw = _read(f"{proc}/{pid}/stat", 4096).decode(errors="surrogateescape")
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2:].split()
        return Stat(comm, rest[0], int(rest[1]), int(rest[6]), int(rest[19]))
    except (OSError, ValueError, IndexError):
        return None


def read_cmdline(pid: int, proc: str = "/proc") -> str | None:
    """argv joined by spaces ("" for kernel threads and zombies); None when the process is gone."""
    try:
        return b" ".join(_read(f"{proc}/{pid}/cmdline").rstrip(b"\0").split(b"\0")).decode(errors="surrogateescape")
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    comm: str
    exe: str
    cmdline: str
    ppid: int


def read_info(pid: int, proc: str = "/proc") -> ProcessInfo:
    """Identity of a live process; raises ProcessLookupError when it is gone."""
    st = read_stat(pid, proc)
    cmdline = read_cmdline(pid, proc)
    if st is None or cmdline is None or st.state in ("Z", "X"):
        raise ProcessLookupError(pid)
    try:
        exe = os.readlink(f"{proc}/{pid}/exe")
    except OSError:
        exe = ""
    return ProcessInfo(pid, st.comm, exe, cmdline.strip(), st.ppid)


@dataclass(frozen=True)
class ProcView:
    """What target selection looks at in one process (ProcView.read builds it from /proc)."""

    pid: int
    comm: str                    # /proc/PID/comm, at most 15 bytes
    cmdline: str                 # argv joined by spaces; "" for kernel threads and zombies
    uid: int                     # effective uid, as `pgrep -u` matches
    cgroup_path: str             # cgroup v2 path from /proc/PID/cgroup, e.g. /system.slice/foo.service
    systemd_path: str = ""       # systemd's: its v1 name=systemd hierarchy's path, else the v2 one

    @classmethod
    def read(cls, pid: int, proc: str = "/proc") -> ProcView | None:
        """None when the process is gone (or was never there). The caller still has to guard
        against PID reuse, e.g. by comparing the start time before and after."""
        base = f"{proc}/{pid}"
        try:
            comm = _read(f"{base}/comm", 256).rstrip(b"\n").decode(errors="surrogateescape")
            status = _read(f"{base}/status").decode(errors="replace").splitlines()
            uid = next(int(line.split()[2]) for line in status if line.startswith("Uid:"))
            cgroups = _read(f"{base}/cgroup").decode(errors="surrogateescape").splitlines()
            cgroup = next((line[3:] for line in cgroups if line.startswith("0::")), "")
            systemd = next((line.split(":", 2)[2] for line in cgroups if line.split(":", 2)[1:2] == ["name=systemd"]),
                           cgroup)
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        cmdline = read_cmdline(pid, proc)
        return None if cmdline is None else cls(pid, comm, cmdline, uid, cgroup, systemd)


def rss_bytes(pid: int | str = "self") -> int:
    try:
        return int(_read(f"/proc/{pid}/statm", 256).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def own_rss(rss: int, pid: int | str = "self") -> int:
    """RSS less the clean pages of bcc's compiler libraries that other processes map too (another
    bcc tool, a second recorder): those stay resident whatever this process does, and the cgroup
    that first faulted them pays for them. On a host where only bcc's users map them, this is RSS."""
    shared = 0
    name = ""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and not line.split(None, 1)[0].endswith(":"):
                    name = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                elif line.startswith("Shared_Clean:") and ("libLLVM" in name or "libclang" in name):
                    shared += int(line.split()[1]) << 10
    except (OSError, ValueError):
        return rss
    return rss - shared


def exe_path(pid: int) -> str | None:
    """The process's main executable, as it was mapped (' (deleted)' removed); None if gone."""
    try:
        return os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return None


AT_ENTRY = 9


def entry_point(pid: int) -> int:
    """The address of the program's entry point in its image (the auxiliary vector's AT_ENTRY,
    which the kernel writes at exec). Raises OSError, ValueError when there is none."""
    raw = _read(f"/proc/{pid}/auxv", 4096)
    for i in range(0, len(raw) - 15, 16):
        key, value = struct.unpack_from("<QQ", raw, i)
        if key == AT_ENTRY:
            return value
        if key == 0:
            break
    raise ValueError(f"process {pid} has no entry point in its auxiliary vector")


def descendants(roots: set[int], proc: str = "/proc") -> list[tuple[int, int]]:
    """(pid, parent pid) of every live process descended from `roots`, each after its parent: one
    pass over /proc (the processes forked before a recording began; later forks are events)."""
    parent: dict[int, list[int]] = {}
    with os.scandir(proc) as it:
        for e in it:
            if e.name.isdigit() and (st := read_stat(int(e.name), proc)) is not None:
                parent.setdefault(st.ppid, []).append(int(e.name))
    out, todo, seen = [], list(roots), set(roots)
    while todo:
        p = todo.pop()
        for c in parent.get(p, ()):
            if c not in seen:           # a pid reused since the scan began could loop
                seen.add(c)
                out.append((c, p))
                todo.append(c)
    return out


def check_pid(pid: int) -> ProcessInfo:
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}: expected a positive process id")
    if pid == os.getpid():
        raise UsageError("cannot record the recorder itself: give another pid")
    try:
        info = read_info(pid)
    except ProcessLookupError:
        if os.path.exists(f"/proc/{pid}"):
            raise TargetGone(f"process {pid} has exited (zombie): pick a running process") from None
        raise UsageError(f"no such process: {pid} (check the pid with `ps -p {pid}`)") from None
    if not info.exe:
        raise UsageError(f"process {pid} ({info.comm}) is a kernel thread: it has no user-space "
                         "allocator to record")
    tgid = _tgid(pid)
    if tgid not in (None, pid):
        raise UsageError(f"{pid} is a thread of process {tgid} ({info.comm}): give --pid {tgid}")
    return info


def _tgid(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class LaunchedCommand:
    """`CMD ARGS` started under a tiny shell that stops itself before exec, so that probes are
    attached before the command's first allocation; `resume()` lets it exec."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        if not argv:
            raise UsageError("no command given after --")
        if shutil.which(argv[0]) is None:
            raise UsageError(f"command not found: {argv[0]} (give a path or a command on PATH)")
        self.argv = argv
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", 'kill -STOP $$ && exec "$@"', "allocsampler-launch", *argv],
            start_new_session=False, env=env)
        _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            raise TargetGone(f"could not start {argv[0]}: the launcher exited early")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
