"""The fleet over a real S3-protocol server on localhost (moto's standalone server): the commands
read s3:// prefixes as they read the local copy, with the same pruning (unreadable files where a
selection must not look are uploaded too), and bad locations give one line naming cause and fix."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pyarrow.fs as pafs
import pytest
from conftest import allocsampler_cmd
from fleet_data import add_garbage, build_fleet, fleet_plan, recording_day, synthetic_recording, window_args

pytestmark = pytest.mark.bpf

BUCKET = "fleet"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
QUIET = {"AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}   # no instance-metadata probing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3 server as a subprocess on a free port; yields its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def s3(tmp_path_factory, leaky, leaky_grown):
    """The fleet (tests/fleet_data.py) with its unreadable partitions, local and uploaded to
    s3://fleet/prod; the endpoint URL."""
    base = tmp_path_factory.mktemp("s3fleet")
    plan = fleet_plan(leaky.out, leaky_grown.out, synthetic_recording(base / "synthetic"))
    day0 = recording_day(leaky.out)
    clean = build_fleet(base / "clean", plan)
    dirty = build_fleet(base / "dirty", plan)
    add_garbage(dirty, day0)
    with moto_server() as url:
        fs = pafs.S3FileSystem(endpoint_override=url.split("//")[1], scheme="http", region="us-east-1",
                               access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                               allow_bucket_creation=True)
        fs.create_dir(BUCKET)
        pafs.copy_files(str(dirty), f"{BUCKET}/prod", destination_filesystem=fs)
        pafs.copy_files(str(clean), f"{BUCKET}/clean", destination_filesystem=fs)
        yield url, clean, dirty, day0


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    if args[0] == "analyze" and "--jobs" not in args:
        args = (*args, "--jobs", "1")   # as in test_fleet.py: no workers beside the suite's other tests
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run(allocsampler_cmd(*args), capture_output=True, text=True, timeout=300, cwd="/",
                          env={**clean_env, **QUIET, **env})


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    p = cli(*args, env=env or {})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p.stdout


def test_selection_over_s3_equals_local_copy(s3):
    url, _, dirty, day0 = s3
    env = {**KEYS, "AWS_ENDPOINT_URL": url}          # the endpoint from the environment
    sel = window_args(day0)
    for cmd in (["top", "-n", "3"], ["analyze", "--json"], ["analyze"]):
        remote = ok(cmd[0], f"s3://{BUCKET}/prod", *cmd[1:], *sel, env=env)
        local = ok(cmd[0], str(dirty), *cmd[1:], *sel)
        if cmd == ["analyze"]:      # the text names the dataset it read
            remote = remote.replace(f"s3://{BUCKET}/prod", str(dirty))
        assert remote == local, cmd
    assert "== host web-1" in remote and "== host web-2" in remote


def test_whole_fleet_over_s3_equals_local_copy(s3):
    url, clean, _, _ = s3
    endpoint = ["--endpoint", url]                   # the endpoint as an option
    doc = json.loads(ok("analyze", f"s3://{BUCKET}/clean", "--json", *endpoint, env=KEYS))
    assert doc == json.loads(ok("analyze", str(clean), "--json"))
    assert len(doc["hosts"]) == 4 and any(f["host"] == "batch-7" for f in doc["findings"])
    assert ok("top", f"s3://{BUCKET}/clean", "--host", "db_1", *endpoint, env=KEYS) == \
        ok("top", str(clean), "--host", "db_1")
    assert ok("export", f"s3://{BUCKET}/clean", "--host", "web-2", "--collapsed", "-", *endpoint, env=KEYS) == \
        ok("export", str(clean), "--host", "web-2", "--collapsed", "-")
    remote = json.loads(ok("diff", f"s3://{BUCKET}/clean", str(clean), "--host", "batch-7", "--json", *endpoint,
                           env=KEYS))
    assert remote["processes"] == json.loads(ok("diff", str(clean), str(clean), "--host", "batch-7",
                                                "--json"))["processes"]


def assert_one_line(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert p.returncode == code and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("allocsampler: error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), p.stderr


def test_bad_remote_locations(s3):
    url, _, _, _ = s3
    env = {**KEYS, "AWS_ENDPOINT_URL": url}
    assert_one_line(cli("analyze", "s3://no-such-bucket/prod", env=env), 2, "bucket 'no-such-bucket' does not exist")
    assert_one_line(cli("top", f"s3://{BUCKET}/nothing-here", env=env), 2, "no allocsampler dataset at", "prefix")
    assert_one_line(cli("top", "s4://x/y", env=env), 2, "unknown URI scheme s4://")
    assert_one_line(cli("top", f"s3://{BUCKET}/prod", "--endpoint", f"http://127.0.0.1:{free_port()}", env=KEYS),
                    3, "cannot be reached", "--endpoint")


def test_credentials_refused():
    """A server that checks credentials (moto with authentication on): unknown keys, and none."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        env = {"AWS_ENDPOINT_URL": url}
        assert_one_line(cli("top", f"s3://{BUCKET}/prod", env={**KEYS, **env}), 3, "access denied", "credentials")
        assert_one_line(cli("top", f"s3://{BUCKET}/prod", env=env), 3, "no AWS credentials found",
                        "AWS_ACCESS_KEY_ID")
