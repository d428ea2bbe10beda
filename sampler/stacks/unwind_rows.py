"""Compact unwind rows of one file, for the walk in BPF (`struct uw_row` of bpf/abi.h).

Every FDE of the file's CFI is decoded (sampler/stacks/cfi.py: the same decoder and bounds as the
user-space unwinder) into rows sorted by pc: from a row's pc to the next row's, one rule. Rows
that would repeat the previous rule are left out, and the end of an FDE that the next one does
not start at gets a NO_CFI row, so that a binary search finds exactly the rule `CfiTable.rule`
gives. A rule the compact form cannot hold (a return address other than at CFA - 8, an offset
beyond 16 bits) becomes UNSUPPORTED, where BPF hands the walk over to user space.

This runs in the table worker (sampler/stacks/table_worker.py), not in the recorder: libtorch_cpu
has 335k FDEs and ~2M rows, seconds of Python. Results are cached on disk under the CFI key
(build-id and a digest of the CFI bytes), so that a file is decoded once per host.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sampler import files
from sampler.binary.elf import ElfImage
from sampler.bpf.abi import UW_ROWS_LOG2, UwBp, UwKind
from sampler.stacks.cfi import BP_CFA, BP_RBP, CFA_DEREF_RBP, CFA_RBP, CFA_RSP, PLT_ROW, CfiTable

ROW = np.dtype([("pc", "<u4"), ("cfa_off", "<i2"), ("kind", "u1"), ("bp_off8", "i1")])
MAX_ROWS = 1 << UW_ROWS_LOG2        # the BPF search's reach
CACHE_VERSION = 1
_MAX_CACHE_BYTES = MAX_ROWS * ROW.itemsize + 4096
_CFA_KINDS = (CFA_RSP, CFA_RBP, CFA_DEREF_RBP)
_NO_CFI = int(UwKind.NO_CFI)
_UNSUPPORTED = int(UwKind.UNSUPPORTED) | int(UwBp.UNKNOWN) << 4


@dataclass(frozen=True)
class FileRows:
    """What BPF needs of one file: its rows and how its mappings translate to vaddrs."""

    key: str | None          # the CFI key (None: not cacheable, e.g. no build-id)
    rows: np.ndarray         # ROW, sorted by pc; empty: no CFI (frame pointers only)
    loads: tuple[tuple[int, int, int], ...]    # PT_LOAD (file offset, vaddr, file size)
    fits: bool = True        # False: vaddrs beyond 32 bits or too many rows; BPF hands over
    digest: str = ""         # of the rows themselves: files with equal digests share one loaded copy
    file: tuple[int, ...] = ()   # files.identity of the file they were built from (the table worker's)

    def vaddr(self, file_offset: int) -> int | None:
        for off, vaddr, size in self.loads:
            if off <= file_offset < off + max(size, 1):
                return vaddr + file_offset - off
        return None


def encode(row: tuple[int, ...]) -> tuple[int, int, int]:
    """(cfa_off, kind byte, bp_off8) of a decoded CFI row (CfiTable.every_fde's)."""
    kind, off, ra_off, bp_kind, bp_off, aux = row
    if kind == PLT_ROW:
        return (off, int(UwKind.PLT), aux) if -(1 << 15) <= off < 1 << 15 and 0 <= aux < 128 else (0, _UNSUPPORTED, 0)
    if kind not in _CFA_KINDS:
        return 0, kind | int(UwBp.UNKNOWN) << 4, 0          # ENTRY, SIGNAL, UNSUPPORTED
    if ra_off != -8 or not -(1 << 15) <= off < 1 << 15:
        return 0, _UNSUPPORTED, 0
    if bp_kind in (BP_CFA, BP_RBP) and (bp_off % 8 or not -128 <= bp_off // 8 < 128):
        bp_kind, bp_off = int(UwBp.UNKNOWN), 0
    return off, kind | bp_kind << 4, bp_off // 8 if bp_kind in (BP_CFA, BP_RBP) else 0


def build(img: ElfImage, cache_dir: Path | None = None) -> FileRows:
    """The rows of `img`, from the cache when it holds them."""
    loads = tuple(img.loads())
    table = CfiTable(img, in_memory=True)     # every FDE is decoded on a miss
    key = table.key
    path = cache_dir / f"{key}.rows.npy" if cache_dir and key else None
    if path is not None:
        rows = _load(path)
        if rows is not None:
            return FileRows(key, rows, loads, _fits(rows, loads), rows_digest(rows))
    rows = _rows(table)
    fits = rows is not None and _fits(rows, loads)
    if rows is None:
        return FileRows(key, np.empty(0, ROW), loads, False)
    if path is not None and files.private_dir(path.parent) is not None:
        with contextlib.suppress(OSError, ValueError), files.atomic_file(path, durable=False) as f:
            np.save(f, np.concatenate([np.array([CACHE_VERSION, len(rows)], np.int64).view(np.uint8),
                                       rows.view(np.uint8)]), allow_pickle=False)
    return FileRows(key, rows, loads, fits, rows_digest(rows))


def rows_digest(rows: np.ndarray) -> str:
    """What identifies a rows table by content (libtorch_cpu's 2M rows: ~10 ms)."""
    return hashlib.blake2b(np.ascontiguousarray(rows).data, digest_size=16).hexdigest()


def _fits(rows: np.ndarray, loads: tuple[tuple[int, int, int], ...]) -> bool:
    return len(rows) <= MAX_ROWS and all(v + s < 1 << 32 for _, v, s in loads)


def _load(path: Path) -> np.ndarray | None:
    """A cached table; None when absent, damaged or of another version (then built again)."""
    with contextlib.suppress(OSError, ValueError, EOFError):
        raw = np.load(io.BytesIO(files.read_private(path, _MAX_CACHE_BYTES)), allow_pickle=False)
        if raw.dtype == np.uint8 and raw.ndim == 1 and len(raw) >= 16:
            version, n = raw[:16].view(np.int64).tolist()
            body = raw[16:]
            if version == CACHE_VERSION and len(body) == n * ROW.itemsize:
                rows = body.view(ROW)
                if n < 2 or bool(np.all(rows["pc"][1:] > rows["pc"][:-1])):
                    return rows
    return None


def _rows(table: CfiTable) -> np.ndarray | None:
    """None when a row's pc does not fit 32 bits."""
    pcs, cfas, kinds, bps = array("Q"), array("h"), array("B"), array("b")
    last = None                          # the (cfa, kind, bp) of the row before, to leave repeats out
    fdes = table.every_fde()
    nxt = next(fdes, None)
    while nxt is not None:
        start, hi, los, rows = nxt
        nxt = next(fdes, None)
        # an FDE overlapping the next one ends where that one starts (the later start wins, as in
        # CfiTable.find)
        end = min(hi, nxt[0]) if nxt is not None else hi
        if pcs and start < pcs[-1]:
            continue                     # starts inside rows already emitted: out of order
        for lo, row in zip(los, rows, strict=True):
            if lo >= end:
                break
            enc = encode(row)
            if enc != last:
                pcs.append(lo)
                cfas.append(enc[0])
                kinds.append(enc[1])
                bps.append(enc[2])
                last = enc
        if nxt is None or nxt[0] > end:
            enc = (0, _NO_CFI | int(UwBp.UNKNOWN) << 4, 0)
            if enc != last:
                pcs.append(end)
                cfas.append(0)
                kinds.append(enc[1])
                bps.append(0)
                last = enc
    out = np.empty(len(pcs), ROW)
    if not pcs:
        return out
    pc = np.frombuffer(pcs, np.uint64)
    if int(pc.max()) >= 1 << 32:
        return None
    out["pc"] = pc
    out["cfa_off"] = np.frombuffer(cfas, np.int16)
    out["kind"] = np.frombuffer(kinds, np.uint8)
    out["bp_off8"] = np.frombuffer(bps, np.int8)
    return out
