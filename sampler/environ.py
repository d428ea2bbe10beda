"""The environments of allocsampler's own processes and of the commands it starts.

numpy's OpenBLAS starts a thread per CPU when it loads, and each spins (sched_yield) for a while
between jobs before it sleeps. Our processes do no linear algebra, and those spins were ~0.3 s of
CPU in a recorder's start on 2 vCPUs (perf, 2026-11-28), taken from the workload beside it:
`one_blas_thread` sets the variables before numpy loads. A command started for the user gets the
environment it was given (`user_environ`). Workers that read target-controlled files (the table
worker) or touch target processes (the placement helper) get `worker_environ`: nothing beyond
what they need, so that the upload credentials of a daemon's environment never reach them.

Every Python child is isolated (`python_module`: -I, started in /): `python -c` and `-m` put the
working directory first on sys.path, and root's commands may run in a directory another user can
write (a planted json/ or ctypes/ there would run as root); -I also ignores PYTHON* and the user site.
"""

from __future__ import annotations

import os
import sys

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_WORKER_VARS = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", *BLAS_VARS)
_WORKER_PREFIXES = ("ALLOCSAMPLER_", "DEBUGINFOD_")      # our settings; debug files by build-id
# how a worker that downloads (debuginfod, in the name worker) reaches the network
NETWORK_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
                "SSL_CERT_FILE", "SSL_CERT_DIR")
_added: set[str] = set()


def one_blas_thread() -> None:
    """Before numpy loads: one BLAS thread, unless the environment already says how many."""
    for name in BLAS_VARS:
        if name not in os.environ:
            os.environ[name] = "1"
            _added.add(name)


def user_environ() -> dict[str, str]:
    """The environment without what one_blas_thread() added."""
    return {k: v for k, v in os.environ.items() if k not in _added}


def worker_environ(network: bool = False, **extra: str) -> dict[str, str]:
    """A worker's environment: the locale, PATH, temporary directory, our settings and BLAS's,
    with `network` the proxies and CA certificates, plus `extra`; never credentials or anything
    else the recorder was given."""
    wanted = (*_WORKER_VARS, *NETWORK_VARS) if network else _WORKER_VARS
    env = {k: v for k, v in os.environ.items() if k in wanted or k.startswith(_WORKER_PREFIXES)}
    env.update(dict.fromkeys(BLAS_VARS, "1"))
    env.update(extra)
    return env


# The directory this process's `sampler` came from, first on a child's path unless already there (the
# installed forms: site-packages): a child runs this code, also from a checkout on PYTHONPATH (the
# benchmarks), which -I would hide. The child's sys.argv is what `python -m MODULE ARGS` gives it.
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_MODULE = """import runpy, sys
root, module = sys.argv.pop(1), sys.argv.pop(1)
if root not in sys.path:
    sys.path.insert(0, root)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def python_module(module: str, *args: str) -> list[str]:
    """The argv of a child interpreter running `module` as `python -m` does, isolated (-I: nothing
    from its working directory or PYTHON* variables); start it with cwd="/"."""
    return [sys.executable, "-I", "-c", _RUN_MODULE, CODE_ROOT, module, *args]
