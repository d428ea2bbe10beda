"""GPU memory as the NVIDIA driver reports it (NVML, through pynvml from the nvidia-ml-py package).

Every interval: per device total, used and driver-reserved memory, and per process the memory
it uses on each device (host pids, also for processes in containers). Without pynvml, an
NVIDIA driver or permission, `Nvml.status` says why in one line and `sample()` returns nothing:
the rest of the recording goes on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    uuid: str
    name: str
    total: int
    used: int
    reserved: int | None          # the driver's own reserve (nvmlMemory_v2), else None
    processes: int                # processes with memory on the device


@dataclass
class NvmlSample:
    devices: list[DeviceMemory] = field(default_factory=list)
    used_by_pid: dict[int, int] = field(default_factory=dict)   # bytes over all devices
    pids: set[int] = field(default_factory=set)                 # listed by the driver (even if usage is unknown)


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class Nvml:
    """One NVML session for a recording. `nvml` is the pynvml module (tests pass a fake)."""

    def __init__(self, nvml=None):
        self.ok = False
        self.devices = 0
        self._handles: list = []
        self._m = nvml
        if self._m is None:
            try:
                import pynvml
            except ImportError:
                self.status = ("no GPU metrics: pynvml is not installed (pip install nvidia-ml-py); "
                               "CUDA calls are still traced")
                return
            self._m = pynvml
        m = self._m
        try:
            m.nvmlInit()
        except m.NVMLError as e:
            self.status = f"no NVIDIA driver: {_why(m, e)}; GPU memory is not sampled (CUDA calls are still traced)"
            return
        try:
            self.devices = int(m.nvmlDeviceGetCount())
            self._handles = [m.nvmlDeviceGetHandleByIndex(i) for i in range(self.devices)]
            driver = _text(m.nvmlSystemGetDriverVersion())
        except m.NVMLError as e:
            self.status = f"NVML failed: {_why(m, e)}; GPU memory is not sampled"
            self._shutdown()
            return
        self.ok = True
        self.status = f"nvml: {self.devices} device{'s' * (self.devices != 1)}, driver {driver}"

    def sample(self) -> NvmlSample:
        out = NvmlSample()
        if not self.ok:
            return out
        m = self._m
        for i, h in enumerate(self._handles):
            try:
                mem, reserved = self._memory(h)
                procs = []
                for get in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                    fn = getattr(m, get, None)
                    if fn is not None:
                        with contextlib.suppress(m.NVMLError):
                            procs += list(fn(h))
                uuid, name = _text(m.nvmlDeviceGetUUID(h)), _text(m.nvmlDeviceGetName(h))
            except m.NVMLError:
                continue            # a device that fell off the bus: the others are still sampled
            seen = set()
            for p in procs:
                pid = int(p.pid)
                if pid in seen:     # compute and graphics lists may both hold a process
                    continue
                seen.add(pid)
                out.pids.add(pid)
                used = getattr(p, "usedGpuMemory", None)
                if used is not None and used >= 0 and used < 1 << 62:    # NVML_VALUE_NOT_AVAILABLE
                    out.used_by_pid[pid] = out.used_by_pid.get(pid, 0) + int(used)
            out.devices.append(DeviceMemory(i, uuid, name, int(mem.total), int(mem.used), reserved, len(seen)))
        return out

    def _memory(self, h):
        m = self._m
        v2 = getattr(m, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                mem = m.nvmlDeviceGetMemoryInfo(h, version=v2)
                return mem, int(mem.reserved)
            except (m.NVMLError, TypeError, AttributeError):
                pass
        return m.nvmlDeviceGetMemoryInfo(h), None

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._m.nvmlShutdown()

    def close(self) -> None:
        if self.ok:
            self.ok = False
            self._shutdown()


def _why(m, e) -> str:
    value = getattr(e, "value", None)
    if value == getattr(m, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return "libnvidia-ml.so.1 not found (no driver installed, or not visible in this container)"
    if value == getattr(m, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return "the NVIDIA kernel driver is not loaded"
    if value == getattr(m, "NVML_ERROR_NO_PERMISSION", 4):
        return "no permission to query the driver"
    return str(e)
