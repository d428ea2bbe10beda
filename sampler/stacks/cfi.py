"""x86-64 DWARF call frame information: the unwind rule at a pc, decoded on demand.

Big libraries have hundreds of thousands of FDEs (libtorch_cpu: 335k, 2.5M rows), and parsing
all of them takes minutes and gigabytes. Instead `.eh_frame_hdr`'s sorted search table is viewed
with numpy, and only the FDE (and its CIE) covering a looked-up pc is decoded, once. Without a
header, `.eh_frame` (else `.debug_frame`, also from the separate debug file) is scanned once
for the same sorted index. Decoded FDEs are kept per image in memory, and on disk under the
build-id and a digest of the CFI bytes they were decoded from (a file claiming another's build-id
never supplies its rules), so a restart does not decode again.

The bytes are the target's: a decode runs at most MAX_INSNS instructions with a remember_state
stack of MAX_STATES, and a file at most MAX_WORK instructions in all; past that FDEs are unreadable.

A rule says how to find the caller's registers from this frame's (see `Rule`); the forms
compilers emit on x86-64 are covered, anything else is `UNSUPPORTED`, which ends a walk.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import stat
import struct
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sampler import files
from sampler.binary.elf import ElfImage
from sampler.binary.leb128 import sleb as _sleb
from sampler.binary.leb128 import uleb as _uleb
from sampler.binary.reader import MALFORMED, ElfFormatError, FileBytes

# Rule kinds (Rule[0]).
MAX_TABLE_BYTES = 256 << 20  # a saved table; libtorch_cpu's is a few MiB
CFA_RSP = 0  # CFA = rsp + off
CFA_RBP = 1  # CFA = rbp + off
CFA_DEREF_RBP = 2  # CFA = *(rbp + off): a stack realigned through a DRAP register
SIGNAL = 3  # a signal trampoline (CIE augmentation 'S'): the registers are in the ucontext at sp
ENTRY = 4  # the return address is undefined: outermost frame of a thread (_start, clone3)
UNSUPPORTED = 5  # CFI this unwinder does not follow (CFA from r10/r13, other expressions, ...)
NO_CFI = 6  # no FDE covers the pc
PLT_ROW = 7  # decoded rows only: CFA = rsp + off + ((pc & 15) >= aux) * 8, resolved per pc

# How the caller's rbp is found (Rule[3]).
BP_SAME = 0  # unchanged
BP_CFA = 1  # saved at CFA + off
BP_RBP = 2  # saved at rbp + off (DW_CFA_expression: DW_OP_breg6 off), in realigned frames
BP_UNKNOWN = 3  # undefined, or a rule not followed: a later rbp-based CFA cannot be computed

# (kind, cfa_off, ra_off, bp_kind, bp_off): caller's rsp = CFA, its rip = [CFA + ra_off].
Rule = tuple[int, int, int, int, int]
# Decoded rows add the PLT threshold: (kind, cfa_off, ra_off, bp_kind, bp_off, aux).
_Row = tuple[int, int, int, int, int, int]

NO_CFI_RULE: Rule = (NO_CFI, 0, 0, BP_UNKNOWN, 0)
_UNSUPPORTED_ROW: _Row = (UNSUPPORTED, 0, 0, BP_UNKNOWN, 0, 0)
_SIGNAL_ROW: _Row = (SIGNAL, 0, 0, BP_UNKNOWN, 0, 0)
_ENTRY_ROW: _Row = (ENTRY, 0, 0, BP_UNKNOWN, 0, 0)

# In-process bounds: a table's memo and decoded FDEs are dropped wholesale when full (cheaper
# than an LRU on the hot path; a steady state refills them in a few samples).
MEMO_MAX = 1 << 16
DECODED_MAX = 1 << 15
DIGEST_PIECE = 1 << 20  # a section left in its file is digested in pieces of this size
CACHE_VERSION = 2
# Bounds on the work one file's CFI may ask for (a compiler's FDE runs a few dozen instructions, a
# remember_state stack two deep).
MAX_INSNS = 1 << 16  # per FDE, its CIE's included
MAX_STATES = 64
MAX_WORK = 1 << 24  # per CFI section, over all its decodes

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_RSP, _RBP = 7, 6
# The CFA expression ld emits for lazy PLT entries, after DW_OP_breg7 <off>:
# DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit<N>; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus.
_PLT_HEAD, _PLT_TAIL = b"\x80\x00\x3f\x1a", b"\x2a\x33\x24\x22"
_DW_OP_BREG6, _DW_OP_BREG7, _DW_OP_DEREF, _DW_OP_LIT0, _DW_OP_LIT31 = 0x76, 0x77, 0x06, 0x30, 0x4F
_FIXED = {
    0x00: struct.Struct("<Q"),  # absptr
    0x02: struct.Struct("<H"),
    0x03: struct.Struct("<I"),
    0x04: struct.Struct("<Q"),
    0x0A: struct.Struct("<h"),
    0x0B: struct.Struct("<i"),
    0x0C: struct.Struct("<q"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_INTERN: dict[tuple, tuple] = {}  # rules and rows are few distinct tuples: share them


class CfiError(ValueError):
    """Malformed or unsupported CFI bytes."""


def _intern(t: tuple) -> tuple:
    return _INTERN.setdefault(t, t)


def _pointer(b: bytes | memoryview, p: int, enc: int, vaddr: int, img: ElfImage | None) -> tuple[int, int]:
    """Read a DW_EH_PE-encoded pointer at b[p]; `vaddr` is the address of b[0] (for pcrel)."""
    app = enc & 0x70
    if app == 0x50:  # aligned: an absolute pointer at the next 8-byte boundary
        p += -(vaddr + p) % 8
        enc = 0
    fmt = enc & 0x0F
    start = p
    if fmt == 0x01:
        v, p = _uleb(b, p)
    elif fmt == 0x09:
        v, p = _sleb(b, p)
    else:
        s = _FIXED.get(fmt)
        if s is None:
            raise CfiError(f"pointer format {enc:#x}")
        (v,) = s.unpack_from(b, p)
        p += s.size
    if app == 0x10:
        v += vaddr + start
    elif app not in (0x00, 0x30, 0x50):
        # textrel/funcrel are not used on x86-64; datarel in .eh_frame has base 0 there (libgcc).
        raise CfiError(f"pointer application {enc:#x}")
    v &= _MASK
    if enc & 0x80:  # indirect: the value is the address of the pointer
        if img is None:
            raise CfiError("indirect pointer without an image")
        word = img.read_vaddr(v, 8)
        if len(word) < 8:
            raise CfiError("indirect pointer outside the file")
        (v,) = _U64.unpack_from(word)
    return v, p


@dataclass(frozen=True, slots=True)
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int
    has_z: bool
    signal: bool
    insns: bytes


@dataclass(frozen=True, slots=True)
class _Fde:
    start: int
    hi: int  # end of the covered range (== start for an FDE that could not be decoded)
    los: tuple[int, ...]  # row i covers [los[i], los[i + 1]), the last up to hi
    rows: tuple[_Row, ...]


class _Machine:
    """Runs CIE + FDE instructions, tracking the CFA, rbp and the return address column."""

    def __init__(self, cie: _Cie, fde_enc_vaddr: tuple[int, int, ElfImage | None], budget: int = MAX_INSNS):
        self.cie = cie
        self.budget = min(budget, MAX_INSNS)  # instructions left to run
        self.ran = 0
        self.ra = cie.ra_reg
        self.cfa_reg, self.cfa_off, self.cfa_expr = _RSP, 8, b""
        self.regs: dict[int, tuple] = {}
        self.init: dict[int, tuple] = {}
        self.stack: list[tuple] = []
        self.loc = 0
        self.hi = 0
        self.los: list[int] = []
        self.rows: list[_Row] = []
        self._set_loc = fde_enc_vaddr  # (encoding, vaddr of insns[0], image) for DW_CFA_set_loc

    def run_fde(self, insns: bytes, start: int, hi: int) -> _Fde:
        self.loc, self.hi = start, hi
        try:
            self.run(self.cie.insns, cie=True)
            self.init = dict(self.regs)
            self.run(insns, cie=False)
            self.emit(hi)
        except (CfiError, IndexError, struct.error, ValueError, MemoryError):
            # Rows already emitted stay valid; the rest of the range is not followed.
            self.emit_row(self.loc, _UNSUPPORTED_ROW)
        return _Fde(start, hi, tuple(self.los), tuple(self.rows))

    def emit_row(self, lo: int, row: _Row) -> None:
        # Locations only increase (emit ignores set_loc going back), so rows never overlap.
        if lo < self.hi and (not self.rows or self.rows[-1] != row):
            self.los.append(lo)
            self.rows.append(_intern(row))

    def emit(self, new_loc: int) -> None:
        if new_loc > self.loc:
            self.emit_row(self.loc, self.row())
            self.loc = new_loc

    def set(self, reg: int, rule: tuple) -> None:
        if reg == _RBP or reg == self.ra:
            self.regs[reg] = rule

    def restore(self, reg: int) -> None:
        if reg in self.init:
            self.regs[reg] = self.init[reg]
        else:
            self.regs.pop(reg, None)

    def run(self, b: bytes, cie: bool) -> None:
        ca, da = self.cie.code_align, self.cie.data_align
        p, n = 0, len(b)
        while p < n:
            self.ran += 1
            if self.ran > self.budget:
                raise CfiError("too many CFI instructions")
            op = b[p]
            p += 1
            top = op & 0xC0
            if top == 0x40:  # advance_loc
                self.emit(self.loc + (op & 0x3F) * ca)
            elif top == 0x80:  # offset
                off, p = _uleb(b, p)
                self.set(op & 0x3F, ("o", off * da))
            elif top == 0xC0:  # restore
                self.restore(op & 0x3F)
            elif op == 0x00:  # nop
                pass
            elif op == 0x01:  # set_loc
                if cie:
                    raise CfiError("set_loc in a CIE")
                enc, vaddr, img = self._set_loc
                loc, p = _pointer(b, p, enc, vaddr, img)
                self.emit(loc)
            elif op in (0x02, 0x03, 0x04, 0x1D):  # advance_loc1/2/4, MIPS_advance_loc8
                s = {0x02: "<B", 0x03: "<H", 0x04: "<I", 0x1D: "<Q"}[op]
                (delta,) = struct.unpack_from(s, b, p)
                p += struct.calcsize(s)
                self.emit(self.loc + delta * ca)
            elif op in (0x05, 0x11, 0x14, 0x15, 0x2F):  # offset_extended(_sf), val_offset(_sf), GNU neg
                reg, p = _uleb(b, p)
                off, p = _sleb(b, p) if op in (0x11, 0x15) else _uleb(b, p)
                off = -off if op == 0x2F else off
                self.set(reg, ("v" if op in (0x14, 0x15) else "o", off * da))
            elif op == 0x06:  # restore_extended
                reg, p = _uleb(b, p)
                self.restore(reg)
            elif op in (0x07, 0x08):  # undefined, same_value
                reg, p = _uleb(b, p)
                self.set(reg, ("u" if op == 0x07 else "s",))
            elif op == 0x09:  # register
                reg, p = _uleb(b, p)
                reg2, p = _uleb(b, p)
                self.set(reg, ("r", reg2))
            elif op == 0x0A:  # remember_state
                if len(self.stack) >= MAX_STATES:
                    raise CfiError("remember_state stack too deep")
                self.stack.append((self.cfa_reg, self.cfa_off, self.cfa_expr, dict(self.regs)))
            elif op == 0x0B:  # restore_state
                if not self.stack:
                    raise CfiError("restore_state without remember_state")
                self.cfa_reg, self.cfa_off, self.cfa_expr, self.regs = self.stack.pop()
            elif op in (0x0C, 0x12):  # def_cfa(_sf)
                self.cfa_reg, p = _uleb(b, p)
                if op == 0x0C:
                    self.cfa_off, p = _uleb(b, p)
                else:
                    off, p = _sleb(b, p)
                    self.cfa_off = off * da
                self.cfa_expr = b""
            elif op == 0x0D:  # def_cfa_register
                self.cfa_reg, p = _uleb(b, p)
                self.cfa_expr = b""
            elif op in (0x0E, 0x13):  # def_cfa_offset(_sf)
                if op == 0x0E:
                    self.cfa_off, p = _uleb(b, p)
                else:
                    off, p = _sleb(b, p)
                    self.cfa_off = off * da
            elif op == 0x0F:  # def_cfa_expression
                size, p = _uleb(b, p)
                self.cfa_expr = bytes(b[p : p + size])
                p += size
            elif op in (0x10, 0x16):  # expression, val_expression
                reg, p = _uleb(b, p)
                size, p = _uleb(b, p)
                self.set(reg, ("e" if op == 0x10 else "ve", bytes(b[p : p + size])))
                p += size
            elif op == 0x2E:  # GNU_args_size: only matters for landing pads
                _, p = _uleb(b, p)
            elif op == 0x2D:  # GNU_window_save (no operands)
                pass
            else:
                raise CfiError(f"CFA opcode {op:#x}")
            if p > n:
                raise CfiError("instruction runs past the end")

    def row(self) -> _Row:
        if self.cie.signal:
            return _SIGNAL_ROW
        ra = self.regs.get(self.ra)
        if ra is None or ra[0] == "u":
            # gcc marks thread entries with DW_CFA_undefined rip; no rule at all means the same.
            return _ENTRY_ROW if ra is not None else _UNSUPPORTED_ROW
        if ra[0] != "o":
            return _UNSUPPORTED_ROW
        aux = 0
        expr = self.cfa_expr
        if not expr:
            if self.cfa_reg == _RSP:
                kind, off = CFA_RSP, self.cfa_off
            elif self.cfa_reg == _RBP:
                kind, off = CFA_RBP, self.cfa_off
            else:
                return _UNSUPPORTED_ROW
        else:
            parsed = _cfa_expression(expr)
            if parsed is None:
                return _UNSUPPORTED_ROW
            kind, off, aux = parsed
        bp = self.regs.get(_RBP)
        bp_kind, bp_off = BP_SAME, 0
        if bp is not None:
            if bp[0] == "o":
                bp_kind, bp_off = BP_CFA, bp[1]
            elif bp[0] == "e" and len(bp[1]) > 1 and bp[1][0] == _DW_OP_BREG6:
                k, q = _sleb(bp[1], 1)
                bp_kind, bp_off = (BP_RBP, k) if q == len(bp[1]) else (BP_UNKNOWN, 0)
            elif bp[0] != "s":
                bp_kind = BP_UNKNOWN
        return (kind, off, ra[1], bp_kind, bp_off, aux)


def _cfa_expression(e: bytes) -> tuple[int, int, int] | None:
    """(kind, off, aux) for the two CFA expressions x86-64 toolchains emit, else None."""
    try:
        if e[0] == _DW_OP_BREG6:  # DW_OP_breg6 off; DW_OP_deref: realigned stack (DRAP)
            off, q = _sleb(e, 1)
            if e[q:] == bytes([_DW_OP_DEREF]):
                return CFA_DEREF_RBP, off, 0
        elif e[0] == _DW_OP_BREG7:  # the PLT expression
            off, q = _sleb(e, 1)
            lit = e[q + len(_PLT_HEAD)] if len(e) > q + len(_PLT_HEAD) else -1
            if (
                e[q : q + len(_PLT_HEAD)] == _PLT_HEAD
                and _DW_OP_LIT0 <= lit <= _DW_OP_LIT31
                and e[q + len(_PLT_HEAD) + 1 :] == _PLT_TAIL
            ):
                return PLT_ROW, off, lit - _DW_OP_LIT0
    except IndexError:
        pass
    return None


class _Frames:
    """One CFI section (.eh_frame or .debug_frame) with a sorted index of its FDEs."""

    def __init__(self, img: ElfImage, addr: int, data: memoryview, debug: bool):
        self.img = img
        self.addr = addr
        self.data = data
        self.debug = debug  # .debug_frame: CIE ids are 0xffffffff, CIE pointers section offsets
        self.starts = np.empty(0, np.int64)  # FDE initial locations, sorted
        self.offs = np.empty(0, np.int64)  # FDE offsets in data
        self.cies: dict[int, _Cie] = {}
        self.decoded: dict[int, _Fde] = {}  # by initial location
        self.decodes = 0
        self.work = 0  # instructions run by all decodes

    # Index

    def index_hdr(self, hdr_addr: int, hdr: memoryview) -> bool:
        """Use .eh_frame_hdr's table; False when it has none this reader can view as an array."""
        try:
            if len(hdr) < 4 or hdr[0] != 1:
                return False
            ptr_enc, count_enc, table_enc = hdr[1], hdr[2], hdr[3]
            if count_enc == 0xFF or table_enc == 0xFF:
                return False
            _, p = _pointer(hdr, 4, ptr_enc, hdr_addr, None)
            count, p = _pointer(hdr, p, count_enc, hdr_addr, None)
        except (CfiError, IndexError, struct.error, ValueError):
            return False
        # ld always writes datarel sdata4 (or sdata8) pairs: (initial location, FDE address).
        dtype = {0x3B: "<i4", 0x3C: "<i8"}.get(table_enc)
        if dtype is None:
            return False
        count = max(0, min(count, (len(hdr) - p) // (2 * np.dtype(dtype).itemsize)))
        table = np.frombuffer(hdr, dtype, 2 * count, p).reshape(count, 2).astype(np.int64) + hdr_addr
        starts, offs = table[:, 0], table[:, 1] - self.addr
        if count > 1 and bool(np.any(starts[1:] < starts[:-1])):
            order = np.argsort(starts, kind="stable")
            starts, offs = starts[order], offs[order]
        self.starts, self.offs = np.ascontiguousarray(starts), np.ascontiguousarray(offs)
        return True

    def index_scan(self) -> None:
        """Walk every record once (no header table): FDE initial locations and offsets."""
        data, n = self.data, len(self.data)
        starts: list[int] = []
        offs: list[int] = []
        p = 0
        while p + 4 <= n:
            try:
                length, body, idsz = self._record_header(p)
            except struct.error:
                break
            if length == 0:
                if not self.debug:
                    break  # .eh_frame terminator
                p = body
                continue
            end = body + length
            if end > n:
                break
            try:
                cie_id = int.from_bytes(data[body : body + idsz], "little")
                if not self._is_cie(cie_id, idsz):
                    cie = self._cie(self._cie_offset(body, cie_id))
                    start, _ = _pointer(data, body + idsz, cie.fde_enc, self.addr, None)
                    if start < 1 << 63:  # what find() looks up
                        starts.append(start)
                        offs.append(p)
            except (CfiError, IndexError, struct.error, ValueError):
                pass  # an unreadable FDE (or its CIE) is left out of the index
            p = end
        order = np.argsort(np.array(starts, np.int64), kind="stable")
        self.starts = np.array(starts, np.int64)[order]
        self.offs = np.array(offs, np.int64)[order]

    # Decoding

    def _record_header(self, p: int) -> tuple[int, int, int]:
        head = bytes(self.data[p : p + 12])
        (length,) = _U32.unpack_from(head, 0)
        if length == 0xFFFFFFFF:  # 64-bit DWARF
            (length,) = _U64.unpack_from(head, 4)
            return length, p + 12, 8
        return length, p + 4, 4

    def _record(self, off: int, what: str) -> tuple[bytes, int, int]:
        """The record at `off`, from its length field to its end, with the positions of its id field
        and the id's size in it. Only that record is read: the section may stay in its file."""
        length, body, idsz = self._record_header(off)
        end = body + length
        if length == 0 or end > len(self.data):
            raise CfiError(f"{what} at {off:#x} out of bounds")
        return bytes(self.data[off:end]), body - off, idsz

    def _is_cie(self, cie_id: int, idsz: int) -> bool:
        if self.debug:
            return cie_id == (1 << (8 * idsz)) - 1
        return cie_id == 0

    def _cie_offset(self, id_pos: int, cie_id: int) -> int:
        # .eh_frame: distance back from the id field; .debug_frame: offset in the section.
        return cie_id if self.debug else id_pos - cie_id

    def _cie(self, off: int) -> _Cie:
        cie = self.cies.get(off)
        if cie is None:
            cie = self.cies[off] = self._parse_cie(off)
        return cie

    def _parse_cie(self, off: int) -> _Cie:
        rec, body, idsz = self._record(off, "CIE")
        if not self._is_cie(int.from_bytes(rec[body : body + idsz], "little"), idsz):
            raise CfiError(f"no CIE at {off:#x}")
        b = rec[body + idsz :]
        version = b[0]
        nul = b.index(0, 1)
        aug = b[1:nul].decode("ascii", "replace")
        p = nul + 1
        if "eh" in aug:  # ancient gcc: an eh_ptr
            p += 8
        if version >= 4:  # .debug_frame v4: address_size, segment_selector_size
            p += 2
        code_align, p = _uleb(b, p)
        data_align, p = _sleb(b, p)
        if version == 1:
            ra_reg = b[p]
            p += 1
        else:
            ra_reg, p = _uleb(b, p)
        fde_enc = 0x00  # absptr unless 'R' says otherwise
        signal = False
        has_z = aug.startswith("z")
        if has_z:
            size, p = _uleb(b, p)
            q, p_end = p, p + size
            vaddr = self.addr + off + body + idsz  # b[0] is at this address, for pcrel personality
            for c in aug[1:]:
                if c == "R":
                    fde_enc = b[q]
                    q += 1
                elif c == "P":
                    enc = b[q]
                    # Skip the personality pointer; indirect ones are not followed.
                    _, q = _pointer(b, q + 1, enc & 0x7F, vaddr, None)
                elif c == "L":
                    q += 1
                elif c == "S":
                    signal = True
                elif c not in "B":  # B: aarch64 BTI, no data
                    break  # unknown: the rest of the data is skipped by its size
            p = p_end
        elif aug:
            # Without 'z' the data size is unknown; only 'S' alone can be followed.
            signal = aug == "S"
            if not signal:
                raise CfiError(f"CIE augmentation {aug!r}")
        return _Cie(code_align, data_align, ra_reg, fde_enc, has_z, signal, b[p:])

    def decode(self, off: int) -> _Fde:
        self.decodes += 1
        rec, body, idsz = self._record(off, "FDE")
        cie_id = int.from_bytes(rec[body : body + idsz], "little")
        if self._is_cie(cie_id, idsz):
            raise CfiError(f"CIE where an FDE was expected at {off:#x}")
        cie = self._cie(self._cie_offset(off + body, cie_id))
        p = body + idsz
        vaddr = self.addr + off     # of rec[0]
        # No indirect pointer is followed (img None): rows depend on this section's bytes alone,
        # which the on-disk cache's key covers. Compilers write direct ones.
        start, p = _pointer(rec, p, cie.fde_enc, vaddr, None)
        size, p = _pointer(rec, p, cie.fde_enc & 0x0F, vaddr, None)
        if cie.has_z:
            aug, p = _uleb(rec, p)
            p += aug
        if p > len(rec):
            raise CfiError(f"FDE at {off:#x} truncated")
        if self.work >= MAX_WORK:
            raise CfiError(f"over {MAX_WORK} CFI instructions run for this file")
        machine = _Machine(cie, (cie.fde_enc, vaddr + p, None), MAX_WORK - self.work)
        try:
            return machine.run_fde(rec[p:], start, start + size)
        finally:
            self.work += machine.ran

    def find(self, vaddr: int) -> _Fde | None:
        if not 0 <= vaddr < 1 << 63:
            return None
        i = int(np.searchsorted(self.starts, vaddr, "right")) - 1
        if i < 0:
            return None
        start = int(self.starts[i])
        fde = self.decoded.get(start)
        if fde is None:
            try:
                fde = self.decode(int(self.offs[i]))
            except (CfiError, IndexError, struct.error, ValueError, OverflowError, MemoryError):
                fde = _Fde(start, start, (), ())  # unreadable: covers nothing
            if len(self.decoded) >= DECODED_MAX:
                self.decoded.clear()
            self.decoded[start] = fde
        return fde if fde.start <= vaddr < fde.hi else None


class CfiTable:
    """Unwind rules of one ELF image. `memo` maps vaddr -> Rule for the lookups made so far."""

    def __init__(self, img: ElfImage, use_hdr: bool = True, in_memory: bool = False):
        self.image = img
        self.memo: dict[int, Rule] = {}
        self.dirty = False  # decoded FDEs not yet saved
        self.persist = True  # decoded FDEs may be saved under `key`
        self.sources: list[str] = []  # how each CFI section was indexed
        self.key: str | None = None  # for the on-disk cache: build-id and digest of .eh_frame(_hdr)
        t0 = time.perf_counter()
        self._sections: list[_Frames] = []
        self._debug_frame_pending = True
        try:
            eh = img.section_in_file(".eh_frame")
            hdr = img.section(".eh_frame_hdr") if use_hdr and eh is not None else None
            whole = None
            if eh is not None:
                addr, size, read = eh
                # decoded from the very bytes digested: read once, or (left in the file) never saved
                whole = read(0, size) if in_memory or hdr is None else None
                self.key = self._key(img, (addr, whole) if whole is not None else (addr, size, read), hdr)
        except (OSError, ElfFormatError):  # truncated since opened, or too big: no CFI
            eh = hdr = None
            self.sources.append("unreadable")
        if eh is not None:
            try:
                # With .eh_frame_hdr's table the FDEs stay in the file, each read when first decoded
                # (libtorch_cpu's .eh_frame is 17.7 MiB); a walk of every record (no table, or
                # `in_memory`: every FDE decoded, as the table worker does) reads it whole.
                frames = _Frames(img, addr, whole if whole is not None else _InFile(read, size), debug=False)
                if hdr is not None and frames.index_hdr(*hdr):
                    self.sources.append(".eh_frame_hdr")
                    # FDEs read after the digest may not be the bytes it covers if the file is
                    # changed in place: saved under its key only where none but root can do that
                    self.persist = whole is not None or _only_root_writes(img)
                else:
                    if whole is None:
                        whole = read(0, size)
                        self.key = self._key(img, (addr, whole), hdr)
                        frames = _Frames(img, addr, whole, debug=False)
                    frames.index_scan()
                    self.sources.append(".eh_frame")
                self._sections.append(frames)
            except MALFORMED:  # what the section's bytes can make indexing raise: no CFI
                self.key = None
                self.sources.append("malformed")
        self.index_seconds = time.perf_counter() - t0

    @staticmethod
    def _key(img: ElfImage, eh: tuple, hdr: tuple[int, bytes | memoryview] | None) -> str | None:
        return f"{img.build_id}-{cfi_digest(eh, hdr)}" if img.build_id else None

    @property
    def decodes(self) -> int:
        """FDEs decoded (not loaded from a cache) so far."""
        return sum(s.decodes for s in self._sections)

    @property
    def fde_count(self) -> int:
        return sum(len(s.starts) for s in self._sections)

    def fde_starts(self) -> np.ndarray:
        """Initial locations of the FDEs of the primary section (sorted)."""
        return self._sections[0].starts if self._sections else np.empty(0, np.int64)

    def every_fde(self) -> Iterator[tuple[int, int, tuple[int, ...], tuple[tuple[int, ...], ...]]]:
        """Every FDE of the primary section (.eh_frame, else .debug_frame), decoded and not kept, in
        start order: (start, end, row starts, rows), each row (kind, cfa_off, ra_off, bp_kind, bp_off,
        aux) where kind PLT_ROW is resolved per pc as in `rule`. Unreadable FDEs are left out."""
        if not self._sections and not (self._debug_frame_pending and self._add_debug_frame()):
            return
        s = self._sections[0]
        for off in s.offs.tolist():
            try:
                fde = s.decode(off)
            except (CfiError, IndexError, struct.error, ValueError, OverflowError, MemoryError):
                continue
            if fde.rows:
                yield fde.start, fde.hi, fde.los, fde.rows

    def fde_range(self, vaddr: int) -> tuple[int, int] | None:
        """[start, end) of the FDE covering vaddr."""
        fde = self._find(vaddr)
        return (fde.start, fde.hi) if fde else None

    def rule(self, vaddr: int) -> Rule:
        """The rule at `vaddr` (an instruction address in the image, no bias)."""
        rule = self.memo.get(vaddr)
        if rule is not None:
            return rule
        fde = self._find(vaddr)
        if fde is None:
            rule = NO_CFI_RULE
        else:
            # los[0] == start <= vaddr; an FDE whose rows were unreadable has none.
            row = fde.rows[bisect_right(fde.los, vaddr) - 1] if fde.rows else _UNSUPPORTED_ROW
            kind, off, ra_off, bp_kind, bp_off, aux = row
            if kind == PLT_ROW:
                kind, off = CFA_RSP, off + (8 if (vaddr & 15) >= aux else 0)
            rule = _intern((kind, off, ra_off, bp_kind, bp_off))
        if len(self.memo) >= MEMO_MAX:
            self.memo.clear()
        self.memo[vaddr] = rule
        return rule

    def _find(self, vaddr: int) -> _Fde | None:
        before = self.decodes
        fde = None
        for s in self._sections:
            fde = s.find(vaddr)
            if fde is not None:
                break
        else:
            if self._debug_frame_pending and self._add_debug_frame():
                fde = self._sections[-1].find(vaddr)
        if self.decodes != before and self.persist:
            self.dirty = True
        return fde

    def _add_debug_frame(self) -> bool:
        # Code built without .eh_frame (-fno-asynchronous-unwind-tables) may have .debug_frame:
        # indexed on the first pc that .eh_frame does not cover.
        self._debug_frame_pending = False
        try:
            df = self.image.section(".debug_frame")
        except (OSError, ElfFormatError):
            df = None
        if df is None:
            return False
        frames = _Frames(self.image, df[0], df[1], debug=True)
        try:
            frames.index_scan()
        except MALFORMED:
            return False
        self._sections.append(frames)
        self.sources.append(".debug_frame")
        return True

    # Persistence: every decoded FDE in one int64 array (a .npy loads in ~0.2 ms, an .npz in ~1.4):
    # [version, FDEs in the index, n FDEs, n rows], n x (section, start, hi, rows), rows x (lo, *row).

    def export(self) -> np.ndarray:
        """The decoded FDEs of .eh_frame: those the cache key covers (.debug_frame's, from another
        section or file, are decoded again after a restart)."""
        fdes, rows = [], []
        for i, s in enumerate(self._sections[:1] if self.key else []):
            for f in s.decoded.values():
                fdes.append((i, f.start, f.hi, len(f.rows)))
                rows.extend((lo, *row) for lo, row in zip(f.los, f.rows, strict=True))
        head = np.array([CACHE_VERSION, self.fde_count, len(fdes), len(rows)], np.int64)
        return np.concatenate([head, np.array(fdes, np.int64).ravel(), np.array(rows, np.int64).ravel()])

    def load(self, arr: np.ndarray) -> bool:
        """Take the decoded FDEs of an export(); False (and nothing kept) when it does not fit."""
        try:
            ok = self._load(arr)
        except (ValueError, IndexError, TypeError):
            ok = False
        if not ok:
            for s in self._sections:
                s.decoded.clear()
        return ok

    def _load(self, arr: np.ndarray) -> bool:
        if arr.dtype != np.int64 or arr.ndim != 1 or len(arr) < 4:
            return False
        version, count, n_fde, n_rows = arr[:4].tolist()
        if version != CACHE_VERSION or len(arr) != 4 + 4 * n_fde + 7 * n_rows:
            return False
        fdes = arr[4 : 4 + 4 * n_fde].reshape(-1, 4).tolist()
        rows = arr[4 + 4 * n_fde :].reshape(-1, 7).tolist()
        if sum(f[3] for f in fdes) != n_rows:
            return False
        if count != self.fde_count:  # not this binary's CFI
            return False
        k = 0
        for sec, start, hi, n in fdes:
            if sec != 0 or not self._sections:
                return False
            part = rows[k : k + n]
            k += n
            los = tuple(r[0] for r in part)
            self._sections[sec].decoded[start] = _Fde(start, hi, los, tuple(_intern(tuple(r[1:])) for r in part))
        return True


def cfi_digest(*sections: tuple[int, bytes | memoryview] | tuple[int, int, Callable[[int, int], bytes]] | None) -> str:
    """A digest of CFI sections' addresses and bytes: the rows decoded from them depend on nothing
    else (no indirect pointer is followed). A section is (addr, bytes), or (addr, size, read) for one
    left in its file (read in pieces)."""
    h = hashlib.sha256()
    for sec in sections:
        if sec is None:
            h.update(b"-")
        elif len(sec) == 2:
            h.update(f"{sec[0]:x}:{len(sec[1])}:".encode())
            h.update(sec[1])
        else:
            addr, size, read = sec
            h.update(f"{addr:x}:{size}:".encode())
            for off in range(0, size, DIGEST_PIECE):
                piece = read(off, DIGEST_PIECE)
                if not piece:
                    raise ElfFormatError(f"CFI section at {addr:#x} shorter than {size} bytes (truncated)")
                h.update(piece)
    return h.hexdigest()[:32]


def _only_root_writes(img: ElfImage) -> bool:
    """The image's file can be changed in place by root alone (owned by root, writable by no one
    else), or is bytes in memory."""
    buf = img.elf.buf
    if not isinstance(buf, FileBytes):
        return True
    try:
        st = os.fstat(buf.fd)
    except OSError:
        return False
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class _InFile:
    """A section's bytes left in its file, read by slice: the few records a recording decodes."""

    __slots__ = ("_read", "_size")

    def __init__(self, read: Callable[[int, int], bytes], size: int):
        self._read, self._size = read, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, part: slice) -> bytes:
        lo, hi, _ = part.indices(self._size)
        return self._read(lo, hi - lo) if hi > lo else b""


class CfiStore:
    """CfiTables by image (images of identical files are one ElfImage: see ElfImage.open), persisted
    to `cache_dir/<build-id>-<digest of the CFI bytes>.npy`."""

    def __init__(self, cache_dir: Path | None = None):
        self.cache_dir = cache_dir
        self._by_image: dict[ElfImage, CfiTable] = {}
        self._tables: list[CfiTable] = []
        self._save_failed = False

    def table(self, img: ElfImage) -> CfiTable:
        t = self._by_image.get(img)
        if t is None:
            t = CfiTable(img)
            self._tables.append(t)
            if t.key:
                self._load(t, t.key)
            self._by_image[img] = t
        return t

    @property
    def decodes(self) -> int:
        return sum(t.decodes for t in self._tables)

    def prune(self, keep: set[ElfImage]) -> None:
        for img in [k for k in self._by_image if k not in keep]:
            t = self._by_image.pop(img)
            if t.dirty:
                self._save(t)
        live = set(map(id, self._by_image.values()))
        self._tables = [t for t in self._tables if id(t) in live]

    def _path(self, key: str) -> Path | None:
        return self.cache_dir / f"{key}.npy" if self.cache_dir else None

    def _load(self, t: CfiTable, key: str) -> None:
        path = self._path(key)
        if path is None:
            return
        # An absent, stale, damaged or foreign file is ignored, and replaced at the next save.
        with contextlib.suppress(OSError, ValueError, EOFError):
            t.load(np.load(io.BytesIO(files.read_private(path, MAX_TABLE_BYTES)), allow_pickle=False))

    def save(self) -> None:
        """Write the tables decoded further since the last save. Never raises: a full or read-only
        disk (ENOSPC, EROFS) is logged once and the tables stay in memory."""
        for t in self._tables:
            if t.dirty:
                self._save(t)

    def _save(self, t: CfiTable) -> None:
        path = self._path(t.key) if t.key else None
        t.dirty = False
        if path is None or files.private_dir(path.parent) is None:
            return
        try:
            with files.atomic_file(path, durable=False) as f:
                np.save(f, t.export(), allow_pickle=False)
        except (OSError, ValueError) as e:
            if not self._save_failed:
                self._save_failed = True
                log.warning("unwind cache %s not written (%s); later failures are not logged", path, e)
