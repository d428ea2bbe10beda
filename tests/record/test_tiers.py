"""The cheaper tiers and the governor, each against the workload's own ground truth:
always-on (sampled page faults), preload (the process's own otel_memory USDT samples) and the
attach tier's overhead governor (duty-cycled allocation probes, or a move to the always-on tier)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import WORKLOADS, allocsampler_cmd, compile_c, final_by_site

from analysis.dataset import read_table

MiB = 1 << 20
pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def tiers_exe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiers") / "tiers"
    return compile_c(WORKLOADS / "tiers.c", out, "-O2", "-fno-builtin")


def run_gated(gated, record, argv: list[str], *rec_args: str, env: dict | None = None):
    """Start the workload, attach, run it, stop the recorder while the workload still lives
    (the last snapshot has everything); returns (target, recording, ground truth in bytes)."""
    t = gated(argv, ready="ready", env=env)
    rec = record("--pid", str(t.pid), *rec_args)
    rec.wait_attached()
    t.go()
    truth = int(t.line())
    code, _, err = rec.stop()
    assert code == 0, err
    t.go()
    assert t.proc.wait(10) == 0           # the target was never harmed
    return t, rec, truth


def by_site(out: Path, pid: int, source: str) -> pd.DataFrame:
    df = final_by_site(out, pid, source)
    return df.groupby("site_fn").agg(bytes=("outstanding_bytes", "sum"),
                                     var=("outstanding_stderr_bytes", lambda s: (s ** 2).sum()))


def seen(out: Path, pid: int, source: str) -> set[str]:
    """Innermost functions of every stack that had samples of `source` in any interval."""
    o = read_table(out, "outstanding")
    o = o[(o["pid"] == pid) & (o["source"] == source) & (o["alloc_samples"] > 0)]
    f = read_table(out, "frames")
    return set(f[(f["depth"] == 0) & f["stack_id"].isin(set(o["stack_id"]))]["function"].dropna())


# -- always-on tier ----------------------------------------------------------------------------
def test_rss_tier_attributes_resident_growth_to_the_stack_that_keeps_it(tiers_exe, gated, record):
    """Sampled page faults find the stack whose pages stay resident; pages given back (munmap,
    MADV_DONTNEED) leave the estimate; no uprobe is attached; analysis reports the growth."""
    t, rec, truth = run_gated(gated, record, [str(tiers_exe), "faults", "60"],
                              "--rss", "--fault-period", "7", "-i", "0.5")
    sites = by_site(rec.out, t.pid, "fault")
    leak = sites.loc["leak_pages"]
    assert abs(leak.bytes - truth) <= 4 * math.sqrt(leak["var"]) + 0.05 * truth, (leak, truth)
    # the transient pages were sampled, and are gone from the estimate; the faults of madv_pages
    # lie in main's sampled 4 MiB scratch mapping, so they carry the stack that mapped it (one
    # cause, not a second one at first touch)
    assert {"churn_pages", "main"} <= seen(rec.out, t.pid, "fault")
    assert "madv_pages" not in seen(rec.out, t.pid, "fault")
    for fn in ("churn_pages", "main"):
        left = sites.loc[fn].bytes if fn in sites.index else 0.0
        assert left <= 0.02 * truth, (fn, left)
    procs = read_table(rec.out, "processes")
    assert set(procs["tier"].astype(str)) == {"rss"}
    assert procs["alloc_coverage"].isna().all()
    targets = read_table(rec.out, "targets")
    assert all(len(p) == 0 for p in targets["probes"])           # no uprobe anywhere
    rows = read_table(rec.out, "recorder")
    assert rows["sampled_faults"].sum() > 0
    assert int(read_table(rec.out, "recordings")["fault_period"].iloc[-1]) == 7

    p = subprocess.run(allocsampler_cmd("analyze", str(rec.out), "--json"), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    growth = [f for f in json.loads(p.stdout)["findings"] if f["kind"] == "persistent_growth"]
    assert any(f["source"] == "fault" and f["frames"][0]["function"] == "leak_pages" for f in growth), growth


def test_rss_tier_for_a_cgroup_adopts_its_processes(tiers_exe, gated, record, tmp_path):
    """--cgroup selects processes by cgroup (v2) as they fault, without naming pids."""
    from sampler.proc.cgroups import cgroup2_root

    root = Path(cgroup2_root())
    cg = root / f"allocsampler-test-{os.getpid()}"
    cg.mkdir()
    try:
        t = gated([str(tiers_exe), "faults", "20"], ready="ready")
        (cg / "cgroup.procs").write_text(str(t.pid))
        rec = record("--cgroup", str(cg), "--fault-period", "7", "-i", "0.5")
        deadline = time.monotonic() + 60       # no pid to attach: wait for the recording to start
        while not (rec.out / "recordings").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        t.go()
        truth = int(t.line())
        time.sleep(1.0)
        code, _, err = rec.stop()
        assert code == 0, err
        t.go()
        assert t.proc.wait(10) == 0
        sites = by_site(rec.out, t.pid, "fault")
        leak = sites.loc["leak_pages"]
        assert abs(leak.bytes - truth) <= 4 * math.sqrt(leak["var"]) + 0.05 * truth, (leak, truth)
        pids = set(read_table(rec.out, "targets")["pid"])
        assert pids == {t.pid}                   # the recorder and other processes stay out
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        for _ in range(50):                  # an exited task leaves its cgroup a moment later
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# -- governor ----------------------------------------------------------------------------------
# serial: the duty's weights assume the target allocates at the same rate with probes on and off; beside a
# busy neighbour on both CPUs the on phases ran slower and the target caught up off them (CI, 2026-12-01:
# 10.9 MB estimated of 17.9 MB), which is the host's bias, not the governor's arithmetic
@pytest.mark.serial
def test_governor_duty_cycles_allocation_probes_and_keeps_estimates_unbiased(tiers_exe, gated, record):
    """20k malloc/free pairs/s at 1 us per hit cost 4% of a CPU: over the 3% budget, the
    governor attaches allocation probes about half the time (frees always), records the
    coverage, and the leak estimate (weights divided by the duty) still matches the truth."""
    t, rec, truth = run_gated(gated, record, [str(tiers_exe), "rate", "14", "20000"], "--attach-mode", "uprobe",
                              "--cpu-budget", "3", "--probe-cost", "1000", "--sample-bytes", "64K", "-i", "2")
    procs = read_table(rec.out, "processes").sort_values("ts")
    assert set(procs["tier"].astype(str)) == {"attach"}
    cov = procs["alloc_coverage"].to_numpy()[2:-1]          # governed intervals
    assert 0.3 < cov.mean() < 0.7, cov                       # one 2 s duty cycle per interval: they vary
    # the target's bursts (it catches up after stalls) move single intervals; the mean keeps the budget
    assert procs["probe_cpu_estimate"].iloc[2:-1].mean() < 0.036, procs["probe_cpu_estimate"]
    gov = read_table(rec.out, "targets")
    gov = gov[gov["event"] == "governor"]
    assert len(gov) >= 1 and "budget" in gov["detail"].iloc[0], gov["detail"].tolist()
    leak = by_site(rec.out, t.pid, "malloc").loc["leak_blocks"]
    assert abs(leak.bytes - truth) <= 4 * math.sqrt(leak["var"]) + 0.1 * truth, (leak, truth)


def test_governor_moves_an_overloaded_target_to_the_always_on_tier(tiers_exe, gated, record):
    """At 200k pairs/s even the free probes exceed the budget: the target moves to sampled page
    faults (calibrated cost per hit), the move is recorded, and the target runs on unharmed."""
    t, rec, truth = run_gated(gated, record, [str(tiers_exe), "rate", "6", "200000"], "--attach-mode", "uprobe",
                              "--cpu-budget", "3", "-i", "1")
    cost = float(read_table(rec.out, "recordings")["probe_cost_ns"].iloc[-1])
    assert 100 <= cost <= 50_000
    moves = read_table(rec.out, "targets")
    moves = moves[moves["event"] == "tier"]
    assert len(moves) == 1 and moves["detail"].iloc[0].startswith("rss:"), moves["detail"].tolist()
    procs = read_table(rec.out, "processes").sort_values("ts")
    assert procs["tier"].astype(str).iloc[-1] == "rss"
    assert truth > 0 and seen(rec.out, t.pid, "fault")     # recorded on, from page faults


# -- preload tier ------------------------------------------------------------------------------
def test_preload_and_inject_tiers_match_the_attach_tier_and_the_truth(tiers_exe, gated, record):
    """The same workload under allocator uprobes, with the shim preloaded (found by its otel_memory
    USDT probes, no uprobe on malloc) and with the sampler injected (no restart): all estimates match
    the workload's ground truth and each other within sampling error, and all stacks start at the
    caller (no frame of the shim or the injected sampler)."""
    from sampler.inprocess.preload import preload_env

    argv = [str(tiers_exe), "sizes", "60000"]
    results = {}
    for tier, env, mode in (("attach", None, "uprobe"), ("preload", preload_env(256 << 10), "auto"),
                            ("inject", None, "inject")):
        t, rec, truth = run_gated(gated, record, argv, "--sample-bytes", "256K", "-i", "1", "--attach-mode", mode,
                                  "--max-samples-per-s", "0", env=env)
        assert read_table(rec.out, "recorder")["lost_events"].sum() == 0
        procs = read_table(rec.out, "processes")
        assert set(procs["tier"].astype(str)) == {tier}
        probes = [p for ps in read_table(rec.out, "targets")["probes"] for p in ps]
        usdt = [p for p in probes if p.startswith("otel_memory:")]
        if tier in ("preload", "inject"):
            assert usdt and not [p for p in probes if p.startswith("malloc+")], probes
        else:
            assert not usdt and any(p.startswith("malloc+") for p in probes), probes
        leak = by_site(rec.out, t.pid, "malloc").loc["leak_sized"]   # the caller, not malloc or the shim
        assert abs(leak.bytes - truth) <= 4 * math.sqrt(leak["var"]), (tier, leak, truth)
        o = read_table(rec.out, "outstanding")
        frames = read_table(rec.out, "frames")
        frames = frames[frames["stack_id"].isin(set(o[o["source"] == "malloc"]["stack_id"]))]
        assert not frames["module"].astype(str).str.contains("allocsampler").any()   # (the shim's own
        # table's mmap is rightly a stack in the shim, under source mmap)
        results[tier] = leak
    a = results["attach"]
    for other in ("preload", "inject"):
        p = results[other]
        assert abs(a.bytes - p.bytes) <= 4 * math.sqrt(a["var"] + p["var"]), results


def test_record_preload_command_with_python_frames(tmp_path, bpf_ready):
    """`record --preload -- CMD`: a Python leak recorded from the shim's samples has the Python
    line of the leak in its stack."""
    script = tmp_path / "leak.py"
    script.write_text("import time\n"
                      "keep = []\n"
                      "def leak():\n"
                      "    keep.append(bytearray(100_000))  # LEAK\n"
                      "for _ in range(3000):\n"
                      "    leak()\n"
                      "    time.sleep(0.001)\n")
    out = tmp_path / "out"
    p = subprocess.run(allocsampler_cmd("record", "-q", "-o", str(out), "-i", "0.5", "--preload", "--cpu-budget", "0",
                                        "--", "/usr/bin/python3", str(script)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    procs = read_table(out, "processes")
    assert set(procs["tier"].astype(str)) == {"preload"}
    f = read_table(out, "frames")
    hit = f[(f["kind"] == "python") & (f["function"] == "leak") & (f["line"] == 4)]
    assert len(hit), f[f["kind"] == "python"][["function", "line"]].drop_duplicates()
    o = read_table(out, "outstanding")
    o = o[o["stack_id"].isin(set(hit["stack_id"])) & (o["source"] == "malloc")]
    peak = o.groupby("ts")["outstanding_bytes"].sum().max()    # the exit frees it all: take the peak
    assert peak == pytest.approx(3000 * 100_000, rel=0.25)
