"""Writing the Hive-partitioned Parquet dataset: OUT/<table>/date=YYYY-MM-DD/<file>.parquet.

Every file is written under a temporary dot-name in its final directory, fsynced, then renamed:
readers (pyarrow.dataset and pandas skip dot-files; the temporary name does not end in .parquet,
so DuckDB's globs, which do not skip dot-files, miss it too) and a crash never see a partial file.
A write holds a shared flock on OUT: whoever deletes temporaries or swaps a partition
(sampler.dataset.retention) takes it exclusively, so it never removes a file a live writer is writing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sampler import files
from sampler.dataset.schema import Table

# The daemon's modes: stack traces reveal paths and code, so no world access.
PRIVATE_DIR_MODE = 0o750
PRIVATE_FILE_MODE = 0o640
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """A write failed for lack of space (ENOSPC/EDQUOT); no partial file was left visible."""


class DatasetWriter:
    def __init__(self, root: str | os.PathLike, recording_id: str, *, host: str | None = None,
                 dir_mode: int = 0o755, file_mode: int = 0o644):
        self.root = Path(root)
        self.recording_id = recording_id
        self.host = host
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._seq: dict[str, int] = {}
        make_dirs(self.root, dir_mode)
        remove_temporaries(self.root)

    def write(self, table: Table, rows: list[dict] | pa.Table, *, name: str | None = None,
              day: dt.date | None = None) -> Path | None:
        """Write rows (dicts, or an Arrow table of the schema) as one new file, or replace the
        file `name`. Returns its path. Raises DiskFull when the filesystem is full."""
        if len(rows) == 0:
            return None
        day = day or dt.datetime.now(dt.timezone.utc).date()
        directory = self.root / table.name / f"date={day.isoformat()}"
        if name is None:
            seq = self._seq[table.name] = self._seq.get(table.name, 0) + 1
            name = f"{self.recording_id}-{seq:06d}"
        path = directory / f"{name}.parquet"
        if not isinstance(rows, pa.Table):
            rows = self._stamp(table, rows)
        data = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=table.schema)
        try:
            make_dirs(self.root, self.dir_mode)         # deleted under a running recorder: back
            with root_lock(self.root):
                make_dirs(directory, self.dir_mode)     # under the lock: retention removes empty ones
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
        common = {k: v for k, v in (("recording_id", self.recording_id), ("host", self.host))
                  if k in names and v is not None}
        return [{**common, **r} for r in rows] if common else rows


@contextlib.contextmanager
def root_lock(root: Path, *, exclusive: bool = False) -> Iterator[None]:
    """flock on the dataset directory: writers share it, cleanup and partition swaps exclude them."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def make_dirs(path: Path, mode: int) -> None:
    """mkdir -p; the directories it creates get exactly `mode` (chmod: the umask does not apply).
    Existing directories are left as they are."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:         # created meanwhile by someone else: theirs
            continue
        os.chmod(d, mode)


def remove_temporaries(root: Path) -> int:
    """Delete temporary files left by a writer that was killed; returns how many."""
    return len(remove_temporary_files(root))


def remove_temporary_files(root: Path) -> list[Path]:
    """remove_temporaries, returning the files. Takes the lock exclusively, so the temporary of
    a writer still at work is not touched."""
    removed = []
    with root_lock(root, exclusive=True):
        for tmp in root.glob("*/date=*/.*.parquet*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
