"""numpy's BLAS in allocsampler's own processes: one thread, no spinning.

numpy's OpenBLAS starts a thread per CPU when it loads, and each spins (sched_yield) for a while
between jobs before it sleeps. Our processes do no linear algebra, and those spins were ~0.2 s of
CPU in a recorder's first second on 2 vCPUs (perf, 2026-11-28), taken from the workload beside it.
The variables are set before numpy loads and are inherited by our own children (the table worker,
the daemon's jobs); a command started for the user gets the environment it was given
(`user_environ`).
"""

from __future__ import annotations

import os

VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_added: set[str] = set()


def one_thread() -> None:
    """Before numpy loads: one BLAS thread, unless the environment already says how many."""
    for name in VARS:
        if name not in os.environ:
            os.environ[name] = "1"
            _added.add(name)


def user_environ() -> dict[str, str]:
    """The environment without what one_thread() added."""
    return {k: v for k, v in os.environ.items() if k not in _added}
