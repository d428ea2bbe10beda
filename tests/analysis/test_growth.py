"""Growth classification on synthetic series with realistic sampling error.

Series are simulated the way the recorder sees them: sampled blocks arrive as a Poisson process
(rate = bytes per second / T, each standing for T bytes) and live for a while; a snapshot's
estimate is T x (live samples) with standard error T x sqrt(live samples).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import pandas as pd
import pytest

from analysis import analyze, dataset, series
from analysis.dataset import Dataset, load
from analysis.detect import growth
from analysis.detect.growth import classify, classify_series, detect_growth
from analysis.findings import to_document
from sampler.dataset.schema import FRAMES, OUTSTANDING, PROCESSES, STACKS, TARGETS
from sampler.dataset.writer import DatasetWriter

T = 512 << 10
MiB = 1 << 20


def simulate(rng, duration, interval, rate, lifetime=np.inf, start=0.0, stop=np.inf, batch_period=None):
    """Snapshot times, estimates and stderrs for blocks allocated at `rate` bytes/s between
    start and stop, each living `lifetime` s (or until the next batch boundary)."""
    times = np.arange(interval, duration + interval / 2, interval)
    n = rng.poisson(rate * (min(duration, stop) - start) / T) if rate > 0 else 0
    born = np.sort(rng.uniform(start, min(duration, stop), n))
    dies = born + lifetime
    if batch_period:
        dies = np.minimum(dies, (np.floor(born / batch_period) + 1) * batch_period)
    live = np.array([((born <= t) & (dies > t)).sum() for t in times])
    edges = np.concatenate(([0.0], times))
    churn = np.histogram(born, edges)[0] + np.histogram(dies[dies <= duration], edges)[0]
    return times, live * T, np.sqrt(live) * T, churn, live


def test_steady_leak_is_flagged_with_its_rate():
    rng = np.random.default_rng(1)
    tr = classify(*simulate(rng, 600, 10, rate=2 * MiB))
    assert tr.classification == "leak" and tr.confidence > 0.99
    assert tr.rate == pytest.approx(2 * MiB, rel=0.15)


def test_a_few_mb_per_second_is_flagged_within_30_seconds():
    rng = np.random.default_rng(2)
    series = simulate(rng, 30, 10, rate=3 * MiB)
    assert len(series[0]) == 3
    assert classify(*series).classification == "leak"


def test_bounded_cache_is_a_plateau_not_a_leak():
    hits = 0
    for seed in range(50):
        rng = np.random.default_rng(seed)
        # deque(maxlen=N): fills in ~2 min, then each new record evicts one (lifetime 120 s)
        tr = classify(*simulate(rng, 900, 10, rate=1 * MiB, lifetime=120))
        hits += tr.classification == "leak"
        assert tr.classification in ("plateau", "noise")
    assert hits == 0


def test_batching_is_a_sawtooth_unless_its_troughs_rise():
    rng = np.random.default_rng(3)
    t, y, s, c, n = simulate(rng, 900, 10, rate=4 * MiB, batch_period=150)
    assert classify(t, y, s, c, n).classification == "sawtooth"
    # the same batches on top of a leak
    _, y2, s2, c2, n2 = simulate(rng, 900, 10, rate=1 * MiB)
    tr = classify(t, y + y2, np.hypot(s, s2), c + c2, n + n2)
    assert tr.classification == "leak" and tr.pattern == "sawtooth"


def test_noise_at_realistic_sampling_error_is_never_a_leak():
    flagged = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        # churn: blocks live ~2 s, snapshots every 10 s; plus a static pool allocated before
        t, y, s, c, n = simulate(rng, 600, 10, rate=20 * MiB, lifetime=2)
        _, y2, s2, c2, n2 = simulate(rng, 600, 10, rate=0)
        flagged += classify(t, y + y2, np.hypot(s, s2), c + c2, n + n2).classification == "leak"
    assert flagged <= 1


def test_long_windows():
    rng = np.random.default_rng(4)
    tr = classify(*simulate(rng, 24 * 3600, 10, rate=20 << 10))          # 20 KiB/s for a day: 1.6 GiB
    assert tr.classification == "leak" and tr.rate == pytest.approx(20 << 10, rel=0.1)
    stopped = simulate(rng, 24 * 3600, 10, rate=20 << 10, stop=6 * 3600)   # stopped after 6 h
    assert classify(*stopped).classification == "plateau"


# -- held growth: the shapes a user meets ----------------------------------------------------------
def test_growth_that_paused_is_a_leak_reported_with_its_rate_and_pause():
    """PostgreSQL's prepared statements: one stack grows 70 MB/s for 47 s, then the client pauses
    for 7 s (snapshots every second); minutes of growth and a pause of seconds alike."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        tr = classify(*simulate(rng, 54, 1, rate=70e6, stop=47))
        assert tr.classification == "leak" and tr.pattern == "held", (seed, tr)
        assert tr.paused_s == pytest.approx(7, abs=1.5) and tr.rate == pytest.approx(70e6, rel=0.1), (seed, tr)
        assert tr.tail_z >= 3                                  # the rate's error is its growth's
        long = classify(*simulate(rng, 1200, 10, rate=1 * MiB, stop=1000))    # 17 min, then 3 min idle
        assert long.classification == "leak" and long.pattern == "held" and 150 <= long.paused_s <= 210, (seed, long)


