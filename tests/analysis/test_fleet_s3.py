"""The fleet over a real S3-protocol server on localhost (moto's standalone server): the commands
read s3:// prefixes as they read the local copy, with the same pruning (unreadable files where a
selection must not look are uploaded too), and bad locations give one line naming cause and fix."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, allocsampler_cmd
from fleet_data import (
    KEYS,
    QUIET,
    add_garbage,
    build_fleet,
    fleet_plan,
    free_port,
    moto_server,
    recording_day,
    synthetic_recording,
    window_args,
)

from analysis.fleet import FLEET_FINDINGS
from analysis.source import open_source

pytestmark = pytest.mark.bpf

BUCKET = "fleet"


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


# --- the same fleet as a Spark job (analysis/spark.py) ---------------------------------------------

SPARK = ("--engine", "spark", "--master", "local[2]")


def test_spark_findings_over_s3_equal_the_local_pools(s3, tmp_path):
    """Spark in local mode, its tasks reading s3:// through pyarrow (no Hadoop connector): the
    JSON equals `--jobs 1`'s field by field, and --findings-out writes the documented rows."""
    url, _, _, _ = s3
    env = {**KEYS, "AWS_ENDPOINT_URL": url}
    local = json.loads(ok("analyze", f"s3://{BUCKET}/clean", "--json", env=env))
    out = tmp_path / "findings.parquet"
    doc = json.loads(ok("analyze", f"s3://{BUCKET}/clean", "--json", *SPARK, "--findings-out", str(out), env=env))
    assert doc == local
    table = pq.read_table(out)
    assert table.schema.equals(FLEET_FINDINGS)
    rows = table.to_pylist()
    assert [(r["host"], r["processes"]) for r in rows if r["record"] == "host"] == \
        [(h["host"], h["processes"]) for h in local["hosts"]]
    by_host: dict[str, list[dict]] = {}
    for r in sorted((r for r in rows if r["record"] == "finding"), key=lambda r: (r["host"], r["ordinal"])):
        by_host.setdefault(r["host"], []).append(json.loads(r["finding"]))
    expected: dict[str, list[dict]] = {}
    for f in local["findings"]:
        expected.setdefault(f["host"], []).append({k: v for k, v in f.items() if k != "host"})
    assert {h: sorted(fs, key=json.dumps) for h, fs in by_host.items()} == \
        {h: sorted(fs, key=json.dumps) for h, fs in expected.items()}
    growth = [r for r in rows if r["kind"] == "persistent_growth"]
    assert growth and all(r["stack_signature"] and r["growth_bytes_per_hour"] > 0 for r in growth)


def test_a_damaged_host_is_one_error_row_and_the_text_ends_with_the_rollups(s3, tmp_path):
    """One host's file is not Parquet: that host is an error (one line on stderr, exit 1), the
    others are reported as the local pool reports them, then the rollups across hosts."""
    _, clean, _, _ = s3
    damaged = tmp_path / "fleet"
    shutil.copytree(clean, damaged)
    victim = sorted((damaged / "processes" / "host=web-2").rglob("*.parquet"))[0]
    victim.write_bytes(b"not parquet at all" * 100)
    local = cli("analyze", str(damaged), env={})
    p = cli("analyze", str(damaged), *SPARK, env={})
    for run in (local, p):
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("allocsampler analyze: host web-2 could not be analysed:"), \
            run.stderr
    hosts, rollups = p.stdout.split("== across hosts:", 1)
    assert hosts == local.stdout
    assert "== host web-2: could not be analysed ==" in hosts and "== host batch-7: " in hosts
    assert "the stacks that grow on the most hosts" in rollups and "/h on " in rollups, rollups
    assert "time to OOM" in p.stdout


def test_a_spark_job_killed_mid_run_and_started_again_gives_the_same_answer(s3, tmp_path):
    """SIGKILL to the whole command (driver, JVM, Python workers) once its tasks run: nothing is
    written, no process is left, and the command started again writes what a run never killed does
    (the local pool's, row for row)."""
    _, clean, _, _ = s3
    out = tmp_path / "findings.parquet"
    argv = allocsampler_cmd("analyze", str(clean), "--json", *SPARK, "--findings-out", str(out))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", start_new_session=True)
    try:
        _wait_for_workers(p)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert _gone(p.pid, 10)
    assert not out.exists()
    doc = json.loads(ok("analyze", str(clean), "--json", *SPARK, "--findings-out", str(out)))
    pool = tmp_path / "pool.parquet"
    assert doc == json.loads(ok("analyze", str(clean), "--json", "--findings-out", str(pool)))
    assert pq.read_table(out).equals(pq.read_table(pool))


