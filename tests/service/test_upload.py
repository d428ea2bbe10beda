"""The daemon's [upload] against a real S3-protocol server on localhost (moto's standalone server, a
subprocess the tests start, stop and pause): a real daemon recording a real workload uploads its
sealed files, which read back from s3:// identical to the local ones; kill -9 of the daemon in the
middle of an upload loses and duplicates nothing; a store that is down at start: the backlog
grows, shows in status and metrics, and drains when the store is back; the backlog cap drops the
oldest files and counts them. Configuration and credential errors are one line."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import allocsampler_cmd, compile_c
from test_daemon import WORK_C, DaemonProc, Target, free_port, metric, wait_for

from sampler.dataset import layout
from sampler.dataset import retention as R
from sampler.dataset import upload as U
from sampler.dataset.schema import PROCESSES, RECORDINGS
from sampler.dataset.writer import DatasetWriter
from sampler.proc.process import descendants
from sampler.service.config import UploadConfig
from sampler.service.upload import Uploads

pytestmark = pytest.mark.serial     # alone after the rest (scripts/test.sh): kill -9 mid-upload and hung runs are timed

BUCKET = "fleet-bucket"
PREFIX = "allocsampler"
MiB = 1 << 20
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
HOST = layout.host_key(socket.gethostname())
T0 = dt.datetime(2024, 1, 2, tzinfo=dt.timezone.utc)


class Moto:
    """moto's S3 server as a subprocess on a fixed port: stop() and start() again (a fresh, empty
    server), pause() and resume() (it stops answering; the data stays)."""

    def __init__(self, port: int, env: dict | None = None):
        self.port, self.env, self.proc = port, env or {}, None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, bucket: bool = True) -> Moto:
        exe = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env={**os.environ, **self.env})
        wait_for(self._up, 30, "moto_server to answer", every=0.1)
        if bucket:
            self.fs(create=True).create_dir(BUCKET)
        return self

    def _up(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def fs(self, create: bool = False) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                                 endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
                                 allow_bucket_creation=create)

    def objects(self) -> dict[str, int]:
        """key below BUCKET/PREFIX -> size."""
        base = f"{BUCKET}/{PREFIX}/"
        infos = self.fs().get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {i.path[len(base):]: i.size for i in infos
                if i.type == pafs.FileType.File and i.base_name != U.PROBE_NAME}


@pytest.fixture
def moto():
    m = Moto(free_port())
    yield m
    m.resume() if m.proc is not None and m.proc.poll() is None else None
    m.stop()


@pytest.fixture(scope="module")
def work_bin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("upload_bins")
    (d / "up_work.c").write_text(WORK_C)
    return compile_c(d / "up_work.c", d / "up_work")


def write_config(path: Path, data: Path, port: int, moto: Moto, *, max_bytes: str = "1G", backlog: str = "512M",
                 timeout_s: float = 10, extra: str = "") -> Path:
    path.write_text(f"""
