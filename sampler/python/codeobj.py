"""Names and lines of the Python frames captured by the BPF walk, read from the target's memory.

A raw frame is (code_word, instr_word) as `PyProcess.walk` describes. Code objects can be freed and
their memory reused, so every use re-reads the object's header: a cached entry is used only while
the type, first line and the name, filename and line-table pointers are unchanged, and nothing is
returned that does not validate (frames are dropped rather than misnamed).
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sampler.python.runtime import ADDR_MASK, OWNER_CSTACK, PyProcess

_MAX_TABLE = 1 << 20  # longest line table read (a 10,000-line function's is ~40 KiB)
# Code objects cached per process, bounded by count and by bytes: line tables and what they
# decode to are the target's to size (the cost counts a decoded table as 4x its bytes).
_MAX_CACHED_BYTES = 64 << 20
_MAX_CODE_UNITS = 1 << 24
_MAX_REFCNT = 1 << 40  # beyond: a freed block whose first word is now a free-list pointer


@dataclass(frozen=True)
class PyFrame:
    function: str  # co_qualname on 3.11+, co_name on 3.10
    file: str  # co_filename
    line: int | None  # current line of the frame
    entry: bool  # the outermost frame of one C-level call of the eval loop


class LineTable:
    """Line per instruction: ranges [previous end, end) in code units, decoded once."""

    def __init__(self, ends: list[int], lines: list[int | None]):
        self.ends = ends
        self.lines = lines

    def line(self, index: int) -> int | None:
        i = bisect_right(self.ends, index)
        return self.lines[i] if i < len(self.ends) else None


def decode_linetable_310(table: bytes, firstlineno: int) -> LineTable:
    """3.10 co_linetable (PEP 626): (bytecode bytes, signed line delta) pairs; -128 means no line."""
    ends: list[int] = []
    lines: list[int | None] = []
    line, end = firstlineno, 0
    for k in range(0, len(table) - 1, 2):
        start, end = end, end + table[k]
        delta = table[k + 1] - 256 if table[k + 1] > 127 else table[k + 1]
        cur = None
        if delta != -128:
            line += delta
            cur = line
        if end > start:  # empty ranges only carry line deltas
            ends.append(end // 2)
            lines.append(cur)
    return LineTable(ends, lines)


def _varint(table: bytes, pos: int) -> int:
    b = table[pos]
    val, shift = b & 63, 0
    while b & 64:
        pos += 1
        b = table[pos]
        shift += 6
        val |= (b & 63) << shift
    return val


def decode_linetable_311(table: bytes, firstlineno: int) -> LineTable:
    """3.11+ location table (Objects/locations.md); only line numbers are decoded.

    Each entry starts with a byte with bit 7 set: code (bits 3-6), length - 1 in code units
    (bits 0-2). Codes 13 (no columns) and 14 (long form) start with a signed varint line delta,
    10-12 mean a delta of code - 10, 15 no location, 0-9 the same line.
    """
    ends: list[int] = []
    lines: list[int | None] = []
    line, end, pos, n = firstlineno, 0, 0, len(table)
    while pos < n:
        head = table[pos]
        if not head & 0x80:
            break  # not an entry start: corrupt, keep what was decoded
        code = (head >> 3) & 15
        cur: int | None = line
        if code == 15:
            cur = None
        elif code in (13, 14):
            if pos + 1 >= n:
                break
            u = _varint(table, pos + 1)
            line += -(u >> 1) if u & 1 else u >> 1
            cur = line
        elif code >= 10:
            line += code - 10
            cur = line
        end += (head & 7) + 1
        ends.append(end)
        lines.append(cur)
        pos += 1
        while pos < n and not table[pos] & 0x80:
            pos += 1
    return LineTable(ends, lines)


@dataclass
class _Code:
    ident: tuple[int, ...]
    function: str
    file: str
    firstlineno: int
    ncode: int  # instructions, in code units
    raw_table: bytes
    table: LineTable | None = None

    @property
    def cost(self) -> int:
        return 5 * len(self.raw_table) + 512
    frames: dict[tuple[int, bool], PyFrame] = field(default_factory=dict)  # (index, entry) -> frame


class CodeReader:
    """Resolves raw frames of one process to PyFrames, with an LRU of code objects."""

    def __init__(self, proc: PyProcess, cache_size: int = 65536):
        self._proc = proc
        self._cache_size = cache_size
        self._codes: OrderedDict[int, _Code] = OrderedDict()
        self._bytes = 0  # cost of the cached codes
        o = proc.offsets
        self._v310 = proc.version < (3, 11)
        self._shims = proc.version >= (3, 12)
        self._decode = decode_linetable_310 if self._v310 else decode_linetable_311
        # The header fields that identify a code object, read with one struct after refcnt, ob_type.
        fields = {o.code_firstlineno: "i", o.code_filename: "Q", o.code_name: "Q", o.code_linetable: "Q"}
        if self._v310:
            fields[o.code_code] = "Q"
        else:
            fields[o.code_qualname] = "Q"
            fields[o.var_size] = "q"
        fmt, pos = "<QQ", 16
        self._slot: dict[int, int] = {}
        for off in sorted(fields):
            fmt += f"{off - pos}x{fields[off]}"
            self._slot[off] = len(self._slot)
            pos = off + struct.calcsize(fields[off])
        self._header = struct.Struct(fmt)

    def frames(self, raw: Sequence[tuple[int, int]]) -> list[PyFrame]:
        """Innermost first; invalid frames dropped, 3.12+ shim frames folded into entry flags."""
        out: list[PyFrame] = []
        seen: dict[int, _Code | None] = {}
        for code_word, instr_word in raw:
            tag, addr = code_word >> 56, code_word & ADDR_MASK
            if self._shims and tag == OWNER_CSTACK:
                # The shim starts a C-level eval call: the Python frame before it ends that call.
                if out and not out[-1].entry:
                    out[-1] = replace(out[-1], entry=True)
                continue
            if addr not in seen:
                seen[addr] = self._code(addr)
            code = seen[addr]
            if code is None:
                continue
            entry = self._v310 or (not self._shims and tag != 0)
            index = self._index(addr, instr_word)
            frame = code.frames.get((index, entry))
            if frame is None:
                frame = PyFrame(code.function, code.file, self._line(code, index), entry)
                if len(code.frames) < 4 * code.ncode + 8:
                    code.frames[(index, entry)] = frame
            out.append(frame)
        return out

    def _index(self, addr: int, instr_word: int) -> int:
        """Index in code units of the instruction a frame executes; -1: not started."""
        if self._v310:
            lasti = instr_word & 0xFFFFFFFF  # f_lasti, an int (f_lineno shares the word)
            return lasti - (1 << 32) if lasti & 0x80000000 else lasti
        # 3.11/3.12 prev_instr and 3.13 instr_ptr both point at the instruction being executed
        # (in callers a CALL or one of its cache entries, which share its line).
        delta = instr_word - (addr + self._proc.offsets.code_adaptive)
        return delta // 2 if delta % 2 == 0 else -2

    def _line(self, code: _Code, index: int) -> int | None:
        if index == -1:
            return code.firstlineno
        if not 0 <= index < code.ncode:
            return None
        if code.table is None:
            try:
                code.table = self._decode(code.raw_table, code.firstlineno)
            except (IndexError, ValueError, OverflowError, MemoryError):
                code.table = LineTable([], [])  # a malformed table: no lines
        return code.table.line(index)

    def _code(self, addr: int) -> _Code | None:
        proc = self._proc
        hdr = proc.read(addr, self._header.size) if addr else None
        if hdr is None:
            return None
        refcnt, ob_type, *ident = self._header.unpack(hdr)
        if ob_type != proc.types.code or not 0 < refcnt < _MAX_REFCNT:
            return None
        cached = self._codes.get(addr)
        if cached is not None and cached.ident == tuple(ident):
            self._codes.move_to_end(addr)
            return cached
        code = self._load(tuple(ident))
        old = self._codes.pop(addr, None)
        if old is not None:
            self._bytes -= old.cost
        if code is None:
            return None
        self._codes[addr] = code
        self._bytes += code.cost
        while self._codes and (len(self._codes) > self._cache_size or self._bytes > _MAX_CACHED_BYTES):
            self._bytes -= self._codes.popitem(last=False)[1].cost
        return code

    def _load(self, ident: tuple[int, ...]) -> _Code | None:
        proc, o = self._proc, self._proc.offsets

        def get(off: int) -> int:
            return ident[self._slot[off]]

        firstlineno = get(o.code_firstlineno)
        name = proc.read_str(get(o.code_name if self._v310 else o.code_qualname))
        filename = proc.read_str(get(o.code_filename))
        table = proc.read_bytes(get(o.code_linetable), _MAX_TABLE)
        if name is None or filename is None or table is None or firstlineno < 0:
            return None
        if self._v310:
            co_code = proc.bytes_size(get(o.code_code))
            ncode = None if co_code is None else co_code // 2
        else:
            ncode = get(o.var_size)
        if ncode is None or not 0 < ncode <= _MAX_CODE_UNITS:
            return None
        return _Code(ident, name, filename, firstlineno, ncode, table)
