"""`allocsampler analyze`: find persistent growth, arena bloat and GPU problems in a dataset; over
several hosts' data, each host on its own (analysis/fleet.py), findings grouped by host."""

from __future__ import annotations

import argparse
import json

from sampler.cli.args import add_window, dataset_location, load_window, open_location

HELP = "find persistent growth and arena bloat in a dataset"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--json", action="store_true", help="print one JSON object (docs/findings.md)")
    a.add_argument("--interpreter-frames", action="store_true",
                   help="show CPython's own frames between two Python frames (folded by default)")


def analyzed(args: argparse.Namespace, source=None):
    """(dataset, findings) of the window the arguments select (analyze and report)."""
    from analysis import analyze

    ds = load_window(args, dataset_location(args, source))
    return ds, analyze.run(ds)


def run(args: argparse.Namespace) -> int:
    from analysis import analyze
    from analysis.report.text import render

    source = open_location(args, since=args.since, until=args.until)
    if len(source.hosts()) > 1:
        return run_fleet(args, source)
    ds, findings = analyzed(args, source)
    print(json.dumps(analyze.to_document(findings), indent=2) if args.json
          else render(ds, findings, interpreter_frames=args.interpreter_frames))
    return 0


def run_fleet(args: argparse.Namespace, source) -> int:
    from analysis.fleet import fleet_document, per_host
    from analysis.report.text import render
    from sampler.text import printable

    def visit(host, ds, findings):
        n = len(ds.summary())
        if not args.json:       # rendered now: the host's frames are released after this
            print(f"== host {printable(host)}: {n} processes, {len(findings)} findings ==")
            print(render(ds, findings, interpreter_frames=args.interpreter_frames), end="\n\n", flush=True)
        return findings, n

    results = [(host, findings, n) for host, (findings, n) in per_host(source, visit, lambda s: load_window(args, s))]
    if args.json:
        print(json.dumps(fleet_document(results), indent=2))
    return 0
