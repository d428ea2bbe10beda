"""Find the CPython interpreter in another process and read its threads and frames.

The BPF program walks Python frames with the handful of offsets in `PyLayout`; this module finds
them and everything user space needs around that walk. Offsets come from a table per version
(x86-64 release builds, measured for 3.10-3.12) or, on 3.13, from `_Py_DebugOffsets` at the start
of `_PyRuntime`. Neither is trusted blindly: `detect` checks the layout against the live process
(type objects' names and sizes, thread states pointing back at their interpreter, native thread
ids that are the process's threads, frames whose code objects are code objects) and refuses
rather than return a wrong layout. All reads go through /proc/PID/mem.
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass, field, replace

from sampler.binary.elf import ElfImage
from sampler.binary.reader import MALFORMED, ElfFormatError
from sampler.bpf.abi import PY_LAYOUT
from sampler.proc.maps import Mapping, open_path, read_maps

NO_FIELD = 0xFFFF
ADDR_MASK = (1 << 56) - 1  # the BPF walk stores the frame's entry/owner byte in bits 56..63
OWNER_CSTACK = 3  # 3.12+: a shim frame owned by the C stack, one per C-level eval invocation
SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13))

_MAX_ADDR = 1 << 63  # /proc/PID/mem offsets are signed 64-bit
_MAX_INTERPRETERS = 4096
_MAX_STR = 1 << 16  # longest name or filename read
_KIND_CODEC = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}
_CALL_OPCODES_310 = {131, 141, 142, 161}  # CALL_FUNCTION, CALL_FUNCTION_KW, CALL_FUNCTION_EX, CALL_METHOD
_MAX_THREADS = 1 << 16
_VALIDATE_ATTEMPTS = 5  # live structures can change under a read: retry before refusing
_VALIDATE_DEPTH = 256
_LIBPYTHON = re.compile(r"libpython(\d+)\.(\d+)")
_PYTHON_NAME = re.compile(r"python(\d+)\.(\d+)")

# glibc x86-64: struct pthread starts with tcbhead_t, whose `self` (+16) points at itself.
_PTHREAD_SELF = 16
_PTHREAD_TID_GLIBC = 0x2D0  # tid in glibc 2.2x-2.3x struct pthread; any other is searched for
_PTHREAD_SCAN = 0x800
# PyTypeObject: tp_name, tp_basicsize (tp_itemsize follows), tp_members (stable across 3.10-3.13
# release builds). tp_members lists PyMemberDef {name, type, offset, flags, doc}: the interpreter's
# own record of some struct offsets, which validates the tables.
_TP_NAME, _TP_BASICSIZE, _TP_MEMBERS = 24, 32, 240
_MEMBER = struct.Struct("<Qi4xq")
_MEMBER_SIZE = 40
_T_INT, _T_OBJECT = 1, 6


class PyUnsupported(Exception):
    """A CPython process whose interpreter cannot be read (version, build or failed validation)."""


class PyNotReady(PyUnsupported):
    """The interpreter is not running Python code yet (or no longer): try again later."""


@dataclass(frozen=True)
class PyLayout:
    """Offsets the BPF frame walk uses; to_bytes() packs them as the BPF struct."""

    version: int  # 0x030A ... 0x030D
    tstate_frame: int  # 3.10 `frame`, 3.11/3.12 `cframe`, 3.13 `current_frame`
    cframe_frame: int  # current_frame in _PyCFrame (3.11/3.12), else NO_FIELD
    frame_code: int  # f_code / f_executable
    frame_back: int  # f_back / previous
    frame_instr: int  # 3.10 f_lasti (int), 3.11/3.12 prev_instr, 3.13 instr_ptr
    frame_entry: int  # 3.11 is_entry, 3.12/3.13 owner (one byte); NO_FIELD on 3.10

    def to_bytes(self) -> bytes:
        return PY_LAYOUT.struct.pack(
            self.version,
            self.tstate_frame,
            self.cframe_frame,
            self.frame_code,
            self.frame_back,
            self.frame_instr,
            self.frame_entry,
        )


@dataclass(frozen=True)
class PyOffsets:
    """What user space reads besides the frame walk (byte offsets)."""

    runtime_interp_head: int  # _PyRuntime.interpreters.head; interpreters.main follows it
    interp_next: int
    interp_threads_head: int
    tstate_next: int
    tstate_interp: int
    tstate_native_tid: int | None  # None on 3.10: the tid is read from glibc's struct pthread
    tstate_thread_id: int  # pthread_self() of the thread
    code_filename: int
    code_name: int
    code_qualname: int | None  # None on 3.10
    code_firstlineno: int
    code_linetable: int
    code_code: int | None  # 3.10: co_code, a bytes object
    code_adaptive: int | None  # 3.11+: co_code_adaptive, the instructions inline in the object
    str_ascii_data: int  # sizeof(PyASCIIObject)
    str_compact_data: int  # sizeof(PyCompactUnicodeObject)
    ob_type: int = 8
    var_size: int = 16  # ob_size: code units of a 3.11+ code object, length of a bytes object
    str_length: int = 16
    str_state: int = 32
    bytes_data: int = 32
    tstate_prev: int = 0
    pthread_tid: int | None = None  # 3.10: offset of tid in struct pthread, found by detect()


@dataclass(frozen=True)
class PyTypes:
    """Absolute addresses of the type objects that validate what is read."""

    code: int
    str: int
    bytes: int
    frame: int | None  # PyFrame_Type, checked on 3.10 where frames are objects


_LAYOUTS = {
    (3, 10): PyLayout(0x030A, tstate_frame=24, cframe_frame=NO_FIELD, frame_code=32, frame_back=24,
                      frame_instr=96, frame_entry=NO_FIELD),
    (3, 11): PyLayout(0x030B, tstate_frame=56, cframe_frame=8, frame_code=32, frame_back=48,
                      frame_instr=56, frame_entry=68),
    (3, 12): PyLayout(0x030C, tstate_frame=56, cframe_frame=0, frame_code=0, frame_back=8,
                      frame_instr=56, frame_entry=70),
}
_OFFSETS = {
    (3, 10): PyOffsets(runtime_interp_head=32, interp_next=0, interp_threads_head=8, tstate_next=8,
                       tstate_interp=16, tstate_native_tid=None, tstate_thread_id=176, code_filename=104,
                       code_name=112, code_qualname=None, code_firstlineno=40, code_linetable=120,
                       code_code=48, code_adaptive=None, str_ascii_data=48, str_compact_data=72),
    (3, 11): PyOffsets(runtime_interp_head=40, interp_next=0, interp_threads_head=16, tstate_next=8,
                       tstate_interp=16, tstate_native_tid=160, tstate_thread_id=152, code_filename=112,
                       code_name=120, code_qualname=128, code_firstlineno=72, code_linetable=136,
                       code_code=None, code_adaptive=184, str_ascii_data=48, str_compact_data=72),
    (3, 12): PyOffsets(runtime_interp_head=40, interp_next=0, interp_threads_head=72, tstate_next=8,
                       tstate_interp=16, tstate_native_tid=144, tstate_thread_id=136, code_filename=112,
                       code_name=120, code_qualname=128, code_firstlineno=68, code_linetable=136,
                       code_code=None, code_adaptive=192, str_ascii_data=40, str_compact_data=56),
}
_CODE_BASICSIZE_310 = 176  # sizeof(PyCodeObject); on 3.11+ it equals co_code_adaptive's offset

# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h), after cookie[8], version and
# free_threaded: sections of u64, each starting with the size of the struct it describes.
_DEBUG_COOKIE = b"xdebugpy"
_DEBUG_SECTIONS_313 = (
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", ("size", "id", "next", "threads_head", "gc", "imports_modules", "sysdict", "builtins",
                           "ceval_gil", "gil_runtime_state", "gil_runtime_state_enabled",
                           "gil_runtime_state_locked", "gil_runtime_state_holder")),
    ("thread_state", ("size", "prev", "next", "interp", "current_frame", "thread_id", "native_thread_id",
                      "datastack_chunk", "status")),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner")),
    ("code_object", ("size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount",
                     "localsplusnames", "localspluskinds", "co_code_adaptive")),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
)


@dataclass
class PyProcess:
    """One CPython process: where its interpreter is and how to read it."""

    pid: int
    version: tuple[int, int]
    layout: PyLayout
    eval_ranges: list[tuple[int, int]]  # absolute [lo, hi) of _PyEval_EvalFrameDefault (+ .cold)
    module_ranges: list[tuple[int, int]]  # executable mappings of libpython or the executable
    offsets: PyOffsets
    runtime: int  # address of _PyRuntime
    types: PyTypes
    module_path: str
    namespaced: bool = False  # in another pid namespace: tstates hold namespace tids
    forked_from: int = 0  # read through this parent when the process is gone (a short-lived fork)
    _fd: int = field(default=-1, init=False, repr=False, compare=False)

    # Memory

    def read(self, addr: int, n: int) -> bytes | None:
        """`n` bytes at `addr` in the process, or None when any of them cannot be read."""
        if n <= 0:
            return b""
        if addr <= 0 or addr + n > _MAX_ADDR:
            return None
        if self._fd < 0:
            # a fork gone before its samples are read: its code objects from before the fork are
            # the parent's (what it made since reads as garbage, which the readers' checks refuse)
            for pid in dict.fromkeys(p for p in (self.pid, self.forked_from) if p):
                try:
                    self._fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
                    break
                except OSError:
                    continue
            else:
                return None
        try:
            data = os.pread(self._fd, n, addr)
        except OSError:
            return None
        return data if len(data) == n else None

    def u64(self, addr: int) -> int | None:
        data = self.read(addr, 8)
        return None if data is None else int.from_bytes(data, "little")

    def read_str(self, addr: int, limit: int = _MAX_STR) -> str | None:
        """A compact str object (ASCII or 1/2/4-byte kinds) of at most `limit` characters, else None.

        The character after the last must be the NUL CPython always stores: a cheap check that
        the object and the offsets are what they claim to be.
        """
        o = self.offsets
        hdr = self.read(addr, o.str_state + 1) if addr else None
        if hdr is None or int.from_bytes(hdr[o.ob_type : o.ob_type + 8], "little") != self.types.str:
            return None
        length = int.from_bytes(hdr[o.str_length : o.str_length + 8], "little", signed=True)
        state = hdr[o.str_state]
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or not 0 <= length <= limit or kind not in _KIND_CODEC or (ascii_ and kind != 1):
            return None
        data = self.read(addr + (o.str_ascii_data if ascii_ else o.str_compact_data), (length + 1) * kind)
        if data is None or any(data[-kind:]):
            return None
        try:
            return data[:-kind].decode("ascii" if ascii_ else _KIND_CODEC[kind], "surrogatepass")
        except UnicodeDecodeError:
            return None

    def bytes_size(self, addr: int) -> int | None:
        """Length of the bytes object at `addr`, None when it is not one."""
        o = self.offsets
        hdr = self.read(addr, o.var_size + 8) if addr else None
        if hdr is None or int.from_bytes(hdr[o.ob_type : o.ob_type + 8], "little") != self.types.bytes:
            return None
        size = int.from_bytes(hdr[o.var_size : o.var_size + 8], "little", signed=True)
        return size if size >= 0 else None

    def read_bytes(self, addr: int, limit: int) -> bytes | None:
        """Contents of the bytes object at `addr` (NUL-terminated, as CPython stores them)."""
        size = self.bytes_size(addr)
        if size is None or size > limit:
            return None
        data = self.read(addr + self.offsets.bytes_data, size + 1)
        return None if data is None or data[-1] else data[:-1]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    # Threads and frames

    def threads(self) -> dict[int, int]:
        """Native thread id (as this machine's /proc numbers it) -> PyThreadState, all interpreters.

        A thread state records the thread that created it, and 3.11/3.12 run subinterpreter code
        in the subinterpreter's first thread state whatever the thread: when two claim one thread,
        the main interpreter's (listed last) wins, so frames are never given to the wrong thread.
        """
        host = _host_tids(self.pid) if self.namespaced else None
        out: dict[int, int] = {}
        for interp in self.interpreters():
            for tstate in self.tstates(interp):
                tid = self.native_tid(tstate)
                if host is not None:
                    tid = host.get(tid) if tid else None
                if tid:
                    out[tid] = tstate
        return out

    def walk(self, tid: int, limit: int = 128) -> list[tuple[int, int]]:
        """The raw (code_word, instr_word) pairs the BPF walk produces for thread `tid`."""
        tstate = self.threads().get(tid)
        if tstate is None:
            return []
        return [(code, instr) for _, code, instr in self.walk_frames(tstate, limit)]

    def walk_frames(self, tstate: int, limit: int = 128) -> list[tuple[int, int, int]]:
        """(frame address, code_word, instr_word) per frame, innermost first, as BPF walks them."""
        lay = self.layout
        p = self.u64(tstate + lay.tstate_frame)
        if p and lay.cframe_frame != NO_FIELD:
            p = self.u64(p + lay.cframe_frame)
        span = max(lay.frame_code, lay.frame_back, lay.frame_instr) + 8
        if lay.frame_entry != NO_FIELD:
            span = max(span, lay.frame_entry + 1)
        out: list[tuple[int, int, int]] = []
        while p and len(out) < limit:
            raw = self.read(p, span)
            if raw is None:
                break
            code = int.from_bytes(raw[lay.frame_code : lay.frame_code + 8], "little")
            if lay.frame_entry != NO_FIELD:
                code = (code & ADDR_MASK) | raw[lay.frame_entry] << 56
            out.append((p, code, int.from_bytes(raw[lay.frame_instr : lay.frame_instr + 8], "little")))
            p = int.from_bytes(raw[lay.frame_back : lay.frame_back + 8], "little")
        return out

    def interpreters(self) -> list[int]:
        out: list[int] = []
        interp = self.u64(self.runtime + self.offsets.runtime_interp_head)
        while interp and interp not in out and len(out) < _MAX_INTERPRETERS:
            out.append(interp)
            interp = self.u64(interp + self.offsets.interp_next)
        return out

    def tstates(self, interp: int) -> list[int]:
        out: list[int] = []
        seen: set[int] = set()
        t = self.u64(interp + self.offsets.interp_threads_head)
        while t and t not in seen and len(out) < _MAX_THREADS:
            seen.add(t)
            out.append(t)
            t = self.u64(t + self.offsets.tstate_next)
        return out

    def native_tid(self, tstate: int) -> int | None:
        """The thread's id in its own pid namespace (0 or None when not known yet)."""
        o = self.offsets
        if o.tstate_native_tid is not None:
            return self.u64(tstate + o.tstate_native_tid)
        pthread = self.u64(tstate + o.tstate_thread_id)
        if not pthread or o.pthread_tid is None:
            return None
        raw = self.read(pthread + o.pthread_tid, 4)
        return None if raw is None else int.from_bytes(raw, "little", signed=True)


def detect(pid: int) -> PyProcess | None:
    """The CPython interpreter of `pid`; None when it has none.

    Raises PyUnsupported (PyNotReady while it has no Python frames yet) when it has one this
    module cannot read (a malformed file or memory too), ProcessLookupError when the process is
    gone, PermissionError when its memory cannot be read.
    """
    try:
        return _detect(pid)
    except MALFORMED as e:  # what the target's bytes can make the code below raise
        raise PyUnsupported(f"pid {pid}: malformed interpreter ({type(e).__name__}: {e})") from e


def _detect(pid: int) -> PyProcess | None:
    maps = read_maps(pid)
    found = _interpreter_module(pid, maps)
    if found is None:
        return None
    img, mappings = found
    path = mappings[0].path
    bias = _load_bias(img, mappings)
    if bias is None:
        raise PyUnsupported(f"{path} (pid {pid}): cannot relate its mappings to its ELF segments")
    version = _version(img, path)
    desc = f"CPython {version[0]}.{version[1]} in {path} (pid {pid})"
    if version not in SUPPORTED:
        raise PyUnsupported(f"{desc}: version not supported (3.10 to 3.13 are)")

    def sym(name: str) -> int | None:
        s = img.symbol(name)
        return None if s is None else bias + s.value

    runtime, code_t, str_t, bytes_t = (sym(n) for n in ("_PyRuntime", "PyCode_Type", "PyUnicode_Type", "PyBytes_Type"))
    if not (runtime and code_t and str_t and bytes_t):
        raise PyUnsupported(f"{desc}: _PyRuntime or a core type object is not exported")
    eval_ranges = []
    for name in ("_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold"):
        s = img.symbol(name)
        if s is not None and s.size:
            eval_ranges.append((bias + s.value, bias + s.value + s.size))
    if version >= (3, 13):
        layout, offsets = _from_debug_offsets(pid, runtime, img, desc)
    else:
        layout, offsets = _LAYOUTS[version], _OFFSETS[version]
    proc = PyProcess(
        pid=pid,
        version=version,
        layout=layout,
        eval_ranges=sorted(eval_ranges),        # bisected: .cold often lies below the function
        module_ranges=[(m.start, m.end) for m in mappings if m.executable],
        offsets=offsets,
        runtime=runtime,
        types=PyTypes(code_t, str_t, bytes_t, sym("PyFrame_Type")),
        module_path=path,
        namespaced=_namespaced(pid),
    )
    try:
        _check_types(proc, sym("PyType_Type"), desc)
        _check_live(proc, desc)
    except BaseException:
        proc.close()
        raise
    return proc


# Finding the interpreter


def _interpreter_module(pid: int, maps: list[Mapping]) -> tuple[ElfImage, list[Mapping]] | None:
    """The ELF image defining _PyRuntime (libpython or the executable) and its mappings."""
    try:
        exe_ino = os.stat(f"/proc/{pid}/exe").st_ino
    except OSError:
        exe_ino = None
    files: dict[tuple[str, int], list[Mapping]] = {}
    for m in maps:
        if m.file_backed:
            files.setdefault((m.dev, m.inode), []).append(m)
    # libpython first: an executable that links it (python3, uwsgi) holds no interpreter itself.
    candidates = sorted(
        (0 if _LIBPYTHON.search(os.path.basename(ms[0].path)) else 1, ms)
        for ms in files.values()
        if _LIBPYTHON.search(os.path.basename(ms[0].path)) or ms[0].inode == exe_ino
    )
    old = None
    for _, ms in candidates:
        try:
            img = ElfImage.open(open_path(pid, ms[0]))
        except (OSError, ElfFormatError):
            continue
        if img.symbol("_PyRuntime") is not None:
            return img, ms
        if img.symbol("PyCode_Type") is not None:
            old = ms[0].path
    if old is not None:
        raise PyUnsupported(f"{old} (pid {pid}): CPython without _PyRuntime (older than 3.7) is not supported")
    return None


def _load_bias(img: ElfImage, mappings: list[Mapping]) -> int | None:
    for m in mappings:
        vaddr = img.file_offset_to_vaddr(m.offset)
        if vaddr is not None:
            return m.start - vaddr
    return None


def _version(img: ElfImage, path: str) -> tuple[int, int]:
    sym = img.symbol("Py_Version")  # 3.11+: PY_VERSION_HEX
    if sym is not None and sym.size >= 4:
        hexversion = int.from_bytes(img.read_vaddr(sym.value, 4), "little")
        return hexversion >> 24, (hexversion >> 16) & 0xFF
    m = _PYTHON_NAME.search(os.path.basename(path))
    if m is None:
        raise PyUnsupported(f"{path}: CPython of unknown version (no Py_Version, no version in the file name)")
    return int(m.group(1)), int(m.group(2))


def _read_once(pid: int, addr: int, n: int) -> bytes | None:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, n, addr)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == n else None


