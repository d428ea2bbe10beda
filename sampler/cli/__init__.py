"""The `allocsampler` command line: one module per command (prepare_parser + run), as memray does."""

from __future__ import annotations

import os
import sys

from sampler import __version__, environ
from sampler.cli import analyze, check, daemon, diff, export, import_torch, preload_path, record, report, status, top
from sampler.cli.args import Parser
from sampler.errors import AllocsamplerError
from sampler.shutdown import release_s3

COMMANDS = {"record": record, "top": top, "analyze": analyze, "report": report, "export": export, "diff": diff,
            "check": check, "daemon": daemon, "status": status, "preload-path": preload_path,
            "import-torch": import_torch}


def build_parser() -> Parser:
    p = Parser(prog="allocsampler", description="eBPF memory allocation sampler writing Parquet.")
    p.add_argument("--version", action="version", version=f"allocsampler {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, mod in COMMANDS.items():
        p.commands[name] = sub.add_parser(name, help=mod.HELP)
        mod.prepare_parser(p.commands[name])
    return p


def parse(argv: list[str] | None = None):
    """The arguments; a bad one gets one line that names the command's own --help."""
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        p.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    environ.one_blas_thread()   # before any command loads numpy
    try:
        return COMMANDS[args.command].run(args)
    except AllocsamplerError as e:
        print(f"allocsampler: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:         # `allocsampler diff A B | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def entry() -> int:
    """The `allocsampler` command and `python -m sampler.cli`: main, then what a process does
    before it exits (not main's: a test calls main in its own process, and goes on)."""
    try:
        return main()
    finally:
        release_s3()

