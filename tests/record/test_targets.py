"""Targets: a launched command, its children, threads started after attach, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import WORKLOADS, compile_c, final_by_site

from analysis.dataset import read_table
from sampler import environ

pytestmark = pytest.mark.bpf
MiB = 1 << 20


def test_launched_command_with_children(tmp_path, record):
    exe = compile_c(WORKLOADS / "forker.c", tmp_path / "forker")
    rec = record("-i", "1", "--children", "--", str(exe), "0")
    code = rec.proc.wait(120)                    # the recording ends with the command
    assert code == 0, rec.proc.stderr.read()
    targets = read_table(rec.out, "targets")
    parent = targets[targets["comm"] == "forker"]["pid"].min()
    child_rows = targets[(targets["event"] == "attach") & (targets["pid"] != parent)]
    assert len(child_rows) >= 1, targets[["pid", "event", "comm"]]
    exits = targets[(targets["event"] == "exit") & (targets["pid"] == parent)]
    assert "exit status 3" in exits["detail"].iloc[0]
    child = int(child_rows["pid"].iloc[0])
    df = final_by_site(rec.out, child)
    est = df[df["site_fn"] == "child_leak"]["outstanding_bytes"].sum()
    assert est == pytest.approx(32 * MiB, rel=0.35)


def test_a_launched_command_gets_the_environment_it_was_given(tmp_path, record):
    """The recorder runs its own numpy on one BLAS thread (sampler/environ.py); a command it starts
    gets the user's environment: those variables as they were, absent when they were absent."""
    seen = tmp_path / "env"
    rec = record("--", "sh", "-c", f"env > {seen}")
    assert rec.proc.wait(120) == 0, rec.proc.stderr.read()
    env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    assert {v: env.get(v) for v in environ.BLAS_VARS} == {v: os.environ.get(v) for v in environ.BLAS_VARS}


def test_threads_started_after_attach_are_covered(workload, record):
    w = workload()
    rec = record("--pid", str(w.pid), "-i", "1")
    rec.wait_attached()
    truth = w.call("leak_malloc", 24 * 1024, 4096, thread=True)   # a thread born after attach
    rec.wait_snapshot(time.time() + 1.5)
    code, _, err = rec.stop(signal.SIGTERM)                         # SIGTERM: flush, exit 0
    assert code == 0, err
    df = final_by_site(rec.out, w.pid)
    assert df[df["site_fn"] == "leak_malloc"]["outstanding_bytes"].sum() == pytest.approx(truth, rel=0.25)
    rows = read_table(rec.out, "recordings")
    assert rows["ended"].notna().all(), "SIGTERM must end the recording cleanly"


