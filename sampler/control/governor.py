"""The overhead governor of the attach tier: keep each target's probe cost within a CPU budget.

Every allocator probe hit costs the target a trap (~1.35-6 us here, calibrated at start-up by
sampler/control/probe_cost.py). From each target's hit rates the governor estimates that cost as a
fraction of one CPU; a hit also runs the probe links of every other target on the same library,
so each of those adds `link_ns` to it. Over the budget it first duty-cycles the *allocation* probes: they are
attached for a fraction `duty` of each cycle, at a random phase, while free probes stay
attached so that every sampled block's free is still seen. An allocation is then sampled with
probability duty x (1 - exp(-S/T)), so its weight is divided by `duty` (Horvitz-Thompson again):
estimates stay unbiased and their standard errors grow, honestly, as long as the target allocates
at the same rate in both phases (a CPU-starved target whose on phases run slower and catch up
off them reads low: 0.61 of its leak beside a busy neighbour, CI 2026-12-01). When frees alone would exceed
the budget, or the duty would fall below `min_duty`, the target moves to the always-on tier
(sampled page faults, no uprobes).

Plain logic: the recorder feeds hit counts and applies the returned actions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FULL, DUTY, RSS = "full", "duty", "rss"


@dataclass
class TargetState:
    level: str = FULL
    duty: float = 1.0                 # fraction of time the allocation probes are attached
    on: bool = True
    next_toggle: float = float("inf")
    cycle_end: float = 0.0            # end of the current duty cycle
    alloc_rate: float = 0.0           # allocation hits per second while attached (smoothed)
    free_rate: float = 0.0            # free hits per second (smoothed)
    last_hits: tuple[int, int] | None = None
    last_t: float = 0.0
    on_since: float = 0.0             # when the current on phase began (if on)
    on_time: float = 0.0              # seconds attached since the last interval's report
    on_total: float = 0.0             # seconds attached in finished on phases, ever
    last_on_total: float = 0.0        # attached seconds up to the last observation
    iv_hits: tuple[int, int] | None = None    # hits, attached seconds and time at the last
    iv_on_total: float = 0.0                  # interval's end: duty-cycled rates are measured
    iv_t: float = 0.0                         # over whole intervals (tick windows are too noisy)
    interval_t0: float = 0.0
    pinned_until: float = 0.0         # full coverage until then, whatever it costs (pre-OOM capture)
    cost_ns: float = 0.0              # per hit: the calibrated cost + link_ns x other targets' links


@dataclass(frozen=True)
class Action:
    kind: str            # "pause" | "resume" | "duty" | "rss"
    reason: str = ""


class Governor:
    def __init__(self, budget: float, cost_ns: float, cycle_s: float = 2.0, min_duty: float = 0.05,
                 seed: int | None = None, link_ns: float = 0.0):
        self.budget = budget              # fraction of one CPU per process
        self.cost_ns = cost_ns            # per probe hit
        self.link_ns = link_ns            # per probe hit and link of another target at that address
        self.cycle_s = cycle_s
        self.min_duty = min_duty
        self.states: dict[int, TargetState] = {}
        self._rng = random.Random(seed)

    def add(self, pid: int, now: float) -> None:
        self.states[pid] = TargetState(last_t=now, on_since=now, interval_t0=now, cost_ns=self.cost_ns)

    def sharing(self, pid: int, others: int) -> None:
        """`others` other targets have probe links on this target's allocator library."""
        if (st := self.states.get(pid)) is not None:
            st.cost_ns = self.cost_ns + self.link_ns * others

    def cost(self, pid: int) -> float:
        st = self.states.get(pid)
        return st.cost_ns if st else self.cost_ns

    def forget(self, pid: int) -> None:
        self.states.pop(pid, None)

    def duty(self, pid: int) -> float:
        st = self.states.get(pid)
        return st.duty if st else 1.0

    def cpu(self, alloc_rate: float, free_rate: float, duty: float = 1.0, cost_ns: float | None = None) -> float:
        """Fraction of one CPU the probes cost at these hit rates."""
        return (duty * alloc_rate + free_rate) * (cost_ns or self.cost_ns) * 1e-9

    def observe(self, pid: int, now: float, hits: tuple[int, int]) -> None:
        """New cumulative hit counts (allocation, free) of a target."""
        st = self.states.get(pid)
        if st is None:
            return
        attached = _attached(st, now)
        if st.iv_hits is None:
            st.iv_hits, st.iv_on_total, st.iv_t = hits, attached, now
        if st.last_hits is not None and st.level == FULL:
            dt = now - st.last_t
            on = attached - st.last_on_total
            da, df = (max(0, a - b) for a, b in zip(hits, st.last_hits, strict=True))
            if dt > 0.05:
                st.free_rate = _smooth(st.free_rate, df / dt)
            if on > 0.05:
                st.alloc_rate = _smooth(st.alloc_rate, da / on)
        st.last_hits, st.last_t, st.last_on_total = hits, now, attached

    def tick(self, pid: int, now: float) -> list[Action]:
        """Phase toggles of a duty-cycled target, and the first reaction to a target over budget
        (decided at once: an overload must not wait for the interval's end)."""
        st = self.states.get(pid)
        if st is None or st.level == RSS or now < st.pinned_until:
            return []
        if st.level == FULL:
            full = self.cpu(st.alloc_rate, st.free_rate, cost_ns=st.cost_ns)
            if full > self.budget and st.last_hits is not None:
                return self._reduce(st, now, full)
            return []
        out = []
        # the probes change state when the recorder applies this, i.e. now: the bookkeeping
        # uses now too, not the scheduled time (a late tick must not count time twice)
        if now >= st.next_toggle:
            if st.on:
                _end_on(st, now)
                out.append(Action("pause"))
                self._next_cycle(st, now)
            else:
                st.on, st.on_since = True, now
                out.append(Action("resume"))
                st.next_toggle = now + st.duty * self.cycle_s
        return out

    def pin(self, pid: int, now: float, until: float) -> list[Action]:
        """Allocation probes attached all the time until `until` (the daemon's pre-OOM window),
        over the budget if need be; the budget applies again after it. A target already moved to
        the always-on tier stays there."""
        st = self.states.get(pid)
        if st is None or st.level == RSS:
            return []
        st.pinned_until = max(st.pinned_until, until)
        if st.level == FULL:
            return []
        st.level, st.duty, st.next_toggle = FULL, 1.0, float("inf")
        out = [Action("duty", f"pre-OOM capture: allocation probes attached all the time for "
                              f"{until - now:.0f} s, whatever they cost")]
        if not st.on:
            st.on, st.on_since = True, now
            out.append(Action("resume"))
        return out

    def _next_cycle(self, st: TargetState, now: float) -> None:
        """The cycle ending at `cycle_end` has had its on phase: schedule the next cycle's. Each
        cycle of `cycle_s` seconds has one on phase of duty x cycle_s at a uniformly random
        offset, so that every moment is covered with probability `duty`."""
        while st.cycle_end < now:          # late: skip whole cycles
            st.cycle_end += self.cycle_s
        st.next_toggle = st.cycle_end + (1 - st.duty) * self.cycle_s * self._rng.random()
        st.cycle_end += self.cycle_s

    def _reduce(self, st: TargetState, now: float, full: float) -> list[Action]:
        free_cpu = self.cpu(0.0, st.free_rate, cost_ns=st.cost_ns)
        alloc_cpu = self.cpu(st.alloc_rate, 0.0, cost_ns=st.cost_ns)
        duty = (self.budget - free_cpu) / alloc_cpu if alloc_cpu > 0 else 1.0
        what = (f"probes would cost {100 * full:.1f}% of a CPU ({st.alloc_rate:,.0f} allocation + "
                f"{st.free_rate:,.0f} free hits/s x {st.cost_ns / 1000:.2f} us), over the "
                f"{100 * self.budget:g}% budget")
        if duty < self.min_duty:
            st.level = RSS
            if st.on:
                _end_on(st, now)
            return [Action("rss", f"{what}; frees alone cost {100 * free_cpu:.1f}%: moved to the "
                                  "always-on tier (sampled page faults)")]
        st.duty = _round_down(duty)
        st.level = DUTY
        # the current on phase ends now: cycles start here
        if st.on:
            _end_on(st, now)
        st.cycle_end = now
        self._next_cycle(st, now)
        return [Action("duty", f"{what}: allocation probes attached {100 * st.duty:.0f}% of the time, "
                               "free probes always; sampled weights divided by the duty"),
                Action("pause")]

    def interval(self, pid: int, now: float, hits: tuple[int, int] | None = None) -> tuple[float, list[Action]]:
        """At a snapshot, with the target's hit counts now: the fraction of the interval with
        allocation probes attached, and a new duty when the load changed (weights change only
        here, after the ring buffer is drained)."""
        st = self.states.get(pid)
        if st is None:
            return 1.0, []
        span = now - st.interval_t0
        on = st.on_time + (now - st.on_since if st.on else 0.0)
        coverage = min(1.0, on / span) if span > 0 else 1.0
        if st.on:                      # split the running phase at the interval's end
            _end_on(st, now)
            st.on, st.on_since = True, now
        st.on_time, st.interval_t0 = 0.0, now
        out: list[Action] = []
        if hits is not None:
            attached = _attached(st, now)
            if st.level == DUTY and st.iv_hits is not None:
                on = attached - st.iv_on_total
                da, df = (max(0, a - b) for a, b in zip(hits, st.iv_hits, strict=True))
                if now - st.iv_t > 0.5:
                    st.free_rate = _smooth(st.free_rate, df / (now - st.iv_t))
                if on > 0.2:
                    st.alloc_rate = _smooth(st.alloc_rate, da / on)
            st.iv_hits, st.iv_on_total, st.iv_t = hits, attached, now
        if st.level == DUTY:
            full = self.cpu(st.alloc_rate, st.free_rate, cost_ns=st.cost_ns)
            if full < 0.5 * self.budget:
                st.level, st.duty = FULL, 1.0
                st.next_toggle = float("inf")
                if not st.on:
                    st.on, st.on_since = True, now
                    out.append(Action("resume"))
                out.insert(0, Action("duty", f"probes would cost {100 * full:.1f}% of a CPU at full rate: "
                                             "allocation probes attached all the time again"))
            else:
                alloc_cpu = self.cpu(st.alloc_rate, 0.0, cost_ns=st.cost_ns)
                duty = (self.budget - self.cpu(0.0, st.free_rate, cost_ns=st.cost_ns)) / alloc_cpu if alloc_cpu else 1.0
                if duty < self.min_duty:
                    st.level = RSS
                    if st.on:
                        _end_on(st, now)
                        out.append(Action("pause"))
                    out.insert(0, Action("rss", f"probes would cost {100 * full:.1f}% of a CPU even "
                                                f"at the {100 * self.min_duty:.0f}% minimum duty: moved "
                                                "to the always-on tier (sampled page faults)"))
                else:
                    new = _round_down(min(1.0, duty))
                    if abs(new - st.duty) > 0.25 * st.duty:
                        st.duty = new
                        out.append(Action("duty", f"load changed: allocation probes attached "
                                                  f"{100 * new:.0f}% of the time"))
        return coverage, out


def _end_on(st: TargetState, t: float) -> None:
    st.on_time += t - st.on_since
    st.on_total += t - st.on_since
    st.on = False


def _attached(st: TargetState, now: float) -> float:
    """Seconds the allocation probes have been attached, ever, up to `now`."""
    return st.on_total + (now - st.on_since if st.on else 0.0)


def _smooth(old: float, new: float) -> float:
    return new if old == 0 else 0.5 * old + 0.5 * new


def _round_down(d: float) -> float:
    """Two significant digits, rounded down: the budget is a ceiling."""
    if d >= 1:
        return 1.0
    scale = 100 if d >= 0.1 else 1000
    return max(1, int(d * scale)) / scale
