#!/usr/bin/env python3
"""Whole servers under load, recorded (`record --pid MAIN --children`, default settings) and not,
interleaved in rounds: the benchmark's own throughput, and the recorder's CPU over the run.

  pg-S:    PostgreSQL, pgbench -S (selects), 4 clients on persistent connections
  pg-S-C:  the same with a new connection (a forked backend) per transaction
  redis:   Redis SET, redis-benchmark -P 8 (pipelined), 200-byte values
  gunicorn: gunicorn's pre-fork server, 2 sync workers, GET / from 4 client threads (each request
           on a new connection, over a unix socket)
  pg-S-beside: pg-S unrecorded, while a recorder starts beside it (its target an idle Python
           process): one server, one pgbench run, the window in which the recorder starts and
           runs against the windows before and after it (see _beside)

Each run starts a fresh server (scripts/servers.py: as nobody, on a unix socket); a recorded run
starts the recorder first and waits for its `attach` row.

A second table is a fork storm: a Python parent forks --storm-rate children a second for the run,
each keeping 4 MiB for 50 ms (so each is sampled, with near certainty) and exiting. It reports
how many were forked, recorded (a `targets` row) and seen allocating (samples), and the
recorder's CPU beside that of the same recorder on the idle parent.

    sudo .venv/bin/python scripts/bench_servers.py [--rounds 3] [--seconds 10] [--servers pg-S,pg-S-C,redis,gunicorn]
                                                   [--storm-rate 300] [--kernel-side] [--code DIR]

--kernel-side: each server also beside a no-op BPF program on one syscall tracepoint and no
recorder, the kernel's part of what recording costs it (bpf/vm.bpf.c's tracepoints put every
system call of the host on the slow path). --code DIR: each server also recorded by another
checkout's recorder (a `git worktree` of an older commit), in the same rounds.

--quick: one short round, a smoke test whose numbers mean nothing (0.2 s rather than 1 s for a
recorder to settle after its attach row, a 1 s gap rather than 2 s in pg-S-beside).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servers import Gunicorn, Postgres, Redis

ROOT = Path(__file__).resolve().parent.parent
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"
TICK = os.sysconf("SC_CLK_TCK")
SETTLE_S = 1.0          # after a recorder's attach row: its first placements and tables settle
GAP_S = 2               # pg-S-beside: between the recorder's stop and the window after it


def pgbench(connect: bool):
    def run(pg: Postgres, seconds: float) -> float:
        out = pg.run("pgbench", "-S", "-c", "4", "-j", "2", "-T", f"{seconds:g}", "-n", *(["-C"] if connect else []),
                     "postgres", timeout=seconds + 120)
        return float(re.search(r"tps = ([\d.]+)", out).group(1))
    return run


def redis_set(r: Redis, seconds: float) -> float:
    p = r.tool("redis-benchmark", "-t", "set", "-n", str(int(60000 * seconds)), "-P", "8", "-r", "100000",
               "-d", "200", "-q", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=seconds * 10 + 120)
    return float(re.findall(r"([\d.]+) requests per second", out)[-1])


def gunicorn_get(g: Gunicorn, seconds: float) -> float:
    from concurrent.futures import ThreadPoolExecutor
    end = time.monotonic() + seconds

    def client(_: int) -> int:
        n = 0
        while time.monotonic() < end:
            g.get("/")
            n += 1
        return n
    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(client, range(4))) / seconds


SERVERS = {"pg-S": (lambda: Postgres(scale=4), pgbench(False)),
           "pg-S-C": (lambda: Postgres(scale=4), pgbench(True)),
           "redis": (Redis, redis_set),
           "gunicorn": (Gunicorn, gunicorn_get),
           "pg-S-beside": (lambda: Postgres(scale=4), pgbench(False))}


STORM = """
import os, sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
forked, t0 = 0, time.monotonic()
while rate and time.monotonic() - t0 < seconds:
    if os.fork() == 0:
        kept = bytearray(4 << 20)
        time.sleep(0.05)
        os._exit(0)
    forked += 1
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    time.sleep(max(0.0, t0 + forked / rate - time.monotonic()))
time.sleep(max(0.0, t0 + seconds - time.monotonic()))
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print(forked, flush=True)
sys.stdin.readline()
"""


def storm(rate: float, seconds: float, work: Path, forking: bool = True) -> dict[str, float]:
    """The recorder on a parent that forks `rate` children a second (or stays idle: `forking`)."""
    import pandas as pd
    parent = subprocess.Popen([sys.executable, "-c", STORM, str(rate if forking else 0), str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = Path(tempfile.mkdtemp(dir=work))
    try:
        parent.stdout.readline()
        rec = subprocess.Popen([sys.executable, "-m", "sampler.cli", "record", "--pid", str(parent.pid),
                                "--children", "-o", str(out), "-q"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        _wait_attached(rec, out)
        cpu0, t0 = _cpu_s(rec.pid), time.monotonic()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        forked = int(parent.stdout.readline())
        cpu = 100 * (_cpu_s(rec.pid) - cpu0) / (time.monotonic() - t0)
        rec.send_signal(signal.SIGINT)
        rec.wait(300)
    finally:
        parent.kill()
        parent.wait()
    targets = pd.read_parquet(out / "targets")
    recorded = targets[targets["pid"] != parent.pid]["pid"].nunique()
    sampled = pd.read_parquet(out / "outstanding", columns=["pid", "alloc_samples"]) \
        if (out / "outstanding").exists() else pd.DataFrame({"pid": [], "alloc_samples": []})
    sampled = sampled[(sampled["pid"] != parent.pid) & (sampled["alloc_samples"] > 0)]["pid"].nunique()
    return {"forked": forked if forking else 0, "recorded": recorded, "sampled": sampled, "cpu": cpu}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / TICK     # with waited children


# What bpf/vm.bpf.c's syscall tracepoints cost on their own: one attached syscall tracepoint sends
# every system call of the host (not only the targets') through the kernel's slow path.
NOOP_TRACEPOINT = """
import sys
from bcc import BPF
b = BPF(text="TRACEPOINT_PROBE(syscalls, sys_enter_brk) { return 0; }")
print("attached", flush=True)
sys.stdin.readline()
"""


def measure(name: str, recorded: bool | str, seconds: float, work: Path) -> dict[str, float]:
    """One run of server `name` under its load: unrecorded (False), recorded (True), recorded by the
    checkout at path `recorded` (a str), or beside a no-op syscall tracepoint ("tracepoint")."""
    start, load = SERVERS[name]
    with start() as server:
        rec = tp = None
        if recorded == "tracepoint":
            tp = subprocess.Popen([sys.executable, "-I", "-c", NOOP_TRACEPOINT], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd="/")
            assert tp.stdout.readline().strip() == "attached"
        elif recorded:
            out = Path(tempfile.mkdtemp(dir=work))
            code = ROOT if recorded is True else Path(recorded)      # --code: another checkout's recorder
            rec = subprocess.Popen([sys.executable, "-m", "sampler.cli", "record", "--pid", str(server.pid),
                                    "--children", "-o", str(out), "-q"], cwd=code, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(code)})
            _wait_attached(rec, out)
            cpu0 = _cpu_s(rec.pid)
        t0 = time.monotonic()
        rate = load(server, seconds)
        wall = time.monotonic() - t0
        result = {"rate": rate}
        if rec is not None:
            result["recorder_cpu"] = 100 * (_cpu_s(rec.pid) - cpu0) / wall
            rec.send_signal(signal.SIGINT)
            rec.wait(120)
        if tp is not None:
            tp.stdin.close()
            tp.wait(30)
    return result


def _beside(start, seconds: float, work: Path) -> tuple[float, float, float]:
    """One server under one `pgbench -P 1` run in three windows of `seconds`: unrecorded, a
    recorder of another (idle) process launched at the second's start and stopped at its end,
    unrecorded again after a gap of GAP_S. Returns (unrecorded rate: the mean of the first and third
    windows, rate in the second, the recorder's CPU in % of a core over the second). Within one
    server: fresh servers differ by up to 20% from each other here, more than what is measured."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(1e6)"],
                            stdout=subprocess.PIPE, text=True)
    win = max(1, round(seconds))
    try:
        idle.stdout.readline()
        with start() as server:
            bench = server.tool("pgbench", "-S", "-c", "4", "-j", "2", "-T", str(3 * win + GAP_S), "-n", "-P", "1",
                                "postgres", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            t0 = time.monotonic()
            time.sleep(win)
            rec = subprocess.Popen([sys.executable, "-m", "sampler.cli", "record", "--pid", str(idle.pid),
                                    "-o", str(Path(tempfile.mkdtemp(dir=work))), "-q"], cwd=ROOT,
                                   stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            time.sleep(max(0.0, 2 * win - (time.monotonic() - t0)))
            if rec.poll() is not None:
                raise SystemExit(f"recorder exited: {rec.stderr.read()}")
            cpu = 100 * _cpu_s(rec.pid) / win
            rec.send_signal(signal.SIGINT)
            rec.wait(120)
            _, err = bench.communicate(timeout=3 * win + GAP_S + 120)
    finally:
        idle.kill()
        idle.wait()
    per_s = [float(x) for x in re.findall(r"progress: [\d.]+ s, ([\d.]+) tps", err)]
    if len(per_s) < 3 * win + GAP_S - 1:
        raise SystemExit(f"pgbench reported {len(per_s)} of {3 * win + GAP_S} seconds")
    before, during, after = per_s[:win], per_s[win:2 * win], per_s[2 * win + GAP_S:3 * win + GAP_S] or per_s[-win:]
    return (statistics.mean(before) + statistics.mean(after)) / 2, statistics.mean(during), cpu


def _wait_attached(rec: subprocess.Popen, out: Path) -> None:
    import pyarrow.parquet as pq
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if rec.poll() is not None:
            raise SystemExit(f"recorder exited: {rec.stderr.read()}")
        for f in (out / "targets").glob("host=*/date=*/*.parquet"):
            if "attach" in pq.read_table(f, columns=["event"]).column("event").to_pylist():
                time.sleep(SETTLE_S)
                return
        time.sleep(0.1)
    raise SystemExit("recorder did not attach in 120 s")


def _spread(v: list[float], fmt: str = ".0f") -> str:
    """median (min-max)"""
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


def _against_unrecorded(runs: dict, names: list[str], kind: bool | str, cpu: bool):
    """(server, cells) of each server run as `kind`: its rate, its ratio of medians to the
    unrecorded runs and the per-round ratios (and the recorder's CPU)."""
    for name in names:
        if (name, kind) not in runs:
            continue
        base = [x["rate"] for x in runs[(name, False)]]
        rate = [x["rate"] for x in runs[(name, kind)]]
        cells = [_spread(rate), f"{statistics.median(rate) / statistics.median(base):.3f}",
                 ", ".join(f"{b / a:.3f}" for a, b in zip(base, rate, strict=True))]
        if cpu:
            cells.append(_spread([x["recorder_cpu"] for x in runs[(name, kind)]], ".1f"))
        yield name, cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="default 3, --quick 1")
    ap.add_argument("--seconds", type=float, help="benchmark time per run (default 10, --quick 1)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="default %(default)s")
    ap.add_argument("--storm-rate", type=float, help="children forked per second (default 300, --quick 20)")
    ap.add_argument("--kernel-side", action="store_true",
                    help="also run each server beside a no-op syscall tracepoint (no recorder): the kernel's share")
    ap.add_argument("--code", type=Path, help="also record each server with this checkout's recorder "
                                               "(a `git worktree` of an older commit), interleaved")
    ap.add_argument("--quick", action="store_true", help="one short round: a smoke test")
    args = ap.parse_args()
    global SETTLE_S, GAP_S
    if args.quick:
        SETTLE_S, GAP_S = 0.2, 1
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (1.0 if args.quick else 10.0)
    names = args.servers.split(",")
    if unknown := set(names) - set(SERVERS):
        raise SystemExit(f"unknown server {', '.join(sorted(unknown))}: choose from {', '.join(SERVERS)}")
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in range(rounds):
        for name in names:
            if name.endswith("-beside"):
                base, rate, cpu = _beside(SERVERS[name][0], seconds, work)
                runs.setdefault((name, False), []).append({"rate": base})
                runs.setdefault((name, True), []).append({"rate": rate, "recorder_cpu": cpu})
                continue
            kinds = (False, True, *(["tracepoint"] if args.kernel_side else []),
                     *([str(args.code.resolve())] if args.code else []))
            for recorded in (kinds if r % 2 == 0 else kinds[::-1]):     # none always first
                runs.setdefault((name, recorded), []).append(measure(name, recorded, seconds, work))
    print(f"| server | unrecorded (per s) | recorded (per s) | ratio | per-round ratios | recorder CPU (% of a core) "
          f"|  (median of {rounds}, min-max; {seconds:g} s each)")
    print("|---|--:|--:|--:|---|--:|")
    for name, cells in _against_unrecorded(runs, names, True, cpu=True):
        print(f"| {name} | {_spread([x['rate'] for x in runs[(name, False)]])} | " + " | ".join(cells) + " |")
    others = [*([("tracepoint", "beside a no-op syscall tracepoint", False)] if args.kernel_side else []),
              *([(str(args.code.resolve()), f"recorded by {args.code}", True)] if args.code else [])]
    for kind, title, cpu in others:
        print()
        print(f"| server | {title} (per s) | ratio | per-round ratios "
              + ("| recorder CPU (% of a core) " if cpu else "") + f"|  (median of {rounds})")
        print("|---|--:|--:|---|" + ("--:|" if cpu else ""))
        for name, cells in _against_unrecorded(runs, names, kind, cpu):
            print(f"| {name} | " + " | ".join(cells) + " |")
    rate = args.storm_rate or (20.0 if args.quick else 300.0)
    storms = [(storm(rate, seconds, work), storm(rate, seconds, work, forking=False)) for _ in range(rounds)]
    print()
    print(f"| fork storm | children/s | forked | recorded | seen allocating | recorder CPU (% of a core) "
          f"| on the idle parent |  (median of {rounds}, min-max; {seconds:g} s each)")
    print("|---|--:|--:|--:|--:|--:|--:|")
    cells = []
    for k, which in (("forked", 0), ("recorded", 0), ("sampled", 0), ("cpu", 0), ("cpu", 1)):
        v = [run[which][k] for run in storms]
        fmt = "{:.1f}" if k == "cpu" else "{:.0f}"
        cells.append(f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
    print(f"| python parent | {rate:g} | " + " | ".join(cells) + " |")
    if args.quick:
        print(QUICK_NOTE)


if __name__ == "__main__":
    main()
