"""Where a dataset lies, and which of its files a selection needs.

A location is a local directory or a URI that `pyarrow.fs.FileSystem.from_uri` opens
(`s3://bucket/prefix`, `gs://...`, `file:///path`). Its tables are laid out as

    <table>/host=<host>/date=<YYYY-MM-DD>/<name>.parquet    (schema version 6)
    <table>/date=<YYYY-MM-DD>/<name>.parquet                 (older: the host only in the rows)

and one prefix may hold both. A `Source` lists host= and date= directories and prunes them by
their names before any file is opened; what remains is read with pyarrow.dataset and the row
filters (time window, host of old-layout files, process names) pushed down to the row groups.
`analysis.dataset.read_table` reads a Source like a directory, so every reader takes either.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
import re
import urllib.parse
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from sampler import files
from sampler.dataset.layout import HOST_PREFIX, host_key, parse_day
from sampler.dataset.schema import TABLES
from sampler.errors import EnvironmentProblem, UsageError

# The tables written once per thing first seen (a stack, a recording, an attach): rows of later
# days refer to them, so a window prunes only their days after it.
CATALOGS = frozenset({"stacks", "frames", "targets", "recordings"})
# Rows are written within seconds of their `ts` (date= is the day written), so a window's last
# rows may lie in the next day's directory; the row filter on `ts` drops the rest there.
WRITE_LAG = dt.timedelta(days=1)
# Tables whose rows carry the process name a --comm selection matches.
BY_COMM = frozenset({"outstanding", "processes"})
# host= and date= values as dictionaries, as analysis.dataset.read_table reads them: the type of
# the old layout's `host` file column.
HIVE = ds.HivePartitioning.discover(infer_dictionary=True)
READ_ATTEMPTS = 5


@dataclass(frozen=True)
class Selection:
    """What a command asked for: host name globs (matched against host= names), a time window
    (UTC), process names. Empty means all."""

    hosts: tuple[str, ...] = ()
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    comms: tuple[str, ...] = ()

    def wants_host(self, name: str) -> bool:
        return not self.hosts or any(fnmatch.fnmatchcase(name, p) for p in self.hosts)

    def wants_day(self, table: str, day: dt.date) -> bool:
        if self.since is not None and table not in CATALOGS and day < utc(self.since).date():
            return False
        return self.until is None or day <= (utc(self.until) + WRITE_LAG).date()

    def rows(self, table: str):
        """The row filter of this selection on `table` (None: none)."""
        names = TABLES[table].schema.names if table in TABLES else []
        expr = None
        if "ts" in names and table not in CATALOGS:
            for bound, op in ((self.since, ">="), (self.until, "<=")):
                if bound is not None:
                    v = pa.scalar(utc(bound), pa.timestamp("us", tz="UTC"))
                    expr = both(expr, ds.field("ts") >= v if op == ">=" else ds.field("ts") <= v)
        if self.comms and table in BY_COMM:
            expr = both(expr, ds.field("comm").isin(list(self.comms)))
        return expr


def utc(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def both(a, b):
    """The conjunction of two optional dataset expressions."""
    return b if a is None else a if b is None else a & b


@dataclass(frozen=True)
class DataFile:
    path: str
    host: str | None        # its host= key; None: old layout (the host is in the rows only)
    day: dt.date


class Source:
    """A dataset location with a selection. Sources derived with `select` share the location's
    listings (cache): the table directories' host= and date= names, and each host directory's
    files (listed again when a read finds one gone)."""

    def __init__(self, filesystem: pafs.FileSystem, base: str, location: str,
                 selection: Selection = Selection(), *, cache: dict | None = None):
        self.filesystem = filesystem
        self.base = base.rstrip("/")
        self.location = location
        self.selection = selection
        self.cache: dict = {} if cache is None else cache

    def __repr__(self) -> str:
        return f"Source({self.location!r}, {self.selection})"

    def __str__(self) -> str:
        hosts = self.selection.hosts
        return self.location if not hosts else f"{self.location} [host {', '.join(hosts)}]"

    @property
    def name(self) -> str:
        return os.path.basename(self.base) or self.location

    def select(self, **changes) -> Source:
        return Source(self.filesystem, self.base, self.location, replace(self.selection, **changes),
                      cache=self.cache)

    # -- listing --------------------------------------------------------------------------------

    def entries(self, path: str, recursive: bool = False) -> list[pafs.FileInfo]:
        try:
            return self.filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
        except OSError as e:
            raise access_error(self.location, e) from None

    def table_dirs(self, table: str) -> list[str]:
        """Names of the directories in <table>/ (host=*, date=*), listed once per location."""
        key = ("dirs", table)
        if key not in self.cache:
            self.cache[key] = sorted(os.path.basename(e.path) for e in self.entries(f"{self.base}/{table}")
                                     if e.type == pafs.FileType.Directory)
        return self.cache[key]

    def files(self, table: str) -> list[DataFile]:
        """The data files of `table` that the selection needs: host= and date= directories are
        pruned by name; dot-files (being written, or a compaction's work area) are skipped."""
        sel = self.selection
        out: list[DataFile] = []
        for name in self.table_dirs(table):
            if name.startswith(HOST_PREFIX):
                host = name[len(HOST_PREFIX):]
                if not sel.wants_host(host):
                    continue
                out += [f for f in self.host_files(table, name) if sel.wants_day(table, f.day)]
            elif (day := parse_day(name)) and sel.wants_day(table, day):
                out += sorted((DataFile(e.path, None, day) for e in self.entries(f"{self.base}/{table}/{name}")
                               if e.type == pafs.FileType.File and data_file(os.path.basename(e.path))),
                              key=lambda f: f.path)
        return out

    def host_files(self, table: str, name: str) -> list[DataFile]:
        """The data files under <table>/<name>/ (a host= directory): one recursive listing, kept
        until a read finds a listed file gone (a live daemon's compaction replaced it)."""
        key = ("files", table, name)
        if key not in self.cache:
            top = f"{self.base}/{table}/{name}"
            found = []
            for e in self.entries(top, recursive=True):
                parts = e.path[len(top) + 1:].split("/")
                if len(parts) == 2 and e.type == pafs.FileType.File and data_file(parts[1]) and \
                        (day := parse_day(parts[0])):
                    found.append(DataFile(e.path, name[len(HOST_PREFIX):], day))
            # in time order (date=, then the files' sequence names): rows come in time order,
            # which the series reader builds its grids from cheaply (a listing's order is the store's)
            self.cache[key] = sorted(found, key=lambda f: f.path)
        return self.cache[key]

    def old_layout_hosts(self) -> dict[str, list[str | None]]:
        """{host= key: host values} of the selected days' old-layout files (no host= directory),
        from the `host` column of their `processes` rows (one dictionary column: cheap)."""
        key = ("old_hosts", self.selection.since, self.selection.until)
        if key not in self.cache:
            old = [f.path for f in self.select(hosts=()).files("processes") if f.host is None]
            values = self.scan("processes", old, None, ["host"]).column("host").unique() if old else []
            found: dict[str, list[str | None]] = {}
            for h in (values.dictionary_decode() if pa.types.is_dictionary(values.type) else values).to_pylist() \
                    if old else []:
                found.setdefault(host_key(h), []).append(h)
            self.cache[key] = found
        return self.cache[key]

    def hosts(self) -> list[str]:
        """The host= keys of the selected data (old-layout hosts by their rows' host)."""
        files = self.files("processes")     # a snapshot of every process: every host with data
        found = {f.host for f in files if f.host is not None}
        if any(f.host is None for f in files):
            found |= {h for h in self.old_layout_hosts() if self.selection.wants_host(h)}
        return sorted(found)

    def has_tables(self) -> bool:
        try:
            info = self.filesystem.get_file_info(self.base) if self.base else None
        except OSError as e:
            raise access_error(self.location, e) from None
        if info is not None and info.type == pafs.FileType.File:
            return False
        return any(self.table_dirs(t) for t in ("processes", "outstanding", "recordings"))

    def bucket_missing(self) -> bool:
        """Whether the first component of the path (an object store's bucket) does not exist."""
        try:
            return self.filesystem.get_file_info(self.base.split("/")[0]).type == pafs.FileType.NotFound
        except OSError as e:
            raise access_error(self.location, e) from None

    # -- reading --------------------------------------------------------------------------------

    def read(self, table: str, *, filter=None, columns: list[str] | None = None, arrow: bool = False):
        """One table, as analysis.dataset.read_table gives it, of the selected files and rows (with
        `arrow`: as a pyarrow Table)."""
        for attempt in range(READ_ATTEMPTS):
            try:
                return self.read_once(table, filter, columns, arrow)
            except FileNotFoundError:
                if attempt == READ_ATTEMPTS - 1:
                    raise
                for key in [k for k in self.cache if k[0] == "files"]:    # a compaction replaced files
                    del self.cache[key]
        raise AssertionError("unreachable")

    def read_once(self, table: str, filter, columns: list[str] | None, arrow: bool = False):
        files = self.files(table)
        rows = both(filter, self.selection.rows(table))
        new = [f.path for f in files if f.host is not None]
        old = [f.path for f in files if f.host is None]
        parts = []
        if new:
            parts.append(self.scan(table, new, rows, columns))
        host_rows = None
        if old and self.selection.hosts:    # the old layout's hosts are in its rows only
            values = [v for name, vs in self.old_layout_hosts().items() if self.selection.wants_host(name) for v in vs]
            if not values:
                old = []
            else:
                host_rows = ds.field("host").isin(pa.array([v for v in values if v is not None], pa.string()))
                if None in values:
                    host_rows = host_rows | ds.field("host").is_null()
        if old:
            parts.append(self.scan(table, old, both(rows, host_rows), columns))
        if not parts:
            empty = TABLES[table].read_schema.empty_table()
            empty = empty.select(columns) if columns else empty
            return empty if arrow else empty.to_pandas()
        data = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive")
        return data if arrow else data.to_pandas(self_destruct=True, split_blocks=True)

    def scan(self, table: str, paths: list[str], filter, columns: list[str] | None) -> pa.Table:
        kw = dict(filesystem=self.filesystem, format="parquet", partitioning=HIVE,
                  partition_base_dir=f"{self.base}/{table}")
        try:
            dataset = ds.dataset(paths, **kw)
            wanted = TABLES[table].read_schema if table in TABLES else pa.schema([])
            missing = [f for f in wanted if f.name not in dataset.schema.names]
            if missing:     # columns added since the first file was written: null there
                dataset = ds.dataset(paths, schema=pa.schema([*dataset.schema, *missing]), **kw)
            return dataset.to_table(filter=filter, columns=columns)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise access_error(self.location, e) from None
        except pa.ArrowInvalid as e:    # a file that is not Parquet, or of another schema
            raise EnvironmentProblem(f"cannot read {self.location}: {one_line(e)}") from None


def data_file(name: str) -> bool:
    return name.endswith(".parquet") and not name.startswith((".", "_"))     # what pyarrow skips too


# -- opening a location --------------------------------------------------------------------------

def is_uri(location: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) is not None


def open_source(location: str, selection: Selection = Selection(), *, endpoint: str | None = None) -> Source:
    """A Source for a local directory or a URI; one clear error when nothing can be read there.
    `endpoint` (http[s]://host:port) overrides the S3 endpoint; without it pyarrow's own
    configuration applies (AWS_ENDPOINT_URL, AWS_REGION, the standard credential chain)."""
    if not is_uri(location):
        path = os.path.abspath(location)
        if not os.path.isdir(path):
            raise UsageError(f"no dataset at {location}: give the directory passed to `record --out` "
                             "or a URI such as s3://BUCKET/PREFIX")
        source = Source(pafs.LocalFileSystem(), path, location, selection)
    else:
        scheme = location.split("://", 1)[0].lower()
        uri = location
        if endpoint:
            if scheme != "s3":
                raise UsageError(f"--endpoint applies to s3:// locations, not {scheme}://")
            uri = with_endpoint(location, endpoint)
        try:
            filesystem, base = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowInvalid, ValueError) as e:
            if "Unrecognized filesystem type" in str(e):
                raise UsageError(f"cannot read {location}: unknown URI scheme {scheme}://; give a local directory "
                                 "or a URI pyarrow opens, e.g. s3://BUCKET/PREFIX or file:///PATH") from None
            raise UsageError(f"cannot read {location}: {one_line(e)}") from None
        except OSError as e:
            raise access_error(location, e) from None
        if scheme == "s3" and not base:
            raise UsageError(f"cannot read {location}: no bucket in the URI; give s3://BUCKET/PREFIX")
        source = Source(filesystem, base, location, selection)
    if not source.has_tables():
        if is_uri(location) and source.bucket_missing():
            raise no_bucket(location, source.base.split("/")[0])
        raise UsageError(f"no allocsampler dataset at {location}: no outstanding/, processes/ or recordings/ "
                         "table there; give the prefix that holds them (the daemon's upload prefix or a "
                         "`record --out` directory)")
    return source