def test_a_steady_leak_is_not_taken_for_a_paused_one():
    """Few samples in the last seconds of a steady leak are its noise, not a pause."""
    held = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        tr = classify(*simulate(rng, 14, 1, rate=1.3e6))     # ~2.5 samples a second (the journeys' service)
        held += tr.pattern == "held"
        assert tr.classification == "leak", (seed, tr)
    assert held <= 2, held


def test_a_cache_that_fills_in_seconds_and_holds_for_minutes_is_not_a_leak():
    for seed in range(50):
        rng = np.random.default_rng(seed)
        for duration, interval, fill in ((300, 5, 10), (60, 1, 8), (1800, 10, 120)):
            tr = classify(*simulate(rng, duration, interval, rate=8 * MiB, stop=fill))
            assert tr.classification in ("plateau", "noise"), (seed, duration, tr)


def test_growth_that_is_freed_is_not_a_leak():
    for seed in range(50):
        rng = np.random.default_rng(seed)
        # blocks kept for 60 s: the level rises for a minute, then every one is freed after the load stops
        tr = classify(*simulate(rng, 300, 5, rate=4 * MiB, lifetime=60, stop=120))
        assert tr.classification != "leak", (seed, tr)


def test_a_slow_leak_under_churn_is_found():
    found = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        t, y, s, c, n = simulate(rng, 1800, 10, rate=20 * MiB, lifetime=2)      # churn
        _, y2, s2, c2, n2 = simulate(rng, 1800, 10, rate=200 << 10)            # the leak: 350 MiB in 30 min
        tr = classify(t, y + y2, np.hypot(s, s2), c + c2, n + n2)
        found += tr.classification == "leak" and tr.pattern == "linear"
    assert found >= 18, found


def _dataset(series: dict[int, tuple], limit: int = 16 << 30) -> Dataset:
    """A Dataset with one process per pid, each with one stack per (stack_id -> series)."""
    t0 = pd.Timestamp("2026-11-22T00:00:00Z")
    out_rows, proc_rows, frame_rows, stack_rows = [], [], [], []
    for pid, stacks in series.items():
        times = None
        for sid, (t, y, s, churn, live) in stacks.items():
            times = t
            for ti, yi, si, ci, ni in zip(t, y, s, churn, live, strict=True):
                out_rows.append({"ts": t0 + pd.Timedelta(seconds=float(ti)), "recording_id": "r", "host": "h",
                                 "interval_s": 10.0, "pid": pid, "comm": f"p{pid}", "source": "malloc",
                                 "stack_id": sid, "outstanding_bytes": yi, "outstanding_stderr_bytes": si,
                                 "live_samples": int(ni), "alloc_samples": int(ci), "free_samples": 0})
            frame_rows.append({"stack_id": sid, "depth": 0, "function": f"site_{sid}", "module": "libx.so",
                               "kind": "native"})
            stack_rows.append({"stack_id": sid, "n_frames": 1, "site": f"site_{sid} (libx.so)"})
        for ti in times:
            proc_rows.append({"ts": t0 + pd.Timedelta(seconds=float(ti)), "recording_id": "r", "host": "h",
                              "pid": pid, "comm": f"p{pid}", "rss": int(500 * MiB), "memory_limit": limit})

    def frame(table, rows):
        empty = table.schema.empty_table().to_pandas()
        return pd.concat([empty, pd.DataFrame(rows)], ignore_index=True) if rows else empty

    return Dataset(root=".", outstanding=frame(OUTSTANDING, out_rows), processes=frame(PROCESSES, proc_rows),
                   stacks=frame(STACKS, stack_rows), frames=frame(FRAMES, frame_rows),
                   vm_events=pd.DataFrame(), targets=pd.DataFrame(), recordings=pd.DataFrame())


