"""`allocsampler analyze`: find persistent growth, arena bloat and GPU problems in a dataset."""

from __future__ import annotations

import argparse
import json

from sampler.cli.args import add_window, load_window

HELP = "find persistent growth and arena bloat in a dataset"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--json", action="store_true", help="print one JSON object (docs/findings.md)")


def analyzed(args: argparse.Namespace):
    """(dataset, findings) of the window the arguments select (analyze and report)."""
    from analysis import analyze

    ds = load_window(args)
    return ds, analyze.run(ds)


def run(args: argparse.Namespace) -> int:
    from analysis import analyze
    from analysis.report.text import render

    ds, findings = analyzed(args)
    print(json.dumps(analyze.to_document(findings), indent=2) if args.json else render(ds, findings))
    return 0
