"""Persistent growth: which stacks keep growing, and is RSS growth explained by them.

Each (process, source, stack) gives a series of outstanding-bytes estimates y_t with standard
errors s_t (from the sampling weights). The classification uses three pieces of evidence:

1. Growth beyond sampling noise: the level at the end minus the level at the start (medians over
   the first and last tenth of the window) against the noise of a change: the sampled blocks
   born or freed in between (alloc_samples + free_samples) times the per-sample variance term.
   A leak's change is made of new samples only; a busy bounded cache churns many samples at a
   constant level, so its changes are correctly judged noisy. Needs z >= 3.
2. A monotone trend: Mann-Kendall p < 0.01 once there are >= 8 points (robust, rank-based; it
   ignores the size of sampling spikes). Shorter series must simply never drop by more than
   2 standard errors, so a leak of a few MB/s is flagged within 3-4 snapshots (~30 s).
3. Still held: growth that stopped is a leak that paused (held growth: a client's idle time, a
   recording that runs through a quiet hour) unless the flat part lasts at least half as long
   as the growth before it (PLATEAU_RATIO), which is what a bounded cache shows (deque(maxlen=N)
   fills in seconds and holds for minutes): a plateau. A flat end is the longest end of the window over which the
   series grew by less than 2 change-noise errors and by at least 4 less than the pace before
   it would have added (errors of that pace's own noise): a tail that is only noisy (few
   samples) is not flat. Growth made of one
   step (a large block allocated once) is not a leak either.
Drops by more than max(3 s, 20% of the running maximum) mark batching: two or more make a
sawtooth, which is reported as a leak only when its troughs rise significantly. A leak's rate
is its slope over the growth (to the end, or to the pause), with the standard error of that
growth's change noise.

Theil-Sen and Mann-Kendall are O(n^2): long series are binned to at most 200 points first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.dataset import Dataset
from analysis.detect.coverage import allocator_growth
from analysis.detect.stats import bin_series, bin_starts, mann_kendall, median, normal_sf, theil_sen, theil_sen_interval
from analysis.findings import Finding
from analysis.frames import ALLOCATOR_MODULES, cause_representatives, frames_json, site, site_key
from analysis.series import ProcessSums, StackSeries, read_series
from analysis.units import fmt_duration, fmt_hours, fmt_rate
from sampler.dataset.sources import ALLOCATION_TIERS, FAULT, GPU_SOURCES, MALLOC, MMAP, PYTHON, RSS, TORCH
from sampler.units import fmt_bytes

MiB = 1 << 20


PLATEAU_RATIO = 0.5        # a flat end at least this long compared with the growth before it: a plateau


@dataclass(frozen=True)
class Trend:
    classification: str        # leak | plateau | sawtooth | noise | insufficient
    pattern: str               # linear | sawtooth | held (a leak that paused)
    rate: float                # bytes per second over the growth (leak), else overall slope
    growth: float              # bytes over the window
    z: float                   # growth / its sampling error
    tail_z: float              # the rate's: its growth / that growth's sampling error
    mk_p: float
    drops: int
    confidence: float
    paused_s: float = 0.0      # held: seconds of the flat end (the growth stopped that long before the end)


def classify(t: np.ndarray, y: np.ndarray, s: np.ndarray, churn: np.ndarray | None = None,
             live: np.ndarray | None = None, *, z_min: float = 3.0,
             alpha: float = 0.01, max_points: int = 200) -> Trend:
    """Classify one series: t seconds, y outstanding bytes, s their stderr; churn = sampled
    allocations + frees of the stack since the previous point, live = live samples.

    The change of the estimate between two snapshots is a Horvitz-Thompson sum over the sampled
    blocks born or freed in between, so its variance is (their count) x (the per-sample variance
    term): the noise of a *change*, which the snapshots' own stderrs overstate for a leak (shared
    samples) and cannot see for a busy cache (turnover at a constant level). Without churn counts
    the conservative sqrt(s_a^2 + s_b^2) is used."""
    if len(t) < 3 or t[-1] <= t[0]:
        return INSUFFICIENT
    t, y, s = (np.asarray(a, float) for a in (t, y, s))
    cum = np.cumsum(churn) if churn is not None else None
    var1 = 0.0
    if cum is not None and live is not None and np.sum(live) > 0:
        var1 = float(np.sum(s ** 2) / np.sum(live))
    held = None if live is None else np.asarray(live, float)
    if len(t) > max_points:
        if cum is not None:     # churn up to the end of each bin, aligned with the binned points
            cum = cum[np.append(bin_starts(t, max_points)[1:], len(t)) - 1]
        if held is not None:
            _, held, _ = bin_series(t, held, np.zeros_like(held), max_points)
        t, y, s = bin_series(t, y, s, max_points)
    return classify_points(t, y, s, cum, var1, held, z_min=z_min, alpha=alpha)


INSUFFICIENT = Trend("insufficient", "linear", 0.0, 0.0, 0.0, 0.0, 1.0, 0, 0.0)


def classify_points(t: np.ndarray, y: np.ndarray, s: np.ndarray, cum: np.ndarray | None, var1: float,
                    live: np.ndarray | None = None, *, z_min: float = 3.0, alpha: float = 0.01) -> Trend:
    """`classify` of a series already binned (at most max_points points): `cum` the sampled
    allocations + frees up to the end of each point, `var1` the per-sample variance term (0:
    unknown, the conservative change noise instead), `live` the live samples at each point.

    The samples that change the estimate from a to b are those born since and live at b, and
    those live at a and freed since: at most the churn between them, and at most the live samples
    at a and b together (a block born and freed in between changes nothing: under heavy churn of
    short-lived blocks the churn alone overstates the noise of a slow leak beside it)."""
    n = len(t)

    def sigma(a: int | np.ndarray, b: int | np.ndarray) -> np.ndarray:
        if var1 > 0:
            moved = cum[b] - cum[a]
            if live is not None:
                moved = np.minimum(moved, live[a] + live[b])
            return np.sqrt(var1 * np.maximum(moved, 1.0))
        return np.hypot(s[a], s[b])

    idx = np.arange(n)
    pair = sigma(idx[:-1], idx[1:])
    step = np.diff(y)
    running_max = np.maximum.accumulate(y)[:-1]
    drop = -step > np.maximum(3 * pair, 0.2 * running_max)
    drops = int(drop.sum())

    if drops >= 2:
        # troughs: the first point and every point right after a drop
        tr_idx = np.concatenate(([0], np.nonzero(drop)[0] + 1))
        beta = theil_sen(t[tr_idx], y[tr_idx]) if len(tr_idx) >= 3 else 0.0
        growth = beta * (t[tr_idx[-1]] - t[0])
        z = growth / max(float(sigma(0, tr_idx[-1])), 1.0)
        if len(tr_idx) >= 3 and z >= z_min:
            return Trend("leak", "sawtooth", beta, growth, z, z, 1.0, drops, _confidence(z, z, None))
        return Trend("sawtooth", "sawtooth", beta, growth, z, 0.0, 1.0, drops, 0.0)

    beta = theil_sen(t, y)
    # growth: level at the end minus level at the start (medians over a tenth of the window each),
    # so that grew-then-flat still counts as growth before the tail test
    span = (t[-1] - t[0]) / 10
    head, end = np.nonzero(t <= t[0] + span)[0], np.nonzero(t >= t[-1] - span)[0]
    growth = median(y[end]) - median(y[head])
    z = growth / max(float(sigma(head[len(head) // 2], end[len(end) // 2])), 1.0)
    _, mk_p = mann_kendall(y)
    # short series: no drop beyond noise instead of a rank test that needs more points
    trending = mk_p < alpha if n >= 8 else bool((step >= -2 * pair).all()) and y[-1] > y[0]
    if not (z >= z_min and trending):
        return Trend("noise", "linear", beta, growth, z, 0.0, mk_p, drops, 0.0)

    end = _flat_end(t, y, sigma)
    stop = n - 1 if end is None else end
    paused = t[-1] - t[stop]
    if end is not None and paused >= PLATEAU_RATIO * (t[stop] - t[0]):
        return Trend("plateau", "linear", beta, growth, z, 0.0, mk_p, drops, 0.0, paused)
    if _one_step(t[:stop + 1], y[:stop + 1]):
        return Trend("plateau", "linear", beta, growth, z, 0.0, mk_p, drops, 0.0)
    if end is None:
        # the rate: over the whole window, or over its last half when growth started late
        half = t >= t[-1] - (t[-1] - t[0]) / 2
        late = theil_sen(t[half], y[half]) if half.sum() >= 3 else -math.inf
        rate, first = (late, int(np.argmax(half))) if late > beta else (beta, 0)
    else:
        first = 0
        rate = theil_sen(t[:stop + 1], y[:stop + 1])
    if rate <= 0:
        return Trend("plateau", "linear", beta, growth, z, 0.0, mk_p, drops, 0.0)
    rate_z = rate * (t[stop] - t[first]) / max(float(sigma(first, stop)), 1.0)
    return Trend("leak", "linear" if end is None else "held", rate, growth, z, rate_z, mk_p, drops,
                 _confidence(z, rate_z, mk_p if n >= 8 else None), paused if end is not None else 0.0)


def _flat_end(t: np.ndarray, y: np.ndarray, sigma) -> int | None:
    """Where the series' flat end starts (see the module doc), None when it has none."""
    found = None
    n = len(t)
    for k in range(n - 2, 0, -1):
        grown = y[-1] - y[k]
        noise = float(sigma(k, n - 1))
        expected = (y[k] - y[0]) / (t[k] - t[0]) * (t[-1] - t[k])
        # had it gone on at its pace, its change noise would have grown with it (few samples in a
        # short end are that noise, not a pause)
        noise_on = float(sigma(0, k)) * math.sqrt((t[-1] - t[k]) / (t[k] - t[0]))
        if grown < 2 * noise and expected - grown >= 4 * max(noise, noise_on):
            found = k
    return found


