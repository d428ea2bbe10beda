"""Small Python objects (pymalloc's: they never reach malloc) leaked at two sites and churned at a
third, with larger ones (malloc's) at a fourth, for the inject tier's Python-object source.

    py_objects.py COUNT   -> prints "ready", waits for a line, runs, prints the truth as JSON:
                             {site function: bytes it keeps}, then waits for a line

The truth is sys.getsizeof of each kept object and of the list that holds them: the size CPython
asked its allocator for (the GC header and the list's item array included; the array is over 512
bytes: malloc's). Each site works in ten paced steps, so that a recording's sample rate stays
under its cap and its mean where it was set.
"""

import json
import sys
import time

COUNT = int(sys.argv[1])
STEPS = 10
kept: dict[str, list] = {}


def leak_small(n):
    kept["leak_small"] = out = []
    for _ in range(STEPS):
        out += [bytes(40) for _ in range(n // STEPS)]
        time.sleep(0.05)


def leak_tuples(n):
    kept["leak_tuples"] = out = []
    for _ in range(STEPS):
        out += [(n,) * 40 for _ in range(n // STEPS)]   # (n,): not a folded constant
        time.sleep(0.05)


def churn(n):
    for _ in range(STEPS):
        for _ in range(n // STEPS):
            x = bytes(200)
            del x
        time.sleep(0.05)


def leak_large(n):
    kept["leak_large"] = out = []
    for _ in range(STEPS):
        out += [bytes(3000) for _ in range(n // STEPS)]
        time.sleep(0.05)


print("ready", flush=True)
sys.stdin.readline()
leak_small(COUNT)
leak_tuples(COUNT // 4)
churn(COUNT)
leak_large(COUNT // 100)
truth = {site: sys.getsizeof(objs) + sum(sys.getsizeof(o) for o in objs) for site, objs in kept.items()}
truth["churn"] = 0
print(json.dumps(truth), flush=True)
sys.stdin.readline()
