"""Attach policy: which probes a recorded process gets in its tier, and moving it between tiers.

- inject (the default for a dynamically linked process): the preload shim's sampling placed into
  the running process (sampler/inprocess/inject.py); its allocator calls go through the injected
  sampler, and only sampled ones reach a probe: the preload tier's events, without a restart;
- attach: uprobes on the malloc family of every allocator library it maps (sampler/probes), when
  injection is refused or impossible (a static binary, ptrace forbidden, a debugger attached) or
  --attach-mode uprobe;
- preload: a process that carries otel_memory USDT probes samples itself; its allocator uprobes
  would count those samples again, so it gets the USDT probes instead;
- rss and syscalls: no allocator probes (page faults and mmap-family syscalls only).
CUDA and PyTorch probes come with every tier (their calls are rare), and CPython targets get
their frame layout pushed to BPF. Libraries appear later (exec, dlopen): `rescan` looks again.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from concurrent import futures

from sampler.binary.reader import ElfFormatError
from sampler.bpf.abi import TargetFlag
from sampler.bpf.loader import BpfProbes
from sampler.control.governor import Governor
from sampler.gpu.cuda import GpuTracer
from sampler.inprocess import helper, inject
from sampler.probes import usdt
from sampler.probes.allocators import Family, find_allocators
from sampler.proc.maps import Mapping, open_path, pinned, read_maps
from sampler.python.targets import PythonTargets
from sampler.record.hold import PLACING, Holds
from sampler.record.placement import Placements
from sampler.record.target import ATTACH, INJECT, PRELOAD, RSS, SYSCALLS, Target
from sampler.record.vm_events import VmClassifier

EXEC_RESCAN_S = 5.0     # after an exec the new image maps its libraries over a moment
# The recording's end waits this long, in all, for slots given back and placement helpers still at
# work (the unit's TimeoutStopSec leaves room for it and the last flush).
STOP_BUDGET_S = 25.0
NO_ALLOCATOR = ("no probeable allocator (statically linked or stripped: no malloc symbol in any mapped file)")


class Attacher:
    """`note(t, event, detail)` writes a `targets` row; `warn(t, message)` one of event "warning";
    `mapped_code(t)` says the process has new code (the sampler placed beside the loop)."""

    def __init__(self, probes: BpfProbes, *, allocators: tuple[Family, ...], fault_period: int,
                 fault_all: bool, fault_cgroups: list[int], gpu: GpuTracer | None,
                 python: PythonTargets | None, governor: Governor | None,
                 note: Callable[[Target, str, str], None], warn: Callable[[Target, str], None], quiet: bool,
                 attach_mode: str = "auto", sample_mean: int = 512 << 10, max_samples_per_s: int = 2000,
                 python_objects: bool = False, mapped_code: Callable[[Target], None] = lambda t: None):
        self.probes, self.allocators, self.fault_period = probes, allocators, fault_period
        self.python_objects = python_objects
        self.attach_mode, self.sample_mean, self.max_samples_per_s = attach_mode, sample_mean, max_samples_per_s
        self.fault_all, self.fault_cgroups = fault_all, fault_cgroups    # host-wide selection (--all, --cgroup)
        self.gpu, self.python, self.governor = gpu, python, governor
        self.note, self.warn, self.quiet = note, warn, quiet
        self.mapped_code = mapped_code      # the process has new code (the sampler's): unwind tables, symbols
        self.faults_used = False            # the page-fault program ran for some target
        self._gpu_said = False
        self.placements = Placements()
        self.waiting: set[int] = set()      # targets whose placement waits for the rate (poll tries again)
        self.retries: dict[int, float] = {}  # pid -> when its refused placement is tried again (monotonic)
        self.restoring: list[futures.Future] = []   # slots given back beside the loop (release)
        self.holds = Holds(probes, self._flags, warn)

    def attach(self, t: Target) -> None:
        """Probes for a new target, then its `attach` row (once its placement is done, when it has
        one: poll). ProcessLookupError: it exited meanwhile."""
        if t.tier == RSS:
            self.enable_faults()
        self.probes.add_target(t.pid, self._flags(t), t.budget)
        if t.held:                          # a command's launcher: its exec is held, its image placed into
            t.attach_owed = True
            return
        if t.tier == ATTACH and self.attach_mode != "uprobe" and self._inject(t):
            t.attach_owed = True            # its allocator probes come with the placement's outcome
            self._detect_python(t, final=False)
            return
        self._settled(t)

    def _flags(self, t: Target) -> TargetFlag:
        return (TargetFlag.SYSCALLS | (TargetFlag.FAULTS if t.tier == RSS else 0)
                | (TargetFlag.FAMILY if t.family else 0) | (TargetFlag.HOLD if t.holds else 0))

    def adopt_fork(self, t: Target, parent: Target, fork_ns: int) -> bool:
        """A fork of `parent` that BPF registered at the fork (--children, at `fork_ns`): it
        inherits the parent's sampler (inject tier) or preloaded shim (preload tier), its slots
        and its family links with its copy of the address space, so it needs no placement, no
        link and no read of its files. A child that is gone already is still recorded: its
        samples until its exit follow this event. False when the parent has neither, or had not
        finished changing itself at the fork (a process that forks as soon as it starts, while
        its placement runs): the caller attaches the child as usual. Its `targets` entry is
        BPF's, made at the fork (not written again: a child gone meanwhile would get one back)."""
        if not parent.family:
            return False
        if parent.tier == INJECT and parent.injection is not None and parent.injection.copied_by(fork_ns):
            how = "inject"
        elif parent.tier == PRELOAD and parent.usdt and all(self.probes.has_family(i[:2]) for i in parent.usdt):
            how = "preload"
        else:
            return False
        t.tier = INJECT if how == "inject" else PRELOAD
        if self.python is not None and self.python.forked(parent.pid, t.pid, fork_ns):
            t.py_checked = True
        # the family's links cover it already; any other probe file is attached at its rescan
        t.usdt = {ident for ident in parent.usdt if self.probes.join_family(ident[:2], t.pid)}
        t.usdt_labels = [label for label in parent.usdt_labels if label.endswith("(usdt, family)")]
        if how == "preload":
            self.note(t, "tier", f"preload: otel_memory probes inherited from pid {parent.pid} (forked)")
            self.note(t, "attach", "")
            return True
        try:
            t.injection = parent.injection.forked(t.pid)
        except ProcessLookupError:
            self.note(t, "tier", f"inject: inherited from pid {parent.pid} (forked; exited before it was looked at)")
            return True
        self.note(t, "tier", f"inject: in-process sampler at {t.injection.base:#x} inherited from pid "
                             f"{parent.pid} (forked)")
        self.note(t, "attach", "")
        return True

    def _settled(self, t: Target) -> None:
        """The target's tier is decided: its allocator probes, then the `attach` row (now, or once
        its first redirection is done)."""
        if self.governor is not None and t.tier == ATTACH:
            self.governor.add(t.pid, time.monotonic())
        self._attach_gpu(t, self._attach_allocators(t))
        if not t.held:                      # held at its entry point, its interpreter has not started
            self._detect_python(t, final=not t.rescan_until)   # after an exec: until it is up
        if self.placements.busy(t.pid):
            t.attach_owed = True
        else:
            t.attach_owed = False
            self.note(t, "attach", t.attach_detail())

    def poll(self, targets: dict[int, Target], fail: Callable[[int, str, Exception], None]) -> None:
        """What follows each finished placement or redirection (on the loop), and placements that
        waited for the rate."""
        for job, result, error in self.placements.poll():
            t = targets.get(job.pid)
            if t is None or t.image != job.image:
                if isinstance(result, inject.Injection):
                    result.close()          # placed for an image (or a process) no longer recorded
                continue
            try:
                job.then(result, error)
            except ProcessLookupError:
                continue                    # it exited: its exit event ends it
            except Exception as e:  # noqa: BLE001
                fail(t.pid, "placing the sampler", e)
                continue
            if t.attach_owed and not self.placements.busy(t.pid) and (t.injection or t.inject_refused):
                t.attach_owed = False       # (a transient refusal is tried again first)
                self.note(t, "attach", t.attach_detail())
        now = time.monotonic()
        for pid, at in list(self.retries.items()):
            t = targets.get(pid)
            if t is None or t.inject_refused is None:
                del self.retries[pid]
            elif now >= at and not self.placements.busy(pid):
                del self.retries[pid]
                t.inject_refused = None     # its backoff is over: the refusal said when
                t.inject_retried = True     # its probes are in place already: a new refusal changes nothing
                self.waiting.add(pid)
        for pid in list(self.waiting):
            t = targets.get(pid)
            self.waiting.discard(pid)
            if t is not None and t.injection is None and t.inject_refused is None:
                try:
                    if not self._inject(t):
                        self._settled(t)
                except ProcessLookupError:
                    continue
                except Exception as e:  # noqa: BLE001
                    fail(pid, "placing the sampler", e)
        self.holds.tick(now, lambda pid: self.placements.busy(pid) or pid in self.waiting)

    @property
    def busy(self) -> bool:
        """Placements in flight or waiting for the rate, or a process held for one."""
        return bool(self.placements.jobs or self.waiting or self.holds.holding)

    def settle(self, targets: dict[int, Target], fail: Callable[[int, str, Exception], None]) -> None:
        """A recording's first targets: their placements are waited for (they are attached when the
        recording says so)."""
        end = time.monotonic() + inject.PLACE_WAIT_S + 5
        while (self.placements.jobs or self.waiting) and time.monotonic() < end:
            self.placements.wait(set(targets), max(0.0, end - time.monotonic()))
            self.poll(targets, fail)
            if self.waiting:
                time.sleep(0.05)

    def close(self) -> None:
        self.placements.close()

    def enable_faults(self) -> None:
        """The page-fault program, once, with the recording's host-wide selection (a target that
        moves to the rss tier later must not narrow it)."""
        if not self.faults_used:
            self.probes.enable_faults(self.fault_period, self.fault_all, self.fault_cgroups)
            self.faults_used = True

    def rescan(self, t: Target) -> None:
        """Look for libraries mapped since the last look (a new `attach` row when there are)."""
        if self.placements.busy(t.pid) or t.pid in self.waiting or t.held:
            return                      # what it needs comes with its placement (held: in its stop)
        if t.tier == ATTACH and self.attach_mode != "uprobe" and self._inject(t):
            return                      # after an exec: the new image is injected once it is mapped
        n = len(t.libs)
        try:
            new_gpu = self._attach_gpu(t, self._attach_allocators(t))
        except ProcessLookupError:
            return
        self._detect_python(t, final=not t.rescan_until)
        if len(t.libs) > n or new_gpu:
            self.note(t, "attach", t.attach_detail())

    def release(self, t: Target, restore: bool) -> None:
        """The process stops being recorded. `restore`: it goes on in the same image (the recording
        ended, or failed on it), and its redirected slots get their functions back; never after an
        exit, a pid reuse or an exec (the sampler went with the image, and nothing is written into
        whatever holds the pid now)."""
        self.holds.let_go(t)
        self.retries.pop(t.pid, None)
        self.waiting.discard(t.pid)
        inj, t.injection = t.injection, None
        if inj is None:
            return
        if not restore:
            inj.close()
            return
        # on a worker, never on the loop (a helper can wait seconds on the process), after a
        # redirection still running for it (it changes the same slots); the recording's end waits
        # for these within one budget (finish)
        job = self.placements.jobs.get(t.pid)
        before = job.future if job is not None else None

        def work() -> None:
            try:
                if before is not None:
                    with contextlib.suppress(Exception):
                        before.result(inject.PLACE_WAIT_S)
                with contextlib.suppress(OSError):
                    inj.restore()
            finally:
                inj.close()
        self.restoring = [f for f in self.restoring if not f.done()]
        self.restoring.append(self.placements.pool.submit(work))

    def finish(self, budget_s: float = STOP_BUDGET_S) -> tuple[int, int]:
        """The recording's end: the restores on their way and the placement helpers still alive,
        within one budget; what does not fit is left as it is (a sampler that keeps its slots
        forwards correctly, and the next recorder adopts it; a helper is never killed). Returns
        (restores not done, helpers still alive)."""
        end = time.monotonic() + budget_s
        futures.wait(self.restoring, timeout=budget_s)
        pending = sum(not f.done() for f in self.restoring)
        return pending, helper.wait_all(max(0.0, end - time.monotonic()))

    def resume_allocs(self, t: Target) -> None:
        """The governor's on phase: the allocation probes again, on the allocator files the image
        maps now (after an exec or a dlopen the paths of the last look may name mappings that are
        gone). A library that cannot be probed again is said once."""
        for lib in list(t.libs):
            try:
                self.probes.attach(t.pid, lib, allocs_only=True)
                continue
            except OSError:
                if not os.path.exists(f"/proc/{t.pid}"):
                    return                  # exiting: its exit event follows
            try:
                self._attach_allocators(t)  # this image's paths
                fresh = next((x for x in t.libs if (x.path, x.build_id) == (lib.path, lib.build_id)), None)
                if fresh is None:
                    continue                # unmapped since: nothing allocates through it
                self.probes.attach(t.pid, fresh, allocs_only=True)
            except (OSError, ProcessLookupError) as e:
                if os.path.exists(f"/proc/{t.pid}"):
                    self.warn(t, f"could not attach the allocation probes of {lib.path} again after the "
                                 f"governor's pause ({e}): its allocations are not sampled")

    def leave_attach(self, t: Target, tier: str, why: str) -> None:
        """Move a target out of the attach tier: its allocator probes go, and with them the
        sampled blocks whose frees could no longer be seen."""
        self.probes.detach_probes(t.pid)
        self.probes.forget_live(t.pid, t.table.drop_malloc())
        t.attached.clear()
        t.libs = []
        t.modes = {}
        t.duty, t.coverage = 1.0, None
        t.tier = tier
        if self.governor is not None:
            self.governor.forget(t.pid)
        if tier == RSS:
            self.probes.add_target(t.pid, self._flags(t), t.budget)
            self.enable_faults()
        self.note(t, "tier", f"{tier}: {why}")

    def exec_(self, t: Target, from_thread: bool) -> None:
        """The process exec'd: what belonged to the old image goes; probes bound to files stay."""
        pid = t.pid
        if from_thread:
            # exec from a non-leader thread: the old leader task, to which the probe links were
            # bound, is gone; attach again to the new image
            self.probes.detach_probes(pid)
            t.attached.clear()
        self.probes.forget_live(pid, t.table.live_addresses())
        self.probes.forget_mappings(pid)
        t.table.clear()
        t.image += 1                         # what was being placed for the old image is dropped
        t.inject_refused = None              # a new image: a new chance (within the backoff)
        t.inject_retried = False
        if t.tier == INJECT:                 # the sampler went with the old image: inject again
            self.probes.detach_probes(pid)
            if t.injection is not None:
                t.injection.close()
            t.injection = None
            t.usdt.clear()
            t.usdt_labels = []
            t.tier = ATTACH
        t.vm = VmClassifier()
        self.probes.detach_gpu(pid)          # the new image maps its own CUDA, if any
        if self.gpu is not None:
            self.gpu.forget(pid)
        if t.tier == PRELOAD:                # the new image may not carry the probes: start over
            self.probes.detach_probes(pid)
            t.usdt.clear()
            t.usdt_labels = []
            t.attached.clear()
            t.tier = ATTACH
            if self.governor is not None:
                self.governor.add(pid, time.monotonic())
        if self.python is not None:
            self.python.forget(pid)
        t.py_checked = False
        # Attachments stay: uprobes are bound to the library file and the task, and follow it
        # into the new image. Rescan for libraries that the new image adds.
        t.rescan_until = time.monotonic() + EXEC_RESCAN_S
        self.retries.pop(pid, None)
        if t.holds:                          # a command we started, stopped at its exec by BPF
            self.holds.exec_(t)

    def entered(self, t: Target) -> None:
        """A held command stopped at its entry point: the sampler is placed in that stop (or, where
        it is not to be injected, its probes attached), then it goes on."""
        if not self.holds.entered(t):
            return
        if t.tier == ATTACH and self.attach_mode != "uprobe" and self._inject(t):
            return
        self._settled(t)

    # ------------------------------------------------------------------------------------------
    def _detect_python(self, t: Target, final: bool) -> None:
        """Start reading Python frames when the target runs CPython. Right after an exec the
        interpreter may not be initialized yet: retried quietly until `final`."""
        if self.python is None or t.py_checked:
            return
        why = self.python.add(t.pid)
        if self.python.known(t.pid) or final:
            t.py_checked = True
            if why:
                self.warn(t, why)

    def _inject(self, t: Target) -> bool:
        """Starts placing (or adopting) the injected sampler beside the loop; True when it started or
        waits for the rate (poll goes on), False when the target stays in the attach tier (the
        reason is said once)."""
        if t.injection is not None or t.inject_refused is not None:
            return False
        if self._emits_otel_memory(t):
            return False                    # samples itself already (the preload shim): never twice
        now = time.monotonic()
        why = self.placements.when(t.pid, now)
        if why is not None:
            self._refused(t, why)
            if (at := self.placements.next_try(t.pid)) is not None:
                self.retries[t.pid] = at
            return False
        pid, image, inherits = t.pid, t.image, t.inherits if t.image == 0 else None
        held = t.held == PLACING

        def work() -> inject.Injection:
            return inject.inject(pid, self.sample_mean, self.max_samples_per_s, self.python_objects, inherits, held)
        # adopting a fork's sampler stops no thread: not held to the placements' rate
        if not self.placements.submit(pid, image, work, lambda inj, e: self._placed(t, inj, e),
                                      limited=inherits is None):
            self.waiting.add(pid)
        return True

    def _placed(self, t: Target, inj: inject.Injection | None, e: BaseException | None) -> None:
        """On the loop: the placement's outcome. The target moves to the inject tier, or stays in the
        attach tier with the reason (said once), and gets its allocator probes."""
        if e is not None:
            if isinstance(e, ProcessLookupError) or not os.path.exists(f"/proc/{t.pid}"):
                raise ProcessLookupError(t.pid)
            if not isinstance(e, (inject.Refused, OSError, ElfFormatError)):
                raise e
            if isinstance(e, inject.Refused) and e.transient and t.rescan_until:
                return                      # an exec's image still being mapped: again at the next rescan
            self.placements.failed(t.pid, time.monotonic())
            self._refused(t, f"{str(e) or type(e).__name__}; {self._next_try(t)}")
            if not t.inject_retried:
                self._settled(t)
            return
        inj.held = t.held == PLACING        # let go meanwhile: its later writes need no stop of ours
        t.injection = inj
        # its mappings, made beside the loop, may have been read as the process's own before now
        t.table.unmap(inj.base, inj.layout.total_span)
        self.mapped_code(t)
        how = (f"inherited from pid {t.parent} (forked)" if inj.inherited
               else "adopted from an earlier recording" if inj.adopted
               else f"placed (one thread stopped {inj.stop_ns / 1000:.0f} us)")
        why = f"in-process sampler at {inj.base:#x} {how}"
        if t.attached:                      # uprobes of the image before an exec: the sampler replaces them
            self.leave_attach(t, INJECT, why)
        else:
            t.tier = INJECT
            self.note(t, "tier", f"inject: {why}")
        self._settled(t)

    def _next_try(self, t: Target) -> str:
        """When a refused placement is tried again (scheduled here), in words."""
        now = time.monotonic()
        at = self.placements.next_try(t.pid)
        if at is None:
            return "not tried again"
        self.retries[t.pid] = at
        return f"next try in {max(0.0, at - now):.0f} s"

    def _refused(self, t: Target, why: str) -> None:
        t.inject_refused = why
        if self.attach_mode == "inject":
            t.tier = SYSCALLS
            self.warn(t, f"the sampler could not be injected ({why}); --attach-mode inject: "
                         "no allocator probes, only mmap/brk are recorded")
        else:
            self.note(t, "tier", f"attach: uprobes on the allocator, the sampler could not be injected ({why})")

    def _redirect(self, t: Target) -> None:
        """Redirects the slots of objects loaded since (a job beside the loop; its notes when done).
        A failed one counts in the process's placement backoff: no new one before its next try."""
        inj = t.injection
        if self.placements.when(t.pid, time.monotonic()) is not None:
            return

        def done(n: int | None, e: BaseException | None) -> None:
            if e is not None:
                if not os.path.exists(f"/proc/{t.pid}"):
                    raise ProcessLookupError(t.pid)
                if not isinstance(e, (OSError, ElfFormatError, ValueError, inject.Refused)):
                    raise e
                self.placements.failed(t.pid, time.monotonic())
                self.warn(t, f"could not redirect newly loaded objects ({e}); {self._next_try(t)}")
                return
            if n and t.rescan_until == 0.0 and len(inj.slots) > n:
                self.note(t, "inject", f"{n} more slots redirected (objects loaded since)")
            while inj.news:
                self.note(t, "inject", inj.news.pop(0))
        self.placements.submit(t.pid, t.image, inj.redirect, done, limited=False)

    def _emits_otel_memory(self, t: Target) -> bool:
        for m in read_maps(t.pid):
            if m.executable and m.file_backed and not m.path.startswith(inject.MEMFD_NAME) \
                    and usdt.memory_probes(open_path(t.pid, m)):
                return True
        return False

    def _attach_allocators(self, t: Target) -> list[Mapping] | None:
        """Returns the maps it read, for _attach_gpu (None: this tier reads none)."""
        pid = t.pid
        if t.tier in (RSS, SYSCALLS):
            return None
        if t.tier == INJECT:
            maps = read_maps(pid)
            self._attach_usdt(t, maps)
            if t.usdt:
                self._redirect(t)           # only once its probe sites are watched
            return maps
        libs, maps = find_allocators(pid, self.allocators)
        if self._attach_usdt(t, maps) or t.tier == PRELOAD:
            return maps
        for lib in libs:
            ident = (lib.path, lib.build_id)
            if ident in t.attached:
                if t.attached[ident] is not None:
                    # the probes follow the file, but its attach path names this image's mapping
                    # (map_files): the governor's next on phase attaches through it
                    t.attached[ident] = lib
                continue
            t.attached[ident] = None
            try:
                modes, failed = self.probes.attach(pid, lib)
            except OSError as e:
                if not os.path.exists(f"/proc/{pid}"):
                    raise ProcessLookupError(pid) from None
                modes, failed = {}, {p.name: str(e) for p in lib.points}
            t.modes.update(modes)
            for why in dict.fromkeys(failed.values()):
                names = ", ".join(n for n, w in failed.items() if w == why)
                t.failures.append(f"could not probe {names} in {lib.path}: {why}")
                self.warn(t, t.failures[-1])
            if modes:
                t.attached[ident] = lib
        t.libs = [a for lib in libs if (a := t.attached.get((lib.path, lib.build_id)))]
        if not libs and not t.libs and not t.rescan_until and not t.warned:
            t.warned = True
            self.warn(t, f"{NO_ALLOCATOR}; only mmap/brk are recorded. Name the allocator library "
                         "with --allocator LIB[:PREFIX].")
        return maps

    def _attach_gpu(self, t: Target, maps: list[Mapping] | None) -> bool:
        """CUDA runtime/driver probes and PyTorch's USDT probes, in every tier (CUDA calls are
        rare). `maps`: as _attach_allocators read them, None to read them here. Returns whether new
        ones were attached. ProcessLookupError: the process is gone."""
        if self.gpu is None:
            return False
        if t.tier in (RSS, SYSCALLS) and t.pid in self.gpu.targets and not t.rescan_until:
            return False        # host-wide tiers: rescan only when the process maps new code
        new, warnings = self.gpu.scan(t.pid, read_maps(t.pid) if maps is None else maps)
        for w in warnings:
            self.warn(t, w)
        if new and not self._gpu_said and not self.quiet and not self.gpu.nvml.ok:
            self._gpu_said = True         # the one line about the missing driver, when it matters
            print(f"allocsampler: {self.gpu.status}", file=sys.stderr)
        return new

    def _attach_usdt(self, t: Target, maps: list[Mapping]) -> bool:
        """Preload tier: a process carrying otel_memory probes samples its own allocations. Its
        allocator uprobes would count them again: they are dropped. Returns whether it has them."""
        found = []
        seen = set()
        for m in maps:
            ident = (m.dev, m.inode, m.path)
            if not m.executable or not m.path.startswith("/") or ident in seen or ident in t.usdt:
                continue
            seen.add(ident)
            if usdt.memory_probes(open_path(t.pid, m)):
                found.append((ident, m))
        if not found:
            return False
        if t.tier == ATTACH:
            self.leave_attach(t, PRELOAD, f"carries otel_memory USDT probes ({found[0][1].path}): "
                                          "recorded from its own samples, no allocator uprobes")
        for ident, m in found:
            try:
                # under --children the file's sites are its family's: one link, any pid (the
                # injected sampler's memfd, the preload shim, an application's own probes)
                family = ident[:2] if t.family else None
                with pinned(t.pid, m) as path:      # parsed from and attached through one descriptor
                    probes = usdt.memory_probes(path)
                    self.probes.attach_usdt(t.pid, path, usdt.memory_sites(probes, family is not None), family)
            except (OSError, ValueError) as e:
                if not os.path.exists(f"/proc/{t.pid}"):
                    raise ProcessLookupError(t.pid) from None
                t.failures.append(f"could not attach the otel_memory probes of {m.path}: {e}")
                self.warn(t, t.failures[-1])
                continue
            t.usdt.add(ident)
            t.usdt_labels += [f"{p.label} (usdt, {'family' if family else 'multi'})" for p in probes]
        return True
