"""The per-process sampling mean (sampler/control/sample_rate.py) and the reconciliation of sampled
mappings with /proc/PID/maps (ProcessTable.keep_mapped): plain logic, no BPF."""

from __future__ import annotations

from sampler.control.sample_rate import MIN_CAP, SHIFT_MAX, SampleRate
from sampler.record.outstanding import FAULT, MMAP, ProcessTable


def feed(sr: SampleRate, pid: int, rate: float, seconds: float, t: float, n: int,
         step: float = 0.25) -> tuple[float, int, list[int]]:
    """Samples arriving at `rate` per second; returns the time, the count and the shifts set."""
    shifts = []
    for _ in range(round(seconds / step)):
        t += step
        n += round(rate * step * 2.0 ** -sr.shift(pid))      # what a raised mean lets through
        if (s := sr.observe(pid, t, n)) is not None:
            shifts.append(s)
    return t, n, shifts


def test_a_burst_raises_the_mean_enough_at_once_and_it_comes_back_step_by_step():
    sr = SampleRate(2000)
    sr.add(1, 0.0)
    t, n, shifts = feed(sr, 1, 150_000, 1.0, 0.0, 0)
    # 150k/s -> at most cap/2 after one tick: 2^8 (150k / 256 = 586/s; 2^7 would leave 1.2k/s)
    assert shifts[0] == 8 and sr.shift(1) == 8
    assert "over the cap" in sr.why(1)
    t, n, shifts = feed(sr, 1, 150_000, 3.0, t, n)
    assert shifts == []                                    # within the cap: no oscillation
    t, n, shifts = feed(sr, 1, 100, 3.0, t, n)             # the burst is over
    assert shifts == [7, 6, 5, 4, 3, 2, 1, 0] and sr.shift(1) == 0


def test_a_recorder_over_its_cpu_budget_raises_the_busiest_means_before_anything_drops():
    sr = SampleRate(2000)
    sr.add(1, 0.0)                          # busy: 1,500 samples/s, under the configured cap
    sr.add(2, 0.0)                          # quiet: 20 samples/s
    t, n1, _ = feed(sr, 1, 1500, 1.0, 0.0, 0)
    t2, n2, _ = feed(sr, 2, 20, 1.0, 0.0, 0)
    assert sr.shift(1) == 0
    caps = []
    while sr.squeeze("the daemon is over its CPU budget of 10%"):
        caps.append(sr.cap)
    assert caps == [1000, 500, 250, 125, 62.5, MIN_CAP]       # halved down to its floor, no further
    t, n1, shifts = feed(sr, 1, 1500, 1.0, t, n1)
    feed(sr, 2, 20, 1.0, t2, n2)
    # the busy process's mean rises until its rate is at most half the squeezed cap; the quiet one's does not
    assert sr.shift(1) >= 6 and 1500 * 2.0 ** -sr.shift(1) <= MIN_CAP / 2
    assert "over the cap of 50" in sr.why(1) and "over its CPU budget" in sr.why(1)
    assert sr.shift(2) == 0
    relaxed = []
    while sr.relax():
        relaxed.append(sr.cap)
    assert relaxed[-1] == 2000 and sr.squeezed_why == ""      # back to the configured cap


def test_the_shift_is_bounded_and_a_cap_of_zero_is_off():
    sr = SampleRate(10)
    sr.add(1, 0.0)
    feed(sr, 1, 10**9, 2.0, 0.0, 0)
    assert sr.shift(1) == SHIFT_MAX
    off = SampleRate(0)
    off.add(2, 0.0)
    assert feed(off, 2, 10**6, 2.0, 0.0, 0)[2] == []


def test_pre_oom_lowers_the_mean_for_a_window_and_the_cap_still_applies():
    sr = SampleRate(2000)
    sr.add(1, 0.0)
    assert sr.lower(1, -3, until=5.0) == -3 and sr.why(1) == "pre-OOM capture"
    t, n, shifts = feed(sr, 1, 50, 2.0, 0.0, 0)            # quiet: stays at the floor
    assert shifts == [] and sr.shift(1) == -3
    t, n, shifts = feed(sr, 1, 200, 1.0, t, n)             # 8x the samples at 1/8 the mean: 1.6k/s
    assert shifts == []
    t, n, shifts = feed(sr, 1, 50_000, 0.5, t, n)          # a burst: the cap wins over the floor
    assert shifts and shifts[0] > -3
    t, n, shifts = feed(sr, 1, 10, 4.0, t, n)              # the window ended at 5 s
    assert sr.shift(1) == 0 and t > 5.0


def test_a_forgotten_process_has_the_default_mean():
    sr = SampleRate(100)
    sr.add(1, 0.0)
    feed(sr, 1, 10_000, 1.0, 0.0, 0)
    sr.forget(1)
    assert sr.shift(1) == 0 and sr.observe(1, 9.0, 10**6) is None


def test_keep_mapped_drops_what_lies_outside_the_mappings():
    t = ProcessTable()
    t.map(0x10000, 0x4000, 0x4000, 1, 0)             # a sampled mapping, still mapped
    t.map(0x20000, 0x4000, 0x8000, 2, 0)             # half of it unmapped unseen (p = 0.5)
    t.map(0x40000, 0x1000, 0x1000, 3, 0)             # gone entirely
    t.map(0x50000, 0x1000, 0x1000, 4, 0, FAULT)      # a faulted-in page in a live mapping
    t.map(0x60000, 0x1000, 0x1000, 5, 0, FAULT)      # one whose mapping is gone
    t.keep_mapped([(0x8000, 0x18000), (0x20000, 0x22000), (0x50000, 0x51000)])
    assert t.regions(MMAP) == [(0x10000, 0x14000), (0x20000, 0x22000)]
    assert t.regions(FAULT) == [(0x50000, 0x51000)]
    live = {r["stack_id"]: r["outstanding_bytes"] for r in t.snapshot(1)}
    assert live[1] == 0x4000 and live[2] == 0x2000 / 0.5 and live[3] == 0 and live[5] == 0
