"""`allocsampler status`: what the daemon is doing."""

from __future__ import annotations

import argparse

HELP = "what the daemon is doing: targets, tiers, events, disk, findings"


def prepare_parser(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", "-c", default="/etc/allocsampler/config.toml", help="the daemon's "
                   "configuration, for its data_dir (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    from sampler.service.status import main

    return main(args.config, args.json)
