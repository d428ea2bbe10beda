"""Where a dataset's files live: the Hive partition paths of both layouts.

Schema 6 and later write ROOT/<table>/host=<host>/date=<YYYY-MM-DD>/<name>.parquet: files of many
hosts merge into one directory or object-store prefix by plain copy (`cp -r`, `aws s3 sync`),
and `host` is a partition key that readers prune on. Datasets of schema 5 and before have
ROOT/<table>/date=<YYYY-MM-DD>/<name>.parquet; everything that lists partitions here sees both.

File names hold the recording id (start time, recorder pid and a random suffix), so that two
hosts that share a name, or one host's restarts, never write the same path.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

HOST_PREFIX = "host="
DATE_PREFIX = "date="
UNKNOWN_HOST = "unknown"
UPLOAD_DIR = ".upload"      # ROOT/.upload: what was shipped (sampler.dataset.upload)
MAX_HOST_KEY = 200          # a directory name stays well under NAME_MAX (255) with its prefix
_NOT_KEY = re.compile(r"[^A-Za-z0-9._-]")
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def host_key(name: str | None) -> str:
    """A host name as its partition key: characters other than [A-Za-z0-9._-] become `_` (no
    `/`, `=` or `%`, which Hive paths would have to escape), empty or None is `unknown`. The
    writer stamps the `host` column with the same value, so the column and the path agree."""
    key = _NOT_KEY.sub("_", name or "")[:MAX_HOST_KEY]
    return key or UNKNOWN_HOST


def partition_dir(root: str | os.PathLike, table: str, host: str | None, day: dt.date) -> Path:
    """ROOT/<table>/host=<host_key(host)>/date=<day>."""
    return Path(root) / table / f"{HOST_PREFIX}{host_key(host)}" / f"{DATE_PREFIX}{day.isoformat()}"


@dataclass(frozen=True)
class Partition:
    """One day partition directory of a table; `host` is None in the layout of schema <= 5."""

    path: Path
    table: str
    host: str | None
    day: dt.date | None         # None: a date= directory whose name is not a date

    @property
    def key(self) -> str:
        """A name for the partition, unique within the dataset and safe as a file name."""
        return ".".join(p for p in (self.table, self.path.parent.name if self.host is not None else None,
                                    self.path.name) if p)

    def relative(self, root: str | os.PathLike) -> Path:
        return self.path.relative_to(root)


def parse_day(name: str) -> dt.date | None:
    """The day of a `date=YYYY-MM-DD` directory name, else None."""
    if not name.startswith(DATE_PREFIX) or not _DAY.fullmatch(name[len(DATE_PREFIX):]):
        return None
    try:
        return dt.date.fromisoformat(name[len(DATE_PREFIX):])
    except ValueError:
        return None


def _dirs(path: Path, *, hidden: bool) -> list[os.DirEntry]:
    """Sub-directories, links neither followed nor listed; dot and underscore names (what
    pyarrow skips) only when `hidden`."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((e for e in entries if e.is_dir(follow_symlinks=False)
                   and (hidden or not e.name.startswith((".", "_")))), key=lambda e: e.name)


def table_partitions(table_dir: Path, *, hidden: bool = False) -> list[Partition]:
    """The date= partitions of one table directory, in both layouts."""
    out = []
    for e in _dirs(table_dir, hidden=hidden):
        if e.name.startswith(DATE_PREFIX):
            out.append(Partition(Path(e.path), table_dir.name, None, parse_day(e.name)))
        elif e.name.startswith(HOST_PREFIX):
            host = e.name[len(HOST_PREFIX):]
            out += [Partition(Path(d.path), table_dir.name, host, parse_day(d.name))
                    for d in _dirs(Path(e.path), hidden=hidden) if d.name.startswith(DATE_PREFIX)]
    return out


def partitions(root: str | os.PathLike, *, hidden: bool = False) -> list[Partition]:
    """Every date= partition of every table directory under root, both layouts, links not
    followed. `hidden` also lists directories whose names start with a dot or underscore (for
    cleanup: readers skip them)."""
    return [p for t in _dirs(Path(root), hidden=hidden) for p in table_partitions(Path(t.path), hidden=hidden)]


def has_files(table_dir: str | os.PathLike) -> bool:
    """Whether a table directory holds any visible .parquet file, in either layout."""
    for p in table_partitions(Path(table_dir)):
        try:
            with os.scandir(p.path) as it:
                if any(e.name.endswith(".parquet") and not e.name.startswith((".", "_")) for e in it):
                    return True
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False
