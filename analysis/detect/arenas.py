"""glibc arena bloat: heap memory that stays resident although no live allocation holds it.

Per process and snapshot (columns of `processes`, docs/schema.md):

    Resident = heap_rss + heap_swap + arena_rss + arena_swap
    Live     = heap_live_bytes + arena_live_bytes      (sampled chunk bytes, standard error s)
    Slack    = (arena_heaps + 1) x (4 KiB + sizeof(malloc_state)) + threads x 235 KiB of tcache
    Bloat    = max(0, Resident - Live - Slack)

When the recorder could read every arena's bins (table `malloc_arenas`), Bloat is instead the
measured resident bytes of free chunks: exact, no sampling noise, and blind to when blocks were
allocated. The recorder walks the bins as often as their cost allows, so a walk's figure stands
for the snapshots after it (up to 5 minutes, less the resident bytes lost since). Either way a
finding needs:

- Bloat >= max(min_bloat, min_ratio x Resident) in >= min_windows consecutive snapshots (the last
  such run; min_measured_windows walks of the free lists suffice): a fixed floor keeps small
  processes quiet, the ratio says most of the heap is waste. The defaults (128 MiB, half) flag the
  8-thread, 32 MiB-per-thread reproducer (tests/workloads/arena_bloat.c) (about 195 MiB of bloat
  in 260 MiB resident) and leave small heaps alone.
- Live flat over the run: a Theil-Sen rise of Live larger than 2 standard errors of the
  difference of its end points and 10% of the bloat is a leak (persistent_growth's business).
- More than 2 secondary arenas, or Resident grown in heap-commit steps (vm_events heap_grow /
  brk_grow) while Live did not: half the final bloat must have formed during the recording.
  Without either, a gap between Resident and Live is more likely unsampled old data than waste;
  a bloat measured from the free lists needs no such guard.

Blocks allocated before the probes were attached are never sampled, so Live is a lower bound and
Bloat an upper bound when the process ran before the recording. Two lower bounds hold anyway:
pre-attach blocks sit in memory committed before attach (at most: [heap] less the brk growth
seen since, arenas less the mprotect growth seen since and at most 64 MiB per heap not reserved
since; nothing after an exec), and they can only be freed later, so the growth of Bloat since its
minimum is new waste. When neither bound reaches the threshold the finding says so (caveats,
summary) and keeps half its confidence; a free-list measurement settles the question.

Trimmable (what malloc_trim(0) would release: whole free pages in bins; the brk top) vs pinned
(free bytes on resident pages that also hold bytes in use) is only known from the free lists.
Sampling alone cannot bound it usefully: one live 1 KiB chunk per page pins every page. With the
free lists read, the recording charged each pinned page's free bytes to the sampled live chunks
on it (outstanding.pinned_bytes, sampler/record/outstanding.py): the finding names the stacks
that pin the most, when their estimate is at least twice its standard error.

severity = 100 x bloat / memory_limit x confidence, the share of the limit that is wasted (as
persistent_growth uses the share of the limit consumed per day). confidence = P(bloat above the
threshold) under the live estimate's normal error (1% of the bloat when measured), times a
factor that reaches 1 at twice min_windows snapshots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.dataset as pds

from analysis.dataset import Dataset, read_table
from analysis.detect.stats import bin_series, normal_sf, theil_sen
from analysis.findings import Finding
from analysis.frames import frames_json, site
from sampler.units import fmt_bytes

HEAP_OVERHEAD = 4096 + 2200           # per heap: heap_info page rounding + sizeof(malloc_state)
TCACHE_PER_THREAD = 235 << 10         # 64 bins x 7 chunks, 24..1032 B: the most a thread caches
COMMIT_EVENTS = ("heap_grow", "brk_grow")
TRIM_EVENTS = ("heap_trim", "brk_trim")
HEAP_MAX = 64 << 20                   # size of a secondary-arena heap
PINNING_SITES = 3                     # stacks named as pinning pages, at most
WALK_STANDS_S = 300.0                 # a free-list walk stands for the snapshots this long after it
PROCESS_COLUMNS = ("ts", "recording_id", "pid", "comm", "rss", "swap", "threads", "memory_limit", "heap_rss",
                   "heap_size", "heap_swap", "arena_rss", "arena_size", "arena_swap", "arena_heaps", "arenas",
                   "heap_live_bytes", "arena_live_bytes", "heap_arena_live_stderr_bytes")    # what it reads


class PinningFinding(Finding):
    """A finding about memory that live objects keep resident (arena_bloat, pymalloc_bloat): its
    stack is the top pinning site's, its sites are shown as numbers."""

    def next_step(self) -> str:
        return self.details.get("recommendation") or ""

    def stack(self) -> list | None:
        sites = self.details.get("pinning_sites") or []
        return sites[0]["frames"] if sites else None

    def numbers(self) -> dict:
        out = {k: v for k, v in super().numbers().items() if k != "pinning_sites"}
        for i, s in enumerate(self.details.get("pinning_sites") or [], 1):
            out[f"pinning_site_{i}"] = s["site"]
            out[f"site_{i}_pinned_bytes"] = s["pinned_bytes"]
            out[f"site_{i}_pinned_stderr_bytes"] = s["pinned_stderr_bytes"]
        return out


