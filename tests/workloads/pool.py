"""A multiprocessing pool forked during a recording (tests/record/test_families.py): each task
keeps 64 KiB bytearrays in its worker (worker_leak), which reports what it holds in all.

    pool.py WORKERS TASKS MIB -> prints "ready", waits for a line, runs TASKS tasks of MIB MiB on a
                                 fork pool of WORKERS, prints "kept PID:BYTES ..." (each worker's
                                 last total), and keeps the pool until stdin closes.
"""

import multiprocessing as mp
import os
import sys

held: list[bytearray] = []


def worker_leak(mib: int) -> tuple[int, int]:
    held.extend(bytearray(64 << 10) for _ in range(mib * 16))
    return os.getpid(), sum(len(b) for b in held)


if __name__ == "__main__":
    workers, tasks, mib = map(int, sys.argv[1:4])
    print("ready", flush=True)
    sys.stdin.readline()
    with mp.get_context("fork").Pool(workers) as pool:
        kept: dict[int, int] = {}
        for pid, n in pool.imap_unordered(worker_leak, [mib] * tasks, chunksize=1):
            kept[pid] = max(kept.get(pid, 0), n)
        print("kept", *(f"{pid}:{n}" for pid, n in kept.items()), flush=True)
        sys.stdin.read()
