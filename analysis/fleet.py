"""Analysis of many hosts' data, one host at a time per worker, in memory bounded by one host's
data per worker.

    from analysis.fleet import per_host
    from analysis.source import open_source
    for host, findings in per_host(open_source("s3://bucket/allocsampler"), lambda h, ds, f: f):
        ...

Each host's selected partitions (host=<name>/, and old-layout rows of that host) are loaded as
one dataset, analysed by the single-host detectors (analysis/analyze.py), handed to `visit`,
and released before the next host's files are read: the fleet's findings are exactly those of
each host's dataset analysed alone. With `jobs` > 1, hosts are analysed in that many worker
processes at once (`visit` and `load` then run there and must pickle: module-level functions or
partials of them), and the results still come in host order.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from typing import Any, TypeVar

import pyarrow as pa

from analysis import analyze
from analysis.dataset import Dataset
from analysis.diff import stack_key
from analysis.findings import FINDINGS_SCHEMA, Finding
from analysis.report.text import render
from analysis.source import Source
from sampler.errors import AllocsamplerError
from sampler.text import printable

T = TypeVar("T")

# what one worker may take: a host's analysis peaked at 250-600 MiB in scripts/bench_analysis.py
JOB_MEMORY = 1 << 30


def default_jobs() -> int:
    """Workers for a fleet: one per CPU this process may run on, at most one per JOB_MEMORY of
    the memory available now, at least one."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = JOB_MEMORY
    return max(1, min(len(os.sched_getaffinity(0)), avail // JOB_MEMORY))


def per_host(source: Source, visit: Callable[[str, Dataset, list[Finding]], T],
             load: Callable[[Source], Dataset] = analyze.load, jobs: int = 1,
             each: Callable[..., T] | None = None) -> Iterator[tuple[str, T]]:
    """(host, visit(host, dataset, findings)) for each selected host, in name order. `load`
    reads one host's Source (the window and process filters of the command); `jobs` hosts are
    analysed at once, each in a worker process of its own (1: here, one after the other).
    `each`: what runs per host (one_host; analyse_host turns damaged files into the host's error)."""
    each = each or one_host
    hosts = source.hosts()
    if jobs <= 1 or len(hosts) <= 1:
        for host in hosts:
            yield host, each(source, host, visit, load)
        return
    # forkserver: workers forked from a process that imported the analysis once and started no
    # thread (this one has Arrow's pools running)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["analysis.analyze"])
    workers = min(jobs, len(hosts))
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    with contextlib.ExitStack() as stack:
        # multiprocessing starts its helpers with `python -c` in the working directory, first on their
        # sys.path (a planted multiprocessing/ there would run as root): the resource tracker (as the
        # pool is made), the forkserver and the workers (as the jobs are submitted) start in /; the
        # Source's paths are absolute (open_source)
        with in_root_dir():
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_threads,
                                                           initargs=(threads,)))
            results = pool.map(each, repeat(source), hosts, repeat(visit), repeat(load))
        try:
            yield from zip(hosts, results, strict=True)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


@contextlib.contextmanager
def in_root_dir() -> Iterator[None]:
    """In / for a while, then back in this directory (by a descriptor: its path may have changed)."""
    here = os.open(".", os.O_PATH | os.O_DIRECTORY)
    try:
        os.chdir("/")
        yield
    finally:
        os.fchdir(here)
        os.close(here)


def _worker_threads(n: int) -> None:
    """Arrow's decoding threads of a worker: its share of the CPUs (the workers are the parallelism)."""
    import pyarrow as pa

    pa.set_cpu_count(n)


def one_host(source: Source, host: str, visit: Callable[[str, Dataset, list[Finding]], T],
             load: Callable[[Source], Dataset] = analyze.load) -> T:
    """visit(host, dataset, findings) of one host's selected data; the dataset (its frames) is
    released on return."""
    ds = load(source.select(hosts=(host,)))
    return visit(host, ds, analyze.run(ds))


# --- one host as plain data: what every engine runs and returns ----------------------------------

# What reading a host's files or analysing them raises when they are damaged (a truncated or
# foreign Parquet file, a missing column): that host's error row, never the whole fleet's failure
DAMAGED = (OSError, ValueError, KeyError, pa.ArrowException, AllocsamplerError)
MAX_ERROR = 500         # characters of an error row's message


@dataclass
class HostResult:
    """One host's analysis: the processes analysed, its findings as `analyze --json` gives them
    (docs/findings.md), in the order the detectors return them; or why it could not be analysed.
    `report`: its terminal report, when asked for."""

    host: str
    processes: int
    findings: list[dict[str, Any]]
    error: str | None = None
    report: str | None = None


def host_result(host: str, ds: Dataset, findings: list[Finding], *, report: bool = False,
                interpreter_frames: bool = False) -> HostResult:
    """A `visit` for per_host/one_host: the plain result of one analysed host."""
    text = render(ds, findings, interpreter_frames=interpreter_frames) if report else None
    return HostResult(host, len(ds.summary()), [f.to_json() for f in findings], report=text)


