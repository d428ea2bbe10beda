#!/usr/bin/env python3
"""A small leaking "inference service" for the demo (after the BERT-service story in the seeds).

Each request is tokenized and answered. Two things keep memory: a request log `deque(maxlen=2000)`
of records holding the token ids grows, then stays flat (a bounded cache, not a leak); a cache of
encoded payloads keyed by document id is never evicted: the leak (~1.4 MB/s, each payload a bytes
object > 512 B, so it comes from malloc), which the service reports itself when it is stopped."""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import time

request_log: collections.deque = collections.deque(maxlen=2000)
payload_cache: dict[int, bytes] = {}          # the leak: never evicted
token_stats: collections.Counter = collections.Counter()


def tokenize(text: str) -> list[int]:
    return [hash(w) & 0xFFFF for w in text.split()]


def handle(doc_id: int, text: str) -> str:
    ids = tokenize(text)
    token_stats.update(ids[:8])
    request_log.append({"doc": doc_id, "ids": ids})
    payload_cache[doc_id] = json.dumps({"doc": doc_id, "ids": ids}).encode() * 2
    return json.dumps({"doc": doc_id, "label": sum(ids) % 3})


def truth(served: int, held: list[tuple[float, int]]) -> str:
    """What the service says of its own leak: the bytes its cache holds (as malloc was asked for them:
    each payload's size as a Python object) and their rate, a least-squares slope over its life."""
    n = len(held)
    mt, mb = sum(t for t, _ in held) / n, sum(b for _, b in held) / n
    var = sum((t - mt) ** 2 for t, _ in held)
    rate = sum((t - mt) * (b - mb) for t, b in held) / var if var else 0.0
    return (f"demo service: served {served} requests; its payload cache (the leak, in handle()) "
            f"holds {held[-1][1]} bytes, growing {rate:.0f} bytes/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rate", type=int, default=800, help="requests per second")
    args = ap.parse_args()
    words = [f"w{i}" for i in range(5000)]
    rng = random.Random(1)
    start = time.monotonic()
    end = start + args.seconds
    doc, cached = 0, 0
    held = [(0.0, 0)]

    def stop(signum, frame) -> None:        # the recording ends by stopping the service: it says its truth
        print(truth(doc, held), file=sys.stderr, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    while time.monotonic() < end:
        t0 = time.monotonic()
        for _ in range(args.rate // 10):
            handle(doc, " ".join(rng.choice(words) for _ in range(120)))
            cached += sys.getsizeof(payload_cache[doc])
            doc += 1
        held.append((time.monotonic() - start, cached))
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
    print(truth(doc, held), file=sys.stderr)


if __name__ == "__main__":
    main()
