"""`allocsampler report`: the findings as a terminal report or one self-contained HTML file."""

from __future__ import annotations

import argparse

from sampler.cli.analyze import analyzed
from sampler.cli.args import add_window
from sampler.errors import UsageError

HELP = "a report of the findings (terminal, or one HTML file)"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--html", metavar="FILE", help="write a self-contained HTML report to FILE")
    a.add_argument("--interpreter-frames", action="store_true",
                   help="show CPython's own frames between two Python frames (folded by default)")


def run(args: argparse.Namespace) -> int:
    from sampler.cli.args import open_location

    source = open_location(args, since=args.since, until=args.until)
    hosts = source.hosts()
    if len(hosts) > 1:
        shown = ", ".join(hosts[:3]) + (", ..." if len(hosts) > 3 else "")
        raise UsageError(f"{args.dir} holds {len(hosts)} hosts ({shown}): a report is of one host, give "
                         "--host NAME (`allocsampler analyze` gives the findings of every host)")
    ds, findings = analyzed(args, source)
    if args.html:
        from analysis.report.html import render_html
        from sampler import files

        try:
            page = render_html(ds, findings, interpreter_frames=args.interpreter_frames)
            files.write_output(args.html, page.encode())
        except files.UnsafePath:
            raise
        except OSError as e:
            raise UsageError(f"cannot write {args.html}: {e.strerror or e}") from None
        print(f"report written to {args.html}")
    else:
        from analysis.report.text import render

        # escaped where it names what a target chose
        print(render(ds, findings, interpreter_frames=args.interpreter_frames))
    return 0
