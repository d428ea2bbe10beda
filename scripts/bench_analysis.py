#!/usr/bin/env python3
"""Time and memory of `analyze` on a synthetic dataset: 50 processes x 24 h at 10 s intervals.

    .venv/bin/python scripts/bench_analysis.py [--processes 50] [--hours 24] [--stacks 10] [--quick]
    .venv/bin/python scripts/bench_analysis.py --fleet [--hosts 100] [--days 5] [--runs 3] [--s3] [--spark]
        [--whole-only] [--quick]

Each process gets `stacks` stacks: a slow leak, a bounded cache, churn and steady pools, written
through the recorder's own DatasetWriter (one file per table per simulated hour holding every
process; --per-process-files: one per process and hour,
the layout of this bench before 2026-11-28, 1,200 files a day), then
`analysis.analyze.run(load(DIR))` runs in a fresh child process whose wall time and peak RSS are
reported.

Every column is converted to its Arrow type in sampler/dataset/schema.py, so a schema change
breaks this bench loudly (or not at all), and tests/project/test_benchmarks.py runs its --quick mode
(2 processes x 2 h x 4 stacks: every kind of stack, two files per table; seconds).

--fleet: a fleet of hosts x days in the schema-6 layout (<table>/host=<h>/date=<d>/, one
compacted file per table and host-day, as the daemon uploads them), each host-day 8 processes x 8
stacks at 30 s (184,320 outstanding rows, a 24th of the single-host day above, in time order as
the recorder and compaction leave them; each process runs through all the days of its host, with
the same four kinds of stack), then
`allocsampler analyze DIR --json` (every host, as many at once as --jobs' default: analysis/fleet.py;
then one at a time) and the same with --host and --since pruning, each in a fresh child process:
wall time and the peak of its and its workers' RSS summed, --runs times.
--s3 repeats the pruned selections over a moto S3 server on localhost (moto[server] installed).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sampler.dataset.schema import FRAMES, OUTSTANDING, PROCESSES, STACKS, Table  # noqa: E402
from sampler.dataset.writer import DatasetWriter  # noqa: E402

T = 512 << 10
MiB = 1 << 20
FULL = {"processes": 50, "hours": 24.0, "stacks": 10}
QUICK = {"processes": 2, "hours": 2.0, "stacks": 4}      # stacks 0-3: leak, cache, churn, steady
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


def series(rng, kind: int, n: int, interval: float) -> tuple[np.ndarray, np.ndarray]:
    """Live sample counts and churn per snapshot for one stack."""
    t = np.arange(1, n + 1) * interval
    if kind == 0:                                     # leak: 50 KiB/s
        births = rng.poisson(50 * 1024 * interval / T, n)
        return np.cumsum(births), births
    if kind == 1:                                     # bounded cache of ~200 samples
        births = rng.poisson(2.0, n)
        live = np.minimum(np.cumsum(births), 200 + rng.integers(-10, 10, n))
        return live, births * 2
    if kind == 2:                                     # churn
        births = rng.poisson(30, n)
        return rng.poisson(1, n), births * 2
    return np.full(n, 40 + kind) + 0 * t, np.zeros(n, int)   # steady pools


def arrow(table: Table, df: pd.DataFrame) -> pa.Table:
    """A DataFrame as an Arrow table of the schema: each column converted to the schema's Arrow
    type, not to one guessed from the data (a float64 guess for an all-null column stopped this
    bench when `processes.tier` became a dictionary); absent columns are nulls of that type. A
    column the schema lacks is an error, so a renamed column cannot silently become a null one."""
    if unknown := sorted(set(df.columns) - {c.name for c in table.columns}):
        raise ValueError(f"table {table.name} has no columns {unknown} (sampler/dataset/schema.py)")
    return pa.Table.from_arrays([pa.array(df[c.name], type=c.type) if c.name in df else pa.nulls(len(df), c.type)
                                 for c in table.columns], schema=table.schema)


def write(out: Path, processes: int, hours: float, stacks: int, interval: float, per_process: bool = False) -> int:
    """The dataset as the recorder writes it: one file per table and hour holding every process
    (with `per_process`, one per process and hour: the layout of this bench before 2026-11-28)."""
    rng = np.random.default_rng(0)
    n = int(hours * 3600 / interval)
    t0 = pd.Timestamp("2026-11-01T00:00:00Z")
    ts = t0 + pd.to_timedelta(np.arange(1, n + 1) * interval, unit="s")
    w = DatasetWriter(out, "bench", host="h")
    frames, stack_rows = [], []
    per_file = int(3600 / interval)
    pids = range(1000, 1000 + processes)
    data = {}
    for pid in pids:
        sids = [pid * 100 + k for k in range(stacks)]
        data[pid] = {sid: series(rng, k % 4 if k < 4 else 3 + k, n, interval) for k, sid in enumerate(sids)}
        for sid in sids:
            frames.append({"ts": t0, "recording_id": "bench", "stack_id": sid, "depth": 0,
                           "function": f"site_{sid}", "module": "libapp.so", "kind": "native"})
            stack_rows.append({"ts": t0, "recording_id": "bench", "stack_id": sid, "n_frames": 1})
    rows = 0
    for lo in range(0, n, per_file):
        hi = min(n, lo + per_file)
        k = hi - lo
        out_parts, proc_parts = [], []
        for pid in pids:
            out_parts.append(pd.concat([pd.DataFrame({
                "ts": ts[lo:hi], "recording_id": "bench", "interval_s": interval, "pid": pid,
                "comm": f"svc{pid % 7}", "source": "malloc", "stack_id": sid,
                "outstanding_bytes": live[lo:hi] * float(T),
                "outstanding_stderr_bytes": np.sqrt(live[lo:hi]) * float(T),
                "live_samples": live[lo:hi], "alloc_samples": churn[lo:hi], "free_samples": np.zeros(k)})
                for sid, (live, churn) in data[pid].items()]))
            proc_parts.append(pd.DataFrame({
                "ts": ts[lo:hi], "recording_id": "bench", "pid": pid, "comm": f"svc{pid % 7}",
                "rss": 800 * MiB + np.arange(lo, hi) * 50 * 1024 * interval, "memory_limit": 16 << 30}))
        by_ts = [(pd.concat(out_parts).sort_values("ts", kind="stable"),
                  pd.concat(proc_parts).sort_values("ts", kind="stable"))]
        groups = zip(out_parts, proc_parts, strict=True) if per_process else by_ts
        for o, p in groups:
            rows += len(o)
            w.write(OUTSTANDING, arrow(OUTSTANDING, o), day=ts[lo].date())
            w.write(PROCESSES, arrow(PROCESSES, p), day=ts[lo].date())
    w.write(FRAMES, arrow(FRAMES, pd.DataFrame(frames)))
    w.write(STACKS, arrow(STACKS, pd.DataFrame(stack_rows)))
    return rows


# Peak RSS as VmHWM: getrusage's maxrss keeps the RSS of this (forked) bench from before the exec,
# ~300 MiB after writing a day's dataset (sampler/service/children.py does the same).
CHILD = """
import sys, time
sys.path.insert(0, {root!r})
t = time.perf_counter()
from analysis import analyze
ds = analyze.load({out!r})
findings = analyze.run(ds)
dt = time.perf_counter() - t
kinds = {{}}
for f in findings:
    kinds[f.kind] = kinds.get(f.kind, 0) + 1
