"""The outstanding table (sampler/record/outstanding.py): allocations and frees, reused addresses,
undone frees, partial unmaps, fault pages, late frees and mappings split into fragments."""

from __future__ import annotations

import pytest

from sampler.control import weights
from sampler.record.outstanding import MALLOC, MMAP, ProcessTable

T = 512 << 10


def test_table_alloc_free_and_snapshot():
    t = ProcessTable()
    w = weights.unbiased_weight(1000, T)
    t.alloc(0x1000, 1000, w, 7, ts_ns=1)
    t.alloc(0x2000, 1000, w, 7, ts_ns=2)
    t.alloc(0x3000, 1000, w, 8, ts_ns=3)
    assert t.free(0x1000) and not t.free(0x1000)      # a double free counts once
    rows = {r["stack_id"]: r for r in t.snapshot(now_ns=10**9 + 2)}
    assert rows[7]["outstanding_bytes"] == pytest.approx(w)
    assert rows[7]["allocated_bytes"] == pytest.approx(2 * w)
    assert rows[7]["freed_bytes"] == pytest.approx(w)
    assert rows[7]["oldest_age_s"] == pytest.approx(1.0)
    assert rows[7]["live_samples"] == 1 and rows[7]["alloc_samples"] == 2 and rows[7]["free_samples"] == 1
    t.free(0x2000)
    rows = {r["stack_id"]: r for r in t.snapshot(now_ns=2 * 10**9)}
    assert rows[7]["outstanding_bytes"] == 0 and rows[7]["allocated_bytes"] == 0 and rows[7]["freed_bytes"] > 0
    assert {r["stack_id"] for r in t.snapshot(now_ns=3 * 10**9)} == {8}    # empty stacks go away


def test_reused_address_replaces_a_missed_free():
    t = ProcessTable()
    t.alloc(0x1000, 64, T, 1, 0)
    t.alloc(0x1000, 64, T, 2, 0)
    assert t.totals(MALLOC)[0] == pytest.approx(T)


def test_unfree_gives_back_a_block_whose_realloc_failed():
    """The in-process samplers report a sampled block freed before realloc and undo it when the
    realloc fails: the block is back, with its stack, age and sums; an undo that does not match
    the last free of that address (another block got it, or the born time differs) does nothing."""
    t = ProcessTable()
    w = weights.unbiased_weight(1000, T)
    t.alloc(0x1000, 1000, w, 7, ts_ns=5)
    t.alloc(0x2000, 1000, w, 7, ts_ns=9)
    assert t.free(0x1000, 5)
    assert not t.unfree(0x1000, born=6)                  # not the block that was freed
    assert t.unfree(0x1000, born=5) and not t.unfree(0x1000, born=5)
    rows = {r["stack_id"]: r for r in t.snapshot(now_ns=10**9 + 5)}
    assert rows[7]["outstanding_bytes"] == pytest.approx(2 * w) and rows[7]["freed_bytes"] == pytest.approx(0)
    assert rows[7]["live_samples"] == 2 and rows[7]["oldest_age_s"] == pytest.approx(1.0)   # its age kept
    assert t.free(0x2000)
    t.alloc(0x2000, 64, T, 8, ts_ns=20)                  # the address was taken again
    assert not t.unfree(0x2000) and t.totals(MALLOC)[0] == pytest.approx(w + T)


def test_mmap_partial_unmaps():
    t = ProcessTable()
    size = 4 << 20                                     # p ~ 1
    w = weights.unbiased_weight(size, T)
    t.map(0x10000000, size, w, 5, 0)
    t.unmap(0x10000000 + (1 << 20), 1 << 20)          # hole in the middle
    assert t.totals(MMAP)[0] == pytest.approx(3 << 20, rel=1e-3)
    assert len(t.regions()) == 2
    t.unmap(0x0, 0x10000000 + (2 << 20))               # covers the first fragment
    assert t.totals(MMAP)[0] == pytest.approx(2 << 20, rel=1e-3)
    w1 = weights.unbiased_weight(1 << 20, T)
    t.map(0x10000000 + (3 << 20), 1 << 20, w1, 6, 0)   # MAP_FIXED over the upper half
    assert t.totals(MMAP)[0] == pytest.approx((1 << 20) * w / size + w1, rel=1e-6)
    rows = {r["stack_id"]: r for r in t.snapshot(0)}
    assert rows[5]["live_samples"] == 1 and rows[6]["live_samples"] == 1


def test_fault_pages_are_released_by_madvise_and_moved_by_mremap():
    """Fault pages are their own ranges: madvise(DONTNEED) releases them and keeps an mmap region
    sampled over the same addresses; mremap moves them; munmap removes both."""
    from sampler.record.outstanding import FAULT
    t = ProcessTable()
    base, page, period = 0x20000000, 4096, 61
    t.map(base, 1 << 20, weights.unbiased_weight(1 << 20, T), 1, 0)               # the mapping
    for i in range(8):
        t.map(base + i * page, page, period * page, 2, 0, FAULT)                   # sampled faults
    assert t.totals(FAULT)[0] == 8 * period * page
    t.unmap(base, 2 * page, (FAULT,))                                              # MADV_DONTNEED
    assert t.totals(FAULT)[0] == 6 * period * page and t.totals(MMAP)[0] > 0
    t.move(base, 1 << 20, 0x30000000, 5 * page)                                    # mremap, shrinking
    assert [lo for lo, _ in t.regions(FAULT)] == [0x30000000 + i * page for i in range(2, 5)]
    assert t.totals(FAULT)[0] == 3 * period * page
    t.unmap(0x30000000, 5 * page)                                                  # munmap
    assert t.totals(FAULT)[0] == 0 and not t.regions(FAULT)


def test_a_late_free_does_not_remove_a_newer_block():
    t = ProcessTable()
    t.alloc(0x1000, 64, T, 1, ts_ns=100)
    t.alloc(0x1000, 64, T, 2, ts_ns=200)        # same address reused before the free arrived
    assert not t.free(0x1000, born=100)           # the old block's free: ignored
    assert t.totals(MALLOC)[0] == pytest.approx(T)
    assert t.free(0x1000, born=200)
    assert t.totals(MALLOC)[0] == 0


def test_fragments_of_one_mapping_are_one_sample():
    t = ProcessTable()
    size = 8 << 20
    p = weights.inclusion_probability(size, 64 << 20)          # a mapping sampled with p ~ 0.12
    t.map(0x20000000, size, size / p, 9, ts_ns=0)
    t.map(0x40000000, size, size / p, 9, ts_ns=50 * 10**9)
    for k in range(7):                                          # seven single pages unmapped
        t.unmap(0x20000000 + (k + 1) * (1 << 20), 4096)
    remaining = size - 7 * 4096
    row = t.snapshot(now_ns=100 * 10**9)[0]
    assert row["live_samples"] == 2
    assert row["outstanding_objects"] == pytest.approx(2 / p)
    assert row["outstanding_bytes"] == pytest.approx((remaining + size) / p)
    assert row["outstanding_stderr_bytes"] == pytest.approx(((remaining / p) ** 2 * (1 - p)
                                                             + (size / p) ** 2 * (1 - p)) ** 0.5)
    assert row["oldest_age_s"] == pytest.approx(100)
    t.unmap(0x20000000, size)
    t.unmap(0x40000000, size)
    row = t.snapshot(now_ns=101 * 10**9)[0]
    assert row["live_samples"] == 0 and row["outstanding_bytes"] == pytest.approx(0, abs=1e-3)
