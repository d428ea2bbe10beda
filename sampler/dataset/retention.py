"""Retention, compaction and crash recovery of a dataset directory (the daemon's output).

The daemon calls these from its loop (nothing here starts a thread):

- `recover(root)` once at start: removes what a kill -9 left behind.
- `enforce(root, max_bytes, max_age_days)` periodically: deletes the oldest data first.
- `compact(root, older_than_s)` hourly: merges the small per-interval files of each partition
  (`seal=True` with [upload]: merged files are final, sealed ones are what is uploaded).
- `DiskState`: stop writing below a free-space floor, resume when space is back.
- `ensure_private(root)`: 0750 directories, 0640 files, owned by root.

Both layouts of sampler.dataset.layout are handled, also mixed in one dataset.

Compaction is atomic for readers that know nothing of it (pandas, pyarrow, DuckDB). The merged
files are written in a work area, ROOT/.compact/<table>.host=<host>.date=<day>/ (schema <= 5:
<table>.date=<day>), beside hard links of the
partition's other files; that directory and the partition are then swapped by one
renameat2(RENAME_EXCHANGE). A reader lists either the old set of files or the new one, never a
merged file beside its sources, and a crash at any point leaves one of the two sets visible.
The work area (the unpublished new set, or the old set after the swap) is garbage in both cases
and recover() deletes it: the visible directory is the commit record, so no journal is needed.
The work area is outside every table directory because DuckDB's globs do not skip dot-names.
Swaps, cleanup and deletions hold the dataset lock (sampler.dataset.writer.root_lock)
exclusively; DatasetWriter holds it shared while it writes, so neither side sees the other's
half-done work.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import errno
import os
import re
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sampler import files
from sampler.dataset import layout
from sampler.dataset.schema import TABLES
from sampler.dataset.writer import (
    LOCK_FILE,
    MARKER_FILE,
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    DiskFull,
    is_dataset,
    mark_dataset,
    real_subdirs,
    remove_temporary_files,
    root_lock,
)

__all__ = ["CompactionReport", "DataFile", "DiskFull", "DiskState", "RetentionReport", "compact",
           "dataset_bytes", "dataset_files", "enforce", "ensure_private", "recover"]

STAGING = ".compact"
STATUS_FILE = ".status.json"    # the daemon's (sampler.service.daemon)
# What a dataset directory holds: a directory with anything else is not taken for one.
KNOWN_NAMES = frozenset({*TABLES, STAGING, STATUS_FILE, LOCK_FILE, MARKER_FILE, layout.UPLOAD_DIR})
# Written once per recording or per stack and referenced by later rows of any age: kept as long
# as their recording has data (a leak's stack was first seen on its first day).
METADATA_TABLES = frozenset({"recordings", "stacks", "frames"})
# One tiny file per recording, rewritten by name when the recording ends: never merged.
NOT_COMPACTED = frozenset({"recordings"})
ROW_GROUP_ROWS = 1 << 16        # rows buffered (and sorted by ts) per row group: bounds the memory
_HIDDEN = (".", "_")            # what pyarrow.dataset (hence pandas) skips
# DatasetWriter's <recording_id>-<seq>.parquet, or a merged <recording_id>-<first>_<last>.parquet
_NAME = re.compile(r"(?P<rec>.+)-(?P<first>\d+)(?:_(?P<last>\d+))?\.parquet")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _step(point: str) -> None:
    """Crash-test hook, called at each step of a compaction: the tests replace it to kill -9
    the process there."""


@dataclass
class DataFile:
    """One visible Parquet file of the dataset."""

    path: Path
    table: str
    day: dt.date
    disk_bytes: int             # disk usage
    mtime: float
    recording: str | None       # from the name; None when the name is not ours
    first: int | None = None    # sequence numbers it holds (DatasetWriter's per-table counter)
    last: int | None = None
    merged: bool = False        # written by compaction (<recording>-<first>_<last>.parquet)
    host: str | None = None     # its host= partition; None in the layout of schema <= 5
    mtime_ns: int = 0
    size: int = 0               # bytes (disk_bytes is the disk usage)

    def age_key(self) -> tuple:
        return self.day, self.mtime, str(self.path)


@dataclass
class RetentionReport:
    deleted: list[str] = field(default_factory=list)    # paths relative to the root
    deleted_bytes: int = 0
    expired: int = 0                # of the deleted files, those past the maximum age
    total_bytes: int = 0            # disk usage of the dataset afterwards
    # Above max_bytes after deleting all it may: files younger than keep_recent_s and the metadata
    # of recordings that still have data. The daemon should not write while this is > 0.
    over_budget_bytes: int = 0


@dataclass
class CompactionReport:
    merged: list[tuple[str, int]] = field(default_factory=list)     # (new file, files merged into it)
    files_before: int = 0           # files merged away
    bytes_before: int = 0
    bytes_after: int = 0
    skipped: list[str] = field(default_factory=list)                # partitions left alone, and why
    seconds: float = 0.0


def _epoch(now: float | dt.datetime | None) -> float:
    if now is None:
        return time.time()
    return now.timestamp() if isinstance(now, dt.datetime) else float(now)


def _usage(st: os.stat_result) -> int:
    return max(st.st_size, st.st_blocks * 512)


def dataset_files(root: str | os.PathLike) -> list[DataFile]:
    """The visible Parquet files of every table, in both layouts (sampler.dataset.layout): what
    readers see."""
    out = []
    for part in layout.partitions(root):
        if part.day is None:
            continue
        try:
            entries = list(os.scandir(part.path))
        except FileNotFoundError:
            continue
        for e in entries:
            if e.name.startswith(_HIDDEN) or not e.name.endswith(".parquet"):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            f = DataFile(Path(e.path), part.table, part.day, _usage(st), st.st_mtime, None, host=part.host,
                         mtime_ns=st.st_mtime_ns, size=st.st_size)
            if part.table == "recordings":
                f.recording = e.name[: -len(".parquet")]
            elif n := _NAME.fullmatch(e.name):
                f.recording, f.first = n["rec"], int(n["first"])
                f.last = int(n["last"] or n["first"])
                f.merged = n["last"] is not None
            out.append(f)
    return out


def dataset_bytes(root: str | os.PathLike) -> int:
    """Disk usage of every file under root (temporaries and work areas included)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += _usage(st) if stat.S_ISREG(st.st_mode) else 0
    return total


