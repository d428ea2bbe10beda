"""A Python parent and its forked children, each child's allocations its own ground truth
(tests/record/test_families.py).

    family.py EARLY   -> forks EARLY children, prints "ready PID..."; then per line on stdin:
      fork N          -> forks N more children, prints "forked PID..."
      alloc MIB       -> every child keeps MIB MiB in 64 KiB bytearrays made in child_leak and
                         prints "kept PID BYTES"
      blink N         -> forks N short-lived children, one at a time: each keeps 4 MiB from its
                         first call (child_leak), prints "kept PID BYTES" and exits at once;
                         then prints "blinked"
      churn N         -> forks N children, one at a time: each maps and unmaps 4 KiB 200 times
                         and exits; then prints "churned SECONDS"
      spawn ARGV...   -> starts ARGV with subprocess (vfork and exec), prints "spawned PID"
      release MIB     -> each spawned program keeps MIB MiB; prints "kept PID BYTES" for each
    EOF ends the children, then the parent.
"""

import mmap
import os
import subprocess
import sys
import time

children: list[tuple[int, int]] = []      # (pid, the write end of its command pipe)
spawned: list[subprocess.Popen] = []


def child_leak(mib: int) -> int:
    kept = [bytearray(64 << 10) for _ in range(mib * 16)]
    globals()["held"] = kept
    return sum(len(b) for b in kept)


def child(r: int) -> None:
    with os.fdopen(r) as commands:
        for line in commands:
            word, arg = line.split()
            if word == "alloc":
                kept = child_leak(int(arg))     # one write: the family shares the pipe
                os.write(1, f"kept {os.getpid()} {kept}\n".encode())
    os._exit(0)


def fork(n: int) -> list[int]:
    pids = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            for _, other in children:
                os.close(other)
            child(r)
        os.close(r)
        children.append((pid, w))
        pids.append(pid)
    return pids


print("ready", *fork(int(sys.argv[1])), flush=True)
for line in sys.stdin:
    word, arg, *more = line.split()
    if word == "fork":
        print("forked", *fork(int(arg)), flush=True)
    elif word == "alloc":
        for _, w in children:
            os.write(w, f"alloc {arg}\n".encode())
    elif word == "spawn":
        p = subprocess.Popen([arg, *more], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        spawned.append(p)
        print("spawned", p.pid, flush=True)
    elif word == "release":
        for p in spawned:
            p.stdin.write(f"{arg}\n")
            p.stdin.flush()
            print("kept", p.pid, p.stdout.readline().split()[1], flush=True)
    elif word == "churn":
        t0 = time.monotonic()
        for _ in range(int(arg)):
            pid = os.fork()
            if pid == 0:
                for _ in range(200):
                    mmap.mmap(-1, 4096).close()
                os._exit(0)
            os.waitpid(pid, 0)
        print("churned", time.monotonic() - t0, flush=True)
    elif word == "blink":
        for _ in range(int(arg)):
            pid = os.fork()
            if pid == 0:
                kept = child_leak(4)
                os.write(1, f"kept {os.getpid()} {kept}\n".encode())
                os._exit(0)
            os.waitpid(pid, 0)
        print("blinked", flush=True)
for pid, w in children:
    os.close(w)
    os.waitpid(pid, 0)
for p in spawned:
    p.stdin.close()
    p.wait()
