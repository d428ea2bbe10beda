"""The `allocsampler` command line."""

from __future__ import annotations

import argparse
import sys

from sampler import __version__
from sampler.dataset.sources import GPU_SOURCES, MALLOC, MMAP
from sampler.errors import EXIT_USAGE, AllocsamplerError

_SIZE_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SOURCES = (MALLOC, MMAP, *GPU_SOURCES)     # --source choices


def _size(text: str) -> int:
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    suffix = t[-1:] if t[-1:] in _SIZE_SUFFIX else ""
    try:
        n = int(float(t[: len(t) - len(suffix)]) * _SIZE_SUFFIX[suffix])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512K, 2M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= v <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be in 0..1000000: {text!r}")
    return v


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        print(f"allocsampler: error: {message} (see allocsampler {self.prog.split()[-1]} --help)",
              file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="allocsampler", description="eBPF memory allocation sampler writing Parquet.")
    p.add_argument("--version", action="version", version=f"allocsampler {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("record", help="record running processes or a command",
                       description="Sample allocations of processes into a Parquet dataset. "
                                   "Targets: --pid (repeatable) and/or a command after --.")
    r.add_argument("--pid", "-p", type=int, action="append", default=[], help="process to record")
    r.add_argument("--out", "-o", default="allocsampler-out", help="dataset directory (default: %(default)s)")
    r.add_argument("--duration", "-d", type=_positive, help="seconds to record (default: until the "
                   "targets exit or SIGINT/SIGTERM)")
    r.add_argument("--interval", "-i", type=_positive, default=10.0, help="snapshot interval in seconds "
                   "(default: %(default)s)")
    r.add_argument("--sample-bytes", type=_size, default=512 << 10, metavar="SIZE",
                   help="mean bytes between samples (default: 512K)")
    r.add_argument("--children", action="store_true", help="also record child processes")
    r.add_argument("--allocator", action="append", default=[], metavar="LIB[:PREFIX]",
                   help="extra allocator library to probe, e.g. libmyalloc or libjemalloc:je_")
    r.add_argument("--syscalls-only", action="store_true",
                   help="record only mmap/munmap/brk/... (no allocator probes)")
    r.add_argument("--probe-mode", choices=("auto", "session", "perf"), default="auto",
                   help="session: uprobe_multi sessions (Linux >= 6.13, return probe only for sampled "
                        "calls); perf: classic uprobes (default: auto)")
    r.add_argument("--live-max", type=int, default=262144, help="capacity of the sampled-live table")
    r.add_argument("--max-frames", type=int, default=127, help="native frames unwound per stack (<= 512)")
    r.add_argument("--stack-bytes", type=_size, default=16 << 10, metavar="SIZE",
                   help="user stack copied per sample for unwinding, 1K..24K in steps of 1K (default: 16K)")
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
    tier.add_argument("--max-samples-per-s", type=_count, default=2000, metavar="N",
                      help="per process: above N samples/s its sampling mean is raised by a power of two "
                           "(estimates stay unbiased; default: %(default)s; 0: no cap)")
    tier.add_argument("--vm-events-per-s", type=_count, default=2000, metavar="N",
                      help="per process: unsampled mmap/munmap/brk/madvise/mprotect events sent per second; "
                           "the rest are counted, not sent (default: %(default)s; 0: all)")
    r.add_argument("--quiet", "-q", action="store_true", help="no summary at the end")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: start and record a command")

    t = sub.add_parser("top", help="top stacks by outstanding bytes in a dataset")
    t.add_argument("dir", help="dataset directory (record --out)")
    t.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    t.add_argument("-n", type=int, default=10, help="stacks per process (default: %(default)s)")

    for name, text in (("analyze", "find persistent growth and arena bloat in a dataset"),
                       ("report", "a report of the findings (terminal, or one HTML file)")):
        a = sub.add_parser(name, help=text, description=text)
        a.add_argument("dir", help="dataset directory (record --out, or the daemon's data directory)")
        a.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
        a.add_argument("--source", action="append", default=[], choices=_SOURCES,
                       help="only these allocation sources")
        a.add_argument("--since", type=_when, help="start of the window (ISO time, UTC if no zone)")
        a.add_argument("--until", type=_when, help="end of the window (ISO time)")
        a.add_argument("--last", type=_duration, metavar="DURATION",
                       help="only the last DURATION of the data, e.g. 30m, 2h")
        if name == "analyze":
            a.add_argument("--json", action="store_true", help="print one JSON object (docs/findings.md)")
        else:
            a.add_argument("--html", metavar="FILE", help="write a self-contained HTML report to FILE")

    e = sub.add_parser("export", help="write a pprof profile or collapsed stacks of a dataset",
                       description="Export outstanding (inuse_*) and allocated (alloc_*) bytes and objects "
                                   "per stack: a gzipped pprof Profile and/or collapsed stacks.")
    e.add_argument("dir", help="dataset directory (record --out)")
    e.add_argument("--pprof", metavar="OUT.pb.gz", help="write a gzipped pprof profile")
    e.add_argument("--collapsed", metavar="OUT.txt", help="write collapsed stacks ('-': standard output)")
    e.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    e.add_argument("--source", choices=_SOURCES, default="malloc",
                   help="allocation source (they overlap, so one at a time; default: %(default)s)")
    when = e.add_mutually_exclusive_group()
    when.add_argument("--at", type=_when, metavar="TIME", help="inuse at TIME, alloc up to TIME (default: "
                      "the end of the data)")
    when.add_argument("--window", type=_when, nargs=2, metavar=("START", "END"),
                      help="alloc over the snapshot intervals ending in (START, END], inuse at END")
    e.add_argument("--value", choices=("inuse_space", "inuse_objects", "alloc_space", "alloc_objects"),
                   help="what --collapsed counts (default: inuse_space, alloc_space with --window)")

    d = sub.add_parser("diff", help="compare a baseline dataset with a new one (CI memory gate)",
                       description="Per process name and stack: peak and final outstanding memory, peak RSS, "
                                   "arena resident, GPU reserved. Exit 1 when a metric grows beyond --budget.")
    d.add_argument("baseline", help="baseline dataset directory")
    d.add_argument("new", help="new dataset directory")
    d.add_argument("--budget", type=_budget, help="allowed growth of each metric: a share of the baseline "
                   "(5%%) or a size (64M); without it nothing fails")
    d.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="only these metrics count against the budget: peak_rss, peak_arena_resident, "
                        "peak_outstanding, final_outstanding, gpu_reserved (default: all)")
    d.add_argument("-n", type=int, default=10, help="stacks listed per kind of change (default: %(default)s)")
    d.add_argument("--json", action="store_true", help="print one JSON object (docs/querying.md)")

    sub.add_parser("check", help="check that this machine can record (root, BPF, headers, tracefs)")
    dm = sub.add_parser("daemon", help="record the processes a configuration selects, as a service",
                        description="Run as a service (packaging/README.md): discovery, retention, analysis, "
                                    "metrics. Exit 2: bad configuration (one line names the key).")
    dm.add_argument("--config", "-c", default="/etc/allocsampler/config.toml", help="default: %(default)s")
    st = sub.add_parser("status", help="what the daemon is doing: targets, tiers, events, disk, findings")
    st.add_argument("--config", "-c", default="/etc/allocsampler/config.toml", help="the daemon's "
                    "configuration, for its data_dir (default: %(default)s)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    sub.add_parser("preload-path", help="build (if needed) and print the LD_PRELOAD sampling shim's path")
    it = sub.add_parser("import-torch", help="import a PyTorch CUDA memory snapshot into a dataset",
                        description="Write a torch.cuda.memory._snapshot() pickle into a dataset: segments as "
                                    "sources cuda/cuda-driver, live tensors as source torch, replayed over time "
                                    "when the snapshot has a trace. Then analyze, report, top, diff read it.")
    it.add_argument("snapshot", help="the pickle (pickle.dump(torch.cuda.memory._snapshot(), f))")
    it.add_argument("--out", "-o", required=True, help="dataset directory (a new recording in it)")
    it.add_argument("--pid", type=int, default=0, help="process id to file it under (default: %(default)s)")
    it.add_argument("--comm", default="torch", help="process name to file it under (default: %(default)s)")
    return p


def _budget(text: str):
    from analysis.diff import parse_budget
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _when(text: str):
    import datetime as dt
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO time: {text!r} (e.g. 2026-11-22T10:00)") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h)") from None


