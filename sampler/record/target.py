"""What the recorder keeps per recorded process (plain data; the policies live in attach.py,
control.py and recorder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sampler.control import pacing
from sampler.control.pacing import Pace
from sampler.dataset.sources import ATTACH, INJECT, PRELOAD, RSS, SYSCALLS  # noqa: F401  (re-exported)
from sampler.inprocess.inject import Injection
from sampler.probes.allocators import AllocatorLib
from sampler.proc.memory import ProcessSample
from sampler.proc.process import ProcessInfo
from sampler.record.outstanding import ProcessTable
from sampler.record.vm_events import VmClassifier


@dataclass
class Target:
    info: ProcessInfo
    tier: str = ATTACH
    table: ProcessTable = field(default_factory=ProcessTable)
    # (path, build_id) -> the library as attached, None when attaching failed (not retried).
    # Attachments outlive exec: uprobes are bound to the file and the task.
    attached: dict[tuple, AllocatorLib | None] = field(default_factory=dict)
    libs: list[AllocatorLib] = field(default_factory=list)   # probed libraries mapped now
    modes: dict[str, str] = field(default_factory=dict)      # function -> session | perf
    failures: list[str] = field(default_factory=list)        # why probes could not be attached
    vm: VmClassifier = field(default_factory=VmClassifier)
    rescan_until: float = 0.0
    next_rescan: float = 0.0                                 # monotonic: not rescanned before (rate limit)
    looked: tuple[float, int, int] = (0.0, 0, 0)             # the last rescan: when, lost events and
                                                             # suppressed vm events then (drops)
    warned: bool = False                                     # "no probeable allocator" said once
    py_checked: bool = False                                 # Python detection done for this image
    drops: tuple[int, int, int, int] = (0, 0, 0, 0)          # lost events, live table full, vm
                                                             # suppressed, samples drawn (BPF counts)
    reconciled: int = 0                                      # vm suppressed at the last reconciliation
    usdt: set[tuple] = field(default_factory=set)            # files whose otel_memory probes are attached
    usdt_labels: list[str] = field(default_factory=list)
    duty: float = 1.0                                        # governor: malloc weights are divided by it
    coverage: float | None = None                            # of the last interval
    hits: int = 0                                            # probe hits at the last snapshot
    hit_rate: float = 0.0                                    # per second, last interval
    allocs_on: bool = True                                   # allocation probes attached (governor)
    injection: Injection | None = None                       # the injected sampler (inject tier)
    parent: int = 0                                          # forked from this target (--children)
    budget: int = 0                                          # whose syscall-event budget it spends
                                                             # (a family's root), 0: its own
    vm_sampled: bool = False                                 # a sampled mapping was reported (vm_live)
    family: bool = False                                     # its forks are recorded too (--children,
                                                             # a daemon rule's children = true)
    inherits: tuple[int, int] | None = None                  # (base, memfd inode) of the parent's sampler
    inject_refused: str | None = None                        # why it was not injected (said once)
    inject_retried: bool = False                             # placement tried again after a refusal (its
                                                             # probes are in place: a refusal changes nothing)
    holds: int = 0                                           # its execs still to be held (a command we
                                                             # started: the sampler before its first call)
    held: str = ""                                           # "entry": let go after its exec, to stop at its
                                                             # entry point; "placing": stopped there
    held_since: float = 0.0                                  # monotonic, when that began
    image: int = 0                                           # execs seen (a placement is for one image)
    attach_owed: bool = False                                # its `attach` row comes once placed
    sampler_mean: int | None = None                          # the in-process sampler's mean, last seen
    recorder_s: float = 0.0                                  # recorder time spent on it this interval
    exe_columns: dict | None = None                          # its image's identity (a fork inherits it)
    # this snapshot's pinned bytes per (source, stack): (estimate, variance), from the arena walk
    pinned: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    main_arena: int = 0                                      # where glibc's main arena was found last
    sample: ProcessSample | None = None                      # its last full memory sample (smaps read)
    sampled_at: float = 0.0                                  # monotonic, when
    sampled_drops: int = 0                                   # vm events suppressed then (drops[2])
    glibc_pace: Pace = field(default_factory=pacing.glibc_walk)        # when its heaps are next walked
    pymalloc_pace: Pace = field(default_factory=pacing.pymalloc_scan)  # when its pymalloc arenas are next scanned

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def forks_budget(self) -> int:
        """Whose syscall-event budget its forks spend: its family's root."""
        return self.budget or self.pid

    def probe_labels(self) -> list[str]:
        """`targets.probes`: each allocator probe with its site and mode, then the USDT ones."""
        probes = [f"{p.name}+{p.site.offset} ({'emulated' if p.site.emulated else 'stepped'}, "
                  f"{self.modes.get(p.name, 'not attached')})" for lib in self.libs for p in lib.points]
        return probes + self.usdt_labels

    def allocator_labels(self) -> list[str]:
        """`targets.allocators`: the probed libraries, or the one the injected sampler forwards to."""
        if self.injection is not None:
            return [self.injection.allocator]
        return [f"{lib.family}:{lib.path}" for lib in self.libs]

    def attach_detail(self) -> str:
        skipped = [f"{name} ({why})" for lib in self.libs for name, why in lib.skipped]
        return ("not probed: " + "; ".join(skipped)) if skipped else ""
