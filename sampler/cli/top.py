"""`allocsampler top`: top stacks by outstanding bytes in a dataset."""

from __future__ import annotations

import argparse

HELP = "top stacks by outstanding bytes in a dataset"


def prepare_parser(t: argparse.ArgumentParser) -> None:
    t.add_argument("dir", help="dataset directory (record --out)")
    t.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    t.add_argument("-n", type=int, default=10, help="stacks per process (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from analysis.report.top import print_top

    print_top(args.dir, pids=args.pid, n=args.n)
    return 0
