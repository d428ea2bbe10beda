"""The recording checks itself against glibc's own count (recording_incomplete): allocations it did
not see are said, with how much and since when, and never blamed on the heap; a recording that saw
them says nothing."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pandas as pd
import pytest
from conftest import WORKLOADS, allocsampler_cmd, compile_c

from analysis.dataset import Dataset
from analysis.detect.coverage import detect_recording_incomplete
from analysis.detect.growth import detect_growth
from sampler.dataset.schema import FRAMES, OUTSTANDING, STACKS

MiB = 1 << 20


def _processes(used: list[float], live: list[float], se: float = 1 * MiB, tier: str = "inject") -> Dataset:
    t0 = pd.Timestamp("2026-12-01T10:00:00Z")
    n = len(used)
    p = pd.DataFrame({
        "ts": [t0 + pd.Timedelta(seconds=2 * i) for i in range(n)], "recording_id": "r", "pid": 7, "comm": "svc",
        "tier": tier, "rss": [200 * MiB + u for u in used], "memory_limit": 8 << 30,
        "heap_rss": [20 * MiB + u for u in used], "arena_rss": 0, "anon_rss": 10 * MiB, "file_rss": 5 * MiB,
        "stack_rss": MiB, "malloc_in_use_bytes": used, "heap_live_bytes": live, "arena_live_bytes": 0.0,
        "heap_arena_live_stderr_bytes": se, "malloc_outstanding_bytes": live, "python_outstanding_bytes": 0.0,
        "lost_events": 0, "dropped_samples": 0})
    def empty(table):
        return table.schema.empty_table().to_pandas()
    return Dataset(root=".", outstanding=empty(OUTSTANDING), processes=p, stacks=empty(STACKS),
                   frames=empty(FRAMES), vm_events=pd.DataFrame(), targets=pd.DataFrame(), recordings=pd.DataFrame())


def test_a_gap_between_the_allocator_and_the_samples_is_said_with_how_much_and_since_when():
    used = [10 * MiB + i * 4 * MiB for i in range(10)]          # +36 MiB in use
    live = [3 * MiB + i * 1 * MiB for i in range(10)]           # +9 MiB of it sampled
    ds = _processes(used, live)
    (f,) = detect_recording_incomplete(ds)
    d = f.details
    assert d["allocator_growth_bytes"] == 36 * MiB and d["sampled_growth_bytes"] == 9 * MiB
    assert d["unseen_bytes"] == 27 * MiB and d["coverage"] == pytest.approx(0.25)
    assert "not seen" in f.summary and "--attach-mode uprobe" in d["recommendation"]
    # what the allocator counts in use is not heap bloat: no unexplained_growth blames the heap for it
    assert not [x for x in detect_growth(ds) if x.kind == "unexplained_growth"]


def test_samples_that_follow_the_allocator_within_their_error_say_nothing():
    rng = np.random.default_rng(1)
    used = [10 * MiB + i * 4 * MiB for i in range(10)]
    live = [u - 7 * MiB + rng.normal(0, 2 * MiB) for u in used]   # allocated before the recording, plus noise
    assert detect_recording_incomplete(_processes(used, live, se=2 * MiB)) == []
    # a brief gap that closes again (chunks freed to tcache, a snapshot between two calls) is no finding
    live2 = [*live[:6], live[6] - 20 * MiB, *live[7:]]
    assert detect_recording_incomplete(_processes(used, live2, se=2 * MiB)) == []


@pytest.mark.bpf
def test_allocations_through_a_pointer_no_one_can_prove_is_malloc_are_said_to_be_missed(tmp_path, gated, record):
    """A program that looked malloc up itself (dlsym) before the recorder came: its 48 MiB through
    that pointer are not sampled at the default tier, and the recording says so, within its error of
    what the program kept; what it keeps through malloc itself raises nothing."""
    exe = compile_c(WORKLOADS / "hidden_malloc.c", tmp_path / "hidden_malloc", "-pie", "-fPIE", "-ldl")
    results = {}
    for how in ("plain", "hidden"):
        t = gated([str(exe)], ready="ready")
        rec = record("--pid", str(t.pid), "-i", "1")
        rec.wait_attached()
        rec.wait_snapshot(time.time() + 0.1)        # glibc's count read once before anything is kept
        kept = 0
        for _ in range(4):
            t.go(f"{how} 12\n")
            kept += int(t.line())
            time.sleep(1.0)
        rec.wait_snapshots(6)
        rec.wait_snapshot(time.time() + 2.5)
        code, _, err = rec.stop()
        assert code == 0, err
        r = subprocess.run(allocsampler_cmd("analyze", str(rec.out), "--json"), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        results[how] = (json.loads(r.stdout)["findings"], kept)
    plain, _ = results["plain"]
    assert not [f for f in plain if f["kind"] == "recording_incomplete"], [f["summary"] for f in plain]
    hidden, kept = results["hidden"]
    missed = [f for f in hidden if f["kind"] == "recording_incomplete"]
    assert len(missed) == 1, [f["summary"] for f in hidden]
    d = missed[0]
    assert abs(d["unseen_bytes"] - kept) <= 4 * d["sampled_growth_stderr_bytes"] + 0.1 * kept, (d, kept)
    assert not [f for f in hidden if f["kind"] == "unexplained_growth"], [f["summary"] for f in hidden]
