"""Shipping a dataset's closed files to an object store (the daemon's [upload]; it runs `run` in a
child process, sampler/service/upload.py schedules it).

- What is uploaded: files that will never change again. With [upload] the daemon's compaction
  seals (sampler.dataset.retention.compact, seal=True): every interval file older than
  compact_after_s ends in a merged `<recording>-<first>_<last>.parquet` that is never merged
  again. Those, and the one `recordings` file per recording (rewritten once, when the recording
  ends: it is uploaded again then, to the same key), in the layout of schema 6 (host=
  directories: keys of several hosts never collide). Older layouts stay local.
- Where: the object key is the file's path in the dataset under the URI's prefix, so a bucket
  holding many hosts' uploads is itself a dataset, and a second upload of a file writes the same
  key with the same bytes: at least once, never under two names.
- Atomic for readers: the file is read whole first, then written with one write and a close. S3
  makes an object visible only when its upload completes (a single PUT, or the completion of a
  multipart upload; pyarrow's stream uses the latter): a killed upload leaves nothing visible (an
  incomplete multipart upload, which a bucket lifecycle rule AbortIncompleteMultipartUpload
  removes). A local or NFS destination gets a dot-name first, then a rename. After the close the
  object's size is checked.
- What was uploaded is in ROOT/.upload/state.json (path -> size, mtime), rewritten atomically
  after each file (at most once a second): a kill -9 loses at most the record of the files of
  the last second, which are uploaded again to the same keys.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sampler import files
from sampler.dataset import layout
from sampler.dataset.retention import METADATA_TABLES, DataFile, dataset_files

STATE_FILE = "state.json"
LOST_FILE = "lost.json"         # the daemon's: files dropped from the backlog before upload
STATE_VERSION = 1
MAX_STATE_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 5.0


class DestinationError(Exception):
    """The destination refuses us for a reason that waiting will not fix (credentials, a missing
    bucket): one line that names the cause and the fix."""


@dataclass(frozen=True)
class Destination:
    uri: str                        # s3://BUCKET[/PREFIX] or file:///PATH, as the config checked it
    endpoint: str | None = None     # http(s)://HOST[:PORT]
    region: str | None = None
    retries: int = 3
    request_timeout_s: float = 60.0

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def local_root(self) -> str:
        """The directory of a file:// destination."""
        return self.uri[len("file://"):]

    def filesystem(self):
        """(pyarrow filesystem, base path) of the destination. Nothing is sent yet."""
        import pyarrow.fs as pafs

        if not self.is_s3:
            return pafs.LocalFileSystem(), self.local_root
        kw = {}
        if self.endpoint:
            scheme, _, hostport = self.endpoint.partition("://")
            kw.update(endpoint_override=hostport, scheme=scheme)
        if self.region:
            kw["region"] = self.region
        s3 = pafs.S3FileSystem(connect_timeout=CONNECT_TIMEOUT_S, request_timeout=self.request_timeout_s,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=self.retries), **kw)
        return s3, self.uri[len("s3://"):]

    def key(self, base: str, rel: str) -> str:
        return f"{base.rstrip('/')}/{rel}"


# -- what was uploaded ----------------------------------------------------------------------------

@dataclass
class State:
    """ROOT/.upload/state.json: the files uploaded to `uri`, relative path -> [size, mtime_ns]."""

    uri: str
    files: dict[str, list[int]] = field(default_factory=dict)

    def done(self, f: DataFile, root: Path) -> bool:
        return self.files.get(rel(f, root)) == [f.size, f.mtime_ns]


def rel(f: DataFile, root: Path) -> str:
    return f.path.relative_to(root).as_posix()


def state_dir(root: str | os.PathLike) -> Path:
    return Path(root) / layout.UPLOAD_DIR


def load_state(root: str | os.PathLike, uri: str) -> State:
    """The state for `uri`; empty when there is none, it is unreadable, or it is another URI's (a
    new destination gets every file)."""
    try:
        doc = json.loads(files.read_private(state_dir(root) / STATE_FILE, MAX_STATE_BYTES))
    except (OSError, ValueError):
        return State(uri)
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION or doc.get("uri") != uri \
            or not isinstance(doc.get("files"), dict):
        return State(uri)
    return State(uri, {k: v for k, v in doc["files"].items()
                       if isinstance(k, str) and isinstance(v, list) and len(v) == 2})


def save_state(root: str | os.PathLike, state: State, present: Iterable[str] | None = None) -> None:
    """Write the state atomically; entries of files no longer in the dataset (`present`) go."""
    if present is not None:
        keep = set(present)
        state.files = {k: v for k, v in state.files.items() if k in keep}
    d = files.subdir(Path(root), layout.UPLOAD_DIR, 0o700)
    files.write_atomic(d / STATE_FILE, json.dumps({"version": STATE_VERSION, "uri": state.uri,
                                                   "files": state.files}).encode())


def closed(f: DataFile) -> bool:
    """Final: written in the fleet layout and either sealed by compaction or a recording's row."""
    return f.host is not None and (f.merged or f.table == "recordings")


def upload_order(fs: list[DataFile]) -> list[DataFile]:
    """Recordings, stacks and frames first (later rows refer to them), then the oldest first."""
    return sorted(fs, key=lambda f: (f.table not in METADATA_TABLES, *f.age_key()))


# -- one run (the child) --------------------------------------------------------------------------

