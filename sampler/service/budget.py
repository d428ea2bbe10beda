"""The daemon's own CPU budget: a token bucket over its CPU time."""

from __future__ import annotations

import time

CPU_BURST_S = 3.0               # the budget may be spent ahead by this many seconds' worth


class CpuBudget:
    """A token bucket over the process's CPU time (all threads): `fraction` of a CPU per second of
    wall time, at most `burst_s` seconds' worth saved up."""

    def __init__(self, fraction: float, burst_s: float = CPU_BURST_S):
        self.fraction = fraction
        self.cap = fraction * burst_s
        self.allowance = self.cap
        self.t, self.cpu = time.monotonic(), time.process_time()
        self.throttled_s = 0.0

    def owed(self) -> float:
        """Seconds to stop working for, to be back within the budget (0: within it)."""
        now, cpu = time.monotonic(), time.process_time()
        self.allowance = min(self.cap, self.allowance + (now - self.t) * self.fraction - (cpu - self.cpu))
        self.t, self.cpu = now, cpu
        return -self.allowance / self.fraction if self.allowance < 0 else 0.0
