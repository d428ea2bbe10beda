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

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from typing import Any, TypeVar

from analysis import analyze
from analysis.dataset import Dataset
from analysis.findings import FINDINGS_SCHEMA, Finding
from analysis.source import Source

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
             load: Callable[[Source], Dataset] = analyze.load, jobs: int = 1) -> Iterator[tuple[str, T]]:
    """(host, visit(host, dataset, findings)) for each selected host, in name order. `load`
    reads one host's Source (the window and process filters of the command); `jobs` hosts are
    analysed at once, each in a worker process of its own (1: here, one after the other)."""
    hosts = source.hosts()
    if jobs <= 1 or len(hosts) <= 1:
        for host in hosts:
            yield host, one_host(source, host, visit, load)
        return
    # forkserver: workers forked from a process that imported the analysis once and started no
    # thread (this one has Arrow's pools running)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["analysis.analyze"])
    workers = min(jobs, len(hosts))
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_threads, initargs=(threads,)) as pool:
        try:
            yield from zip(hosts, pool.map(one_host, repeat(source), hosts, repeat(visit), repeat(load)), strict=True)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


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


def fleet_document(results: list[tuple[str, list[Finding], int]]) -> dict[str, Any]:
    """`analyze --json` of several hosts: the findings of every host ranked together, each with its
    `host`, and per host the processes analysed and findings counted (hosts without any too)."""
    rows = [{"host": host, **f.to_json()} for host, findings, _ in results for f in findings]
    rows.sort(key=lambda r: -r["severity"])
    return {"schema": FINDINGS_SCHEMA,
            "hosts": [{"host": host, "processes": n, "findings": len(findings)} for host, findings, n in results],
            "findings": rows}
