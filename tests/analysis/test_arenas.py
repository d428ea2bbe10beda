"""glibc arena bloat: the reproducer (tests/workloads/arena_bloat.c) recorded for real, and the
detector's decisions on small synthetic datasets."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import WORKLOADS, GatedTarget, compile_c

from analysis import analyze
from analysis.dataset import Dataset, load
from analysis.detect.arenas import detect_arena_bloat
from sampler.dataset.schema import MALLOC_ARENAS, PROCESSES, TARGETS, VM_EVENTS
from sampler.dataset.writer import DatasetWriter

MiB, GiB = 1 << 20, 1 << 30


# -- real recordings ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def arena_bloat_bin(tmp_path_factory) -> Path:
    return compile_c(WORKLOADS / "arena_bloat.c", tmp_path_factory.mktemp("arena") / "arena_bloat", "-pthread")


def record_reproducer(record, binary: Path, mode: str, **env: str) -> Path:
    """Attach first, let a snapshot pass, then release the allocations, and keep the process alive
    for 4 snapshots after they are done: Live then covers every block."""
    target = GatedTarget([str(binary), mode], ready="waiting", stream="stdout", env=env)
    try:
        rec = record("--pid", str(target.pid), "-i", "1")
        rec.wait_attached()
        rec.wait_snapshot(time.time())
        target.go()
        assert target.line() == "ready"
        rec.wait_snapshot(time.time() + 4)
        code, _, err = rec.stop()
        assert code == 0, err
    finally:
        target.kill()
    return rec.out


@pytest.mark.bpf
@pytest.mark.serial         # beside another module's recording, its walks missed the window once in three suites
@pytest.mark.parametrize("mode", ["page-pin", "top-pin"])
def test_reproducer_with_8_arenas_is_flagged(record, arena_bloat_bin, mode):
    out = record_reproducer(record, arena_bloat_bin, mode)
    findings = detect_arena_bloat(load(out))
    assert len(findings) == 1, findings
    d = findings[0].details
    assert d["arenas"] == 8 and d["bloat_bytes"] >= 150e6
    assert d["sampled_bloat_bytes"] >= 150e6             # sampling alone reaches the same verdict
    assert d["bloat_basis"] == "free lists" and findings[0].confidence >= 0.8     # >= 4 windows of 3
    assert "MALLOC_ARENA_MAX=2" in d["recommendation"] and d["expected_saving_bytes"] > 100e6
    assert "before" not in d["caveats"]                   # attached before the allocations
    if mode == "page-pin":     # every page keeps a live chunk: nothing for malloc_trim
        assert d["trimmable_bytes"] < 0.02 * d["bloat_bytes"] and d["pinned_bytes"] > 150e6
        assert d["live_bytes"] == pytest.approx(8 * 8192 * 1040, rel=0.3)
    else:                      # one chunk pins each top: malloc_trim(0) returns the rest
        assert d["trimmable_bytes"] > 0.98 * d["bloat_bytes"]
        assert d["recommendation"].startswith("call malloc_trim(0)")
    # the free lists agree with the definition: free chunk bytes = committed - live chunk bytes
    # (at the last walk: walks are spaced by their cost, sampler/control/pacing.py)
    a = pd.read_parquet(out / "malloc_arenas")
    a = a[a["ts"] == a.loc[a["free_bytes"].notna(), "ts"].max()]
    assert a["free_bytes"].notna().all() and len(a) == 9 and a["main"].sum() == 1
    live_chunks = 8 * (8192 if mode == "page-pin" else 1) * 1040
    assert a["size"].sum() - a["free_bytes"].sum() == pytest.approx(live_chunks, abs=4 * MiB)


@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["page-pin", "top-pin"])
def test_reproducer_with_one_arena_is_not_flagged(record, arena_bloat_bin, mode):
    out = record_reproducer(record, arena_bloat_bin, mode, MALLOC_ARENA_MAX="1")
    assert detect_arena_bloat(load(out)) == []
    p = pd.read_parquet(out / "processes").iloc[-1]
    assert p["arenas"] == 0 and p["heap_rss"] > 30 * MiB  # everything went to the brk heap


# -- synthetic datasets ------------------------------------------------------------------------

T0 = pd.Timestamp("2026-01-01T00:00:00Z")


def snapshots(resident: list[float], live: list[float], *, stderr: float = 8 * MiB, arenas: int = 8,
              threads: int = 16, limit: int = 8 * GiB) -> pd.DataFrame:
    """Processes rows every 10 s: the brk heap holds 64 MiB, the arenas (2 heaps each, or as
    many 64 MiB heaps as they need) the rest of `resident`."""
    base = PROCESSES.schema.empty_table().to_pandas()
    rows = [{c: 0 for c in base.columns} | {
        "ts": T0 + pd.Timedelta(seconds=10 * i), "recording_id": "rec", "host": "h", "pid": 42, "comm": "svc",
        "threads": threads, "memory_limit": limit, "heap_rss": 64 * MiB, "heap_size": 64 * MiB,
        "arena_rss": int(r - 64 * MiB), "arena_size": int(r - 64 * MiB),
        "arena_heaps": max(2 * arenas, -int(-(r - 64 * MiB) // (64 * MiB))),
        "arenas": arenas, "heap_live_bytes": 0.0, "arena_live_bytes": float(lv),
        "heap_arena_live_stderr_bytes": stderr,
    } for i, (r, lv) in enumerate(zip(resident, live, strict=True))]
    return pd.DataFrame(rows)


def dataset(root: Path, processes: pd.DataFrame, vm_events: list[dict] = (), targets: list[dict] = ()) -> Dataset:
    def frame(table, rows):
        empty = table.schema.empty_table().to_pandas()
        return pd.DataFrame([{c: None for c in empty.columns} | r for r in rows]) if rows else empty

    empty = pd.DataFrame()
    return Dataset(root=root, outstanding=empty, processes=processes, stacks=empty, frames=empty,
                   vm_events=frame(VM_EVENTS, list(vm_events)), targets=frame(TARGETS, list(targets)),
                   recordings=empty)


def heap_grow(i: int, length: int) -> dict:
    return {"ts": T0 + pd.Timedelta(seconds=10 * i - 5), "recording_id": "rec", "pid": 42, "op": "mprotect",
            "event": "heap_grow", "length": length}


def test_bloat_that_forms_during_the_recording_is_flagged(tmp_path):
    # 1.5 GiB resident, 300 MiB live; the arenas grew after the first two snapshots
    resident = [400 * MiB, 400 * MiB] + [1.5 * GiB] * 8
    p = snapshots(resident, [300 * MiB] * 10)
    ds = dataset(tmp_path, p, [heap_grow(2, int(1.5 * GiB - 400 * MiB))])
    (f,) = detect_arena_bloat(ds)
    d = f.details
    last = p.iloc[-1]
    slack = (last["arena_heaps"] + 1) * (4096 + 2200) + 16 * (235 << 10)
    assert f.kind == "arena_bloat" and f.pid == 42 and f.comm == "svc"
    assert d["bloat_bytes"] == pytest.approx(1.5 * GiB - 300 * MiB - slack)
    assert d["bloat_ratio"] == pytest.approx(d["bloat_bytes"] / (1.5 * GiB))
    assert d["windows"] == 8 and d["first_seen"] == p["ts"].iloc[2] and d["last_seen"] == p["ts"].iloc[-1]
    assert d["trimmable_bytes"] is None and d["pinned_bytes"] is None and "unknown" in d["caveats"]
    assert "before" not in d["caveats"] and f.confidence > 0.9
    # MALLOC_ARENA_MAX=2 keeps about 2 of the 9 arenas' share
    assert d["expected_saving_bytes"] == pytest.approx(d["bloat_bytes"] * 7 / 9)
    assert f.severity == pytest.approx(100 * d["bloat_bytes"] / (8 * GiB) * f.confidence)


def test_the_processes_columns_of_a_part_are_enough(tmp_path):
    """analyze.run's parts hold only the `processes` columns the detectors declare
    (analyze.PART_COLUMNS): the finding is the one made from every column."""
    p = snapshots([400 * MiB, 400 * MiB] + [1.5 * GiB] * 8, [300 * MiB] * 10)
    grow = [heap_grow(2, int(1.5 * GiB - 400 * MiB))]
    (whole,) = detect_arena_bloat(dataset(tmp_path, p, grow))
    part = detect_arena_bloat(dataset(tmp_path, p[[c for c in p if c in analyze.PART_COLUMNS]], grow))
    assert [f.to_json() for f in part] == [whole.to_json()]


def test_rising_live_is_a_leak_not_bloat(tmp_path):
    # 2.4 GiB between resident and live throughout, but live grows 100 MiB per snapshot
    resident = [3 * GiB + i * 100 * MiB for i in range(10)]
    live = [600 * MiB + i * 100 * MiB for i in range(10)]
    assert detect_arena_bloat(dataset(tmp_path, snapshots(resident, live))) == []
    # the same gap with live flat is bloat
    assert len(detect_arena_bloat(dataset(tmp_path, snapshots([3 * GiB] * 10, [600 * MiB] * 10)))) == 1


def test_bloat_below_the_thresholds_is_not_flagged(tmp_path):
    # 100 MiB of bloat: under the 256 MiB floor
    assert detect_arena_bloat(dataset(tmp_path, snapshots([400 * MiB] * 10, [300 * MiB] * 10))) == []
    # 800 MiB of bloat but only 40% of resident
    assert detect_arena_bloat(dataset(tmp_path, snapshots([2 * GiB] * 10, [1.2 * GiB] * 10))) == []
    # large, but in 2 consecutive snapshots only
    short = snapshots([400 * MiB] * 4 + [2 * GiB] * 2 + [400 * MiB] * 4, [300 * MiB] * 10)
    assert detect_arena_bloat(dataset(tmp_path, short)) == []
    assert len(detect_arena_bloat(dataset(tmp_path, short), min_windows=2)) == 1
    # thresholds are parameters
    assert len(detect_arena_bloat(dataset(tmp_path, snapshots([400 * MiB] * 10, [300 * MiB] * 10)),
                                  min_bloat=64 * MiB, min_ratio=0.2)) == 1


def test_few_arenas_and_no_heap_growth_is_not_flagged(tmp_path):
    # a single-arena process whose gap never grew: more likely old unsampled data than waste
    assert detect_arena_bloat(dataset(tmp_path, snapshots([2 * GiB] * 10, [200 * MiB] * 10, arenas=1))) == []
    # the same gap formed in heap-commit steps while live stayed flat is bloat
    resident = [300 * MiB] * 2 + [2 * GiB] * 8
    p = snapshots(resident, [200 * MiB] * 10, arenas=1)
    assert len(detect_arena_bloat(dataset(tmp_path, p, [heap_grow(2, 1700 * MiB)]))) == 1


def test_bloat_present_from_the_first_snapshot_gets_the_caveat(tmp_path):
    p = snapshots([1.5 * GiB] * 10, [300 * MiB] * 10)
    (f,) = detect_arena_bloat(dataset(tmp_path, p))
    d = f.details
    assert "already there at the first snapshot" in d["caveats"] and "upper bound" in d["caveats"]
    assert "upper bound" in f.summary
    assert d["pre_attach_bytes"] == 1.5 * GiB and d["bloat_lower_bytes"] == 0
    # the same process started under the recorder (attach, then exec): nothing predates attach
    targets = [{"ts": T0 - pd.Timedelta(seconds=2), "recording_id": "rec", "pid": 42, "event": event,
                "allocators": ["glibc:/lib/libc.so.6"]} for event in ("attach", "exec")]
    (g,) = detect_arena_bloat(dataset(tmp_path, p, targets=targets))
    assert "upper bound" not in g.details["caveats"] and g.details["pre_attach_bytes"] == 0
    assert g.confidence > 1.5 * f.confidence


def test_free_lists_split_trimmable_from_pinned(tmp_path):
    p = snapshots([1.5 * GiB] * 6, [300 * MiB] * 6)
    base = MALLOC_ARENAS.schema.empty_table().to_pandas()
    rows = [{c: None for c in base.columns} | {
        "ts": ts, "recording_id": "rec", "host": "h", "pid": 42, "arena": 0x7F0000000000 + k, "main": k == 0,
        "heaps": 2, "size": 192 * MiB, "rss": 192 * MiB, "swap": 0, "live_bytes": 37.5 * MiB,
        "live_stderr_bytes": MiB, "live_samples": 75, "free_bytes": 150 * MiB, "free_chunks": 1000,
        "top_bytes": MiB, "free_resident_bytes": 150 * MiB, "trimmable_bytes": 120 * MiB,
    } for ts in p["ts"] for k in range(8)]
    DatasetWriter(tmp_path, "rec").write(MALLOC_ARENAS, rows)
    (f,) = detect_arena_bloat(dataset(tmp_path, p))
    d = f.details
    assert d["bloat_basis"] == "free lists" and d["bloat_bytes"] == 8 * 150 * MiB
    assert d["trimmable_bytes"] == 8 * 120 * MiB and d["pinned_bytes"] == 8 * 30 * MiB
    assert d["recommendation"].startswith("call malloc_trim(0)") and d["expected_saving_bytes"] == 8 * 120 * MiB
    # measured bloat does not depend on when blocks were allocated: no upper-bound caveat
    assert "upper bound" not in d["caveats"] and "already there" in d["caveats"]


def _walked_rows(p: pd.DataFrame, walks: set[int]) -> list[dict]:
    """malloc_arenas rows of 8 arenas at every snapshot, their free lists read at `walks` only."""
    base = MALLOC_ARENAS.schema.empty_table().to_pandas()
    return [{c: None for c in base.columns} | {
        "ts": ts, "recording_id": "rec", "host": "h", "pid": 42, "arena": 0x7F0000000000 + k, "main": k == 0,
        "heaps": 2, "size": 192 * MiB, "rss": 192 * MiB, "swap": 0, "live_bytes": 37.5 * MiB,
        "live_stderr_bytes": MiB, "live_samples": 75,
    } | ({"free_bytes": 150 * MiB, "free_chunks": 1000, "top_bytes": MiB, "free_resident_bytes": 150 * MiB,
          "trimmable_bytes": 120 * MiB, "pinned_bytes": 30 * MiB, "pinned_pages": 7680} if i in walks else {})
        for i, ts in enumerate(p["ts"]) for k in range(8)]


def test_a_free_list_walk_stands_for_the_snapshots_after_it(tmp_path):
    """The recorder walks the free lists as their cost allows (sampler/control/pacing.py): a walk's
    figures carry to the snapshots after it, less the resident bytes the heap lost since, and no
    longer than WALK_STANDS_S; the finding says when the lists were read."""
    resident = [1.5 * GiB] * 30 + [1.5 * GiB - 400 * MiB] * 10    # pages returned after the last walk
    p = snapshots(resident, [300 * MiB] * 40)
    DatasetWriter(tmp_path, "rec").write(MALLOC_ARENAS, _walked_rows(p, {0, 10, 20}))
    (f,) = detect_arena_bloat(dataset(tmp_path, p))
    d = f.details
    assert d["bloat_basis"] == "free lists" and d["windows"] == 40
    assert d["bloat_bytes"] == 8 * 150 * MiB - 400 * MiB          # never more than the walk saw
    assert d["free_lists_read_at"] == p["ts"].iloc[20] and "read at 00:03:20 UTC" in d["evidence"]
    assert d["trimmable_bytes"] == 8 * 120 * MiB - 400 * MiB and d["pinned_bytes"] == 8 * 30 * MiB

    # one walk, longer ago than a walk stands for: the last snapshots are sampled estimates again
    stale = tmp_path / "stale"
    DatasetWriter(stale, "rec").write(MALLOC_ARENAS, _walked_rows(p, {0}))
    (f,) = detect_arena_bloat(dataset(stale, p))
    assert f.details["bloat_basis"] == "sampled live" and f.details["free_lists_read_at"] is None
    assert f.details["trimmable_bytes"] is None


def test_one_walk_is_not_two_measured_windows(tmp_path):
    """A measured verdict needs min_measured_windows walks, not one walk carried over as many
    snapshots: a 2-snapshot run of one walk falls back to the sampled rule (3 snapshots)."""
    p = snapshots([1.5 * GiB] * 2, [1.4 * GiB] * 2)       # sampled: no bloat; measured: 1.2 GiB
    DatasetWriter(tmp_path, "rec").write(MALLOC_ARENAS, _walked_rows(p, {0}))
    assert detect_arena_bloat(dataset(tmp_path, p)) == []
    both = tmp_path / "both"
    DatasetWriter(both, "rec").write(MALLOC_ARENAS, _walked_rows(p, {0, 1}))
    (f,) = detect_arena_bloat(dataset(both, p))
    assert f.details["bloat_basis"] == "free lists" and f.details["windows"] == 2