@dataclass
class ArenaBloat(PinningFinding):
    """`arena_bloat`: glibc keeps much more heap memory resident than is live."""

    kind: str = field(default="arena_bloat", init=False)

    def facts(self) -> list[str]:
        d = self.details
        return [f"resident {fmt_bytes(d['resident_bytes'])}, live {fmt_bytes(d['live_bytes'])}, "
                f"bloat {fmt_bytes(d['bloat_bytes'])}, {d.get('arenas')} arenas"]


def detect_arena_bloat(ds: Dataset, *, min_bloat: int = 128 << 20, min_ratio: float = 0.5,
                       min_windows: int = 3, min_measured_windows: int = 2) -> list[Finding]:
    """arena_bloat findings, one per process and recording at most."""
    if ds.processes.empty:
        return []
    meta = _free_lists(ds)
    vm, targets = _by_process(ds.vm_events), _by_process(ds.targets)
    findings = []
    for key, p in ds.by_process().items():
        f = _detect(ds, p, key, meta, vm.get(key, ds.vm_events.iloc[:0]),
                    targets.get(key, ds.targets.iloc[:0]), min_bloat, min_ratio, min_windows,
                    min_measured_windows)
        if f is not None:
            findings.append(f)
    return findings


def _by_process(df: pd.DataFrame) -> dict[tuple[str, int], pd.DataFrame]:
    if df.empty:
        return {}
    return {(str(rec), int(pid)): g for (rec, pid), g in df.groupby(["recording_id", "pid"], observed=True)}


def _free_lists(ds: Dataset) -> pd.DataFrame | None:
    """Per (recording, pid, ts) from `malloc_arenas`: free_resident and trimmable (NaN unless
    every arena was read) and `kept`: the bloat left with 2 arenas (the two largest per arena)."""
    rows = read_table(ds.root, "malloc_arenas", filter=pds.field("pid").isin(ds.processes["pid"].unique()))
    if "allocator" in rows:     # glibc's arenas only (null in data written before pymalloc rows: glibc)
        rows = rows[rows["allocator"].isna() | (rows["allocator"] == "glibc")]
    if rows.empty:
        return None
    rows["recording_id"] = rows["recording_id"].astype(str)
    rows["per_arena"] = rows["free_resident_bytes"].astype(float).fillna(
        (rows["rss"] + rows["swap"] - rows["live_bytes"]).clip(lower=0))
    keys = ["recording_id", "pid", "ts"]
    g = rows.groupby(keys)
    if "pinned_bytes" not in rows:          # data written before pinning was measured
        rows["pinned_bytes"] = np.nan
    out = g.agg(free_resident=("free_resident_bytes", "sum"), trimmable=("trimmable_bytes", "sum"),
                pinned=("pinned_bytes", "sum"), n_free=("free_resident_bytes", "count"),
                n_trim=("trimmable_bytes", "count"), n_pin=("pinned_bytes", "count"), n=("pid", "size"))
    out["free_resident"] = out["free_resident"].where(out["n_free"] == out["n"])
    out["trimmable"] = out["trimmable"].where(out["n_trim"] == out["n"])
    out["pinned"] = out["pinned"].where(out["n_pin"] == out["n"])
    top2 = rows.sort_values("per_arena", ascending=False).groupby(keys).head(2)
    out["kept"] = top2.groupby(keys)["per_arena"].sum()
    return out[["free_resident", "trimmable", "pinned", "kept"]].astype(float).reset_index()