def test_many_processes_get_the_expected_decisions():
    rng = np.random.default_rng(5)
    procs = {}
    for pid in range(100, 120):
        procs[pid] = {
            pid * 10 + 1: simulate(rng, 1200, 10, rate=1 * MiB),                     # leak
            pid * 10 + 2: simulate(rng, 1200, 10, rate=2 * MiB, lifetime=180),        # bounded cache
            pid * 10 + 3: simulate(rng, 1200, 10, rate=30 * MiB, lifetime=1),         # churn
        }
    ds = _dataset(procs)
    series = classify_series(ds)
    leaks = series[series["classification"] == "leak"]
    assert set(leaks["stack_id"] % 10) == {1}
    assert len(leaks) == 20
    findings = detect_growth(ds, series)
    growth = [f for f in findings if f.kind == "persistent_growth"]
    assert len(growth) == 20
    f = growth[0]
    assert f.details["frames"][0]["function"].startswith("site_")
    assert f.details["growth_bytes_per_hour"] == pytest.approx(3600 * MiB, rel=0.3)
    assert f.details["time_to_oom_hours"] > 0 and f.details["time_to_oom_basis"] == "leak_rate"
    assert 0 < f.confidence <= 1 and f.summary.endswith(".")


def test_empty_dataset_has_no_findings():
    ds = _dataset({})
    assert classify_series(ds).empty
    assert detect_growth(ds) == []


def test_rss_growth_outside_sampled_allocations_is_reported():
    rng = np.random.default_rng(6)
    ds = _dataset({7: {71: simulate(rng, 600, 10, rate=2 * MiB, lifetime=30)}})     # a busy cache
    p = ds.processes
    grow = np.linspace(0, 300 * MiB, len(p))                      # RSS +300 MiB in anonymous memory
    p["rss"] = (500 * MiB + grow).astype("int64")
    for col in ("heap_rss", "arena_rss", "file_rss", "stack_rss"):
        p[col] = 10 * MiB
    p["anon_rss"] = (100 * MiB + grow).astype("int64")
    findings = detect_growth(ds)
    assert [f.kind for f in findings] == ["unexplained_growth"]
    d = findings[0].details
    assert d["rss_growth_bytes"] == pytest.approx(300 * MiB, rel=0.05)
    assert d["unexplained_bytes"] > 0.8 * d["rss_growth_bytes"]           # the cache explains its own fill
    assert max(d["region_growth_bytes"], key=d["region_growth_bytes"].get) == "anon_rss"
    assert "anon" in findings[0].summary and findings[0].details["time_to_oom_hours"] > 0


@pytest.mark.parametrize("k", [30, 45, 48, 50, 52, 55])
def test_one_large_block_allocated_once_is_not_a_leak(k):
    t = np.arange(1, 61) * 10.0
    y = np.where(np.arange(60) >= k, 100.0 * MiB, 0.0)        # far above T: sampled with p = 1
    churn = (np.arange(60) == k).astype(float)
    assert classify(t, y, np.zeros(60), churn, (y > 0).astype(float)).classification != "leak"


def test_a_source_filter_gives_no_unexplained_verdict():
    rng = np.random.default_rng(7)
    ds = _dataset({7: {71: simulate(rng, 600, 10, rate=2 * MiB, lifetime=30)}})
    ds.processes["rss"] = (500 * MiB + np.linspace(0, 300 * MiB, len(ds.processes))).astype("int64")
    for col in ("heap_rss", "arena_rss", "anon_rss", "file_rss", "stack_rss"):
        ds.processes[col] = 0
    assert [f.kind for f in detect_growth(ds)] == ["unexplained_growth"]
    ds.sources = ["mmap"]
    assert detect_growth(ds) == []


# -- one finding per cause, unknown is not zero, OOM projections --------------------------------------

