"""The outstanding table of one process: sampled live allocations and per-stack estimates.

Plain data in, rows out. Each sampled allocation carries (size, weight); everything else,
including standard errors, comes from weights.sample_terms. mmap regions can be unmapped in
part: a region that was sampled with probability p keeps standing for (remaining bytes) / p.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from sampler.control import weights
from sampler.dataset.sources import FAULT, MALLOC, MMAP, PYTHON, TORCH
from sampler.proc.arenas import CHUNK_HEADER, PAGE, PinMap
from sampler.proc.smaps import ARENA, HEAP


@dataclass(slots=True)
class _Sums:
    bytes: float = 0.0
    var: float = 0.0
    objects: float = 0.0
    objects_var: float = 0.0
    samples: int = 0

    def add(self, size: int, weight: float, sign: int = 1) -> None:
        var, objects, objects_var = weights.sample_terms(size, weight)
        self.bytes += sign * weight
        self.var += sign * var
        self.objects += sign * objects
        self.objects_var += sign * objects_var
        self.samples += sign


@dataclass(slots=True)
class StackStats:
    live: _Sums = field(default_factory=_Sums)
    allocated: _Sums = field(default_factory=_Sums)
    freed: _Sums = field(default_factory=_Sums)
    born: dict[int, int] = field(default_factory=dict)   # addr -> alloc time; insertion order = age


@dataclass(slots=True)
class _Fragment:
    """A piece of a sampled mmap region (a partial munmap splits one)."""

    end: int
    mapping: _Block


@dataclass(slots=True)
class _Block:
    key: tuple[str, int]      # (source, stack_id)
    size: int                 # bytes it still covers (mmap: after partial unmaps)
    p: float                  # inclusion probability it was sampled with
    end: int = 0              # mmap regions only
    born: int = 0             # malloc: allocation time (ns), which tells a late free of an older
                              # block apart; mmap: the region's first start (its key in `born`)


@dataclass(slots=True)
class _Regions:
    """Disjoint sampled address ranges of one source (mmap regions, faulted-in pages)."""

    frags: dict[int, _Fragment] = field(default_factory=dict)   # fragment start -> fragment
    starts: list[int] = field(default_factory=list)             # sorted fragment starts


RECENT_FREES = 256   # frees remembered for an unfree: more than the threads between a free and its undo


class ProcessTable:
    def __init__(self) -> None:
        self.stats: dict[tuple[str, int], StackStats] = {}
        self.blocks: dict[int, _Block] = {}           # malloc: addr -> block
        self.recent: dict[int, _Block] = {}           # the last frees, for an unfree (oldest first)
        self._ranges = {MMAP: _Regions(), FAULT: _Regions()}
        self._gpu_init()

    def _gpu_init(self) -> None:
        # CUDA calls (sampler/gpu/cuda.py), every one traced: weight = size, p = 1, no variance.
        self.gpu: dict[tuple[str, bool, int], _Block] = {}   # (source, is VMM handle, addr) -> block
        self.vmm_maps: dict[int, tuple[int, int]] = {}       # mapped address -> (handle, size)
        self.vmm_refs: dict[int, int] = {}                   # handle -> its own ref + mappings

    # malloc source -----------------------------------------------------------------------
    def alloc(self, addr: int, size: int, weight: float, stack_id: int, ts_ns: int,
              source: str = MALLOC) -> None:
        if source in (MMAP, FAULT):
            self.map(addr, size, weight, stack_id, ts_ns, source)
            return
        old = self.blocks.get(addr)
        if old is not None:          # missed free (lost event): the address was reused
            self._release(addr, old, count_freed=False)
        p = size / weight
        key = (source, stack_id)
        self.blocks[addr] = _Block(key, size, p, born=ts_ns)
        self._born(key, addr, size, weight, ts_ns)

    def free(self, addr: int, born: int = 0) -> bool:
        """Free a sampled block; `born` (its allocation time, when known) must match, so that a
        free reported late never removes a newer block at the same address."""
        block = self.blocks.get(addr)
        if block is None or (born and block.born and born != block.born):
            return False
        del self.blocks[addr]
        self._release(addr, block)
        self.recent.pop(addr, None)
        self.recent[addr] = block
        if len(self.recent) > RECENT_FREES:
            del self.recent[next(iter(self.recent))]
        return True

    def unfree(self, addr: int, born: int = 0) -> bool:
        """Undo the free of a block (the in-process samplers report a sampled block freed before
        realloc, and undo it when the realloc failed: the block is still allocated)."""
        block = self.recent.get(addr)
        if block is None or addr in self.blocks or (born and block.born and born != block.born):
            return False
        del self.recent[addr]
        self.blocks[addr] = block
        st = self.stats.setdefault(block.key, StackStats())
        w = block.size / block.p
        st.live.add(block.size, w)
        st.freed.add(block.size, w, -1)
        st.born[addr] = block.born
        st.born = dict(sorted(st.born.items(), key=lambda kv: kv[1]))   # insertion order is age
        return True

    # CUDA sources ------------------------------------------------------------------------------
    def gpu_alloc(self, source: str, addr: int, size: int, stack_id: int | None, ts_ns: int,
                  handle: bool = False) -> None:
        """A successful CUDA allocation (or cuMemCreate handle, `handle`), counted exactly."""
        k = (source, handle, addr)
        old = self.gpu.pop(k, None)
        if old is not None:          # its free was not seen: the address was reused
            self._release(addr, old, count_freed=False)
        self.gpu[k] = _Block((source, stack_id or 0), size, 1.0, born=ts_ns)
        if handle:
            self.vmm_refs[addr] = 1
        self._born((source, stack_id or 0), addr, size, float(size), ts_ns)

    def gpu_free(self, source: str, addr: int, started_ns: int = 0, handle: bool = False) -> bool:
        """A successful free that started at `started_ns`: it cannot free a block allocated after
        that (another thread got the address back before this free returned)."""
        k = (source, handle, addr)
        block = self.gpu.get(k)
        if block is None or (started_ns and block.born > started_ns):
            return False
        del self.gpu[k]
        self._release(addr, block)
        return True

    def vmm_release(self, handle: int, started_ns: int = 0) -> bool:
        """cuMemRelease: physical memory goes when its handle is released and it is unmapped."""
        block = self.gpu.get(("cuda-driver", True, handle))
        if block is None or handle not in self.vmm_refs or (started_ns and block.born > started_ns):
            return False
        return self._vmm_unref(handle)

    def vmm_map(self, addr: int, size: int, handle: int) -> bool:
        if handle not in self.vmm_refs:
            return False             # created before the recording: unknown
        self.vmm_maps[addr] = (handle, size)
        self.vmm_refs[handle] += 1
        return False                 # mapping adds no memory

    def vmm_unmap(self, addr: int, size: int) -> bool:
        freed = False
        for a in [a for a in self.vmm_maps if addr <= a < addr + max(size, 1)]:
            handle, _ = self.vmm_maps.pop(a)
            freed |= self._vmm_unref(handle)
        return freed

    def _vmm_unref(self, handle: int) -> bool:
        self.vmm_refs[handle] -= 1
        if self.vmm_refs[handle] > 0:
            return False
        del self.vmm_refs[handle]
        return self.gpu_free("cuda-driver", handle, handle=True)

    # mmap and fault sources ----------------------------------------------------------------
    def map(self, start: int, length: int, weight: float, stack_id: int, ts_ns: int,
            source: str = MMAP) -> None:
        """A sampled range: an mmap region, or (FAULT) a page brought in by a sampled fault."""
        self.unmap(start, length, (source,))    # MAP_FIXED over an old sampled region replaces it
        r = self._ranges[source]
        key = (source, stack_id)
        mapping = _Block(key, length, length / weight, start + length, born=start)
        r.frags[start] = _Fragment(start + length, mapping)
        bisect.insort(r.starts, start)
        self._born(key, start, length, weight, ts_ns)

    def mapping_stack(self, addr: int) -> int | None:
        """The stack of the sampled mmap region holding `addr`, None when none does: a page fault
        there is the same memory, first touched, and belongs to the stack that mapped it."""
        r = self._ranges[MMAP]
        i = bisect.bisect_right(r.starts, addr) - 1
        if i < 0:
            return None
        frag = r.frags[r.starts[i]]
        return frag.mapping.key[1] if addr < frag.end else None

    def unmap(self, start: int, length: int, sources: tuple[str, ...] = (MMAP, FAULT)) -> None:
        """Remove [start, start+length) from sampled ranges. A region cut in part keeps its
        fragments; they share one sampling decision, so the mapping still counts as one sample
        and stands for (its remaining bytes) / p."""
        end = start + length
        for src in sources:
            r = self._ranges[src]
            i = max(0, bisect.bisect_right(r.starts, start) - 1)
            while i < len(r.starts) and r.starts[i] < end:
                lo = r.starts[i]
                frag = r.frags[lo]
                if frag.end <= start:
                    i += 1
                    continue
                del r.starts[i]
                del r.frags[lo]
                self._shrink(frag.mapping, min(frag.end, end) - max(lo, start))
                for a, b in ((lo, max(lo, start)), (min(frag.end, end), frag.end)):
                    if b > a:
                        r.frags[a] = _Fragment(b, frag.mapping)
                        bisect.insort(r.starts, a)
                        i += 1

    def move(self, old: int, old_len: int, new: int, new_len: int) -> None:
        """mremap moved pages: faulted-in pages of [old, old+old_len) stay resident at their new
        address (up to new_len); sampled mmap regions were unmapped and re-sampled by the caller."""
        r = self._ranges[FAULT]
        keep = min(old_len, new_len)
        moved = [(lo, r.frags[lo]) for lo in r.starts if old <= lo < old + keep and r.frags[lo].end <= old + keep]
        for lo, _ in moved:
            del r.frags[lo]
            r.starts.remove(lo)
        self.unmap(old, old_len, (FAULT,))
        for lo, frag in moved:
            a = lo - old + new
            self.unmap(a, frag.end - lo, (FAULT,))
            r.frags[a] = _Fragment(frag.end - lo + a, frag.mapping)
            bisect.insort(r.starts, a)

    def keep_mapped(self, mapped: list[tuple[int, int]]) -> None:
        """Drop the parts of sampled regions and pages that lie outside the process's mappings
        (sorted, disjoint [start, end)): their unmap was not seen (a syscall event over the
        process's budget)."""
        starts = [m[0] for m in mapped]
        for source in (MMAP, FAULT):
            for lo, hi in self.regions(source):
                pos = lo
                while pos < hi:
                    i = bisect.bisect_right(starts, pos) - 1
                    if i >= 0 and pos < mapped[i][1]:
                        pos = mapped[i][1]              # covered up to this mapping's end
                        continue
                    cut = min(starts[i + 1] if i + 1 < len(starts) else hi, hi)
                    self.unmap(pos, cut - pos, (source,))
                    pos = cut

    def _shrink(self, m: _Block, cut: int) -> None:
        """A sampled mapping lost `cut` bytes: move its weight from live to freed."""
        st = self.stats[m.key]
        q = 1.0 - m.p
        old, new = m.size / m.p, (m.size - cut) / m.p
        st.live.bytes += new - old
        st.live.var += (new * new - old * old) * q
        st.freed.bytes += old - new
        st.freed.var += (old - new) ** 2 * q
        m.size -= cut
        if m.size <= 0:                                 # the whole mapping is gone
            st.live.objects -= 1 / m.p
            st.live.objects_var -= q / (m.p * m.p)
            st.live.samples -= 1
            st.freed.objects += 1 / m.p
            st.freed.samples += 1
            st.born.pop(m.born, None)

    # shared ---------------------------------------------------------------------------------
    def _born(self, key, addr: int, size: int, weight: float, ts_ns: int) -> None:
        st = self.stats.get(key)
        if st is None:
            st = self.stats[key] = StackStats()
        st.live.add(size, weight)
        st.allocated.add(size, weight)
        st.born[addr] = ts_ns

    def _release(self, addr: int, block: _Block, *, count_freed: bool = True) -> None:
        st = self.stats[block.key]
        w = block.size / block.p
        st.live.add(block.size, w, -1)
        st.born.pop(addr, None)
        if count_freed:
            st.freed.add(block.size, w)

    def clear(self) -> None:
        """Forget everything (the process exec'd: its old heap is gone)."""
        self.stats.clear()
        self.blocks.clear()
        self.recent.clear()
        self._ranges = {MMAP: _Regions(), FAULT: _Regions()}
        self._gpu_init()

    def drop_malloc(self) -> list[int]:
        """Forget the sampled malloc blocks (the process left the attach tier: their frees will not
        be seen); returns their addresses."""
        addrs = list(self.blocks)
        self.blocks.clear()
        self.recent.clear()
        for key in [k for k in self.stats if k[0] in (MALLOC, TORCH, PYTHON)]:
            del self.stats[key]
        return addrs

    def regions(self, source: str = MMAP) -> list[tuple[int, int]]:
        """The sampled ranges of an mmap-like source, as sorted [start, end) fragments."""
        r = self._ranges[source]
        return [(lo, r.frags[lo].end) for lo in r.starts]

    def live_addresses(self) -> list[int]:
        return list(self.blocks)

    def live_blocks(self) -> list[tuple[int, int, float]]:
        """(address, size, inclusion probability) of each sampled live block."""
        return [(a, b.size, b.p) for a, b in self.blocks.items()]

    def snapshot(self, now_ns: int) -> list[dict]:
        """Rows for stacks with live samples or activity since the last snapshot; resets the
        interval sums and drops stacks with nothing left."""
        rows = []
        for (source, stack_id), st in list(self.stats.items()):
            live, al, fr = st.live, st.allocated, st.freed
            if live.samples <= 0 and al.samples == 0 and fr.samples == 0:
                del self.stats[(source, stack_id)]
                continue
            oldest = next(iter(st.born.values()), None)
            rows.append({
                "source": source,
                "stack_id": stack_id,
                "outstanding_bytes": max(0.0, live.bytes),
                "outstanding_stderr_bytes": max(0.0, live.var) ** 0.5,
                "outstanding_objects": max(0.0, live.objects),
                "outstanding_stderr_objects": max(0.0, live.objects_var) ** 0.5,
                "live_samples": live.samples,
                "allocated_bytes": al.bytes,
                "allocated_stderr_bytes": max(0.0, al.var) ** 0.5,
                "allocated_objects": al.objects,
                "freed_bytes": fr.bytes,
                "freed_objects": fr.objects,
                "alloc_samples": al.samples,
                "free_samples": fr.samples,
                "oldest_age_s": (now_ns - oldest) / 1e9 if oldest is not None else None,
            })
            st.allocated, st.freed = _Sums(), _Sums()
            if live.samples <= 0:
                del self.stats[(source, stack_id)]
        return rows

    def live_by_region(self, regions: list[tuple[int, int, str]]) -> tuple[float, float, float]:
        """Estimated live malloc chunk bytes in [heap] and in arena heaps (`regions`: sorted
        (start, end, kind) of sampler/proc/smaps.py), and the variance of their sum."""
        starts = [r[0] for r in regions]
        heap = arena = var = 0.0
        for addr, b in self.blocks.items():
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr >= regions[i][1]:
                continue
            kind = regions[i][2]
            if kind not in (HEAP, ARENA):
                continue
            w = b.size / b.p
            scale = weights.chunk_size(b.size) / b.size if b.size else 1.0
            est = w * scale
            if kind == HEAP:
                heap += est
            else:
                arena += est
            var += weights.sample_terms(b.size, w)[0] * scale * scale
        return heap, arena, var

    def pinned(self, pins: list[PinMap]) -> dict[tuple[str, int], tuple[float, float]]:
        """Per (source, stack): the free bytes of pinned pages (glibc heaps, pymalloc arenas: `pins`)
        charged to its live chunks, and the
        variance of that estimate. A pinned page's free bytes are shared among the bytes in use on
        it, so a chunk is charged sum over its pages of (its bytes there) x (free per byte in use
        there), g; its stack's estimate is the Horvitz-Thompson sum of g / p over its sampled live
        chunks, variance g^2 (1 - p) / p^2: unbiased, as the bytes estimates are."""
        if not pins or not self.blocks:
            return {}
        # heap blocks only: a torch tensor's address is tagged (sampler/gpu/cuda.py), not a heap's
        items = [(a, b) for a, b in self.blocks.items() if b.key[0] in (MALLOC, PYTHON)]
        if not items:
            return {}
        keys = [a for a, _ in items]
        blocks = [b for _, b in items]
        addrs = np.fromiter(keys, np.int64, len(keys))
        # the bytes each block occupies: a glibc chunk (its header before the pointer), or a
        # pymalloc block (16-byte size classes)
        python = np.fromiter((b.key[0] == PYTHON for b in blocks), bool, len(keys))
        chunks = np.fromiter(((b.size + 15) & ~15 if b.key[0] == PYTHON else weights.chunk_size(b.size)
                              for b in blocks), np.int64, len(keys))
        starts = np.where(python, addrs, addrs - CHUNK_HEADER)
        p = np.fromiter((b.p for b in blocks), float, len(keys))
        g = np.zeros(len(keys))
        page = PAGE
        for pin in pins:
            n = len(pin.ratio)
            lo = np.maximum(starts, pin.start)
            hi = np.minimum(starts + chunks, pin.start + n * page)
            m = hi > lo
            if not m.any():
                continue
            a, b = lo[m] - pin.start, hi[m] - pin.start
            hp, tp = a // page, (b - 1) // page
            r = pin.ratio
            csum = np.concatenate(([0.0], np.cumsum(r)))
            same = (b - a) * r[hp]
            edges = (page - a % page) * r[hp] + (b - tp * page) * r[tp]
            middle = page * (csum[tp] - csum[np.minimum(hp + 1, tp)])
            g[m] += np.where(hp == tp, same, edges + middle)
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for i in np.nonzero(g > 0)[0]:
            key = blocks[i].key
            est, var = out.get(key, (0.0, 0.0))
            out[key] = (est + g[i] / p[i], var + g[i] * g[i] * (1 - p[i]) / (p[i] * p[i]))
        return out

    def totals(self, source: str) -> tuple[float, float]:
        """(outstanding bytes, standard error) over all stacks of one source."""
        b = v = 0.0
        for (src, _), st in self.stats.items():
            if src == source:
                b += st.live.bytes
                v += st.live.var
        return max(0.0, b), max(0.0, v) ** 0.5
