"""The README's commands over datasets a host does not record itself: many hosts' data in an
object store (`analyze s3://...`, read through moto's S3 server on localhost as from AWS, by the
local pool and as a Spark job), and a
PyTorch memory snapshot imported into the same tables (`import-torch`)."""

from __future__ import annotations

import datetime as dt
import pickle
import re

import pyarrow.fs as pafs
import pytest
from fleet_data import GARBAGE, KEYS, QUIET, build_fleet, moto_server, recording_day, synthetic_recording
from gpu_data import torch_snapshot
from journey import run_readme, user_env

from analysis.source import CATALOGS
from sampler.dataset.layout import partition_dir
from sampler.dataset.schema import TABLES

pytestmark = pytest.mark.bpf


def test_analyze_a_fleet_in_an_object_store_by_host_and_day(tmp_path):
    """web-1 and web-2 from the day asked for on are analysed, each on its own; a host that does not
    match and the time series of the days before are never read (unreadable files lie there; the
    catalogs of earlier days are, as stacks first seen then are needed)."""
    rec = synthetic_recording(tmp_path / "synthetic")
    day0 = recording_day(rec)
    fleet = build_fleet(tmp_path / "fleet", {"web-1": (rec, [0, 1], False), "web-2": (rec, [1], False),
                                             "db-1": (rec, [1], False)})
    for host, day in (("db-1", day0 + dt.timedelta(days=1)), ("web-1", day0 - dt.timedelta(days=1))):
        for table in set(TABLES) - (set(CATALOGS) if day < day0 else set()):   # where it must never look
            f = partition_dir(fleet, table, host, day) / "garbage.parquet"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(GARBAGE)
    day = (day0 + dt.timedelta(days=1)).isoformat()
    with moto_server() as url:
        fs = pafs.S3FileSystem(endpoint_override=url.split("//")[1], scheme="http", region="us-east-1",
                               access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                               allow_bucket_creation=True)
        fs.create_dir("bucket")
        pafs.copy_files(str(fleet), "bucket/prefix", destination_filesystem=fs)
        env = user_env(**KEYS, **QUIET, AWS_ENDPOINT_URL=url)
        r = run_readme("allocsampler analyze s3://bucket/prefix --host 'web-*' --since 2026-11-24",
                       {"2026-11-24": day}, env=env, timeout=300)
        spark = run_readme("allocsampler analyze s3://bucket/prefix --host 'web-*' --since 2026-11-24 --engine spark",
                           {"2026-11-24": day}, env=env, timeout=300)
    hosts = re.findall(r"^== host ([^:\s]+)", r.stdout, re.M)
    assert hosts == ["web-1", "web-2"], r.stdout[:3000]
    assert "db-1" not in r.stdout and "Traceback" not in r.stderr
    for section in r.stdout.split("== host ")[1:]:
        assert "[persistent_growth]" in section, section[:2000]
    # Spark's tasks give each host what the pool gave it, then the rollups across the two hosts
    per_host, rollups = spark.stdout.split("== across hosts:", 1)
    assert per_host == r.stdout and spark.stderr == "", spark.stderr[-2000:]
    top = rollups.split("== across hosts: time to OOM")[0]
    assert re.search(r"/h on 2 hosts \(\d+ findings\): ", top), rollups


def test_a_pytorch_snapshot_imported_reads_like_a_recording(tmp_path):
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(torch_snapshot()))
    out = tmp_path / "ds"
    r = run_readme("allocsampler import-torch snap.pickle --out DIR", {"snap.pickle": str(snap), "DIR": str(out)})
    assert "reserved 44.0 MiB, allocated 18.0 MiB" in r.stdout, r.stdout
    top = run_readme("allocsampler top /var/tmp/prof", {"/var/tmp/prof": str(out)}).stdout
    # the caching allocator's segments (cuda) and the tensors in them (torch), with their Python stacks
    rows = [ln for ln in top.splitlines() if re.match(r"\s+\d+\.", ln)]
    assert any("torch" in ln and "py_cache (train.py:" in ln for ln in rows), top
    assert any("cuda " in ln and "py_step (train.py:" in ln for ln in rows), top