def _causes_dataset(series: list[tuple], frames: dict[int, list[tuple]], tiers: list[str] | None = None,
                    rss_slope: float = 0.0) -> Dataset:
    """One process; `series`: (source, stack_id, simulate(...) output, measured mask or None);
    `frames`: stack_id -> [(function, module)] innermost first; `tiers`: per snapshot."""
    t0 = pd.Timestamp("2026-11-22T00:00:00Z")
    out_rows, frame_rows, times = [], [], None
    for source, sid, (t, y, s, churn, live), mask in series:
        times = t
        for i, (ti, yi, si, ci, ni) in enumerate(zip(t, y, s, churn, live, strict=True)):
            if mask is not None and not mask[i]:
                continue
            out_rows.append({"ts": t0 + pd.Timedelta(seconds=float(ti)), "recording_id": "r", "host": "h",
                             "interval_s": 10.0, "pid": 9, "comm": "p", "source": source, "stack_id": sid,
                             "outstanding_bytes": yi, "outstanding_stderr_bytes": si, "live_samples": int(ni),
                             "alloc_samples": int(ci), "free_samples": 0})
    for sid, fr in frames.items():
        frame_rows += [{"stack_id": sid, "depth": d, "function": fn, "module": mod,
                        "offset": sum(map(ord, fn)) * 64 + d, "kind": "native"} for d, (fn, mod) in enumerate(fr)]
    proc_rows = [{"ts": t0 + pd.Timedelta(seconds=float(ti)), "recording_id": "r", "host": "h", "pid": 9, "comm": "p",
                  "rss": int(500 * MiB + rss_slope * ti), "memory_limit": 16 << 30,
                  "tier": tiers[i] if tiers else "attach"} for i, ti in enumerate(times)]

    def frame(table, rows):
        return pd.concat([table.schema.empty_table().to_pandas(), pd.DataFrame(rows)], ignore_index=True)

    return Dataset(root=".", outstanding=frame(OUTSTANDING, out_rows), processes=frame(PROCESSES, proc_rows),
                   stacks=frame(STACKS, []), frames=frame(FRAMES, frame_rows), vm_events=pd.DataFrame(),
                   targets=pd.DataFrame(), recordings=pd.DataFrame())


def _leaks(ds: Dataset):
    return [f for f in detect_growth(ds) if f.kind == "persistent_growth"]


def test_stacks_that_differ_only_in_their_thread_start_are_one_finding():
    rng = np.random.default_rng(11)
    inner = [("grow", "srv"), ("handle", "srv")]
    frames = {sid: [*inner, (routine, "srv"), ("start_thread", "libc.so.6"), ("clone3", "libc.so.6")]
              for sid, routine in ((1, "worker_a"), (2, "worker_b"), (3, "worker_c"))}
    ds = _causes_dataset([("malloc", sid, simulate(rng, 300, 10, rate=1 * MiB), None) for sid in frames], frames)
    leaks = _leaks(ds)
    assert len(leaks) == 1, [f.summary for f in leaks]
    assert leaks[0].details["growth_bytes_per_hour"] / 3600 == pytest.approx(3 * MiB, rel=0.15)
    assert sorted(leaks[0].details["merged_stack_ids"]) == [2, 3]


def test_the_same_memory_through_two_sources_is_one_finding():
    """Faults inside a sampled mapping (the recorder gives them the mapping's stack) and the
    mapping: one finding, the resident view; an allocator's extents give none while malloc is
    measured (the allocations carved from them are the malloc finding)."""
    rng = np.random.default_rng(12)
    mapped = simulate(rng, 300, 10, rate=2 * MiB)
    frames = {1: [("grow_buffers", "srv"), ("main", "srv")],
              2: [("pages_map", "libjemalloc.so.2"), ("extent_alloc", "libjemalloc.so.2"), ("malloc",
                  "libjemalloc.so.2"), ("kv_set", "srv"), ("main", "srv")],
              3: [("kv_set", "srv"), ("main", "srv")]}
    ds = _causes_dataset([("mmap", 1, mapped, None), ("fault", 1, mapped, None)], frames, tiers=["rss"] * 30)
    (leak,) = _leaks(ds)
    assert (leak.details["source"], leak.details["attribution"], leak.details["also_seen_as"]) == \
        ("fault", "allocation", "mmap")
    ds = _causes_dataset([("mmap", 2, simulate(rng, 300, 10, rate=4 * MiB), None),
                          ("malloc", 3, simulate(rng, 300, 10, rate=4 * MiB), None)], frames)
    (leak,) = _leaks(ds)
    assert (leak.details["source"], leak.details["stack_id"]) == ("malloc", 3)


