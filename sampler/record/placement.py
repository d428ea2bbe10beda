"""The inject tier's work in a process (placing the sampler, redirecting its slots) beside the loop:
a helper run can wait seconds on one thread of one process (a slow seccomp supervisor, mmap_lock
held by a large fork), and the loop must go on reading events for every other target meanwhile.

Jobs run on a few worker threads; the loop submits them and, at every poll, runs what follows each
finished one (`then`), so that everything the recorder keeps is touched by the loop alone. Attempts
are bounded: a few per second over all targets, and per process identity (uid, pid, start time) a
few in all with a backoff that doubles, which an exec does not reset (a process that re-execs
itself in a loop gets no new attempt each time)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sampler.proc.process import read_stat

WORKERS = 2
PER_SECOND = 8.0            # attempts started per second, over all targets
ATTEMPTS = 4                # failed placements per process identity, in all
BACKOFF_S = 10.0            # after the first failure; doubled after each


@dataclass
class Job:
    pid: int
    image: int                                  # the target's image when submitted (exec: another)
    future: Future
    then: Callable[[Any, BaseException | None], None]


class Placements:
    def __init__(self, workers: int = WORKERS, per_second: float = PER_SECOND):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="allocsampler-place")
        self.jobs: dict[int, Job] = {}
        self.per_second = per_second
        self._tokens, self._at = per_second, time.monotonic()
        self.failures: dict[tuple, tuple[int, float]] = {}     # identity -> (failures, not before)

    def busy(self, pid: int) -> bool:
        return pid in self.jobs

    def when(self, pid: int, now: float) -> str | None:
        """None when a placement in this process may be tried now, else why not."""
        n, after = self.failures.get(identity(pid), (0, 0.0))
        if n >= ATTEMPTS:
            return f"placement failed {n} times in this process: not tried again"
        if now < after:
            return f"placement failed {n} time{'s' * (n > 1)} in this process: next try in {after - now:.0f} s"
        return None

    def next_try(self, pid: int) -> float | None:
        """When a placement in this process may be tried again (monotonic), None: never."""
        n, after = self.failures.get(identity(pid), (0, 0.0))
        return None if n >= ATTEMPTS else after

    def failed(self, pid: int, now: float) -> None:
        key = identity(pid)
        n = self.failures.get(key, (0, 0.0))[0] + 1
        self.failures[key] = (n, now + BACKOFF_S * 2 ** (n - 1))
        if len(self.failures) > 4096:               # processes gone long ago
            for k in list(self.failures)[:1024]:
                del self.failures[k]

    def submit(self, pid: int, image: int, work: Callable[[], Any],
               then: Callable[[Any, BaseException | None], None], limited: bool = True) -> bool:
        """Runs `work` on a worker; `then(result, error)` runs on the loop once it is done (poll).
        False when the pid has a job already, or the rate is spent (`limited`): try again later."""
        if pid in self.jobs:
            return False
        if limited:
            now = time.monotonic()
            self._tokens = min(self.per_second, self._tokens + (now - self._at) * self.per_second)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
        self.jobs[pid] = Job(pid, image, self.pool.submit(work), then)
        return True

    def poll(self) -> list[tuple[Job, Any, BaseException | None]]:
        """The jobs that finished since the last poll (their pids free again)."""
        done = []
        for pid, job in list(self.jobs.items()):
            if job.future.done():
                del self.jobs[pid]
                error = job.future.exception()
                done.append((job, None if error is not None else job.future.result(), error))
        return done

    def wait(self, pids: set[int], timeout: float) -> None:
        """Until none of these pids has a job (or the timeout): a recording's first targets are
        attached before it says so."""
        end = time.monotonic() + timeout
        while any(p in self.jobs and not self.jobs[p].future.done() for p in pids) and time.monotonic() < end:
            time.sleep(0.005)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def identity(pid: int) -> tuple:
    """(uid, pid, start time): what a backoff is kept for (an exec keeps all three)."""
    st = read_stat(pid)
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        uid = -1
    return (uid, pid, st.start if st is not None else 0)
