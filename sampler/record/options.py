"""What a recording is asked to do (RecordOptions) and what a long-running owner adds to it
(RecorderHooks): plain inputs of sampler/record/build.py and recorder.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from sampler.dataset.writer import DatasetWriter
from sampler.probes.allocators import Family


@dataclass
class RecordOptions:
    out: str
    pids: list[int] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    duration: float | None = None
    interval: float | None = None         # None: adaptive (snapshot.snapshot_interval)
    sample_mean: int = 512 * 1024
    children: bool = False
    allocators: tuple[Family, ...] = ()
    syscalls_only: bool = False
    probe_mode: str = "auto"
    attach_mode: str = "auto"             # auto | inject | uprobe (sampler/record/attach.py)
    python_objects: bool = False          # inject tier: CPython's object allocator too
    live_max: int = 262144
    max_frames: int = 127                 # native frames unwound per stack
    stack_bytes: int = 16 << 10           # user stack copied per sampled event
    python: bool = True                   # read Python frames of CPython targets
    interpreter_frames: bool = False      # keep libpython frames between Python frames
    unwind_cache: str | None = None       # directory for the per-build-id unwind tables
    unwind: str = "bpf"                   # bpf: native stacks walked in BPF from compact tables
                                          # (sampler/stacks/kernel_tables.py); user: copied and unwound here
    vm_events_per_interval: int = 20000
    vm_events_per_s: int = 2000           # unsampled syscall events sent per process (BPF budget)
    max_samples_per_s: int = 2000         # per process: its mean is raised above (0: no cap)
    rss: bool = False                     # always-on tier: sampled page faults, no uprobes
    fault_period: int = 61                # one fault sampled in this many (prime: no aliasing
                                          # with loops that fault a power of two of pages)
    cgroups: list[str] = field(default_factory=list)   # always-on tier for these cgroups
    all_processes: bool = False           # always-on tier for every process
    preload: bool = False                 # start the command with the preload shim
    cpu_budget: float = 0.03              # governor: fraction of one CPU per process (0: off)
    probe_cost_ns: float | None = None    # per probe hit; None: calibrate at start-up
    ringbuf_bytes: int = 8 << 20          # BPF ring buffer (mapped once: sampler/bpf/ringbuf.py); read in
                                          # batches of an eighth of it, or every 100 ms
    daemon: bool = False                  # sampler/service/daemon.py: runs without targets, adds its own
    max_targets: int = 4000               # processes recorded at once; forks past it are counted, not recorded
    quiet: bool = False
    argv: str = ""
    gpu: bool = True                      # trace CUDA calls and sample NVML (sampler/gpu/cuda.py)


class RecorderHooks:
    """What a long-running owner of a recording (the daemon) adds to it. The defaults do nothing."""

    def writer(self, root: str, recording_id: str, host: str) -> DatasetWriter:
        return DatasetWriter(root, recording_id, host=host)

    def started(self) -> None:
        """BPF is loaded; no target is attached yet."""

    def tick(self, now: float) -> None:
        """After every poll of the ring buffer (`now`: monotonic)."""

    def snapshot_done(self) -> None:
        """After every interval's snapshot."""

    def target_failed(self, pid: int, comm: str, why: str) -> None:
        """A target was dropped because recording it failed (`why`: one line)."""
