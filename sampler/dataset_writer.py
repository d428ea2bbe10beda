"""Writing the Hive-partitioned Parquet dataset: OUT/<table>/date=YYYY-MM-DD/<file>.parquet.

Every file is written under a temporary dot-name in its final directory, fsynced, then renamed:
readers (pyarrow.dataset and pandas skip dot-files) and a crash never see a partial file.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import Table


class DatasetWriter:
    def __init__(self, root: str | os.PathLike, recording_id: str, *, dir_mode: int = 0o755,
                 file_mode: int = 0o644):
        self.root = Path(root)
        self.recording_id = recording_id
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._seq: dict[str, int] = {}
        self.root.mkdir(parents=True, exist_ok=True, mode=dir_mode)
        remove_temporaries(self.root)

    def write(self, table: Table, rows: list[dict] | pa.Table, *, name: str | None = None,
              day: dt.date | None = None) -> Path | None:
        """Write rows (dicts, or an Arrow table of the schema) as one new file, or replace the
        file `name`. Returns its path."""
        if len(rows) == 0:
            return None
        day = day or dt.datetime.now(dt.timezone.utc).date()
        directory = self.root / table.name / f"date={day.isoformat()}"
        directory.mkdir(parents=True, exist_ok=True, mode=self.dir_mode)
        if name is None:
            seq = self._seq[table.name] = self._seq.get(table.name, 0) + 1
            name = f"{self.recording_id}-{seq:06d}"
        path = directory / f"{name}.parquet"
        tmp = directory / f".{name}.parquet.tmp"
        data = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=table.schema)
        try:
            with open(tmp, "wb") as f:
                pq.write_table(data, f, compression="zstd")
                f.flush()
                os.fchmod(f.fileno(), self.file_mode)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(directory)
        return path


def remove_temporaries(root: Path) -> int:
    """Delete temporary files left by a writer that was killed; returns how many."""
    n = 0
    for tmp in root.glob("*/date=*/.*.parquet.tmp"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
