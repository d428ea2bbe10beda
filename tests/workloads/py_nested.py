"""Two threads blocked in os.read (GIL released) at known Python stacks, for tests/python/test_runtime.py.

Each thread prints one JSON line, then blocks; the stack it prints comes from the same line as the
read, so it is exactly the stack an outside reader sees while the thread waits. A byte on stdin
ends the process. Runs on CPython 3.10+ (no third-party imports).
"""

import json
import os
import sys
import threading
import traceback

_print_lock = threading.Lock()


def report(stack: traceback.StackSummary) -> int:
    """Print the caller's stack (outermost first) as ground truth; return the byte count to read."""
    qualnames = []
    f = sys._getframe(1)
    while f is not None:
        qualnames.append(getattr(f.f_code, "co_qualname", f.f_code.co_name))
        f = f.f_back
    record = {
        "tid": threading.get_native_id(),
        "version": list(sys.version_info[:2]),
        "stack": [[fs.name, fs.filename, fs.lineno] for fs in stack],
        "qualnames": qualnames[::-1],
    }
    with _print_lock:
        print(json.dumps(record), flush=True)
    return 1


# Main thread: <module> -> main -> outer -> middle -> Holder.method -> inner.


def inner(fd: int) -> bytes:
    return os.read(fd, report(traceback.extract_stack()))


class Holder:
    def method(self, fd: int) -> bytes:
        return inner(fd)


def middle(fd: int) -> bytes:
    return Holder().method(fd)


def outer(fd: int) -> bytes:
    return middle(fd)


# Second thread, non-ASCII names (1- and 2-byte str kinds): threading frames -> worker -> größe -> 深い,
# the last call made from C (map), so 深い starts a new C-level eval call (an entry frame).


def 深い(fd: int) -> bytes:
    return os.read(fd, report(traceback.extract_stack()))


def größe(fd: int) -> bytes:
    return list(map(深い, [fd]))[0]


def worker(fd: int) -> bytes:
    return größe(fd)


def main() -> None:
    r, w = os.pipe()
    t = threading.Thread(target=worker, args=(r,))
    t.start()
    outer(sys.stdin.fileno())
    os.write(w, b"x")
    t.join()


if __name__ == "__main__":
    main()