def test_a_tier_change_cuts_the_malloc_series_and_its_faults_take_over():
    """Moved to the page-fault tier after 150 s: malloc is not measured from then on (its rows
    stop; its last value is not carried on), and the same code's page faults continue the story:
    one finding, at the rate measured last, the malloc series named as seen before."""
    rng = np.random.default_rng(13)
    n = 30
    before = np.arange(n) < 15
    frames = {1: [("leak_blocks", "app"), ("main", "app")],
              2: [("_int_malloc", "libc.so.6"), ("malloc", "libc.so.6"), ("leak_blocks", "app"), ("main", "app")]}
    faults = simulate(rng, 300, 10, rate=2 * MiB, start=150)
    ds = _causes_dataset([("malloc", 1, simulate(rng, 300, 10, rate=2 * MiB), before), ("fault", 2, faults, ~before)],
                         frames, tiers=["attach" if b else "rss" for b in before])
    series = classify_series(ds)
    m = series[series["source"] == "malloc"].iloc[0]
    assert m["points"] == 15 and m["measured_until"] == ds.processes["ts"].iloc[14]
    leaks = _leaks(ds)
    assert len(leaks) == 1 and leaks[0].details["source"] == "fault", [f.summary for f in leaks]
    assert leaks[0].details["also_seen_as"] == "malloc" and leaks[0].details["attribution"] == "first_touch"
    assert "first touched by leak_blocks (app)" in leaks[0].summary
    assert leaks[0].details["growth_bytes_per_hour"] / 3600 == pytest.approx(2 * MiB, rel=0.2)


def test_oom_projections_come_from_a_trend_rising_at_the_end():
    from analysis.detect.growth import project_oom
    t = np.arange(0, 600, 10.0)
    rising = {"rss": 1 << 30, "limit": 2 << 30, "rss_slope": 1 * MiB, "rss_slope_ci": (0.8 * MiB, 1.2 * MiB)}
    p = project_oom(rising, 0.1 * MiB, 0.05 * MiB, 0.15 * MiB)
    assert p.basis == "rss_trend" and p.low < p.hours < p.high
    assert p.hours == pytest.approx(1024 / 3600, rel=1e-6)
    flat = {**rising, "rss_slope": 0.0, "rss_slope_ci": (-0.1 * MiB, 0.1 * MiB)}
    p = project_oom(flat, 0.1 * MiB, 0.05 * MiB, 0.15 * MiB)
    assert p.basis == "leak_rate" and p.hours == pytest.approx(10240 / 3600, rel=1e-6)
    assert project_oom(flat, 0.1 * MiB, -0.01 * MiB, 0.2 * MiB).hours is None     # not surely rising
    assert t.size     # (the grid the slopes above would come from)
    # a process whose RSS grew, then stayed flat: no projection from the whole window's slope
    rng = np.random.default_rng(14)
    leak = simulate(rng, 300, 10, rate=1 * MiB)
    ds = _causes_dataset([("malloc", 1, leak, None)], {1: [("grow", "app"), ("main", "app")]})
    ds.processes["rss"] = (500 * MiB + np.minimum(ds.processes.index.to_numpy(), 12) * 30 * MiB).astype("int64")
    (f,) = _leaks(ds)
    assert f.details["time_to_oom_basis"] == "leak_rate", f.summary


