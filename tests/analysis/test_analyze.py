"""`allocsampler analyze` on real recordings: a leak is flagged with its stack and rate, a
bounded cache next to it is not."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from conftest import allocsampler_cmd

pytestmark = pytest.mark.bpf
MiB = 1 << 20


def test_leak_flagged_and_bounded_cache_not(workload, record):
    w = workload()
    # 64 KiB mean: the rate is a slope over ~13 noisy points, and at 512 KiB its sampling error
    # alone (~15% per half-window slope) came close to the tolerance below
    rec = record("--pid", str(w.pid), "-i", "0.5", "--sample-bytes", "64K")
    rec.wait_attached()
    seconds, rate = 8, 8 * MiB
    t0 = time.monotonic()
    w.start_call("service", seconds, rate, 16 * MiB, 4096)          # the cache is full after ~2 s
    rec.wait_snapshots(13)                                           # stop recording mid-leak
    elapsed = time.monotonic() - t0
    code, _, err = rec.stop()
    assert code == 0, err
    leaked = w.result()
    pace = leaked / (time.monotonic() - t0)                          # the loop's real rate
    p = subprocess.run(allocsampler_cmd("analyze", str(rec.out), "--json"), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == 1
    growth = [f for f in doc["findings"] if f["kind"] == "persistent_growth"]
    sites = [f["frames"][0]["function"] for f in growth]
    assert sites == ["leak_step"], doc
    f = growth[0]
    assert f["pid"] == w.pid and f["source"] == "malloc" and 0 < f["confidence"] <= 1
    assert f["growth_bytes_per_hour"] == pytest.approx(pace * 3600, rel=0.3)
    assert f["outstanding_bytes"] == pytest.approx(pace * elapsed, rel=0.3)
    assert f["time_to_oom_hours"] > 0 and f["summary"]
    # the terminal report names it too, and says what to do
    text = subprocess.run(allocsampler_cmd("report", str(rec.out)), capture_output=True, text=True).stdout
    assert "leak_step (libleaky.so)" in text and "next:" in text