def _recordings_in(f: DataFile) -> frozenset[str]:
    if f.recording is not None:
        return frozenset((f.recording,))
    try:    # a file not named by DatasetWriter: ask its rows
        col = pq.ParquetFile(f.path).read(columns=["recording_id"]).column(0)
        return frozenset(str(v) for v in col.unique().to_pylist() if v is not None)
    except (OSError, KeyError, pa.ArrowException):
        return frozenset()


def _day_end(day: dt.date) -> float:
    return dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc).timestamp()


# -- retention ----------------------------------------------------------------------------------

def enforce(root: str | os.PathLike, max_bytes: int | None, max_age_days: float | None,
            now: float | dt.datetime | None = None, *, keep_recent_s: float = 60.0,
            keep_recordings: Collection[str] = (),
            backlog: Callable[[list[DataFile]], tuple[Collection[Path], Collection[Path]]] | None = None,
            ) -> RetentionReport:
    """Delete data past `max_age_days` (whole day partitions: a day goes when its last moment is
    that old), then the oldest files (by day, then modification time) until the dataset's disk
    usage fits `max_bytes`. None disables a limit.

    Never deleted: files younger than `keep_recent_s` (the daemon passes at least two intervals,
    so the latest snapshot survives any budget), and the `recordings`/`stacks`/`frames` files of
    a recording that still has data files or is in `keep_recordings` (the daemon passes its own:
    its recording row and stacks are written once and referenced by every later interval). Those
    of a recording whose data is all gone are deleted with its last data file. `backlog` (the
    daemon with [upload], sampler.service.upload) is given the listing and returns the files to
    keep (not uploaded yet, within its cap) and those to delete first (not uploaded, over the
    cap). What these leave over the budget is reported in `over_budget_bytes`."""
    root = Path(root)
    now_s = _epoch(now)
    report = RetentionReport()
    if not root.is_dir():
        return report
    cutoff = None if max_age_days is None else now_s - max_age_days * 86400
    touched: set[Path] = set()
    with root_lock(root, exclusive=True):
        files = dataset_files(root)
        data = sorted((f for f in files if f.table not in METADATA_TABLES), key=DataFile.age_key)
        meta = [(f, _recordings_in(f)) for f in files if f.table in METADATA_TABLES]
        recs = {id(f): _recordings_in(f) for f in data}
        live = Counter(r for f in data for r in recs[id(f)])
        keep = set(keep_recordings)
        protected, dropped = backlog(files) if backlog is not None else ((), ())
        protected, dropped = set(protected), set(dropped)
        total = dataset_bytes(root)

        def delete(f: DataFile) -> None:
            nonlocal total
            f.path.unlink(missing_ok=True)
            touched.add(f.path.parent)
            total -= f.disk_bytes
            report.deleted.append(str(f.path.relative_to(root)))
            report.deleted_bytes += f.disk_bytes
            if cutoff is not None and _day_end(f.day) <= cutoff:
                report.expired += 1

        def drop_dead_metadata() -> None:
            nonlocal meta
            kept = []
            for f, rs in meta:
                if now_s - f.mtime >= keep_recent_s and f.path not in protected \
                        and not any(live[r] or r in keep for r in rs):
                    delete(f)
                else:
                    kept.append((f, rs))
            meta = kept

        def drop_data(f: DataFile) -> None:
            delete(f)
            live.subtract(recs[id(f)])
            if any(live[r] <= 0 for r in recs[id(f)]):
                drop_dead_metadata()

        deletable = [f for f in data if now_s - f.mtime >= keep_recent_s and f.path not in protected]
        remaining = []
        for f in deletable:
            if f.path in dropped or (cutoff is not None and _day_end(f.day) <= cutoff):
                drop_data(f)
            else:
                remaining.append(f)
        drop_dead_metadata()            # also those of recordings that had no data left before
        for f in remaining:             # oldest first
            if max_bytes is None or total <= max_bytes:
                break
            drop_data(f)
        for d in touched:               # empty partitions go too (a writer re-creates its own)
            with contextlib.suppress(OSError):
                d.rmdir()
                if d.parent.name.startswith(layout.HOST_PREFIX):
                    d.parent.rmdir()
    report.total_bytes = dataset_bytes(root)
    if max_bytes is not None:
        report.over_budget_bytes = max(0, report.total_bytes - max_bytes)
    return report