def test_a_growth_shared_by_a_server_family_is_one_finding():
    """Four children of one server and an unrelated process leak at the same site: the family's
    four are one family_growth finding naming the root, with their summed rate; the stranger
    keeps its own finding, and a child leaking elsewhere too."""
    from dataclasses import replace

    from analysis.detect.families import by_family

    rng = np.random.default_rng(5)
    leak = {pid: {1: simulate(rng, 300, 10, rate=1 * MiB)} for pid in (101, 102, 103, 104, 200)}
    leak[103][2] = simulate(rng, 300, 10, rate=2 * MiB)             # its own leak, elsewhere
    ds = _dataset(leak)
    ts = pd.Timestamp("2026-11-22T00:00:00Z")
    targets = [{"ts": ts, "pid": 100, "event": "attach", "comm": "postgres", "cmdline": "postgres -D /d", "ppid": 1},
               *({"ts": ts, "pid": p, "event": "attach", "comm": "postgres", "cmdline": "postgres: backend",
                  "ppid": 100} for p in (101, 102, 103, 104)),
               {"ts": ts, "pid": 200, "event": "attach", "comm": "other", "cmdline": "other", "ppid": 1}]
    ds = replace(ds, targets=pd.DataFrame(targets))
    findings = by_family(ds, detect_growth(ds))
    fam = [f for f in findings if f.kind == "family_growth"]
    assert len(fam) == 1, [f.summary for f in findings]
    f = fam[0]
    assert (f.pid, f.comm, f.details["processes"], f.details["pids"]) == (100, "postgres", 4, [101, 102, 103, 104])
    assert f.details["growth_bytes_per_hour"] / 3600 == pytest.approx(4 * MiB, rel=0.15)
    assert f.summary.startswith("4 processes of postgres (pid 100) grow at site_1 (libx.so)")
    rest = sorted((g.pid, g.details["frames"][0]["function"]) for g in findings if g.kind == "persistent_growth")
    assert rest == [(103, "site_2"), (200, "site_1")]


# -- the table streamed (analysis/series.py) ------------------------------------------------------

def _written(ds: Dataset, root, exits: list[tuple[float, int]] = ()) -> None:
    """`ds`'s tables in files under `root`, through the recorder's writer; `exits`: (seconds after
    the first snapshot, pid) of exit events, with an `exiting` row of what the teardown left."""
    w = DatasetWriter(root, "r", host="h")
    out = ds.outstanding
    teardown = [{**out[out["pid"] == pid].iloc[-1].to_dict(), "ts": out["ts"].min() + pd.Timedelta(seconds=at),
                 "exiting": True, "outstanding_bytes": 1.0} for at, pid in exits]
    for table, df in ((OUTSTANDING, pd.concat([out, pd.DataFrame(teardown)]) if teardown else out),
                      (PROCESSES, ds.processes), (FRAMES, ds.frames), (STACKS, ds.stacks)):
        rows = [{k: v for k, v in r.items() if not (pd.api.types.is_scalar(v) and pd.isna(v))}
                for r in df.to_dict("records")]
        w.write(table, rows)
    w.write(TARGETS, [{"ts": out["ts"].min() + pd.Timedelta(seconds=at), "recording_id": "r", "pid": pid,
                       "event": "exit"} for at, pid in exits])


def test_series_do_not_depend_on_batches_files_or_memory(tmp_path, monkeypatch):
    """The same series whether the rows are in memory in one batch, in batches of 97 rows, or read
    back from files (two passes over a dataset on disk, an exit among them): stacks merged by
    cause, snapshots of another tier left out, long series binned; rows in any order, grids
    searched per process."""
    rng = np.random.default_rng(13)
    n = 400
    before = np.arange(n) < 250
    frames = {1: [("leak_blocks", "app"), ("main", "app")],
              2: [("_int_malloc", "libc.so.6"), ("malloc", "libc.so.6"), ("leak_blocks", "app"), ("main", "app")],
              3: [("grow", "srv"), ("w_a", "srv"), ("start_thread", "libc.so.6")],
              4: [("grow", "srv"), ("w_b", "srv"), ("start_thread", "libc.so.6")]}
    ds = _causes_dataset([("malloc", 1, simulate(rng, n * 10, 10, rate=2 * MiB), before),
                          ("fault", 2, simulate(rng, n * 10, 10, rate=2 * MiB, start=2500), ~before),
                          ("malloc", 3, simulate(rng, n * 10, 10, rate=1 * MiB), None),
                          ("malloc", 4, simulate(rng, n * 10, 10, rate=1 * MiB), None)],
                         frames, tiers=["attach" if b else "rss" for b in before])
    def ordered(df: pd.DataFrame) -> pd.DataFrame:        # series come in the order first read
        return df.sort_values(["source", "stack_id"]).reset_index(drop=True)

    whole = ordered(classify_series(ds))
    assert len(whole) == 3 and whole["merged_stack_ids"].dropna().tolist() == [[4]]
    assert sorted(whole["points"]) == [150, 250, 250]          # malloc is not measured in the rss tier
    small = Dataset(**{k: getattr(ds, k) for k in ("root", "outstanding", "processes", "stacks", "frames",
                                                   "vm_events", "targets", "recordings")})
    small.batches = functools.partial(Dataset.batches, small, rows=97)
    pd.testing.assert_frame_equal(ordered(classify_series(small)), whole, rtol=1e-9)

    # a snapshot's rows apart (they are written together, and read as runs), and grids searched
    # per process (keys of processes x span that would not fit in 62 bits)
    shuffled = Dataset(**{k: getattr(ds, k) for k in ("root", "processes", "stacks", "frames", "vm_events",
                                                      "targets", "recordings")},
                       outstanding=ds.outstanding.sample(frac=1.0, random_state=3))
    pd.testing.assert_frame_equal(ordered(classify_series(shuffled)), whole, rtol=1e-9)
    monkeypatch.setattr(series, "KEY_BITS", 8)
    small.forget()
    pd.testing.assert_frame_equal(ordered(classify_series(small)), whole, rtol=1e-9)
    monkeypatch.undo()

    _written(ds, tmp_path, exits=[(n * 10 + 1, 9)])
    read = ordered(classify_series(load(tmp_path)))
    pd.testing.assert_frame_equal(read.drop(columns="comm"), whole.drop(columns="comm"), rtol=1e-9)


