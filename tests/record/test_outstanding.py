"""Pure-Python pieces: weights, the outstanding table, event decoding, the writer, the schema doc."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import ROOT

from sampler.bpf import abi
from sampler.bpf.abi import EvType, UwStop
from sampler.bpf.events import HEADER, STACK, decode
from sampler.cli.args import size as _size
from sampler.control import weights
from sampler.dataset.schema import OUTSTANDING, TABLES
from sampler.dataset.writer import DatasetWriter
from sampler.record.outstanding import MALLOC, MMAP, ProcessTable

T = 512 << 10


def test_weight_formula():
    assert weights.unbiased_weight(T * 100, T) == pytest.approx(T * 100)
    assert weights.unbiased_weight(1, T) == pytest.approx(T + 0.5, rel=1e-6)
    for s in (1, 100, T // 3, T, 5 * T):
        p = weights.inclusion_probability(s, T)
        assert weights.unbiased_weight(s, T) * p == pytest.approx(s)


def _bpf_weight(size: int, mean: int, tab: list[int]) -> int:
    """sampler/bpf/common.h sample_bytes(), integer for integer."""
    if size >= abi.WTAB_MAX_X * mean:
        return size
    xq = (size << 22) // mean
    i = xq >> 16
    if i >= abi.WTAB_N - 1:
        return size
    h = tab[i] + (((tab[i + 1] - tab[i]) * (xq & 0xFFFF)) >> 16)
    return (mean * h) >> 20


@pytest.mark.parametrize("mean", [64 << 10, 512 << 10, 2 << 20])
def test_bpf_weight_interpolation_matches_formula(mean):
    tab = weights.weight_table()
    assert tab[0] == 1 << 20 and all(a < b for a, b in zip(tab[:-1], tab[1:], strict=True))
    for size in [1, 16, 100, 4096, mean // 2, mean, 3 * mean, 10 * mean, 23 * mean, 25 * mean]:
        assert _bpf_weight(size, mean, tab) == pytest.approx(weights.unbiased_weight(size, mean), rel=2e-5)


def test_sample_terms():
    var, objects, objects_var = weights.sample_terms(T, weights.unbiased_weight(T, T))
    p = 1 - math.exp(-1)
    assert objects == pytest.approx(1 / p)
    assert var == pytest.approx((T / p) ** 2 * (1 - p))
    assert weights.sample_terms(10 * T * 30, 10 * T * 30) == (0.0, 1.0, 0.0)


def test_chunk_size():
    assert [weights.chunk_size(n) for n in (0, 24, 25, 100)] == [32, 32, 48, 112]


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


def test_event_decoding():
    stack = bytes(range(40))
    # a walk handed over (UwStop.NO_MAP) after 3 pcs: Python frames, pcs, then the copy
    raw = STACK.pack(EvType.ALLOC, 1, 1, 42, 43, 0, 123, 0xABC, 64, T, 0, 2**64 - 12,
                     0x1111, 0x7FF000, 0x7FF100, 0x7FF008, 0x4444, len(stack), 2, 3, UwStop.NO_MAP)
    raw += struct.pack("<4Q", 0xA | 1 << 56, 0xB, 0xC, 0xD) + struct.pack("<3Q", 0x1111, 0x2222, 0x3333) + stack
    ev = decode(raw)
    assert (ev.pid, ev.tid, ev.addr, ev.size, ev.weight, ev.ret) == (42, 43, 0xABC, 64, T, -12)
    assert (ev.ip, ev.sp, ev.bp, ev.ra_slot, ev.ra) == (0x1111, 0x7FF000, 0x7FF100, 0x7FF008, 0x4444)
    assert ev.py == ((0xA | 1 << 56, 0xB), (0xC, 0xD)) and ev.stack == stack
    assert ev.pcs == (0x1111, 0x2222, 0x3333) and ev.stop == UwStop.NO_MAP
    # a walk that ended in BPF: pcs and no copy
    raw = STACK.pack(EvType.ALLOC, 1, 1, 42, 43, 0, 123, 0xABC, 64, T, 0, 0, 0x1111, 0x7FF000, 0x7FF100, 0, 0,
                     0, 0, 2, UwStop.ENTRY) + struct.pack("<2Q", 0x1111, 0x2222)
    walked = decode(raw)
    assert walked.pcs == (0x1111, 0x2222) and walked.stack == b"" and walked.py == ()
    small = decode(HEADER.pack(EvType.FREE, 1, 11, 42, 43, 0, 1, 0xABC, 0, 0, 0, 0))
    assert small.stack == b"" and small.py == () and small.ip == 0


def test_writer_is_atomic_and_partitioned(tmp_path):
    w = DatasetWriter(tmp_path, "rec1")
    row = {c.name: None for c in OUTSTANDING.columns}
    row.update(pid=1, source="malloc", stack_id=5, outstanding_bytes=1.0, recording_id="rec1", host="h")
    path = w.write(OUTSTANDING, [row])
    assert path.parent.name.startswith("date=") and path.parent.parent.name == "host=unknown"
    assert path.parent.parent.parent.name == "outstanding"
    (path.parent / ".junk.parquet.tmp").write_bytes(b"partial")       # a killed writer's leftover
    assert len(pd.read_parquet(tmp_path / "outstanding")) == 1        # readers skip dot-files
    DatasetWriter(tmp_path, "rec2")
    assert not (path.parent / ".junk.parquet.tmp").exists()
    assert pq.read_schema(path).metadata[b"allocsampler.table"] == b"outstanding"
    assert w.write(OUTSTANDING, []) is None


def test_sizes_on_the_command_line():
    assert [_size(s) for s in ("512K", "2M", "1g", "4096", "64KiB")] == [512 << 10, 2 << 20, 1 << 30, 4096, 64 << 10]


def test_schema_doc_is_generated_from_the_schema():
    doc = (ROOT / "docs" / "schema.md").read_text()
    fresh = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_schema_doc.py"), "--stdout"],
                           capture_output=True, text=True, check=True).stdout
    assert doc == fresh, "docs/schema.md is stale: run scripts/gen_schema_doc.py"
    for t in TABLES.values():
        assert f"## `{t.name}`" in doc


def test_vm_classifier_names_a_glibc_heap_lifecycle():
    from sampler.bpf.abi import VmOp
    from sampler.record.vm_events import HEAP_MAX, VmClassifier
    c = VmClassifier()
    r = 0x7F0003FFF000                                    # unaligned 128 MiB reservation
    aligned = 0x7F0004000000
    none_noreserve = 0 | ((0x02 | 0x20 | 0x4000) << 32)
    assert c.classify(VmOp.MMAP, 0, 2 * HEAP_MAX, none_noreserve, r) == "heap_reserve"
    assert c.classify(VmOp.MUNMAP, r, aligned - r, 0, 0) == "heap_reserve_trim"
    tail = aligned + HEAP_MAX
    assert c.classify(VmOp.MUNMAP, tail, r + 2 * HEAP_MAX - tail, 0, 0) == "heap_reserve_trim"
    assert c.classify(VmOp.MPROTECT, aligned, 135168, 3, 0) == "heap_grow"
    assert c.classify(VmOp.MADVISE, aligned + 8192, 4096, 4, 0) == "heap_trim"
    assert c.classify(VmOp.MUNMAP, aligned, HEAP_MAX, 0, 0) == "heap_release"
    assert c.classify(VmOp.BRK, 0, 0, 0, 0x5000000) == "brk_query"
    assert c.classify(VmOp.BRK, 0x5021000, 0, 0, 0x5021000) == "brk_grow"
    assert c.classify(VmOp.MADVISE, 0x5010000, 4096, 4, 0) == "brk_trim"
    assert c.classify(VmOp.BRK, 0x5001000, 0, 0, 0x5001000) == "brk_shrink"
    assert c.classify(VmOp.MMAP, 0, 1 << 20, 3 | ((0x02 | 0x20) << 32), 0x7F1000000000) == "anon_map"
    assert c.classify(VmOp.MMAP, 0, 1 << 20, 3, -12) == "failed"


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