def _dataset(args):
    import datetime as dt

    from analysis.dataset import load, read_table
    from sampler.errors import UsageError

    since = args.since
    if args.last:
        procs = read_table(args.dir, "processes", columns=["ts", "pid"])
        if args.pid:
            procs = procs[procs["pid"].isin(args.pid)]
        if not procs.empty:     # the last DURATION of the selected processes' data
            since = procs["ts"].max().to_pydatetime() - dt.timedelta(seconds=args.last)
    try:
        return load(args.dir, pids=args.pid or None, sources=args.source or None, since=since, until=args.until)
    except FileNotFoundError:
        raise UsageError(f"no dataset at {args.dir}: give the directory passed to `record --out`") from None


def _analyze(args) -> int:
    import json

    from analysis import analyze

    ds = _dataset(args)
    findings = analyze.run(ds)
    if args.json:
        print(json.dumps(analyze.to_document(findings), indent=2))
    else:
        from analysis.report.text import render
        print(render(ds, findings))
    return 0


def _report(args) -> int:
    from analysis import analyze
    from analysis.report.text import render

    ds = _dataset(args)
    findings = analyze.run(ds)
    if args.html:
        from pathlib import Path

        from analysis.report.html import render_html
        Path(args.html).write_text(render_html(ds, findings))
        print(f"report written to {args.html}")
    else:
        print(render(ds, findings))
    return 0