# -- compaction ---------------------------------------------------------------------------------

@dataclass
class _Bin:
    sources: list[DataFile]
    schema: pa.Schema

    @property
    def name(self) -> str:
        return f"{self.sources[0].recording}-{self.sources[0].first:06d}_{self.sources[-1].last:06d}.parquet"


class _NoExchange(OSError):
    """The filesystem cannot swap two directories atomically."""


_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (renameat2 RENAME_EXCHANGE: Linux >= 3.15; ext4, xfs,
    btrfs, tmpfs; not NFS)."""
    if _renameat2 is None:
        raise _NoExchange(errno.ENOSYS, "renameat2 is not in this libc", str(a))
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        cls = _NoExchange if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) else OSError
        raise cls(err, os.strerror(err), str(a), None, str(b))


def _schema(f: DataFile) -> pa.Schema | None:
    try:
        return pq.read_schema(f.path)
    except (OSError, pa.ArrowException):
        return None


def _bins(files: list[DataFile], candidates: set[Path], target_bytes: int, *, singles: bool = False) -> list[_Bin]:
    """Runs of consecutive candidate files of one recording with one schema, up to target_bytes.
    A run stops at a file that is not a candidate, so that a merged file's name range never
    straddles another file and names keep sorting in time order. Runs of one file are left
    alone unless `singles` (sealing: the file is renamed)."""
    by_rec: dict[str, list[DataFile]] = defaultdict(list)
    for f in files:
        if f.first is not None:
            by_rec[f.recording].append(f)
    bins: list[_Bin] = []
    for fs in by_rec.values():
        runs: list[list[tuple[DataFile, pa.Schema]]] = [[]]
        size = 0
        for f in sorted(fs, key=lambda f: f.first):
            schema = _schema(f) if f.path in candidates else None
            run = runs[-1]
            if schema is None or (run and (not schema.equals(run[0][1], check_metadata=True)
                                           or size + f.disk_bytes > target_bytes)):
                runs.append([])
                size = 0
            if schema is not None:
                runs[-1].append((f, schema))
                size += f.disk_bytes
        bins += [_Bin([f for f, _ in run], run[0][1]) for run in runs if len(run) > (0 if singles else 1)]
    return bins


def _write_rows(w: pq.ParquetWriter, tables: list[pa.Table]) -> None:
    t = pa.concat_tables(tables)
    if "ts" in t.column_names:
        t = t.sort_by("ts")         # stable: rows of one ts keep their order (frames by depth)
    w.write_table(t, row_group_size=ROW_GROUP_ROWS)


def _merge(b: _Bin, out: Path) -> int:
    """Write the rows of b's sources, in order, as `out` (in the work area); returns its size.
    One source is linked under the new name: the same bytes, mode and modification time."""
    if len(b.sources) == 1:
        os.link(b.sources[0].path, out, follow_symlinks=False)
        return _usage(os.stat(out))
    tmp = out.with_name(f".{out.name}.tmp")
    first = os.stat(b.sources[0].path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        with pq.ParquetWriter(f, b.schema, compression="zstd") as w:
            buf, rows = [], 0
            for src in b.sources:       # sequence order is time order; sorted by ts per row group
                with pq.ParquetFile(src.path) as pf:
                    t = pf.read(use_threads=False)    # small files: threads cost more than they save
                buf.append(t)
                rows += t.num_rows
                if rows >= ROW_GROUP_ROWS:
                    _write_rows(w, buf)
                    buf, rows = [], 0
                    _step("merge")
            if buf:
                _write_rows(w, buf)
        f.flush()
        if os.geteuid() == 0:
            os.fchown(f.fileno(), first.st_uid, first.st_gid)
        os.fchmod(f.fileno(), stat.S_IMODE(first.st_mode))     # the writer's modes, not ours
        os.fsync(f.fileno())
    mtime = max(s.mtime for s in b.sources)
    os.utime(tmp, (mtime, mtime))       # retention goes by age: merged rows keep theirs
    os.replace(tmp, out)
    return _usage(os.stat(out))


def _remove_tree(path: Path) -> bool:
    """rm -r, links removed, never followed."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            path.unlink()
            return True
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        path.unlink(missing_ok=True)
        return True
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            _remove_tree(Path(e.path))
        else:
            os.unlink(e.path)
            _step("remove")
    os.rmdir(path)
    return True


