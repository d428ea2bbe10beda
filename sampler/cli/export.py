"""`allocsampler export`: a pprof profile and/or collapsed stacks of a dataset."""

from __future__ import annotations

import argparse
import sys

from sampler.cli.args import DIR_HELP, SOURCES, add_location, when
from sampler.errors import UsageError

HELP = "write a pprof profile or collapsed stacks of a dataset"


def prepare_parser(e: argparse.ArgumentParser) -> None:
    e.description = ("Export outstanding (inuse_*) and allocated (alloc_*) bytes and objects "
                     "per stack: a gzipped pprof Profile and/or collapsed stacks.")
    e.add_argument("dir", help=DIR_HELP)
    e.add_argument("--pprof", metavar="OUT.pb.gz", help="write a gzipped pprof profile")
    e.add_argument("--collapsed", metavar="OUT.txt", help="write collapsed stacks ('-': standard output)")
    e.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    e.add_argument("--comm", action="append", default=[], metavar="NAME", help="only processes of this name")
    add_location(e)
    e.add_argument("--source", choices=SOURCES, default="malloc",
                   help="allocation source (they overlap, so one at a time; default: %(default)s)")
    window = e.add_mutually_exclusive_group()
    window.add_argument("--at", type=when, metavar="TIME", help="inuse at TIME, alloc up to TIME (default: "
                        "the end of the data)")
    window.add_argument("--window", type=when, nargs=2, metavar=("START", "END"),
                        help="alloc over the snapshot intervals ending in (START, END], inuse at END")
    e.add_argument("--value", choices=("inuse_space", "inuse_objects", "alloc_space", "alloc_objects", "pinned_space"),
                   help="what --collapsed counts (default: inuse_space, alloc_space with --window)")


def run(args: argparse.Namespace) -> int:
    from analysis.export.collapsed import collapsed_lines
    from analysis.export.pprof import Window, profile_values, write_pprof
    from analysis.frames import read_stack_frames
    from sampler import files
    from sampler.cli.args import dataset_location, open_location
    from sampler.units import fmt_bytes

    if not args.pprof and not args.collapsed:
        raise UsageError("nothing to write: give --pprof OUT.pb.gz and/or --collapsed OUT.txt")
    start, end = args.window if args.window else (None, args.at)
    if start is not None and start >= end:
        raise UsageError("--window START END: START must be before END")
    # inuse is each process's last state up to END, whenever it began: only END prunes days
    where = dataset_location(args, open_location(args, until=end))
    window = Window(start, end)
    values = profile_values(where, window=window, source=args.source, pids=args.pid or None)
    frames = read_stack_frames(where)
    log = sys.stderr if args.collapsed == "-" else sys.stdout
    try:
        if args.pprof:
            write_pprof(where, values, args.pprof, source=args.source, window=window, frames=frames)
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
                files.write_output(args.collapsed, text.encode())
                print(f"collapsed stacks ({value}) written to {args.collapsed}", file=log)
    except files.UnsafePath:
        raise
    except OSError as e:
        raise UsageError(f"cannot write {e.filename}: {e.strerror}") from None
    return 0
