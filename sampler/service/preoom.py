"""Pre-OOM capture: a recorded process whose cgroup nears its memory limit gets a snapshot at once,
finer sampling and full probe coverage for a window, and a snapshot at its end: of that process
only, not of every target.

Any local user may run a recorded program in a delegated cgroup with a tiny limit, so captures are
rate-limited per process, per cgroup (PRE_OOM_AGAIN_S) and globally (one per PRE_OOM_GLOBAL_GAP_S):
a storm of cgroups near their limits cannot make the daemon snapshot continuously. A capture
skipped by the limit is said in a `pre_oom` targets row (once per process and PRE_OOM_AGAIN_S)."""

from __future__ import annotations

import os
from collections.abc import Callable

from sampler.proc.cgroups import cgroup_memory_levels, memory_pressure
from sampler.service.config import AnalysisConfig

PRE_OOM_CHECK_S = 1.0
PRE_OOM_AGAIN_S = 300.0         # per process and per cgroup
PRE_OOM_GLOBAL_GAP_S = 5.0      # between any two captures
LEVELS_TTL_S = 60.0             # a process's cgroup levels are read again after this long
_MiB = 1 << 20


class PreOom:
    """`log` takes one line."""

    def __init__(self, cfg: AnalysisConfig, base_mean: int, log: Callable[[str], None]):
        self.cfg, self.base_mean, self.log = cfg, base_mean, log
        self.levels: dict[int, tuple[int, list[tuple[str, int]], float]] = {}  # pid -> (start, levels, when)
        self.windows: dict[int, float] = {}          # pid -> end (monotonic)
        self.last: dict[tuple[int, int], float] = {}  # (pid, start) -> when a window last opened
        self.last_cgroup: dict[str, float] = {}        # cgroup directory -> when a window last opened
        self.last_any = -1e9                           # when any window last opened
        self.said_skip: dict[tuple[int, int], float] = {}  # (pid, start) -> when a skip was last said
        self.skipped = 0                               # captures skipped by the rate limits

    def check(self, now: float, rec, known_start: Callable[[int], int]) -> None:
        """Close windows that ended, open one for each recorded process near its limit.
        `known_start(pid)`: the process's start time (a reused pid is another process)."""
        a = self.cfg
        for pid, end in list(self.windows.items()):
            if now >= end:
                del self.windows[pid]
                if rec.recording(pid):
                    rec.snapshot_now([pid])
                    rec.note(pid, "pre_oom", "window over: snapshot taken")
                    self.log(f"pre-OOM: pid {pid} window over, snapshot written")
        if not a.pre_oom:
            return
        recorded = rec.recorded()
        pids = {r.pid for r in recorded}
        for pid in [p for p in self.levels if p not in pids]:
            del self.levels[pid]
        for pid, comm, tier in recorded:
            start = known_start(pid)
            cached = self.levels.get(pid)
            if cached is None or cached[0] != start or (now - cached[2] > LEVELS_TTL_S):
                cached = self.levels[pid] = (start, cgroup_memory_levels(pid), now)
            levels = cached[1]
            if not levels or pid in self.windows:
                continue
            p, cgroup = tightest(levels)
            if p is None or p[0] < a.pre_oom_fraction:
                continue
            key = (pid, start)
            again = max(2 * a.pre_oom_window_s, PRE_OOM_AGAIN_S)
            if now - self.last.get(key, -1e9) < again:
                continue                            # still near the limit: again in 5 minutes
            ratio, usage, limit = p
            if now - self.last_cgroup.get(cgroup, -1e9) < again or now - self.last_any < PRE_OOM_GLOBAL_GAP_S:
                self._skipped(now, rec, pid, key, cgroup, again)
                continue
            self.last[key] = self.last_cgroup[cgroup] = self.last_any = now
            for d in (self.last, self.last_cgroup, self.said_skip):
                if len(d) > 4096:
                    for k in list(d)[:2048]:
                        del d[k]
            self.windows[pid] = now + a.pre_oom_window_s
            raised = rec.raise_detail(pid, now + a.pre_oom_window_s, a.pre_oom_sample_bytes)
            mean = rec.sample_mean(pid)
            detail = (f"cgroup memory {usage / _MiB:.0f} MiB of its {limit / _MiB:.0f} MiB limit ({100 * ratio:.0f}%, "
                      f"threshold {100 * a.pre_oom_fraction:.0f}%): snapshot now and after {a.pre_oom_window_s:g} s"
                      + (f"; sampled at a {mean} byte mean meanwhile" if mean < self.base_mean else "")
                      + ("; allocation probes attached all the time meanwhile"
                         if raised and tier == "attach" and rec.governed else ""))
            rec.note(pid, "pre_oom", detail)
            rec.snapshot_now([pid])
            self.log(f"pre-OOM: pid {pid} ({comm}) {detail}")

    def _skipped(self, now: float, rec, pid: int, key: tuple[int, int], cgroup: str, again: float) -> None:
        self.skipped += 1
        if now - self.said_skip.get(key, -1e9) < again:
            return
        self.said_skip[key] = now
        why = (f"cgroup {cgroup} had one less than {again:g} s ago" if now - self.last_cgroup.get(cgroup, -1e9) < again
               else f"another process had one less than {PRE_OOM_GLOBAL_GAP_S:g} s ago")
        detail = f"near its cgroup memory limit, capture skipped by the rate limit ({why})"
        rec.note(pid, "pre_oom", detail)
        self.log(f"pre-OOM: pid {pid} {detail}")


def tightest(levels: list[tuple[str, int]]) -> tuple[tuple[float, int, int] | None, str]:
    """memory_pressure of the tightest level, and that cgroup's directory (the per-cgroup key)."""
    best, where = None, ""
    for level in levels:
        p = memory_pressure([level])
        if p is not None and (best is None or p[0] > best[0]):
            best, where = p, os.path.dirname(level[0])
    return best, where