def _compact_partition(root: Path, live: Path, bins: list[_Bin], report: CompactionReport) -> None:
    work = root / STAGING / ".".join(live.relative_to(root).parts)
    files.subdir(root, STAGING, 0o700)     # a link there is refused, not written through
    _remove_tree(work)
    work.mkdir(mode=0o700)
    rel = live.relative_to(root)
    try:
        sizes = [_merge(b, work / b.name) for b in bins]
        _step("merged")
        with root_lock(root, exclusive=True):
            sources = {s.path.name for b in bins for s in b.sources}
            entries = {e.name: e for e in os.scandir(live)}
            if not sources <= entries.keys():
                report.skipped.append(f"{rel}: files were deleted while merging")
                return
            for name, e in entries.items():
                # a temporary here is a killed writer's (a live one would hold the lock): it
                # leaves with the old set
                if name in sources or (name.startswith(".") and name.endswith(".tmp")):
                    continue
                if not e.is_file(follow_symlinks=False) or (work / name).exists():
                    report.skipped.append(f"{rel}: unexpected entry {name}")
                    return
                os.link(e.path, work / name)
                _step("link")
            st = os.stat(live)
            if os.geteuid() == 0:
                os.chown(work, st.st_uid, st.st_gid)
            os.chmod(work, stat.S_IMODE(st.st_mode))        # the work area becomes the partition
            files.fsync_dir(work)
            _step("linked")
            _exchange(work, live)
            _step("exchanged")
            files.fsync_dir(live.parent)
            files.fsync_dir(work.parent)
        for b, size in zip(bins, sizes, strict=True):
            report.merged.append((str(rel / b.name), len(b.sources)))
            report.files_before += len(b.sources)
            report.bytes_before += sum(s.disk_bytes for s in b.sources)
            report.bytes_after += size
    finally:
        _remove_tree(work)      # after the swap: the old set; before it: the unpublished new one


