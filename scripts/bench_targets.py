#!/usr/bin/env python3
"""Probe cost per target when several attach-tier processes share one libc.

Commit 3a604cc (2026-11-22) measured 70-230 us of CPU per malloc/free pair in a target
recorded together with three others (against ~2 us alone), on a machine busy with the test
suite. This benchmark repeats the measurement on purpose: a paced malloc/free loop reports its
own CPU time per pair each second, recorded by one `allocsampler record` either alone, with 3
idle attach-tier targets on the same libc, or with 3 more busy loops; the governor is off
(--cpu-budget 0) so that the probes stay attached and the cost is the probes' own.

    sudo .venv/bin/python scripts/bench_targets.py [--rounds 2] [--rate 20000] [--seconds 6] [--quick]

Prints a markdown table (median and max CPU per pair of the measured loop, per scenario).
--quick: one round of 2 s (one measured second), no 15-idle scenario (the 3-idle one runs the
same code with fewer targets) and 0.2 s rather than 1 s for the recorder to settle after its first
rows: a smoke test whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOP_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static void *volatile sink;
static double now(int c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv)
{
    /* argv: SECONDS RATE (0: idle, block on stdin). Waits for a line on stdin first. */
    char buf[16];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    if (!fgets(buf, sizeof buf, stdin)) return 0;
    long rate = atol(argv[2]);
    if (!rate) { while (fgets(buf, sizeof buf, stdin)) ; return 0; }
    for (int s = 0; s < atoi(argv[1]); s++) {
        double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_PROCESS_CPUTIME_ID);
        long done = 0;
        while (done < rate && now(CLOCK_MONOTONIC) - t0 < 1.0) {
            for (int i = 0; i < 1000; i++) { void *p = malloc(64 + (i & 255)); sink = p; free(p); }
            done += 1000;
        }
        double c1 = now(CLOCK_PROCESS_CPUTIME_ID);
        while (now(CLOCK_MONOTONIC) - t0 < 1.0) usleep(500);
        printf("%ld %.6f\n", done, c1 - c0);
    }
    return 0;
}
"""
SCENARIOS = {"alone": (0, 0), "with 3 idle targets": (3, 0), "with 3 busy targets": (0, 3),
             "with 15 idle targets": (15, 0)}
QUICK_SCENARIOS = ("alone", "with 3 idle targets", "with 3 busy targets")
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


def start(exe: Path, seconds: int, rate: int) -> subprocess.Popen:
    p = subprocess.Popen([str(exe), str(seconds), str(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def run(exe: Path, out: Path, idle: int, busy: int, rate: int, seconds: int, settle: float = 1.0) -> list[float]:
    """us of CPU per pair of the measured loop, one value per second."""
    measured = start(exe, seconds, rate)
    others = [start(exe, seconds, 0) for _ in range(idle)] + [start(exe, seconds, rate) for _ in range(busy)]
    procs = [measured, *others]
    cmd = [sys.executable, "-m", "sampler.cli", "record", "-o", str(out), "-i", "2", "--cpu-budget", "0", "-q"]
    for p in procs:
        cmd += ["--pid", str(p.pid)]
    rec = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any((out / "targets").glob("host=*/date=*/*.parquet")):
            if rec.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the recorder did not attach: {rec.stderr.read()}")
            time.sleep(0.05)
        time.sleep(settle)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        per_pair = []
        for _ in range(seconds):
            done, cpu = measured.stdout.readline().split()
            per_pair.append(1e6 * float(cpu) / int(done))
        return per_pair
    finally:
        for p in procs:
            p.kill()
            p.wait()
        rec.send_signal(2)
        rec.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, help="default 2, --quick 1")
    ap.add_argument("--rate", type=int, default=20000, help="pairs per second of each busy loop")
    ap.add_argument("--seconds", type=int, help="default 6, --quick 2 (the first second is not counted)")
    ap.add_argument("--quick", action="store_true", help="one short round, three scenarios: a smoke test")
    a = ap.parse_args()
    if a.rounds is None:
        a.rounds = 1 if a.quick else 2
    if a.seconds is None:
        a.seconds = 2 if a.quick else 6
    if a.seconds < 2:
        ap.error("--seconds must be >= 2 (the first second includes attaching and is not counted)")
    scenarios = {k: v for k, v in SCENARIOS.items() if not a.quick or k in QUICK_SCENARIOS}
    if os.geteuid() != 0:
        print("bench_targets: needs root (BPF)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="bench_targets.") as tmp:
        exe = Path(tmp, "loop")
        Path(tmp, "loop.c").write_text(LOOP_C)
        subprocess.run(["cc", "-O2", "-o", str(exe), str(Path(tmp, "loop.c"))], check=True)
        results: dict[str, list[float]] = {k: [] for k in scenarios}
        for r in range(a.rounds):                   # interleaved: drift hits every scenario alike
            for name, (idle, busy) in scenarios.items():
                v = run(exe, Path(tmp, f"{r}-{idle}-{busy}"), idle, busy, a.rate, a.seconds, 0.2 if a.quick else 1.0)
                results[name] += v[1:]              # the first second includes attaching
                print(f"round {r + 1} {name}: {' '.join(f'{x:.2f}' for x in v)} us/pair", file=sys.stderr)
    print(f"\n| scenario ({a.rate} pairs/s, governor off) | median us CPU/pair | max | seconds |")
    print("|---|--:|--:|--:|")
    for name, v in results.items():
        print(f"| {name} | {statistics.median(v):.2f} | {max(v):.2f} | {len(v)} |")
    if a.quick:
        print(QUICK_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
