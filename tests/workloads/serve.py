"""A service with two leaks, for the journeys (tests/journeys/test_record.py): `python serve.py`.

    serve.py [--scale K] [--seconds S]

Every 50 ms it serves a batch of requests; each batch keeps K x 16 KiB of Python bytes objects
(cache_response) and K x 16 KiB of C memory through the leakext extension (tests/workloads/
leakext.c, on PYTHONPATH), and churns as much again. Stopped (SIGTERM, or after S seconds), it
prints on stderr one JSON line of its own truth: per leak, the bytes held (as malloc was asked for
them), the least-squares rate of their growth, and the bytes held over time ([wall clock s, bytes]).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import leakext

responses: list[bytes] = []


def cache_response(n: int) -> int:
    responses.append(bytes(n))
    return sys.getsizeof(responses[-1])


def parse_request(n: int) -> int:
    leakext.leak(n, 1)
    return n


def slope(points: list[tuple[float, int]]) -> float:
    n = len(points)
    mt, mb = sum(t for t, _ in points) / n, sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (b - mb) for t, b in points) / var if var else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=600)
    args = ap.parse_args()
    start, epoch = time.monotonic(), time.time()     # epoch: the wall clock of `start`, for the series
    held = {"cache_response": [(0.0, 0)], "parse_request": [(0.0, 0)]}

    def report(*_) -> None:
        # what each leak held when: a recording's last snapshot comes a moment before the stop
        truth = {k: {"bytes": v[-1][1], "rate": slope(v), "series": [[t + epoch, b] for t, b in v]}
                 for k, v in held.items()}
        print(json.dumps({"truth": truth}), file=sys.stderr, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, report)
    py = c = 0
    while time.monotonic() - start < args.seconds:
        t0 = time.monotonic()
        for _ in range(args.scale * 4):
            py += cache_response(4096)
            c += parse_request(4096)
            junk = [bytes(4096) for _ in range(2)]      # churn: freed at once
            del junk
        now = time.monotonic() - start
        held["cache_response"].append((now, py))
        held["parse_request"].append((now, c))
        time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))
    report()


if __name__ == "__main__":
    main()
