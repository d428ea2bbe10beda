"""CPython targets: their frame layout and thread states pushed to BPF, their frames resolved.

The BPF walk needs, per process, the offsets of the frame chain and, per thread, the address of
its PyThreadState (found by walking the interpreter's thread list here: the interpreter's own
"current thread" pointer is NULL whenever the GIL is released). A thread created after the last
walk is reported by BPF (EvFlag.PY_MISS) and triggers a new walk, rate-limited.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from sampler.python.codeobj import CodeReader, PyFrame
from sampler.python.runtime import PyProcess, PyUnsupported, detect


class _Maps(Protocol):
    def set_python(self, pid: int, layout: bytes | None) -> None: ...
    def set_python_threads(self, add: dict[int, int], remove=()) -> None: ...


@dataclass
class _Py:
    proc: PyProcess
    reader: CodeReader
    tids: set[int] = field(default_factory=set)
    refreshed: float = 0.0
    pushed_ns: int = 0          # CLOCK_MONOTONIC (BPF's clock) once its layout was in BPF


class PythonTargets:
    def __init__(self, maps: _Maps, refresh_interval: float = 0.2):
        self._maps = maps
        self._refresh_interval = refresh_interval
        self._procs: dict[int, _Py] = {}

    def add(self, pid: int) -> str | None:
        """Start reading Python frames of `pid` if it runs CPython. Returns a warning when it runs
        an interpreter that cannot be read (its stacks stay native-only), None otherwise."""
        self.forget(pid)
        try:
            proc = detect(pid)
        except PyUnsupported as e:
            return f"Python frames not recorded: {e}"
        except (ProcessLookupError, PermissionError, OSError):
            return None
        if proc is None:
            return None
        self._procs[pid] = _Py(proc, CodeReader(proc))
        self._maps.set_python(pid, proc.layout.to_bytes())
        self._procs[pid].pushed_ns = time.monotonic_ns()
        self.refresh(pid, force=True)
        return None

    def forked(self, parent: int, child: int, fork_ns: int) -> bool:
        """`child` was forked from `parent` at `fork_ns` (BPF copied its layout and the forking
        thread's PyThreadState, which is the child's one thread): read like the parent, with
        nothing read from the child now; a child forked before its parent's layout reached BPF (a
        server that forks its workers as it starts) gets its own now. False when the parent is not
        known to run CPython."""
        py = self._procs.get(parent)
        if py is None:
            return False
        proc = replace(py.proc, pid=child, forked_from=py.proc.forked_from or parent)
        self._procs[child] = _Py(proc, CodeReader(proc), {child}, time.monotonic(), py.pushed_ns)
        if fork_ns < py.pushed_ns:
            self._maps.set_python(child, proc.layout.to_bytes())
            self.refresh(child, force=True)
        return True

    def known(self, pid: int) -> bool:
        return pid in self._procs

    def refresh(self, pid: int, force: bool = False) -> None:
        """Walk the thread list again (a thread BPF did not know sampled, or once per interval)."""
        py = self._procs.get(pid)
        now = time.monotonic()
        if py is None or (not force and now - py.refreshed < self._refresh_interval):
            return
        py.refreshed = now
        try:
            threads = py.proc.threads()
        except (OSError, ValueError):
            return
        gone = py.tids - threads.keys()
        py.tids = set(threads)
        self._maps.set_python_threads(threads, gone)

    def frames(self, pid: int, raw: Sequence[tuple[int, int]]) -> list[PyFrame]:
        py = self._procs.get(pid)
        if py is None or not raw:
            return []
        return py.reader.frames(raw)

    def process(self, pid: int) -> PyProcess | None:
        py = self._procs.get(pid)
        return py.proc if py else None

    def prune(self, live_pids: set[int]) -> None:
        for pid in [p for p in self._procs if p not in live_pids]:
            self.forget(pid)

    def forget(self, pid: int, bpf_gone: bool = False) -> None:
        """`bpf_gone`: it exited, and BPF dropped its layout and threads at its exit already."""
        py = self._procs.pop(pid, None)
        if py is not None:
            if not bpf_gone:
                self._maps.set_python(pid, None)
                self._maps.set_python_threads({}, py.tids)
            py.proc.close()                 # its /proc/PID/mem descriptor