def test_a_spark_driver_killed_alone_leaves_no_jvm_or_worker(s3):
    """SIGKILL to the command's own process only, once its tasks run: the JVM it started (whose
    stdin is the dead driver's pipe) and the JVM's Python workers end on their own."""
    _, clean, _, _ = s3
    p = subprocess.Popen(allocsampler_cmd("analyze", str(clean), "--json", *SPARK), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    try:
        _wait_for_workers(p)
        assert any("java" in c.split(" ", 1)[0] for c in _cmdlines_in_group(p.pid))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert _gone(p.pid, 60), _cmdlines_in_group(p.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _wait_for_workers(p: subprocess.Popen, timeout: float = 120) -> None:
    """Until the command's group has a pyspark Python worker (its tasks run)."""
    deadline = time.monotonic() + timeout
    while not any("pyspark" in c and "worker" in c for c in _cmdlines_in_group(p.pid)):
        assert p.poll() is None and time.monotonic() < deadline, "the job ended before its workers were seen"
        time.sleep(0.05)


def _gone(pgid: int, timeout: float) -> bool:
    """Whether the group has no running process left within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while _cmdlines_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _cmdlines_in_group(pgid)


def _cmdlines_in_group(pgid: int) -> list[str]:
    """The command lines of the group's processes still running (not zombies)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if os.getpgid(int(d)) == pgid and state not in ("Z", "X"):
                cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def test_the_api_on_ones_own_session_and_its_rollups(s3, monkeypatch, tmp_path):
    """analysis.spark on a SparkSession of the caller's: the rollups are those pandas computes from
    the same rows, from the persisted findings (each host analysed once: pyspark's own
    `sql(..., found=found)` uncached them, and each rollup analysed every host again)."""
    from pyspark.sql import SparkSession

    from analysis import analyze
    from analysis import spark as engine
    _, clean, _, _ = s3
    loads = tmp_path / "loads"

    def counting_load(source):              # in the Python workers: one line per host analysed
        with open(loads, "a") as f:
            f.write("1\n")
        return analyze.load(source)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)        # as a user's session sets up its workers
    session = (SparkSession.builder.master("local[1]").appName("allocsampler-api-test")
               .config("spark.ui.enabled", "false").config("spark.executorEnv.PYTHONPATH", str(ROOT))
               .getOrCreate())
    try:
        source = open_source(str(clean))
        found = engine.findings(session, source, counting_load).persist()
        rows = pd.DataFrame(engine.collect(found).to_pylist())
        top = engine.top_stacks(found).toPandas()
        oom = engine.hosts_by_oom(found).toPandas()
        engine.rollups_text(found)
        # the per-host bound holds in Spark's Python workers too: each host its error row
        bounded = engine.collect(engine.findings(session, source, timeout_s=0.001)).to_pylist()
    finally:
        session.stop()
    assert {r["record"] for r in bounded} == {"error"} and len(bounded) == len(source.hosts())
    assert all("took longer than 0.001 s" in r["error"] for r in bounded), bounded
    assert len(loads.read_text().split()) == len(source.hosts()) >= 2
    g = rows[(rows["record"] == "finding") & (rows["kind"] == "persistent_growth") & rows["stack_signature"].notna()]
    want = g.groupby("stack_signature").agg(hosts=("host", "nunique"), rate=("growth_bytes_per_hour", "sum"))
    want = want.sort_values(["rate", "hosts"], ascending=False).head(10)
    assert list(top["stack_signature"]) == list(want.index)
    assert list(top["hosts"]) == list(want["hosts"]) and len(top) >= 1
    assert top["growth_bytes_per_hour"].tolist() == pytest.approx(want["rate"].tolist())
    t = rows[(rows["record"] == "finding") & rows["time_to_oom_hours"].notna()]
    assert list(oom["host"]) == list(t.groupby("host")["time_to_oom_hours"].min().sort_values().index)[:10]


def test_spark_without_java_is_one_line(tmp_path):
    """No Java runtime on PATH and no JAVA_HOME: one line saying what to install, exit 3."""
    p = subprocess.run(allocsampler_cmd("analyze", str(tmp_path), "--engine", "spark"), capture_output=True,
                       text=True, cwd="/", env={"PATH": "/nonexistent", "HOME": "/root"}, timeout=120)
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a Java runtime" in lines[0] and "openjdk-17-jre-headless" in lines[0], p.stderr
