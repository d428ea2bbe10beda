"""`allocsampler daemon`: record the processes a configuration selects, as a service."""

from __future__ import annotations

import argparse

HELP = "record the processes a configuration selects, as a service"


def prepare_parser(d: argparse.ArgumentParser) -> None:
    d.description = ("Run as a service (packaging/README.md): discovery, retention, analysis, "
                     "metrics. Exit 2: bad configuration (one line names the key).")
    d.add_argument("--config", "-c", default="/etc/allocsampler/config.toml", help="default: %(default)s")


def run(args: argparse.Namespace) -> int:
    from sampler.service.daemon import run as run_daemon

    return run_daemon(args.config)