@dataclass
class RunReport:
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    pending_files: int = 0          # closed files not uploaded when the run ended
    error: str | None = None
    fatal: bool = False             # a DestinationError: retrying will not help
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _read_whole(f: DataFile) -> bytes | None:
    """The file's bytes, if it is still the file that was listed (same size and mtime)."""
    try:
        fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
            return None
        data = fh.read(f.size + 1)
    return data if len(data) == f.size else None


def put(fs, dest: Destination, key: str, data: bytes) -> None:
    """Write `data` as object `key`, visible only once whole; checks its size afterwards."""
    import pyarrow.fs as pafs

    if dest.is_s3:
        out = fs.open_output_stream(key)
        # no `with`: closing a stream after an exception would complete a partial upload
        out.write(data)
        out.close()
    else:
        _put_local(dest.local_root, key, data)
    try:
        info = fs.get_file_info(key)
    except OSError as e:
        if isinstance(classify(e, dest), DestinationError) and dest.is_s3:
            return          # a writer allowed s3:PutObject only: it cannot look, the PUT succeeded
        raise
    if info.type != pafs.FileType.File or info.size != len(data):
        raise OSError(f"{key}: {info.size} bytes in the store after the upload, {len(data)} expected")


def _put_local(base: str, key: str, data: bytes) -> None:
    """A file:// destination under the policy of every output (sampler/files.py): the base a
    directory of ours that no one else can change (its ancestors too, no foreign setgid), each
    directory below it ours and real, the file written beside its place without following links
    and renamed over it: a link planted in a shared destination is refused, never written
    through. Raises UnsafePath (a DestinationError for the caller: waiting will not fix it)."""
    root = files.output_dir(base, what="upload destination")
    rel = Path(os.path.relpath(key, base)).parts
    if not rel or ".." in rel:
        raise files.UnsafePath(f"upload key {key} is outside the destination {base}")
    d = root
    for part in rel[:-1]:
        d = files.subdir(d, part, files.OUTPUT_DIR_MODE)
    files.write_output(d / rel[-1], data)


def classify(e: BaseException, dest: Destination) -> DestinationError | None:
    """A DestinationError for what waiting will not fix, else None (a transient failure)."""
    if isinstance(e, files.UnsafePath):
        return DestinationError(f"upload.uri {dest.uri}: {e}")
    msg = " ".join(str(e).split())
    low = msg.lower()
    creds = ("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the daemon's environment (systemd: Environment= or "
             "EnvironmentFile=), /root/.aws/credentials, or an instance profile or role")
    if any(s in low for s in ("access denied", "accessdenied", "access_denied", "invalidaccesskeyid",
                              "invalid_access_key_id", "signaturedoesnotmatch", "signature_does_not_match",
                              "forbidden", "http status 403", "missingauthenticationtoken", "no credentials",
                              "expiredtoken", "invalidtoken")):
        return DestinationError(f"upload.uri {dest.uri}: the store refuses our credentials ({msg[:200]}): give the "
                                f"daemon credentials allowed to write there: {creds}")
    if dest.is_s3 and ("nosuchbucket" in low or "no_such_bucket" in low
                       or ("bucket" in low and ("not found" in low or "does not exist" in low))):
        return DestinationError(f"upload.uri {dest.uri}: the bucket does not exist ({msg[:200]}): create it or fix "
                                "upload.uri (and upload.endpoint / upload.region)")
    return None


PROBE_NAME = ".allocsampler-probe"     # a dot-name: readers and globs of *.parquet skip it


def probe(dest: Destination) -> None:
    """Write what an upload writes, a (tiny) object under the prefix: DestinationError when the
    store refuses us for good (credentials, no bucket), OSError when it cannot be reached
    (transient), nothing when it took it. Only s3:PutObject is needed, as for the uploads."""
    import pyarrow as pa

    fs, base = dest.filesystem()
    try:
        put(fs, dest, dest.key(base, PROBE_NAME), b"allocsampler upload probe\n")
    except (OSError, pa.ArrowException) as e:
        raise classify(e, dest) or OSError(" ".join(str(e).split())) from None


def run(root: str | os.PathLike, dest: Destination, budget_s: float) -> RunReport:
    """Upload the closed files not uploaded yet, metadata first then oldest first, until done,
    the first failure (the daemon retries later, with backoff) or `budget_s`."""
    import pyarrow as pa

    t0 = time.monotonic()
    root = Path(root)
    report = RunReport()
    state = load_state(root, dest.uri)
    listed = dataset_files(root)
    pending = upload_order([f for f in listed if closed(f) and not state.done(f, root)])
    present = [rel(f, root) for f in listed]
    saved = time.monotonic()
    fs = base = None
    try:
        for i, f in enumerate(pending):
            if time.monotonic() - t0 > budget_s:
                report.pending_files = len(pending) - i
                break
            data = _read_whole(f)
            if data is None:        # gone or replaced since the listing: the next run sees it
                continue
            if fs is None:
                fs, base = dest.filesystem()
            put(fs, dest, dest.key(base, rel(f, root)), data)
            state.files[rel(f, root)] = [f.size, f.mtime_ns]
            report.uploaded_files += 1
            report.uploaded_bytes += f.size
            if time.monotonic() - saved >= 1.0:
                save_state(root, state)
                saved = time.monotonic()
    except (OSError, pa.ArrowException) as e:
        fatal = classify(e, dest)
        report.error = str(fatal) if fatal else " ".join(str(e).split())[:500]
        report.fatal = fatal is not None
        report.pending_files = sum(1 for f in pending if not state.done(f, root))
    finally:
        save_state(root, state, present)
        report.seconds = round(time.monotonic() - t0, 2)
    return report
