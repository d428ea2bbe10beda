"""Targets: a launched command, its children, threads started after attach, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import WORKLOADS, compile_c, final_by_site
from journey import inject_delay

from analysis.dataset import read_table
from sampler import environ

pytestmark = pytest.mark.bpf
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiers_exe(tmp_path_factory) -> Path:
    return compile_c(WORKLOADS / "tiers.c", tmp_path_factory.mktemp("tiers") / "tiers", "-O2", "-fno-builtin")


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
    # the command's image got the sampler at its exec (the launcher was never placed into), and
    # the child it forked inherited it
    assert inject_delay(rec.out, int(parent)) <= 1.0, targets[["pid", "event", "detail"]]
    assert targets[(targets["pid"] == child) & (targets["event"] == "tier")]["detail"].str.contains(
        f"inherited from pid {parent}").any(), targets[["pid", "event", "detail"]]


def test_the_uprobe_tier_follows_the_image_a_command_execs_into(tiers_exe, record):
    """`--attach-mode uprobe` on a command: its allocator probes, attached in the launcher, go on in
    the image it execs into through every duty cycle of the governor (an on phase attaches them
    again through the new image's files): the leak matches what the workload reports after its exec."""
    rec = record("--attach-mode", "uprobe", "--cpu-budget", "3", "--probe-cost", "1000", "--sample-bytes", "64K",
                 "-i", "2", "--", str(tiers_exe), "rate", "12", "20000")
    assert rec.proc.wait(120) == 0
    err = rec.proc.stderr.read()
    truth = int([ln for ln in err.splitlines() if ln.strip().isdigit()][-1])
    targets = read_table(rec.out, "targets")
    assert (targets["event"] == "governor").any(), targets[["event", "detail"]]      # it duty-cycled
    df = final_by_site(rec.out, int(targets[targets["event"] == "exec"]["pid"].iloc[0]))
    leak = df[df["site_fn"] == "leak_blocks"]
    var = float((leak["outstanding_stderr_bytes"] ** 2).sum())
    assert abs(leak["outstanding_bytes"].sum() - truth) <= 4 * var ** 0.5 + 0.1 * truth, (leak, truth)


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


def test_a_refusal_that_says_when_it_is_tried_again_is_tried_again_then(workload, record):
    """A process stopped by job control is not placed into ("stopped ... next try in 10 s", the
    uprobe tier meanwhile); once it runs again, the placement is tried at that time and it moves to
    the inject tier, its leak then sampled there."""
    w = workload()
    os.kill(w.pid, signal.SIGSTOP)
    try:
        rec = record("--pid", str(w.pid), "-i", "1")
        rec.wait_attached(pid=w.pid)
    finally:
        os.kill(w.pid, signal.SIGCONT)
    t0 = time.monotonic()
    deadline = t0 + 30
    tiers: list[str] = []
    while time.monotonic() < deadline:
        t = read_table(rec.out, "targets")
        tiers = list(t[(t["pid"] == w.pid) & (t["event"] == "tier")]["detail"])
        if any(d.startswith("inject:") for d in tiers):
            break
        time.sleep(0.5)
    took = time.monotonic() - t0
    truth = w.call("leak_malloc", 8192, 4096)
    rec.wait_snapshot(time.time() + 1.2)
    code, _, err = rec.stop()
    assert code == 0, err
    assert tiers[0].startswith("attach:") and "stopped" in tiers[0] and "next try in 10 s" in tiers[0], tiers
    assert tiers[-1].startswith("inject: in-process sampler"), tiers
    assert took <= 12, took                                       # at its next try, not at the next exec
    df = final_by_site(rec.out, w.pid)
    assert df[df["site_fn"] == "leak_malloc"]["outstanding_bytes"].sum() == pytest.approx(truth, rel=0.35)
