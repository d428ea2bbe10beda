"""Fleet reading on local files: many hosts' data in the schema-6 layout (and one host in the older
layout) read by the CLI as a whole, by --host/--since/--until, one host at a time, with pruning
proven by unreadable files where a selection must not look. The data are real recordings (the
session's `leaky` and `leaky_grown`) copied in as other hosts and days (tests/fleet_data.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import time
import weakref
from functools import partial

import pandas as pd
import pytest
from conftest import allocsampler_cmd, planted_dir
from fleet_data import (
    add_garbage,
    build_fleet,
    copy_recording,
    fleet_plan,
    recording_day,
    synthetic_recording,
    window_args,
)
from journey import ALLOCSAMPLER

from analysis import analyze
from analysis.fleet import analyse_host, default_jobs, host_result, per_host
from analysis.source import Selection, open_source
from sampler.dataset.layout import host_key

pytestmark = pytest.mark.bpf


def cli(*args: str) -> subprocess.CompletedProcess:
    if args[0] == "analyze" and "--jobs" not in args:
        args = (*args, "--jobs", "1")   # workers on every CPU would starve the tests beside: see the next test
    return subprocess.run(allocsampler_cmd(*args), capture_output=True, text=True, timeout=300, cwd="/")


def ok(*args: str) -> str:
    p = cli(*args)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, leaky, leaky_grown):
    """FLEET (every host and day), and REF/<host>: each host's data alone, as one host's
    recorder writes it (older layout), which the fleet's results must equal."""
    base = tmp_path_factory.mktemp("fleet")
    plan = fleet_plan(leaky.out, leaky_grown.out, synthetic_recording(base / "synthetic"))
    root = build_fleet(base / "fleet", plan)
    refs = {h: build_fleet(base / "ref" / host_key(h), plan, hosts={h}, old_layout=True) for h in plan}
    return root, refs, plan, recording_day(leaky.out)