def test_summary_names_dataset_and_top_stack(workload, bpf_ready, tmp_path):
    from conftest import allocsampler_cmd
    w = workload()
    out = tmp_path / "out"
    p = subprocess.Popen(allocsampler_cmd("record", "--pid", str(w.pid), "-o", str(out), "-i", "1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (any((out / "targets").glob("host=*/date=*/*.parquet"))
                                               and (read_table(out, "targets")["event"] == "attach").any()):
        time.sleep(0.1)
    w.call("leak_malloc", 16 * 1024, 4096)
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert f"dataset: {out}" in stdout
    assert "leak_malloc (libleaky.so)" in stdout


def test_command_that_execs_a_static_binary_is_reported(tmp_path, record):
    exe = compile_c(WORKLOADS / "static_alloc.c", tmp_path / "static_alloc", "-static", "-s")
    rec = record("-i", "1", "-d", "8", "--", str(exe))
    code = rec.proc.wait(120)
    assert code == 0, rec.proc.stderr.read()
    targets = read_table(rec.out, "targets")
    warnings = targets[targets["event"] == "warning"]["detail"]
    assert warnings.str.contains("no probeable allocator").sum() == 1
    assert (targets["event"] == "exec").any()


@pytest.mark.parametrize("mode", ["uprobe", "inject"])
def test_cpp_target_keeps_catching_bad_alloc(mode, tmp_path, record, gated):
    """With tcmalloc preloaded, `operator new` is the allocator's own: a return probe on it would
    break exception unwinding. The recorder must leave it alone."""
    exe = tmp_path / "throw"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(WORKLOADS / "throw_bad_alloc.cc")], check=True)
    target = gated([str(exe)], ready="ready",
                   env={"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"})
    rec = record("--pid", str(target.pid), "-i", "1", "--attach-mode", mode)
    rec.wait_attached()
    target.go("g")
    assert target.line() == "caught 5"
    code, _, err = rec.stop()
    assert code == 0, err
    detail = " ".join(read_table(rec.out, "targets")["detail"].dropna())
    # uprobes: none on a throwing new; injected: operator new is never redirected (only malloc is)
    assert "_Znwm (throws" in detail if mode == "uprobe" else "inject: in-process sampler" in detail


def test_exec_from_a_thread_is_followed(tmp_path, record, gated):
    """The probe links are bound to the leader task, which an exec from another thread replaces."""
    exe = compile_c(WORKLOADS / "thread_exec.c", tmp_path / "thread_exec", "-pthread")
    target = gated([str(exe)], ready="ready")
    rec = record("--pid", str(target.pid), "-i", "1")
    rec.wait_attached()
    target.go("g")
    assert target.line() == "leaked"
    rec.wait_snapshot(time.time() + 1.2)
    code, _, err = rec.stop()
    assert code == 0, err
    df = final_by_site(rec.out, target.pid)
    est = df[df["site_fn"] == "leak_after_exec"]["outstanding_bytes"].sum()
    assert est == pytest.approx(96 * MiB, rel=0.25)


def test_a_burst_of_events_does_not_stall_the_recorder(tmp_path, record):
    """An mmap storm (~180k mmap+munmap pairs/s, most 1 MiB mmaps sampled at the 512 KiB mean):
    the sample-rate cap raises the process's mean within a tick, BPF sends only its budget of
    unsampled syscall events, and the recorder keeps its intervals and --duration."""
    exe = compile_c(WORKLOADS / "mmap_storm.c", tmp_path / "mmap_storm")
    target = subprocess.Popen([str(exe), "120"])     # outlives the test: it is killed below
    try:
        deadline = time.monotonic() + 10     # past exec: ld.so has mapped libc (the allocator)
        while "libc.so" not in Path(f"/proc/{target.pid}/maps").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        rec = record("--pid", str(target.pid), "-i", "1", "-d", "6")
        rec.wait_attached()
        t0 = time.monotonic()           # from attach: compiling the BPF programs is not the point
        code = rec.proc.wait(60)
        assert code == 0, rec.proc.stderr.read()
        assert time.monotonic() - t0 < 6 + 6, "the recorder ignored --duration under the burst"
        intervals = read_table(rec.out, "recorder").sort_values("ts")
        assert len(intervals) >= 5 and intervals["interval_s"].max() < 2.5, intervals["interval_s"].tolist()
        # after the first seconds (the ring buffer's backlog), events read per second stay near the
        # budgets: 2000 unsampled + the capped samples and their unmaps
        late = intervals.iloc[-3:]
        rate = (late["events"] / late["interval_s"]).max()
        assert rate < 8000, late[["events", "interval_s", "samples", "vm_events_suppressed"]]
        assert late["vm_events_suppressed"].sum() > 10 * late["events"].sum()
        procs = read_table(rec.out, "processes").sort_values("ts")
        assert procs["sample_mean_bytes"].iloc[-1] >= 64 * (512 << 10)      # raised by the cap
        assert procs["vm_events_suppressed"].iloc[-1] > 100_000
        events = read_table(rec.out, "targets")
        assert any("over the cap" in str(d) for d in events[events["event"] == "sampling"]["detail"])
        # one 1 MiB mapping is live at a time: the estimate is that, within its error
        last = procs.iloc[-1]
        assert last["mmap_outstanding_bytes"] <= (1 << 20) + 4 * last["mmap_outstanding_stderr_bytes"]
        assert target.poll() is None, "the target was harmed"
    finally:
        target.kill()
        target.wait()