def _one_step(t: np.ndarray, y: np.ndarray) -> bool:
    """The growth is one step (a large block allocated once): it holds most of the growth and came
    faster than the average pace (a step that only spans a long interval is the same pace)."""
    steps = np.diff(y)
    grown = y[-1] - y[0]
    if not len(steps) or grown <= 0:
        return False
    k = int(np.argmax(steps))
    pace = grown / (t[-1] - t[0])
    return bool(steps[k] > (0.5 if len(steps) >= 5 else 0.8) * grown and steps[k] / (t[k + 1] - t[k]) > 1.5 * pace)


def _confidence(z: float, tail_z: float, mk_p: float | None) -> float:
    p = max(normal_sf(z), normal_sf(tail_z), mk_p or 0.0)
    return min(0.999, max(0.0, 1.0 - p))


def _seconds(ts: pd.Series) -> np.ndarray:
    """Seconds since the first, as pandas' total_seconds computes them (whole seconds plus the
    rest over the unit's count per second: below 2**53 ticks, exactly), without making a Series
    of timedeltas (a tenth of the time)."""
    v = ts.array.asi8
    if not len(v):
        return np.zeros(0)
    per = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}[ts.dt.unit]
    whole, rest = np.divmod(v - v[0], per)
    return whole + rest / per