def findings_by_host(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in doc["findings"]:
        out.setdefault(f.pop("host"), []).append(f)
    return out


def test_fleet_analysis_equals_each_host_alone(fleet):
    root, refs, plan, _ = fleet
    doc = json.loads(ok("analyze", str(root), "--json"))
    hosts = [h["host"] for h in doc["hosts"]]
    assert hosts == sorted(host_key(h) for h in plan)
    got = findings_by_host(doc)
    for host, ref in refs.items():
        alone = json.loads(ok("analyze", str(ref), "--json"))["findings"]
        assert got.get(host_key(host), []) == alone, host
    assert len(got["batch-7"]) >= 4       # its leaks, in each of its two days' recordings
    n = {h["host"]: h["processes"] for h in doc["hosts"]}
    for host, (src, days, _) in plan.items():
        procs = pd.read_parquet(src / "processes")
        assert n[host_key(host)] == len(days) * procs["pid"].nunique()
    text = ok("analyze", str(root))
    assert [ln.split(":")[0] for ln in text.splitlines() if ln.startswith("== host ")] == \
        [f"== host {h}" for h in hosts]


def test_one_host_in_memory_at_a_time(fleet):
    """per_host releases each host's dataset (its frames) before it loads the next host's."""
    root, _, plan, _ = fleet
    earlier: list[weakref.ref] = []

    def load(source):
        assert all(r() is None for r in earlier), "an earlier host's frames are still referenced"
        ds = analyze.load(source)
        earlier.extend([weakref.ref(ds), weakref.ref(ds.outstanding), weakref.ref(ds.processes)])
        return ds

    got = dict(per_host(open_source(str(root)), lambda host, ds, findings: len(findings), load))
    assert sorted(got) == sorted(host_key(h) for h in plan) and got["batch-7"] >= 4


def test_a_host_whose_analysis_runs_past_its_bound_is_an_error_and_the_others_go_on(fleet):
    """A host that takes too long (its load sleeps) is that host's error within its bound; the
    hosts before and after it are analysed as without a bound. On the command line, a bound no
    host can meet makes every host one error line (exit 1, no traceback)."""
    root, _, plan, _ = fleet
    slow = "batch-7"

    def load(source):
        if source.hosts() == [slow]:
            time.sleep(30)
        return analyze.load(source)

    source = open_source(str(root))
    t0 = time.monotonic()
    got = dict(per_host(source, host_result, load, each=partial(analyse_host, timeout_s=1.0)))
    assert time.monotonic() - t0 < 25
    assert got[slow].error is not None and "took longer than 1 s" in got[slow].error and not got[slow].findings
    unbounded = dict(per_host(source, host_result, analyze.load, each=partial(analyse_host, timeout_s=None)))
    assert {h: r for h, r in got.items() if h != slow} == {h: r for h, r in unbounded.items() if h != slow}
    assert all(r.error is None for r in unbounded.values()) and len(unbounded) == len(plan)
    p = cli("analyze", str(root), "--host-timeout", "0.001")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == len(plan) and all("took longer than 0.001 s" in ln for ln in lines), p.stderr
    bad = cli("analyze", str(root), "--host-timeout", "0")
    assert bad.returncode == 2 and "--host-timeout: must be positive" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.serial     # workers on both CPUs: alone, not beside the recordings of the suite's other step
def test_hosts_in_workers_equal_one_at_a_time(fleet, tmp_path):
    """--jobs N analyses N hosts at once, each in a worker process: the same document and the same
    report, hosts in name order; a host's bad file is that host's error (one line each, exit 1,
    the other hosts still analysed), the same as without workers."""
    root, _, plan, day0 = fleet
    outputs = {}
    for args in (["--json"], []):
        outputs[bool(args)] = one = ok("analyze", str(root), *args, "--jobs", "1")
        assert ok("analyze", str(root), *args, "--jobs", "3") == one
        assert ok("analyze", str(root), *args, "--jobs", "2") == one
    doc = json.loads(outputs[True])
    assert len(doc["hosts"]) == len(plan) and doc["findings"]
    assert 1 <= default_jobs() <= len(os.sched_getaffinity(0))      # the default: a worker per CPU at most
    dirty = build_fleet(tmp_path / "dirty", plan)
    add_garbage(dirty, day0)
    errors = [cli("analyze", str(dirty), "--json", "--jobs", n) for n in ("1", "3")]
    for p in errors:
        assert p.returncode == 1 and "Traceback" not in p.stderr and "garbage.parquet" in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert lines and all(ln.startswith("allocsampler analyze: host ") for ln in lines), p.stderr
        hosts = json.loads(p.stdout)["hosts"]
        assert sorted(h["host"] for h in hosts if "error" in h) == sorted(ln.split()[3] for ln in lines)
        assert any("error" not in h and h["processes"] for h in hosts)     # the others analysed
    assert errors[0].stderr == errors[1].stderr and errors[0].stdout == errors[1].stdout
    bad = cli("analyze", str(root), "--jobs", "0")
    assert bad.returncode == 2 and "--jobs: must be in 1..256" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.serial     # workers on both CPUs, as above
def test_workers_import_nothing_from_the_working_directory(tmp_path):
    """multiprocessing starts its resource tracker, forkserver and workers with `python -c` in the
    working directory, first on their sys.path: from a directory with a planted ctypes/, json/ and
    multiprocessing/, `analyze ./DIR --jobs 2` (the entry point, as root runs it) imports none of
    them, and the relative path still reaches the workers (they start in /)."""
    marker = tmp_path / "imported"
    cwd = planted_dir(tmp_path / "cwd", marker)
    src = synthetic_recording(tmp_path / "synthetic")
    for host in ("web-1", "web-2"):
        copy_recording(src, cwd / "data", host)
    runs = [subprocess.run([ALLOCSAMPLER, "analyze", "./data", "--jobs", n], cwd=cwd, capture_output=True, text=True,
                           timeout=300) for n in ("2", "1")]
    for p in runs:
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert runs[0].stdout == runs[1].stdout and "== host web-2:" in runs[0].stdout
    assert not marker.exists(), marker.read_text()


def test_top_per_host_equals_each_host_alone(fleet):
    root, refs, _, _ = fleet
    text = ok("top", str(root), "-n", "3")
    sections = {}
    for chunk in text.split("== host ")[1:]:
        head, body = chunk.split(" ==\n", 1)
        sections[head] = body
    assert set(sections) == {host_key(h) for h in refs}
    for host, ref in refs.items():
        assert sections[host_key(host)] == ok("top", str(ref), "-n", "3"), host
    # one host: the plain output, as for a single dataset
    assert ok("top", str(root), "-n", "3", "--host", "db_1") == ok("top", str(refs["db 1"]), "-n", "3")


def test_selection_prunes_before_opening(fleet, tmp_path):
    """Unreadable files in the partitions a selection excludes: the commands never open them,
    and give what the same selection gives on clean data (and what the selected data alone gives)."""
    root, _, plan, day0 = fleet
    dirty = build_fleet(tmp_path / "dirty", plan)
    garbage = add_garbage(dirty, day0)
    sel = window_args(day0)
    p = cli("top", str(dirty))          # unselected, the garbage is read and said to be bad
    assert p.returncode != 0 and "Traceback" not in p.stderr and "garbage.parquet" in p.stderr, p.stderr
    source = open_source(str(dirty), Selection(("web-*",), *(dt.datetime.fromisoformat(v).replace(
        tzinfo=dt.timezone.utc) for v in (sel[3], sel[5]))))
    listed = {f.path for t in ("outstanding", "processes", "stacks", "frames", "targets", "recordings")
              for f in source.files(t)}
    assert listed and not listed & {str(g) for g in garbage}
    # the window's data alone: web-1 and web-2 of day0+1 (web-1's day0+2 copy has catalogs only in reach)
    alone = build_fleet(tmp_path / "alone", plan, only_days={1}, hosts={"web-1", "web-2"})
    outputs = {}
    for cmd in (["top", "-n", "3"], ["analyze", "--json"]):
        outputs[cmd[0]] = ok(cmd[0], str(dirty), *cmd[1:], *sel)
        assert outputs[cmd[0]] == ok(cmd[0], str(root), *cmd[1:], *sel)
        assert outputs[cmd[0]] == ok(cmd[0], str(alone), *cmd[1:])
    assert [h["host"] for h in json.loads(outputs["analyze"])["hosts"]] == ["web-1", "web-2"]
    assert "== host web-2" in outputs["top"] and "leak_malloc" in outputs["top"]


def test_comm_selects_processes(fleet):
    """--comm keeps the processes of that name: their findings are those of the whole analysis."""
    root, _, _, _ = fleet
    every = json.loads(ok("analyze", str(root), "--host", "batch-7", "--json"))["findings"]
    comm = every[-1]["comm"]
    some = json.loads(ok("analyze", str(root), "--host", "batch-7", "--comm", comm, "--json"))["findings"]
    assert some and some == [f for f in every if f["comm"] == comm]


def test_old_layout_host_by_its_rows(fleet):
    """A host in the older layout is selected by its rows' host (sanitized as a host= name)."""
    root, refs, _, _ = fleet
    source = open_source(str(root), Selection(("db_1",)))
    got = source.read("processes")
    ref = pd.read_parquet(refs["db 1"] / "processes")
    assert set(got["host"].astype(str)) == {"db 1"} and len(got) == len(ref)
    assert source.hosts() == ["db_1"]
    assert open_source(str(root), Selection(("web-*",))).read("processes")["host"].astype(str).unique().tolist() \
        in (["web-1", "web-2"], ["web-2", "web-1"])


def test_host_partition_and_column_do_not_clash(fleet):
    """`host` is both a host= directory and a column in the files: one `host` column, the rows'."""
    root, _, plan, _ = fleet
    df = open_source(str(root)).read("outstanding")
    assert list(df.columns).count("host") == 1 and "date" in df.columns
    expect = sum(len(pd.read_parquet(src / "outstanding")) * len(days) for src, days, _ in plan.values())
    assert len(df) == expect
    assert set(df["host"].astype(str)) == set(plan)


def test_report_of_several_hosts_asks_for_one(fleet):
    root, _, plan, _ = fleet
    p = cli("report", str(root))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{len(plan)} hosts" in p.stderr and "--host" in p.stderr
    assert "allocsampler analysis of" in ok("report", str(root), "--host", "web-2")


def test_diff_and_export_take_a_host(fleet, tmp_path):
    root, refs, _, _ = fleet
    assert json.loads(ok("diff", str(root), str(root), "--host", "web-1", "--json"))["processes"] == \
        json.loads(ok("diff", str(refs["web-1"]), str(refs["web-1"]), "--json"))["processes"]
    assert ok("export", str(root), "--host", "web-2", "--collapsed", "-") == \
        ok("export", str(refs["web-2"]), "--collapsed", "-")


def test_bad_locations_are_one_line():
    for args, words in ((["top", "foo://bucket/x"], ("unknown URI scheme foo://",)),
                        (["analyze", "/nonexistent/prefix"], ("no dataset at /nonexistent/prefix",)),
                        (["export", "/", "--collapsed", "-"], ("no allocsampler dataset at /",))):
        p = cli(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("allocsampler: error:")]
        assert len(lines) == 1 and all(w in lines[0] for w in words), p.stderr
