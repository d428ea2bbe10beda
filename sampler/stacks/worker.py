"""Children that read target files for the recorder: unwind rows (table_worker.py) and names
(name_worker.py).

A target's files may be built to cost whatever a parser lets them: memory, time. In a child they
cost that child. Each runs under an address-space limit (ADDRESS_SPACE): ~150 MiB of it is what
Python maps to start (much of it code not resident), so a child's data can grow by ~230 MiB, which
with the daemon's own bound (max_rss 256M) stays below the unit's MemoryMax (576M). A file that
takes a child to its limit fails alone (a MemoryError, or the child dies and the next request
starts another), and the cgroup does not kill the daemon. Children the recorder does not wait
for run at a lower priority; all run without the daemon's credentials (environ.worker_environ),
die with it, and exit when idle.

    python -m sampler.stacks.<module> PARENT_PID [ARGS...]      (isolated, in /: environ.python_module)
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import time
from typing import IO

import psutil

from sampler import environ
from sampler.lifetime import die_with_parent

# What a child may map. Python with numpy and pyelftools maps ~150 MiB to start; decoding
# libtorch_cpu's CFI peaks at 246 MiB, naming its symbols at 191 MiB (2026-11-28, f0798c0).
ADDRESS_SPACE = 384 << 20
IDLE_S = 30.0               # a child exits after this long without work
LEAVE_S = 2.0               # a closed child has this long to exit before it is killed


class Child:
    """One child running `module`, started on demand; JSON lines to its stdin, its stdout read by
    the owner."""

    def __init__(self, module: str, *args: str, network: bool = False):
        self.module = module
        self.args = args
        self.network = network          # it downloads: the proxies and CA certificates it needs
        self.proc: subprocess.Popen | None = None
        self._exited_cpu_s = 0.0          # CPU time of children that have exited
        self._leaving: list[tuple[subprocess.Popen, float]] = []     # closed, not yet reaped

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> IO[bytes]:
        """A fresh child (the old one closed); its stdout."""
        self.close()
        argv = environ.python_module(self.module, str(os.getpid()), *self.args)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True, cwd="/", env=environ.worker_environ(self.network))
        return self.proc.stdout

    def send(self, line: bytes) -> bool:
        """False when the child is gone."""
        if self.proc is None:
            return False
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every child so far, the running one included."""
        running = 0.0
        if self.proc is not None:
            with contextlib.suppress(psutil.Error):
                running = sum(psutil.Process(self.proc.pid).cpu_times()[:2])
        return self._exited_cpu_s + running

    def close(self, kill: bool = False) -> None:
        """Let the child finish what it has (or `kill` it: stuck on a file); it is reaped later
        (reap): a child at its low priority on a busy host may take seconds to exit, and the
        recorder's loop does not wait for it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(psutil.Error):
            self._exited_cpu_s += sum(psutil.Process(proc.pid).cpu_times()[:2])
        if kill:
            proc.kill()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        self._leaving.append((proc, time.monotonic() + LEAVE_S))
        self.reap()

    def reap(self, wait: bool = False) -> None:
        """Collect the closed children that exited, kill those past LEAVE_S (`wait`: wait for
        each until then, as the owner closes)."""
        left = []
        for proc, deadline in self._leaving:
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is not None:
                continue
            if wait or time.monotonic() >= deadline:
                proc.kill()
                if wait:
                    proc.wait()
                    continue
            left.append((proc, deadline))
        self._leaving = left

def child_setup(argv: list[str], nice: int = 10) -> None:
    """The child's side, first: dies with its parent (argv[0]), under the address-space limit,
    `nice` lower; the recorder's Ctrl-C is the recorder's."""
    die_with_parent(int(argv[0]), nice)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
