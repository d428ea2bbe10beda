"""Leaking Python workloads for the readable-stacks tests.

    py_leak.py MODE SIZE COUNT      (MODE: ext, ext_nogil, bytes, torch)

Prints "ready", waits for a line on stdin, leaks through three nested functions, prints "done"
and waits for another line. Tests find the expected lines by the `# L:` markers.
"""

import sys

MODE, SIZE, COUNT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kept = []


def do_leak():
    if MODE.startswith("ext"):
        import leakext
        leakext.leak(SIZE, COUNT, MODE == "ext_nogil")  # L:ext
    elif MODE == "torch":
        import torch
        for _ in range(COUNT):
            kept.append(torch.ones(SIZE // 4, dtype=torch.float32))  # L:torch
    else:
        for _ in range(COUNT):
            kept.append(bytearray(SIZE))  # L:bytes


def middle():
    do_leak()  # L:middle


def outer():
    middle()  # L:outer


if MODE == "torch":
    import torch  # noqa: F401  (imported before "ready": loading it maps many libraries)
elif MODE.startswith("ext"):
    import leakext  # noqa: F401  (mapped before "ready", as torch is)
print("ready", flush=True)
sys.stdin.readline()
outer()  # L:module
print("done", flush=True)
sys.stdin.readline()