def _detect(ds: Dataset, p: pd.DataFrame, key: tuple[str, int], meta: pd.DataFrame | None, vm: pd.DataFrame,
            targets: pd.DataFrame, min_bloat: int, min_ratio: float, min_windows: int,
            min_measured_windows: int) -> Finding | None:
    """The finding for one process in one recording (`p`: its snapshots in time order), or None."""
    rec, pid = key
    execs = targets.loc[targets["event"] == "exec", "ts"]
    if len(execs):                        # an exec replaced the heap: only what followed counts
        p = p[p["ts"] > execs.max()]
    if len(p) < min(min_windows, min_measured_windows):
        return None
    if meta is None:
        p = p.assign(free_resident=np.nan, trimmable=np.nan, pinned=np.nan, kept=np.nan)
    else:
        p = p.assign(recording_id=rec).merge(meta, on=["recording_id", "pid", "ts"], how="left")
    resident = (p["heap_rss"] + p["heap_swap"] + p["arena_rss"] + p["arena_swap"]).to_numpy(float)
    # unknown is not zero: live is null while the process's tier does not see allocations (rss,
    # syscalls); such a snapshot has no sampled bloat, and breaks a run unless the free lists were read
    live = (p["heap_live_bytes"] + p["arena_live_bytes"]).to_numpy(float)
    se = p["heap_arena_live_stderr_bytes"].to_numpy(float)
    slack = ((p["arena_heaps"] + 1) * HEAP_OVERHEAD + p["threads"] * TCACHE_PER_THREAD).to_numpy(float)
    sampled = np.maximum(0.0, resident - live - slack)
    measured, walk = _carried(p, resident)
    known = ~np.isnan(measured)
    bloat = np.where(known, measured, sampled)
    threshold = np.maximum(min_bloat, min_ratio * resident)
    with np.errstate(invalid="ignore"):
        over = bloat >= threshold
    # a measured verdict (free lists read at min_measured_windows walks) needs fewer snapshots
    # than one estimated from samples
    run = _last_run(over, min(min_windows, min_measured_windows))
    if run is not None and run.stop - run.start < min_windows and not (
            known[run].all() and len(np.unique(walk[run])) >= min_measured_windows):
        run = _last_run(over, min_windows)
    if run is None or (not known[run].any() and not _probed(targets)):
        return None
    if np.isnan(live[run]).any():      # the free lists carry the run where live was not measured
        live, se = np.nan_to_num(live), np.nan_to_num(se)
    t = (p["ts"] - p["ts"].iloc[0]).dt.total_seconds().to_numpy()
    first, last = run.start, run.stop - 1
    rise = theil_sen(*bin_series(t[run], live[run], se[run], 200)[:2]) * (t[last] - t[first])
    rise_se = math.hypot(se[first], se[last])
    if rise > 2 * rise_se and rise > 0.1 * float(np.median(bloat[run])):
        return None                       # Live grows: a leak, not bloat
    vm = vm[vm["ts"] <= p["ts"].iloc[last]]
    commits = vm[vm["event"].isin(COMMIT_EVENTS)]
    formed = resident[last] - resident[0] - max(0.0, live[last] - live[0])
    grew = len(commits) > 0 and formed >= 0.5 * bloat[last]
    # glibc never frees an arena, so the recent count is the truth; the median of the last three
    # snapshots ignores a single inflated read (one run counted 9 for the reproducer's 8 arenas)
    arenas = int(np.median(p["arenas"].iloc[run].to_numpy()[-3:]))
    if arenas <= 2 and not grew and not known[last]:
        return None

    pre_attach = 0.0 if len(execs) else _pre_attach(vm, p.iloc[0])
    lower = np.maximum.reduce([np.zeros_like(sampled), sampled - pre_attach,
                               sampled - np.minimum.accumulate(sampled)])
    lower = np.where(known, bloat, lower)
    established = bool(lower[last] >= threshold[last])

    n = run.stop - run.start
    sigma = max(float(se[run].max()), 1.0) if not known[run].all() else max(0.01 * float(bloat[last]), 1.0)
    z = float(np.min(bloat[run] - threshold[run])) / sigma
    confidence = (1 - normal_sf(z)) * (0.5 + 0.5 * min(1.0, n / (2 * min_windows)))
    if not established:
        confidence *= 0.5
    last_row = p.iloc[last]
    walked = p.iloc[walk[last]] if known[last] else last_row   # the free lists' figures: the last walk's
    limit = float(last_row["memory_limit"]) if last_row["memory_limit"] > 0 else 0.0
    b = float(bloat[last])
    severity = min(100.0, 100.0 * b / limit) * confidence if limit else 50 * confidence
    lost = max(0.0, float(resident[walk[last]] - resident[last])) if known[last] else 0.0   # since the walk
    trimmable = None if math.isnan(walked["trimmable"]) else max(0.0, float(walked["trimmable"]) - lost)
    pinned = None if math.isnan(walked["pinned"]) else min(b, float(walked["pinned"]))
    if pinned is None and trimmable is not None:      # older data: everything malloc_trim leaves
        pinned = max(0.0, b - trimmable)
    kept = None if math.isnan(walked["kept"]) else float(walked["kept"])
    sites = pinning_sites(ds, rec, pid, walked["ts"]) if pinned else []
    recommendation, saving = _recommend(b, arenas, trimmable, kept, pinned, sites)
    trims = vm[vm["event"].isin(TRIM_EVENTS) & (vm["ts"] >= p["ts"].iloc[first])]
    r, lv = float(resident[last]), float(live[last])
    summary = (f"{fmt_bytes(b)} of glibc heap memory is resident but not allocated ({b / r:.0%} of "
               f"{fmt_bytes(r)} in [heap] and {arenas} arenas; live {fmt_bytes(lv)}) for {n} snapshots"
               + ("" if established else " (an upper bound: the process allocated before the recording)")
               + (f"; {pinning_text(sites[0])}" if sites else "")
               + f"; {recommendation.split(';')[0]}.")
    return ArenaBloat(pid, str(last_row["comm"]), severity, min(1.0, confidence), summary, {
        "resident_bytes": r, "live_bytes": lv, "live_stderr_bytes": float(se[last]),
        "slack_bytes": float(slack[last]), "bloat_bytes": b, "bloat_lower_bytes": float(lower[last]),
        "bloat_ratio": b / r, "bloat_basis": "free lists" if known[last] else "sampled live",
        "sampled_bloat_bytes": float(sampled[last]), "free_resident_bytes": None if not known[last] else b,
        "arenas": arenas, "arena_heaps": int(last_row["arena_heaps"]), "threads": int(last_row["threads"]),
        "trimmable_bytes": trimmable, "pinned_bytes": pinned, "pinning_sites": sites,
        "pre_attach_bytes": pre_attach, "windows": n, "first_seen": p["ts"].iloc[first],
        "last_seen": p["ts"].iloc[last], "free_lists_read_at": walked["ts"] if known[last] else None,
        "memory_limit_bytes": limit or None, "recommendation": recommendation,
        "expected_saving_bytes": saving, "recording_id": rec,
        "evidence": _evidence(p, run, bloat, threshold, live, se, rise, rise_se, commits, grew, trims,
                              walked["ts"] if known[last] else None, trimmable),
        "caveats": _caveats(bool(bloat[0] >= threshold[0]), established, pre_attach, float(lower[last]),
                            known[last], trimmable),
    })