def classify_series(ds: Dataset, *, min_bytes: float = 1 * MiB) -> pd.DataFrame:
    """One row per (recording, pid, source, stack) whose outstanding reached `min_bytes`: its
    classification and numbers. A stack absent from a snapshot has nothing outstanding (0).

    The rows are read as binned series in two streaming passes (analysis/series.py): memory is
    the processes' snapshot times and at most 200 points per stack, not the table."""
    streamed, sums = _streamed(ds, min_bytes)
    merged: dict[int, list[int]] = {}
    for other, rep in ds.derived["reps"].items():
        merged.setdefault(rep, []).append(other)
    rows = []
    for x in streamed:
        tr = (classify_points(x.t, x.y, x.s, x.cum, x.var1, x.live) if x.points >= 3 and x.window_s > 0
              else INSUFFICIENT)
        ends = pd.Timestamp(x.ends_us, unit="us", tz="UTC")
        rows.append({
            "recording_id": x.recording_id, "pid": x.pid, "comm": sums[(x.recording_id, x.pid)].comm,
            "source": x.source, "stack_id": x.stack_id,
            "classification": tr.classification, "pattern": tr.pattern, "rate_bytes_per_s": tr.rate,
            "growth_bytes": tr.growth, "z": tr.z, "tail_z": tr.tail_z, "mk_p": tr.mk_p, "drops": tr.drops,
            "confidence": tr.confidence, "paused_s": tr.paused_s,
            "outstanding_bytes": x.y_last, "outstanding_stderr_bytes": x.s_last,
            "first_seen": pd.Timestamp(x.first_us, unit="us", tz="UTC"), "last_seen": ends,
            "measured_until": ends if x.ends_us != x.last_us else None,
            "window_s": x.window_s, "points": x.points, "merged_stack_ids": merged.get(x.stack_id),
        })
    if not rows:
        return pd.DataFrame(columns=["recording_id", "pid", "source", "stack_id", "classification"])
    return pd.DataFrame(rows)


SUM_KINDS = ("allocations", MMAP, FAULT)
# the `processes` columns this module reads (analyze.run's parts hold only what detectors read)
PROCESS_COLUMNS = ("ts", "recording_id", "pid", "comm", "rss", "memory_limit", "heap_rss", "arena_rss", "anon_rss",
                   "file_rss", "stack_rss", "malloc_outstanding_bytes", "python_outstanding_bytes",
                   "malloc_in_use_bytes", "heap_live_bytes", "arena_live_bytes", "heap_arena_live_stderr_bytes")


