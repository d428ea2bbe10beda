"""`allocsampler diff`: compare a baseline dataset with a new one (the CI memory gate)."""

from __future__ import annotations

import argparse
import json

from sampler.cli.args import add_location
from sampler.errors import UsageError

HELP = "compare a baseline dataset with a new one (CI memory gate)"


def _budget(text: str):
    from analysis.diff import parse_budget
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prepare_parser(d: argparse.ArgumentParser) -> None:
    d.description = ("Per process name and stack: peak and final outstanding memory, peak RSS, "
                     "arena resident, GPU reserved. Exit 1 when a metric grows beyond --budget.")
    d.add_argument("baseline", help="baseline dataset: a directory or a URI (s3://BUCKET/PREFIX)")
    d.add_argument("new", help="new dataset: a directory or a URI")
    add_location(d)     # --host applies to both sides
    d.add_argument("--budget", type=_budget, help="allowed growth of each metric: a share of the baseline "
                   "(5%%) or a size (64M); without it nothing fails")
    d.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="only these metrics count against the budget: peak_rss, peak_arena_resident, "
                        "peak_outstanding, final_outstanding, gpu_reserved (default: all)")
    d.add_argument("-n", type=int, default=10, help="stacks listed per kind of change (default: %(default)s)")
    d.add_argument("--json", action="store_true", help="print one JSON object (docs/querying.md)")


def run(args: argparse.Namespace) -> int:
    from analysis.dataset import read_table
    from analysis.diff import METRICS, compare, render

    bad = sorted(set(args.metric) - set(METRICS))
    if bad:
        raise UsageError(f"unknown --metric {', '.join(bad)}: choose from {', '.join(METRICS)}")
    sides = [side(args, d) for d in (args.baseline, args.new)]
    for d, where in zip((args.baseline, args.new), sides, strict=True):
        if read_table(where, "processes", columns=["pid"]).empty:
            raise UsageError(f"no recording in {d}: give a directory written by `record --out`")
    report = compare(*sides, args.budget, tuple(args.metric) or METRICS)
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report, n=args.n))
    return 1 if report.over_budget else 0


def side(args: argparse.Namespace, location: str):
    """One side's dataset: the directory itself, or a Source of a URI or of the --host selection."""
    from analysis.source import Selection, is_uri, open_source

    if not is_uri(location) and not args.host:
        return location
    return open_source(location, Selection(hosts=tuple(args.host)), endpoint=args.endpoint)