def _carried(p: pd.DataFrame, resident: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bloat measured from the free lists, the row of the walk it comes from) per snapshot; NaN
    and -1 where none stands. The recorder walks the free lists as often as their cost allows
    (sampler/control/pacing.py), so a walk stands for the snapshots after it, up to WALK_STANDS_S
    later, less the resident bytes the heap lost since (returned pages were free ones); bytes it
    gained are taken as live: a carried figure never exceeds what a walk saw."""
    free = p["free_resident"].to_numpy(float)
    rows = np.maximum.accumulate(np.where(np.isnan(free), -1, np.arange(len(p))))
    j = np.maximum(rows, 0)
    ts = p["ts"].dt.as_unit("us").astype("int64").to_numpy()
    age = (ts - ts[j]) / 1e6
    stands = (rows >= 0) & (age <= WALK_STANDS_S)
    carried = np.maximum(0.0, free[j] - np.maximum(0.0, resident[j] - resident))
    return np.where(stands, carried, np.nan), np.where(stands, rows, -1)


def _last_run(mask: np.ndarray, min_len: int) -> slice | None:
    """The last run of consecutive True of at least `min_len` elements."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    starts, ends = edges[::2], edges[1::2]
    long = np.flatnonzero(ends - starts >= min_len)
    return slice(int(starts[long[-1]]), int(ends[long[-1]])) if len(long) else None


def _probed(targets: pd.DataFrame) -> bool:
    """False when the recording had no allocator probes for the process (--syscalls-only, static
    binary): Live is then 0 by construction, not by measurement."""
    attach = targets[targets["event"] == "attach"]
    return attach.empty or any(a is not None and len(a) > 0 for a in attach["allocators"])