def write_table(location: str, table: pa.Table, *, endpoint: str | None = None) -> None:
    """`table` as one Parquet file at `location` (a local path or a URI, as open_source takes),
    whole or not at all: a local file is renamed into place, an object store's put is atomic."""
    import pyarrow.parquet as pq

    if not is_uri(location):
        try:
            with files.atomic_file(os.path.abspath(location), 0o644) as f:
                pq.write_table(table, f)
        except OSError as e:
            raise EnvironmentProblem(f"cannot write {location}: {e.strerror or one_line(e)}") from None
        return
    try:
        filesystem, path = pafs.FileSystem.from_uri(with_endpoint(location, endpoint) if endpoint else location)
        pq.write_table(table, path, filesystem=filesystem)
    except (pa.ArrowInvalid, ValueError) as e:
        raise UsageError(f"cannot write {location}: {one_line(e)}") from None
    except OSError as e:
        raise access_error(location, e) from None


def with_endpoint(uri: str, endpoint: str) -> str:
    """The s3:// URI with pyarrow's endpoint_override and scheme query options of `endpoint`."""
    e = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not e.netloc:
        raise UsageError(f"--endpoint {endpoint}: give http[s]://HOST[:PORT]")
    u = urllib.parse.urlsplit(uri)
    query = urllib.parse.parse_qsl(u.query) + [("endpoint_override", e.netloc), ("scheme", e.scheme)]
    return urllib.parse.urlunsplit(u._replace(query=urllib.parse.urlencode(query)))


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                   "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def credentials_configured() -> bool:
    """Whether the standard AWS credential chain has a source besides an instance role."""
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
             os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")]
    return any(os.environ.get(v) for v in CREDENTIAL_VARS) or \
        any(os.path.isfile(os.path.expanduser(f)) for f in files)


