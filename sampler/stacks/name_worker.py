"""Names native frames (function, source line, inlined calls) in a child process
(sampler/stacks/worker.py).

Symbol tables and DWARF are the biggest things read from a target's files, and the ones a target
shapes most freely (a few hundred KiB of compressed sections inflate to gigabytes; a DIE tree can
cost seconds). Read here, what a file costs is the child's: within its address-space limit, within
symbolize.NAME_TIMEOUT_S per recorder snapshot (a child still reading then is killed). A file that
fails (malformed, over its budget; over the child's memory or too slow twice) is not asked for
again: its frames keep their file and offset. Debug files (and debuginfod's downloads) are looked
for here too.

The child opens the file through the recorder's own descriptor of it (/proc/RECORDER/fd/N): the
file the process mapped, whatever its path names now, even once the process has exited.

Protocol: one JSON line per request on the child's stdin ({"id", "path", "seen_as", "debug",
"offsets"}; `debug`: the recorder's descriptor of the debug file it found and verified, or null),
one per answer on its stdout ({"id", "names": [[function, file, line, [[function, file, line],
...]], ...]}, one per offset, inlined calls innermost first; or {"id", "error"}).

    python -m sampler.stacks.name_worker PARENT_PID
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import weakref
from typing import IO

from sampler.binary.dwarf_lines import LineTables
from sampler.binary.elf import ElfImage
from sampler.binary.reader import MALFORMED, FileBytes
from sampler.stacks.symbolize import Named, name_at
from sampler.stacks.worker import IDLE_S, Child, child_setup

MAX_ANSWER_BYTES = 64 << 20
MAX_NAME = 4096             # characters of a function or file name kept
MAX_INLINED = 64            # inlined calls kept per address
STRIKE_AFTER_S = 2.0        # a request killed sooner was cut by the snapshot's budget, not its file's
STRIKES = 2                 # late answers or dead children before a file is not asked for again


class NameWorker:
    """Asks the child for the names of offsets in one image at a time, waiting for the answer
    (`name`); failed images are remembered and not asked for again."""

    def __init__(self):
        self._child = Child("sampler.stacks.name_worker", network=True)    # debuginfod is asked there
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._last_used = time.monotonic()
        self.failed: weakref.WeakSet[ElfImage] = weakref.WeakSet()
        self._strikes: weakref.WeakKeyDictionary[ElfImage, int] = weakref.WeakKeyDictionary()
        self.failures = 0

    def cpu_seconds(self) -> float:
        return self._child.cpu_seconds()

    def can_name(self, img: ElfImage) -> bool:
        """Whether `img` is read through a descriptor the child can open (and has not failed)."""
        return isinstance(img.elf.buf, FileBytes) and img not in self.failed

    def strikes(self, img: ElfImage) -> int:
        """How many times `img` ran out of time or killed the child (0 for a file never slow)."""
        return self._strikes.get(img, 0)

    def name(self, img: ElfImage, seen_as: str, offsets: list[int], deadline: float) -> list[Named] | None:
        """The names at `offsets` (vaddrs in `img`, which its process maps from `seen_as`), or None:
        the image failed (now or before), or the deadline (time.monotonic()) passed first."""
        if not self.can_name(img) or time.monotonic() >= deadline:
            return None
        self.warm()
        self._seq += 1
        debug = img.debug_elf.buf if img.debug_elf is not None else None
        line = json.dumps({"id": self._seq, "path": _ours(img.elf.buf), "seen_as": seen_as, "offsets": offsets,
                           "debug": _ours(debug) if isinstance(debug, FileBytes) else None}) + "\n"
        self._last_used = started = time.monotonic()
        if not self._child.send(line.encode()):
            self._child.close(kill=True)
            return self._strike(img)
        while True:
            try:
                seq, doc = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._child.close(kill=True)        # still reading this file
                # its fault only when it had time of its own: else the snapshot's budget ran out
                return self._strike(img) if time.monotonic() - started >= STRIKE_AFTER_S else None
            if seq is None:                          # the child died on it (its memory limit, say), or
                self._child.close(kill=True)         # its answer was not one: never left half-read
                return self._strike(img)
            if seq != self._seq:
                continue                             # the answer to a request given up on
            try:
                names = [bounded(_named(n)) for n in doc["names"]]
            except (KeyError, TypeError, ValueError):
                names = []
            if len(names) != len(offsets):
                return self._fail(img)
            return names

    def warm(self) -> None:
        """The child started, when it is not running (it then loads while the caller goes on)."""
        if not self._child.running:
            out = self._child.start()
            self._answers = queue.SimpleQueue()     # a killed child's reader still reports its end
            threading.Thread(target=_read_answers, args=(out, self._answers), daemon=True,
                             name="name-worker").start()
            self._last_used = time.monotonic()

    def _strike(self, img: ElfImage) -> None:
        """No answer in time, or the child died: the file fails at the second time (a first may be
        a cold start on a busy machine)."""
        self._strikes[img] = self._strikes.get(img, 0) + 1
        return self._fail(img) if self._strikes[img] >= STRIKES else None

    def _fail(self, img: ElfImage) -> None:
        self.failed.add(img)
        self.failures += 1
        return None

    def idle(self) -> None:
        """Called between snapshots: the child exits after IDLE_S without work."""
        if self._child.running and time.monotonic() - self._last_used > IDLE_S:
            self._child.close()
        self._child.reap()

    def close(self) -> None:
        self._child.close()
        self._child.reap(wait=True)


def _ours(f: FileBytes) -> str:
    """The path through which the child opens our descriptor of a file: the very file we read."""
    return f"/proc/{os.getpid()}/fd/{f.fd}"


def bounded(n: Named) -> Named:
    """`n` within what a frame row holds (names a target's DWARF chose can be of any length, lines
    any number): applied by the child before it answers and again here."""
    def text(v: object) -> str | None:
        return v[:MAX_NAME] if isinstance(v, str) else None

    def line(v: object) -> int | None:
        return v if isinstance(v, int) and 0 <= v < 1 << 31 else None

    return Named(text(n.function), text(n.file), line(n.line),
                 tuple((text(f), text(p), line(k)) for f, p, k in n.inlined[:MAX_INLINED]))


def _named(doc: list) -> Named:
    fn, file, line, inlined = doc
    return Named(fn, file, line, tuple((f, p, k) for f, p, k in inlined[:MAX_INLINED]))


def _read_answers(out: IO[bytes], answers: queue.SimpleQueue) -> None:
    try:
        while line := out.readline(MAX_ANSWER_BYTES):
            doc = json.loads(line)
            answers.put((int(doc["id"]), doc))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    answers.put((None, None))


# -- the child's side ------------------------------------------------------------------------------

def child_main(argv: list[str]) -> int:
    # the recorder's loop waits for its answers: at a lower priority than the loop, a busy host
    # would hold the loop up (the 64 stubborn processes of test_daemon_placement: 22 s)
    child_setup(argv, nice=0)
    out = sys.stdout.buffer
    for line in sys.stdin:
        req = json.loads(line)
        try:
            img = ElfImage.open(req["path"], req["seen_as"], debug=req.get("debug"))
            names = [name_at(img, int(off)) for off in req["offsets"]]
        except MemoryError:
            # over the address-space limit: what this child keeps goes, and the file is not retried
            ElfImage.forget()
            LineTables.prune(shed=2)
            answer = {"id": req["id"], "error": "MemoryError"}
        except (OSError, *MALFORMED) as e:
            answer = {"id": req["id"], "error": f"{type(e).__name__}: {e}"[:200]}
        else:
            answer = {"id": req["id"], "names": [[n.function, n.file, n.line, n.inlined] for n in map(bounded, names)]}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
