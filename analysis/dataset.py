"""Loading an allocsampler dataset (the directory given to `record --out`) into pandas."""

from __future__ import annotations

import concurrent.futures
import copy
import datetime as dt
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from analysis.source import Source
from sampler.dataset import layout
from sampler.dataset.schema import TABLES
from sampler.dataset.sources import ALLOCATION_TIERS


def read_table(root: str | Path | Source, name: str, *, filter=None, columns: list[str] | None = None) -> pd.DataFrame:
    """One table as a DataFrame (empty, with the schema's columns, when nothing was written).

    `filter` is a pyarrow.dataset expression, e.g. `ds.field("pid") == 1234`. Both layouts are
    read (sampler.dataset.layout): host=*/date=*/ and, from schema <= 5, date=*/. `root` may be a
    Source (analysis/source.py): a URI, or a selection of hosts and days pruned before reading."""
    if isinstance(root, Source):
        return root.read(name, filter=filter, columns=columns)
    table = TABLES[name]
    path = Path(root) / name
    if not path.is_dir() or not layout.has_files(path):
        empty = table.read_schema.empty_table().to_pandas()
        return empty[columns] if columns else empty
    for _ in range(READ_ATTEMPTS - 1):
        try:
            return _scan(path, table, filter, columns)
        except FileNotFoundError:
            continue    # a live daemon's compaction replaced files between the listing and the read
    return _scan(path, table, filter, columns)


READ_ATTEMPTS = 5
# recordings of schema 5 and 6 named code no symbol covers after the nearest export before it,
# `export+0xOFF`: no function's name ends so, and a reader took it for the function that ran
_APPROXIMATE_NAME = r"\+0x[0-9a-f]+$"


def read_frames(root: str | Path | Source) -> pd.DataFrame:
    """The `frames` table, one row per (stack, depth), with the approximate names older
    recordings wrote read as what they are: unnamed (null)."""
    frames = read_table(root, "frames").drop_duplicates(["stack_id", "depth"])
    if "function" in frames and len(frames):
        guessed = frames["function"].astype("string").str.contains(_APPROXIMATE_NAME, regex=True).fillna(False)
        if guessed.any():
            frames["function"] = frames["function"].astype(object).where(~guessed.to_numpy(), None)
    return frames


# Partition values as dictionaries, as pandas reads them: in the layout of schema <= 5 `host` is a
# dictionary column of the files (and there is no host= directory), and a partition field must
# have the type of a file column of the same name for both layouts to be read as one.
HIVE = ds.HivePartitioning.discover(infer_dictionary=True)


def _dataset(path: Path, table) -> ds.Dataset:
    dataset = ds.dataset(path, format="parquet", partitioning=HIVE)
    missing = [f for f in table.read_schema if f.name not in dataset.schema.names]
    if missing:     # columns added since the first file was written: null there
        dataset = ds.dataset(path, format="parquet", partitioning=HIVE, schema=pa.schema([*dataset.schema, *missing]))
    return dataset


def _scan(path: Path, table, filter, columns: list[str] | None) -> pd.DataFrame:
    return _dataset(path, table).to_table(filter=filter, columns=columns).to_pandas(self_destruct=True,
                                                                                    split_blocks=True)


# A process's last running snapshot within this many seconds of its exit, with less than half of
# the sampled memory of the snapshot before, is its teardown too (finalization began before it).
TEARDOWN_S = 3.0
HELD_SOURCES = ("malloc", "python", "mmap")