print(dt, int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM:")).split()[1]) * 1024, kinds)
"""


# -- fleet ---------------------------------------------------------------------------------------

FLEET = {"hosts": 100, "days": 5, "processes": 8, "stacks": 8, "interval": 30.0}
FLEET_QUICK = {"hosts": 3, "days": 2, "processes": 2, "stacks": 4, "interval": 600.0}
FLEET_T0 = pd.Timestamp("2026-11-01T00:00:00Z")


def write_fleet(out: Path, hosts: int, days: int, processes: int, stacks: int, interval: float) -> int:
    """The fleet through the recorder's writer (schema-6 layout), one file per table and host-day.
    Returns the outstanding rows."""
    rng = np.random.default_rng(0)
    per_day = int(86400 / interval)
    n = days * per_day
    ts = FLEET_T0 + pd.to_timedelta(np.arange(1, n + 1) * interval, unit="s")
    rows = 0
    for h in range(hosts):
        rec = f"bench-h{h:03d}"
        w = DatasetWriter(out, rec, host=f"h{h:03d}")
        series_of = {}
        stack_rows, frame_rows = [], []
        for pid in range(1000, 1000 + processes):
            for k in range(stacks):
                sid = pid * 100 + k
                series_of[(pid, sid)] = series(rng, k % 4 if k < 4 else 3 + k, n, interval)
                stack_rows.append({"ts": FLEET_T0, "recording_id": rec, "stack_id": sid, "n_frames": 1,
                                   "site": f"site_{k} (libapp.so)", "summary": f"site_{k} (libapp.so)"})
                frame_rows.append({"ts": FLEET_T0, "recording_id": rec, "stack_id": sid, "depth": 0,
                                   "function": f"site_{k}", "module": "libapp.so", "kind": "native"})
        w.write(STACKS, arrow(STACKS, pd.DataFrame(stack_rows)), day=FLEET_T0.date())     # first seen on day 0
        w.write(FRAMES, arrow(FRAMES, pd.DataFrame(frame_rows)), day=FLEET_T0.date())
        for d in range(days):
            lo, hi = d * per_day, (d + 1) * per_day
            day = ts[lo].date()
            parts = [pd.DataFrame({
                "ts": ts[lo:hi], "recording_id": rec, "interval_s": interval, "pid": pid, "comm": f"svc{pid % 7}",
                "source": "malloc", "stack_id": sid, "outstanding_bytes": live[lo:hi] * float(T),
                "outstanding_stderr_bytes": np.sqrt(live[lo:hi]) * float(T), "live_samples": live[lo:hi],
                "alloc_samples": churn[lo:hi], "free_samples": np.zeros(hi - lo)})
                for (pid, sid), (live, churn) in series_of.items()]
            procs = [pd.DataFrame({
                "ts": ts[lo:hi], "recording_id": rec, "pid": pid, "comm": f"svc{pid % 7}",
                "rss": 800 * MiB + np.arange(lo, hi) * 50 * 1024 * interval, "memory_limit": 16 << 30})
                for pid in range(1000, 1000 + processes)]
            # in time order, a snapshot's rows together: as the recorder writes them and compaction
            # keeps them (sorted by ts, stable). Before 2026-11-29 they were in series order.
            df = pd.concat(parts).sort_values("ts", kind="stable")
            rows += len(df)
            w.write(OUTSTANDING, arrow(OUTSTANDING, df), day=day)
            w.write(PROCESSES, arrow(PROCESSES, pd.concat(procs).sort_values("ts", kind="stable")), day=day)
    return rows


# Peak memory of the analysis and its workers together: their proportional set sizes (Pss: pages
# the workers share with the forkserver counted once) summed every 250 ms (the workers are the
# forkserver's children, so no rusage of this process sees them), or this process's VmHWM if more.
FLEET_CHILD = """
import contextlib, io, json, os, sys, threading, time
sys.path.insert(0, {root!r})

def tree_pss():
    todo, total = [os.getpid()], 0
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{{p}}/smaps_rollup") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("Pss:")) * 1024
            for t in os.listdir(f"/proc/{{p}}/task"):
                with open(f"/proc/{{p}}/task/{{t}}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, StopIteration):
            pass
    return total

peak, done = [0], threading.Event()

def watch():
    while not done.wait(0.25):
        peak[0] = max(peak[0], tree_pss())

threading.Thread(target=watch, daemon=True).start()
t = time.perf_counter()
from sampler.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    code = main({argv!r})
dt = time.perf_counter() - t
done.set()
doc = json.loads(buf.getvalue())
hosts = len(doc["hosts"]) if "hosts" in doc else 1
own = int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM:")).split()[1]) * 1024
print(code, dt, max(own, peak[0]), hosts, len(doc["findings"]))
"""


# The contrast: the selected hosts loaded and analysed as one dataset, as a single-host reader
# would (what per-host streaming avoids).
AT_ONCE_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
t = time.perf_counter()
from analysis import analyze
from analysis.source import Selection, open_source
argv = {argv!r}
source = open_source(argv[1], Selection((argv[-1],)))
findings = analyze.run(analyze.load(source))
dt = time.perf_counter() - t
peak = int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM:")).split()[1]) * 1024
print(0, dt, peak, len(source.hosts()), len(findings))
"""


def measure(argv: list[str], env: dict[str, str] | None = None,
            child: str = FLEET_CHILD) -> tuple[float, int, int, int]:
    """(wall s, peak RSS bytes, hosts, findings) of `allocsampler ARGV` in a fresh child."""
    out = subprocess.run([sys.executable, "-c", child.format(root=str(ROOT), argv=argv)], capture_output=True,
                         text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise SystemExit(f"analyze {argv} failed: {out.stderr.strip()}")
    code, wall, rss, hosts, findings = out.stdout.split()
    assert code == "0", out.stdout
    return float(wall), int(rss), int(hosts), int(findings)


def spread(values: list[float], fmt: str) -> str:
    """median [min-max] of the runs."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def moto_upload(local: Path) -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free localhost port holding `local` as s3://bench/fleet."""
    import urllib.request

    import pyarrow.fs as pafs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                           access_key="bench", secret_key="bench", allow_bucket_creation=True)
    fs.create_dir("bench")
    pafs.copy_files(str(local), "bench/fleet", destination_filesystem=fs, use_threads=True)
    return proc, url


def fleet_main(args: argparse.Namespace) -> None:
    sizes = FLEET_QUICK if args.quick else FLEET
    hosts = args.hosts or sizes["hosts"]
    days = args.days or sizes["days"]
    runs = 1 if args.quick else args.runs
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "fleet"
        t = time.perf_counter()
        rows = write_fleet(out, hosts, days, sizes["processes"], sizes["stacks"], sizes["interval"])
        files = sum(1 for _ in out.rglob("*.parquet"))
        size = sum(f.stat().st_size for f in out.rglob("*.parquet"))
        print(f"wrote {hosts} hosts x {days} days: {rows:,} outstanding rows, {files:,} files, "
              f"{size / MiB:.0f} MiB in {time.perf_counter() - t:.0f} s")
        last_day = (FLEET_T0 + pd.Timedelta(days=days - 1)).date().isoformat()
        selections = [("every host, every day", []),
                      ("every host, every day, --jobs 1 (no workers)", ["--jobs", "1"]),
                      ("--host h000 (one host)", ["--host", "h000"]),
                      (f"--host 'h00*' ({min(hosts, 10)} hosts)", ["--host", "h00*"]),
                      (f"--since {last_day} (the last day)", ["--since", last_day]),
                      (f"as one dataset: 'h00*' ({min(hosts, 10)} hosts) loaded at once", ["--host", "h00*"])]
        if args.spark:      # beside the pool's whole-fleet row
            selections.insert(1, ("every host, every day, --engine spark --master local[2]",
                                  ["--engine", "spark", "--master", "local[2]"]))
        if args.whole_only:
            selections = [s for s in selections if s[0].startswith("every") and "--jobs 1" not in s[0]]
        where = [("local", str(out), None)]
        moto = None
        if args.s3:
            t = time.perf_counter()
            moto, url = moto_upload(out)
            print(f"uploaded to a moto S3 server in {time.perf_counter() - t:.0f} s")
            where.append(("moto S3", "s3://bench/fleet", {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench",
                                                          "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}))
        try:
            print("| where | selection | hosts | findings | wall time, median [min-max] "
                  "| peak Pss with workers, median [min-max] |")
            print("|---|---|--:|--:|--:|--:|")
            for place, location, env in where:
                for label, extra in selections:
                    whole = label.startswith("every")     # over moto only with --s3-all: moto is one Python process
                    if place != "local" and (label.startswith("as one") or whole and not args.s3_all):
                        continue
                    child = AT_ONCE_CHILD if label.startswith("as one dataset") else FLEET_CHILD
                    got = [measure(["analyze", location, "--json", *extra], env, child) for _ in range(runs)]
                    print(f"| {place} | {label} | {got[0][2]} | {got[0][3]} | "
                          f"{spread([g[0] for g in got], '{:.1f} s')} | "
                          f"{spread([g[1] / MiB for g in got], '{:,.0f} MiB')} |", flush=True)
        finally:
            if moto is not None:
                moto.terminate()
                moto.wait()
    if args.quick:
        print(QUICK_NOTE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, help=f"default {FULL['processes']}, --quick {QUICK['processes']}")
    ap.add_argument("--hours", type=float, help=f"default {FULL['hours']:g}, --quick {QUICK['hours']:g}")
    ap.add_argument("--stacks", type=int, help=f"default {FULL['stacks']}, --quick {QUICK['stacks']}")
    ap.add_argument("--interval", type=float, default=10)
    ap.add_argument("--quick", action="store_true", help="smallest sizes that still exercise every step")
    ap.add_argument("--per-process-files", action="store_true",
                    help="one file per process and hour (this bench's layout before 2026-11-28)")
    ap.add_argument("--fleet", action="store_true", help="the fleet benchmark (hosts x days, schema-6 layout)")
    ap.add_argument("--hosts", type=int, help=f"--fleet: default {FLEET['hosts']}")
    ap.add_argument("--days", type=int, help=f"--fleet: default {FLEET['days']}")
    ap.add_argument("--runs", type=int, default=3, help="--fleet: runs of each selection (default 3)")
    ap.add_argument("--spark", action="store_true", help="--fleet: the whole fleet as a Spark job (local[2]) too")
    ap.add_argument("--whole-only", action="store_true",
                    help="--fleet: only the whole fleet, by the pool (and by Spark with --spark): large fleets")
    ap.add_argument("--s3", action="store_true", help="--fleet: the pruned selections over a moto S3 server too")
    ap.add_argument("--s3-all", action="store_true", help="--fleet --s3: the whole fleet over moto too")
    args = ap.parse_args()
    if args.fleet:
        fleet_main(args)
        return
    for k, v in (QUICK if args.quick else FULL).items():      # explicit sizes win over either preset
        if getattr(args, k) is None:
            setattr(args, k, v)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ds"
        t = time.perf_counter()
        rows = write(out, args.processes, args.hours, args.stacks, args.interval, args.per_process_files)
        print(f"wrote {rows:,} outstanding rows in {time.perf_counter() - t:.0f} s")
        res = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), out=str(out))],
                             capture_output=True, text=True, check=True).stdout.split(maxsplit=2)
        print(f"analyze: {float(res[0]):.1f} s, peak RSS {int(res[1]) / MiB:.0f} MiB, findings {res[2].strip()}")
        if args.quick:
            print(QUICK_NOTE)


if __name__ == "__main__":
    main()
