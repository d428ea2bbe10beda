"""`allocsampler record`: sample allocations of processes (or a command) into a Parquet dataset."""

from __future__ import annotations

import argparse
import os
import sys

from sampler.cli.args import count, positive, size
from sampler.errors import UsageError

HELP = "record running processes or a command"


def prepare_parser(r: argparse.ArgumentParser) -> None:
    r.description = ("Sample allocations of processes into a Parquet dataset. "
                     "Targets: --pid (repeatable) and/or a command after --.")
    r.add_argument("--pid", "-p", type=int, action="append", default=[], help="process to record")
    r.add_argument("--out", "-o", default="allocsampler-out", help="dataset directory (default: %(default)s)")
    r.add_argument("--duration", "-d", type=positive, help="seconds to record (default: until the "
                   "targets exit or SIGINT/SIGTERM)")
    r.add_argument("--interval", "-i", type=positive, default=None, help="snapshot interval in seconds "
                   "(default: adaptive, 1 s at the start growing to 10 s, at least 8 snapshots in any "
                   "recording of 10 s or more)")
    r.add_argument("--sample-bytes", type=size, default=512 << 10, metavar="SIZE",
                   help="mean bytes between samples (default: 512K)")
    r.add_argument("--children", action="store_true", help="also record child processes")
    r.add_argument("--allocator", action="append", default=[], metavar="LIB[:PREFIX]",
                   help="extra allocator library to probe, e.g. libmyalloc or libjemalloc:je_")
    r.add_argument("--syscalls-only", action="store_true",
                   help="record only mmap/munmap/brk/... (no allocator probes)")
    r.add_argument("--attach-mode", choices=("auto", "inject", "uprobe"), default="auto",
                   help="inject: place the in-process sampler into each process and redirect its allocator "
                        "calls (no restart; only sampled calls trap); uprobe: a probe on every allocator "
                        "call; auto: inject, else uprobe with the reason in the targets table (default)")
    r.add_argument("--python-objects", action="store_true",
                   help="inject tier: also sample CPython's small objects (<= 512 bytes, which never reach "
                        "malloc) with their Python stacks, source `python`; an allocation-heavy Python loop "
                        "runs ~10%% slower with it (without it, their memory shows as pymalloc arena mmaps)")
    r.add_argument("--probe-mode", choices=("auto", "session", "perf"), default="auto",
                   help="session: uprobe_multi sessions (Linux >= 6.13, return probe only for sampled "
                        "calls); perf: classic uprobes (default: auto)")
    r.add_argument("--live-max", type=int, default=262144, help="capacity of the sampled-live table")
    r.add_argument("--max-frames", type=int, default=127, help="native frames unwound per stack (<= 512)")
    r.add_argument("--stack-bytes", type=size, default=16 << 10, metavar="SIZE",
                   help="user stack copied per sample where the walk in BPF hands over to user space, "
                        "1K..24K in steps of 1K (default: 16K)")
    r.add_argument("--unwind", choices=("bpf", "user"), default="bpf",
                   help="bpf (default): walk native stacks in BPF from compact CFI tables, a few hundred "
                        "bytes per sample; user: copy the stack and unwind it in the recorder (as before)")
    r.add_argument("--no-python", dest="python", action="store_false",
                   help="do not read Python frames of CPython targets")
    r.add_argument("--interpreter-frames", action="store_true",
                   help="keep the interpreter's own frames between Python frames")
    r.add_argument("--no-gpu", dest="gpu", action="store_false",
                   help="do not trace CUDA calls or sample GPU memory through NVML")
    tier = r.add_argument_group("tiers and overhead")
    tier.add_argument("--preload", action="store_true",
                      help="start the command with the LD_PRELOAD sampling shim (preload tier: no trap "
                           "per malloc; a process that carries otel_memory USDT probes is recorded "
                           "through them anyway)")
    tier.add_argument("--rss", action="store_true",
                      help="always-on tier: attribute RSS growth to stacks from sampled page faults "
                           "and mmap/brk/madvise, without allocator uprobes")
    tier.add_argument("--cgroup", action="append", default=[], metavar="PATH",
                      help="always-on tier for every process of this cgroup (v2, e.g. "
                           "system.slice/foo.service); repeatable")
    tier.add_argument("--all", dest="all_processes", action="store_true",
                      help="always-on tier for every process of the host")
    tier.add_argument("--fault-period", type=int, default=61, metavar="N",
                      help="always-on tier: sample one page fault in N (default: %(default)s)")
    tier.add_argument("--cpu-budget", type=float, default=3.0, metavar="PCT",
                      help="attach tier: %% of one CPU per process the probes may cost; above it the "
                           "governor duty-cycles allocation probes or moves the process to the always-on "
                           "tier (default: %(default)s; 0: off)")
    tier.add_argument("--probe-cost", type=float, metavar="NS",
                      help="cost of one probe hit in ns (default: calibrated at start-up)")
    tier.add_argument("--max-samples-per-s", type=count, default=2000, metavar="N",
                      help="per process: above N samples/s its sampling mean is raised by a power of two "
                           "(estimates stay unbiased; default: %(default)s; 0: no cap)")
    tier.add_argument("--vm-events-per-s", type=count, default=2000, metavar="N",
                      help="per process (with --children, per family: the forks share their root's): unsampled "
                           "mmap/munmap/brk/madvise/mprotect events sent per second; the rest are counted, not "
                           "sent (default: %(default)s; 0: all)")
    r.add_argument("--quiet", "-q", action="store_true", help="no summary at the end")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: start and record a command")


