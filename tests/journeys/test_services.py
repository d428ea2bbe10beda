"""Servers as the README records them: a pre-forking server under `record --children`, a service
started with the preload shim and recorded by pid, and the daemon from a config file, asked for
its status and stopped with SIGTERM as systemd stops it; `allocsampler check` first."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, WORKLOADS
from journey import ALLOCSAMPLER, findings, run_readme, start_readme, tier_rows, truth_line, user_env
from servers import Gunicorn

from sampler.units import parse_size

pytestmark = pytest.mark.bpf

SERVE = WORKLOADS / "serve.py"
ANALYZE = "allocsampler analyze /var/tmp/prof [--json]"


def test_check_says_this_machine_can_record():
    r = run_readme("allocsampler check")
    assert r.stdout.strip().startswith("allocsampler: this machine can record"), r.stdout


def test_a_pre_forking_server_and_every_worker_it_forks(tmp_path, bpf_ready):
    """gunicorn started under `record --children`: its arbiter gets the sampler at its exec, each
    worker it forks inherits it (no placement), and the workers' growth is named at the app's line
    at the rate the workers report."""
    sock = Path(tempfile.mkdtemp(prefix="allocsampler-journey-", dir="/tmp")) / "app.sock"
    out = tmp_path / "prof"
    gunicorn = [sys.executable, "-m", "gunicorn", "--bind", f"unix:{sock}", "--chdir", str(WORKLOADS),
                "--worker-tmp-dir", str(sock.parent)]
    rec = start_readme("allocsampler record --children --out /var/tmp/prof -- gunicorn --workers 4 app:app",
                       {"/var/tmp/prof": str(out), "gunicorn": gunicorn, "4": "2", "app:app": "wsgi_leak:app"},
                       cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            assert rec.poll() is None, rec.communicate()
            time.sleep(0.1)
        client = Gunicorn.__new__(Gunicorn)        # its client only: the server is the recorded command's
        client.socket = sock
        held: dict[int, int] = {}
        with ThreadPoolExecutor(2) as pool:
            for _ in range(80):                     # 100 requests a second for 8 s: 50 MiB kept
                t0 = time.monotonic()
                for pid, n in pool.map(lambda _: client.get("/leak"), range(10)):
                    held[pid] = max(held.get(pid, 0), n)
                time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
        time.sleep(1.2)                             # a snapshot after the last request
    finally:
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=120)
        shutil.rmtree(sock.parent, ignore_errors=True)
    assert rec.returncode == 0, err[-3000:]
    assert len(held) == 2, held
    t = pd.read_parquet(out / "targets")
    arbiter = int(t[t["event"] == "exec"]["pid"].iloc[0])
    for pid in held:
        tiers = [d for e, d in tier_rows(out, pid) if e == "tier"]
        assert tiers and f"inherited from pid {arbiter} (forked)" in tiers[0], tiers
    found = findings(run_readme(ANALYZE, {"/var/tmp/prof": str(out)}).stdout)
    named = [f for f in found if any(fr["function"] == "handle_leak" for fr in f.get("frames") or [])]
    assert named, [f["summary"] for f in found]
    # one finding for the family, or one per worker: what they hold adds up to what the workers say
    total = sum(f["outstanding_bytes"] for f in named if f["kind"] in ("family_growth", "persistent_growth")
                and not (f["kind"] == "persistent_growth" and any(g["kind"] == "family_growth" for g in named)))
    assert total == pytest.approx(sum(held.values()), rel=0.3), ([f["summary"] for f in named], held)


def test_a_service_started_with_the_preload_shim_is_recorded_by_pid(tmp_path, leakext, bpf_ready):
    shim = subprocess.run([ALLOCSAMPLER, "preload-path"], capture_output=True, text=True, env=user_env(), check=True)
    env = user_env(PYTHONPATH=str(leakext), LD_PRELOAD=shim.stdout.strip(), ALLOCSAMPLER_SAMPLE_MEAN="524288",
                   ALLOCSAMPLER_MAX_SAMPLES_PER_S="2000")
    svc = subprocess.Popen([sys.executable, str(SERVE)], env=env, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        time.sleep(1.0)
        rec = start_readme("allocsampler record --pid PID", {"PID": str(svc.pid)}, cwd=tmp_path)
        time.sleep(12)
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err[-3000:]
    finally:
        svc.terminate()
        _, svc_err = svc.communicate(timeout=30)
    out = tmp_path / "allocsampler-out"            # record's default --out, in the working directory
    tiers = [d for e, d in tier_rows(out, svc.pid) if e == "tier"]
    assert tiers and tiers[0].startswith("preload:"), tiers
    truth = truth_line(svc_err)
    found = findings(run_readme(ANALYZE, {"/var/tmp/prof": str(out)}).stdout)
    for function in ("cache_response", "ext_alloc_record"):
        f = [x for x in found if x["kind"] == "persistent_growth" and any(fr["function"] == function
                                                                           for fr in x["frames"])]
        assert len(f) == 1, [x["summary"] for x in found]
        key = "cache_response" if function == "cache_response" else "parse_request"
        rate, se = f[0]["growth_bytes_per_hour"] / 3600, f[0]["growth_stderr_bytes_per_hour"] / 3600
        assert abs(rate - truth[key]["rate"]) <= 3 * se + 0.05 * truth[key]["rate"], (f[0]["summary"], truth)


def unit_settings() -> dict[str, str]:
    """The [Service] settings of the systemd unit the Debian package installs."""
    text = (ROOT / "packaging" / "allocsampler.service").read_text()
    return dict(ln.split("=", 1) for ln in text.splitlines() if re.match(r"[A-Z]\w+=", ln))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_daemon_from_its_config_reports_status_and_stops_on_sigterm(tmp_path, leakext, bpf_ready):
    data = tmp_path / "data"
    cfg = tmp_path / "config.toml"
    port = _free_port()
    # a name of its own: a rule for serve.py would record the other tests' services too (and did)
    served = tmp_path / f"serve_daemon_{os.getpid()}.py"
    shutil.copy(SERVE, served)
    cfg.write_text(f"""
