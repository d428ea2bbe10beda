"""One target cannot take the recorder down: a failure while recording one process drops that
process alone (one `targets` row, one line) and the recording of the others goes on; a loop that
stalls is seen (systemd watchdog, health in metrics and status); what a SIGKILLed recorder leaves in
tracefs is swept at the next start."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import pytest
from conftest import WORKLOADS, GatedTarget, compile_c

from analysis.dataset import read_table
from sampler.record.options import RecorderHooks, RecordOptions
from sampler.record.recorder import Recorder

pytestmark = pytest.mark.bpf


class FailingStacks:
    """The recorder's stack table, failing for one pid as a parser would on a file that process
    supplied (fault injection at the seam every sampled event goes through)."""

    def __init__(self, inner, pid: int):
        self.inner, self.pid = inner, pid

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def intern(self, ev):
        if ev.pid == self.pid:
            raise RuntimeError("injected: a stack this process supplied broke the unwinder")
        return self.inner.intern(ev)


class InjectFault(RecorderHooks):
    def __init__(self, pid: int):
        self.pid, self.rec, self.failures = pid, None, []

    def started(self) -> None:
        self.rec.stacks = FailingStacks(self.rec.stacks, self.pid)

    def target_failed(self, pid: int, comm: str, why: str) -> None:
        self.failures.append((pid, why))


def test_a_failing_target_is_dropped_and_the_others_are_recorded(tmp_path, bpf_ready, capfd):
    exe = compile_c(WORKLOADS / "tiers.c", tmp_path / "tiers", "-O2", "-fno-builtin")
    bad, good = (GatedTarget([str(exe), "rate", "5", "20000"], ready="ready") for _ in range(2))
    try:
        hooks = InjectFault(bad.pid)
        rec = Recorder(RecordOptions(out=str(tmp_path / "rec"), pids=[bad.pid, good.pid], duration=4,
                                     cpu_budget=0, quiet=True), hooks=hooks)
        hooks.rec = rec
        bad.go()
        good.go()
        assert rec.run() == 0
        for t in (bad, good):                 # both ran to the end, unharmed
            assert int(t.line()) > 0
            t.go()
            assert t.proc.wait(10) == 0
    finally:
        bad.kill()
        good.kill()
    assert [p for p, _ in hooks.failures] == [bad.pid]
    assert "RuntimeError: injected" in hooks.failures[0][1]
    targets = read_table(tmp_path / "rec", "targets")
    failed = targets[targets["event"] == "failed"]
    assert list(failed["pid"]) == [bad.pid] and "no longer recorded" in failed["detail"].iloc[0]
    procs = read_table(tmp_path / "rec", "processes")
    assert len(procs[procs["pid"] == good.pid]) >= 4          # recorded to the end
    assert len(procs[procs["pid"] == bad.pid]) <= 1           # not after its failure
    out = read_table(tmp_path / "rec", "outstanding")
    assert (out[out["pid"] == good.pid]["alloc_samples"] > 0).any()
    assert "Traceback" not in capfd.readouterr().err


# -- a stalled loop is seen ---------------------------------------------------------------------


def test_watchdog_notifications_reach_systemd_socket(tmp_path, monkeypatch):
    """sd_notify's protocol, against a real datagram socket standing in for systemd's: READY once,
    then WATCHDOG at most every half of WATCHDOG_USEC, STOPPING at the end."""
    from sampler.service.watchdog import Watchdog

    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    w = Watchdog.from_env()
    assert w.enabled and w.interval_s == pytest.approx(0.2)
    w.ready("recording")
    assert sock.recv(256) == b"READY=1\nSTATUS=recording"
    t0 = time.monotonic()
    w.pet(t0)
    assert sock.recv(256) == b"WATCHDOG=1"
    w.pet(t0 + 0.1)                          # too soon: nothing sent
    w.pet(t0 + 0.25)
    assert sock.recv(256) == b"WATCHDOG=1"
    w.stopping()
    assert sock.recv(256) == b"STOPPING=1"
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process: silent
    assert not Watchdog.from_env().watchdog
    sock.close()


def test_stale_tracefs_events_of_a_dead_recorder_are_swept(tmp_path):
    """On kernels without the uprobe PMU a SIGKILLed recorder leaves `allocsampler_<pid>_...`
    uprobe events in tracefs: a new recorder removes those of recorders that are gone and keeps
    those of one still running."""
    from sampler.bpf.tracefs import sweep_stale_events, uprobe_events, write_command

    events = uprobe_events()
    if events is None:
        pytest.fail("tracefs uprobe_events is not writable: the recorder needs it (scripts/setup.sh)")
    target = Path("/bin/true").resolve()
    entry = int.from_bytes(target.read_bytes()[24:32], "little")    # e_entry: an instruction in .text
    dead, alive = 2 ** 22 + 7, os.getpid()          # above pid_max's default: never a live pid
    names = [f"allocsampler_{dead}_1_malloc_1000_0_1", f"allocsampler_{alive}_1_malloc_1000_0_2"]
    for name in names:
        write_command(events, f"p:uprobes/{name} {target}:{entry:#x}")
    try:
        removed = sweep_stale_events()
        text = Path(events).read_text()
        assert names[0] in removed and names[0] not in text
        assert names[1] in text
    finally:
        for name in names:
            with contextlib.suppress(OSError):
                write_command(events, f"-:uprobes/{name}")


def test_the_daemon_tells_systemd_it_is_ready_and_alive(tmp_path, bpf_ready):
    """A real daemon under a stand-in for systemd's notify socket: READY once recording starts,
    WATCHDOG pings from its loop, STOPPING on SIGTERM; its metrics say the loop is healthy, and
    would say so no more once the loop has not run for its stall time."""
    from test_daemon import DaemonProc, free_port, wait_for, write_config

    from sampler.service.metrics import MetricsState, loop_health

    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.5)
    port = free_port()
    env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000"}
    d = DaemonProc(write_config(tmp_path / "config.toml", tmp_path / "data", port), tmp_path / "data", port,
                   tmp_path / "daemon.log", env=env)
    got: list[bytes] = []

    def received(what: bytes) -> bool:
        with contextlib.suppress(TimeoutError):
            got.append(sock.recv(256))
        return any(m.startswith(what) for m in got)

    try:
        wait_for(lambda: received(b"READY=1"), 240, "READY from the daemon")
        n = sum(m == b"WATCHDOG=1" for m in got)
        wait_for(lambda: received(b"WATCHDOG=1") and sum(m == b"WATCHDOG=1" for m in got) >= n + 3, 20,
                 "watchdog pings, one per second")
        metrics = d.metrics()
        assert "allocsampler_loop_healthy 1" in metrics, metrics[-400:]
        assert d.stop() == 0
        wait_for(lambda: received(b"STOPPING=1"), 10, "STOPPING")
    finally:
        if d.alive():
            d.proc.kill()
        sock.close()
    stuck = MetricsState(stall_after_s=60)
    stuck.heartbeat(time.monotonic() - 61)
    assert b"allocsampler_loop_healthy 0" in loop_health(stuck, time.monotonic())


EMIT_C = r"""
#include <stdio.h>
#include <sys/sdt.h>
static char block[4096];
__attribute__((noinline)) void forged(void)
{
    unsigned long long p = (unsigned long long)block, n = 4096, w = 1ULL << 62;
    STAP_PROBE3(otel_memory, alloc, p, n, w);          /* a weight standing for 4 EiB */
    unsigned long long q = p + 64, huge = 1ULL << 50;
    STAP_PROBE3(otel_memory, alloc, q, huge, huge);    /* a size no address space holds */
}
__attribute__((noinline)) void released(void)         /* the contract has both probes */
{
    unsigned long long p = 0;
    STAP_PROBE1(otel_memory, free, p);
}
int main(void)
{
    char line[8];
    fprintf(stderr, "ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    forged();
    fprintf(stderr, "1\n");
    if (fgets(line, sizeof line, stdin))
        released();
    return 0;
}
"""


def test_forged_memory_contract_samples_are_bounded(tmp_path, gated, record):
    """The in-process samplers' reports are probe arguments the process chooses: a forged weight is
    capped (1 TiB a sample) and a size no address space holds is dropped, so a process can skew only
    its own estimates, and no further than allocating for real would."""
    src = tmp_path / "emit.c"
    src.write_text(EMIT_C)
    exe = compile_c(src, tmp_path / "emit", "-O2")
    t = gated([str(exe)], ready="ready")
    rec = record("--pid", str(t.pid))           # it carries the otel_memory probes: the preload tier
    rec.wait_attached()
    t.go()
    assert t.line() == "1"
    code, _, err = rec.stop()
    assert code == 0, err
    t.go()
    assert t.proc.wait(10) == 0
    out = read_table(rec.out, "outstanding")
    mine = out[(out["pid"] == t.pid) & (out["source"] == "malloc")]
    assert mine["alloc_samples"].sum() == 1, mine
    assert mine["outstanding_bytes"].max() == 2.0 ** 40