def _pre_attach(vm: pd.DataFrame, first: pd.Series) -> float:
    """Upper bound on the heap bytes committed before attach, hence on what the unsampled blocks
    allocated before attach can occupy at the first snapshot. [heap]: its size less the brk growth
    seen since; arenas: their size less the mprotect growth seen since, and at most 64 MiB per heap
    not reserved since. Rows over the vm_events cap are missing: the bound only gets looser."""
    vm = vm[vm["ts"] <= first["ts"]]
    event = vm["event"]
    brk = vm.loc[vm["op"] == "brk", "result"].to_numpy(float)
    brk_grown = float(np.clip(np.diff(brk), 0, None).sum()) if len(brk) > 1 else 0.0
    arena_grown = float(vm.loc[event == "heap_grow", "length"].sum())
    old_heaps = max(0, int(first["arena_heaps"]) - int((event == "heap_reserve").sum())
                    + int((event == "heap_release").sum()))
    return (max(0.0, float(first["heap_size"]) - brk_grown)
            + min(max(0.0, float(first["arena_size"]) - arena_grown), float(old_heaps * HEAP_MAX)))


def pinning_sites(ds: Dataset, rec: str, pid: int, ts: pd.Timestamp, source: str = "malloc") -> list[dict]:
    """The call sites of `source` whose live blocks pin the most free bytes at the snapshot `ts` (at
    most PINNING_SITES, each estimated at twice its standard error or more), largest first. A
    Python object's site is its innermost Python line: the tuple, str and int one line makes are
    one site (their stacks differ only below it)."""
    rows = read_table(ds.root, "outstanding", filter=(pds.field("pid") == pid) & (pds.field("source") == source)
                      & pds.field("pinned_bytes").is_valid(),
                      columns=["ts", "recording_id", "stack_id", "pinned_bytes", "pinned_stderr_bytes",
                               "outstanding_bytes", "outstanding_stderr_bytes"])
    rows = rows[(rows["recording_id"].astype(str) == rec) & (rows["ts"] == ts)]
    sites: dict[str, dict] = {}
    for r in rows.itertuples():
        frames = frames_json(ds, int(r.stack_id))
        python = [f for f in frames if f.get("kind") == "python"]
        name = site(python[:1] if source == "python" and python else frames)
        s = sites.setdefault(name, {"stack_id": int(r.stack_id), "site": name, "frames": frames, "pinned_bytes": 0.0,
                                    "pinned_var": 0.0, "live_bytes": 0.0, "live_var": 0.0})
        s["pinned_bytes"] += float(r.pinned_bytes)
        s["pinned_var"] += float(r.pinned_stderr_bytes) ** 2
        s["live_bytes"] += float(r.outstanding_bytes)
        s["live_var"] += float(r.outstanding_stderr_bytes) ** 2
    out = []
    for s in sorted(sites.values(), key=lambda s: -s["pinned_bytes"]):
        s["pinned_stderr_bytes"], s["live_stderr_bytes"] = s.pop("pinned_var") ** 0.5, s.pop("live_var") ** 0.5
        if s["pinned_bytes"] >= 2 * s["pinned_stderr_bytes"] and s["pinned_bytes"] > 0:
            out.append(s)
    return out[:PINNING_SITES]


def pinning_text(s: dict) -> str:
    return (f"{s['site']} holds {fmt_bytes(s['live_bytes'])} of live data on {fmt_bytes(s['pinned_bytes'])} of "
            f"otherwise free resident pages (± {fmt_bytes(s['pinned_stderr_bytes'])})")


