"""`allocsampler report`: the findings as a terminal report or one self-contained HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path

from sampler.cli.analyze import analyzed
from sampler.cli.args import add_window

HELP = "a report of the findings (terminal, or one HTML file)"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--html", metavar="FILE", help="write a self-contained HTML report to FILE")


def run(args: argparse.Namespace) -> int:
    ds, findings = analyzed(args)
    if args.html:
        from analysis.report.html import render_html

        Path(args.html).write_text(render_html(ds, findings))
        print(f"report written to {args.html}")
    else:
        from analysis.report.text import render

        print(render(ds, findings))
    return 0