# wall time one host's analysis may take (`analyze --host-timeout`): a host's files are what its
# recorder wrote, or what anyone who could write the bucket put there; a day of 50 processes
# takes ~2 s here, so this leaves room for hosts hundreds of times larger
HOST_TIMEOUT_S = 600.0


class HostTimeout(AllocsamplerError):
    """One host's analysis ran past its bound: that host's error row."""


def analyse_host(source: Source, host: str, visit: Callable[[str, Dataset, list[Finding]], HostResult] = host_result,
                 load: Callable[[Source], Dataset] = analyze.load, timeout_s: float | None = HOST_TIMEOUT_S
                 ) -> HostResult:
    """The engine-neutral analysis of one host (the local pool, Spark's tasks): damaged files, or
    an analysis longer than `timeout_s` (None: unbounded), give its error, not an exception."""
    try:
        with _bounded(timeout_s):
            return one_host(source, host, visit, load)
    except DAMAGED as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        return HostResult(host, 0, [], error=printable(msg)[:MAX_ERROR])


@contextlib.contextmanager
def _bounded(seconds: float | None) -> Iterator[None]:
    """SIGALRM after `seconds` of wall time raises HostTimeout where the analysis is (between two
    Python bytecodes: a numpy call in progress finishes first). Only the main thread gets signals:
    elsewhere (a caller's own thread) the analysis runs unbounded. The pool's workers, Spark's
    Python workers and `--jobs 1` run it in their main thread. 1e6 s or more: unbounded."""
    if seconds is None or not 0 < seconds < 1e6 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise HostTimeout(f"its analysis took longer than {seconds:g} s (analyze --host-timeout SECONDS raises "
                          "the bound)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# The rows of a fleet's findings (docs/findings.md, "A fleet's findings as a table"): per host one
# `host` row (or one `error` row), then one `finding` row per finding. `finding` holds the whole
# finding's JSON; the typed columns beside it are what fleet rollups group and sort by.
FLEET_FINDINGS = pa.schema([
    ("host", pa.string()), ("record", pa.string()), ("ordinal", pa.int32()), ("processes", pa.int64()),
    ("kind", pa.string()), ("pid", pa.int64()), ("comm", pa.string()), ("severity", pa.float64()),
    ("confidence", pa.float64()), ("summary", pa.string()), ("stack_signature", pa.string()),
    ("outstanding_bytes", pa.float64()), ("growth_bytes_per_hour", pa.float64()),
    ("time_to_oom_hours", pa.float64()), ("finding", pa.string()), ("error", pa.string()), ("report", pa.string()),
])


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def to_records(r: HostResult) -> list[dict[str, Any]]:
    """A host's result as FLEET_FINDINGS rows."""
    head = {"host": r.host, "record": "error" if r.error is not None else "host", "ordinal": 0,
            "processes": r.processes, "error": r.error, "report": r.report}
    rows = [head]
    for i, f in enumerate(r.findings):
        frames = f.get("frames")
        rows.append({"host": r.host, "record": "finding", "ordinal": i, "kind": f.get("kind"), "pid": f.get("pid"),
                     "comm": f.get("comm"), "severity": _number(f.get("severity")),
                     "confidence": _number(f.get("confidence")), "summary": f.get("summary"),
                     "stack_signature": stack_key(frames) if isinstance(frames, list) and frames else None,
                     "outstanding_bytes": _number(f.get("outstanding_bytes")),
                     "growth_bytes_per_hour": _number(f.get("growth_bytes_per_hour")),
                     "time_to_oom_hours": _number(f.get("time_to_oom_hours")),
                     "finding": json.dumps(f, sort_keys=False)})
    return rows


def findings_table(results: list[HostResult]) -> pa.Table:
    """The fleet's FLEET_FINDINGS rows as one table (what --findings-out writes), without the
    hosts' text reports."""
    rows = [row | {"report": None} for r in results for row in to_records(r)]
    return pa.Table.from_pylist(rows, schema=FLEET_FINDINGS)


def from_records(rows: list[dict[str, Any]]) -> list[HostResult]:
    """FLEET_FINDINGS rows (in any order) back to each host's result, in host order."""
    results: dict[str, HostResult] = {}
    found: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for row in rows:
        if row["record"] == "finding":
            found.setdefault(row["host"], []).append((row["ordinal"], json.loads(row["finding"])))
        else:
            results[row["host"]] = HostResult(row["host"], int(row["processes"] or 0), [], row["error"], row["report"])
    for host, fs in found.items():
        results[host].findings = [f for _, f in sorted(fs, key=lambda x: x[0])]
    return [results[h] for h in sorted(results)]


def fleet_document(results: list[HostResult]) -> dict[str, Any]:
    """`analyze --json` of several hosts: the findings of every host ranked together, each with its
    `host`, and per host the processes analysed and findings counted (hosts without any too, and
    a host that could not be analysed with its `error`)."""
    rows = [{"host": r.host, **f} for r in results for f in r.findings]
    rows.sort(key=lambda r: -r["severity"])
    hosts = [{"host": r.host, "processes": r.processes, "findings": len(r.findings)}
             | ({"error": r.error} if r.error is not None else {}) for r in results]
    return {"schema": FINDINGS_SCHEMA, "hosts": hosts, "findings": rows}
