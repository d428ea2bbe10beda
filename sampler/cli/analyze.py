"""`allocsampler analyze`: find persistent growth, arena bloat and GPU problems in a dataset; over
several hosts' data, each host on its own (analysis/fleet.py), findings grouped by host."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

from sampler.cli.args import add_window, dataset_location, jobs, load_window, open_location, positive
from sampler.errors import UsageError
from sampler.text import printable

HELP = "find persistent growth and arena bloat in a dataset"


def prepare_parser(a: argparse.ArgumentParser) -> None:
    a.description = HELP
    add_window(a)
    a.add_argument("--json", action="store_true", help="print one JSON object (docs/findings.md)")
    a.add_argument("--interpreter-frames", action="store_true",
                   help="show CPython's own frames between two Python frames (folded by default)")
    a.add_argument("--jobs", type=jobs, metavar="N", help="hosts analysed at once, each in a process of its own, "
                   "when the data holds several (default: one per CPU, at most one per GiB of available memory)")
    a.add_argument("--engine", choices=("local", "spark"), default="local",
                   help="where a fleet's hosts are analysed: this machine's pool of processes (default), or a "
                   "Spark job (pyspark and a Java runtime: the [spark] extra)")
    a.add_argument("--master", metavar="URL", help="the Spark master of --engine spark (default: local[N], "
                   "N the CPUs here; spark://HOST:PORT, yarn, k8s://...)")
    a.add_argument("--findings-out", metavar="URI", help="also write the fleet's findings as one Parquet file "
                   "(docs/findings.md: a fleet's findings as a table), a local path or s3://...")
    a.add_argument("--host-timeout", type=positive, metavar="SECONDS", default=None,
                   help="a fleet's host whose analysis takes longer is an error row, the others go on "
                   "(default 600)")


def analyzed(args: argparse.Namespace, source=None):
    """(dataset, findings) of the window the arguments select (analyze and report)."""
    from analysis import analyze

    ds = load_window(args, dataset_location(args, source))
    return ds, analyze.run(ds)


def run(args: argparse.Namespace) -> int:
    from analysis import analyze
    from analysis.report.text import render

    if args.engine == "spark":
        from analysis import spark

        spark.require()                 # before any listing: what to install, in one line
    source = open_location(args, since=args.since, until=args.until)
    if args.engine == "spark" or args.findings_out:
        return run_fleet(args, source)
    if args.master:
        raise UsageError("--master goes with --engine spark")
    if len(source.hosts()) > 1:
        return run_fleet(args, source)
    ds, findings = analyzed(args, source)
    print(json.dumps(analyze.to_document(findings), indent=2) if args.json
          else render(ds, findings, interpreter_frames=args.interpreter_frames))
    return 0


def run_fleet(args: argparse.Namespace, source) -> int:
    """Each host on its own, in the local pool or as a Spark job; the results printed per host,
    then the hosts that could not be analysed (exit 1 when there are any)."""
    from analysis.fleet import (
        HOST_TIMEOUT_S,
        analyse_host,
        default_jobs,
        findings_table,
        fleet_document,
        from_records,
        host_result,
        per_host,
    )

    # what the workers need of the arguments (the rest need not pickle)
    window = argparse.Namespace(**{k: getattr(args, k) for k in ("dir", "since", "until", "last", "pid", "source")})
    load = partial(load_window, window)
    visit = partial(host_result, report=not args.json, interpreter_frames=args.interpreter_frames)
    timeout = args.host_timeout or HOST_TIMEOUT_S
    rollups = None
    if args.engine == "spark":
        from analysis import spark

        with spark.session(args.master or spark.default_master()) as session:
            found = spark.findings(session, source, load, visit, timeout).persist()
            table = spark.collect(found)
            if not args.json:
                rollups = spark.rollups_text(found)
        results = from_records(table.to_pylist())
        for r in results if not args.json else ():
            _print_host(r)
    else:
        results = []
        each = partial(analyse_host, timeout_s=timeout)
        for _, r in per_host(source, visit, load, jobs=args.jobs or default_jobs(), each=each):
            if not args.json:
                _print_host(r)
            results.append(r)
    if args.findings_out:
        from analysis.source import write_table

        write_table(args.findings_out, findings_table(results), endpoint=args.endpoint)
    if args.json:
        print(json.dumps(fleet_document(results), indent=2))
    elif rollups:
        print(rollups)
    failed = [r for r in results if r.error is not None]
    for r in failed:
        print(f"allocsampler analyze: host {printable(r.host)} could not be analysed: {r.error}", file=sys.stderr)
    return 1 if failed else 0


def _print_host(r) -> None:
    if r.error is not None:
        print(f"== host {printable(r.host)}: could not be analysed ==\n{r.error}", end="\n\n", flush=True)
        return
    print(f"== host {printable(r.host)}: {r.processes} processes, {len(r.findings)} findings ==")
    print(r.report, end="\n\n", flush=True)