def _from_debug_offsets(pid: int, runtime: int, img: ElfImage, desc: str) -> tuple[PyLayout, PyOffsets]:
    """Layout and offsets from 3.13's _Py_DebugOffsets, each offset checked against its struct's size."""
    n = sum(len(fields) for _, fields in _DEBUG_SECTIONS_313)
    raw = _read_once(pid, runtime, 24 + 8 * n)
    if raw is None or raw[:8] != _DEBUG_COOKIE:
        raise PyUnsupported(f"{desc}: no _Py_DebugOffsets (cookie) at _PyRuntime")
    version, free_threaded = struct.unpack_from("<QQ", raw, 8)
    sym = img.symbol("Py_Version")
    if sym is None or version != int.from_bytes(img.read_vaddr(sym.value, 4), "little"):
        raise PyUnsupported(f"{desc}: _Py_DebugOffsets.version {version:#x} differs from Py_Version")
    if free_threaded:
        raise PyUnsupported(f"{desc}: free-threaded builds are not supported")
    values = iter(struct.unpack_from(f"<{n}Q", raw, 24))
    d = {sec: dict(zip(fields, values, strict=False)) for sec, fields in _DEBUG_SECTIONS_313}

    def off(sec: str, name: str, width: int = 8) -> int:
        v = d[sec][name]
        if v + width > d[sec]["size"] or v >= NO_FIELD:
            raise PyUnsupported(f"{desc}: _Py_DebugOffsets.{sec}.{name} = {v} is outside the struct")
        return v

    # Fields this module reads with fixed offsets in every version: refuse if 3.13 disagrees.
    fixed = {("pyobject", "ob_type"): 8, ("type_object", "tp_name"): _TP_NAME, ("bytes_object", "ob_size"): 16,
             ("bytes_object", "ob_sval"): 32, ("unicode_object", "length"): 16, ("unicode_object", "state"): 32}
    for (sec, name), want in fixed.items():
        if off(sec, name) != want:
            raise PyUnsupported(f"{desc}: _Py_DebugOffsets.{sec}.{name} is {d[sec][name]}, expected {want}")
    layout = PyLayout(
        0x030D,
        tstate_frame=off("thread_state", "current_frame"),
        cframe_frame=NO_FIELD,
        frame_code=off("interpreter_frame", "executable"),
        frame_back=off("interpreter_frame", "previous"),
        frame_instr=off("interpreter_frame", "instr_ptr"),
        frame_entry=off("interpreter_frame", "owner", 1),
    )
    ascii_size = d["unicode_object"]["asciiobject_size"]
    offsets = PyOffsets(
        runtime_interp_head=off("runtime_state", "interpreters_head"),
        interp_next=off("interpreter_state", "next"),
        interp_threads_head=off("interpreter_state", "threads_head"),
        tstate_next=off("thread_state", "next"),
        tstate_prev=off("thread_state", "prev"),
        tstate_interp=off("thread_state", "interp"),
        tstate_native_tid=off("thread_state", "native_thread_id"),
        tstate_thread_id=off("thread_state", "thread_id"),
        code_filename=off("code_object", "filename"),
        code_name=off("code_object", "name"),
        code_qualname=off("code_object", "qualname"),
        code_firstlineno=off("code_object", "firstlineno", 4),
        code_linetable=off("code_object", "linetable"),
        code_code=None,
        code_adaptive=off("code_object", "co_code_adaptive", 2),
        str_ascii_data=ascii_size,
        # PyUnicodeObject is PyCompactUnicodeObject plus the data pointer of legacy strings.
        str_compact_data=d["unicode_object"]["size"] - 8,
    )
    if not 0 < ascii_size < offsets.str_compact_data:
        raise PyUnsupported(f"{desc}: implausible unicode sizes in _Py_DebugOffsets")
    return layout, offsets


