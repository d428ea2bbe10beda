"""The overhead controls applied to the probes: the attach tier's governor (sampler/control/governor.py)
and the per-process sample-rate cap (sampler/control/sample_rate.py).

The policies decide; this module carries their decisions out on the BPF side and in the targets,
on one clock for the recorder's loop and its idle pauses alike.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

from sampler.bpf.loader import BpfProbes
from sampler.control.governor import Governor
from sampler.control.sample_rate import SampleRate
from sampler.record.attach import Attacher
from sampler.record.target import ATTACH, RSS, Target

GOVERNOR_TICK_S = 1.0
SAMPLING_TICK_S = 0.25     # a burst of samples fills the ring buffer within a second


class Controls:
    """`note(t, event, detail)` writes a `targets` row."""

    def __init__(self, probes: BpfProbes, governor: Governor | None, sample_rate: SampleRate, sample_mean: int,
                 attacher: Attacher, note: Callable[[Target, str, str], None]):
        self.probes, self.governor, self.sample_rate = probes, governor, sample_rate
        self.base_mean = sample_mean
        self.attacher, self.note = attacher, note
        now = time.monotonic()
        self._next_gov = now + GOVERNOR_TICK_S
        self._next_sampling = now + SAMPLING_TICK_S

    def add(self, t: Target) -> None:
        self.sample_rate.add(t.pid, time.monotonic())

    def forget(self, pid: int) -> None:
        if self.governor is not None:
            self.governor.forget(pid)
        self.sample_rate.forget(pid)

    def sample_mean(self, pid: int) -> int:
        """The process's sampling mean now (bytes)."""
        return round(self.base_mean * 2.0 ** self.sample_rate.shift(pid))

    def tick(self, now: float, targets: dict[int, Target]) -> None:
        """What is due: the governor's phases (every call: duty cycles are fractions of a second;
        its observations once a second) and the sample-rate cap (every SAMPLING_TICK_S)."""
        if self.governor is not None:
            observe = now >= self._next_gov
            self._govern(now, observe, targets)
            if observe:
                self._next_gov = now + GOVERNOR_TICK_S
        if now >= self._next_sampling:
            self._tune_sampling(now, targets)
            self._next_sampling = now + SAMPLING_TICK_S

    def interval(self, t: Target, mono: float, hits: dict[int, tuple[int, int]]) -> None:
        """At a snapshot: the interval's coverage of allocations (None: not the attach tier)."""
        if self.governor is not None and t.tier == ATTACH:
            t.coverage, actions = self.governor.interval(t.pid, mono, hits.get(t.pid, (0, 0)))
            self._apply(t, actions)
        else:
            t.coverage = 1.0 if t.tier == ATTACH else None

    def raise_detail(self, t: Target, until: float, sample_mean: int | None = None) -> bool:
        """Pre-OOM capture until `until` (monotonic): the process is sampled at `sample_mean` or
        the next power-of-two fraction of the recording's mean below it (the sample-rate cap
        still applies), and a duty-cycled attach-tier process gets its allocation probes all the
        time (the governor waits). Returns whether anything changed."""
        changed = False
        if sample_mean and sample_mean < self.base_mean:
            shift = -math.ceil(math.log2(self.base_mean / sample_mean))
            new = self.sample_rate.lower(t.pid, shift, until)
            if new is not None:
                self._set_shift(t, new)
                changed = True
        if self.governor is not None and t.tier == ATTACH:
            actions = self.governor.pin(t.pid, time.monotonic(), until)
            self._apply(t, actions)
            changed |= bool(actions)
        return changed

    # ------------------------------------------------------------------------------------------
    def _govern(self, now: float, observe: bool, targets: dict[int, Target]) -> None:
        hits = self.probes.hits() if observe else {}
        if observe:
            self._price_shared_links(targets)
        for pid, t in list(targets.items()):
            if t.tier != ATTACH:
                continue
            if observe:
                self.governor.observe(pid, now, hits.get(pid, (0, 0)))
            actions = self.governor.tick(pid, now)
            if actions:
                self._apply(t, actions)

    def _tune_sampling(self, now: float, targets: dict[int, Target]) -> None:
        """Samples drawn per process, counted in BPF (what user space reads lags behind under a burst)."""
        drops = self.probes.drops()
        for pid, t in list(targets.items()):
            t.drops = drops.get(pid, t.drops)
            new = self.sample_rate.observe(pid, now, t.drops[3])
            if new is not None:
                self._set_shift(t, new)

    def _set_shift(self, t: Target, shift: int) -> None:
        self.probes.set_sample_shift(t.pid, shift)
        if t.injection is not None:                 # the inject tier samples in the process
            with contextlib.suppress(OSError):
                t.injection.set_mean(self.sample_mean(t.pid))
                t.sampler_mean = self.sample_mean(t.pid)   # said here, not again as the cap's doing
        self.note(t, "sampling", f"sample mean {self.sample_mean(t.pid)} bytes ({self.sample_rate.why(t.pid)})")

    def _price_shared_links(self, targets: dict[int, Target]) -> None:
        """A hit also runs the links of the other targets on the same library: tell the governor
        how many there are for each target (the most over its libraries)."""
        users: dict[tuple, int] = {}
        for t in targets.values():
            for lib in t.libs:
                users[(lib.path, lib.build_id)] = users.get((lib.path, lib.build_id), 0) + 1
        for pid, t in targets.items():
            if t.tier == ATTACH:
                self.governor.sharing(pid, max((users[(lib.path, lib.build_id)] - 1 for lib in t.libs), default=0))

    def _apply(self, t: Target, actions) -> None:
        """Bring the allocation probes to the governor's state. Order matters for the weights:
        probes are paused before the ring buffer is drained and the duty changed, and resumed
        after."""
        pid = t.pid
        st = self.governor.states.get(pid)
        want_on = st is not None and st.on
        if t.allocs_on and not want_on:
            self.probes.pause_allocs(pid)
            t.allocs_on = False
        for a in actions:
            if a.kind == "rss":
                self.probes.drain()
                self.attacher.leave_attach(t, RSS, a.reason)
                return
            if a.kind == "duty":
                self.probes.drain()
                t.duty = self.governor.duty(pid)
                self.note(t, "governor", a.reason)
        if want_on and not t.allocs_on:
            self.attacher.resume_allocs(t)
            t.allocs_on = True
