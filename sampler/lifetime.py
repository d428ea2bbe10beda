"""Child processes that must not outlive the recorder or the daemon that started them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, nice: int = 10) -> None:
    """SIGKILL this process when `parent` dies (kill -9 included), and run it `nice` lower."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:           # it died before the prctl
        os._exit(1)
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
