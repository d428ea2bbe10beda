"""Target processes: checking pids, starting a command stopped before exec, reading identity."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from sampler.errors import TargetGone, UsageError


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    comm: str
    exe: str
    cmdline: str
    ppid: int


def read_info(pid: int) -> ProcessInfo:
    """Identity of a live process; raises ProcessLookupError when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        state, ppid = fields[0], int(fields[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    if state in ("Z", "X"):
        raise ProcessLookupError(pid)
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    return ProcessInfo(pid, comm, exe, cmdline, ppid)


def is_process(tid: int) -> bool:
    """A new task from a fork tracepoint: a process (its own thread group) or just a thread?"""
    return _tgid(tid) == tid


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
