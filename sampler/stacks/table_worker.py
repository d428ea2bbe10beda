"""Builds files' unwind rows (sampler/stacks/unwind_rows.py) in a child process.

Decoding every FDE of a big library takes seconds of CPU; in the recorder it would stall the
ring buffer's reader (and the GIL) that long. The child (sampler/stacks/worker.py: an address-space
limit, a lower priority) dies with the recorder and exits when idle (the next build starts
another). Samples whose files are not built yet are unwound in user space meanwhile (BPF hands
them over), so nothing waits for it.

Protocol: one JSON line per request on the child's stdin ({"id", "path", "seen_as", "root"}),
one JSON line per answer on its stdout ({"id", "key", "loads", "fits", "digest", "file", "rows"} or
{"id", "error"}), followed by `rows` bytes of `uw_row`s. `file` is files.identity of the very
descriptor the rows were read from: the recorder ties a mapping to them only when its own file
has that identity. A reader thread turns answers into a queue.

    python -m sampler.stacks.table_worker PARENT_PID [CACHE_DIR]
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import IO

import numpy as np

from sampler import files
from sampler.binary import debuginfod
from sampler.binary.elf import ElfImage
from sampler.binary.reader import MALFORMED, open_regular
from sampler.stacks.unwind_rows import ROW, FileRows, build
from sampler.stacks.worker import IDLE_S, Child, child_setup

MAX_ANSWER_BYTES = (1 << 23) * ROW.itemsize + (1 << 20)


class BuildFailed(Exception):
    """The child could not build a file's rows: unreadable or malformed, or the child died
    (`worker_died`: killed at its address space limit, say, perhaps by another file's build)."""

    def __init__(self, why: str, worker_died: bool = False, gone: bool = False):
        super().__init__(why)
        self.worker_died = worker_died
        self.gone = gone        # the mapping it was opened through is gone (exec, exit, unmap): not the file's fault


class TableWorker:
    """Builds in one child, one file at a time, in submission order. `done()` returns finished
    builds: (ident, FileRows) or (ident, BuildFailed)."""

    def __init__(self, cache_dir: Path | None = None):
        self._child = Child("sampler.stacks.table_worker", str(cache_dir) if cache_dir else "")
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, object] = {}
        self._seq = 0
        self._idle_since = time.monotonic()
        self.builds = 0
        self.failures = 0
        self._exited_cpu_s = 0.0          # CPU time of children that have exited

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every child so far, the running one included."""
        return self._child.cpu_seconds()

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def submit(self, ident: object, path: str, seen_as: str, root: str) -> None:
        if not self._child.running:
            out = self._child.start()
            threading.Thread(target=_read_answers, args=(out, self._answers), daemon=True,
                             name="table-worker").start()
        self._seq += 1
        self._jobs[self._seq] = ident
        line = json.dumps({"id": self._seq, "path": path, "seen_as": seen_as, "root": root}) + "\n"
        if not self._child.send(line.encode()):
            self._answers.put((self._seq, BuildFailed("the table worker exited", worker_died=True)))

    def done(self) -> list[tuple[object, FileRows | BuildFailed]]:
        out: list[tuple[object, FileRows | BuildFailed]] = []
        while True:
            try:
                seq, result = self._answers.get_nowait()
            except queue.Empty:
                break
            if seq is None:                  # the child exited: whatever it had is lost
                for s in list(self._jobs):
                    out.append((self._jobs.pop(s), BuildFailed("the table worker exited", worker_died=True)))
                continue
            ident = self._jobs.pop(seq, None)
            if ident is None:
                continue
            if isinstance(result, BuildFailed):
                self.failures += 1
            else:
                self.builds += 1
            out.append((ident, result))
        now = time.monotonic()
        if self._jobs:
            self._idle_since = now
        elif self._child.running and now - self._idle_since > IDLE_S:
            self._child.close()
        self._child.reap()
        return out

    def close(self) -> None:
        self._child.close()
        self._child.reap(wait=True)


def _read_exactly(out: IO[bytes], n: int) -> bytearray | None:
    """`n` bytes into one buffer (read(n) of a pipe joins its pieces: twice the answer at once,
    40 MiB for libtorch_cpu's rows); None at an early end."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = out.readinto(view[got:])
        if not k:
            return None
        got += k
    return buf


def _read_answers(out: IO[bytes], answers: queue.SimpleQueue) -> None:
    try:
        while line := out.readline():
            doc = json.loads(line)
            if "error" in doc:
                answers.put((doc["id"], BuildFailed(str(doc["error"])[:200], gone=bool(doc.get("gone")))))
                continue
            nbytes = int(doc["rows"])
            if not 0 <= nbytes <= MAX_ANSWER_BYTES or nbytes % ROW.itemsize:
                break
            data = _read_exactly(out, nbytes)
            if data is None:
                break
            rows = np.frombuffer(data, ROW)
            answers.put((doc["id"], FileRows(doc["key"], rows, tuple(map(tuple, doc["loads"])), bool(doc["fits"]),
                                             str(doc["digest"]), tuple(int(x) for x in doc["file"]))))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    answers.put((None, None))


# -- the child's side ------------------------------------------------------------------------------

def child_main(argv: list[str]) -> int:
    child_setup(argv)
    debuginfod.leave_to_workers()       # debug files are downloaded for names, by the name worker
    cache = Path(argv[1]) if len(argv) > 1 and argv[1] else None
    out = sys.stdout.buffer
    for line in sys.stdin:
        req = json.loads(line)
        try:
            fd = open_regular(req["path"])
            try:
                ident = files.identity(os.fstat(fd))
                # through this descriptor: the file whose identity is answered, whatever the path names now
                fr = build(ElfImage.open(f"/proc/self/fd/{fd}", req["seen_as"], req["root"]), cache)
            finally:
                os.close(fd)
        except (OSError, MemoryError, *MALFORMED) as e:
            gone = isinstance(e, (FileNotFoundError, ProcessLookupError))
            out.write(json.dumps({"id": req["id"], "error": f"{type(e).__name__}: {e}", "gone": gone}).encode()
                      + b"\n")
            out.flush()
            continue
        data = fr.rows.tobytes()
        out.write(json.dumps({"id": req["id"], "key": fr.key, "loads": fr.loads, "fits": fr.fits,
                              "digest": fr.digest, "file": ident, "rows": len(data)}).encode() + b"\n")
        out.write(data)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
