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
KEY_BITS = 62           # processes x span (us) of a dataset's grids that fit one key (_Grids)
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
    live: np.ndarray            # live samples per point (bin means)
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
        local, codes = self.local(arr)
        return codes[local]

    def local(self, arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """The column's own dictionary indices, and the code of each index: work on the rows can
        use the indices, and map only what it keeps."""
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if not pa.types.is_dictionary(arr.type):
            arr = pc.dictionary_encode(arr)
        codes = np.array([self.code(str(v)) for v in arr.dictionary.to_pylist()] or [0], np.int64)
        return arr.indices.fill_null(0).to_numpy(zero_copy_only=False), codes

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


def _snapshots(rec: np.ndarray, pid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Where each run of rows of one (recording, process, snapshot) starts. The recorder writes a
    snapshot's rows together, so a batch holds about a tenth as many runs as rows and the work
    per process and snapshot is done per run. Runs of one snapshot that are not adjacent only
    cost more: the sums per point (_by_point) join them."""
    new = np.empty(len(ts), bool)
    new[:1] = True
    np.not_equal(ts[1:], ts[:-1], out=new[1:])
    new[1:] |= pid[1:] != pid[:-1]
    new[1:] |= rec[1:] != rec[:-1]
    return np.flatnonzero(new)


def _by_point(proc: np.ndarray, ts: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
    """(process, ts) pairs in order, unique, with each of `values` summed per pair."""
    lo, span = ts.min(initial=0), int(ts.max(initial=0)) - int(ts.min(initial=0)) + 1
    if len(ts) and (int(proc.max()) + 1) * span < 1 << 62:      # one key: a sort, or a hash then a sort
        key = proc * span + (ts - lo)
        order = np.argsort(key)
        k = key[order]
        if len(k) < 2 or (k[1:] != k[:-1]).all():       # a run per snapshot (the usual): a sort is all it takes
            return (k // span, k % span + lo, *(v[order].astype(float) for v in values))
        inv, uniq = pd.factorize(key)
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
    per process its sums: `kinds(source codes, stack ids, source names)` says which (source,
    stack) pairs are of each kind (kinds do not overlap), and the rows of a kind are summed at
    the first and last snapshot with such rows (`grid_kinds`: at the process's first and last
    snapshot).

    `batches(columns, running=)` yields the rows (Dataset.batches), `exits` the time (us) of
    each process's exit event (its `exiting` rows count too), `merge(stack_ids)` the stacks that stand for others
    (frames.cause_representatives)."""
    recs, srcs, procs = _Codes(), _Codes(), _Procs()
    held = srcs.of(pa.array(list(HELD_SOURCES)))

    # -- pass 1: grids, stacks, what exited processes held at their last snapshots ---------------
    # per batch, per recording: its snapshot times there; per process: (batch, its points as
    # indices into those), 2 bytes a point where they fit rather than 8
    times: list[dict[int, np.ndarray]] = []
    points: list[list[tuple[int, np.ndarray]]] = []
    proc_rec = np.zeros(0, np.int64)        # per process: its recording's code
    stacks_seen = []
    last_held: dict[int, dict[int, float]] = {}     # per process: its last two snapshots that held memory
    exits = dict(exits)
    for b in batches(PASS1, running=False, keep=PASS2):
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
        (rec, rec_codes), pid, ts = recs.local(b.column("recording_id")), \
            b.column("pid").to_numpy(zero_copy_only=False), _micros(b.column("ts"))
        at = _snapshots(rec, pid, ts)
        src, src_codes = srcs.local(b.column("source"))
        hold = np.isin(src_codes, held)[src]
        up, ut, sums, nheld = _by_point(procs.of(rec_codes[rec[at]], pid[at]), ts[at],
                                        np.add.reduceat(np.where(hold, _num(b, "outstanding_bytes"), 0.0), at),
                                        np.add.reduceat(hold.astype(float), at))
        if len(proc_rec) < len(procs.names):
            proc_rec = np.append(proc_rec, np.array(procs.names[len(proc_rec):], np.int64) >> 32)
        point_rec = proc_rec[up]
        code, here = np.empty(len(ut), np.int64), {}
        for r in np.unique(point_rec).tolist():        # one recording, mostly
            mine = point_rec == r
            here[r], code[mine] = np.unique(ut[mine], return_inverse=True)
        times.append(here)
        code = code.astype(np.uint16 if max(map(len, here.values()), default=0) <= 1 << 16 else np.int32)
        starts = np.flatnonzero(np.append(True, up[1:] != up[:-1]))     # points are in process order
        points += [[] for _ in range(len(procs.names) - len(points))]
        for a, z in zip(starts.tolist(), [*starts[1:].tolist(), len(up)], strict=True):
            points[int(up[a])].append((len(times) - 1, code[a:z]))
        _last_two(last_held, up[nheld > 0], ut[nheld > 0], sums[nheld > 0])
        stacks_seen.append(pc.unique(b.column("stack_id")).to_numpy(zero_copy_only=False))
    if not points:
        return [], {}
    # each recording's snapshot times: a process that has every one between its first and last
    # (the usual) keeps a range of them as its grid, not a copy
    groups = [np.unique(np.concatenate([t[r] for t in times if r in t] or [np.zeros(0, np.int64)]))
              for r in range(len(recs.names))]      # (a recording seen only in exiting rows has none)
    member = []
    for i, key in enumerate(procs.names):
        r = key >> 32
        g = np.concatenate([times[k][r][c] for k, c in points[i]])
        points[i] = []
        if len(g) > 1 and not (g[1:] > g[:-1]).all():      # batches in time order: sorted already
            g = np.unique(g)
        # a last snapshot within TEARDOWN_S of the exit with less than half of what the one before
        # held (in the sources that hold memory) belongs to the teardown: its rows are left out
        when = exits.get((recs.names[r], key & 0xFFFFFFFF))
        two = sorted(last_held.get(i, {}).items())
        if when is not None and len(two) == 2 and when - two[1][0] <= TEARDOWN_S * 1e6 and two[1][1] < 0.5 * two[0][1]:
            g = g[g != two[1][0]]
        a = int(np.searchsorted(groups[r], g[0])) if len(g) else 0
        if not len(g) or int(np.searchsorted(groups[r], g[-1])) - a + 1 == len(g):     # g is in groups[r]
            member.append((r, a, a + len(g)))
        else:
            member.append((len(groups), 0, len(g)))
            groups.append(g)
    grids = _Grids(groups, member)
    del points, times, groups
    reps = merge(np.unique(np.concatenate(stacks_seen)))
    rep_src = np.fromiter(reps.keys(), np.int64, len(reps))
    rep_dst = np.fromiter(reps.values(), np.int64, len(reps))
    rep_order = np.argsort(rep_src)
    rep_src, rep_dst = rep_src[rep_order], rep_dst[rep_order]

    # -- per process and source: which grid point falls in which bin -----------------------------
    layouts = _Layouts(grids, [{s: m for s, m in measured(recs.names[k >> 32], k & 0xFFFFFFFF, grids[i]).items()
                                if not m.all()} for i, k in enumerate(procs.names)])

    # -- pass 2: every row into its bin --------------------------------------------------------
    store = _Store(layouts)
    sums = [ProcessSums() for _ in procs.names]
    kind_ends: dict[str, _Ends] = {}
    stack_codes = _Intern()                 # stack ids as dense codes, for packed series keys
    for b in batches(PASS2):
        if not b.num_rows:
            continue
        (rec, rec_codes), pid, ts = recs.local(b.column("recording_id")), \
            b.column("pid").to_numpy(zero_copy_only=False), _micros(b.column("ts"))
        at = _snapshots(rec, pid, ts)
        run_proc = procs.of(rec_codes[rec[at]], pid[at])
        run_pos, on_grid = grids.locate(run_proc, ts[at])      # the teardown's rows are not on the grid
        lens = np.diff(np.append(at, len(ts)))
        if not on_grid.all():
            b = b.filter(pa.array(np.repeat(on_grid, lens)))
            run_proc, run_pos, lens = run_proc[on_grid], run_pos[on_grid], lens[on_grid]
            at = np.cumsum(lens) - lens
            if not b.num_rows:
                continue
        proc, pos = np.repeat(run_proc, lens), np.repeat(run_pos, lens)
        src = srcs.of(b.column("source"))
        y, s = _num(b, "outstanding_bytes"), _num(b, "outstanding_stderr_bytes")
        live = _num(b, "live_samples")
        churn = _num(b, "alloc_samples") + _num(b, "free_samples")
        last_p, k = np.unique(run_proc[::-1], return_index=True)      # each process's last run in the batch
        last_row = at[len(at) - 1 - k] + lens[len(at) - 1 - k] - 1
        for p, name in zip(last_p, b.column("comm").take(pa.array(last_row)).to_pylist(), strict=True):
            sums[p].comm = str(name)
        # per distinct stack of the batch: its representative, and per (source, stack) its kind
        st_code, st_uniq = pd.factorize(b.column("stack_id").to_numpy(zero_copy_only=False).astype(np.int64),
                                        size_hint=2 * len(stack_codes.names) + 1024)
        nsrc, nst = len(srcs.names), len(st_uniq)
        kind_names, table = _kind_table(kinds, srcs.names, st_uniq)
        kind_of = table[src * nst + st_code]
        # summed per run and kind, then per point
        has, nk = kind_of >= 0, max(1, len(kind_names))
        run_kind = np.repeat(np.arange(len(at)) * nk, lens)[has] + kind_of[has]
        ysum = np.bincount(run_kind, weights=y[has], minlength=len(at) * nk).reshape(len(at), nk)
        seen = np.bincount(run_kind, minlength=len(at) * nk).reshape(len(at), nk) > 0
        for j, kind in enumerate(kind_names):
            if kind not in kind_ends:
                kind_ends[kind] = _Ends(len(grids), grids.lengths if kind in grid_kinds else None)
            h = seen[:, j]
            kind_ends[kind].add(run_proc[h], run_pos[h], ysum[h, j])
        rep = st_uniq
        if len(rep_src):
            i = np.minimum(np.searchsorted(rep_src, st_uniq), len(rep_src) - 1)
            rep = np.where(rep_src[i] == st_uniq, rep_dst[i], st_uniq)
        merged_u = (rep != st_uniq) | np.isin(rep, rep_dst)
        rep_code, rep_uniq = pd.factorize(rep)
        # each row's series, then its bin in the series' layout (one per process and source)
        inv, uniq = pd.factorize((proc * nsrc + src) * len(rep_uniq) + rep_code[st_code],
                                 size_hint=2 * len(store.keys) + 1024)   # a table the size of the keys: cached
        ps, r = np.divmod(uniq, len(rep_uniq))
        codes = np.array([stack_codes.code(int(x)) for x in rep_uniq.tolist()], np.int64)
        sid = store.sids(ps // nsrc, ps % nsrc, codes[r], rep_uniq[r], srcs.names)[inv]
        store.grow()
        lid = store.lid[sid]
        bins = layouts.bins[layouts.starts[lid] + pos]
        flat = np.where(bins >= 0, store.offset[sid] + bins, -1)
        merged = merged_u[st_code]
        store.add(sid, flat, pos == layouts.lasts[lid], pos, y, s, live, churn, merged)

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
            if ends.seen[p]:
                s.first_last[kind] = (float(ends.first_y[p]), float(ends.last_y[p]))
        per_proc[(recs.names[key >> 32], key & 0xFFFFFFFF)] = s
    return out, per_proc


def _kind_table(kinds: Kinds, sources: list[str], stacks: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The kinds' names, and per (source code, stack) of a batch, flat (source-major), the index
    of its kind among them (-1: none). Kinds do not overlap."""
    src = np.repeat(np.arange(len(sources)), len(stacks))
    masks = kinds(src, np.tile(stacks, len(sources)), sources)
    out = np.full(len(src), -1, np.int64)
    for j, m in enumerate(masks.values()):
        if (out[m] >= 0).any():
            raise ValueError(f"the kind {list(masks)[j]} overlaps another")
        out[m] = j
    return list(masks), out


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


class _Ends:
    """Per process, of the rows of one kind: [first point, bytes there, last point, bytes there],
    the first and last points that had such rows, or with `n_grid` (each process's grid length)
    the process's own first and last snapshots (0 bytes where no such row was)."""

    def __init__(self, n: int, n_grid: np.ndarray | None) -> None:
        self.seen = np.zeros(n, bool)
        self.fixed = n_grid is not None
        self.first = np.zeros(n, np.int64) if n_grid is not None else np.full(n, np.iinfo(np.int64).max)
        self.last = n_grid - 1 if n_grid is not None else np.full(n, -1, np.int64)
        self.first_y, self.last_y = np.zeros(n), np.zeros(n)

    def add(self, proc: np.ndarray, pos: np.ndarray, y: np.ndarray) -> None:
        """One batch's rows (or sums per run) of the kind."""
        self.seen[proc] = True
        if self.fixed:          # only the rows at the grid's ends count
            at_end = (pos == 0) | (pos == self.last[proc])
            proc, pos, y = proc[at_end], pos[at_end], y[at_end]
        if not len(proc):
            return
        p, at, sums = _by_point(proc, pos, y)           # in (process, point) order: a process's first and last
        starts = np.flatnonzero(np.append(True, p[1:] != p[:-1]))
        ends = np.append(starts[1:], len(p)) - 1
        p = p[starts]
        for mark, y_at, at_end, earlier in ((self.first, self.first_y, at[starts], np.less),
                                            (self.last, self.last_y, at[ends], np.greater)):
            sums_end = sums[starts] if mark is self.first else sums[ends]
            new = earlier(at_end, mark[p])
            mark[p[new]], y_at[p[new]] = at_end[new], 0.0
            hit = at_end == mark[p]
            y_at[p[hit]] += sums_end[hit]


@dataclass
class _Layout:
    """The measured points of a process's grid for one source, and their bins (bin_series)."""

    t: np.ndarray               # per bin: mean seconds since the grid's first point
    count: np.ndarray           # per bin: grid points in it
    last: int                   # the last measured grid point, -1 when none
    points: int
    t_span: float               # seconds from the first measured point to the last

    @staticmethod
    def of(grid: np.ndarray, mask: np.ndarray | None) -> tuple[_Layout, np.ndarray]:
        """The layout, and per grid point its bin (-1: not measured)."""
        idx = np.arange(len(grid)) if mask is None else np.flatnonzero(mask)
        t = (grid[idx] - grid[0]) / 1e6 if len(grid) else np.zeros(0)
        bin_of = np.full(len(grid), -1, np.int16)       # MAX_POINTS bins
        if len(idx) > MAX_POINTS:
            starts = bin_starts(t, MAX_POINTS)
            which = np.searchsorted(starts, np.arange(len(idx)), side="right") - 1
            count = np.diff(np.append(starts, len(idx)))
            tb = np.add.reduceat(t, starts) / count
        else:
            which, count, tb = np.arange(len(idx)), np.ones(len(idx), np.int64), t
        bin_of[idx] = which
        return _Layout(tb, count, int(idx[-1]) if len(idx) else -1, len(idx),
                       float(t[-1] - t[0]) if len(t) else 0.0), bin_of


class _Grids:
    """Every process's grid (its snapshot times, in us) as a range of a group of times: its
    recording's snapshot times, or its own where it missed some between its first and last. The
    groups are kept end to end in one array of keys, group index * span + time since the first
    snapshot of all, so that a batch's snapshots find their points with one search (where groups x
    span would not fit in 62 bits, the keys are the times and the search is per group). A grid is
    made again when asked for (`grids[p]`)."""

    def __init__(self, groups: list[np.ndarray], member: list[tuple[int, int, int]]) -> None:
        """From the groups (sorted, unique), each dropped from the list once copied, and per process
        (group, first, end) of its range."""
        m = np.array(member, np.int64).reshape(-1, 3)
        self.group, self.first, self.lengths = m[:, 0], m[:, 1], m[:, 2] - m[:, 1]
        self.offsets = np.concatenate(([0], np.cumsum([len(g) for g in groups]))).astype(np.int64)
        self.t0 = min((int(g[0]) for g in groups if len(g)), default=0)
        self.span = max((int(g[-1]) for g in groups if len(g)), default=0) - self.t0 + 1
        self.keyed = len(groups) * self.span < 1 << KEY_BITS
        self.keys = np.empty(int(self.offsets[-1]), np.int64)
        for j in range(len(groups)):
            self.keys[self.offsets[j]:self.offsets[j + 1]] = groups[j] + self._base(j)
            groups[j] = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def _base(self, j: int) -> int:
        """What group j's keys hold more than its times."""
        return (j * self.span if self.keyed else 0) - self.t0

    def __getitem__(self, p: int) -> np.ndarray:
        j = int(self.group[p])
        a = int(self.offsets[j] + self.first[p])
        return self.keys[a:a + int(self.lengths[p])] - self._base(j)

    def locate(self, proc: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per (process, time): its point in the process's grid, and whether the grid has it."""
        known = proc < len(self.lengths)
        p = np.where(known, proc, 0)
        j = self.group[p] if len(self.lengths) else np.zeros(len(p), np.int64)
        at, hit = np.zeros(len(p), np.int64), np.zeros(len(p), bool)     # in the group
        if not len(self.keys):
            pass
        elif self.keyed:
            key = j * self.span + (ts - self.t0)
            i = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
            hit, at = self.keys[i] == key, i - self.offsets[j]
        else:
            for g, rows in _runs(j):
                keys, t = self.keys[self.offsets[g]:self.offsets[g + 1]], ts[rows] - self.t0
                if len(keys):
                    i = np.minimum(np.searchsorted(keys, t), len(keys) - 1)
                    at[rows], hit[rows] = i, keys[i] == t
        if len(self.lengths):
            at = at - self.first[p]
            hit &= known & (at >= 0) & (at < self.lengths[p])
        return np.where(hit, at, 0), hit


class _Layouts:
    """The layouts of (process, source), made on first use: one per process, and one more per
    source that only some of its snapshots measured (`masks`). Their bins per grid point are
    kept in one flat array, so that a batch's rows find their bins with one gather."""

    def __init__(self, grids: _Grids, masks: list[dict[str, np.ndarray]]) -> None:
        self.grids, self.masks = grids, masks
        self.ids: dict[tuple[int, str | None], int] = {}
        self.made: list[_Layout] = []
        self.bins = np.zeros(1024, np.int16)    # the layouts' bin_of, end to end (capacity doubles)
        self.used = 0
        self.starts = self.lasts = np.zeros(0, np.int64)        # per layout, as arrays (`sync`)
        self._starts: list[int] = []

    def of(self, p: int, source: str) -> int:
        m = self.masks[p].get(source)
        key = (p, source if m is not None else None)
        i = self.ids.get(key)
        if i is None:
            lay, bin_of = _Layout.of(self.grids[p], m)
            i = self.ids[key] = len(self.made)
            self.made.append(lay)
            if self.used + len(bin_of) > len(self.bins):
                grown = np.zeros(max(2 * len(self.bins), self.used + len(bin_of)), np.int16)
                grown[:self.used] = self.bins[:self.used]
                self.bins = grown
            self.bins[self.used:self.used + len(bin_of)] = bin_of
            self._starts.append(self.used)
            self.used += len(bin_of)
        return i

    def sync(self) -> None:
        """The per-layout arrays extended to the layouts made since."""
        if len(self.starts) < len(self.made):
            self.starts = np.array(self._starts, np.int64)
            self.lasts = np.array([lay.last for lay in self.made], np.int64)


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

    def __init__(self, layouts: _Layouts) -> None:
        self.made = layouts                      # each series' layout: made[lids[i]]
        self.index: dict[int, int] = {}          # packed ((process, source) code, stack code) -> series
        self.pairs = _Intern()
        self.keys: list[tuple[int, int, int]] = []
        self.lids: list[int] = []
        self.starts: list[int] = []          # each series' first bin in the flat arrays
        self.nbins = 0
        self.offset = self.lid = np.zeros(0, np.int64)
        self.y = self.s2 = self.churn = np.zeros(0)
        self.live = np.zeros(0, np.float32)      # live samples per bin (summed; means per point)
        self.s2_all, self.live_all, self.y_last, self.s2_last, self.max_row = (np.zeros(0) for _ in range(5))
        self.first_live = np.zeros(0, np.int64)
        # series of merged stacks: their sums per grid point (for their peak), end to end in `points`
        # from point_at[series] (-1: none)
        self.point_at = np.zeros(0, np.int64)
        self.points = np.zeros(0)
        self.npoints = 0

    def sids(self, proc: np.ndarray, src: np.ndarray, stack_code: np.ndarray, stack: np.ndarray,
             sources: list[str]) -> np.ndarray:
        """The series of each (process, source code, stack), those not seen before made with
        their layout. Keys are packed in one int, (process, source) pair code << 32 | stack code
        (both dense codes of what the dataset holds): one dict lookup each."""
        pairs, at = np.unique(proc << 32 | src, return_inverse=True)      # a few hundred per batch
        pair = np.array([self.pairs.code(k) for k in pairs.tolist()], np.int64)[at]
        packed = pair << 32 | stack_code
        out = np.array([self.index.get(k, -1) for k in packed.tolist()], np.int64)
        for j in np.flatnonzero(out < 0).tolist():
            p, sc = int(proc[j]), int(src[j])
            out[j] = self.index[int(packed[j])] = len(self.keys)
            lid = self.made.of(p, sources[sc])
            self.keys.append((p, sc, int(stack[j])))
            self.lids.append(lid)
            self.starts.append(self.nbins)
            self.nbins += len(self.made.made[lid].count)
        return out

    def grow(self) -> None:
        """The arrays extended to the series made since (once per batch: no copy per series)."""
        self.made.sync()
        new = len(self.keys) - len(self.offset)
        if not new:
            return
        self.offset = np.array(self.starts, np.int64)
        self.lid = np.array(self.lids, np.int64)
        pad = self.nbins - len(self.y)
        self.y, self.s2, self.churn = (np.concatenate([a, np.zeros(pad)]) for a in (self.y, self.s2, self.churn))
        self.live = np.concatenate([self.live, np.zeros(pad, np.float32)])
        self.s2_all, self.live_all, self.y_last, self.s2_last, self.max_row = (
            np.concatenate([a, np.zeros(new)]) for a in (self.s2_all, self.live_all, self.y_last, self.s2_last,
                                                         self.max_row))
        # unseen: past the grid's end (first_live, per series, is where its live samples start)
        unseen = self.made.grids.lengths[np.array([k[0] for k in self.keys[-new:]], np.int64)]
        self.first_live = np.concatenate([self.first_live, unseen])
        self.point_at = np.concatenate([self.point_at, np.full(new, -1, np.int64)])

    def add(self, sid, flat, last, pos, y, s, live, churn, merged) -> None:
        s2 = s * s
        m = flat >= 0                    # measured: in a bin
        if m.all():
            fm, sm, ym, s2m, cm, lm = flat, sid, y, s2, churn, live
        else:
            fm, sm, ym, s2m, cm, lm = flat[m], sid[m], y[m], s2[m], churn[m], live[m]
        # ufunc.at adds in place, in row order: no array of every bin per batch
        np.add.at(self.y, fm, ym)
        np.add.at(self.s2, fm, s2m)
        np.add.at(self.churn, fm, cm)
        np.add.at(self.live, fm, lm)
        np.add.at(self.s2_all, sm, s2m)
        np.add.at(self.live_all, sm, lm)
        np.add.at(self.y_last, sid[last], y[last])
        np.add.at(self.s2_last, sid[last], s2[last])
        # ufunc.at only on the rows that move a minimum or maximum: after a series' first rows, few do
        earlier = (live > 0) & (pos < self.first_live[sid])
        np.minimum.at(self.first_live, sid[earlier], pos[earlier])
        higher = ~merged & (y > self.max_row[sid])
        np.maximum.at(self.max_row, sid[higher], y[higher])
        if merged.any():
            msid = sid[merged]
            new = np.unique(msid[self.point_at[msid] < 0])
            if len(new):
                lengths = self.made.grids.lengths[np.array([self.keys[i][0] for i in new.tolist()], np.int64)]
                self.point_at[new] = self.npoints + np.cumsum(lengths) - lengths
                self.npoints += int(lengths.sum())
                if self.npoints > len(self.points):
                    self.points = np.concatenate([self.points, np.zeros(max(self.npoints, 2 * len(self.points))
                                                                        - len(self.points))])
            np.add.at(self.points, self.point_at[msid] + pos[merged], y[merged])

    def peak(self, i: int) -> float:
        a = int(self.point_at[i])
        if a < 0:
            return float(self.max_row[i])
        n = int(self.made.grids.lengths[self.keys[i][0]])
        return max(float(self.points[a:a + n].max()), float(self.max_row[i]))

    def series(self, i: int, rec: str, pid: int, source: str, stack: int, grid: np.ndarray) -> StackSeries:
        lay = self.made.made[self.lids[i]]
        a = self.offset[i]
        y, s2, churn, live = (x[a:a + len(lay.count)] for x in (self.y, self.s2, self.churn, self.live))
        first = grid[self.first_live[i]] if self.first_live[i] < len(grid) else grid[0]
        return StackSeries(
            rec, pid, source, stack, lay.points, lay.t, y / lay.count, np.sqrt(s2 / lay.count), np.cumsum(churn),
            live / lay.count,
            self.s2_all[i] / self.live_all[i] if self.live_all[i] > 0 else 0.0, float(lay.t_span),
            float(self.y_last[i]), float(self.s2_last[i]) ** 0.5, self.peak(i),
            int(first), int(grid[lay.last]) if lay.last >= 0 else int(grid[0]), int(grid[-1]))
