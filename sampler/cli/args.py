"""Argument types and the parser class the commands share: each bad value is one line and exit 2."""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from sampler.dataset.sources import GPU_SOURCES, MALLOC, MMAP, PYTHON
from sampler.errors import EXIT_USAGE, UsageError
from sampler.units import parse_size

SOURCES = (MALLOC, PYTHON, MMAP, *GPU_SOURCES)     # --source choices


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}     # the top level's: one per command

    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        print(f"allocsampler: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def size(text: str) -> int:
    n = parse_size(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512K, 2M)")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _number(text: str, kind: type, what: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def count(text: str) -> int:
    v = _number(text, int, "a whole number")
    if not 0 <= v <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be in 0..1000000: {text!r}")
    return v


def jobs(text: str) -> int:
    v = _number(text, int, "a whole number")
    if not 1 <= v <= 256:
        raise argparse.ArgumentTypeError(f"must be in 1..256: {text!r}")
    return v


def positive(text: str) -> float:
    v = _number(text, float, "a number")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


def when(text: str) -> dt.datetime:
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO time: {text!r} (e.g. 2026-11-22T10:00)") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h)") from None


DIR_HELP = "dataset: a directory (record --out, the daemon's data directory) or a URI (s3://BUCKET/PREFIX)"


def add_location(p: argparse.ArgumentParser) -> None:
    """Where the data lies beyond a local directory, and which hosts of it."""
    p.add_argument("--host", action="append", default=[], metavar="GLOB",
                   help="only these hosts (host= partition names; globs such as 'web-*'; repeatable)")
    p.add_argument("--endpoint", metavar="URL", help="S3 endpoint of an s3:// dataset, e.g. http://127.0.0.1:9000 "
                   "(default: AWS_ENDPOINT_URL, else AWS)")


def add_window(p: argparse.ArgumentParser) -> None:
    """The dataset selection of analyze and report."""
    p.add_argument("dir", help=DIR_HELP)
    p.add_argument("--pid", type=int, action="append", default=[], help="only these processes")
    p.add_argument("--comm", action="append", default=[], metavar="NAME", help="only processes of this name")
    add_location(p)
    p.add_argument("--source", action="append", default=[], choices=SOURCES, help="only these allocation sources")
    p.add_argument("--since", type=when, help="start of the window (ISO time, UTC if no zone)")
    p.add_argument("--until", type=when, help="end of the window (ISO time)")
    p.add_argument("--last", type=duration, metavar="DURATION", help="only the last DURATION of the data, e.g. 30m, 2h")


def open_location(args, *, since: dt.datetime | None = None, until: dt.datetime | None = None):
    """The Source (analysis/source.py) of args.dir with --host, --comm and the window, which
    prunes host= and date= directories before reading."""
    from analysis.source import Selection, open_source

    selection = Selection(tuple(args.host), since, until, tuple(getattr(args, "comm", ())))
    return open_source(args.dir, selection, endpoint=args.endpoint)


def dataset_location(args, source=None):
    """What the readers get: args.dir itself for a local directory read whole (as before any
    selection existed), else the Source."""
    from analysis.source import Selection, is_uri

    source = source or open_location(args, since=getattr(args, "since", None), until=getattr(args, "until", None))
    return args.dir if not is_uri(args.dir) and source.selection == Selection() else source


def load_window(args, where=None):
    """The dataset that add_window's arguments select (`where`: dataset_location(args), or one
    host's Source of it)."""
    from analysis.dataset import load, read_table
    from analysis.source import Source

    where = dataset_location(args) if where is None else where
    since = args.since
    if args.last:
        procs = read_table(where, "processes", columns=["ts", "pid"])
        if args.pid:
            procs = procs[procs["pid"].isin(args.pid)]
        if not procs.empty:     # the last DURATION of the selected processes' data
            since = procs["ts"].max().to_pydatetime() - dt.timedelta(seconds=args.last)
            if isinstance(where, Source):
                where = where.select(since=since)
    try:
        return load(where, pids=args.pid or None, sources=args.source or None, since=since, until=args.until)
    except FileNotFoundError:
        raise UsageError(f"no dataset at {args.dir}: give the directory passed to `record --out`") from None