def _record(args) -> int:
    from sampler.errors import UsageError
    from sampler.probes.allocators import parse_allocator_spec
    from sampler.record.recorder import Recorder, RecordOptions, cgroup_id

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
    try:
        families = tuple(parse_allocator_spec(s) for s in args.allocator)
    except ValueError as e:
        raise UsageError(str(e)) from None
    opts = RecordOptions(
        out=args.out, pids=args.pid, command=cmd, duration=args.duration, interval=args.interval,
        sample_mean=args.sample_bytes, children=args.children, allocators=families,
        syscalls_only=args.syscalls_only, probe_mode=args.probe_mode, live_max=args.live_max,
        max_frames=args.max_frames, stack_bytes=args.stack_bytes, python=args.python,
        interpreter_frames=args.interpreter_frames, rss=args.rss, fault_period=args.fault_period,
        cgroups=args.cgroup, all_processes=args.all_processes, preload=args.preload,
        cpu_budget=args.cpu_budget / 100, probe_cost_ns=args.probe_cost, quiet=args.quiet,
        argv=" ".join(sys.argv), gpu=args.gpu, max_samples_per_s=args.max_samples_per_s,
        vm_events_per_s=args.vm_events_per_s)
    rec = Recorder(opts)
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


def _preload_path(args) -> int:
    from sampler.inprocess.preload import shim_path

    print(shim_path())
    return 0


def _top(args) -> int:
    from analysis.report.top import print_top
    print_top(args.dir, pids=args.pid, n=args.n)
    return 0


def _export(args) -> int:
    from pathlib import Path

    from analysis.export.collapsed import collapsed_lines
    from analysis.export.pprof import Window, profile_values, write_pprof
    from analysis.frames import read_stack_frames
    from analysis.units import fmt_bytes
    from sampler.errors import UsageError

    if not args.pprof and not args.collapsed:
        raise UsageError("nothing to write: give --pprof OUT.pb.gz and/or --collapsed OUT.txt")
    if not Path(args.dir).is_dir():
        raise UsageError(f"no dataset at {args.dir}: give the directory passed to `record --out`")
    start, end = args.window if args.window else (None, args.at)
    if start is not None and start >= end:
        raise UsageError("--window START END: START must be before END")
    window = Window(start, end)
    values = profile_values(args.dir, window=window, source=args.source, pids=args.pid or None)
    frames = read_stack_frames(args.dir)
    log = sys.stderr if args.collapsed == "-" else sys.stdout
    try:
        if args.pprof:
            write_pprof(args.dir, values, args.pprof, source=args.source, window=window, frames=frames)
            print(f"pprof profile written to {args.pprof}: {len(values)} samples of "
                  f"{values.groupby(['recording_id', 'pid']).ngroups} processes, inuse_space "
                  f"{fmt_bytes(values['inuse_space'].sum())}, alloc_space {fmt_bytes(values['alloc_space'].sum())} "
                  f"(source {args.source})", file=log)
        if args.collapsed:
            value = args.value or ("alloc_space" if args.window else "inuse_space")
            text = "".join(line + "\n" for line in collapsed_lines(values, frames, value))
            if args.collapsed == "-":
                sys.stdout.write(text)
            else:
                Path(args.collapsed).write_text(text)
                print(f"collapsed stacks ({value}) written to {args.collapsed}", file=log)
    except OSError as e:
        raise UsageError(f"cannot write {e.filename}: {e.strerror}") from None
    return 0


def _diff(args) -> int:
    import json

    from analysis.dataset import read_table
    from analysis.diff import METRICS, compare, render
    from sampler.errors import UsageError

    bad = sorted(set(args.metric) - set(METRICS))
    if bad:
        raise UsageError(f"unknown --metric {', '.join(bad)}: choose from {', '.join(METRICS)}")
    for d in (args.baseline, args.new):
        if read_table(d, "processes", columns=["pid"]).empty:
            raise UsageError(f"no recording in {d}: give a directory written by `record --out`")
    report = compare(args.baseline, args.new, args.budget, tuple(args.metric) or METRICS)
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report, n=args.n))
    return 1 if report.over_budget else 0


def _daemon(args) -> int:
    from sampler.service.daemon import run
    return run(args.config)


def _status(args) -> int:
    from sampler.service.status import main as status
    return status(args.config, args.json)


def _import_torch(args) -> int:
    from analysis.units import fmt_bytes
    from sampler.dataset.torch_import import import_snapshot
    s = import_snapshot(args.snapshot, args.out, pid=args.pid, comm=args.comm)
    print(f"imported {args.snapshot} into {args.out} as recording {s.recording_id}: {s.points} point(s), "
          f"{s.stacks} stacks, reserved {fmt_bytes(s.reserved_bytes)}, allocated {fmt_bytes(s.allocated_bytes)}")
    return 0


def _check(_args) -> int:
    from sampler.bpf import preflight
    preflight.check_all()
    print("allocsampler: this machine can record (root, BPF, bcc, kernel headers, tracefs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"record": _record, "top": _top, "check": _check, "analyze": _analyze, "report": _report,
                    "export": _export, "diff": _diff, "preload-path": _preload_path,
                    "import-torch": _import_torch, "daemon": _daemon,
                    "status": _status}
        return commands[args.command](args)
    except AllocsamplerError as e:
        print(f"allocsampler: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