def test_grids_as_ranges_of_a_recording_or_of_their_own(tmp_path, monkeypatch):
    """A process's grid is a range of its recording's snapshot times when it has each one between
    its first and last, else a copy of its own: a process with every snapshot, one that started
    late and one that missed three give, read together (in memory, from files, grids searched per
    group), each the series it gives alone, with the points each was given."""
    rng = np.random.default_rng(21)
    keep = np.ones(300, bool)
    keep[[50, 51, 120]] = False
    procs = {100: {1001: simulate(rng, 3000, 10, rate=1 * MiB)},
             101: {1011: tuple(a[100:] for a in simulate(rng, 3000, 10, rate=1 * MiB))},
             102: {1021: tuple(a[keep] for a in simulate(rng, 3000, 10, rate=1 * MiB))}}

    def by_pid(ds: Dataset) -> dict[int, dict]:
        out = {}
        for x in growth._streamed(ds)[0]:
            d = dataclasses.asdict(x)
            d.pop("recording_id")
            out[x.pid] = d
        return out

    def same(got: dict[int, dict], want: dict[int, dict]) -> None:
        assert sorted(got) == sorted(want)
        for pid, d in want.items():
            for k, v in d.items():
                if isinstance(v, np.ndarray):
                    np.testing.assert_allclose(got[pid][k], v, rtol=1e-12, err_msg=f"{pid} {k}")
                elif isinstance(v, float):
                    assert got[pid][k] == pytest.approx(v, rel=1e-12), (pid, k)
                else:
                    assert got[pid][k] == v, (pid, k)

    alone = {pid: by_pid(_dataset({pid: stacks}))[pid] for pid, stacks in procs.items()}
    assert [alone[p]["points"] for p in procs] == [300, 200, 297]
    together = _dataset(procs)
    same(by_pid(together), alone)
    _written(together, tmp_path)
    same(by_pid(load(tmp_path)), alone)
    monkeypatch.setattr(series, "KEY_BITS", 8)
    same(by_pid(load(tmp_path)), alone)
    monkeypatch.undo()
    # a recording seen only in a teardown's `exiting` row: no snapshot times, no grid, no series
    row = {**together.outstanding.iloc[-1].to_dict(), "recording_id": "other", "pid": 999, "exiting": True}
    together.outstanding = pd.concat([together.outstanding, pd.DataFrame([row])], ignore_index=True)
    _written(together, tmp_path / "exit-only")
    same(by_pid(load(tmp_path / "exit-only")), alone)


def test_findings_do_not_depend_on_how_processes_are_cut_into_parts(tmp_path, monkeypatch):
    """analyze.run reads `processes` a part of whole processes at a time (Dataset.parts, through
    compressed files of each part): cut into parts of one process, the findings are those of
    the whole table in one part."""
    rng = np.random.default_rng(5)
    procs = {pid: {pid * 10 + 1: simulate(rng, 1200, 10, rate=1 * MiB),
                   pid * 10 + 2: simulate(rng, 1200, 10, rate=0.0)} for pid in range(100, 106)}
    _written(_dataset(procs), tmp_path)
    whole = to_document(analyze.run(load(tmp_path)))
    monkeypatch.setattr(dataset, "PART_ROWS", 150)
    ds = load(tmp_path)
    assert len(list(ds.parts())) == 6
    assert to_document(analyze.run(load(tmp_path))) == whole
    assert len(whole["findings"]) == 6


