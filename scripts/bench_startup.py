#!/usr/bin/env python3
"""Start-up of `allocsampler record -p PID`: from launch until the target is attached (sampling
from then on), the recorder's wall time, CPU time (user and system) and peak RSS, with the
compiled BPF programs cached (warm) and not (cold), on idle targets (a Python process and a torch
one), interleaved in rounds.

Both modes share warm unwind tables and probe cost: only sampler/bpf/objcache.py's cache differs.

    sudo .venv/bin/python scripts/bench_startup.py --rounds 5 [--targets python,torch,sleep] [--code DIR ...]

--code: also start the recorder of these checkouts (e.g. a `git worktree` of an older commit) in
the same rounds, for a before/after comparison on one machine.

--quick: one round (the priming start, one cold and one warm start), a smoke test whose numbers
mean nothing. Its priming start begins from a copy of the host's cache (what `record` uses by
default: $ALLOCSAMPLER_CACHE_DIR or /var/cache/allocsampler) rather than from nothing, so that the
cold start is its one BPF compile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


TARGETS = {
    "python": [sys.executable, "-c", "import time; time.sleep(1e6)"],
    "torch": [sys.executable, "-c", "import time, torch; print('ready', flush=True); time.sleep(1e6)"],
    "sleep": ["sleep", "1000000"],
}


def launch(name: str) -> subprocess.Popen:
    proc = subprocess.Popen(TARGETS[name], stdout=subprocess.PIPE, text=True)
    if name == "torch":
        proc.stdout.readline()          # torch imported
    time.sleep(0.5)
    return proc


def start(target: int, cache: Path, out: Path, code: Path = ROOT) -> dict[str, float]:
    env = {**os.environ, "ALLOCSAMPLER_CACHE_DIR": str(cache), "PYTHONPATH": str(code)}
    t0 = time.monotonic()
    rec = subprocess.Popen([sys.executable, "-m", "sampler.cli", "record", "-p", str(target), "-o", str(out),
                            "-q", "-i", "1"], cwd=code, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        while not any((out / "targets").glob("host=*/date=*/*.parquet")):
            if rec.poll() is not None:
                raise SystemExit(f"recorder exited: {rec.stderr.read()}")
            if time.monotonic() - t0 > 120:
                raise SystemExit("recorder did not attach within 120 s")
            time.sleep(0.02)
        wall = time.monotonic() - t0
        stat = Path(f"/proc/{rec.pid}/stat").read_text().rsplit(")", 1)[1].split()
        user, system = int(stat[11]) / TICK, int(stat[12]) / TICK
        rss = next(int(ln.split()[1]) for ln in Path(f"/proc/{rec.pid}/status").read_text().splitlines()
                   if ln.startswith("VmHWM:")) / 1024
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    return {"wall": wall, "cpu": user + system, "user": user, "sys": system, "rss": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="default 5, --quick 1")
    ap.add_argument("--targets", default="python,torch", help="of " + ", ".join(TARGETS))
    ap.add_argument("--code", type=Path, action="append", default=[], help="another checkout's recorder too")
    ap.add_argument("--quick", action="store_true", help="one round: a smoke test")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    codes = [ROOT, *args.code]
    names = [n for n in args.targets.split(",") if n]
    if args.quick:
        names = names[:1]
    targets = {n: launch(n) for n in names}
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        warm = {c: work / f"warm{i}" for i, c in enumerate(codes)}
        if args.quick:
            host = Path(os.environ.get("ALLOCSAMPLER_CACHE_DIR") or "/var/cache/allocsampler")
            for c in codes:
                with contextlib.suppress(OSError, shutil.Error):  # what is missing, the priming start fills
                    shutil.copytree(host, warm[c], ignore=shutil.ignore_patterns(".*"))
        for c in codes:
            start(targets[names[0]].pid, warm[c], work / f"prime{codes.index(c)}", c)      # fills every cache once
        results: dict[tuple[Path, str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for c in codes[r % len(codes):] + codes[:r % len(codes)]:       # rotated: none always first
                for name, target in targets.items():
                    for mode in ("cold", "warm"):
                        cache = warm[c]
                        if mode == "cold":
                            cache = work / f"cold{r}{name}{codes.index(c)}"
                            shutil.copytree(warm[c], cache, ignore=shutil.ignore_patterns("bpf"))
                        results.setdefault((c, name, mode), []).append(
                            start(target.pid, cache, work / f"{mode}{r}{name}{codes.index(c)}", c))
        print(f"| target | BPF programs | attached after (s) | recorder CPU (s) | of it user | of it system | "
              f"recorder peak RSS (MiB) |  (median of {args.rounds}, min-max)")
        print("|---|---|--:|--:|--:|--:|--:|")
        for (c, name, mode), runs in sorted(results.items(), key=lambda kv: (codes.index(kv[0][0]), kv[0][1:])):
            cells = []
            for k in ("wall", "cpu", "user", "sys", "rss"):
                v = [x[k] for x in runs]
                fmt = "{:.0f}" if k == "rss" else "{:.2f}"
                cells.append(f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
            label = name if c == ROOT else f"{name} ({c})"
            print(f"| {label} | {'compiled (cold cache)' if mode == 'cold' else 'loaded from the cache'} | "
                  + " | ".join(cells) + " |")
        if args.quick:
            print(QUICK_NOTE)
    finally:
        for t in targets.values():
            t.kill()
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    main()
