"""BPF programs compiled once per host and loaded without the compiler.

bcc compiles C with clang/LLVM at every start: ~9 CPU-s and ~80 MiB of LLVM pages for our
programs. The result depends only on the source, the compile flags, the kernel (headers and
tracepoint formats) and bcc, so it is kept: an `ObjectSpec` (each program's instructions, with
the places that refer to a map, and each map's definition and key/value layout) is stored per
hash of those inputs under the cache directory and loaded through the bpf() syscall
(`BpfObject`). A cache miss compiles through libbcc's module API, stores the spec and loads it
the same way, so one loading path serves both.

Map sizes are not compiled in: the `sizes` given to BpfObject replace the compiled
max_entries (the live table, the ring buffer), so configurations that differ only there share
one compiled object.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import importlib.util
import json
import mmap
import os
import resource
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from sampler import files
from sampler.bpf import syscall as sc

WRITE_WINDOW = 4 << 20       # bytes of a mmapable array map mapped at once (write_array)

FORMAT = 1                       # of the stored spec; part of the key
CACHE_ENTRIES = 32               # specs kept (newest used first)
MAX_ENTRY_BYTES = 64 << 20       # a spec is ~0.3 MiB; anything far larger is not ours
PROG_KPROBE, PROG_TRACEPOINT, PROG_PERF_EVENT = 2, 5, 7
MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH = 5, 6, 10
_LD_IMM64, _PSEUDO_MAP_FD, _CALL = 0x18, 1, 0x85
_TRACEPOINT_PREFIX = "tracepoint__"


@dataclass(frozen=True)
class MapSpec:
    name: str
    type: int
    key_size: int
    leaf_size: int
    max_entries: int
    flags: int
    key_desc: str
    leaf_desc: str


@dataclass(frozen=True)
class ProgSpec:
    name: str
    insns: bytes
    relocs: tuple[tuple[int, str], ...]     # (instruction index, map name) of map fd loads


@dataclass(frozen=True)
class ObjectSpec:
    license: str
    kern_version: int
    maps: tuple[MapSpec, ...]
    progs: tuple[ProgSpec, ...]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "license": self.license, "kern_version": self.kern_version,
                           "maps": [asdict(m) for m in self.maps],
                           "progs": [{"name": p.name, "insns": base64.b64encode(p.insns).decode(),
                                      "relocs": p.relocs} for p in self.progs]})

    @classmethod
    def from_json(cls, text: str) -> ObjectSpec:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"spec format {d.get('format')}")
        return cls(d["license"], d["kern_version"], tuple(MapSpec(**m) for m in d["maps"]),
                   tuple(ProgSpec(p["name"], base64.b64decode(p["insns"]), tuple(map(tuple, p["relocs"])))
                         for p in d["progs"]))


# -- compiling (cache misses) ---------------------------------------------------------------------

def cache_key(text: str, cflags: list[str]) -> str:
    """What the compiled result depends on: source, flags, the kernel build and its headers
    (structures, tracepoint formats), bcc."""
    rel = os.uname().release
    build = Path(f"/lib/modules/{rel}/build")
    with contextlib.suppress(OSError):
        build = build.resolve()
    try:
        headers = f"{build}:{build.stat().st_mtime_ns}"
    except OSError:
        headers = str(build)
    try:        # the kernel's build id: a rebuilt kernel of the same release is another kernel
        notes = hashlib.sha256(Path("/sys/kernel/notes").read_bytes()).hexdigest()
    except OSError:
        notes = ""
    h = hashlib.sha256()
    for part in (str(FORMAT), text, "\0".join(cflags), rel, os.uname().version, os.uname().machine, notes,
                 headers, _bcc_version(), Path(__file__).read_text()):
        h.update(part.encode() + b"\0\1")
    return h.hexdigest()[:32]


def _bcc_version() -> str:
    """bcc's version, read without importing bcc: its import loads libbcc and with it LLVM (~40 MiB
    of pages its static initializers touch), which a start from the cache never needs."""
    spec = importlib.util.find_spec("bcc")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        with contextlib.suppress(OSError):
            return (Path(where) / "version.py").read_text()
    return "?"


def compile_spec(text: str, cflags: list[str]) -> ObjectSpec:
    """Compile with bcc (clang/LLVM) and take the result out of its module. Raises RuntimeError
    with the compiler's complaint on stderr."""
    lib = libbcc()
    flags = (ctypes.c_char_p * len(cflags))(*(f.encode() for f in cflags))
    module = lib.bpf_module_create_c_from_string(text.encode(), 0, flags, len(cflags), True, None)
    if not module:
        raise RuntimeError("bcc could not compile the BPF programs")
    try:
        maps, by_fd = [], {}
        for i in range(lib.bpf_num_tables(module)):
            name = lib.bpf_table_name(module, i)
            tid = lib.bpf_table_id(module, name)
            maps.append(MapSpec(
                name.decode(), lib.bpf_table_type_id(module, tid), lib.bpf_table_key_size_id(module, tid),
                lib.bpf_table_leaf_size_id(module, tid), lib.bpf_table_max_entries_id(module, tid),
                lib.bpf_table_flags_id(module, tid), lib.bpf_table_key_desc(module, name).decode(),
                lib.bpf_table_leaf_desc(module, name).decode()))
            by_fd[lib.bpf_table_fd(module, name)] = name.decode()
        progs = []
        for i in range(lib.bpf_num_functions(module)):
            name = lib.bpf_function_name(module, i)
            insns = bytearray(ctypes.string_at(lib.bpf_function_start(module, name),
                                               lib.bpf_function_size(module, name)))
            relocs = tuple(_map_loads(insns, by_fd))
            for i, _ in relocs:         # the module's fds mean nothing later: stored as 0
                insns[8 * i + 4:8 * i + 8] = bytes(4)
            progs.append(ProgSpec(name.decode(), bytes(insns), relocs))
        return ObjectSpec(lib.bpf_module_license(module).decode(), lib.bpf_module_kern_version(module),
                          tuple(maps), tuple(progs))
    finally:
        lib.bpf_module_destroy(module)


