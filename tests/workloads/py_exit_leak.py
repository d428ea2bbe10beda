"""A pure-Python service whose per-token statistics grow without bound, then exits gracefully
(CPython's finalization frees them all). Scenario of tests/analysis/test_diagnoses.py.

usage: py_exit_leak.py SECONDS MB_PER_S TRUTH_FILE
Grows for SECONDS at about MB_PER_S of small objects (pymalloc arenas), writes its own truth to
TRUTH_FILE as JSON (RSS growth and its rate over the growth phase, from /proc/self/statm), and
returns from main, leaving the objects to finalization."""

import json
import os
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
stats: dict[str, list] = {}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def record_token(i: int) -> None:
    # one entry ~ 250 B of small objects: the key, a list, two ints and a float
    stats[f"token-{i:09d}"] = [i, i * 7, float(i), f"t{i}"]


def main() -> None:
    seconds, mb_per_s, truth = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    per_tick = int(mb_per_s * 1e6 / 250 / 20)           # 20 ticks per second
    time.sleep(1.0)                                     # the recorder attaches
    start, t0, i = rss(), time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        for _ in range(per_tick):
            record_token(i)
            i += 1
        time.sleep(0.05)
    grown, took = rss() - start, time.monotonic() - t0
    with open(truth, "w") as f:
        json.dump({"rss_growth_bytes": grown, "seconds": took, "rate_bytes_per_s": grown / took,
                   "entries": i}, f)
    time.sleep(0.5)


if __name__ == "__main__":
    main()
