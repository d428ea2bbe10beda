"""A Python (or torch) workload that checks its own work while a recorder injects, redirects and
restores its allocator calls, CPython's object allocator included (tests/inprocess/test_inject.py).

    py_stress.py python|torch ITERATIONS   -> prints "ready", waits for a line, works until the
                                              next line or EOF, then "ok CHECKSUM SIGNALS FORKS"
                                              (exit 0)

8 threads (4 with torch) build and verify objects of every small size class (tuples, dicts, strings,
bytes, lists that grow through realloc) or torch tensors, each from its own random stream, so the
checksum is the same in every run; a signal handler allocates; a thread forks children that
allocate and verify; midway an extension module is loaded (dlopen). Anything that corrupts memory
or loses an object changes the checksum or crashes the process. The work is repeated from the same
seeds until stdin says stop, so a recorder always finds it running; every repeat must give the first
one's checksum.
"""

import os
import random
import signal
import sys
import threading
import zlib

MODE, ITERATIONS = sys.argv[1], int(sys.argv[2])
THREADS = 4 if MODE == "torch" else 8
signals = 0
forks = 0

if MODE == "torch":
    import torch
    torch.set_num_threads(1)        # one intra-op thread: sums in a fixed order


def objects(rng: random.Random, n: int) -> int:
    """Objects of mixed sizes, kept a while, checked and dropped; returns a CRC of what was checked."""
    crc, keep = 0, []
    for _ in range(n):
        k = rng.randrange(6)
        if k == 0:
            o = tuple(range(rng.randrange(1, 60)))
        elif k == 1:
            o = {j: str(j) for j in range(rng.randrange(1, 20))}
        elif k == 2:
            o = "s" * rng.randrange(1, 700)
        elif k == 3:
            o = bytes(rng.randrange(1, 600))
        elif k == 4:
            o = []
            for j in range(rng.randrange(1, 200)):
                o.append(j)     # grows through PyMem_Realloc
        else:
            o = bytearray(rng.randrange(1, 3000))
        keep.append(o)
        if len(keep) > 64:
            crc = zlib.crc32(repr(keep.pop(rng.randrange(len(keep)))).encode(), crc)
    return zlib.crc32(repr(keep).encode(), crc)


def tensors(rng: random.Random, n: int) -> int:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    crc = 0
    for _ in range(n):
        a = torch.randint(-100, 100, (rng.randrange(1, 64), 32), generator=g)
        b = torch.randint(-100, 100, (32, rng.randrange(1, 64)), generator=g)
        c = (a @ b).sum(dim=0)
        crc = zlib.crc32(str(int(c.sum())).encode() + str(tuple(c.shape)).encode(), crc)
    return crc


work = tensors if MODE == "torch" else objects


def round_of(i: int) -> int:
    rng = random.Random(i)
    crc = 0
    for step in range(ITERATIONS):
        crc = zlib.crc32(str(work(rng, 50)).encode(), crc)
        if i == 0 and step == ITERATIONS // 2:
            import _decimal  # noqa: F401  (a C extension, dlopen'ed midway)
    return crc


def worker(i: int, out: list, stopping: threading.Event) -> None:
    out[i] = round_of(i)
    while not stopping.is_set():
        if round_of(i) != out[i]:
            print("corrupt: a repeated round gave another checksum", flush=True)
            os._exit(1)


def forker(stop: threading.Event) -> None:
    global forks
    n = 0
    while not stop.is_set() and n < 20:
        pid = os.fork()
        if pid == 0:                  # the child inherits the redirected allocator: it must work
            rng = random.Random(1000 + n)
            os._exit(0 if objects(rng, 200) == objects(random.Random(1000 + n), 200) else 3)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print(f"child failed {status}", flush=True)
            os._exit(1)
        forks += 1
        n += 1
        stop.wait(0.05)


def on_alarm(_sig, _frame) -> None:
    global signals
    signals += 1
    assert sum(len(str(x)) for x in [{"a": [1.5] * 10}] * 20) > 0     # allocates in the handler


print("ready", flush=True)
sys.stdin.readline()
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
results = [0] * THREADS
stop = threading.Event()
fk = threading.Thread(target=forker, args=(stop,))
fk.start()
stopping = threading.Event()
threads = [threading.Thread(target=worker, args=(i, results, stopping)) for i in range(THREADS)]
for t in threads:
    t.start()
sys.stdin.readline()            # a line or EOF: stop after the current round
stopping.set()
for t in threads:
    t.join()
signal.setitimer(signal.ITIMER_REAL, 0, 0)
stop.set()
fk.join()
print("ok", zlib.crc32(repr(results).encode()), signals, forks, flush=True)