def test_parts_leave_out_columns_null_in_every_file(tmp_path, monkeypatch):
    """Columns whose every file says (in its footer) that they hold only nulls are neither read
    nor spilled; each part gets them back as Arrow converts nulls: a part equals the whole
    table's rows of its processes, columns and types included, and the findings are unchanged."""
    rng = np.random.default_rng(8)
    procs = {pid: {pid * 10 + 1: simulate(rng, 1200, 10, rate=1 * MiB)} for pid in range(100, 104)}
    ds = _dataset(procs)
    ds.processes["threads"] = np.where(ds.processes["pid"] == 102, 4.0, np.nan)     # one process has it
    _written(ds, tmp_path)
    null = dataset.null_columns(tmp_path / "processes", analyze.PART_COLUMNS)
    assert {"swap", "heap_rss", "gpu_used_bytes"} <= null and not null & {"threads", "rss", "ts", "comm"}
    whole = load(tmp_path)
    want = whole.processes[analyze.PART_COLUMNS]
    findings = to_document(analyze.run(whole))
    monkeypatch.setattr(dataset, "PART_ROWS", 130)
    ds = load(tmp_path)
    parts = list(ds.parts(columns=analyze.PART_COLUMNS))
    assert len(parts) == 4
    for part in parts:
        got = part.processes.reset_index(drop=True)
        mine = want[want["pid"].isin(got["pid"].unique())].reset_index(drop=True)
        # (a filled column's type may narrow where a part has no null: int32 threads, as before)
        pd.testing.assert_frame_equal(got[analyze.PART_COLUMNS], mine, check_categorical=False, check_dtype=False)
        assert sorted(got.columns) == sorted(want.columns)
        assert all(got[c].dtype == want[c].dtype for c in null), got.dtypes
        assert got["threads"].notna().any() == (got["pid"] == 102).any()
    assert to_document(analyze.run(load(tmp_path))) == findings


def test_a_file_replaced_while_it_is_streamed_reads_everything_again(tmp_path, monkeypatch):
    """A live daemon's compaction replaces files: a file gone between the listing and its read
    makes analyze.run read the dataset again, with the same findings as an undisturbed read."""
    rng = np.random.default_rng(5)
    _written(_dataset({pid: {pid * 10 + 1: simulate(rng, 1200, 10, rate=1 * MiB)} for pid in (100, 101)}), tmp_path)
    whole = to_document(analyze.run(load(tmp_path)))
    real, calls = dataset.pq.ParquetFile, []

    def vanishing(path, *a, **kw):          # the third file opened is gone (once)
        calls.append(path)
        if len(calls) == 3:
            raise FileNotFoundError(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(dataset.pq, "ParquetFile", vanishing)
    assert to_document(analyze.run(load(tmp_path))) == whole and len(whole["findings"]) == 2
    assert len(calls) > 3


def test_arrow_allocator_is_chosen_before_pyarrow_and_a_choice_kept():
    """Importing `analysis` first makes Arrow allocate with jemalloc (one arena: docs/performance.md)
    without leaving that in the environment; a pool named in the environment, or pyarrow imported
    before, is left as it is."""
    import subprocess
    import sys

    from conftest import ROOT

    def backend(code: str, **env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "JE_ARROW_MALLOC_CONF")}
        show = ("; import os; print(pyarrow.default_memory_pool().backend_name,"
                " sorted(k for k in os.environ if 'ARROW' in k))")
        out = subprocess.run([sys.executable, "-c", code + show],
                             capture_output=True, text=True, env={**clean, **env}, cwd=ROOT, check=True)
        assert not out.stderr, out.stderr
        return out.stdout.strip()

    # and the environment is left as it was: processes started later do not inherit the choice
    assert backend("import analysis, pyarrow") == "jemalloc []"
    assert backend("import analysis, pyarrow", ARROW_DEFAULT_MEMORY_POOL="system") == \
        "system ['ARROW_DEFAULT_MEMORY_POOL']"
    assert backend("import pyarrow, analysis") == "mimalloc []"
