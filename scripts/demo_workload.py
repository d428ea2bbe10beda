#!/usr/bin/env python3
"""A small leaking "inference service" for the demo (after the BERT-service story in the seeds).

Each request is tokenized and answered. Two things keep memory:
- a request log `deque(maxlen=2000)` of records holding the token ids: it grows, then stays
  flat (a bounded cache, not a leak);
- a per-document cache of encoded payloads keyed by document id that is never evicted: the leak
  (~2 MB/s by default, each payload a bytes object > 512 B, so it comes from malloc).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rate", type=int, default=800, help="requests per second")
    args = ap.parse_args()
    words = [f"w{i}" for i in range(5000)]
    rng = random.Random(1)
    end = time.monotonic() + args.seconds
    doc = 0
    while time.monotonic() < end:
        t0 = time.monotonic()
        for _ in range(args.rate // 10):
            handle(doc, " ".join(rng.choice(words) for _ in range(120)))
            doc += 1
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
    print(f"served {doc} requests; cache holds {sum(map(len, payload_cache.values())) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
