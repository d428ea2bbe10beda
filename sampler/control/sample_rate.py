"""Per-process sampling means: a power-of-two shift of the compiled mean, applied in BPF.

A process whose samples come faster than `cap` per second (an mmap storm, a loop of large
allocations, a tiny --sample-bytes) would make the recorder fall behind and lose events for
every process. Its mean is raised by the power of two that brings its rate to at most cap/2,
and lowered one step at a time once the rate is at most cap/4 (the preload shim's rule,
sampler/inprocess/preload.c). A recorder over its own CPU budget halves the cap (`squeeze`),
down to MIN_CAP, before it lets events drop; it doubles back (`relax`) once under budget again.
The pre-OOM capture lowers the mean below the compiled one for a window (`lower`), the cap still
applying.

Weights need no correction: bpf/common.h sample_bytes computes each sample's weight with the
mean in force for that allocation, and the shared countdown is memoryless, so every sum of
weights stays unbiased whatever the means did; the standard errors, computed from the weights,
grow as they should.

Plain logic: the recorder feeds cumulative sample counts and applies the returned shifts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sampler.bpf.abi import SHIFT_MAX, SHIFT_MIN


@dataclass
class _State:
    t0: float
    count0: int = 0
    shift: int = 0
    floor: int = 0                     # the lowest shift allowed now (pre-OOM: below 0)
    floor_until: float = 0.0
    why: str = ""                      # of the last change


MIN_CAP = 50.0                         # samples/s per process the CPU budget never goes below


class SampleRate:
    def __init__(self, cap_per_s: float, window_s: float = 0.25):
        self.cap = cap_per_s           # 0: no cap
        self.configured = cap_per_s
        self.window_s = window_s
        self.states: dict[int, _State] = {}
        self.squeezed_why = ""         # why the cap is below the configured one

    def squeeze(self, why: str) -> bool:
        """The recorder is over its CPU budget: halve the cap (the busiest processes' means rise
        first). False when it is at its floor already (only then may events be dropped)."""
        if self.configured <= 0 or self.cap <= MIN_CAP:
            return False
        self.cap = max(MIN_CAP, self.cap / 2)
        self.squeezed_why = why
        return True

    def relax(self) -> bool:
        """Back within the budget with room to spare: double the cap, up to the configured one."""
        if self.cap >= self.configured:
            return False
        self.cap = min(self.configured, self.cap * 2)
        if self.cap >= self.configured:
            self.squeezed_why = ""
        return True

    def add(self, pid: int, now: float, samples: int = 0) -> None:
        self.states[pid] = _State(now, samples)

    def forget(self, pid: int) -> None:
        self.states.pop(pid, None)

    def shift(self, pid: int) -> int:
        st = self.states.get(pid)
        return st.shift if st else 0

    def why(self, pid: int) -> str:
        st = self.states.get(pid)
        return st.why if st else ""

    def lower(self, pid: int, shift: int, until: float) -> int | None:
        """Sample a process at SAMPLE_MEAN * 2^shift (shift < 0) until `until`; returns its new
        shift when it changes."""
        st = self.states.get(pid)
        if st is None:
            return None
        st.floor, st.floor_until = max(SHIFT_MIN, min(0, shift)), until
        return self._set(st, min(st.shift, st.floor), "pre-OOM capture")

    def observe(self, pid: int, now: float, samples: int) -> int | None:
        """The process's cumulative count of samples drawn; returns its new shift when it
        changes. Rates are measured over windows of at least `window_s`."""
        st = self.states.get(pid)
        if st is None:
            return None
        if st.floor_until and now >= st.floor_until:
            st.floor, st.floor_until = 0, 0.0
        elapsed = now - st.t0
        if elapsed < self.window_s:
            return self._set(st, max(st.shift, st.floor), "pre-OOM window over")
        rate = (samples - st.count0) / elapsed
        st.t0, st.count0 = now, samples
        shift, why = st.shift, f"{rate:.0f} samples/s"
        if self.cap > 0 and rate > self.cap:
            shift += math.ceil(math.log2(rate / (self.cap / 2)))
            why += f", over the cap of {self.cap:g}"
            if self.squeezed_why:
                why += f" (lowered from {self.configured:g}: {self.squeezed_why})"
        elif (self.cap <= 0 or rate <= self.cap / 4) and shift > st.floor:
            shift -= 1
        if shift < st.floor:
            shift, why = st.floor, "pre-OOM window over"
        return self._set(st, shift, why)

    @staticmethod
    def _set(st: _State, shift: int, why: str) -> int | None:
        shift = max(SHIFT_MIN, min(SHIFT_MAX, shift))
        if shift == st.shift:
            return None
        st.shift, st.why = shift, why
        return shift