[daemon]
data_dir = "{data}"
interval_s = 1
rescan_s = 1
attach_mode = "uprobe"
cpu_percent = 20
[retention]
max_bytes = "{max_bytes}"
min_free_bytes = "4M"
compact_after_s = 2
[metrics]
listen = "127.0.0.1:{port}"
[analysis]
every_s = 3600
[upload]
uri = "s3://{BUCKET}/{PREFIX}"
endpoint = "{moto.endpoint}"
region = "us-east-1"
interval_s = 1
timeout_s = {timeout_s}
retries = 1
backoff_max_s = 2
max_backlog_bytes = "{backlog}"
{extra}
[[targets]]
name = "up_work"
tier = "attach"
""")
    return path


def start_daemon(tmp_path: Path, moto: Moto, name: str = "d", **kw) -> DaemonProc:
    port = free_port()
    data = tmp_path / "data"
    cfg = write_config(tmp_path / f"{name}.toml", data, port, moto, **kw)
    d = DaemonProc(cfg, data, port, tmp_path / f"{name}.log", env=AWS_ENV)
    d.wait_started()
    return d


def sealed(data: Path) -> dict[str, int]:
    """The local files that are to be uploaded: relative path -> size."""
    return {U.rel(f, data): f.size for f in R.dataset_files(data) if U.closed(f)}


def upload_state(d: DaemonProc) -> dict:
    return d.status().get("upload") or {}


def old_recording(data: Path, files: int, mib: float, rec: str = "20240101T000000Z-1-abcdef") -> list[Path]:
    """Sealed files of an earlier recording of this host (random values: they do not compress)."""
    w = DatasetWriter(data, rec, host=socket.gethostname())
    rng = np.random.default_rng(1)
    rows = int(mib * MiB / 8)
    out = []
    for i in range(files):
        t = pa.table({c.name: pa.nulls(rows, c.type) for c in PROCESSES.columns})
        t = t.set_column(t.schema.get_field_index("rss"), "rss", pa.array(rng.integers(0, 1 << 62, rows)))
        path = w.write(PROCESSES, t.cast(PROCESSES.schema), name=f"{rec}-{i + 1:06d}_{i + 1:06d}")
        out.append(path)
    return out


def check_bucket(moto: Moto, data: Path, must_have: set[str]) -> None:
    """Every object is a sealed local file under its own path with the same bytes (a `recordings`
    file rewritten at the daemon's stop: its earlier version), nothing else is there, and nothing
    of `must_have` is missing. A `recordings` file may be in the bucket alone: that of a recording
    with no data files (a daemon killed before its first snapshot), which a later daemon's
    retention deleted here after its upload."""
    local = sealed(data)
    remote = moto.objects()
    extra = {k for k in set(remote) - set(local)
             if not (k.startswith("recordings/") and not any(Path(k).stem in other for other in local))}
    assert not extra, extra
    assert must_have <= set(remote), must_have - set(remote)
    fs = moto.fs()
    for key in remote:
        if not key.startswith("recordings/"):
            with fs.open_input_stream(f"{BUCKET}/{PREFIX}/{key}") as f:
                assert f.read() == (data / key).read_bytes(), key


def drained(d: DaemonProc, moto: Moto) -> set[str] | None:
    """The sealed files, once all of them are in the bucket."""
    local = set(sealed(d.data))
    return local if not local - set(moto.objects()) else None


@pytest.mark.bpf
def test_daemon_uploads_sealed_files_identical_to_local(tmp_path, moto, work_bin, bpf_ready):
    """A daemon recording a workload: its sealed files reach the bucket under their dataset paths,
    read back with pyarrow from s3:// as the same rows as the local files; status and metrics say
    what was uploaded."""
    moto.start()
    d = start_daemon(tmp_path, moto)
    try:
        t = Target([work_bin, "leak", "2048", "60"])        # keeps allocating: outstanding rows every interval
        d.targets.append(t)
        t.go()
        t0 = time.monotonic()
        wait_for(lambda: any(k.startswith("outstanding/") for k in moto.objects())
                 and any(k.startswith("targets/") for k in moto.objects()), 60, "outstanding and targets uploaded")
        print(f"\n[upload] first outstanding file in the bucket {time.monotonic() - t0:.1f} s after the workload began")
        up = upload_state(d)
        assert up["state"] == "ok" and up["uploaded_files"] > 0 and up["lost_files"] == 0, up
        text = d.metrics()
        assert metric(text, "allocsampler_upload_files_total") >= 1
        assert metric(text, "allocsampler_upload_failures_total") == 0
        assert metric(text, "allocsampler_upload_backlog_files") is not None
        p = subprocess.run(allocsampler_cmd("status", "--config", str(d.cfg)), capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and f"upload: s3://{BUCKET}/{PREFIX}: ok" in p.stdout, p
        t.kill()
    finally:
        assert d.stop() == 0
    # what was sealed before the stop is in the bucket, byte for byte; then the same rows as pyarrow reads them
    uploaded = moto.objects()
    check_bucket(moto, d.data, set())
    for table in ("outstanding", "processes", "targets", "stacks"):
        keys = sorted(k for k in uploaded if k.startswith(f"{table}/"))
        assert keys, table
        hive = ds.HivePartitioning.discover()
        remote = ds.dataset([f"{BUCKET}/{PREFIX}/{k}" for k in keys], filesystem=moto.fs(), format="parquet",
                            partitioning=hive, partition_base_dir=f"{BUCKET}/{PREFIX}/{table}")
        mine = ds.dataset([str(d.data / k) for k in keys], format="parquet", partitioning=hive,
                          partition_base_dir=str(d.data / table))
        assert remote.to_table().equals(mine.to_table()), table
        assert set(remote.to_table().column("host").to_pylist()) == {HOST}
    targets = next(k for k in uploaded if k.startswith("targets/"))
    t = pq.read_table(f"{BUCKET}/{PREFIX}/{targets}", filesystem=moto.fs())
    assert "exe_build_id" in t.column_names
    assert "Traceback" not in d.log()


@pytest.mark.bpf
def test_kill9_mid_upload_then_restart_loses_and_duplicates_nothing(tmp_path, moto, bpf_ready):
    """kill -9 of the daemon while its upload child sends 156 MiB (files of 12 MiB, multipart, and
    2 MiB): no partial object is visible; after a restart every sealed file is in the
    bucket once, under its own path, with its bytes."""
    moto.start()
    data = tmp_path / "data"
    old_recording(data, 3, 12, rec="20240101T000000Z-2-bcdefa")     # first: uploaded first (multipart)
    old_recording(data, 60, 2)             # enough that the kill lands mid-upload (96 MiB once ended first)
    total = len(sealed(data))
    d = start_daemon(tmp_path, moto)
    wait_for(lambda: moto.objects(), 60, "the upload to be under way", every=0.05)
    family = [pid for pid, _ in descendants({d.pid})]
    d.stop(signal.SIGKILL)
    # the upload child dies with it (PR_SET_PDEATHSIG): once it is gone, a request it had sent
    # just before may still complete at the server; nothing may come after that
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in family), 30, "the upload child to die")
    time.sleep(0.5)
    killed = moto.objects()
    print(f"\n[kill -9] {len(killed)} of {total} files in the bucket at the kill")
    assert len(killed) < total
    local = sealed(data)
    for key, size in killed.items():
        assert size == local[key], key                     # whole objects only
    time.sleep(1)
    assert moto.objects() == killed                        # the child died with the daemon: nothing more
    d2 = start_daemon(tmp_path, moto, name="d2")
    try:
        done = wait_for(lambda: drained(d2, moto), 60, "the upload to complete")
    finally:
        assert d2.stop() == 0
    check_bucket(moto, data, done)
    assert "Traceback" not in d.log() + d2.log()


@pytest.mark.bpf
def test_store_down_at_start_backlog_grows_then_drains(tmp_path, moto, bpf_ready):
    """The store does not answer when the daemon starts: one line says so, recording goes on, the
    backlog grows in status and metrics while runs fail and are retried with backoff; then a
    store that answers but hangs (paused) costs a timed-out run, not the loop; once it answers,
    the backlog drains and the bucket holds exactly the sealed files."""
    d = start_daemon(tmp_path, moto, timeout_s=5)
    try:
        assert "cannot be reached now" in d.log() and f"s3://{BUCKET}/{PREFIX}" in d.log()
        wait_for(lambda: upload_state(d).get("consecutive_failures", 0) >= 2
                 and upload_state(d).get("backlog_files", 0) > 10 and len(sealed(d.data)) > 3, 30,
                 "failed runs and a backlog")
        up = upload_state(d)
        assert up["state"] == "failing" and up["last_error"] and up["backlog_bytes"] > 0, up
        assert up["backlog_oldest_age_s"] > 0
        text = d.metrics()
        assert metric(text, "allocsampler_upload_failures_total") >= 2
        assert metric(text, "allocsampler_upload_backlog_files") > 10
        p = subprocess.run(allocsampler_cmd("status", "--config", str(d.cfg)), capture_output=True, text=True,
                           timeout=60)
        assert "failing: " in p.stdout, p.stdout
        print(f"\n[store down] {up['backlog_files']} files ({up['backlog_bytes'] / MiB:.2f} MiB) backlog after "
              f"{up['failed_runs']} failed runs: {up['last_error'][:120]}")
        assert "upload: to s3://" in d.log() and "retrying in" in d.log()

        moto.start()
        moto.pause()                                        # it accepts connections and says nothing
        failed = upload_state(d)["failed_runs"]
        t0 = time.monotonic()
        wait_for(lambda: upload_state(d)["failed_runs"] > failed, 30, "a hung upload run to end")
        print(f"[store hangs] the run failed after {time.monotonic() - t0:.1f} s: {upload_state(d)['last_error']}")
        assert d.alive() and metric(d.metrics(), "allocsampler_up") == 1
        moto.resume()
        t0 = time.monotonic()
        done = wait_for(lambda: upload_state(d).get("state") == "ok" and drained(d, moto), 60, "the backlog to drain")
        print(f"[store back] backlog drained in {time.monotonic() - t0:.1f} s")
        assert "works again after" in d.log()
    finally:
        assert d.stop() == 0
    check_bucket(moto, d.data, done)
    assert "Traceback" not in d.log()


@pytest.mark.bpf
def test_backlog_cap_drops_the_oldest_and_counts_them_lost(tmp_path, moto, bpf_ready):
    """Store down, 6 MiB of an earlier recording waiting, a 2 MiB cap: the oldest files go, are
    counted as lost (status, metrics, the log, and across a restart), the newest stay."""
    data = tmp_path / "data"
    old = old_recording(data, 6, 1)
    d = start_daemon(tmp_path, moto, backlog="2M")
    try:
        up = wait_for(lambda: (u := upload_state(d)) and u.get("lost_files", 0) >= 4 and u, 30, "lost files")
        assert 4 <= up["lost_files"] <= 5 and up["lost_bytes"] >= 4 * MiB, up
        assert [p.exists() for p in old][:4] == [False] * 4 and old[-1].exists()
        assert up["backlog_bytes"] <= 2 * MiB + MiB // 2, up
        assert metric(d.metrics(), "allocsampler_upload_lost_files_total") == up["lost_files"]
        assert "deleted before they could be uploaded" in d.log()
    finally:
        assert d.stop() == 0
    assert json.loads((data / layout.UPLOAD_DIR / U.LOST_FILE).read_text())["files"] == up["lost_files"]


# -- no BPF: configuration, credentials, scheduling ----------------------------------------------

def daemon_exit(tmp_path: Path, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\ndata_dir = "{tmp_path / "data"}"\n[metrics]\nenabled = false\n{body}\n'
                   '[[targets]]\nname = "nothing-here"\n')
    return subprocess.run(allocsampler_cmd("daemon", "--config", str(cfg)), capture_output=True, text=True,
                          timeout=120, env={**os.environ, **AWS_ENV, **(env or {})})


@pytest.mark.parametrize("body, fragment", [
    ('[upload]\nuri = "s3://Bad_Bucket/x"', "upload.uri"),
    ('[upload]\nuri = "https://example.com/x"', "expected s3://BUCKET[/PREFIX]"),
    ('[upload]\nendpoint = "http://127.0.0.1:9000"', "upload.uri: missing"),
    ('[upload]\nuri = "s3://bkt"\nendpoint = "127.0.0.1:9000"', "upload.endpoint"),
    ('[upload]\nuri = "s3://bkt"\nmax_backlog_bytes = "20G"', "at most retention.max_bytes"),
    ('[upload]\nuri = "s3://bkt"\nintervl_s = 5', "did you mean interval_s"),
])
def test_bad_upload_config_is_one_line_and_exit_2(tmp_path, body, fragment):
    p = daemon_exit(tmp_path, body)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and fragment in p.stderr, p
    assert "Traceback" not in p.stderr


def test_refused_credentials_and_missing_bucket_stop_the_daemon_with_one_line(tmp_path):
    """Checked before anything is recorded: credentials the store refuses (moto with IAM checks on)
    and a bucket that does not exist are one line each, naming the fix; exit 3."""
    strict = Moto(free_port(), env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}).start(bucket=False)
    open_ = Moto(free_port()).start(bucket=False)
    try:
        p = daemon_exit(tmp_path, f'[upload]\nuri = "s3://{BUCKET}/x"\nendpoint = "{strict.endpoint}"')
        assert p.returncode == 3 and p.stderr.count("\n") == 1, p
        assert "refuses our credentials" in p.stderr and "AWS_ACCESS_KEY_ID" in p.stderr, p.stderr
        p = daemon_exit(tmp_path, f'[upload]\nuri = "s3://{BUCKET}/x"\nendpoint = "{open_.endpoint}"')
        assert p.returncode == 3 and p.stderr.count("\n") == 1, p
        assert "bucket does not exist" in p.stderr and "create it" in p.stderr, p.stderr
    finally:
        strict.stop()
        open_.stop()


def test_backoff_doubles_with_jitter_and_resets(tmp_path):
    cfg = UploadConfig(uri="file:///nowhere", interval_s=10, backoff_max_s=100, max_backlog_bytes=MiB)
    logged: list[str] = []
    u = Uploads(cfg, tmp_path, logged.append, rand=lambda: 1.0)
    waits = []
    for _ in range(6):
        u.done({"error": "connection refused"}, {}, 0.0, 0.0)
        waits.append(u.next_at)
    assert waits == [10, 20, 40, 80, 100, 100] and len(logged) == 1      # logged once per 10 minutes
    u.rand = lambda: 0.0
    u.done({"error": "x"}, {}, 0.0, 0.0)
    assert u.next_at == 50                                                # half, at the least
    u.done({"uploaded_files": 3, "uploaded_bytes": 30, "pending_files": 0}, {}, 1000.0, 5.0)
    assert (u.failures, u.next_at, u.uploaded_files, u.last_success) == (0, 1010.0, 3, 5.0)
    assert "works again after 7 failed runs" in logged[-1]
    u.done({"uploaded_files": 1, "pending_files": 4}, {}, 2000.0, 6.0)
    assert u.next_at == 2000.0                                            # out of time with files left: at once


def test_upload_run_to_a_directory_is_atomic_and_idempotent(tmp_path):
    """file:// (local or NFS): only sealed files of the fleet layout, under a dot-name until
    renamed; a second run sends nothing; a rewritten recordings file goes again to the same path."""
    data, dest = tmp_path / "data", tmp_path / "dest"
    old_recording(data, 2, 0.1)
    w = DatasetWriter(data, "20240102T000000Z-3-cdefab", host="h")
    row = {"recording_id": w.recording_id, "started": T0, "schema_version": 6}
    recs = w.write(RECORDINGS, [row], name=w.recording_id)
    unsealed = old_recording(data, 1, 0.1, rec="20240103T000000Z-4-defabc")[0]
    unsealed = unsealed.rename(unsealed.with_name("20240103T000000Z-4-defabc-000001.parquet"))
    (data / "processes" / "date=2023-01-01").mkdir(parents=True)          # the old layout: not uploaded
    (data / "processes" / "date=2023-01-01" / "20230101T000000Z-9-000001_000002.parquet").write_bytes(b"x")
    target = U.Destination(f"file://{dest}")
    rep = U.run(data, target, 30)
    assert (rep.uploaded_files, rep.error) == (3, None)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == sorted(sealed(data)) and not any(Path(g).name.startswith(".") for g in got)
    assert U.run(data, target, 30).uploaded_files == 0
    w.write(RECORDINGS, [{**row, "ended": T0}], name=w.recording_id)        # the recording ended: rewritten
    assert U.run(data, target, 30).uploaded_files == 1
    assert (dest / recs.relative_to(data)).read_bytes() == recs.read_bytes()
    assert json.loads((data / ".upload" / "state.json").read_text())["uri"] == f"file://{dest}"
    assert U.run(data, U.Destination(f"file://{tmp_path / 'elsewhere'}"), 30).uploaded_files == 3   # a new URI


def test_a_directory_destination_gets_the_output_policy(tmp_path):
    """file:// goes through the checks of every output (sampler/files.py): a link planted where
    an uploaded file goes is refused, not written through (the root-owned file it points at is
    untouched), and so is a destination setgid to another group (its members could read every
    dataset) or writable by others. Each is one line that names the cause, and uploads nothing."""
    data = tmp_path / "data"
    old_recording(data, 1, 0.1)
    [rel] = sealed(data)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    dest = tmp_path / "dest"
    (dest / rel).parent.mkdir(parents=True, mode=0o700)
    for d in [dest, *(dest / rel).parents]:
        if d.is_relative_to(dest):
            d.chmod(0o700)
    (dest / rel).symlink_to(victim)
    rep = U.run(data, U.Destination(f"file://{dest}"), 30)
    assert rep.uploaded_files == 0 and "symbolic link" in rep.error and "\n" not in rep.error
    assert victim.read_bytes() == b"root's file"
    (dest / rel).unlink()
    os.chown(dest, -1, 65534)
    dest.chmod(0o2700)
    rep = U.run(data, U.Destination(f"file://{dest}"), 30)
    assert rep.uploaded_files == 0 and "setgid to group 65534" in rep.error
    dest.chmod(0o777)
    rep = U.run(data, U.Destination(f"file://{dest}"), 30)
    assert rep.uploaded_files == 0 and "writable by other users" in rep.error
    dest.chmod(0o700)
    assert U.run(data, U.Destination(f"file://{dest}"), 30).uploaded_files == 1
    assert (dest / rel).stat().st_mode & 0o077 == 0