def no_bucket(location: str, bucket: str) -> UsageError:
    return UsageError(f"cannot read {location}: bucket {bucket!r} does not exist; check the URI, and the "
                      "endpoint (--endpoint or AWS_ENDPOINT_URL) if the store is not AWS")


def access_error(location: str, e: OSError) -> Exception:
    """One line naming the cause and the fix of a failed listing or read."""
    text = one_line(e)
    if "NO_SUCH_BUCKET" in text or "bucket does not exist" in text.lower():
        return no_bucket(location, urllib.parse.urlsplit(location).netloc)
    if not credentials_configured() and location.lower().startswith("s3://"):
        return EnvironmentProblem(f"cannot read {location}: no AWS credentials found ({text}); set "
                                  "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
                                  "with an instance role")
    if any(k in text for k in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                               "AccessDenied", "HTTP status 403")):
        return EnvironmentProblem(f"cannot read {location}: access denied ({text}); check the credentials "
                                  "(AWS_ACCESS_KEY_ID/AWS_PROFILE) and that they may list and read this prefix")
    if any(k in text for k in ("NETWORK_CONNECTION", "Couldn't connect", "Connection refused",
                               "Could not resolve", "curlCode")):
        return EnvironmentProblem(f"cannot read {location}: the object store cannot be reached ({text}); "
                                  "check the endpoint (--endpoint or AWS_ENDPOINT_URL) and the network")
    return EnvironmentProblem(f"cannot read {location}: {text}")
