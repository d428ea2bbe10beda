"""Naming memory-mapping syscalls by what glibc's allocator is doing with them.

glibc builds each secondary-arena heap as: mmap(NULL, 128 MiB, PROT_NONE, MAP_NORESERVE), munmap
of the unaligned head and tail (a 64 MiB-aligned heap remains), mprotect(RW) as the heap grows,
madvise(MADV_DONTNEED) or mmap(MAP_FIXED, PROT_NONE) as it shrinks, munmap of a whole heap when
freed. The main arena grows and trims with brk (glibc malloc/arena.c, new_heap and shrink_heap).
"""

from __future__ import annotations

from sampler.bpf.abi import VmOp

HEAP_MAX = 64 << 20
PROT_NONE, PROT_RW = 0, 3
MAP_FIXED, MAP_ANONYMOUS, MAP_PRIVATE, MAP_NORESERVE = 0x10, 0x20, 0x02, 0x4000
MADV_DONTNEED, MADV_FREE = 4, 8


def _base(addr: int) -> int:
    return addr & ~(HEAP_MAX - 1)


class VmClassifier:
    """Per process: remembers heap reservations, arena heaps and the program break."""

    def __init__(self) -> None:
        self.reservations: list[tuple[int, int]] = []    # recent PROT_NONE reservations
        self.heaps: set[int] = set()                      # 64 MiB-aligned arena heap bases
        self.brk_range: tuple[int, int] | None = None     # [heap] start, current break

    def learn_regions(self, regions: list[tuple[int, int, str]]) -> None:
        """Arena heaps and [heap] as the last smaps read saw them (covers those made before attach)."""
        for start, end, kind in regions:
            if kind == "arena":
                self.heaps.add(_base(start))
            elif kind == "heap":
                self.brk_range = (start, end)

    def classify(self, op: int, addr: int, length: int, arg: int, ret: int) -> str:
        ok = ret >= 0 or ret < -4095
        if op == VmOp.MMAP:
            prot, flags = arg & 0xFFFFFFFF, arg >> 32
            anon_private = flags & (MAP_ANONYMOUS | MAP_PRIVATE) == MAP_ANONYMOUS | MAP_PRIVATE
            if not ok:
                return "failed"
            if prot == PROT_NONE and flags & MAP_FIXED and _base(addr) in self.heaps:
                return "heap_shrink"
            if prot == PROT_NONE and flags & MAP_NORESERVE and anon_private and length in (HEAP_MAX, 2 * HEAP_MAX):
                self.reservations = [*self.reservations[-7:], (ret, ret + length)]
                aligned = -(-ret // HEAP_MAX) * HEAP_MAX
                if aligned + HEAP_MAX <= ret + length:
                    self.heaps.add(aligned)
                return "heap_reserve"
            if anon_private:
                return "anon_map" if prot else "anon_reserve"
            return "file_map" if not flags & MAP_ANONYMOUS else "shared_map"
        if not ok:
            return "failed"
        if op == VmOp.MUNMAP:
            if addr not in self.heaps and any(lo <= addr < hi for lo, hi in self.reservations):
                return "heap_reserve_trim"
            if addr in self.heaps and length >= HEAP_MAX:
                self.heaps.discard(addr)
                return "heap_release"
            return "unmap"
        if op == VmOp.MPROTECT:
            if _base(addr) in self.heaps:
                return "heap_grow" if arg & PROT_RW == PROT_RW else "heap_protect"
            return "protect"
        if op == VmOp.MADVISE:
            if arg in (MADV_DONTNEED, MADV_FREE):
                if _base(addr) in self.heaps:
                    return "heap_trim"
                if self.brk_range and self.brk_range[0] <= addr < self.brk_range[1]:
                    return "brk_trim"
                return "release"
            return "advise"
        if op == VmOp.BRK:
            prev = self.brk_range[1] if self.brk_range else None
            start = self.brk_range[0] if self.brk_range else ret
            self.brk_range = (start, ret)
            if addr == 0 or prev is None or ret == prev:
                return "brk_query" if addr == 0 or ret == addr else "brk_failed"
            return "brk_grow" if ret > prev else "brk_shrink"
        if op == VmOp.MREMAP:
            return "remap"
        return "other"
