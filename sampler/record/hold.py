"""A command that `record --` started, held until its sampler is in: placed before the program's
first allocation, not some milliseconds into its start.

The launcher (a shell stopped before its exec, sampler/proc/process.py) is never placed into:
BPF stops the process at its exec (TGT_HOLD, proc.bpf.c), before the new image runs an
instruction; here its entry point gets hold_entry and it is let go to stop there (PROC_ENTRY),
where the dynamic linker has loaded and relocated every library and the program has not started.
The sampler is placed and its slots redirected in that stop (the helper's --held mode), then the
process goes on (SIGCONT). A wrapper that execs again (env, sh -c, pyenv's shims) is held at each
of its first EXEC_HOLDS execs. Every stop is bounded: past HOLD_MAX_S the process is let go whatever is still
running (a placement then finishes with the process running), and a hold that cannot be set up
lets it go at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from sampler.bpf.loader import BpfProbes
from sampler.proc.maps import pinned, read_maps
from sampler.proc.process import entry_point, read_stat
from sampler.record.target import Target

EXEC_HOLDS = 16         # execs of a started command that are held (wrapper chains: pyenv's shims exec 7 times)
HOLD_MAX_S = 5.0        # the longest any one stop of ours lasts
LAUNCH, ENTRY, PLACING = "launch", "entry", "placing"


class Holds:
    """`flags(t)`: the target's BPF flags (TGT_HOLD while it has holds left); `warn(t, message)`."""

    def __init__(self, probes: BpfProbes, flags: Callable[[Target], int], warn: Callable[[Target, str], None]):
        self.probes, self.flags, self.warn = probes, flags, warn
        self.holding: dict[int, Target] = {}

    def launcher(self, t: Target) -> None:
        """`t` is the launcher of a command we started: its exec will be held."""
        t.holds, t.held = EXEC_HOLDS, LAUNCH

    def resumed(self, t: Target) -> None:
        """The launcher was let go to its exec."""
        t.held_since = time.monotonic()
        self.holding[t.pid] = t

    def exec_(self, t: Target) -> None:
        """Its exec event: BPF stopped it there. Its entry point gets hold_entry, then it goes on."""
        pid = t.pid
        try:
            entry = entry_point(pid)
            m = next((x for x in read_maps(pid) if x.file_backed and x.start <= entry < x.end), None)
            if m is None:
                raise ValueError(f"its entry point {entry:#x} is in no mapped file")
            with pinned(pid, m) as path:
                self.probes.hold_at_entry(pid, path, entry - m.start + m.offset)
            t.held, t.held_since = ENTRY, time.monotonic()
            self.holding[pid] = t
        except (OSError, ValueError) as e:
            if os.path.exists(f"/proc/{pid}"):
                self.warn(t, f"could not hold the command at its entry point ({e}): its sampler is placed "
                             "once it runs, and its first allocations are not sampled")
            self._spent(t)
            self.forget(t)
        finally:
            _cont(pid)

    def entered(self, t: Target) -> bool:
        """Its entry event: BPF stopped it there. True when the sampler is to be placed in this
        stop (the caller starts it; tick lets the process go once it is done); False: it was let
        go already."""
        self.probes.release_entry(t.pid)
        if t.held != ENTRY:                 # a hold given up meanwhile: BPF stopped it all the same
            _cont(t.pid)
            return False
        t.holds -= 1
        if not t.holds:
            self.probes.add_target(t.pid, self.flags(t), t.budget)
        t.held, t.held_since = PLACING, time.monotonic()
        return True

    def tick(self, now: float, busy: Callable[[int], bool]) -> None:
        """Lets go each held process whose placement is done (`busy(pid)`: still running), or
        whose stop has lasted HOLD_MAX_S."""
        for pid, t in list(self.holding.items()):
            if t.held == PLACING and not busy(pid):
                self.let_go(t)
            elif now - t.held_since > HOLD_MAX_S:
                if t.held == LAUNCH:        # its exec event was lost, or it has not exec'd yet
                    st = read_stat(pid)
                    if st is not None and st.state != "T":
                        continue            # running: its exec comes when it comes
                self.warn(t, f"held for {HOLD_MAX_S:g} s at its {'exec' if t.held == LAUNCH else t.held}: let go "
                             "(its sampler is placed while it runs)")
                if t.held == ENTRY:
                    self._spent(t)
                self.let_go(t)

    def let_go(self, t: Target) -> None:
        """The process goes on; nothing of ours waits on it any more."""
        if t.held == ENTRY:
            self.probes.release_entry(t.pid)
        was = t.held
        self.forget(t)
        if t.injection is not None:
            t.injection.held = False
        if was:
            _cont(t.pid)

    def forget(self, t: Target) -> None:
        self.holding.pop(t.pid, None)
        t.held, t.held_since = "", 0.0

    def _spent(self, t: Target) -> None:
        """No more holds for it: BPF stops it no more."""
        if t.holds:
            t.holds = 0
            with contextlib.suppress(KeyError, OSError):
                self.probes.add_target(t.pid, self.flags(t), t.budget)


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
