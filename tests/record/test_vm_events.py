"""The classification of mmap-family events (sampler/record/vm_events.py): a glibc arena heap's life,
the brk heap's, an anonymous mapping and a failed call."""

from __future__ import annotations


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
