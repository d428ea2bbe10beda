"""Running the placement helper (place.c), bounded and counted.

Every run is a root process that stops a thread of a process of any local user, and that process
decides how long its calls take. So each run has a bound of its own (HELPER_MAX_S: place.c has
ended by then, whatever the process does); a worker waits for its answer PLACE_WAIT_S at most
(past that the run finishes on its own and is reaped later); the runs alive at once are capped, in
all and per uid of the process they work in; and a process with a live run gets no new one.
Nothing here kills a run: killed in the middle of a call, it would leave the thread with its
registers. A recording that ends waits for its runs within their bound (wait_all).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass

from sampler import environ

# place.c's own bound (its ALLOCSAMPLER_PLACE_MAX_MS: the tests shorten it)
HELPER_MAX_S = float(os.environ.get("ALLOCSAMPLER_PLACE_MAX_MS") or 20000) / 1000
PLACE_WAIT_S = 5.0      # a worker waits this long for an answer (a slow call is interrupted at 2 s)
MAX_ALIVE = 8           # runs alive at once, in all
MAX_PER_UID = 2         # ... working in processes of one uid


class HelperError(Exception):
    """The run made no change, or its answer is not known (the message says which, in one line)."""


@dataclass
class _Run:
    proc: subprocess.Popen
    pid: int            # the process it works in
    uid: int
    started: float
    abandoned: bool = False     # its worker stopped waiting: reaped here (else the worker reads its pipes)


_alive: dict[int, _Run] = {}        # by the helper's pid
_lock = threading.Lock()            # runs start on the placement workers (sampler/record/placement.py)


def run(argv: list[str], pid: int, stdin: str = "") -> list[str]:
    """Runs the helper on process `pid`; its output lines (the first one "ok ..."). Raises HelperError."""
    with _lock:
        _reap()
        busy = next((r for r in _alive.values() if r.pid == pid), None)
        if busy is not None:
            raise HelperError(f"a placement helper is still at work in process {pid} (for "
                              f"{time.monotonic() - busy.started:.0f} s): no new one until it ends")
        uid = _uid(pid)
        if len(_alive) >= MAX_ALIVE:
            raise HelperError(f"{len(_alive)} placement helpers are still at work: no new one until one ends")
        if sum(r.uid == uid for r in _alive.values()) >= MAX_PER_UID:
            raise HelperError(f"{MAX_PER_UID} placement helpers are still at work in processes of uid {uid}: no "
                              "new one until one ends")
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, cwd="/",
                             env=environ.worker_environ(ALLOCSAMPLER_PLACE_MAX_MS=str(int(HELPER_MAX_S * 1000))))
        _alive[p.pid] = _Run(p, pid, uid, time.monotonic())
    try:
        out, err = p.communicate(stdin, timeout=PLACE_WAIT_S)
    except BaseException as e:
        with _lock:
            _alive[p.pid].abandoned = True
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        raise HelperError(f"the placement helper is still waiting for a thread of the process after "
                          f"{PLACE_WAIT_S:g} s (it gives the thread its registers back when its system call "
                          f"returns, and ends within {HELPER_MAX_S:g} s)") from None
    with _lock:
        _alive.pop(p.pid, None)
    lines = out.strip().splitlines()
    if p.returncode != 0 or not lines or not lines[0].startswith("ok"):
        last = lines[-1] if lines else ""
        raise HelperError(last.removeprefix("error ") or f"the placement helper failed ({err.strip()[:200]})")
    return lines


def alive() -> int:
    """Runs still alive (reaped first)."""
    with _lock:
        _reap()
        return len(_alive)


def wait_all(timeout: float) -> int:
    """Waits for the runs still alive, each at most until its bound and all at most `timeout`;
    returns how many are left (never killed)."""
    end = time.monotonic() + timeout
    while (left := alive()) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _reap() -> None:
    # only runs their worker gave up on: another worker's communicate() is never raced
    for hp, r in list(_alive.items()):
        if r.abandoned and r.proc.poll() is not None:
            r.proc.communicate()            # its pipes closed
            del _alive[hp]


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1