def _streamed(ds: Dataset, min_bytes: float = 1 * MiB) -> tuple[list[StackSeries], dict[tuple[str, int], ProcessSums]]:
    """The stacks' series and the processes' sums (series.read_series), once per dataset."""
    key = ("series", min_bytes)
    if key not in ds.derived:
        tiers = _tiers(ds)
        frames = ds.frames

        def merge(stacks: np.ndarray) -> dict[int, int]:
            ds.derived["reps"] = cause_representatives(frames[frames["stack_id"].isin(stacks)])
            return ds.derived["reps"]

        libc = set(frames.loc[(frames["depth"] == 0) & frames["module"].astype(str).str.startswith("libc.so"),
                              "stack_id"])
        libc_ids = np.fromiter(libc, np.int64, len(libc))

        def kinds(src: np.ndarray, stack: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
            code = {n: i for i, n in enumerate(names)}
            # the mmaps made outside the allocator: glibc's own large-chunk mmaps count under malloc
            return {"allocations": np.isin(src, [code.get(MALLOC, -2), code.get(PYTHON, -2)]),
                    MMAP: (src == code.get(MMAP, -2)) & ~np.isin(stack, libc_ids),
                    FAULT: src == code.get(FAULT, -2)}

        ds.derived[key] = read_series(ds.batches, ds.exits(),
                                      lambda rec, pid, grid: _measured(tiers.get((rec, pid)), grid),
                                      merge, kinds, min_bytes=min_bytes, grid_kinds=("allocations",))
        ds.derived.setdefault("reps", {})
    return ds.derived[key]


# Which sources a tier measures (sampler/dataset/sources.py): allocations only in the allocation
# tiers, page faults only in the always-on tier; mmap and the GPU sources in every tier.
ALLOCATION_SOURCES = (MALLOC, PYTHON, TORCH)


def _tiers(ds: Dataset) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(recording, pid) -> (snapshot times in us, tier at each) from `processes`."""
    p = ds.tiers()
    if p.empty or "tier" not in p or set(p["tier"].dropna().astype(str).unique()) <= set(ALLOCATION_TIERS):
        return {}       # every snapshot measured allocations (and no page faults were sampled)
    out = {}
    p = p[["recording_id", "pid", "ts", "tier"]].sort_values("ts")
    for (r, pid), g in p.groupby(["recording_id", "pid"], observed=True):
        out[(str(r), int(pid))] = (g["ts"].dt.as_unit("us").astype("int64").to_numpy(),
                                   g["tier"].astype(object).fillna("").astype(str).to_numpy())
    return out


def _measured(tiers: tuple[np.ndarray, np.ndarray] | None, grid: np.ndarray) -> dict[str, np.ndarray]:
    """Per source whose measurement depends on the tier: which snapshots of `grid` measured it (a
    snapshot without a `processes` row or a tier, as in older data, counts as measured)."""
    if tiers is None:
        return {}
    ts, tier = tiers
    at = np.searchsorted(ts, grid)
    found = (at < len(ts)) & (ts[np.minimum(at, len(ts) - 1)] == grid)
    t = np.where(found, tier[np.minimum(at, len(ts) - 1)], "")
    unknown = ~found | (t == "")
    return {**dict.fromkeys(ALLOCATION_SOURCES, unknown | np.isin(t, ALLOCATION_TIERS)), FAULT: unknown | (t == RSS)}


def merge_causes(out: pd.DataFrame, reps: dict[int, int]) -> pd.DataFrame:
    """Outstanding rows with each stack replaced by the one that stands for it (frames.
    cause_representatives) and rows of one snapshot, source and cause summed (variances add:
    different stacks are sampled independently)."""
    if not reps:
        return out
    src = np.fromiter(reps.keys(), np.int64, len(reps))
    dst = np.fromiter(reps.values(), np.int64, len(reps))
    order = np.argsort(src)
    src, dst = src[order], dst[order]
    sid = out["stack_id"].to_numpy(np.int64)
    pos = np.minimum(np.searchsorted(src, sid), len(src) - 1)
    hit = src[pos] == sid
    involved = hit | np.isin(sid, dst)
    m = out[involved]
    m = m.assign(stack_id=np.where(hit, dst[pos], sid)[involved], var=m["outstanding_stderr_bytes"] ** 2)
    sums = {c: "sum" for c in ("outstanding_bytes", "var", "live_samples", "alloc_samples", "free_samples")
            if c in m}
    g = m.groupby(["recording_id", "pid", "ts", "source", "stack_id"], observed=True, sort=False)
    merged = g.agg({**sums, "comm": "last"}).reset_index()
    merged["outstanding_stderr_bytes"] = np.sqrt(merged.pop("var"))
    return pd.concat([out[~involved], merged[[c for c in out.columns if c in merged]]], ignore_index=True)


def _process_trend(ds: Dataset, rec: str, pid: int) -> dict:
    """RSS at the end, the limit, and the RSS slope over the last half of the window with its 95%
    interval: an OOM projection rests on a trend that is still rising at the end."""
    p = ds.by_process().get((str(rec), int(pid)))
    if p is None or len(p) < 2:
        return {}
    t, rss, _ = _binned(p)
    tail = t >= t[-1] - (t[-1] - t[0]) / 2
    if tail.sum() < 4:
        tail = np.arange(len(t)) >= len(t) - 4
    last = p.iloc[-1]
    return {"rss": float(last["rss"]), "limit": _limit(last["memory_limit"]),
            "rss_slope": theil_sen(t[tail], rss[tail]), "rss_slope_ci": theil_sen_interval(t[tail], rss[tail])}


def _limit(v) -> float:
    """The memory limit, 0 when unknown (null in merged or older datasets)."""
    return float(v) if pd.notna(v) and v > 0 else 0.0


def _binned(p: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RSS of a process over time, binned to at most 200 points (the tests are O(n^2))."""
    t = _seconds(p["ts"])
    rss = p["rss"].to_numpy(float)
    return bin_series(t, rss, np.zeros_like(rss), 200)


def time_to_oom_hours(rss: float, limit: float, rss_slope: float, leak_rate: float) -> tuple[float | None, str]:
    """Hours until RSS reaches the limit: from the RSS trend when RSS grows, else assuming the
    leak adds to RSS at its own rate."""
    if limit <= 0 or rss >= limit:
        return (0.0, "rss_at_limit") if limit > 0 else (None, "")
    if rss_slope > 0:
        return (limit - rss) / rss_slope / 3600, "rss_trend"
    if leak_rate > 0:
        return (limit - rss) / leak_rate / 3600, "leak_rate"
    return None, ""


@dataclass(frozen=True)
class OomProjection:
    hours: float | None          # at the estimated rate; None: no projection
    low: float | None            # at the fastest rate of the 95% interval
    high: float | None           # at the slowest; None: the slowest plausible rate is not growth
    basis: str                   # rss_trend | leak_rate | rss_at_limit | ""

    def text(self, limit: float) -> str:
        if self.hours is None:
            return ""
        if self.basis == "rss_at_limit":
            return f"; the process is at its {fmt_bytes(limit)} limit"
        span = (f"{fmt_hours(self.low or 0.0)} to {fmt_hours(self.high)}" if self.high is not None
                else f"at least {fmt_hours(self.low or 0.0)}")
        return (f"; at the {'RSS trend' if self.basis == 'rss_trend' else 'leak rate'} of the end of the window "
                f"the process reaches its {fmt_bytes(limit)} limit in {fmt_hours(self.hours)} ({span}, 95%)")


NO_PROJECTION = OomProjection(None, None, None, "")


def project_oom(trend: dict, rate: float, rate_lo: float, rate_hi: float, held: bool = False) -> OomProjection:
    """When RSS reaches the limit: from RSS's own slope over the end of the window when that is
    significantly rising, else from the leak's rate (`rate_lo`..`rate_hi`: its 95% interval)
    assuming it adds to RSS; no projection from a trend that is not rising at the end, nor for
    growth that paused before it (`held`)."""
    rss, limit = trend.get("rss", 0.0), trend.get("limit", 0.0)
    if limit <= 0:
        return NO_PROJECTION
    if rss >= limit:
        return OomProjection(0.0, 0.0, 0.0, "rss_at_limit")
    lo, hi = trend.get("rss_slope_ci", (0.0, 0.0))
    slope = trend.get("rss_slope", 0.0)
    if held:
        return NO_PROJECTION        # a pause is no trend: when it grows again, and how fast, is unknown
    if lo > 0 and slope > 0:
        basis, rate, rate_lo, rate_hi = "rss_trend", slope, lo, hi
    elif rate > 0 and rate_lo > 0:
        basis = "leak_rate"
    else:
        return NO_PROJECTION
    room = (limit - rss) / 3600
    return OomProjection(room / rate, room / rate_hi if math.isfinite(rate_hi) else 0.0,
                         room / rate_lo if rate_lo > 0 else None, basis)


@dataclass
class PersistentGrowth(Finding):
    """`persistent_growth`: a stack whose outstanding bytes keep growing to the end of the window."""

    kind: str = field(default="persistent_growth", init=False)

    def facts(self) -> list[str]:
        d = self.details
        oom = d.get("time_to_oom_hours")
        return [f"outstanding {fmt_bytes(d['outstanding_bytes'])} ± {fmt_bytes(d['outstanding_stderr_bytes'])}, "
                f"growth {fmt_rate(d['growth_bytes_per_hour'], d.get('growth_stderr_bytes_per_hour'))}"
                + (f", OOM in {fmt_hours(oom)} ({d['time_to_oom_basis']})" if oom is not None else "")]

    def next_step(self) -> str:
        if self.details.get("attribution") == "first_touch":
            return ("These stacks first wrote the pages; in the page-fault tier the allocating stack is not seen. "
                    f"Record the process with `allocsampler record --pid {self.pid}` (a sampler injected at "
                    "in-process cost) to see what allocates them and from where.")
        return ("Find who keeps references to these allocations (the innermost frames are the allocation site); "
                "compare with `allocsampler top` over time.")


@dataclass
class UnexplainedGrowth(Finding):
    """`unexplained_growth`: RSS grows and the sampled allocations do not explain it."""

    kind: str = field(default="unexplained_growth", init=False)

    def facts(self) -> list[str]:
        regions = ", ".join(f"{k[:-4]} {fmt_bytes(v)}" for k, v in self.details["region_growth_bytes"].items() if v)
        return [f"region growth: {regions}"]

    def next_step(self) -> str:
        return "The summary names the region that grew; the `processes` table has it per snapshot."


def detect_growth(ds: Dataset, series: pd.DataFrame | None = None) -> list[Finding]:
    """persistent_growth findings (leaks), one per cause, and unexplained_growth when RSS grows
    beyond what the sampled allocations account for."""
    series = classify_series(ds) if series is None else series
    findings: list[Finding] = []
    trends: dict[tuple, dict] = {}
    # GPU sources are gpu_growth findings (analysis/detect/gpu.py), with the device as the limit
    leaks = series[(series["classification"] == "leak") & ~series["source"].astype(str).isin(GPU_SOURCES)] \
        if len(series) else series
    leaks = one_per_cause(ds, leaks, series)
    for r in leaks.itertuples() if len(leaks) else ():
        pt = trends.setdefault((r.recording_id, r.pid), _process_trend(ds, r.recording_id, r.pid))
        rate_h = r.rate_bytes_per_s * 3600
        # the rate's 95% interval from its sampling noise over the sustained part (tail_z >= 3)
        se = rate_stderr(r.rate_bytes_per_s, r.tail_z)
        margin, se_h = 1.96 * se, se * 3600
        held = r.pattern == "held"
        oom = project_oom(pt, r.rate_bytes_per_s, r.rate_bytes_per_s - margin, r.rate_bytes_per_s + margin, held)
        frames = frames_json(ds, r.stack_id)
        where = site(frames)
        limit = pt.get("limit", 0)
        severity = min(100.0, 100.0 * rate_h * 24 / limit) * r.confidence if limit else 50 * r.confidence
        holds = f"{fmt_bytes(r.outstanding_bytes)} ± {fmt_bytes(r.outstanding_stderr_bytes)}"
        until = None if pd.isna(r.measured_until) else pd.Timestamp(r.measured_until)
        if r.source == FAULT and r.attribution == "first_touch":
            text = (f"pages first touched by {where} hold {holds} (fault: page faults show the code that first "
                    f"wrote memory, not what allocated it) and "
                    + growth_phrase(rate_h, r.pattern, r.paused_s, "window", plural=True, stderr_h=se_h))
        else:
            text = (f"{where} holds {holds} ({r.source}) and "
                    + growth_phrase(rate_h, r.pattern, r.paused_s,
                                    "window" if until is None else
                                    f"measured window (not measured since {until:%H:%M:%S} UTC, "
                                    f"when the process left the tier that sees it)", stderr_h=se_h))
        text += oom.text(limit)
        findings.append(PersistentGrowth(
            r.pid, r.comm, severity, r.confidence, text + ".",
            {"source": r.source, "stack_id": int(r.stack_id), "frames": frames,
             "growth_bytes_per_hour": rate_h, "growth_stderr_bytes_per_hour": se_h,
             "outstanding_bytes": r.outstanding_bytes,
             "outstanding_stderr_bytes": r.outstanding_stderr_bytes, "first_seen": r.first_seen,
             "last_seen": r.last_seen, "measured_until": until,
             "time_to_oom_hours": oom.hours, "time_to_oom_low_hours": oom.low, "time_to_oom_high_hours": oom.high,
             "time_to_oom_basis": oom.basis or None, "memory_limit_bytes": limit or None, "pattern": r.pattern,
             "paused_s": r.paused_s or None,
             "classification": "leak", "attribution": r.attribution, "also_seen_as": r.also_seen_as,
             "merged_stack_ids": r.merged_stack_ids, "z": r.z, "recording_id": r.recording_id}))
    findings += _unexplained(ds, series)
    return findings


def rate_stderr(rate_bytes_per_s: float, tail_z: float) -> float:
    """A leak rate's standard error (bytes/s) from its sampling noise over the sustained part."""
    return rate_bytes_per_s / max(tail_z, 1e-9)


def growth_phrase(rate_h: float, pattern: str, paused_s: float, window: str, plural: bool = False,
                  stderr_h: float | None = None) -> str:
    """How a leak grows, in words: to the end of the `window`, in a sawtooth, or held since it paused."""
    if pattern == "held":
        return (f"grew {fmt_rate(rate_h, stderr_h)}, then held all of it for the last {fmt_duration(paused_s)} of "
                f"the {window} (paused, not freed)")
    return (f"grow{'' if plural else 's'} {fmt_rate(rate_h, stderr_h)} to the end of the {window}"
            + (" in a sawtooth" if pattern == "sawtooth" else ""))


def one_per_cause(ds: Dataset, leaks: pd.DataFrame, series: pd.DataFrame) -> pd.DataFrame:
    """The leak series that are causes of their own, with `attribution` and `also_seen_as`.
    Memory seen through two sources is one cause: the page faults inside a sampled mapping carry
    the mapping's stack (sampler/record/recorder.py), and the resident view (fault) stands for
    both; an allocator's own mappings (glibc's mmapped chunks, jemalloc's extents: an mmap whose
    site is in the allocator) hold the blocks that the malloc source counts, when it was measured."""
    if leaks.empty:
        return leaks.assign(attribution=None, also_seen_as=None)
    kind = series["source"].astype(str)

    def keys(source: str, cols: tuple[str, ...]) -> set:
        return set(zip(*(series.loc[kind == source, c] for c in cols), strict=True))

    mapped = keys(MMAP, ("recording_id", "pid", "stack_id"))
    with_malloc = keys(MALLOC, ("recording_id", "pid"))
    fault_leaks = {(r.recording_id, r.pid, r.stack_id) for r in leaks.itertuples() if r.source == FAULT}
    if "site_module" not in ds.derived:          # parts share `derived`: once per dataset
        f = ds.frames
        ds.derived["site_module"] = f[f["depth"] == 0].drop_duplicates("stack_id").set_index("stack_id")["module"]
    site_module = ds.derived["site_module"]
    keep, attribution, also = [], [], []
    for r in leaks.itertuples():
        k = (r.recording_id, r.pid, r.stack_id)
        by_allocator = bool(ALLOCATOR_MODULES.match(str(site_module.get(r.stack_id, ""))))
        keep.append(not (r.source == MMAP and (k in fault_leaks or (by_allocator and k[:2] in with_malloc))))
        attribution.append("first_touch" if r.source == FAULT and k not in mapped else "allocation")
        also.append(MMAP if r.source == FAULT and k in mapped else None)
    out = leaks.assign(attribution=attribution, also_seen_as=also)[np.array(keep)]
    return _across_sources(ds, out)


def _across_sources(ds: Dataset, leaks: pd.DataFrame) -> pd.DataFrame:
    """One finding for the same code seen through different sources (frames.site_key): malloc
    until a tier change and its page faults after it, an allocator's extent and the allocations
    carved from it. The series measured last stands for the others (its rate is the current one);
    series of one source are separate causes and all stay."""
    if len(leaks) < 2:
        return leaks
    leaks = leaks.assign(_key=[(r.recording_id, r.pid, site_key(frames_json(ds, r.stack_id)))
                               for r in leaks.itertuples()])
    drop = set()
    for _, g in leaks.groupby("_key", sort=False):
        if g["source"].nunique() < 2:
            continue
        lead = g.sort_values(["last_seen", "rate_bytes_per_s"]).index[-1]
        others = g[(g.index != lead) & (g["source"] != g.at[lead, "source"])]
        if others.empty:
            continue
        drop |= set(others.index)
        seen = [str(x) for x in ([leaks.at[lead, "also_seen_as"]] if leaks.at[lead, "also_seen_as"] else [])]
        leaks.at[lead, "also_seen_as"] = ", ".join(dict.fromkeys(seen + [str(x) for x in others["source"]]))
        ids = list(leaks.at[lead, "merged_stack_ids"] or []) + [int(x) for x in others["stack_id"]]
        leaks.at[lead, "merged_stack_ids"] = ids
    return leaks.drop(index=list(drop)).drop(columns="_key")


def _unexplained(ds: Dataset, series: pd.DataFrame) -> list[Finding]:
    """RSS growth that the sampled stacks do not account for."""
    findings = []
    p = ds.processes
    if p.empty or ds.sources:      # with a source filter the sampled side is incomplete: no verdict
        return findings
    sampled_growth = _sampled_growth(ds)
    for (rec, pid), g in ds.by_process().items():
        if len(g) < 4:
            continue
        t, rss, _ = _binned(g)
        slope = theil_sen(t, rss)
        growth = slope * (t[-1] - t[0])
        _, mk_p = mann_kendall(rss)
        if growth < max(16 * MiB, 0.05 * rss[0]) or (len(g) >= 8 and mk_p >= 0.01):
            continue
        sampled = sampled_growth.get((rec, pid), 0.0)
        unexplained = growth - sampled
        if unexplained < 0.5 * growth:
            continue
        first, last = g.iloc[0], g.iloc[-1]
        regions = {k: float(last[k] - first[k]) for k in ("heap_rss", "arena_rss", "anon_rss", "file_rss", "stack_rss")}
        where = max(regions, key=regions.get)
        counted = allocator_growth(g)
        if where in ("heap_rss", "arena_rss") and counted is not None \
                and float(counted[0]["gap"].iloc[-1]) >= 0.5 * unexplained:
            continue        # glibc counts these bytes in use: allocations the recording missed (recording_incomplete)
        hint = {"heap_rss": "the brk heap grew without sampled live blocks to match: see arena_bloat / malloc_trim",
                "arena_rss": "glibc arenas grew without sampled live blocks to match: see arena_bloat",
                "anon_rss": "anonymous memory outside sampled allocations: mmap by other code paths "
                            "(Python obmalloc arenas, custom allocators, GPU driver mappings)",
                "file_rss": "file-backed memory (mapped files, shared libraries, page cache of mmaps)",
                "stack_rss": "thread stacks (more threads, or deep recursion)"}[where]
        limit = _limit(last["memory_limit"])
        # the same rule as persistent_growth: only from RSS still rising over the end of the window
        oom = project_oom(_process_trend(ds, rec, pid), 0.0, 0.0, 0.0)
        rate_h = slope * 3600
        findings.append(UnexplainedGrowth(
            pid, str(last["comm"]),
            min(100.0, 100.0 * rate_h * 24 / limit) * 0.8 if limit else 30.0, 1.0 - (mk_p if len(g) >= 8 else 0.0),
            f"RSS grew {fmt_bytes(growth)} ({fmt_bytes(rate_h)}/h) but sampled allocations explain only "
            f"{fmt_bytes(max(0.0, sampled))}: growth is outside sampled allocations, mostly {where[:-4]} - {hint}.",
            {"rss_growth_bytes": growth, "rss_growth_bytes_per_hour": rate_h, "explained_bytes": max(0.0, sampled),
             "unexplained_bytes": unexplained, "region_growth_bytes": regions, "time_to_oom_hours": oom.hours,
             "time_to_oom_low_hours": oom.low, "time_to_oom_high_hours": oom.high,
             "time_to_oom_basis": oom.basis or None, "memory_limit_bytes": limit or None,
             "first_seen": first["ts"], "last_seen": last["ts"], "recording_id": rec}))
    return findings


def _sampled_growth(ds: Dataset) -> dict[tuple[str, int], float]:
    """Per process: growth of sampled outstanding bytes over the window, malloc and Python objects
    (the recorder's per-snapshot totals in `processes`, over the snapshots that measured them)
    plus the mmap made outside the allocator (glibc's own large-chunk mmaps are already counted
    under malloc, pymalloc's arenas are not sampled when its objects are); for a process in the
    always-on tier, the memory its sampled page faults brought in: sums of the rows at the first
    and last snapshot, read with the series (analysis/series.py)."""
    out: dict[tuple[str, int], float] = {}

    def add(rec, pid, v: float) -> None:     # a process that changed tier has both, in turn
        out[(str(rec), int(pid))] = out.get((str(rec), int(pid)), 0.0) + v

    p = ds.processes
    totals = set()
    if not p.empty and "malloc_outstanding_bytes" in p:
        held = p["malloc_outstanding_bytes"] + (p["python_outstanding_bytes"].fillna(0.0)
                                                if "python_outstanding_bytes" in p else 0.0)
        q = pd.DataFrame({"recording_id": p["recording_id"], "pid": p["pid"], "ts": p["ts"], "b": held}).dropna()
        for (rec, pid), g in q.sort_values("ts").groupby(["recording_id", "pid"], observed=True)["b"]:
            add(rec, pid, float(g.iloc[-1] - g.iloc[0]))
            totals.add((str(rec), int(pid)))
    _, sums = _streamed(ds)
    for (rec, pid), s in sums.items():
        for kind, (first, last) in s.first_last.items():
            # allocations from the rows for processes without the recorder's totals (imported or
            # synthetic data); mmap and faults are not in the totals
            if kind != "allocations" or (rec, pid) not in totals:
                add(rec, pid, last - first)
    return out
