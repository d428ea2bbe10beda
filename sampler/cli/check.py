"""`allocsampler check`: can this machine record?"""

from __future__ import annotations

import argparse

HELP = "check that this machine can record (root, BPF, headers, tracefs)"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from sampler.bpf import preflight

    preflight.check_all()
    print("allocsampler: this machine can record (root, BPF, bcc, kernel headers, tracefs)")
    return 0