def compact(root: str | os.PathLike, older_than_s: float, target_bytes: int = 64 << 20,
            now: float | dt.datetime | None = None, *, seal: bool = False) -> CompactionReport:
    """Merge, per table and day partition, the files of each recording older than
    `older_than_s` into files of up to about `target_bytes` (files that size or larger are left
    alone). Schema (metadata included), rows, their order by ts and the files' modification
    times (retention's age) are kept. Raises DiskFull when there is no room for a merged file
    (nothing changes then); the merge needs free space for one partition's merged files.

    `seal` (the daemon with an [upload] section): merged files are final, never merged again,
    and every file older than `older_than_s` goes into one, alone if need be (a link under the
    merged name) and whatever its size: a merged name then means a closed file, which is what
    is uploaded (sampler.dataset.upload), so that no row reaches the store in two objects."""
    root = Path(root)
    now_s = _epoch(now)
    t0 = time.monotonic()
    report = CompactionReport()
    by_part: dict[Path, list[DataFile]] = defaultdict(list)
    for f in dataset_files(root):
        if f.table not in NOT_COMPACTED:
            by_part[f.path.parent].append(f)
    for live, part in sorted(by_part.items()):
        if seal:
            candidates = {f.path for f in part if f.first is not None and not f.merged
                          and now_s - f.mtime >= older_than_s}
        else:
            candidates = {f.path for f in part if f.first is not None and f.disk_bytes < target_bytes
                          and now_s - f.mtime >= older_than_s}
        bins = _bins(part, candidates, target_bytes, singles=seal)
        if not bins:
            continue
        try:
            _compact_partition(root, live, bins, report)
        except _NoExchange as e:
            report.skipped.append(f"{live.relative_to(root)}: not compacted, the filesystem cannot swap "
                                  f"directories atomically ({e.strerror})")
            break
        except DiskFull:
            raise
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise DiskFull(e.errno, e.strerror, e.filename) from e
            report.skipped.append(f"{live.relative_to(root)}: {e}")
        except pa.ArrowException as e:     # an unreadable source: the partition stays as it is
            report.skipped.append(f"{live.relative_to(root)}: {e}")
    report.seconds = time.monotonic() - t0
    return report


# -- recovery, modes, free space ----------------------------------------------------------------

