#!/usr/bin/env python3
"""The recorder's own bill in steady state: its whole CPU per sample (snapshots, Parquet writes
and everything else included) and its peak RSS, with the default 10 s snapshots and with 1 s ones,
in interleaved rounds, recording
  service: a Python service that handles ~1,000 requests/s (each builds a 40 KB response and a
           small dict), sampled every 64 KiB;
  torch:   a CPU torch training loop (an MLP on random batches), at the default sampling.

    sudo .venv/bin/python scripts/bench_recorder.py [--rounds 3] [--seconds 40] [--workloads service,torch]
                                                    [--code DIR ...]

--code: also run the recorder of these checkouts (e.g. a `git worktree` of an older commit), in
the same rounds, for a before/after comparison on one machine. --quick: one short round, a smoke
test whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"
SERVICE = """
import sys, time
rate = int(sys.argv[1]); keep = []; t0 = time.monotonic(); n = 0
print("ready", flush=True)
while True:
    body = bytes(40000) + b"x"
    d = {str(i): [i] * 8 for i in range(60)}
    keep.append(len(body) + len(d))
    if len(keep) > 100:
        keep.clear()
    n += 1
    delay = t0 + n / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)
"""
TRAINING = """
import torch
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("ready", flush=True)
while True:
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
WORKLOADS = {"service": (SERVICE, ["--sample-bytes", "64K"]), "torch": (TRAINING, [])}


def measure(code: Path, workload: str, interval: float, seconds: float, work: Path, rate: int) -> dict[str, float]:
    source, options = WORKLOADS[workload]
    svc = subprocess.Popen([sys.executable, "-c", source, str(rate)], stdout=subprocess.PIPE, text=True)
    out = Path(tempfile.mkdtemp(dir=work))
    try:
        svc.stdout.readline()
        env = {**os.environ, "PYTHONPATH": str(code)}
        rec = subprocess.Popen([sys.executable, "-m", "sampler.cli", "record", "-p", str(svc.pid), "-o", str(out),
                                "-q", "-i", f"{interval:g}", *options], cwd=code, env=env,
                               stderr=subprocess.PIPE, text=True)
        time.sleep(seconds)
        if rec.poll() is not None:
            raise SystemExit(f"recorder exited: {rec.stderr.read()}")
        hwm = next(int(ln.split()[1]) for ln in Path(f"/proc/{rec.pid}/status").read_text().splitlines()
                   if ln.startswith("VmHWM:")) / 1024
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    finally:
        svc.kill()
    rows = pa.concat_tables([pq.read_table(f) for f in (out / "recorder").rglob("*.parquet")]).to_pylist()
    rows.sort(key=lambda r: r["ts"])
    steady = rows[1:-1] if len(rows) > 2 else rows     # not the start, not the partial last interval
    secs = sum(r["interval_s"] for r in steady)
    cpu = sum(r["cpu_s"] for r in steady)
    samples = sum(r["stacks_unwound"] for r in steady)
    # the children that read target files (unwind rows, names), over the whole run: mostly at its start
    workers = sum((r.get("unwind_worker_cpu_s") or 0.0) + (r.get("name_worker_cpu_s") or 0.0) for r in rows)
    return {"samples_s": samples / secs, "cpu_pct": 100 * cpu / secs, "us_sample": 1e6 * cpu / max(samples, 1),
            "rss": hwm, "workers_s": workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="default 3, --quick 1")
    ap.add_argument("--seconds", type=float, help="recorded per run (default 40, --quick 6)")
    ap.add_argument("--rate", type=int, default=1000, help="requests/s of the service (default %(default)s)")
    ap.add_argument("--workloads", default="service", help="service,torch (default %(default)s)")
    ap.add_argument("--code", type=Path, action="append", default=[], help="another checkout's recorder too")
    ap.add_argument("--quick", action="store_true", help="one short round: a smoke test")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (6.0 if args.quick else 40.0)
    intervals = (1.0,) if args.quick else (10.0, 1.0)
    codes = [ROOT, *args.code]
    work = Path(tempfile.mkdtemp(prefix="bench-recorder-"))
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"unknown workload {', '.join(sorted(unknown))}: choose from {', '.join(WORKLOADS)}")
    results: dict[tuple[str, str, float], list[dict[str, float]]] = {}
    for r in range(rounds):
        for code in codes[r % len(codes):] + codes[:r % len(codes)]:      # rotated: no code always first
            for wl in workloads:
                for ivl in intervals:
                    results.setdefault((str(code), wl, ivl), []).append(
                        measure(code, wl, ivl, seconds, work, args.rate))
    print("| recorder | workload | snapshots every (s) | samples/s | recorder CPU (% of a core) "
          f"| us of recorder CPU per sample | peak RSS (MiB) | workers' CPU, whole run (s) "
          f"|  (median of {rounds}, min-max; {seconds:g} s each)")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for (code, wl, ivl), runs in results.items():
        cells = []
        for k, fmt in (("samples_s", "{:.0f}"), ("cpu_pct", "{:.1f}"), ("us_sample", "{:.0f}"), ("rss", "{:.0f}"),
                        ("workers_s", "{:.2f}")):
            v = [x[k] for x in runs]
            cells.append(f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
        name = "this checkout" if code == str(ROOT) else code
        print(f"| {name} | {wl} | {ivl:g} | " + " | ".join(cells) + " |")
    if args.quick:
        print(QUICK_NOTE)


if __name__ == "__main__":
    main()
