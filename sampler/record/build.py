"""Everything a recording runs with, built in one step before its loop exists: BPF, the stack
and symbol tables, the GPU tracer, the governor, the attacher, the overhead controls, the
VM-event bookkeeping and the snapshotter. The loop (recorder.py) hands in what only it can do:
interning a sampled event's stack."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sampler import files
from sampler.binary import debuginfod
from sampler.bpf.events import Event
from sampler.bpf.loader import BpfProbes, ProbeConfig
from sampler.control import probe_cost, weights
from sampler.control.governor import Governor
from sampler.control.sample_rate import SampleRate
from sampler.dataset.writer import leave_pandas_unloaded, use_system_allocator
from sampler.gpu.cuda import GpuTracer
from sampler.inprocess import inject, preload
from sampler.probes import usdt
from sampler.proc.cgroups import cgroup_id
from sampler.python.targets import PythonTargets
from sampler.record.attach import Attacher
from sampler.record.mappings import Mappings
from sampler.record.options import RecorderHooks, RecordOptions
from sampler.record.overhead import Controls
from sampler.record.snapshot import Clock, Recording, Snapshots
from sampler.record.target import Target
from sampler.stacks.kernel_tables import KernelTables
from sampler.stacks.name_worker import NameWorker
from sampler.stacks.symbolize import Symbolizer
from sampler.stacks.table import StackTable
from sampler.stacks.table_worker import TableWorker
from sampler.stacks.unwind import Unwinder
from sampler.text import printable


@dataclass
class Parts:
    probes: BpfProbes
    symbolizer: Symbolizer
    unwinder: Unwinder
    tables: KernelTables | None          # None: native stacks unwound here (--unwind user)
    stacks: StackTable
    python: PythonTargets | None
    gpu: GpuTracer | None
    governor: Governor | None
    attacher: Attacher
    controls: Controls
    mappings: Mappings
    snapshots: Snapshots

    def close(self) -> None:
        try:
            self.attacher.close()
            if self.gpu is not None:
                self.gpu.close()
            if self.tables is not None:
                self.tables.close()
            self.symbolizer.close()
        finally:
            self.probes.close()


def build(opts: RecordOptions, hooks: RecorderHooks, recording_id: str, host: str, started: dt.datetime,
          intern: Callable[[Event], int]) -> Parts:
    """Load BPF and build every collaborator; on failure what was built is closed again."""
    o = opts
    use_system_allocator()
    leave_pandas_unloaded()
    probes = BpfProbes(ProbeConfig(o.sample_mean, live_max=o.live_max, mode=o.probe_mode,
                                   stack_bytes=o.stack_bytes, ringbuf_bytes=o.ringbuf_bytes,
                                   vm_events_per_s=o.vm_events_per_s, cache_dir=files.cache_dir("bpf"),
                                   max_frames=o.max_frames, weight_table=tuple(weights.weight_table())))
    tables: KernelTables | None = None
    gpu: GpuTracer | None = None
    try:
        symbolizer = Symbolizer(namer=NameWorker())
        debuginfod.leave_to_workers()
        python = PythonTargets(probes) if o.python else None
        unwinder = Unwinder(files.cache_dir("unwind", o.unwind_cache))
        if o.unwind == "bpf":
            tables = KernelTables(probes, TableWorker(files.cache_dir("unwind", o.unwind_cache)))
        stacks = StackTable(symbolizer, unwinder, python, o.max_frames, interpreter_frames=o.interpreter_frames)
        if o.gpu:
            from sampler.gpu.nvml import Nvml
            gpu = GpuTracer(probes, Nvml(), o.vm_events_per_interval)
        governor, cost_ns = _governor(o, probes)

        # the snapshotter writes `targets` rows for those built before it: bound late, called later
        def note(t: Target, event: str, detail: str) -> None:
            snapshots.target_row(t, event, detail)

        def warn(t: Target, msg: str) -> None:
            note(t, "warning", msg)
            if not o.quiet:
                print(f"allocsampler: warning: pid {t.pid} ({printable(t.info.comm)}): {printable(msg)}",
                      file=sys.stderr)

        def mapped_code(t: Target, now: bool = False) -> None:
            """`t` mapped code: symbols and unwind tables read again (`now`: at once, for code its
            walks need from the start: the injected sampler)."""
            symbolizer.mapped_code(t.pid)
            if tables is not None:
                if now:
                    tables.refresh(t.pid)
                else:
                    tables.changed(t.pid)

        attacher = Attacher(probes, allocators=o.allocators, fault_period=o.fault_period,
                            fault_all=o.all_processes, fault_cgroups=[cgroup_id(c) for c in o.cgroups],
                            gpu=gpu, python=python, governor=governor, note=note, warn=warn, quiet=o.quiet,
                            attach_mode=o.attach_mode, sample_mean=o.sample_mean,
                            max_samples_per_s=o.max_samples_per_s, python_objects=o.python_objects,
                            mapped_code=lambda t: mapped_code(t, now=True))
        controls = Controls(probes, governor, SampleRate(o.max_samples_per_s), o.sample_mean, attacher, note)
        if o.rss or o.all_processes or o.cgroups:
            attacher.enable_faults()
        elif o.attach_mode != "uprobe" and not o.syscalls_only:
            probes.load_usdt()
            # the injected sampler's and the shim's argument layouts: no file's probes crowd them out
            own = (inject.built()[0], preload.shim_path())
            probes.reserve_usdt([s.spec for path in own for s in usdt.memory_sites(usdt.memory_probes(str(path)))])
        clock = Clock()
        mappings = Mappings(o.vm_events_per_interval, intern, lambda: stacks.last_pcs, mapped_code, clock.wall)
        recording = Recording(recording_id, host, started, "session" if probes.session else "perf",
                              o.cpu_budget if governor is not None else 0.0, cost_ns)
        snapshots = Snapshots(o, recording, hooks.writer(o.out, recording_id, host), clock,
                              probes=probes, stacks=stacks,
                              unwinder=unwinder, tables=tables, python=python, gpu=gpu, governor=governor,
                              controls=controls, mappings=mappings, faults_used=lambda: attacher.faults_used)
        return Parts(probes, symbolizer, unwinder, tables, stacks, python, gpu, governor, attacher, controls,
                     mappings, snapshots)
    except BaseException:
        if gpu is not None:
            gpu.close()
        if tables is not None:
            tables.close()
        probes.close()
        raise


def _governor(o: RecordOptions, probes: BpfProbes) -> tuple[Governor | None, float | None]:
    """The attach tier's governor, its probe cost calibrated here unless given (None: no budget)."""
    if o.cpu_budget <= 0 or o.rss or o.syscalls_only:
        return None, None
    cost_ns, link_ns, how = ((o.probe_cost_ns, probe_cost.DEFAULT_LINK_NS, "given") if o.probe_cost_ns
                             else probe_cost.calibrate(probes, files.cache_dir("", o.unwind_cache)))
    if not o.quiet:
        print(f"allocsampler: probe cost {cost_ns / 1000:.2f} us per hit, +{link_ns / 1000:.2f} us "
              f"per other target probed on the same library ({how}); budget "
              f"{100 * o.cpu_budget:g}% of a CPU per process", file=sys.stderr)
    return Governor(o.cpu_budget, cost_ns, link_ns=link_ns), cost_ns
