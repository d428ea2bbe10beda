"""GPU memory: which CUDA libraries a process maps, what to probe in them, and what their calls
do to the outstanding table.

Two layers describe the same device memory (one cudaMalloc is one cuMemAlloc_v2 in the driver),
kept apart as sources that are compared, never added:

- `cuda`: runtime (libcudart) device and managed memory: cudaMalloc, cudaMallocAsync(_ptsz),
  cudaMallocFromPoolAsync, cudaMallocManaged, cudaMallocPitch; cudaFree, cudaFreeAsync(_ptsz).
- `cuda-host`: runtime pinned host memory: cudaMallocHost, cudaHostAlloc, cudaHostRegister;
  cudaFreeHost, cudaHostUnregister.
- `cuda-driver`: driver (libcuda) device and managed memory: cuMemAlloc_v2, cuMemAllocAsync(_ptsz),
  cuMemAllocFromPoolAsync(_ptsz), cuMemAllocManaged, cuMemAllocPitch_v2; cuMemFree_v2,
  cuMemFreeAsync(_ptsz); and the VMM API's physical memory: cuMemCreate, gone when its handle is
  released *and* unmapped (cuMemRelease, cuMemMap/cuMemUnmap).
- `cuda-driver-host`: driver pinned host memory: cuMemAllocHost_v2, cuMemHostAlloc,
  cuMemHostRegister_v2; cuMemFreeHost, cuMemHostUnregister.
- `torch`: PyTorch caching-allocator tensors (USDT pytorch:malloc/free in libc10_cuda), sampled
  like malloc blocks.

Address space (cuMemAddressReserve/cuMemAddressFree) and mappings are `gpu_events` rows only:
they are not memory. Every CUDA call is a `gpu_events` row with its result and, for calls that
allocate (successful or not), its stack. Out-parameters are read only on success (BPF), failed
calls change nothing, cudaFree(NULL) is not traced at all, and a free applies only to a block
allocated before the free started (the address may be reused by another thread meanwhile).
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field

from sampler.binary.elf import ElfImage
from sampler.bpf.abi import CK_CONV_SHIFT, CK_NULL_SKIP, CK_SRC_SHIFT, CK_STACK, CudaConv, Source, UsdtKind
from sampler.bpf.loader import UsdtSite
from sampler.dataset.schema import int64
from sampler.dataset.sources import CUDA, CUDA_DRIVER, CUDA_DRIVER_HOST, CUDA_HOST, DEVICE_SOURCES, HOST_SOURCES, TORCH
from sampler.probes import usdt
from sampler.probes.allocators import own_probes
from sampler.probes.plans import PlanCache
from sampler.proc.maps import Mapping, open_path, pinned

SRC_CUDA, SRC_CUDA_DRIVER, SRC_TORCH = Source.CUDA, Source.CUDA_DRIVER, Source.TORCH
LAYER_OF = {SRC_CUDA: CUDA, SRC_CUDA_DRIVER: CUDA_DRIVER}
TORCH_PROVIDER = "pytorch"

# cookie bits (bpf/cuda.bpf.c)
CV_OUT, CV_PITCH, CV_ARGS = CudaConv.OUT, CudaConv.PITCH, CudaConv.ARGS


class Op(enum.Enum):
    ALLOC = "alloc"              # memory comes into being (device, managed, pinned host)
    FREE = "free"
    REGISTER = "register"        # existing host memory becomes pinned
    UNREGISTER = "unregister"
    CREATE = "create"            # VMM physical memory (a handle)
    RELEASE = "release"
    MAP = "map"                  # VMM: a handle mapped at an address
    UNMAP = "unmap"
    RESERVE = "reserve"          # VMM: address space only, never counted
    UNRESERVE = "unreserve"


_OPENS = (Op.ALLOC, Op.REGISTER, Op.CREATE, Op.MAP, Op.RESERVE)   # calls whose stack is captured


@dataclass(frozen=True)
class CudaFn:
    name: str
    layer: str          # CUDA (runtime) | CUDA_DRIVER
    op: Op
    conv: int           # CV_OUT | CV_PITCH | CV_ARGS
    memory: str         # device | managed | host | vmm | address

    @property
    def source(self) -> str:
        host = self.memory == "host"
        if self.layer == CUDA:
            return CUDA_HOST if host else CUDA
        return CUDA_DRIVER_HOST if host else CUDA_DRIVER

    @property
    def null_skip(self) -> bool:
        return self.op in (Op.FREE, Op.UNREGISTER, Op.RELEASE)


def _fns(layer: str, rows: str) -> list[CudaFn]:
    convs = {"out": CV_OUT, "pitch": CV_PITCH, "args": CV_ARGS}
    out = []
    for line in rows.strip().splitlines():
        names, op, conv, memory = line.split()
        out += [CudaFn(n, layer, Op(op), convs[conv], memory) for n in names.split(",")]
    return out


# The probe table: per function, its operation, argument convention and kind of memory
# (docs/design.md, "GPU memory"). Function ids are positions in it (+1): they travel in the
# cookie and the record, and mean nothing outside one recorder.
FUNCTIONS: tuple[CudaFn, ...] = tuple(_fns(CUDA, """
cudaMalloc,cudaMallocAsync,cudaMallocAsync_ptsz,cudaMallocFromPoolAsync,cudaMallocFromPoolAsync_ptsz alloc out device
cudaMallocManaged alloc out managed
cudaMallocPitch alloc pitch device
cudaFree,cudaFreeAsync,cudaFreeAsync_ptsz free args device
cudaMallocHost,cudaHostAlloc alloc out host
cudaFreeHost free args host
cudaHostRegister register args host
cudaHostUnregister unregister args host
""") + _fns(CUDA_DRIVER, """
cuMemAlloc_v2,cuMemAllocAsync,cuMemAllocAsync_ptsz,cuMemAllocFromPoolAsync,cuMemAllocFromPoolAsync_ptsz alloc out device
cuMemAllocManaged alloc out managed
cuMemAllocPitch_v2 alloc pitch device
cuMemFree_v2,cuMemFreeAsync,cuMemFreeAsync_ptsz free args device
cuMemAllocHost_v2,cuMemHostAlloc alloc out host
cuMemFreeHost free args host
cuMemHostRegister_v2 register args host
cuMemHostUnregister unregister args host
cuMemCreate create out vmm
cuMemRelease release args vmm
cuMemMap map args vmm
cuMemUnmap unmap args vmm
cuMemAddressReserve reserve out address
cuMemAddressFree unreserve args address
"""))
FN_ID = {f.name: i + 1 for i, f in enumerate(FUNCTIONS)}
assert len(FUNCTIONS) < 256


def by_id(fn_id: int) -> CudaFn | None:
    return FUNCTIONS[fn_id - 1] if 0 < fn_id <= len(FUNCTIONS) else None


def cookie(fn: CudaFn) -> int:
    src = SRC_CUDA if fn.layer == CUDA else SRC_CUDA_DRIVER
    return (FN_ID[fn.name] | fn.conv << CK_CONV_SHIFT | src << CK_SRC_SHIFT | (CK_STACK if fn.op in _OPENS else 0)
            | (CK_NULL_SKIP if fn.null_skip else 0))


# Library files: pip wheels (site-packages/nvidia/cuda_runtime/lib/libcudart.so.12), the toolkit
# (/usr/local/cuda/lib64/libcudart.so.13), copies bundled in torch/lib with a hash in the name
# (libcudart-9335f6a2.so.12), the driver (libcuda.so.1, libcuda.so.535.104.05).
RUNTIME_LIB = re.compile(r"^libcudart(-[0-9a-f]{6,})?\.so(\.|$)")
DRIVER_LIB = re.compile(r"^libcuda\.so(\.|$)")
TORCH_LIB = re.compile(r"^lib(c10_cuda|torch_cuda)(-[0-9a-f]{6,})?\.so")


def layer_of_file(path: str) -> str | None:
    base = os.path.basename(path)
    if RUNTIME_LIB.search(base):
        return CUDA
    if DRIVER_LIB.search(base):
        return CUDA_DRIVER
    return None


@dataclass(frozen=True)
class CudaPoint:
    name: str
    file_offset: int
    cookie: int


@dataclass
class CudaLib:
    layer: str
    path: str                # as the process sees it
    build_id: str | None
    points: list[CudaPoint] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def plan_library(image: ElfImage, layer: str, path: str) -> CudaLib:
    """The functions of one layer that a library defines, probed at their first instruction.
    Symbols at one address are probed once; a function that calls or jumps to another probed
    function of the library is not probed (the other probe sees its memory)."""
    lib = CudaLib(layer, path, image.build_id)
    fns = {f.name: f for f in FUNCTIONS if f.layer == layer and image.symbol(f.name) is not None}
    # probed at the entry, so a symbol without a size is still probed
    for sym, _ in own_probes(image, fns, lib.skipped, sizeless=True):
        off = image.vaddr_to_file_offset(sym.value)
        if off is None:
            lib.skipped.append((sym.name, "not in a loadable segment"))
            continue
        lib.points.append(CudaPoint(sym.name, off, cookie(fns[sym.name])))
    return lib


def torch_probes(path: str) -> list[usdt.UsdtProbe]:
    """PyTorch's caching-allocator USDT sites: pytorch:malloc(ptr, device, size, stream) and
    pytorch:free(ptr); [] unless both are there with those arguments."""
    found = [p for p in usdt.read_probes(path) if p.provider == TORCH_PROVIDER
             and (p.name, len(p.args)) in (("malloc", 4), ("free", 1))]
    return found if {p.name for p in found} == {"malloc", "free"} else []


def torch_site(p: usdt.UsdtProbe) -> UsdtSite:
    """A pytorch:malloc/free site with its arguments in the order the BPF program reads them
    (ptr, size, device)."""
    if p.name == "malloc":
        return UsdtSite(p.file_offset, p.semaphore, usdt.pack_spec((p.args[0], p.args[2], p.args[1]),
                                                                   UsdtKind.TORCH_ALLOC))
    return UsdtSite(p.file_offset, p.semaphore, usdt.pack_spec((p.args[0],), UsdtKind.TORCH_FREE))


plans: PlanCache[CudaLib] = PlanCache()


def find_libraries(pid: int, maps: list[Mapping]) -> list[tuple[CudaLib, str, Mapping]]:
    """CUDA runtime and driver libraries mapped by `pid`, with a path that opens them from here
    (/proc/PID/map_files or /proc/PID/root: containers), planned once per file."""
    out = []
    seen: set[tuple] = set()
    for m in maps:
        ident = (m.dev, m.inode, m.path)
        if not m.path.startswith("/") or ident in seen:
            continue
        seen.add(ident)
        layer = layer_of_file(m.path)
        if layer is None:
            continue
        attach = open_path(pid, m)
        plan = plans.get(ident, attach, lambda image, layer=layer, m=m: plan_library(image, layer, m.path))
        if plan is not None and plan.points:
            out.append((plan, attach, m))
    return out


# --- error codes: the common ones, by layer ----------------------------------------------------
_RT_ERRORS = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 3: "cudaErrorInitializationError",
              4: "cudaErrorCudartUnloading", 34: "cudaErrorStubLibrary", 35: "cudaErrorInsufficientDriver",
              46: "cudaErrorDevicesUnavailable", 100: "cudaErrorNoDevice", 101: "cudaErrorInvalidDevice",
              201: "cudaErrorDeviceUninitialized", 400: "cudaErrorInvalidResourceHandle",
              700: "cudaErrorIllegalAddress", 712: "cudaErrorHostMemoryAlreadyRegistered",
              713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported", 999: "cudaErrorUnknown"}
_DRV_ERRORS = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
               4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY", 100: "CUDA_ERROR_NO_DEVICE",
               101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT", 400: "CUDA_ERROR_INVALID_HANDLE",
               700: "CUDA_ERROR_ILLEGAL_ADDRESS", 712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
               713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 801: "CUDA_ERROR_NOT_SUPPORTED", 999: "CUDA_ERROR_UNKNOWN"}


def error_name(layer: str, code: int) -> str | None:
    if code == 0:
        return None
    return (_RT_ERRORS if layer == CUDA else _DRV_ERRORS).get(code, f"error {code}")


def apply_call(table, fn: CudaFn, ok: bool, addr: int, size: int, arg4: int, started_ns: int, ts_ns: int,
               stack_id: int | None) -> bool:
    """What one traced call does to a process's outstanding table (sampler/record/outstanding.py);
    returns whether it changed it. Failed calls never do."""
    if not ok:
        return False
    src = fn.source
    if fn.op in (Op.ALLOC, Op.REGISTER):
        if not addr or not size:
            return False
        table.gpu_alloc(src, addr, size, stack_id, ts_ns)
        return True
    if fn.op in (Op.FREE, Op.UNREGISTER):
        return table.gpu_free(src, addr, started_ns)
    if fn.op == Op.CREATE:
        if not addr or not size:
            return False
        table.gpu_alloc(src, addr, size, stack_id, ts_ns, handle=True)
        return True
    if fn.op == Op.RELEASE:
        return table.vmm_release(addr, started_ns)
    if fn.op == Op.MAP:
        return table.vmm_map(addr, size, arg4)
    if fn.op == Op.UNMAP:
        return table.vmm_unmap(addr, size)
    return False            # address reservations are not memory


# --- the recorder's side -------------------------------------------------------------------------

@dataclass
class _GpuTarget:
    attached: set[tuple] = field(default_factory=set)   # files tried (attached or failed)
    libs: list[str] = field(default_factory=list)       # `layer:path`
    labels: list[str] = field(default_factory=list)     # probe sites, for `targets.probes`
    cuda: bool = False                                  # runtime or driver probes attached
    torch: bool = False                                 # pytorch USDT probes attached


class GpuTracer:
    """CUDA probes per target, the `gpu_events` rows, NVML samples and the GPU columns of
    `processes`. `probes` is the BpfProbes; `nvml` a sampler.gpu.nvml.Nvml (None: not sampled)."""

    def __init__(self, probes, nvml=None, rows_per_interval: int = 20000):
        from sampler.gpu.nvml import NvmlSample
        self.probes = probes
        self.nvml = nvml
        self.targets: dict[int, _GpuTarget] = {}
        self.rows: list[dict] = []
        self.rows_per_interval = rows_per_interval
        self.dropped = 0
        self.last = NvmlSample()

    @property
    def status(self) -> str:
        return self.nvml.status if self.nvml is not None else "GPU tracing off (--no-gpu)"

    def scan(self, pid: int, maps: list[Mapping]) -> tuple[bool, list[str]]:
        """Attach to CUDA libraries and PyTorch USDT sites that `pid` maps and that are new.
        Returns (whether anything was attached, warnings). ProcessLookupError: gone."""
        st = self.targets.setdefault(pid, _GpuTarget())
        new, warnings = False, []
        for lib, attach, m in find_libraries(pid, maps):
            ident = (m.dev, m.inode, m.path)
            if ident in st.attached:
                continue
            st.attached.add(ident)
            try:
                self.probes.attach_cuda(pid, attach, [p.file_offset for p in lib.points],
                                        [p.cookie for p in lib.points])
            except OSError as e:
                if not os.path.exists(f"/proc/{pid}"):
                    raise ProcessLookupError(pid) from None
                warnings.append(f"could not probe the CUDA {'runtime' if lib.layer == CUDA else 'driver'} "
                                f"in {m.path}: {e}")
                continue
            new = st.cuda = True
            st.libs.append(f"{lib.layer}:{m.path}")
            st.labels += [f"{p.name}+0 (cuda, multi)" for p in lib.points]
        for m in maps:
            ident = (m.dev, m.inode, m.path)
            if not m.executable or ident in st.attached or not TORCH_LIB.search(os.path.basename(m.path)):
                continue
            st.attached.add(ident)
            if not torch_probes(open_path(pid, m)):
                continue
            try:
                with pinned(pid, m) as path:        # parsed from and attached through one descriptor
                    found = torch_probes(path)
                    self.probes.attach_torch(pid, path, [torch_site(p) for p in found])
            except (OSError, ValueError) as e:
                if not os.path.exists(f"/proc/{pid}"):
                    raise ProcessLookupError(pid) from None
                warnings.append(f"could not attach the pytorch USDT probes of {m.path}: {e}")
                continue
            new = st.torch = True
            st.libs.append(f"pytorch:{m.path}")
            st.labels += [f"{p.label} (usdt, multi)" for p in found]
        return new, warnings

    def forget(self, pid: int) -> None:
        self.targets.pop(pid, None)

    def libraries(self, pid: int) -> list[str]:
        st = self.targets.get(pid)
        return list(st.libs) if st else []

    def labels(self, pid: int) -> list[str]:
        st = self.targets.get(pid)
        return list(st.labels) if st else []

    def on_event(self, table, ev, intern, wall) -> None:
        """One EV_CUDA record: apply it to the process's table and keep its `gpu_events` row.
        `intern(ev)` gives the stack id; `wall(ns)` the row's timestamp."""
        fn = by_id(ev.op)
        if fn is None:
            return
        code = ev.ret & 0xFFFFFFFF
        ok = code == 0
        sid = intern(ev) if fn.op in _OPENS else None
        counted = apply_call(table, fn, ok, ev.addr, ev.size, ev.arg, ev.weight, ev.ts_ns, sid)
        if len(self.rows) >= self.rows_per_interval:
            self.dropped += 1
            return
        self.rows.append({
            "ts": wall(ev.ts_ns), "pid": ev.pid, "tid": ev.tid, "source": fn.source, "function": fn.name,
            "op": fn.op.value, "memory": fn.memory, "ptr": int64(ev.addr),
            "size": None if fn.op in (Op.FREE, Op.UNREGISTER, Op.RELEASE) else int64(ev.size),
            "handle": int64(ev.arg) if fn.op == Op.MAP else None,
            "result": code - (1 << 32) if code >= 1 << 31 else code, "error": error_name(fn.layer, code),
            "counted": counted, "duration_us": max(0, ev.ts_ns - ev.weight) / 1e3 if ev.weight else None,
            "stack_id": sid,
        })

    def drain_rows(self) -> list[dict]:
        rows, self.rows = self.rows, []
        self.dropped = 0
        return rows

    def sample(self):
        """NVML once per snapshot; the processes' columns below use it."""
        if self.nvml is not None:
            self.last = self.nvml.sample()
        return self.last

    def device_rows(self) -> list[dict]:
        return [{"device": d.index, "uuid": d.uuid, "name": d.name, "total_bytes": d.total, "used_bytes": d.used,
                 "reserved_bytes": d.reserved, "processes": d.processes} for d in self.last.devices]

    def process_columns(self, pid: int, table) -> dict:
        """The GPU columns of one `processes` row (null where not measured)."""
        st = self.targets.get(pid)
        nvml_ok = self.nvml is not None and self.nvml.ok
        used = self.last.used_by_pid.get(pid)
        if used is None and nvml_ok and st is not None and st.cuda and pid not in self.last.pids:
            used = 0                          # CUDA loaded, no context on any device (yet)
        out = {"gpu_used_bytes": used, "gpu_reserved_bytes": None, "gpu_pinned_bytes": None,
               "gpu_allocated_bytes": None, "gpu_allocated_stderr_bytes": None}
        if st is not None and st.cuda:
            out["gpu_reserved_bytes"] = max(table.totals(s)[0] for s in DEVICE_SOURCES)
            out["gpu_pinned_bytes"] = max(table.totals(s)[0] for s in HOST_SOURCES)
        if st is not None and st.torch:
            out["gpu_allocated_bytes"], out["gpu_allocated_stderr_bytes"] = table.totals(TORCH)
        return out

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
