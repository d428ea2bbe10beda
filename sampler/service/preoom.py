"""Pre-OOM capture: a recorded process whose cgroup nears its memory limit gets a snapshot at once,
finer sampling and full probe coverage for a window, and a snapshot at its end."""

from __future__ import annotations

from collections.abc import Callable

from sampler.proc.cgroups import cgroup_memory_levels, memory_pressure
from sampler.service.config import AnalysisConfig

PRE_OOM_CHECK_S = 1.0
PRE_OOM_AGAIN_S = 300.0
LEVELS_TTL_S = 60.0             # a process's cgroup levels are read again after this long
_MiB = 1 << 20


class PreOom:
    """`log` takes one line."""

    def __init__(self, cfg: AnalysisConfig, base_mean: int, log: Callable[[str], None]):
        self.cfg, self.base_mean, self.log = cfg, base_mean, log
        self.levels: dict[int, tuple[int, list[tuple[str, int]], float]] = {}  # pid -> (start, levels, when)
        self.windows: dict[int, float] = {}          # pid -> end (monotonic)
        self.last: dict[tuple[int, int], float] = {}  # (pid, start) -> when a window last opened

    def check(self, now: float, rec, known_start: Callable[[int], int]) -> None:
        """Close windows that ended, open one for each recorded process near its limit.
        `known_start(pid)`: the process's start time (a reused pid is another process)."""
        a = self.cfg
        for pid, end in list(self.windows.items()):
            if now >= end:
                del self.windows[pid]
                if pid in rec.targets:
                    rec.snapshot_now()
                    rec.note(pid, "pre_oom", "window over: snapshot taken")
                    self.log(f"pre-OOM: pid {pid} window over, snapshot written")
        if not a.pre_oom:
            return
        for pid in [p for p in self.levels if p not in rec.targets]:
            del self.levels[pid]
        for pid, t in list(rec.targets.items()):
            start = known_start(pid)
            cached = self.levels.get(pid)
            if cached is None or cached[0] != start or (now - cached[2] > LEVELS_TTL_S):
                cached = self.levels[pid] = (start, cgroup_memory_levels(pid), now)
            levels = cached[1]
            if not levels or pid in self.windows:
                continue
            p = memory_pressure(levels)
            if p is None or p[0] < a.pre_oom_fraction:
                continue
            key = (pid, start)
            if now - self.last.get(key, -1e9) < max(2 * a.pre_oom_window_s, PRE_OOM_AGAIN_S):
                continue                            # still near the limit: again in 5 minutes
            self.last[key] = now
            if len(self.last) > 4096:
                self.last = dict(list(self.last.items())[-2048:])
            ratio, usage, limit = p
            self.windows[pid] = now + a.pre_oom_window_s
            raised = rec.raise_detail(pid, now + a.pre_oom_window_s, a.pre_oom_sample_bytes)
            mean = rec.sample_mean(pid)
            detail = (f"cgroup memory {usage / _MiB:.0f} MiB of its {limit / _MiB:.0f} MiB limit ({100 * ratio:.0f}%, "
                      f"threshold {100 * a.pre_oom_fraction:.0f}%): snapshot now and after {a.pre_oom_window_s:g} s"
                      + (f"; sampled at a {mean} byte mean meanwhile" if mean < self.base_mean else "")
                      + ("; allocation probes attached all the time meanwhile"
                         if raised and t.tier == "attach" and rec.governor is not None else ""))
            rec.note(pid, "pre_oom", detail)
            rec.snapshot_now()
            self.log(f"pre-OOM: pid {pid} ({t.info.comm}) {detail}")
