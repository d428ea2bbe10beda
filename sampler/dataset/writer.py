"""Writing the Hive-partitioned Parquet dataset: OUT/<table>/host=<host>/date=YYYY-MM-DD/<file>.parquet
(sampler.dataset.layout: the paths, and the layout of schema <= 5 that readers still accept).

Every file is written under a temporary dot-name in its final directory, fsynced, then renamed:
readers (pyarrow.dataset and pandas skip dot-files; the temporary name does not end in .parquet,
so DuckDB's globs, which do not skip dot-files, miss it too) and a crash never see a partial file.
A write holds a shared flock on OUT/.lock (a file of ours: a lock on the directory itself could be
taken by anyone who can open it, blocking every write): whoever deletes temporaries or swaps a
partition (sampler.dataset.retention) takes it exclusively, so it never removes a file a live
writer is writing.

Recordings are private by default (0700 directories, 0600 files: stack traces reveal paths and
code); OUT must be a new path or a directory of ours that no one else may write to, and a table
or partition directory inside it that is a link or not ours is refused (sampler.files). The
marker file OUT/.allocsampler-dataset says the directory is a dataset (the daemon changes modes
only in such a directory).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sampler import files
from sampler.dataset import layout
from sampler.dataset.schema import Table

# The daemon's modes: stack traces reveal paths and code, so no world access (its group may read).
PRIVATE_DIR_MODE = 0o750
PRIVATE_FILE_MODE = 0o640
LOCK_FILE = ".lock"
MARKER_FILE = ".allocsampler-dataset"
# Nothing can be written now, but may be later: the daemon pauses, the CLI ends the recording.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)



def use_system_allocator() -> None:
    """pyarrow's buffers from the system allocator: what it frees goes back with malloc_trim
    (its default jemalloc/mimalloc pools keep tens of MiB of a long recording's writes)."""
    pa.set_memory_pool(pa.system_memory_pool())


def leave_pandas_unloaded() -> None:
    """For a process that writes rows but never hands pyarrow a pandas object (the recorder):
    pyarrow imports pandas (44 MiB of RSS beside pyarrow, 2026-11-27) the first time it converts a
    Python list, only to ask whether the list is a pandas object. Its one look, taken here, finds
    no pandas; a later to_pandas() still imports it (pyarrow tries again when it needs it)."""
    if "pandas" in sys.modules:
        return
    sys.meta_path.insert(0, _NoPandas)
    try:
        pa.array([], pa.int8())
    finally:
        sys.meta_path.remove(_NoPandas)


class _NoPandas:
    """An import finder under which `import pandas` raises ImportError."""

    @staticmethod
    def find_spec(name: str, path=None, target=None) -> None:
        if name == "pandas":
            raise ImportError("pandas is left unloaded here")

class DiskFull(OSError):
    """A write failed for lack of space (ENOSPC/EDQUOT) or a read-only filesystem (EROFS); no
    partial file was left visible."""


class DatasetWriter:
    def __init__(self, root: str | os.PathLike, recording_id: str, *, host: str | None = None,
                 dir_mode: int = files.OUTPUT_DIR_MODE, file_mode: int = files.OUTPUT_FILE_MODE):
        self.root = Path(root)
        self.recording_id = recording_id
        self.host = host            # its partition: host=<layout.host_key(host)>
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._seq: dict[str, int] = {}
        files.output_dir(self.root, dir_mode, "dataset directory")
        mark_dataset(self.root)
        remove_temporaries(self.root)

    def write(self, table: Table, rows: list[dict] | pa.Table, *, name: str | None = None,
              day: dt.date | None = None) -> Path | None:
        """Write rows (dicts, or an Arrow table of the schema) as one new file, or replace the
        file `name`. Returns its path. Raises DiskFull when the filesystem is full."""
        if len(rows) == 0:
            return None
        day = day or dt.datetime.now(dt.timezone.utc).date()
        directory = layout.partition_dir(self.root, table.name, self.host, day)
        if name is None:
            seq = self._seq[table.name] = self._seq.get(table.name, 0) + 1
            name = f"{self.recording_id}-{seq:06d}"
        path = directory / f"{name}.parquet"
        if not isinstance(rows, pa.Table):
            rows = self._stamp(table, rows)
        data = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=table.schema)
        try:
            if not self.root.is_dir():                  # deleted under a running recorder: back
                files.output_dir(self.root, self.dir_mode, "dataset directory")
            with root_lock(self.root):
                # under the lock: retention removes empty ones
                parent = self.root
                for name in directory.relative_to(self.root).parts:
                    parent = files.subdir(parent, name, self.dir_mode)
                # a dot-name until complete (readers skip it), then exactly file_mode
                with files.atomic_file(path, self.file_mode) as f:
                    pq.write_table(data, f, compression="zstd")
        except OSError as e:
            if e.errno in _DISK_FULL and not isinstance(e, DiskFull):
                raise DiskFull(e.errno, e.strerror, str(path)) from e
            raise
        return path


    def _stamp(self, table: Table, rows: list[dict]) -> list[dict]:
        """The recording's own columns, where the rows leave them out."""
        names = table.schema.names
        common = {"recording_id": self.recording_id} if "recording_id" in names else {}
        return [{**common, **r} for r in rows] if common else rows


@contextlib.contextmanager
def root_lock(root: Path, *, exclusive: bool = False) -> Iterator[None]:
    """flock on ROOT/.lock: writers share it, cleanup and partition swaps exclude them."""
    fd = files.open_lock(Path(root) / LOCK_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def remove_temporaries(root: Path) -> int:
    """Delete temporary files left by a writer that was killed; returns how many."""
    return len(remove_temporary_files(root))


def remove_temporary_files(root: Path) -> list[Path]:
    """remove_temporaries, returning the files. Takes the lock exclusively, so the temporary of
    a writer still at work is not touched."""
    removed = []
    with root_lock(root, exclusive=True):
        # not glob: it would follow a linked table directory
        for part in layout.partitions(root, hidden=True):
            for e in os.scandir(part.path):
                if e.name.startswith(".") and ".parquet" in e.name and e.name.endswith(".tmp") \
                        and not e.is_dir(follow_symlinks=False):
                    os.unlink(e.path)
                    removed.append(Path(e.path))
    return removed


def real_subdirs(path: Path) -> list[Path]:
    """Directories in `path`, links not followed (nor listed)."""
    try:
        return sorted(Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def mark_dataset(root: Path) -> None:
    """Leave the marker (once): the directory is a dataset, whose modes we may set."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(root / MARKER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))


def is_dataset(root: Path, known: frozenset[str]) -> bool:
    """Whether `root` (a directory) may be taken as a dataset: empty, marked (a regular file of
    ours), or holding only names of ours (`known`: a dataset written before the marker existed)."""
    try:
        st = os.stat(root / MARKER_FILE, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return True
    except FileNotFoundError:
        pass
    return all(e.name in known for e in os.scandir(root))
