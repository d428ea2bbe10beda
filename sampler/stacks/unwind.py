"""DWARF CFI stack unwinding of x86-64 user stacks captured by BPF (registers + a stack copy).

glibc, CPython and most wheels are built without frame pointers, so a frame-pointer walk stops
after 1-3 frames. With the registers and the top of the stack copied at the sample, the CFI of
the binaries (`sampler.stacks.cfi`) gives every caller, as perf --call-graph dwarf does. Code without
CFI (JIT code, some hand-written assembly) falls back to frame pointers when rbp looks like one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sampler.binary.elf import ElfImage
from sampler.stacks.cfi import (
    BP_CFA,
    BP_RBP,
    BP_SAME,
    CFA_DEREF_RBP,
    CFA_RBP,
    CFA_RSP,
    ENTRY,
    NO_CFI,
    NO_CFI_RULE,
    SIGNAL,
    CfiStore,
    CfiTable,
)

# The ucontext a signal trampoline returns through: uc_flags, uc_link, uc_stack (24 bytes), then
# uc_mcontext.gregs[], indexed by REG_RBP = 10, REG_RSP = 15, REG_RIP = 16.
_GREGS = 40
_REG_RBP, _REG_RSP, _REG_RIP = _GREGS + 8 * 10, _GREGS + 8 * 15, _GREGS + 8 * 16

_LOST = -1  # rbp was saved outside the copied bytes (a real rbp is never -1)
_FP_REACH = 1 << 20  # an rbp this far above sp, past the copy, counts as a frame not copied
_U64 = struct.Struct("<Q").unpack_from
_U64X2 = struct.Struct("<QQ").unpack_from


@dataclass(frozen=True, slots=True)
class Regs:
    ip: int
    sp: int
    bp: int | None      # None: unknown (a walk handed over after a frame that did not restore it)


@dataclass(frozen=True, slots=True)
class UnwindResult:
    # pcs[0] == regs.ip; the rest are return addresses (the interrupted ip after a signal frame),
    # innermost first.
    pcs: tuple[int, ...]
    # Why the walk ended: "entry" (outermost frame: return address undefined or 0), "no_cfi" (code
    # without unwind info and no usable frame pointer), "stack_end" (a needed read lies outside
    # the copied bytes), "max_frames", "bad_frame" (CFA not increasing, return address in no
    # executable mapping, unsupported CFI rule).
    stop: str
    fp_frames: int  # frames that came from the frame-pointer fallback
    used: int = 0   # stack bytes above regs.sp that the walk reached (the last frame's sp)


# Absolute address -> (image, bias) with vaddr = addr - bias; None when the address is in no
# file-backed executable mapping.
Locate = Callable[[int], tuple[ElfImage, int] | None]


class Unwinder:
    """Unwinds sampled stacks; rules are cached per image, and in `cache_dir` across restarts
    under the build-id and a digest of the CFI bytes.

    Not thread-safe: one Unwinder per thread that unwinds.
    """

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cfi = CfiStore(cache_dir)
        self._tables: dict[ElfImage, CfiTable] = {}  # the store's tables, one dict lookup away

    @property
    def decodes(self) -> int:
        """FDEs decoded so far (those loaded from the disk cache are not counted)."""
        return self.cfi.decodes

    def prune(self, keep: set[ElfImage]) -> None:
        """Drop the tables of images not in `keep` (those of processes gone), saved first to the
        disk cache to be found again."""
        for img in [k for k in self._tables if k not in keep]:
            del self._tables[img]
        self.cfi.prune(keep)

    def save(self) -> None:
        """Persist the per-build-id caches to cache_dir (atomically); no-op without cache_dir."""
        self.cfi.save()

    def unwind(self, locate: Locate, regs: Regs, stack: bytes, max_frames: int = 127,
               precise: bool = True) -> UnwindResult:
        """`stack` holds the bytes at [regs.sp, regs.sp + len(stack)). `precise`: regs.ip is where
        execution is (a sample's first frame), not a return address (a walk handed over by BPF)."""
        # One loop, locals only: this runs for every sample (~27 frames for a torch stack).
        base, n = regs.sp, len(stack)
        # bp becomes None when its rule is not followed, _LOST when it was saved outside the copy.
        pc, sp, bp = regs.ip, regs.sp, regs.bp
        pcs = [pc]
        fp_frames = 0
        # precise: pc is where execution is (frame 0, after a signal), not a return address
        tables = self._tables
        stop = "max_frames"
        while True:
            addr = pc if precise else pc - 1  # a call may be the last instruction of a function
            loc = locate(addr)
            if loc is None:
                if not precise:
                    pcs.pop()  # a return address must be in a known executable mapping
                    stop = "bad_frame"
                    break
                rule = NO_CFI_RULE  # e.g. JIT code: only frame pointers can help
            else:
                img, bias = loc
                vaddr = addr - bias
                t = tables.get(img)
                if t is None:
                    t = tables[img] = self.cfi.table(img)
                rule = t.memo.get(vaddr) or t.rule(vaddr)
            kind, cfa_off, ra_off, bp_kind, bp_off = rule

            if kind == CFA_RSP:
                cfa = sp + cfa_off
            elif kind in (CFA_RBP, CFA_DEREF_RBP):
                if bp is None or bp == _LOST:
                    stop = "bad_frame" if bp is None else "stack_end"
                    break
                cfa = bp + cfa_off
                if kind == CFA_DEREF_RBP:
                    o = cfa - base
                    if o < 0 or o + 8 > n:
                        stop = "stack_end"
                        break
                    cfa = _U64(stack, o)[0]
            elif kind == SIGNAL:
                o = sp - base
                if o < 0 or o + _REG_RIP + 8 > n:
                    stop = "stack_end"
                    break
                new_sp = _U64(stack, o + _REG_RSP)[0]
                if base <= new_sp <= sp:  # would revisit copied bytes: a loop
                    stop = "bad_frame"
                    break
                if len(pcs) >= max_frames:
                    break
                bp, sp, pc = _U64(stack, o + _REG_RBP)[0], new_sp, _U64(stack, o + _REG_RIP)[0]
                pcs.append(pc)
                precise = True
                continue
            elif kind == ENTRY:
                stop = "entry"
                break
            elif kind == NO_CFI:
                # Frame pointers, if rbp points into the copied stack at or above sp. Just above the
                # copy it is most likely a frame pointer whose frame was not copied.
                if bp is None or not sp <= bp or bp - base + 16 > n:
                    near = bp is not None and (bp == _LOST or sp <= bp < sp + _FP_REACH)
                    stop = "stack_end" if near else "no_cfi"
                    break
                saved_bp, ra = _U64X2(stack, bp - base)
                if ra == 0:
                    stop = "entry"
                    break
                if len(pcs) >= max_frames:
                    break
                pcs.append(ra)
                fp_frames += 1
                pc, sp, bp, precise = ra, bp + 16, saved_bp, False
                continue
            else:
                stop = "bad_frame"  # UNSUPPORTED
                break

            if cfa <= sp:
                stop = "bad_frame"
                break
            o = cfa + ra_off - base
            if o < 0 or o + 8 > n:
                stop = "stack_end"
                break
            ra = _U64(stack, o)[0]
            if bp_kind != BP_SAME:
                if bp_kind == BP_CFA:
                    o = cfa + bp_off - base
                elif bp_kind == BP_RBP and bp is not None:
                    o = bp + bp_off - base if bp != _LOST else -1
                else:
                    o = None
                bp = None if o is None else _U64(stack, o)[0] if 0 <= o <= n - 8 else _LOST
            if ra == 0:  # some outermost frames end with a zero return address instead
                stop = "entry"
                break
            if len(pcs) >= max_frames:
                break
            pcs.append(ra)
            pc, sp, precise = ra, cfa, False
        return UnwindResult(tuple(pcs), stop, fp_frames, max(0, sp - regs.sp))
