"""Diagnoses a user can trust, on scenarios that report their own truth: a Python service that
leaks and exits gracefully, a 20 s recording of arena bloat, a governor tier change in the middle
of a leak, and a C key-value server on jemalloc whose keyspace grows under load and plateaus.
Estimates within +-35% of the workload's truth; no false finding on the controls. (A process
that leaks until the kernel OOM-kills it: tests/service/test_daemon.py, with the daemon's pre-OOM capture.)"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import WORKLOADS, GatedTarget, allocsampler_cmd, compile_c

from analysis.dataset import latest_outstanding, read_table

pytestmark = pytest.mark.bpf
MiB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def findings(out: Path, pid: int, *args: str) -> list[dict]:
    """`allocsampler analyze --json` of one process, run as users run it."""
    r = subprocess.run(allocsampler_cmd("analyze", str(out), "--pid", str(pid), "--json", *args),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["findings"]


def frames_text(f: dict) -> str:
    return " < ".join(f"{x['function']}" for x in f["frames"])


# -- a pure-Python leak, then a graceful exit -----------------------------------------------------

def test_python_leak_survives_a_graceful_exit(tmp_path, bpf_ready):
    """CPython's finalization frees everything at exit: the rows written then are the teardown's,
    and every reader uses the last running snapshot. The leak is found with its Python line, the
    rates of the findings add up to the process's own RSS growth, and `top` shows what it held."""
    truth_file, out = tmp_path / "truth.json", tmp_path / "rec"
    r = subprocess.run(allocsampler_cmd("record", "-q", "-o", str(out), "--cpu-budget", "0", "--",
                                        sys.executable, str(WORKLOADS / "py_exit_leak.py"), "12", "5",
                                        str(truth_file)), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    truth = json.loads(truth_file.read_text())
    pid = int(read_table(out, "processes")["pid"].iloc[0])
    procs = read_table(out, "processes")
    assert len(procs) >= 8, "the adaptive interval gives a 12 s recording enough snapshots"
    o = read_table(out, "outstanding")
    teardown, running = o[o["exiting"].fillna(False)], o[~o["exiting"].fillna(False)]
    assert len(teardown) and teardown["outstanding_bytes"].sum() < 0.5 * running.groupby("ts")[
        "outstanding_bytes"].sum().max(), "finalization freed the leak at exit"

    fs = findings(out, pid)
    leaks = [f for f in fs if f["kind"] == "persistent_growth"]
    assert leaks, fs
    assert any("record_token" in frames_text(f) for f in leaks), [f["summary"] for f in leaks]
    assert not [f for f in fs if f["kind"] == "unexplained_growth"], fs
    rate = sum(f["growth_bytes_per_hour"] for f in leaks) / 3600
    print(f"\n[exit] {len(leaks)} findings, {rate / MiB:.2f} MiB/s; "
          f"the workload's RSS grew {truth['rate_bytes_per_s'] / MiB:.2f} MiB/s")
    assert rate == pytest.approx(truth["rate_bytes_per_s"], rel=0.35), (rate, truth)
    # one finding per cause: no two findings for the same stack summary
    assert len({f["summary"] for f in leaks}) == len(leaks)

    last = latest_outstanding(out, [pid])
    held = last[last["source"].isin(["mmap", "malloc"])]["outstanding_bytes"].sum()
    assert held == pytest.approx(truth["rss_growth_bytes"], rel=0.35), (held, truth)
    top = subprocess.run(allocsampler_cmd("top", str(out)), capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "top stacks" in top.stdout and "No outstanding" not in top.stdout, top


# -- arena bloat in a 20 s recording at the default interval ----------------------------------------

def test_arena_bloat_in_a_20_second_recording(tmp_path, bpf_ready):
    """The arena-bloat reproducer (tests/workloads/arena_bloat.c) recorded for 20 s with no
    --interval: the adaptive interval gives enough snapshots, and the bloat read from the free
    lists matches the bytes the workload freed."""
    exe = compile_c(WORKLOADS / "arena_bloat.c", tmp_path / "arena_bloat", "-pthread")
    target = GatedTarget([str(exe), "page-pin"], ready="waiting", stream="stdout")
    try:
        rec = subprocess.Popen(allocsampler_cmd("record", "-q", "-o", str(tmp_path / "rec"), "--cpu-budget", "0",
                                                "--pid", str(target.pid), "--duration", "20"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_attached(tmp_path / "rec", rec)
        target.go()
        assert target.line() == "ready"
        freed = int(target.line().split()[1])
        _, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
    finally:
        target.kill()
    fs = [f for f in findings(tmp_path / "rec", target.pid) if f["kind"] == "arena_bloat"]
    assert len(fs) == 1, fs
    print(f"\n[arena] bloat {fs[0]['bloat_bytes'] / MiB:.0f} MiB ({fs[0]['bloat_basis']}, "
          f"{fs[0]['windows']} snapshots), the workload freed {freed / MiB:.0f} MiB")
    assert fs[0]["bloat_bytes"] == pytest.approx(freed, rel=0.35), (fs[0]["bloat_bytes"], freed)
    assert "record as root" not in fs[0]["recommendation"]       # the recorder is root already


# -- a governor tier change in the middle of a leak --------------------------------------------------

def test_tier_change_in_the_middle_of_a_leak(tmp_path, gated, record):
    """At 200k pairs/s the governor moves the target to the page-fault tier: from then on malloc is
    not measured (null, not its last value), no arena verdict rests on it, and the leak is one
    finding (its malloc series until the move, its page faults after) at the workload's rate."""
    exe = compile_c(WORKLOADS / "tiers.c", tmp_path / "tiers", "-O2", "-fno-builtin")
    t = gated([str(exe), "rate", "8", "200000"], ready="ready")
    rec = record("--pid", str(t.pid), "--attach-mode", "uprobe", "--cpu-budget", "3")
    rec.wait_attached()
    t0 = time.monotonic()
    t.go()
    truth = int(t.line())
    seconds = time.monotonic() - t0
    code, _, err = rec.stop()            # the leak ran to the end of the recording
    assert code == 0, err
    t.go()
    assert t.proc.wait(10) == 0
    procs = read_table(rec.out, "processes").sort_values("ts")
    rss = procs[procs["tier"].astype(str) == "rss"]
    assert len(rss) >= 3, procs["tier"].tolist()
    assert rss["malloc_outstanding_bytes"].isna().all() and rss["heap_live_bytes"].isna().all()
    fs = findings(rec.out, t.pid)
    assert not [f for f in fs if f["kind"] == "arena_bloat"], fs
    leaks = [f for f in fs if f["kind"] == "persistent_growth" and "leak_blocks" in frames_text(f)]
    assert len(leaks) == 1, [f["summary"] for f in fs]
    rate = leaks[0]["growth_bytes_per_hour"] / 3600
    print(f"\n[tier] {leaks[0]['source']} ({leaks[0]['attribution']}, also {leaks[0]['also_seen_as']}): "
          f"{rate / MiB:.1f} MiB/s, the workload's {truth / seconds / MiB:.1f} MiB/s")
    assert rate == pytest.approx(truth / seconds, rel=0.35), (rate, truth / seconds, leaks[0]["summary"])


# -- a C server on jemalloc: keyspace grows under load, then plateaus --------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv_load(port: int, seconds: float, keys_per_s: int, overwrite_of: int = 0, first_key: int = 0) -> int:
    """SETs of 512..4096-byte values, pipelined in batches: new keys (numbered from first_key), or
    overwrites of random keys below overwrite_of. Returns the next new key number."""
    rng = random.Random(1)
    with socket.create_connection(("127.0.0.1", port)) as s:
        f = s.makefile("rb")
        t0, k, sent = time.monotonic(), first_key, 0
        while (now := time.monotonic() - t0) < seconds:
            batch = min(500, int(now * keys_per_s) - sent + 1)
            lines = []
            for _ in range(batch):
                key = rng.randrange(overwrite_of) if overwrite_of else (k := k + 1)
                lines.append(f"SET key:{key} {rng.randint(512, 4096)}\n")
            s.sendall("".join(lines).encode())
            for _ in range(batch):
                assert f.readline() == b"OK\n"
            sent += batch
            time.sleep(0.01)
        return k


def _kv_requested(port: int) -> int:
    """The bytes the server asked malloc for and still holds (its STATS: its own truth)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"STATS\n")
        return int(s.makefile("rb").readline().split()[5])


def test_c_server_keyspace_grows_then_plateaus(tmp_path, bpf_ready):
    """A long-lived server on jemalloc fills its keyspace for 10 s, then overwrites keys for 10 s:
    memory plateaus. Over the whole recording: no growth finding and no OOM projection; the held
    estimate matches the server's own count (jemalloc's extents and the allocations carved from
    them are one memory). Over the window that ends 6 s into the plateau (`--until`): what grew has
    its rates adding up to no more than the server's growth, and no OOM projection rests on a
    trend that is flat at the end."""
    if not os.path.exists(JEMALLOC):
        pytest.fail(f"{JEMALLOC} missing: scripts/setup.sh installs libjemalloc2")
    exe = compile_c(WORKLOADS / "kv_server.c", tmp_path / "kv_server", "-O2")
    port = _free_port()
    server = subprocess.Popen([str(exe), str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LD_PRELOAD": JEMALLOC})
    try:
        assert server.stdout.readline().strip() == "ready"
        out = tmp_path / "rec"
        rec = subprocess.Popen(allocsampler_cmd("record", "-q", "-o", str(out), "--cpu-budget", "0",
                                                "--pid", str(server.pid)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_attached(out, rec)
        t0 = time.monotonic()
        keys = _kv_load(port, 10, 3000)
        grown, seconds = _kv_requested(port), time.monotonic() - t0
        until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=6)
        _kv_load(port, 10, 3000, overwrite_of=keys)
        used = _kv_requested(port)
        rec.send_signal(2)
        _, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
        assert server.poll() is None                       # never harmed
    finally:
        server.kill()
        server.wait()
    fs = findings(out, server.pid)
    growth = [f for f in fs if f["kind"] in ("persistent_growth", "unexplained_growth")]
    assert not growth, [f["summary"] for f in growth]
    assert not [f for f in fs if f.get("time_to_oom_hours") is not None], fs
    last = latest_outstanding(out, [server.pid])
    held = last[last["source"] == "malloc"]["outstanding_bytes"].sum()
    print(f"\n[kv] held {held / MiB:.0f} MiB (malloc), the server counts {used / MiB:.0f} MiB")
    assert held == pytest.approx(used, rel=0.35), (held, used)

    fs = findings(out, server.pid, "--until", until.isoformat())
    assert not [f for f in fs if f.get("time_to_oom_hours") is not None], [f["summary"] for f in fs]
    rates = sum(f["growth_bytes_per_hour"] for f in fs if f["kind"] == "persistent_growth") / 3600
    assert rates <= 1.35 * grown / seconds, (rates, grown / seconds, [f["summary"] for f in fs])


def _wait_attached(out: Path, rec: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rec.poll() is not None:
            raise AssertionError(f"recorder exited early: {rec.communicate()}")
        if any((out / "targets").glob("host=*/date=*/*.parquet")):
            t = read_table(out, "targets")
            if (t["event"] == "attach").any():
                return
        time.sleep(0.1)
    raise AssertionError("recorder did not attach in time")



# -- growth that pauses ------------------------------------------------------------------------------

def test_a_leak_that_pauses_is_reported_with_its_rate_and_its_pause(tmp_path, record):
    """A steady leak (2 MiB/s, the workload logs every block) whose process is stopped for the last
    4 s of the recording, as a server whose client went idle: one persistent_growth finding, `held`,
    at the rate the workload logged while it grew, saying how long it has held the memory; no OOM
    projection rests on the pause."""
    import signal

    import numpy as np
    exe = compile_c(WORKLOADS / "steady_leak.c", tmp_path / "steady_leak")
    log = tmp_path / "leaked.txt"
    with open(log, "w") as out:
        target = subprocess.Popen([str(exe)], stdout=out)
    try:
        rec = record("--pid", str(target.pid), "-i", "1", "--sample-bytes", "128K")
        rec.wait_attached()
        time.sleep(12)
        os.kill(target.pid, signal.SIGSTOP)
        paused_at = time.time()
        time.sleep(4)
        rec.wait_snapshot(time.time())
        code, _, err = rec.stop()
        assert code == 0, err
    finally:
        target.kill()
        target.wait()
    fs = [f for f in findings(rec.out, target.pid) if f["kind"] == "persistent_growth"]
    assert len(fs) == 1 and fs[0]["frames"][0]["function"] == "leak_site", fs
    f = fs[0]
    rows = np.loadtxt(log, dtype=np.int64, ndmin=2)
    t, total = rows[:, 0] / 1e9, rows[:, 1].astype(float)
    inside = t >= pd.Timestamp(f["first_seen"]).timestamp()
    truth = float(np.polyfit(t[inside], total[inside], 1)[0])
    rate, se = f["growth_bytes_per_hour"] / 3600, f["growth_stderr_bytes_per_hour"] / 3600
    print(f"\n[held] {rate / MiB:.2f} ± {se / MiB:.2f} MiB/s, the workload's {truth / MiB:.2f} MiB/s; "
          f"paused {f['paused_s']:.1f} s (stopped {time.time() - paused_at:.1f} s before the analysis)")
    assert f["pattern"] == "held" and 2.0 <= f["paused_s"] <= 6.0, f["summary"]
    assert abs(rate - truth) <= 3 * se + 0.05 * truth, (rate, se, truth)
    assert "then held all of it for the last" in f["summary"] and f["time_to_oom_hours"] is None, f["summary"]
