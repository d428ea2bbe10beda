"""Analysis of many hosts' data, one host at a time, in memory bounded by one host's data.

    from analysis.fleet import per_host
    from analysis.source import open_source
    for host, findings in per_host(open_source("s3://bucket/allocsampler"), lambda h, ds, f: f):
        ...

Each host's selected partitions (host=<name>/, and old-layout rows of that host) are loaded as
one dataset, analysed by the single-host detectors (analysis/analyze.py), handed to `visit`,
and released before the next host's files are read: the fleet's findings are exactly those of
each host's dataset analysed alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from analysis import analyze
from analysis.dataset import Dataset
from analysis.findings import FINDINGS_SCHEMA, Finding
from analysis.source import Source

T = TypeVar("T")


def per_host(source: Source, visit: Callable[[str, Dataset, list[Finding]], T],
             load: Callable[[Source], Dataset] = analyze.load) -> Iterator[tuple[str, T]]:
    """(host, visit(host, dataset, findings)) for each selected host, in name order. `load`
    reads one host's Source (the window and process filters of the command)."""
    for host in source.hosts():
        ds = load(source.select(hosts=(host,)))
        findings = analyze.run(ds)
        result = visit(host, ds, findings)
        del ds, findings        # before the next host is read: one host's frames at a time
        yield host, result


def fleet_document(results: list[tuple[str, list[Finding], int]]) -> dict[str, Any]:
    """`analyze --json` of several hosts: the findings of every host ranked together, each with its
    `host`, and per host the processes analysed and findings counted (hosts without any too)."""
    rows = [{"host": host, **f.to_json()} for host, findings, _ in results for f in findings]
    rows.sort(key=lambda r: -r["severity"])
    return {"schema": FINDINGS_SCHEMA,
            "hosts": [{"host": host, "processes": n, "findings": len(findings)} for host, findings, n in results],
            "findings": rows}