def _recommend(bloat: float, arenas: int, trimmable: float | None, kept: float | None, pinned: float | None = None,
               sites: list[dict] | None = None) -> tuple[str, float | None]:
    """Concrete actions, the most effective first, and the saving of the best quantified one."""
    options: list[tuple[float, str]] = []
    if sites and pinned is not None and pinned >= 0.25 * bloat:
        charged = sum(x["pinned_bytes"] for x in sites)
        names = ", ".join(x["site"] for x in sites)
        options.append((min(charged, pinned), f"allocate what {names} keep{'s' if len(sites) == 1 else ''} "
                                               f"up front, or from an arena or pool of its own (a separate "
                                               f"allocator instance, one large block carved up): its long-lived "
                                               f"chunks lie among short-lived ones and keep "
                                               f"{fmt_bytes(min(charged, pinned))} of their freed pages resident, "
                                               f"which neither free nor malloc_trim can return"))
    if trimmable is not None and trimmable >= 0.25 * bloat:
        options.append((trimmable, f"call malloc_trim(0) periodically (e.g. after each batch or every minute): "
                                   f"the free lists show {fmt_bytes(trimmable)} of whole free pages it returns"))
    if arenas + 1 > 2:
        # Fragmentation is retained per arena: with 2 arenas roughly the two worst remain.
        remain = min(bloat, kept) if kept is not None else bloat * 2 / (arenas + 1)
        options.append((bloat - remain, f"set MALLOC_ARENA_MAX=2 (GLIBC_TUNABLES=glibc.malloc.arena_max=2): the "
                                        f"bloat is spread over {arenas + 1} arenas and should shrink to about "
                                        f"{fmt_bytes(remain)}, saving ~{fmt_bytes(bloat - remain)} at the cost of "
                                        f"more lock contention between threads"))
    options.sort(key=lambda o: -o[0])
    text = [o[1] for o in options]
    if trimmable is None:
        text.append("malloc_trim(0) returns whole free pages inside arenas: how much is trimmable is unknown, "
                    "as glibc's free lists could not be read consistently in this recording (the process "
                    "changed them during every read)")
    elif trimmable < 0.25 * bloat:
        text.append(f"malloc_trim(0) would return only {fmt_bytes(trimmable)}: the rest is pinned by live chunks "
                    f"scattered over the pages")
    text.append("or preload jemalloc (LD_PRELOAD=libjemalloc.so.2), which returns unused pages to the system "
                "by itself; measure the result, allocator savings vary by workload")
    return "; ".join(text), (options[0][0] if options else None)


def _evidence(p: pd.DataFrame, run: slice, bloat, threshold, live, se, rise: float, rise_se: float,
              commits: pd.DataFrame, grew: bool, trims: pd.DataFrame, read_at: pd.Timestamp | None,
              trimmable: float | None) -> str:
    first, last = run.start, run.stop - 1
    out = [f"bloat >= threshold ({fmt_bytes(threshold[last])}) in {run.stop - run.start} consecutive snapshots "
           f"from {p['ts'].iloc[first]:%H:%M:%S} to {p['ts'].iloc[last]:%H:%M:%S} UTC, "
           f"min {fmt_bytes(float(np.min(bloat[run])))}",
           f"live flat: {fmt_bytes(live[first])} -> {fmt_bytes(live[last])} ± {fmt_bytes(se[last])} "
           f"(trend {fmt_bytes(rise)} vs 2 x {fmt_bytes(rise_se)})"]
    if len(commits):
        out.append(f"{len(commits)} heap commits (heap_grow/brk_grow) during the recording"
                   + (" while live did not grow" if grew else ""))
    if len(trims):
        out.append(f"{len(trims)} trims (madvise in heaps, {fmt_bytes(float(trims['length'].sum()))}) during the run "
                   f"and the bloat stayed")
    if read_at is not None:
        out.append(f"bloat measured from glibc's free lists (resident bytes in free chunks and top chunks, read at "
                   f"{read_at:%H:%M:%S} UTC)"
                   + ("" if trimmable is None else f", {fmt_bytes(trimmable)} of it in whole pages malloc_trim "
                                                   f"would return"))
    return "; ".join(out) + "."


def _caveats(from_first: bool, established: bool, pre_attach: float, lower: float, measured: bool,
             trimmable: float | None) -> str:
    out = []
    if from_first:
        out.append("the bloat was already there at the first snapshot")
    if not established:
        out.append(f"blocks allocated before the probes were attached are never sampled, and up to "
                   f"{fmt_bytes(pre_attach)} of heap memory was committed before attach: Live is a lower bound, "
                   f"so the bloat is an upper bound; what the recording proves is at least {fmt_bytes(lower)} "
                   f"(growth since its minimum). A recording from process start (record -- CMD) or with the "
                   f"free lists readable settles it")
    elif from_first and not measured:
        out.append(f"blocks allocated before attach are not sampled, but at most {fmt_bytes(pre_attach)} of the "
                   f"heap predates the recording, which leaves at least {fmt_bytes(lower)} of bloat")
    if trimmable is None:
        out.append("trimmable vs pinned is unknown: sampled live blocks do not show which pages hold them")
    out.append("slack (arena headers, per-thread tcache) is an estimate")
    text = "; ".join(out)
    return text[0].upper() + text[1:] + "."