def _map_loads(insns: bytearray, by_fd: dict[int, str]) -> Iterator[tuple[int, str]]:
    """bcc's compiled code loads maps by the fd its module created: where, and which map."""
    for i in range(0, len(insns) // 8):
        code, regs = insns[8 * i], insns[8 * i + 1]
        # anything else that refers to the module (map values, BTF ids, subprograms) would not
        # survive the cache: refuse it here rather than load wrong code later
        if (code == _LD_IMM64 and regs >> 4 not in (0, _PSEUDO_MAP_FD)) or (code == _CALL and regs >> 4 == 1):
            raise RuntimeError(f"instruction {i} ({code:#x}, src {regs >> 4}) cannot be kept across loads")
        if code == _LD_IMM64 and regs >> 4 == _PSEUDO_MAP_FD:
            fd = int.from_bytes(insns[8 * i + 4:8 * i + 8], "little", signed=True)
            if fd not in by_fd:
                raise RuntimeError(f"instruction {i} loads map fd {fd}, which is not one of the module's")
            yield i, by_fd[fd]


def build(text: str, cflags: list[str], cache_dir: Path | None) -> tuple[ObjectSpec, bool]:
    """The compiled spec, from the cache when it holds one. Returns (spec, compiled now)."""
    key = cache_key(text, cflags)
    # programs from the cache run in the kernel: only from a directory and file nobody else can write
    path = cache_dir / f"{key}.json" if cache_dir and files.private_dir(cache_dir, create=False) else None
    if path is None:
        return compile_spec(text, cflags), True
    spec = _cached(path)
    if spec is not None:
        return spec, False
    with _compile_lock(path.parent):    # recorders starting together compile once, not each
        spec = _cached(path)
        if spec is not None:
            return spec, False
        spec = compile_spec(text, cflags)
        with contextlib.suppress(OSError):
            _store(path, spec.to_json())
    return spec, True


def _cached(path: Path) -> ObjectSpec | None:
    try:
        spec = ObjectSpec.from_json(files.read_private(path, MAX_ENTRY_BYTES).decode())
    except (OSError, ValueError, KeyError, TypeError):
        return None                 # absent, unreadable or not private: compiled again and replaced
    with contextlib.suppress(OSError):
        os.utime(path)              # newest used last to be pruned (a read-only cache still serves)
    return spec


@contextlib.contextmanager
def _compile_lock(directory: Path) -> Iterator[None]:
    try:
        fd = os.open(directory / ".compile.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield                       # a read-only cache: compile without it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def forget(text: str, cflags: list[str], cache_dir: Path | None) -> None:
    """Drop the cached spec of these inputs (the kernel refused it)."""
    if cache_dir:
        with contextlib.suppress(OSError):
            (cache_dir / f"{cache_key(text, cflags)}.json").unlink()


def _store(path: Path, text: str) -> None:
    files.write_atomic(path, text.encode())
    old = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[CACHE_ENTRIES:]
    for p in old:
        with contextlib.suppress(OSError):
            p.unlink()


# -- loading --------------------------------------------------------------------------------------

class BpfObject:
    """Maps created and programs loaded from a spec. `sizes`: map name -> max_entries."""

    def __init__(self, spec: ObjectSpec, sizes: dict[str, int] | None = None):
        with contextlib.suppress(ValueError, OSError):     # kernels before memcg accounting
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        self.spec = spec
        self._ncpus = len(cpus("possible"))
        self._maps: dict[str, Map] = {}
        self._progs: dict[tuple[str, int, int], int] = {}
        self._slots: set[tuple[str, int]] = set()      # program array slots filled
        self._perf_fds: list[int] = []
        self._fds: list[int] = []
        self._prog_specs = {p.name: p for p in spec.progs}
        try:
            for m in spec.maps:
                size = (sizes or {}).get(m.name, m.max_entries)
                try:
                    fd = sc.bpf(sc.MAP_CREATE, sc.MapCreateAttr(
                        map_type=m.type, key_size=m.key_size, value_size=m.leaf_size, max_entries=size,
                        map_flags=m.flags, map_name=m.name.encode()[:sc.OBJ_NAME_LEN - 1]))
                except OSError as e:
                    raise OSError(e.errno, f"creating BPF map {m.name}: {e.strerror}") from None
                self._fds.append(fd)
                self._maps[m.name] = Map(m, fd, self._ncpus, size)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Map:
        return self._maps[name]

    def load_func(self, name: str, prog_type: int, attach_type: int = 0) -> int:
        """Load one program (once); returns its fd. Raises OSError with the verifier's last words."""
        fd = self._progs.get((name, prog_type, attach_type))
        if fd is not None:
            return fd
        p = self._prog_specs[name]
        insns = bytearray(p.insns)
        for i, map_name in p.relocs:
            insns[8 * i + 4:8 * i + 8] = self._maps[map_name].fd.to_bytes(4, "little", signed=True)
        buf = (ctypes.c_uint8 * len(insns)).from_buffer(insns)
        lic = ctypes.create_string_buffer(self.spec.license.encode())
        short = name.removeprefix(_TRACEPOINT_PREFIX).split("__")[-1]     # what bpftool shows
        attr = sc.ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(buf),
                               license=ctypes.addressof(lic), kern_version=self.spec.kern_version,
                               prog_name=short.encode()[:sc.OBJ_NAME_LEN - 1], expected_attach_type=attach_type)
        try:
            fd = _prog_load(attr)
        except OSError as e:
            # again with the verifier's log, for its last words (a transient failure may pass now)
            log = ctypes.create_string_buffer(1 << 20)
            attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ctypes.addressof(log)
            try:
                fd = _prog_load(attr)
            except OSError:
                last = " | ".join(log.value.decode(errors="replace").strip().splitlines()[-3:])
                raise OSError(e.errno, f"loading {name}: {e.strerror}{': ' + last if last else ''}") from None
        self._fds.append(fd)
        self._progs[(name, prog_type, attach_type)] = fd
        return fd

    def tail_call(self, table: str, index: int, name: str, prog_type: int, attach_type: int = 0) -> None:
        """Program `name`, loaded once, in slot `index` of the program array `table` (once)."""
        if (table, index) in self._slots:
            return
        self._maps[table][ctypes.c_uint32(index)] = ctypes.c_uint32(self.load_func(name, prog_type, attach_type))
        self._slots.add((table, index))

    def attach_tracepoints(self) -> None:
        """Load and attach every `TRACEPOINT_PROBE(category, event)` program (named
        tracepoint__category__event), as bcc does when it loads a module."""
        lib = runtime()
        for p in self.spec.progs:
            if p.name.startswith(_TRACEPOINT_PREFIX):
                category, event = p.name[len(_TRACEPOINT_PREFIX):].split("__", 1)
                fd = lib.bpf_attach_tracepoint(self.load_func(p.name, PROG_TRACEPOINT),
                                               category.encode(), event.encode())
                if fd < 0:
                    err = ctypes.get_errno() or 22
                    raise OSError(err, f"attaching tracepoint {category}:{event}: {os.strerror(err)}")
                self._perf_fds.append(fd)

    def attach_perf_event(self, name: str, ev_type: int, ev_config: int, sample_period: int) -> None:
        """Run a PERF_EVENT program on a software/hardware event on every online CPU."""
        lib, prog = runtime(), self.load_func(name, PROG_PERF_EVENT)
        fds = []
        for cpu in cpus("online"):
            fd = lib.bpf_attach_perf_event(prog, ev_type, ev_config, sample_period, 0, -1, cpu, -1)
            if fd < 0:
                err = ctypes.get_errno() or 22
                for opened in fds:          # all CPUs or none
                    lib.bpf_close_perf_event_fd(opened)
                raise OSError(err, f"perf event on CPU {cpu}: {os.strerror(err)}")
            fds.append(fd)
        self._perf_fds += fds

    def close(self) -> None:
        lib = runtime()
        for fd in self._perf_fds:
            lib.bpf_close_perf_event_fd(fd)
        self._perf_fds = []
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds, self._progs, self._maps = [], {}, {}


class Map:
    """A map by fd, with bcc's table interface as far as we use it: Key and Leaf types (per-CPU
    maps: Leaf is one value per possible CPU, sLeaf one value), item get/set/delete (KeyError
    when absent), iteration over keys, items()."""

    def __init__(self, spec: MapSpec, fd: int, ncpus: int, max_entries: int):
        self.name, self.fd = spec.name, fd
        self.max_entries = max_entries
        self.Key = ctype(json.loads(spec.key_desc))
        leaf = ctype(json.loads(spec.leaf_desc))
        self.percpu = spec.type in (MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH)
        if self.percpu:
            # the kernel's layout when a value is a multiple of 8 bytes; others are refused by _op
            self.sLeaf, self.Leaf = leaf, leaf * ncpus
        else:
            self.Leaf = leaf
        self._key_size = spec.key_size
        self._value_bytes = (spec.leaf_size + 7) // 8 * 8 * ncpus if self.percpu else spec.leaf_size

    def _op(self, cmd: int, key, value=None, flags: int = 0) -> None:
        # the kernel reads and writes exactly the map's sizes through these pointers
        if key is not None and ctypes.sizeof(key) < self._key_size:
            raise TypeError(f"map {self.name}: key of {ctypes.sizeof(key)} bytes, the map's are {self._key_size}")
        if value is not None and cmd != sc.MAP_GET_NEXT_KEY and ctypes.sizeof(value) < self._value_bytes:
            raise TypeError(f"map {self.name}: value of {ctypes.sizeof(value)} bytes, needs {self._value_bytes}")
        attr = sc.ElemAttr(map_fd=self.fd, key=ctypes.addressof(key) if key is not None else 0,
                           value=ctypes.addressof(value) if value is not None else 0, flags=flags)
        try:
            sc.bpf(cmd, attr)
        except OSError as e:
            if e.errno == 2:        # ENOENT
                raise KeyError(key) from None
            raise OSError(e.errno, f"map {self.name}: {e.strerror}") from None

    def __getitem__(self, key):
        leaf = self.Leaf()
        self._op(sc.MAP_LOOKUP_ELEM, key, leaf)
        return leaf

    def __setitem__(self, key, leaf) -> None:
        self._op(sc.MAP_UPDATE_ELEM, key, leaf)

    def __delitem__(self, key) -> None:
        self._op(sc.MAP_DELETE_ELEM, key)

    def update_batch(self, keys: bytes | bytearray | memoryview, values: bytes | bytearray | memoryview,
                     count: int) -> None:
        """Set `count` elements in one call: `keys` and `values` are the packed keys and values."""
        if len(keys) < count * self._key_size or len(values) < count * self._value_bytes:
            raise TypeError(f"map {self.name}: {count} elements need more key or value bytes")
        kbuf = (ctypes.c_char * len(keys)).from_buffer_copy(keys)
        vbuf = (ctypes.c_char * len(values)).from_buffer_copy(values)
        attr = sc.BatchAttr(keys=ctypes.addressof(kbuf), values=ctypes.addressof(vbuf), count=count, map_fd=self.fd)
        try:
            sc.bpf(sc.MAP_UPDATE_BATCH, attr)
        except OSError as e:
            raise OSError(e.errno, f"map {self.name}: {e.strerror}") from None

    def write_array(self, first: int, data: bytes | memoryview) -> None:
        """Write elements first, first + 1, ... of an array map created BPF_F_MMAPABLE through a
        shared mapping of it, a window at a time, each unmapped after (its pages leave this
        process's RSS: a large library's rows never count twice in the recorder's peak)."""
        data = memoryview(data).cast("B")
        size = self.max_entries * self._value_bytes
        start, end = first * self._value_bytes, first * self._value_bytes + len(data)
        # the kernel lays elements out 8-byte aligned: only 8-byte multiples map one to one
        if first < 0 or end > size or len(data) % self._value_bytes or self._value_bytes % 8:
            raise ValueError(f"map {self.name}: elements {first}.. do not fit")
        page = mmap.PAGESIZE
        for at in range(start, end, WRITE_WINDOW):
            stop = min(end, at + WRITE_WINDOW)
            lo = at // page * page
            with mmap.mmap(self.fd, -(-stop // page) * page - lo, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE, offset=lo) as m:
                m[at - lo:stop - lo] = data[at - start:stop - start]

    def put(self, key, leaf) -> None:
        """Set `key` to `leaf`; None deletes it (absent or not)."""
        if leaf is not None:
            self[key] = leaf
            return
        with contextlib.suppress(KeyError):
            del self[key]

    def __iter__(self) -> Iterator:
        key, nxt = None, self.Key()
        while True:
            try:
                self._op(sc.MAP_GET_NEXT_KEY, key, nxt)
            except KeyError:
                return
            key, nxt = nxt, self.Key()
            yield key

    def items(self) -> list[tuple]:
        out = []
        for k in list(self):
            with contextlib.suppress(KeyError):     # deleted by BPF meanwhile
                out.append((k, self[k]))
        return out


_libbcc = None
_runtime = None


def runtime():
    """libbcc's runtime half (libbcc_bpf: attach, perf events, libbpf's ring buffer), without the
    compiler: a start from the cache never maps LLVM. A private handle, so that our argtypes do not
    change bcc's own."""
    global _runtime
    if _runtime is None:
        _runtime = _declare(ctypes.CDLL("libbcc_bpf.so.0", use_errno=True), _RUNTIME)
    return _runtime


def libbcc():
    """libbcc with its compiler (bcc_common.h): for cache misses only."""
    global _libbcc
    if _libbcc is None:
        _libbcc = _declare(ctypes.CDLL("libbcc.so.0", use_errno=True), _COMPILER)
    return _libbcc


def _declare(lib: ctypes.CDLL, functions) -> ctypes.CDLL:
    for fn, res, args in functions:
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args
    return lib


_c_p, _c_s, _c_id, _c_int = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
_RUNTIME = (
    ("bpf_attach_uprobe", _c_int, [_c_int, _c_int, _c_s, _c_s, ctypes.c_uint64, _c_int, ctypes.c_uint32]),
    ("bpf_detach_uprobe", _c_int, [_c_s]),
    ("bpf_close_perf_event_fd", _c_int, [_c_int]),
    ("bpf_attach_tracepoint", _c_int, [_c_int, _c_s, _c_s]),
    ("bpf_attach_perf_event", _c_int, [_c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                                       _c_int, _c_int, _c_int]),
    # libbpf's ring buffer, as bcc builds it in
)
_COMPILER = (           # the compiled module
    ("bpf_module_create_c_from_string", _c_p, [_c_s, ctypes.c_uint, ctypes.POINTER(_c_s), _c_int, ctypes.c_bool, _c_s]),
    ("bpf_module_destroy", None, [_c_p]),
    ("bpf_module_license", _c_s, [_c_p]),
    ("bpf_module_kern_version", ctypes.c_uint, [_c_p]),
    ("bpf_num_functions", _c_id, [_c_p]),
    ("bpf_function_name", _c_s, [_c_p, _c_id]),
    ("bpf_function_start", _c_p, [_c_p, _c_s]),
    ("bpf_function_size", _c_id, [_c_p, _c_s]),
    ("bpf_num_tables", _c_id, [_c_p]),
    ("bpf_table_name", _c_s, [_c_p, _c_id]),
    ("bpf_table_id", _c_id, [_c_p, _c_s]),
    ("bpf_table_fd", _c_int, [_c_p, _c_s]),
    ("bpf_table_type_id", _c_int, [_c_p, _c_id]),
    ("bpf_table_max_entries_id", _c_id, [_c_p, _c_id]),
    ("bpf_table_flags_id", _c_int, [_c_p, _c_id]),
    ("bpf_table_key_size_id", _c_id, [_c_p, _c_id]),
    ("bpf_table_leaf_size_id", _c_id, [_c_p, _c_id]),
    ("bpf_table_key_desc", _c_s, [_c_p, _c_s]),
    ("bpf_table_leaf_desc", _c_s, [_c_p, _c_s]),
)

# bcc's type descriptors (JSON, kept in the spec) as ctypes, the way bcc's Python decodes them
_SCALARS = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "wchar_t": ctypes.c_wchar, "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "int": ctypes.c_int, "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long, "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float, "double": ctypes.c_double,
    "long double": ctypes.c_longdouble, "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2,
}


def ctype(desc):
    """A ctypes type from a bcc type descriptor: a scalar's name, or [name, fields, kind] where a
    field is [name, type], [name, type, [n]] (array), [name, type, bits] or a nested [name, fields,
    kind] (kind: struct, struct_packed, union; an unnamed one is anonymous)."""
    if isinstance(desc, str):
        return _SCALARS[desc]
    fields, anon = [], []
    for f in desc[1]:
        if len(f) == 2:
            fields.append((f[0], ctype(f[1])))
        elif len(f) == 3 and isinstance(f[2], list):
            fields.append((f[0], ctype(f[1]) * f[2][0]))
        elif len(f) == 3 and isinstance(f[2], int):
            fields.append((f[0], ctype(f[1]), f[2]))
        elif len(f) == 3 and f[2] in ("struct", "struct_packed", "union"):
            name = f[0] or f"__anon{len(anon)}"
            if not f[0]:
                anon.append(name)
            fields.append((name, ctype(f)))
        else:
            raise ValueError(f"cannot decode bcc type {f!r}")
    kind = desc[2] if len(desc) > 2 else "struct"
    body = {"_anonymous_": anon, "_fields_": fields, **({"_pack_": 1} if kind == "struct_packed" else {})}
    return type(str(desc[0]), (ctypes.Union if kind == "union" else ctypes.Structure,), body)


def cpus(kind: str) -> list[int]:
    """The CPUs in /sys/devices/system/cpu/{possible,online} ("0-3,5")."""
    out: list[int] = []
    for part in Path(f"/sys/devices/system/cpu/{kind}").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out

PROG_LOAD_TRIES = 5


def _prog_load(attr: sc.ProgLoadAttr) -> int:
    """BPF_PROG_LOAD with this thread's signals blocked: the verifier gives up with EAGAIN when a
    signal is pending (a child's SIGCHLD, a Ctrl-C: it aborted a recording once), and a blocked
    signal is not pending for this thread; it is delivered once the load is done. Those that cannot
    be blocked (SIGKILL, SIGSTOP) are retried."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        for attempt in range(PROG_LOAD_TRIES):
            try:
                return sc.bpf(sc.PROG_LOAD, attr)
            except OSError as e:
                if e.errno != errno.EAGAIN or attempt == PROG_LOAD_TRIES - 1:
                    raise
        raise AssertionError("unreachable")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