def recover(root: str | os.PathLike) -> list[str]:
    """At start: delete the temporary files of interrupted writes and the work areas of
    interrupted compactions (readers saw each partition either before or after its compaction,
    never both: nothing else needs undoing or finishing). Returns what it did, for the log."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [f"removed {p.relative_to(root)} (interrupted write)" for p in remove_temporary_files(root)]
    staging = root / STAGING
    with root_lock(root, exclusive=True):
        if os.path.islink(staging):     # not ours: removed, never followed
            staging.unlink()
            done.append(f"removed {STAGING} (a symbolic link)")
        for p in real_subdirs(root / STAGING) if staging.is_dir() else []:
            _remove_tree(p)
            done.append(f"removed {p.relative_to(root)} (work area of an interrupted compaction)")
    return done


def ensure_private(root: str | os.PathLike, *, dir_mode: int = PRIVATE_DIR_MODE,
                   file_mode: int = PRIVATE_FILE_MODE) -> int:
    """Create root if missing and bring the whole tree to `dir_mode` directories and `file_mode`
    files owned by root when running as root (the group is kept: it may be given read access).
    Stack traces reveal paths and code. Only a dataset is changed (empty, marked, or holding only
    our names): any other directory (data_dir = /) raises UnsafePath, so that no tree that is not
    ours is chowned. Links are neither followed nor changed: each entry is opened O_PATH|O_NOFOLLOW
    and changed through that descriptor, so a name swapped for a link meanwhile is not followed.
    Returns how many entries were changed."""
    root = files.output_dir(root, dir_mode, "data directory") if not os.path.lexists(root) else Path(root)
    if os.path.islink(root) or not root.is_dir():
        raise files.UnsafePath(f"{root} is not a directory (or is a link): give a directory path")
    if not is_dataset(root, KNOWN_NAMES):
        raise files.UnsafePath(f"{root} is not empty and holds no allocsampler dataset (no {MARKER_FILE}): "
                               "give a new or empty directory (its modes and owner would be changed)")
    mark_dataset(root)
    as_root = os.geteuid() == 0

    def fix(path: str, want_dir: bool) -> int:
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            st = os.fstat(fd)
            if not (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)):
                return 0                # links, FIFOs, devices: left alone
            mode = dir_mode if want_dir else file_mode
            via = f"/proc/self/fd/{fd}"     # the inode we opened, whatever the name is now
            changed = 0
            if as_root and st.st_uid != 0:
                os.chown(via, 0, -1)
                changed = 1
            if stat.S_IMODE(st.st_mode) != mode or changed:     # chown clears set-id bits: chmod after
                os.chmod(via, mode)
                changed = 1
            return changed
        finally:
            os.close(fd)

    n = fix(str(root), True)
    for dirpath, dirnames, filenames in os.walk(root):      # does not descend into symlinked dirs
        n += sum(fix(os.path.join(dirpath, d), True) for d in dirnames)
        n += sum(fix(os.path.join(dirpath, f), False) for f in filenames)
    return n


@dataclass
class DiskState:
    """Free space on the dataset's filesystem against a floor. While `full` the daemon does not
    write (it keeps serving metrics); update() and mark_full() return True when `full` changes,
    so that it logs once per change."""

    path: Path
    floor_bytes: int = 256 << 20
    resume_bytes: int | None = None     # resume above this; default 2 x floor, no flapping at the edge
    retry_s: float = 300.0              # after a DiskFull, wait this long before trying again
    full: bool = False
    free_bytes: int | None = None
    _failed_at: float | None = field(default=None, init=False, repr=False)

    def update(self, now: float | None = None) -> bool:
        """Re-read the free space (statvfs: what non-root may use, so root's reserve is left)."""
        st = os.statvfs(self.path)
        self.free_bytes = st.f_bavail * st.f_frsize
        now = time.monotonic() if now is None else now
        if self.full:
            resume = self.resume_bytes if self.resume_bytes is not None else 2 * self.floor_bytes
            # a failed write (quota: statvfs does not see it) is retried only after retry_s
            waited = self._failed_at is None or now - self._failed_at >= self.retry_s
            full = self.free_bytes < resume or not waited
        else:
            full = self.free_bytes < self.floor_bytes
        changed, self.full = full != self.full, full
        if not full:
            self._failed_at = None
        return changed

    def mark_full(self, now: float | None = None) -> bool:
        """After a write raised DiskFull."""
        self._failed_at = time.monotonic() if now is None else now
        changed, self.full = not self.full, True
        return changed
