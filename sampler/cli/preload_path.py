"""`allocsampler preload-path`: build (if needed) and print the LD_PRELOAD sampling shim's path."""

from __future__ import annotations

import argparse

HELP = "build (if needed) and print the LD_PRELOAD sampling shim's path"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from sampler.inprocess.preload import shim_path

    print(shim_path())
    return 0
