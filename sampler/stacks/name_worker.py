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
STRIKES = 2                 # late answers or dead children before a file is not asked for again


class NameWorker:
    """Asks the child for the names of offsets in one image at a time, waiting for the answer
    (`name`); failed images are remembered and not asked for again."""

    def __init__(self):
        self._child = Child("sampler.stacks.name_worker")
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
        self._last_used = time.monotonic()
        if not self._child.send(line.encode()):
            return self._fail(img)
        while True:
            try:
                seq, doc = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._child.close(kill=True)        # still reading this file: it is the one at fault
                return self._strike(img)
            if seq is None:                          # the child died on it (its memory limit, say)
                return self._strike(img)
            if seq != self._seq:
                continue                             # the answer to a request given up on
            names = doc.get("names")
            if not isinstance(names, list) or len(names) != len(offsets):
                return self._fail(img)
            return [_named(n) for n in names]

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
            self.close()

    def close(self) -> None:
        self._child.close()


def _ours(f: FileBytes) -> str:
    """The path through which the child opens our descriptor of a file: the very file we read."""
    return f"/proc/{os.getpid()}/fd/{f.fd}"


def _named(doc: list) -> Named:
    fn, file, line, inlined = doc
    return Named(_str(fn), _str(file), _int(line), tuple((_str(f), _str(p), _int(n)) for f, p, n in inlined))


def _str(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) else None


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
    child_setup(argv)
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
            answer = {"id": req["id"], "names": [[n.function, n.file, n.line, n.inlined] for n in names]}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
