"""Argument validation of the command line, in-process: each bad value is one line naming the
cause and the fix, exit 2, no traceback, and nothing is loaded before the arguments are checked.
(tests/cli/test_cli_errors.py runs the CLI in bad environments.)"""

from __future__ import annotations

import pytest

from sampler.cli import main
from sampler.cli.args import size as _size


@pytest.mark.parametrize("args,words", [
    (["record"], ["nothing to record"]),
    (["record", "--pid", "1", "--interval", "0"], ["must be positive"]),
    (["record", "--pid", "1", "--sample-bytes", "lots"], ["not a size"]),
    (["record", "--pid", "abc"], ["invalid int value"]),
    (["record", "--", "/nonexistent/program"], ["command not found"]),
    (["record", "--pid", "1", "--max-frames", "600"], ["--max-frames"]),
    (["record", "--pid", "1", "--stack-bytes", "1500"], ["--stack-bytes"]),
    (["record", "--pid", "1", "--allocator", ":je_"], ["LIBRARY[:PREFIX]"]),
    (["record", "--preload", "--pid", "1"], ["--preload", "LD_PRELOAD="]),
    (["record", "--pid", "1", "--cpu-budget", "150"], ["--cpu-budget"]),
    (["record", "--pid", "1", "--fault-period", "0"], ["--fault-period"]),
    (["record", "--cgroup", "no/such.service"], ["no such cgroup"]),
    (["record", "--preload", "--rss", "--", "true"], ["different tiers"]),
    (["frobnicate"], ["invalid choice"]),
])
def test_bad_arguments(args, words, capsys):
    try:
        code = main(args)
    except SystemExit as e:         # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("allocsampler: error:")]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


def test_sizes_on_the_command_line():
    assert [_size(s) for s in ("512K", "2M", "1g", "4096", "64KiB")] == [512 << 10, 2 << 20, 1 << 30, 4096, 64 << 10]
