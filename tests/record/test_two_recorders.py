"""Two recorders on one process (a daemon's rule that matches a process an engineer records by
hand): the second is refused while the first records, leaves the first's sampler alone when it
stops, and a third adopts the sampler once the first has ended. (CI 2026-12-02: a daemon adopted a
running recording's sampler, restored its slots at its own stop, and the first recording saw no
allocation after that.)"""

from __future__ import annotations

import subprocess
import time

import pandas as pd
import pytest
from conftest import WORKLOADS, compile_c, end_child

from analysis.dataset import read_table

pytestmark = pytest.mark.bpf

REFUSED = "another allocsampler recording records it with its in-process sampler"


def details(out, pid: int) -> list[str]:
    if not any((out / "targets").glob("host=*/date=*/*.parquet")):
        return []
    t = read_table(out, "targets")
    return [str(d) for d in t[t["pid"] == pid]["detail"]]


def leak_site_bytes(out, pid: int) -> pd.Series:
    """leak_site's estimate per snapshot."""
    o = read_table(out, "outstanding")
    o = o[(o["pid"] == pid) & (o["source"].astype(str) == "malloc")]
    frames = read_table(out, "frames")
    sites = set(frames[(frames["function"].astype(str) == "leak_site")]["stack_id"])
    return o[o["stack_id"].isin(sites)].groupby("ts")["outstanding_bytes"].sum()


def truth_at(lines: list[tuple[int, int]], ts: pd.Timestamp) -> int:
    """Bytes the workload had leaked at `ts` (its own lines: realtime ns, bytes)."""
    ns = ts.value
    return max((b for t, b in lines if t <= ns), default=0)


def test_a_second_recorder_is_refused_and_leaves_the_first_ones_sampler_alone(record, tmp_path):
    exe = compile_c(WORKLOADS / "steady_leak.c", tmp_path / "steady_leak")
    log = tmp_path / "leak.log"
    with open(log, "w") as f:
        leak = subprocess.Popen([str(exe)], stdout=f)
    try:
        first = record("--pid", str(leak.pid), "-i", "1")
        first.wait_attached(pid=leak.pid)
        assert any(d.startswith("inject: in-process sampler at") for d in details(first.out, leak.pid))
        second = record("--pid", str(leak.pid), "-i", "1")
        deadline = time.monotonic() + 30
        while not any(REFUSED in d for d in details(second.out, leak.pid)):
            assert time.monotonic() < deadline, "the second recorder was never refused"
            time.sleep(0.2)
        time.sleep(2)
        code, _, err = second.stop()
        assert code == 0, err
        stopped = pd.Timestamp.now(tz="UTC")
        first.wait_snapshots(len(list((first.out / "recorder").glob("host=*/date=*/*.parquet"))) + 6)
        code, _, err = first.stop()
        assert code == 0, err
        # the sampler is adopted once no recording holds it
        third = record("--pid", str(leak.pid), "-i", "1")
        third.wait_attached(pid=leak.pid)
        code, _, err = third.stop()
        assert code == 0, err
    finally:
        end_child(leak)
    assert not any(d.startswith("inject:") for d in details(second.out, leak.pid)), details(second.out, leak.pid)
    assert any("adopted from an earlier recording" in d for d in details(third.out, leak.pid)), \
        details(third.out, leak.pid)

    # the first recording goes on sampling after the second stopped: leak_site's growth from then
    # on is the workload's own, within the estimate's error
    lines = [tuple(map(int, ln.split())) for ln in log.read_text().splitlines() if len(ln.split()) == 2]
    est = leak_site_bytes(first.out, leak.pid)
    after = est[est.index > stopped]
    assert len(after) >= 4, est
    a, b = after.index[0], after.index[-1]
    grown, truth = after.iloc[-1] - after.iloc[0], truth_at(lines, b) - truth_at(lines, a)
    o = read_table(first.out, "outstanding")
    se = o[(o["pid"] == leak.pid) & (o["ts"] == b)]["outstanding_stderr_bytes"].pow(2).sum() ** 0.5
    print(f"\n[two recorders] after the second stopped: leak_site grew {grown:.0f} B, the workload {truth} B "
          f"(standard error {se:.0f} B)")
    assert truth > 4 << 20
    assert abs(grown - truth) <= 4 * se + 0.05 * truth, (grown, truth, se)
