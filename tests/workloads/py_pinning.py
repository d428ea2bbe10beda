"""Python objects that keep pymalloc arenas resident (resident-vs-live attribution: docs/findings.md).

usage: python py_pinning.py interleaved|first [N]

Prints "waiting" and blocks until a line arrives on stdin (a recorder attaches first). Then N
triples of small objects (a 2-tuple of an int and a str: pymalloc blocks) come from two functions: every 8th
from long_lived(), the others from short_lived(),
  interleaved: in one sequence, so that survivors end up in every pool of the new arenas;
  first:       (the control) every survivor first, then the short-lived ones,
and the short-lived ones are dropped. Then it prints its ground truth, from CPython's own
accounting (sys._debugmallocstats) taken after minus before: "live BYTES" (bytes in allocated
blocks), "pinned BYTES" (bytes in available blocks and unused pools: what the survivors keep
resident in arenas pymalloc cannot give back), "arenas N" (arenas allocated now), then "ready",
and sleeps until its stdin closes. CPython says nothing when another allocator stands in for
pymalloc's entry points (allocsampler's --python-objects does): the figures are then "unknown",
and a twin run that nothing records gives them (the same sequence lays out the same arenas).
"""

import os
import re
import sys
import tempfile

STATS = {"live": r"# bytes in allocated blocks\s*=\s*([\d,]+)",
         "available": r"# bytes in available blocks\s*=\s*([\d,]+)",
         "unused": r"(\d+) unused pools \* 16384 bytes", "arenas": r"# arenas allocated current\s*=\s*([\d,]+)"}


def stats() -> dict[str, int] | None:
    # it writes to the C stderr: catch fd 2 in a file
    with tempfile.TemporaryFile("w+") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read()
    found = {k: re.search(rx, text) for k, rx in STATS.items()}
    if not all(found.values()):
        return None
    out = {k: int(m.group(1).replace(",", "")) for k, m in found.items()}
    out["unused"] *= 16384
    return out


# each object of a pair is made here (the int too: the loop's own is dropped), so that all the
# survivors' bytes are this line's
def long_lived(i):
    return (i + 1, str(i))


def short_lived(i):
    return (i + 1, str(i))


def main() -> None:
    mode = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 480_000
    print("waiting", flush=True)
    sys.stdin.readline()
    before = stats()
    keep, drop = [], []
    if mode == "interleaved":
        for i in range(n):
            if i % 8 == 7:
                keep.append(long_lived(i))
            else:
                drop.append(short_lived(i))
    else:
        keep = [long_lived(i) for i in range(n // 8)]
        drop = [short_lived(i) for i in range(n - n // 8)]
    del drop
    after = stats()
    if before is None or after is None:
        print("live unknown\npinned unknown\narenas unknown", flush=True)
    else:
        print(f"live {after['live'] - before['live']}", flush=True)
        print(f"pinned {after['available'] + after['unused'] - before['available'] - before['unused']}", flush=True)
        print(f"arenas {after['arenas']}", flush=True)
    print("ready", flush=True)
    sys.stdin.readline()
    print(len(keep))


if __name__ == "__main__":
    main()
