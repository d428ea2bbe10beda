"""When the recorder next reads a target's allocator layout (sampler/control/pacing.py)."""

from __future__ import annotations

from sampler.control.pacing import Pace, glibc_walk, pymalloc_scan

MiB = 1 << 20


def test_a_walk_waits_its_duty_times_its_cost():
    pace = glibc_walk()
    assert pace.due(0.0)                                # never walked: now
    pace.done(0.0, cpu_s=0.07)                          # an 84 MiB heap
    assert not pace.due(6.9) and pace.due(7.0 + 1e-9)   # 1% of a CPU
    pace.done(10.0, cpu_s=0.0005)                       # a small heap: every snapshot
    assert pace.due(10.1)


def test_a_scan_waits_for_a_reason_its_cost_allows():
    pace = pymalloc_scan()
    assert pace.due(0.0, (100 * MiB, 10 * MiB))
    pace.done(0.0, cpu_s=0.02, found=True, marks=(100 * MiB, 10 * MiB))
    assert not pace.due(1.0, (200 * MiB, 10 * MiB))     # moved, but its cost says wait 2 s
    assert not pace.due(5.0, (105 * MiB, 10.5 * MiB))   # allowed, but nothing moved by an eighth
    assert pace.due(5.0, (100 * MiB, 8 * MiB))          # objects dropped while RSS stayed
    assert pace.due(5.0, (87 * MiB, 10 * MiB))          # RSS moved by an eighth
    assert pace.due(60.0, (100 * MiB, 10 * MiB))        # a minute: due anyway
    small = Pace(duty=100, every_s=60.0)
    small.done(0.0, 0.0, marks=(0.0, 0.0))              # from nothing, a byte is not a move
    assert not small.due(1.0, (1000.0, 1000.0)) and small.due(1.0, (float(MiB), 0.0))


def test_a_scan_that_found_nothing_waits_long():
    pace = pymalloc_scan()
    pace.done(0.0, cpu_s=0.01, found=False, marks=(100 * MiB, 0.0))
    assert not pace.due(599.0, (400 * MiB, 50 * MiB)) and pace.due(600.0, (400 * MiB, 50 * MiB))