[daemon]
data_dir = "{data}"
interval_s = 2

[[targets]]
regex = '{served.stem}[.]py'

[metrics]
listen = "127.0.0.1:{port}"

[analysis]
every_s = 5
window_s = 60
""")
    svc = subprocess.Popen([sys.executable, str(served)], env=user_env(PYTHONPATH=str(leakext)),
                           stderr=subprocess.PIPE, text=True, cwd="/")
    # as the unit runs it: its capability bounding set, and its TasksMax and MemoryMax as cgroup limits
    unit = unit_settings()
    caps = ",".join(["-all", *(f"+{c.lower().removeprefix('cap_')}" for c in unit["CapabilityBoundingSet"].split())])
    cgroups = {"pids": {"pids.max": unit["TasksMax"]},
               "memory": {"memory.limit_in_bytes": str(parse_size(unit["MemoryMax"]))}}
    dirs = [Path(f"/sys/fs/cgroup/{c}/allocsampler-journey-{os.getpid()}") for c in cgroups]
    for d, limits in zip(dirs, cgroups.values(), strict=True):
        d.mkdir(exist_ok=True)
        for k, v in limits.items():
            (d / k).write_text(v)
    enter = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in dirs)
    daemon = start_readme("allocsampler daemon --config /etc/allocsampler/config.toml",
                          {"/etc/allocsampler/config.toml": str(cfg)}, cwd="/",
                          prefix=["sh", "-c", f'{enter} && exec setpriv --bounding-set {caps} -- "$@"', "unit"])
    status = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert daemon.poll() is None, daemon.communicate()
            # the README's `allocsampler status` reads the package's config path; this one lies elsewhere
            r = run_readme("allocsampler status", {"status": ["status", "--config", str(cfg)]}, check=False)
            status = r.stdout
            if re.search(rf"\b{svc.pid}\b.*inject", status) and "findings" in status and "persistent_growth" in status:
                break
            time.sleep(1)
        assert re.search(rf"\b{svc.pid}\b.*inject", status), status
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=60)
        stopped = time.monotonic() - t0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.communicate()
        svc.terminate()
        svc.communicate(timeout=30)
    events = (dirs[0] / "pids.events").read_text()
    for d in dirs:
        for _ in range(50):
            with contextlib.suppress(OSError):
                d.rmdir()
                break
            time.sleep(0.1)
    assert daemon.returncode == 0, err[-3000:]
    assert stopped < int(unit["TimeoutStopSec"].removesuffix("s")), stopped
    assert events.split() == ["max", "0"], events   # never at TasksMax
    assert "Traceback" not in err
    assert "persistent_growth" in status and "cache_response" in status, status
    assert os.path.isdir(data / "outstanding")
