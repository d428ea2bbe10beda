"""The `outstanding` table reduced, in two streaming passes, to what the growth detectors read:
per (recording, process, source, stack) a series of at most MAX_POINTS points, and per process
the sums that `unexplained_growth` compares with RSS.

A day of 10 s snapshots of 50 processes is millions of rows; the detectors' tests are
O(points^2), so they have always binned long series to MAX_POINTS equal-time bins
(detect/stats.py bin_series). Here the rows are binned as they are read, in Arrow batches: memory
is the processes' snapshot times and the bins, not the rows, and a week costs what a day does but
for its snapshot times. The bins are those bin_series makes of the complete series (absent rows
count as 0: a stack absent from a snapshot held nothing), so the detectors see what they saw when
the whole table was read into pandas.

Pass 1 reads the (recording, pid, ts, source, stack, bytes) columns: every process's snapshot
times (its grid), the stack ids, and what each exited process held at its last snapshots (a last
snapshot taken while its teardown ran is the teardown's: dataset.split_exit). Pass 2 reads the rest
and adds each row to its bin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from analysis.dataset import HELD_SOURCES, TEARDOWN_S
from analysis.detect.stats import bin_starts

MAX_POINTS = 200
PASS1 = ["recording_id", "pid", "ts", "source", "stack_id", "outstanding_bytes"]
PASS2 = [*PASS1, "comm", "outstanding_stderr_bytes", "live_samples", "alloc_samples", "free_samples"]

# measured(recording, pid, grid in us) -> {source: which grid points measured it}; sources absent: all
Measured = Callable[[str, int, np.ndarray], dict[str, np.ndarray]]
Batches = Callable[..., Iterator[pa.RecordBatch]]       # Dataset.batches
Kinds = Callable[[np.ndarray, np.ndarray, list[str]], dict[str, np.ndarray]]


@dataclass
class StackSeries:
    """One (recording, process, source, stack) over the snapshots that measured its source."""

    recording_id: str
    pid: int
    source: str
    stack_id: int
    points: int                 # snapshots that measured it (before binning)
    t: np.ndarray               # seconds since the process's first snapshot, per point (bin means)
    y: np.ndarray               # outstanding bytes per point (bin means; 0 where it had no row)
    s: np.ndarray               # their standard error (rms over a bin)
    cum: np.ndarray             # sampled allocations + frees up to the end of each point
    var1: float                 # per-sample variance term: sum s^2 / sum live samples (0: unknown)
    window_s: float             # from its first to its last measured snapshot
    y_last: float               # outstanding bytes at its last measured snapshot
    s_last: float               # and their standard error
    peak: float                 # the largest outstanding bytes of one snapshot (every snapshot)
    first_us: int               # the first snapshot with live samples (or the process's first)
    ends_us: int                # its last measured snapshot (the process's first when none)
    last_us: int                # the process's last snapshot


@dataclass
class ProcessSums:
    """Per process: its last `comm`, its first and last snapshot, and the sampled bytes (sums of
    every stack) of a kind at the first and the last snapshot that had rows of that kind."""

    comm: str = ""
    first_last: dict[str, tuple[float, float]] = field(default_factory=dict)


class _Intern:
    """Keys (strings, packed process keys) as dense integer codes, in order of first sight."""

    def __init__(self) -> None:
        self.names: list = []
        self.index: dict = {}

    def code(self, key) -> int:
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.names)
            self.names.append(key)
        return i


class _Codes(_Intern):
    """Strings of Arrow columns (dictionary or plain) as stable integer codes."""

    def of(self, arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if not pa.types.is_dictionary(arr.type):
            arr = pc.dictionary_encode(arr)
        local = np.array([self.code(str(v)) for v in arr.dictionary.to_pylist()] or [0], np.int64)
        return local[arr.indices.fill_null(0).to_numpy(zero_copy_only=False)]

    def names_of(self, arr: pa.Array | pa.ChunkedArray) -> list[str]:
        return [self.names[c] for c in self.of(arr)]


def _micros(arr: pa.Array) -> np.ndarray:
    if pa.types.is_timestamp(arr.type) and arr.type.unit != "us":
        arr = pc.cast(arr, pa.timestamp("us", arr.type.tz), safe=False)
    return arr.cast(pa.int64()).to_numpy(zero_copy_only=False)


def _num(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return batch.column(name).to_numpy(zero_copy_only=False).astype(float)


class _Procs(_Intern):
    """Processes by (recording code << 32 | pid) -> dense index."""

    def of(self, rec: np.ndarray, pid: np.ndarray) -> np.ndarray:
        inv, uniq = pd.factorize(rec << 32 | pid.astype(np.int64))      # hashed: no sort of the batch
        return np.array([self.code(int(k)) for k in uniq], np.int64)[inv]


def _by_point(proc: np.ndarray, ts: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
    """(process, ts) pairs in order, unique, with each of `values` summed per pair."""
    lo, span = ts.min(initial=0), int(ts.max(initial=0)) - int(ts.min(initial=0)) + 1
    if len(ts) and (int(proc.max()) + 1) * span < 1 << 62:      # one key: a hash, then a sort of the pairs
        inv, uniq = pd.factorize(proc * span + (ts - lo))
        order = np.argsort(uniq)
        rank = np.empty(len(uniq), np.int64)
        rank[order] = np.arange(len(uniq))
        grp, key = rank[inv], uniq[order]
        return (key // span, key % span + lo, *(np.bincount(grp, weights=v, minlength=len(key)) for v in values))
    order = np.lexsort((ts, proc))
    proc, ts = proc[order], ts[order]
    new = np.ones(len(order), bool)
    new[1:] = (proc[1:] != proc[:-1]) | (ts[1:] != ts[:-1])
    grp = np.cumsum(new) - 1
    return (proc[new], ts[new], *(np.bincount(grp, weights=v[order]) for v in values))


def read_series(batches: Batches, exits: dict[tuple[str, int], int], measured: Measured,
                merge: Callable[[np.ndarray], dict[int, int]], kinds: Kinds, *, min_bytes: float,
                grid_kinds: tuple[str, ...] = ()) -> tuple[list[StackSeries], dict[tuple[str, int], ProcessSums]]:
    """The series of every stack whose outstanding bytes reached `min_bytes` in one snapshot, and
    per process its sums: `kinds(source codes, stack ids, source names)` gives per batch the rows
    of each kind, summed at the first and last snapshot with such rows (`grid_kinds`: at the
    process's first and last snapshot).

    `batches(columns, running=)` yields the rows (Dataset.batches), `exits` the time (us) of
    each process's exit event (its `exiting` rows count too), `merge(stack_ids)` the stacks that stand for others
    (frames.cause_representatives)."""
    recs, srcs, procs = _Codes(), _Codes(), _Procs()
    held = srcs.of(pa.array(list(HELD_SOURCES)))

    # -- pass 1: grids, stacks, what exited processes held at their last snapshots ---------------
    parts, stacks_seen = [], []
    last_held: dict[int, dict[int, float]] = {}     # per process: its last two snapshots that held memory
    exits = dict(exits)
    for b in batches(PASS1, running=False):
        if not b.num_rows:
            continue
        if "exiting" in b.schema.names:         # what a teardown left, written at the exit: its time
            at_exit = b.column("exiting").fill_null(False).to_numpy(zero_copy_only=False)
            if at_exit.any():
                gone = b.filter(pa.array(at_exit))
                for key, t in zip(zip(recs.names_of(gone.column("recording_id")),
                                      gone.column("pid").to_pylist(), strict=True),
                                  _micros(gone.column("ts")), strict=True):
                    exits[key] = min(exits.get(key, t), int(t))
                b = b.filter(pa.array(~at_exit))
                if not b.num_rows:
                    continue
        proc = procs.of(recs.of(b.column("recording_id")), b.column("pid").to_numpy(zero_copy_only=False))
        hold = np.isin(srcs.of(b.column("source")), held)
        up, ut, sums, nheld = _by_point(proc, _micros(b.column("ts")),
                                        np.where(hold, _num(b, "outstanding_bytes"), 0.0), hold.astype(float))
        parts.append((up.astype(np.int32), ut))
        _last_two(last_held, up[nheld > 0], ut[nheld > 0], sums[nheld > 0])
        stacks_seen.append(np.unique(b.column("stack_id").to_numpy(zero_copy_only=False)))
    if not parts:
        return [], {}
    # each batch's points are in process order: a process's grid joins its slices of them
    cuts = [np.searchsorted(up, np.arange(len(procs.names) + 1)) for up, _ in parts]
    # a last snapshot within TEARDOWN_S of the exit with less than half of what the one before
    # held (in the sources that hold memory) belongs to the teardown: its rows are left out
    grids = []
    for i, key in enumerate(procs.names):
        g = np.unique(np.concatenate([ut[c[i]:c[i + 1]] for (_, ut), c in zip(parts, cuts, strict=True)]))
        when = exits.get((recs.names[key >> 32], key & 0xFFFFFFFF))
        two = sorted(last_held.get(i, {}).items())
        if when is not None and len(two) == 2 and when - two[1][0] <= TEARDOWN_S * 1e6 and two[1][1] < 0.5 * two[0][1]:
            g = g[g != two[1][0]]
        grids.append(g)
    del parts, cuts
    reps = merge(np.unique(np.concatenate(stacks_seen)))
    rep_src = np.fromiter(reps.keys(), np.int64, len(reps))
    rep_dst = np.fromiter(reps.values(), np.int64, len(reps))
    rep_order = np.argsort(rep_src)
    rep_src, rep_dst = rep_src[rep_order], rep_dst[rep_order]

    # -- per process and source: which grid point falls in which bin -----------------------------
    masks = [{s: m for s, m in measured(recs.names[k >> 32], k & 0xFFFFFFFF, g).items() if not m.all()}
             for k, g in zip(procs.names, grids, strict=True)]
    layouts: dict[tuple[int, str | None], _Layout] = {}

    def layout(p: int, source: str) -> _Layout:
        m = masks[p].get(source)
        key = (p, source if m is not None else None)
        if key not in layouts:
            layouts[key] = _Layout.of(grids[p], m)
        return layouts[key]

    # -- pass 2: every row into its bin --------------------------------------------------------
    store = _Store()
    sums = [ProcessSums() for _ in procs.names]
    kind_ends: dict[str, dict[int, list]] = {}
    for b in batches(PASS2):
        if not b.num_rows:
            continue
        proc = procs.of(recs.of(b.column("recording_id")), b.column("pid").to_numpy(zero_copy_only=False))
        ts = _micros(b.column("ts"))
        pos = np.zeros(len(ts), np.int64)
        on_grid = np.zeros(len(ts), bool)
        for p, rows in _runs(proc):
            g = grids[p]
            if len(g):
                at = np.minimum(np.searchsorted(g, ts[rows]), len(g) - 1)
                pos[rows], on_grid[rows] = at, g[at] == ts[rows]      # the teardown's rows are not
        if not on_grid.all():
            b, proc, ts, pos = b.filter(pa.array(on_grid)), proc[on_grid], ts[on_grid], pos[on_grid]
            if not b.num_rows:
                continue
        src = srcs.of(b.column("source"))
        stack = b.column("stack_id").to_numpy(zero_copy_only=False).astype(np.int64)
        y, s = _num(b, "outstanding_bytes"), _num(b, "outstanding_stderr_bytes")
        live = _num(b, "live_samples")
        churn = _num(b, "alloc_samples") + _num(b, "free_samples")
        last_p, k = np.unique(proc[::-1], return_index=True)       # each process's last row in the batch
        for p, name in zip(last_p, b.column("comm").take(pa.array(len(proc) - 1 - k)).to_pylist(), strict=True):
            sums[p].comm = str(name)
        for kind, rows in kinds(src, stack, srcs.names).items():
            if kind in grid_kinds:       # at the process's first and last snapshot, whatever had rows there
                _ends(kind_ends.setdefault(kind, {}), proc[rows], pos[rows], y[rows], grids)
            else:
                _ends(kind_ends.setdefault(kind, {}), proc[rows], pos[rows], y[rows])
        if len(rep_src):
            at = np.minimum(np.searchsorted(rep_src, stack), len(rep_src) - 1)
            hit = rep_src[at] == stack
            stack = np.where(hit, rep_dst[at], stack)
            merged = hit | np.isin(stack, rep_dst)
        else:
            merged = np.zeros(len(stack), bool)
        # each row's series, then its bin in the series' layout (one per process and source)
        nsrc = len(srcs.names) + 1
        ps = proc * nsrc + src
        st_code, st_uniq = pd.factorize(stack)
        inv, uniq = pd.factorize(ps * len(st_uniq) + st_code)
        ids = []
        for u in uniq:
            p, sc = divmod(int(u) // len(st_uniq), nsrc)
            ids.append(store.sid((p, sc, int(st_uniq[int(u) % len(st_uniq)])), layout(p, srcs.names[sc]),
                                 len(grids[p])))
        sid = np.array(ids, np.int64)[inv]
        store.grow()
        flat = np.full(len(ts), -1, np.int64)
        last = np.zeros(len(ts), bool)
        for key, rows in _runs(ps):
            lay = layout(key // nsrc, srcs.names[key % nsrc])
            bins = lay.bin_of[pos[rows]]
            flat[rows] = np.where(bins >= 0, store.offset[sid[rows]] + bins, -1)
            last[rows] = pos[rows] == lay.last
        store.add(sid, flat, last, pos, y, s, live, churn, merged)

    out = []
    for i, (p, sc, st) in enumerate(store.keys):
        if store.peak(i) < min_bytes:
            continue
        key, grid = procs.names[p], grids[p]
        out.append(store.series(i, recs.names[key >> 32], key & 0xFFFFFFFF, srcs.names[sc], st, grid))
    per_proc = {}
    for p, key in enumerate(procs.names):
        s = sums[p]
        for kind, ends in kind_ends.items():
            if p in ends:
                s.first_last[kind] = (ends[p][1], ends[p][3])
        per_proc[(recs.names[key >> 32], key & 0xFFFFFFFF)] = s
    return out, per_proc


def _last_two(state: dict[int, dict[int, float]], proc: np.ndarray, ts: np.ndarray, held: np.ndarray) -> None:
    """Per process, the held bytes of its two latest snapshots (sums over batches: a snapshot's
    rows may be in two), from one batch's (process, ts) points in order."""
    if not len(proc):
        return
    ends = np.append(np.flatnonzero(proc[1:] != proc[:-1]), len(proc) - 1)
    for z in ends:
        cur = state.setdefault(int(proc[z]), {})
        for k in (z - 1, z) if z >= 1 and proc[z - 1] == proc[z] else (z,):
            cur[int(ts[k])] = cur.get(int(ts[k]), 0.0) + float(held[k])
        while len(cur) > 2:
            del cur[min(cur)]


def _ends(state: dict[int, list], proc: np.ndarray, pos: np.ndarray, y: np.ndarray,
          grids: list[np.ndarray] | None = None) -> None:
    """Per process [first point, bytes there, last point, bytes there] of the rows of one kind:
    the first and last points that had such rows, or with `grids` the process's own first and
    last snapshots (0 bytes where no such row was)."""
    if not len(proc):
        return
    p, at, sums = _by_point(proc, pos, y)
    starts = np.flatnonzero(np.append(True, p[1:] != p[:-1]))
    for a, z in zip(starts, np.append(starts[1:], len(p)) - 1, strict=True):
        i = int(p[a])
        cur = state.setdefault(i, [0, 0.0, len(grids[i]) - 1, 0.0] if grids is not None else
                               [int(at[a]), 0.0, int(at[z]), 0.0])
        if at[a] < cur[0]:
            cur[0], cur[1] = int(at[a]), 0.0
        if at[z] > cur[2]:
            cur[2], cur[3] = int(at[z]), 0.0
        sel = slice(a, z + 1)
        cur[1] += float(sums[sel][at[sel] == cur[0]].sum())
        cur[3] += float(sums[sel][at[sel] == cur[2]].sum())


@dataclass
class _Layout:
    """The measured points of a process's grid for one source, and their bins (bin_series)."""

    bin_of: np.ndarray          # per grid point: its bin, -1 when not measured
    t: np.ndarray               # per bin: mean seconds since the grid's first point
    count: np.ndarray           # per bin: grid points in it
    last: int                   # the last measured grid point, -1 when none
    points: int
    t_span: float               # seconds from the first measured point to the last

    @staticmethod
    def of(grid: np.ndarray, mask: np.ndarray | None) -> _Layout:
        idx = np.arange(len(grid)) if mask is None else np.flatnonzero(mask)
        t = (grid[idx] - grid[0]) / 1e6 if len(grid) else np.zeros(0)
        bin_of = np.full(len(grid), -1, np.int64)
        if len(idx) > MAX_POINTS:
            starts = bin_starts(t, MAX_POINTS)
            which = np.searchsorted(starts, np.arange(len(idx)), side="right") - 1
            count = np.diff(np.append(starts, len(idx)))
            tb = np.add.reduceat(t, starts) / count
        else:
            which, count, tb = np.arange(len(idx)), np.ones(len(idx), np.int64), t
        bin_of[idx] = which
        return _Layout(bin_of, tb, count, int(idx[-1]) if len(idx) else -1, len(idx),
                       float(t[-1] - t[0]) if len(t) else 0.0)


def _runs(keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(key, the rows that have it) for each distinct key, from one sort."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    cut = np.flatnonzero(k[1:] != k[:-1]) + 1
    for a, z in zip(np.concatenate(([0], cut)), np.append(cut, len(k)), strict=True):
        yield int(k[a]), order[a:z]


class _Store:
    """Every series' sums per bin, in flat arrays (a series' bins from its `offset`), and what the
    detectors read besides, per series."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, int, int], int] = {}
        self.keys: list[tuple[int, int, int]] = []
        self.layouts: list[_Layout] = []
        self.starts: list[int] = []          # each series' first bin in the flat arrays
        self.nbins = 0
        self.offset = np.zeros(0, np.int64)
        self.y = self.s2 = self.churn = np.zeros(0)
        self.s2_all, self.live_all, self.y_last, self.s2_last, self.max_row = (np.zeros(0) for _ in range(5))
        self.first_live = np.zeros(0, np.int64)
        self.per_point: dict[int, np.ndarray] = {}      # merged stacks: sums per grid point (their peak)
        self.n_grid: list[int] = []

    def sid(self, key: tuple[int, int, int], lay: _Layout, n_grid: int) -> int:
        """The series of (process, source, stack), made with its layout when new."""
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.keys)
            self.keys.append(key)
            self.layouts.append(lay)
            self.n_grid.append(n_grid)
            self.starts.append(self.nbins)
            self.nbins += len(lay.count)
        return i

    def grow(self) -> None:
        """The arrays extended to the series made since (once per batch: no copy per series)."""
        new = len(self.keys) - len(self.offset)
        if not new:
            return
        self.offset = np.array(self.starts, np.int64)
        pad = self.nbins - len(self.y)
        self.y, self.s2, self.churn = (np.concatenate([a, np.zeros(pad)]) for a in (self.y, self.s2, self.churn))
        self.s2_all, self.live_all, self.y_last, self.s2_last, self.max_row = (
            np.concatenate([a, np.zeros(new)]) for a in (self.s2_all, self.live_all, self.y_last, self.s2_last,
                                                         self.max_row))
        self.first_live = np.concatenate([self.first_live, np.array(self.n_grid[-new:], np.int64)])

    def add(self, sid, flat, last, pos, y, s, live, churn, merged) -> None:
        m = flat >= 0                    # measured: in a bin
        nb, ns = len(self.y), len(self.keys)
        s2 = s * s
        self.y += np.bincount(flat[m], weights=y[m], minlength=nb)
        self.s2 += np.bincount(flat[m], weights=s2[m], minlength=nb)
        self.churn += np.bincount(flat[m], weights=churn[m], minlength=nb)
        self.s2_all += np.bincount(sid[m], weights=s2[m], minlength=ns)
        self.live_all += np.bincount(sid[m], weights=live[m], minlength=ns)
        self.y_last += np.bincount(sid[last], weights=y[last], minlength=ns)
        self.s2_last += np.bincount(sid[last], weights=s2[last], minlength=ns)
        seen = live > 0
        np.minimum.at(self.first_live, sid[seen], pos[seen])
        np.maximum.at(self.max_row, sid[~merged], y[~merged])
        for i, rows in _runs(sid[merged]) if merged.any() else ():
            rows = np.flatnonzero(merged)[rows]
            pts = self.per_point.setdefault(i, np.zeros(self.n_grid[i]))
            np.add.at(pts, pos[rows], y[rows])

    def peak(self, i: int) -> float:
        pts = self.per_point.get(i)
        return max(float(pts.max()), float(self.max_row[i])) if pts is not None else float(self.max_row[i])

    def series(self, i: int, rec: str, pid: int, source: str, stack: int, grid: np.ndarray) -> StackSeries:
        lay = self.layouts[i]
        a = self.offset[i]
        y, s2, churn = (x[a:a + len(lay.count)] for x in (self.y, self.s2, self.churn))
        first = grid[self.first_live[i]] if self.first_live[i] < len(grid) else grid[0]
        return StackSeries(
            rec, pid, source, stack, lay.points, lay.t, y / lay.count, np.sqrt(s2 / lay.count), np.cumsum(churn),
            self.s2_all[i] / self.live_all[i] if self.live_all[i] > 0 else 0.0, float(lay.t_span),
            float(self.y_last[i]), float(self.s2_last[i]) ** 0.5, self.peak(i),
            int(first), int(grid[lay.last]) if lay.last >= 0 else int(grid[0]), int(grid[-1]))
