"""Families: --children records the processes a target forked before the recording began and
those it forks during it; a fork of a process with the injected sampler inherits it (adopted, not
placed again), and every child's allocations are estimated against what the child says it kept."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from conftest import WORKLOADS, outstanding_through

from analysis.dataset import read_table

pytestmark = pytest.mark.bpf
MiB = 1 << 20



def test_children_forked_before_and_during_the_recording_are_recorded(record):
    fam = subprocess.Popen([sys.executable, str(WORKLOADS / "family.py"), "2"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        word, *early = fam.stdout.readline().split()
        assert word == "ready" and len(early) == 2
        rec = record("--pid", str(fam.pid), "--children", "-i", "1", "--sample-bytes", "128K")
        for pid in [fam.pid, *map(int, early)]:
            rec.wait_attached(pid=pid)
        fam.stdin.write("fork 2\n")
        fam.stdin.flush()
        late = [int(p) for p in fam.stdout.readline().split()[1:]]
        for pid in late:
            rec.wait_attached(pid=pid)
        fam.stdin.write("alloc 24\n")
        fam.stdin.flush()
        kept = {}
        while len(kept) < 4:
            line = fam.stdout.readline()
            assert line.startswith("kept "), line
            word, pid, n = line.split()
            kept[int(pid)] = int(n)
        rec.wait_snapshot(time.time() + 1.2)
        code, _, err = rec.stop(signal.SIGTERM)
        assert code == 0, err
    finally:
        fam.stdin.close()
        fam.wait(30)
    targets = read_table(rec.out, "targets")
    tiers = targets[targets["event"] == "tier"].groupby("pid")["detail"].last()
    assert set(kept) == {*late, *map(int, early)}
    for pid in late:              # forked from the injected parent: its sampler came with the fork
        assert f"inherited from pid {fam.pid} (forked)" in tiers[pid], tiers
    for pid in map(int, early):   # forked before any placement: placed like any process
        assert tiers[pid].startswith("inject: in-process sampler") and "inherited" not in tiers[pid], tiers
    found = {pid: outstanding_through(rec.out, pid, "child_leak") for pid in kept}
    print("\n[families] " + "; ".join(f"{pid} ({'late' if pid in late else 'early'}): kept {kept[pid]}, "
                                      f"estimated {found[pid]:.0f}" for pid in kept))
    for pid, truth in kept.items():
        assert found[pid] == pytest.approx(truth, rel=0.35), (pid, tiers[pid])
