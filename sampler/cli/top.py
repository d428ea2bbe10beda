"""`allocsampler top`: top stacks by outstanding bytes in a dataset (per host when it holds several)."""

from __future__ import annotations

import argparse

from sampler.cli.args import DIR_HELP, add_location, dataset_location, open_location, when

HELP = "top stacks by outstanding bytes in a dataset"


def prepare_parser(t: argparse.ArgumentParser) -> None:
    t.add_argument("dir", help=DIR_HELP)
    t.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    t.add_argument("--comm", action="append", default=[], metavar="NAME", help="only processes of this name")
    t.add_argument("--since", type=when, help="only data from this time (ISO time, UTC if no zone)")
    t.add_argument("--until", type=when, help="the stacks as of this time (ISO time): each process's last "
                   "snapshot up to it")
    add_location(t)
    t.add_argument("-n", type=int, default=10, help="stacks per process (default: %(default)s)")
    t.add_argument("--pinned", action="store_true", help="by the free glibc heap pages each stack's live chunks "
                   "keep resident (malloc_trim cannot return them) instead of by outstanding bytes")


def run(args: argparse.Namespace) -> int:
    from analysis.report.top import print_top
    from sampler.text import printable

    source = open_location(args, since=args.since, until=args.until)
    hosts = source.hosts()
    if len(hosts) <= 1:
        print_top(dataset_location(args, source), pids=args.pid, n=args.n, pinned=args.pinned)
        return 0
    for host in hosts:      # pids and process names are per host
        print(f"== host {printable(host)} ==")
        print_top(source.select(hosts=(host,)), pids=args.pid, n=args.n, pinned=args.pinned)
    return 0