def _namespaced(pid: int) -> bool:
    ns = _nspid(f"/proc/{pid}/status")
    return ns is not None and len(ns) > 1


def _nspid(path: str) -> list[int] | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return None


def _host_tids(pid: int) -> dict[int, int]:
    """Thread id inside the process's pid namespace -> id in ours (BPF sees the latter)."""
    out: dict[int, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        ns = _nspid(f"/proc/{pid}/task/{t}/status")
        if ns:
            out[ns[-1]] = ns[0]
    return out


def _tasks(pid: int) -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError as e:
        raise ProcessLookupError(pid) from e


# Validation


def _c_string(proc: PyProcess, addr: int | None, limit: int = 64) -> str | None:
    raw = proc.read(addr, limit) if addr else None
    if raw is None or b"\0" not in raw:
        return None
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def _check_types(proc: PyProcess, type_type: int | None, desc: str) -> None:
    """The exported type objects are what their names say, with the sizes the offsets assume."""
    o = proc.offsets
    code_size = o.code_adaptive if o.code_adaptive is not None else _CODE_BASICSIZE_310
    expect = [
        ("PyCode_Type", proc.types.code, "code", code_size, 2 if o.code_adaptive is not None else 0),
        # PyUnicodeObject = PyCompactUnicodeObject + data pointer; PyBytesObject ends in ob_sval[1].
        ("PyUnicode_Type", proc.types.str, "str", o.str_compact_data + 8, 0),
        ("PyBytes_Type", proc.types.bytes, "bytes", o.bytes_data + 1, 1),
    ]
    if proc.version < (3, 11):
        expect.append(("PyFrame_Type", proc.types.frame, "frame", None, None))
    for sym, addr, name, basicsize, itemsize in expect:
        raw = proc.read(addr, _TP_BASICSIZE + 16) if addr else None
        if raw is None:
            raise PyUnsupported(f"{desc}: cannot read {sym}")
        ob_type = int.from_bytes(raw[o.ob_type : o.ob_type + 8], "little")
        tp_name, size, item = struct.unpack_from("<Qqq", raw, _TP_NAME)
        if type_type is not None and ob_type != type_type:
            raise PyUnsupported(f"{desc}: {sym} is not a type object (wrong load address?)")
        if _c_string(proc, tp_name) != name:
            raise PyUnsupported(f"{desc}: {sym}.tp_name is not {name!r} (wrong load address?)")
        if basicsize is not None and (size, item) != (basicsize, itemsize):
            raise PyUnsupported(
                f"{desc}: {sym} has basicsize/itemsize {size}/{item}, expected {basicsize}/{itemsize}"
                " (a build with another object layout, such as a debug build)")
    want = {"co_filename": (o.code_filename, _T_OBJECT), "co_name": (o.code_name, _T_OBJECT),
            "co_firstlineno": (o.code_firstlineno, _T_INT), "co_linetable": (o.code_linetable, _T_OBJECT)}
    if o.code_qualname is not None:
        want["co_qualname"] = (o.code_qualname, _T_OBJECT)
    if o.code_code is not None:
        want["co_code"] = (o.code_code, _T_OBJECT)
    _check_members(proc, "PyCode_Type", proc.types.code, want, desc)
    if proc.version < (3, 11):
        lay = proc.layout
        _check_members(proc, "PyFrame_Type", proc.types.frame,
                       {"f_back": (lay.frame_back, _T_OBJECT), "f_code": (lay.frame_code, _T_OBJECT)}, desc)


def _check_members(proc: PyProcess, sym: str, type_addr: int | None, want: dict[str, tuple[int, int]],
                   desc: str) -> None:
    have: dict[str, tuple[int, int]] = {}
    p = proc.u64(type_addr + _TP_MEMBERS) if type_addr else None
    for _ in range(64):
        raw = proc.read(p, _MEMBER.size) if p else None
        if raw is None:
            break
        name, kind, offset = _MEMBER.unpack(raw)
        if not name:
            break
        have[_c_string(proc, name) or ""] = (offset, kind)
        p += _MEMBER_SIZE
    for name, (offset, kind) in want.items():
        if have.get(name) != (offset, kind):
            raise PyUnsupported(f"{desc}: {sym} member {name} is {have.get(name)}, expected (offset, type) "
                                f"{(offset, kind)}")


class _Retry(Exception):
    def __init__(self, reason: str, not_ready: bool = False):
        super().__init__(reason)
        self.not_ready = not_ready


def _check_live(proc: PyProcess, desc: str) -> None:
    last: _Retry | None = None
    for attempt in range(_VALIDATE_ATTEMPTS):
        try:
            _check_threads_and_frames(proc)
            return
        except _Retry as e:
            last = e
            if not os.path.exists(f"/proc/{proc.pid}"):
                raise ProcessLookupError(proc.pid) from e
            time.sleep(0.02 * (attempt + 1))
    assert last is not None
    cls = PyNotReady if last.not_ready else PyUnsupported
    raise cls(f"{desc}: {last}")


def _check_threads_and_frames(proc: PyProcess) -> None:
    o = proc.offsets
    interps = proc.interpreters()
    if not interps:
        raise _Retry("no interpreter yet", not_ready=True)
    # The main interpreter (interpreters.main, next to head) is the oldest: the end of the list.
    if proc.u64(proc.runtime + o.runtime_interp_head + 8) != interps[-1]:
        raise _Retry(f"the interpreter list does not end at the main interpreter (next offset {o.interp_next})")
    tstates = []
    for interp in interps:
        prev = 0
        for t in proc.tstates(interp):
            if proc.u64(t + o.tstate_interp) != interp:
                raise _Retry(f"a thread state does not point back at its interpreter (offset {o.tstate_interp})")
            if proc.u64(t + o.tstate_prev) != prev:
                raise _Retry("the thread state list is not doubly linked (head or next offset wrong?)")
            tstates.append(t)
            prev = t
    if not tstates:
        raise _Retry("no thread states yet", not_ready=True)
    if proc.version < (3, 11) and o.pthread_tid is None:
        proc.offsets = replace(o, pthread_tid=_find_pthread_tid(proc, tstates))
    own_pid = proc.pid
    if proc.namespaced:
        ns = _nspid(f"/proc/{proc.pid}/status")
        own_pid = ns[-1] if ns else -1
    ids = [proc.native_tid(t) for t in tstates]
    if own_pid not in ids:
        raise _Retry("no thread state has the main thread's native id (native_thread_id offset wrong?)")
    tasks = _host_tids(proc.pid).keys() if proc.namespaced else _tasks(proc.pid)
    if any(i and i not in tasks for i in ids):
        raise _Retry("a thread state's native id is not a thread of the process")

    frames = callers = at_call = 0
    for t in tstates:
        walked = proc.walk_frames(t, _VALIDATE_DEPTH)
        in_thread = 0
        for frame, code_word, instr in walked:
            tag, code = code_word >> 56, code_word & ADDR_MASK
            if proc.version >= (3, 11) and tag > (1 if proc.version == (3, 11) else OWNER_CSTACK):
                raise _Retry(f"a frame's is_entry/owner byte (offset {proc.layout.frame_entry}) is {tag}")
            if proc.version >= (3, 12) and tag == OWNER_CSTACK:
                continue
            why = _bad_frame(proc, frame, code, instr)
            if why:
                raise _Retry(why)
            if proc.version < (3, 11) and in_thread:
                callers += 1
                at_call += _at_call_310(proc, code, instr)
            in_thread += 1
        frames += in_thread
        # A thread's first frame was entered from C: is_entry on 3.11, a shim frame on 3.12+.
        if proc.version >= (3, 11) and 0 < len(walked) < _VALIDATE_DEPTH and walked[-1][1] >> 56 == 0:
            raise _Retry(f"a thread's outermost frame is no entry frame (offset {proc.layout.frame_entry})")
    if not frames:
        raise _Retry("no Python frames yet", not_ready=True)
    # 3.10's f_lasti has no independent check: callers wait in a call instruction (nearly always
    # CALL_*, other instructions can call Python too), so at least one must.
    if callers and not at_call:
        raise _Retry(f"no caller frame's f_lasti (offset {proc.layout.frame_instr}) is at a call instruction")


def _bad_frame(proc: PyProcess, frame: int, code: int, instr: int) -> str | None:
    """Why a frame does not look right with this layout (None when it does)."""
    o = proc.offsets
    if proc.u64(code + o.ob_type) != proc.types.code:
        return f"a frame's code (offset {proc.layout.frame_code}) is not a code object"
    names = [o.code_filename, o.code_name] + ([o.code_qualname] if o.code_qualname is not None else [])
    if any(proc.read_str(proc.u64(code + off) or 0) is None for off in names):
        return "a code object's name or filename does not read as a str (str offsets wrong?)"
    if proc.read_bytes(proc.u64(code + o.code_linetable) or 0, 1 << 24) is None:
        return "a code object's line table does not read as bytes (bytes offsets wrong?)"
    if proc.version < (3, 11):
        if proc.u64(frame + o.ob_type) != proc.types.frame:
            return "a frame is not a frame object"
        n = proc.bytes_size(proc.u64(code + o.code_code) or 0)
        lasti = _lasti_310(instr)
        if n is None or not -1 <= lasti < n // 2:
            return f"a frame's f_lasti ({lasti}) is outside its code"
        return None
    n = proc.u64(code + o.var_size)
    delta = instr - (code + o.code_adaptive)
    if n is None or delta % 2 or not -1 <= delta // 2 < n:
        return f"a frame's instruction pointer (offset {proc.layout.frame_instr}) is outside its code"
    return None


def _lasti_310(instr_word: int) -> int:
    lasti = instr_word & 0xFFFFFFFF  # an int; f_lineno shares the word the walk reads
    return lasti - (1 << 32) if lasti & 0x80000000 else lasti


def _at_call_310(proc: PyProcess, code: int, instr: int) -> bool:
    co_code = proc.u64(code + proc.offsets.code_code) or 0
    lasti = _lasti_310(instr)
    op = proc.read(co_code + proc.offsets.bytes_data + 2 * lasti, 1) if lasti >= 0 else None
    return op is not None and op[0] in _CALL_OPCODES_310


def _find_pthread_tid(proc: PyProcess, tstates: list[int]) -> int:
    """Offset of the kernel tid in glibc's struct pthread (3.10 keeps only pthread_self())."""
    want = proc.pid
    if proc.namespaced:
        ns = _nspid(f"/proc/{proc.pid}/status")
        want = ns[-1] if ns else -1
    blocks = []
    for t in tstates:
        pthread = proc.u64(t + proc.offsets.tstate_thread_id)
        if not pthread or proc.u64(pthread + _PTHREAD_SELF) != pthread:
            raise _Retry("thread_id is not a glibc pthread (thread_id offset wrong, or not glibc)")
        block = proc.read(pthread, _PTHREAD_SCAN)
        if block is None:
            raise _Retry("cannot read a struct pthread")
        blocks.append(block)
    tasks = set(_host_tids(proc.pid)) if proc.namespaced else _tasks(proc.pid)

    def fits(off: int) -> bool:
        ids = [int.from_bytes(b[off : off + 4], "little") for b in blocks]
        return want in ids and all(i in tasks for i in ids)

    if fits(_PTHREAD_TID_GLIBC):
        return _PTHREAD_TID_GLIBC
    found = [off for off in range(0, _PTHREAD_SCAN, 4) if fits(off)]
    if len(found) != 1:
        raise _Retry("cannot locate the tid in struct pthread")
    return found[0]
