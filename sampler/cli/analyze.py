"""`allocsampler analyze`: find persistent growth, arena bloat and GPU problems in a dataset; over
several hosts' data, each host on its own (analysis/fleet.py), findings grouped by host."""

from __future__ import annotations

import argparse
import json
from functools import partial

from sampler.cli.args import add_window, dataset_location, jobs, load_window, open_location

HELP = "find persistent growth and arena bloat in a dataset"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--json", action="store_true", help="print one JSON object (docs/findings.md)")
    a.add_argument("--interpreter-frames", action="store_true",
                   help="show CPython's own frames between two Python frames (folded by default)")
    a.add_argument("--jobs", type=jobs, metavar="N", help="hosts analysed at once, each in a process of its own, "
                   "when the data holds several (default: one per CPU, at most one per GiB of available memory)")


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
    from analysis.fleet import default_jobs, fleet_document, per_host
    from sampler.text import printable

    # what the workers need of the arguments (the rest need not pickle)
    window = argparse.Namespace(**{k: getattr(args, k) for k in ("dir", "since", "until", "last", "pid", "source")})
    visit = partial(_host_result, text=not args.json, interpreter_frames=args.interpreter_frames)
    results = []
    for host, (findings, n, text) in per_host(source, visit, partial(load_window, window),
                                              jobs=args.jobs or default_jobs()):
        if text is not None:
            print(f"== host {printable(host)}: {n} processes, {len(findings)} findings ==")
            print(text, end="\n\n", flush=True)
        results.append((host, findings, n))
    if args.json:
        print(json.dumps(fleet_document(results), indent=2))
    return 0


def _host_result(host: str, ds, findings, *, text: bool, interpreter_frames: bool):
    """(findings, processes, the text report or None) of one host: rendered where its dataset is,
    as its frames are released after this."""
    from analysis.report.text import render

    return findings, len(ds.summary()), render(ds, findings, interpreter_frames=interpreter_frames) if text else None