def split_exit(out: pd.DataFrame, exits: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(running rows, teardown rows) of `outstanding` rows: exit is not a free. The rows written at
    a process's exit (`exiting`) hold what its teardown (interpreter finalization, atexit) left;
    so does a last snapshot taken while the teardown ran. `exits`: (ts, recording_id, pid) of the
    exits (`targets` rows of event `exit`, or the teardown rows already read apart). The frame is
    copied only when rows move."""
    at_exit = (out["exiting"].fillna(False).to_numpy(dtype=bool, copy=True) if "exiting" in out
               else np.zeros(len(out), bool))
    keys = ["recording_id", "pid"]
    when = [out.loc[at_exit, [*keys, "ts"]]] + ([exits[[*keys, "ts"]]] if exits is not None and len(exits) else [])
    when = pd.concat(when) if len(when) > 1 else when[0]
    if len(when) and len(out):
        exited = when.groupby(keys, observed=True)["ts"].min()
        held = out[~at_exit & (out["source"].astype(str).isin(HELD_SOURCES) if "source" in out else True)]
        held = held[pd.MultiIndex.from_frame(held[keys]).isin(exited.index)]
        # the last two snapshots of each exited process: (ts, sampled bytes held)
        per_ts = held.groupby([*keys, "ts"], observed=True)["outstanding_bytes"].sum()
        last2 = per_ts.groupby(level=[0, 1], observed=True).tail(2)
        for (rec, pid), g in last2.groupby(level=[0, 1], observed=True):
            ts = g.index.get_level_values("ts")
            if len(g) == 2 and (exited[(rec, pid)] - ts[-1]).total_seconds() <= TEARDOWN_S \
                    and g.iloc[-1] < 0.5 * g.iloc[-2]:
                at_exit |= ((out["recording_id"] == rec) & (out["pid"] == pid) & (out["ts"] == ts[-1])).to_numpy()
    out = out.drop(columns="exiting") if "exiting" in out else out
    if not at_exit.any():
        return out, out.iloc[:0]
    return out[~at_exit], out[at_exit]


def exit_events(root: str | Path, pids: list[int] | None = None) -> pd.DataFrame:
    """`targets` rows of the processes' exits (ts, recording_id, pid)."""
    flt = ds.field("event") == "exit"
    if pids:
        flt = flt & ds.field("pid").isin(pids)
    return read_table(root, "targets", filter=flt, columns=["ts", "recording_id", "pid"])


AT_EXIT = ds.field("exiting") == True  # noqa: E712  (an Arrow expression)
RUNNING = ds.field("exiting").is_null() | (ds.field("exiting") == False)  # noqa: E712


def read_outstanding(root: str | Path, *, filter=None, columns: list[str] | None = None,
                     pids: list[int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(running rows, teardown rows) of the `outstanding` table (split_exit). The rows written at
    exits are filtered apart while scanning, so the big running frame is never copied for them."""
    cols = None if columns is None else [c for c in columns if c != "exiting"]
    teardown = read_table(root, "outstanding", filter=AT_EXIT if filter is None else filter & AT_EXIT, columns=cols)
    out = read_table(root, "outstanding", filter=RUNNING if filter is None else filter & RUNNING, columns=cols)
    for df in (out, teardown):
        if "exiting" in df:     # all of one kind here (read with columns=None): ours to drop in place
            del df["exiting"]
    exits = exit_events(root, pids)
    out, late = split_exit(out, pd.concat([teardown[["ts", "recording_id", "pid"]], exits])
                           if len(teardown) else exits)
    return out, pd.concat([teardown, late]) if len(late) else teardown


def latest_outstanding(root: str | Path, pids: list[int] | None = None, pinned: bool = False) -> pd.DataFrame:
    """The last snapshot of each (recording, process), joined with stack summaries; with `pinned`,
    the last that charged pinned pages (the recorder reads heap layouts as their cost allows)."""
    flt = ds.field("pid").isin(pids) if pids else None
    if pinned:
        flt = ds.field("pinned_bytes").is_valid() if flt is None else flt & ds.field("pinned_bytes").is_valid()
    out, _ = read_outstanding(root, filter=flt, pids=pids)
    if out.empty:
        return out
    last = out.groupby(["recording_id", "pid"], observed=True)["ts"].transform("max")
    out = out[out["ts"] == last]
    stacks = read_table(root, "stacks", columns=["stack_id", "site", "summary", "n_frames"])
    stacks = stacks.drop_duplicates("stack_id")
    return out.merge(stacks, on="stack_id", how="left")


class _ReadOnUse:
    """A Dataset field that `load` leaves unread, read on first use with the load's filters: the
    outstanding rows (with the teardown rows read beside them), the processes rows. The detectors
    stream the first (`batches`) and read the second a part at a time (`parts`)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None                     # the field's default: not read yet
        d, sc = obj.__dict__, obj.scan
        if d.get(self.slot) is None and sc is not None:
            if self.slot == "_processes":
                d["_processes"] = read_table(obj.root, "processes", filter=sc.rows)
            elif d.get("_outstanding") is None:
                d["_outstanding"], d["_teardown"] = read_outstanding(obj.root, filter=sc.filter, columns=sc.columns,
                                                                     pids=sc.pids)
        return d.get(self.slot)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value
        obj.__dict__.pop("_by_process", None)       # Dataset.by_process: grouped from the old rows


# A part of the processes table (Dataset.parts): at most this many rows, ~25 MiB in pandas
PART_ROWS = 1 << 16


@dataclass
class Dataset:
    """The tables of one dataset directory, filtered, as DataFrames."""

    root: Path | Source
    outstanding: pd.DataFrame = _ReadOnUse()          # running state only (split_exit)
    processes: pd.DataFrame = _ReadOnUse()
    stacks: pd.DataFrame = field(default_factory=pd.DataFrame)
    frames: pd.DataFrame = field(default_factory=pd.DataFrame)
    vm_events: pd.DataFrame = field(default_factory=pd.DataFrame)
    targets: pd.DataFrame = field(default_factory=pd.DataFrame)
    recordings: pd.DataFrame = field(default_factory=pd.DataFrame)
    sources: list[str] | None = None    # the source filter it was loaded with (None: all)
    teardown: pd.DataFrame | None = _ReadOnUse()      # outstanding rows of exiting processes' teardowns
    scan: Scan | None = None            # how `load` filtered the tables it left unread
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # detectors' caches

    def _read(self) -> bool:
        """Whether `outstanding` is in memory (given, or read since)."""
        return self.__dict__.get("_outstanding") is not None or self.scan is None

    def forget(self) -> None:
        """Drop what was derived from the files (their rows may have moved: a compaction)."""
        self.derived.clear()
        self.__dict__["_summary"] = None
        self.__dict__.pop("_kept", None)

    def summary(self) -> pd.DataFrame:
        """Per process of `processes` (recording_id, pid): its rows, first and last snapshot, and
        whether a tier that does not see allocations measured it (`other_tier`). Read once, a
        file at a time: a week of snapshots costs what a day does."""
        if self.__dict__.get("_summary") is None:
            cols = ["recording_id", "pid", "ts", "tier"]
            keys = ["recording_id", "pid"]
            p = self.__dict__.get("_processes")
            batches = pa.Table.from_pandas(p.reindex(columns=cols).astype({"recording_id": str, "tier": object}),
                                           preserve_index=False).to_batches() if p is not None else \
                _batches(self.root, "processes", cols, self.scan.rows)
            per = []
            for b in batches:       # Arrow's group_by per batch, then the few per-process rows joined
                tier = b.column("tier").cast(pa.string())      # null: older data, an allocation tier
                other = pc.and_(pc.is_valid(tier), pc.invert(pc.is_in(tier, pa.array(ALLOCATION_TIERS))))
                t = pa.table({"recording_id": b.column("recording_id").cast(pa.string()), "pid": b.column("pid"),
                              "ts": b.column("ts"), "other": pc.fill_null(other, False)})
                per.append(t.group_by(keys).aggregate([("ts", "count"), ("ts", "min"), ("ts", "max"),
                                                       ("other", "any")]).to_pandas())
            out = pd.concat(per).groupby(keys).agg({"ts_count": "sum", "ts_min": "min", "ts_max": "max",
                                                    "other_any": "any"}).reset_index() if per else \
                pd.DataFrame(columns=[*keys, "ts_count", "ts_min", "ts_max", "other_any"])
            out = out.rename(columns={"ts_count": "rows", "ts_min": "first_ts", "ts_max": "last_ts",
                                      "other_any": "other_tier"})
            self.__dict__["_summary"] = out
        return self.__dict__["_summary"]

    def tiers(self) -> pd.DataFrame:
        """(recording_id, pid, ts, tier) of the processes that a tier blind to allocations measured
        at some snapshot (summary().other_tier); the others' snapshots all measured them."""
        cols = ["recording_id", "pid", "ts", "tier"]
        odd = self.summary()
        odd = odd[odd["other_tier"].astype(bool)]
        if odd.empty:
            return pd.DataFrame(columns=cols)
        p = self.__dict__.get("_processes")
        if p is None:
            flt = ds.field("pid").isin(sorted({int(x) for x in odd["pid"]}))
            p = read_streamed(self.root, "processes", flt if self.scan.rows is None else self.scan.rows & flt, cols)
        p = p.reindex(columns=cols)
        wanted = pd.MultiIndex.from_frame(odd[["recording_id", "pid"]].astype({"recording_id": str}))
        return p[pd.MultiIndex.from_arrays([p["recording_id"].astype(str), p["pid"]]).isin(wanted)]

    def parts(self, rows: int | None = None, columns: list[str] | None = None) -> Iterator[Dataset]:
        """The dataset as parts of whole processes whose `processes` rows are at most `rows` (one
        part, itself, when all of them are): the detectors that read `processes` run part by part,
        in memory bounded by a part, of `columns` only (None: all; recording_id and pid always).
        Every part shares the other tables and `derived`."""
        rows = PART_ROWS if rows is None else rows
        counts = self.summary().set_index(["recording_id", "pid"])["rows"]
        if counts.sum() <= rows or self.__dict__.get("_processes") is not None:
            return iter([self])
        groups, size = [[]], 0
        for key, n in counts.items():
            if size and size + n > rows:
                groups.append([])
                size = 0
            groups[-1].append(key)
            size += n
        group_of = {(str(r), int(pid)): g for g, keys in enumerate(groups) for r, pid in keys}
        return self._parts(_Spill(self.root, self.scan.rows, group_of, len(groups), columns))

    def _parts(self, spill: _Spill) -> Iterator[Dataset]:
        for p in spill:
            part = copy.copy(self)      # not dataclasses.replace: that would read what is unread
            part.processes = p
            part.__dict__["_summary"] = None
            yield part
            del part, p

    def batches(self, columns: list[str], rows: int = 1 << 17, running: bool = True,
                keep: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The rows of `outstanding` in Arrow batches of `columns`, streamed from the files: the
        running ones (split_exit's late teardown snapshots too), or with `running=False` every row,
        the `exiting` column with them. Rows in memory are all running ones. `keep`: the columns
        of the next call, which one host's Source reads now with these and keeps for it (a read
        and its filter saved: the rows are read whole there anyway)."""
        if self._read():
            df = self.outstanding if self.outstanding is not None else pd.DataFrame(columns=columns)
            table = pa.Table.from_pandas(df[[c for c in columns if c in df]], preserve_index=False)
            yield from table.to_batches(rows)
            return
        flt = self.scan.filter
        if not running:
            columns = [*columns, "exiting"]
        if isinstance(self.root, Source):       # one host's files: read whole (analysis/fleet.py streams hosts)
            kept = self.__dict__.pop("_kept", None)
            wanted = list(dict.fromkeys([*columns, *(keep or ()), "exiting"]))
            t = kept if kept is not None and set(columns) <= set(kept.column_names) else \
                self.root.read("outstanding", filter=flt, columns=wanted, arrow=True)
            del kept
            if keep:
                self.__dict__["_kept"] = t
            if running:     # as RUNNING would, without a filter node over every column (2-3x the read)
                gone = pc.fill_null(t.column("exiting"), False)
                if pc.any(gone).as_py():
                    t = t.filter(pc.invert(gone))
            yield from t.select(columns).to_batches(rows)
            return
        # files hold a flush or an hour each: small batches are joined, as the per-batch work is fixed
        buf: list[pa.RecordBatch] = []
        n = 0
        for b in stream(Path(self.root) / "outstanding", TABLES["outstanding"], columns, flt, rows, running):
            if buf and (b.schema != buf[0].schema or n + b.num_rows > rows):
                yield from _joined(buf)
                buf, n = [], 0
            buf.append(b)
            n += b.num_rows
        yield from _joined(buf)

    def exits(self) -> dict[tuple[str, int], int]:
        """(recording, pid) -> its exit event's time (us; the `exiting` rows say it too: `batches`);
        {} when the rows are in memory (their teardown is split off already)."""
        if self._read():        # rows in memory are the running ones already (read_outstanding split them)
            return {}
        first = exit_events(self.root, self.scan.pids).groupby(["recording_id", "pid"], observed=True)["ts"].min()
        return {(str(r), int(p)): int(pd.Timestamp(t).value // 1000) for (r, p), t in first.items()}

    def by_process(self) -> dict[tuple[str, int], pd.DataFrame]:
        """The `processes` rows per (recording, pid), each in time order: grouped once, for the
        detectors that each look at every process."""
        if self.__dict__.get("_by_process") is None:
            p = self.processes
            groups: dict[tuple[str, int], pd.DataFrame] = {}
            if len(p):      # one sort of the rows, then a slice per process (groupby copied each group)
                rec, recs = pd.factorize(p["recording_id"], sort=True)
                known = (rec >= 0) & p["pid"].notna().to_numpy()        # groupby's keys: no nulls
                pid = p["pid"].to_numpy(np.int64, na_value=0)
                order = np.lexsort((p["ts"].to_numpy("datetime64[us]"), pid, rec))
                order = order[known[order]]
                p = p.take(order)
                rec, pid = rec[order], pid[order]
                cut = np.flatnonzero((rec[1:] != rec[:-1]) | (pid[1:] != pid[:-1])) + 1
                for a, z in zip([0, *cut.tolist()], [*cut.tolist(), len(p)], strict=True):
                    groups[(str(recs[rec[a]]), int(pid[a]))] = p.iloc[a:z]
            self.__dict__["_by_process"] = groups
        return self.__dict__["_by_process"]

    def frames_of(self, stack_id: int) -> pd.DataFrame:
        """A stack's frames, innermost first (the table sorted once: findings ask for many)."""
        f, ids = self._frames_sorted()
        return f.iloc[np.searchsorted(ids, stack_id, "left"):np.searchsorted(ids, stack_id, "right")]

    def frame_records(self, stack_id: int) -> list[dict[str, Any]]:
        """A stack's frames as plain records (column -> value, None where null), innermost first:
        the columns are turned into Python lists once, not a DataFrame slice per stack."""
        if "frame_lists" not in self.derived:
            f, _ = self._frames_sorted()
            self.derived["frame_lists"] = {c: f[c].astype(object).where(f[c].notna(), None).tolist()
                                           for c in f.columns}
        _, ids = self._frames_sorted()
        cols = self.derived["frame_lists"]
        return [{c: v[i] for c, v in cols.items()}
                for i in range(np.searchsorted(ids, stack_id, "left"), np.searchsorted(ids, stack_id, "right"))]

    def _frames_sorted(self) -> tuple[pd.DataFrame, np.ndarray]:
        if "frames_sorted" not in self.derived:
            f = self.frames.sort_values(["stack_id", "depth"], kind="stable") if len(self.frames) else self.frames
            self.derived["frames_sorted"] = (f, f["stack_id"].to_numpy() if len(f) else np.zeros(0, np.int64))
        return self.derived["frames_sorted"]


# the columns that load's filters name (window, processes, sources, exits)
FILTER_COLUMNS = ("ts", "pid", "source", "exiting")


def table_files(path: Path) -> list[Path]:
    """The data files of a local table directory (both layouts), in partition and name order."""
    paths: list[Path] = []
    for part in layout.table_partitions(path):
        try:
            paths += sorted(part.path / e.name for e in os.scandir(part.path)
                            if e.name.endswith(".parquet") and not e.name.startswith((".", "_")))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return paths


def null_columns(path: Path, columns: list[str]) -> set[str]:
    """Of `columns`, those that every file of a local table directory lacks or holds only nulls
    in, as its footer's statistics say (a file without them holds values). Reading them would
    only decode nulls: a host without GPUs, or the tiers that read no arenas, leave a third of
    `processes` empty."""
    null = set(columns)
    for p in table_files(path):
        if not null:
            break
        try:
            meta = pq.read_metadata(p)
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowInvalid):
            return set()        # read as usual: the reader says what is wrong with it
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for i in range(rg.num_columns):
                c = rg.column(i)
                st = c.statistics           # nested columns' leaves have dotted paths: never in `null`
                if c.path_in_schema in null and (st is None or not st.has_null_count or st.null_count != rg.num_rows):
                    null.discard(c.path_in_schema)
    return null


def stream(path: Path, table, columns: list[str], filter, rows: int, running: bool = False,
           ) -> Iterator[pa.RecordBatch]:
    """The rows of a local table directory, file by file, in batches of `columns` (read_table's
    files, both layouts); columns a file lacks are nulls; with `running`, the `exiting` rows left
    out. One file at a time: pyarrow's dataset scanner keeps every file's footer until its scan
    ends (170 MiB for 2,400 files of `outstanding`), a file's own reader only its own. The next
    file is read while one is used (the reads release the GIL)."""
    schema = table.read_schema
    extra = [c for c in FILTER_COLUMNS if (filter is not None or running and c == "exiting")
             and c in schema.names and c not in columns]
    paths = table_files(path)

    def read(p: Path) -> pa.Table:
        f = pq.ParquetFile(p)
        have = set(f.schema_arrow.names)
        t = f.read(columns=[c for c in (*columns, *extra) if c in have])
        for c in (*columns, *extra):
            if c not in have:
                t = t.append_column(schema.field(c), pa.nulls(len(t), schema.field(c).type))
        if running and pc.any(t.column("exiting")).as_py():      # a plain mask, and only where one is exiting
            t = t.filter(pc.invert(pc.fill_null(t.column("exiting"), False)))
        if filter is not None:
            t = t.filter(filter)
        return t.select(columns)

    freed = 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = [pool.submit(read, p) for p in paths[:1]]
        for i in range(len(paths)):
            t = ahead.pop(0).result()
            if i + 1 < len(paths):
                ahead.append(pool.submit(read, paths[i + 1]))
            yield from t.to_batches(rows)
            freed += t.nbytes
            del t
            if freed > 16 << 20:      # mimalloc keeps what decoding freed: given back now and then
                pa.default_memory_pool().release_unused()
                freed = 0


def read_streamed(root: Path | Source, name: str, filter, columns: list[str]) -> pd.DataFrame:
    """read_table of a few columns of a big table: a local one is read a file at a time
    (`stream`), so that memory is the columns kept rather than every file's footer."""
    path = None if isinstance(root, Source) else Path(root) / name
    if path is None or not path.is_dir() or not layout.has_files(path):
        return read_table(root, name, filter=filter, columns=columns)
    parts = [pa.Table.from_batches([b]) for b in stream(path, TABLES[name], columns, filter, 1 << 20)]
    return pa.concat_tables(parts, promote_options="permissive").to_pandas(self_destruct=True, split_blocks=True)


def _batches(root: Path | Source, name: str, columns: list[str], filter) -> Iterator[pa.RecordBatch]:
    """A table's rows in batches: a local one streamed a file at a time, a Source's read whole."""
    if isinstance(root, Source):
        yield from root.read(name, filter=filter, columns=columns, arrow=True).to_batches()
        return
    path = Path(root) / name
    if not path.is_dir():
        yield from pa.Table.from_pandas(read_table(root, name, filter=filter, columns=columns),
                                       preserve_index=False).to_batches()
        return
    yield from stream(path, TABLES[name], columns, filter, 1 << 20)


class _Spill:
    """The `processes` rows (of `columns`; None: all) of each group of processes (`group_of`:
    (recording, pid) -> group), from one pass over the table: each group's rows go to an
    lz4-compressed Arrow file of their own in a temporary directory, read back one group at a time
    in group order. Rows are split SPILL_ROWS at a time (a file holds an hour: splitting each
    would write a few rows per group per file); a file of one process is written as it is. The
    files are written when the first group is asked for. (Writing them in a thread while the
    series are read saved 7% of a week's analysis and cost 40 MiB more at its peak: not done.)
    One host's Source (analysis/fleet.py) is read whole, as its `outstanding` is: its groups are
    split in memory."""

    def __init__(self, root: Path | Source, filter, group_of: dict[tuple[str, int], int], n: int,
                 columns: list[str] | None) -> None:
        full = TABLES["processes"].read_schema
        self.schema = pa.schema([f for f in full if columns is None or f.name in (*columns, "recording_id", "pid")])
        self.root, self.filter, self.group_of, self.n = root, filter, group_of, n

    def __iter__(self) -> Iterator[pd.DataFrame]:
        if isinstance(self.root, Source):       # one host's rows, read whole anyway: split in memory
            t = self.root.read("processes", filter=self.filter, columns=self.schema.names, arrow=True)
            t = t.select(self.schema.names).cast(self.schema).unify_dictionaries().combine_chunks()
            g = np.concatenate([self._groups(b) for b in t.to_batches()] or [np.zeros(0, np.int64)])
            for rows in _by_group(t, g, self.n):
                yield rows.to_pandas(split_blocks=True)
            return
        # columns null in every file are neither read nor written, and put back in each part
        null = null_columns(Path(self.root) / "processes",
                            [n for n in self.schema.names if n not in ("recording_id", "pid")])
        with tempfile.TemporaryDirectory(prefix="allocsampler-parts-") as tmp:
            files = [Path(tmp) / f"{g}.arrow" for g in range(self.n)]
            self._write(files, pa.schema([f for f in self.schema if f.name not in null]))
            for f in files:
                with pa.ipc.open_stream(f) as r:
                    df = r.read_all().to_pandas(self_destruct=True, split_blocks=True)
                f.unlink()
                for i, field in enumerate(self.schema):
                    if field.name in null:      # as Arrow converts a column of nulls
                        df.insert(i, field.name, pa.nulls(len(df), field.type).to_pandas())
                yield df

    def _groups(self, t: pa.RecordBatch) -> np.ndarray:
        """Each row's group (-1: none)."""
        rec = t.column("recording_id")          # a dictionary (the read schema's type)
        names = rec.dictionary.to_pylist()
        key = (rec.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64) << 32
               | t.column("pid").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
        inv, uniq = pd.factorize(key)
        return np.array([self.group_of.get((str(names[k >> 32]), int(k & 0xFFFFFFFF)), -1) for k in uniq],
                        np.int64)[inv]

    def _write(self, files: list[Path], schema: pa.Schema) -> None:
        n = self.n
        batches = stream(Path(self.root) / "processes", TABLES["processes"], schema.names, self.filter, 1 << 16)
        opts = pa.ipc.IpcWriteOptions(compression="lz4")
        # a stream, not a file: a batch may bring a dictionary of its own
        writers = [pa.ipc.new_stream(f, schema, options=opts) for f in files]
        group = self._groups

        def split(buf: list[pa.RecordBatch], groups: list[np.ndarray]) -> None:
            if not buf:
                return
            t = pa.Table.from_batches(buf, schema).unify_dictionaries().combine_chunks()
            g = np.concatenate(groups)
            buf.clear()
            groups.clear()
            for k, rows in enumerate(_by_group(t, g, n)):
                if rows.num_rows:
                    writers[k].write_table(rows)

        try:
            buf: list[pa.RecordBatch] = []
            groups: list[np.ndarray] = []
            size = 0
            for b in batches:
                b = b.select(schema.names)
                if b.schema != schema:          # an older file's types
                    b = b.cast(schema)
                if not b.num_rows:
                    continue
                g = group(b)
                if (g == g[0]).all():       # a file of one process (a recording's own): as it is
                    split(buf, groups)
                    size = 0
                    if g[0] >= 0:
                        writers[g[0]].write_batch(b)
                    continue
                buf.append(b)
                groups.append(g)
                size += b.num_rows
                if size >= SPILL_ROWS:
                    split(buf, groups)
                    size = 0
            split(buf, groups)
        finally:
            for w in writers:
                w.close()


SPILL_ROWS = 1 << 16


def _by_group(t: pa.Table, group: np.ndarray, n: int) -> list[pa.Table]:
    """The rows of each group 0..n-1 (`group`: each row's; -1: none), in their order: one take."""
    order = np.argsort(group, kind="stable")
    t, group = t.take(pa.array(order)), group[order]
    cuts = np.searchsorted(group, np.arange(n + 1))
    return [t.slice(cuts[k], cuts[k + 1] - cuts[k]) for k in range(n)]


def _joined(batches: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    if len(batches) == 1:
        yield batches[0]
    elif batches:
        yield from pa.Table.from_batches(batches).unify_dictionaries().combine_chunks().to_batches()


@dataclass(frozen=True)
class Scan:
    """How `load` filtered the tables it left unread, to read them later."""

    filter: Any                         # outstanding rows: window, processes, sources
    rows: Any                           # processes rows: window, processes
    columns: list[str] | None           # of outstanding (None: all)
    pids: list[int] | None


def _time_filter(since: dt.datetime | None, until: dt.datetime | None):
    expr = None
    for bound, op in ((since, ">="), (until, "<=")):
        if bound is None:
            continue
        e = ds.field("ts") >= pa.scalar(bound, pa.timestamp("us", tz="UTC")) if op == ">=" else \
            ds.field("ts") <= pa.scalar(bound, pa.timestamp("us", tz="UTC"))
        expr = e if expr is None else expr & e
    return expr


# What the detectors and reports read of `outstanding` (the big table): the rest stays on disk.
OUTSTANDING_COLUMNS = ["ts", "recording_id", "pid", "comm", "source", "stack_id", "outstanding_bytes",
                       "outstanding_stderr_bytes", "live_samples", "alloc_samples", "free_samples", "exiting"]


def load(root: str | Path | Source, *, pids: list[int] | None = None, sources: list[str] | None = None,
         since: dt.datetime | None = None, until: dt.datetime | None = None,
         outstanding_columns: list[str] | None = OUTSTANDING_COLUMNS) -> Dataset:
    """Read a dataset, keeping only the given processes, sources and time window (and, of the
    outstanding table, the columns analysis uses; None reads all)."""
    if not isinstance(root, Source):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"no dataset at {root}")
    when = _time_filter(since, until)
    by_pid = ds.field("pid").isin(pids) if pids else None

    def both(*exprs):
        exprs = [e for e in exprs if e is not None]
        if not exprs:
            return None
        out = exprs[0]
        for e in exprs[1:]:
            out = out & e
        return out

    src = ds.field("source").isin(sources) if sources else None
    targets = read_table(root, "targets", filter=by_pid)
    stacks = read_table(root, "stacks").drop_duplicates("stack_id")
    frames = read_frames(root)
    return Dataset(
        root=root,
        outstanding=None,
        processes=None,
        stacks=stacks,
        frames=frames,
        vm_events=read_table(root, "vm_events", filter=both(when, by_pid)),
        targets=targets,
        recordings=read_table(root, "recordings"),
        sources=sources,
        scan=Scan(both(when, by_pid, src), both(when, by_pid), outstanding_columns, pids),
    )