def options(args: argparse.Namespace):
    """RecordOptions from the arguments; UsageError (one line, exit 2) before anything is loaded."""
    from sampler.probes.allocators import parse_allocator_spec
    from sampler.proc.cgroups import cgroup_id
    from sampler.record.options import RecordOptions

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not args.pid and not cmd and not args.all_processes and not args.cgroup:
        raise UsageError("nothing to record: give --pid PID, a command after --, --cgroup or --all")
    if args.preload and not cmd:
        raise UsageError("--preload starts a command with the shim: give it after -- (a running "
                         f"service needs LD_PRELOAD={_shim_hint()} in its environment and a restart)")
    if (args.all_processes or args.cgroup) and not args.rss:
        args.rss = True                 # host-wide selection is the always-on tier's
    if args.preload and args.rss:
        raise UsageError("--preload and --rss are different tiers: pick one")
    if not 1 <= args.fault_period <= 1 << 20:
        raise UsageError(f"--fault-period must be between 1 and 1048576, got {args.fault_period}")
    if not 0 <= args.cpu_budget <= 100:
        raise UsageError(f"--cpu-budget must be a percentage between 0 and 100, got {args.cpu_budget}")
    for cg in args.cgroup:
        cgroup_id(cg)                   # a bad path is an error now, not after compiling BPF
    if args.probe_cost is not None and not 1 <= args.probe_cost <= 1e6:
        raise UsageError(f"--probe-cost must be between 1 and 1000000 ns, got {args.probe_cost}")
    if not 1 <= args.max_frames <= 512:
        raise UsageError(f"--max-frames must be between 1 and 512, got {args.max_frames}")
    if args.stack_bytes % 1024 or not 1024 <= args.stack_bytes <= 24 << 10:
        raise UsageError(f"--stack-bytes must be a multiple of 1K between 1K and 24K, got {args.stack_bytes}")
    if args.sample_bytes > 1 << 36:
        raise UsageError(f"--sample-bytes must be at most 64G, got {args.sample_bytes}")
    if args.live_max < 1024:
        raise UsageError(f"--live-max must be at least 1024, got {args.live_max}")
    if os.geteuid() == 0:           # otherwise "must run as root" is the one line to say
        check_out(args.out)
    try:
        families = tuple(parse_allocator_spec(s) for s in args.allocator)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return RecordOptions(
        out=args.out, pids=args.pid, command=cmd, duration=args.duration, interval=args.interval,
        sample_mean=args.sample_bytes, children=args.children, allocators=families,
        syscalls_only=args.syscalls_only, probe_mode=args.probe_mode, attach_mode=args.attach_mode,
        python_objects=args.python_objects,
        live_max=args.live_max,
        max_frames=args.max_frames, stack_bytes=args.stack_bytes, unwind=args.unwind, python=args.python,
        interpreter_frames=args.interpreter_frames, rss=args.rss, fault_period=args.fault_period,
        cgroups=args.cgroup, all_processes=args.all_processes, preload=args.preload,
        cpu_budget=args.cpu_budget / 100, probe_cost_ns=args.probe_cost, quiet=args.quiet,
        argv=" ".join(sys.argv), gpu=args.gpu, max_samples_per_s=args.max_samples_per_s,
        vm_events_per_s=args.vm_events_per_s)


def check_out(out: str) -> None:
    """Refuse a foreign, linked or shared output directory now, not after compiling BPF."""
    from sampler import files

    files.check_ancestors(out)
    if os.path.lexists(out):
        files.check_own_dir(out, "dataset directory")


def run(args: argparse.Namespace) -> int:
    from sampler.record.recorder import Recorder

    rec = Recorder(options(args))
    code = rec.run()
    if not args.quiet:
        from analysis.report.top import print_summary
        print_summary(args.out, rec.recording_id, rec.finished)
    return code


def _shim_hint() -> str:
    try:
        from sampler.inprocess.preload import shim_path
        return str(shim_path(build=False))
    except Exception:
        return "$(allocsampler preload-path)"
