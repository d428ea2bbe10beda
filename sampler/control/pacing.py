"""When the recorder next reads a target's allocator layout from outside (the glibc heap walk,
the pymalloc scan: sampler/proc/arenas.py, sampler/proc/pymalloc.py).

Both read the target's memory in proportion to its heap, so each waits `duty` times what its last
run cost (at most 1/duty of a CPU per process): a small heap is walked at every snapshot, a GiB
heap every minute or two. The pymalloc scan also waits for a reason (a minute passed, or RSS or
the sampled Python bytes moved by an eighth), since it reads every 16 KiB of anonymous memory.
"""

from __future__ import annotations

from dataclasses import dataclass

MOVED = 8                  # a mark moved when it changed by 1/MOVED of its last value
MOVE_FLOOR = float(1 << 20)  # ... and by at least 1/MOVED of this many bytes


@dataclass
class Pace:
    duty: float                  # waits this many times the last run's CPU seconds
    every_s: float = 0.0         # due at least this often when its marks stay; 0: whenever its cost allows
    retry_s: float = 0.0         # after a run that found nothing
    next: float = 0.0            # monotonic: not due before
    at: float = float("-inf")    # monotonic: the last run
    marks: tuple[float, ...] = ()  # what the process looked like then (RSS, sampled bytes)

    def due(self, mono: float, marks: tuple[float, ...] = ()) -> bool:
        if mono < self.next:
            return False
        if not self.every_s or mono - self.at >= self.every_s or len(marks) != len(self.marks):
            return True
        return any(abs(now - then) * MOVED >= max(then, MOVE_FLOOR) for now, then in zip(marks, self.marks,
                                                                                          strict=True))

    def done(self, mono: float, cpu_s: float, found: bool = True, marks: tuple[float, ...] = ()) -> None:
        self.next = mono + (self.duty * cpu_s if found else max(self.retry_s, self.duty * cpu_s))
        self.at, self.marks = mono, marks


def glibc_walk() -> Pace:
    """The glibc free-list walk: whenever its cost allows (0.07 s for an 84 MiB heap: every 7 s)."""
    return Pace(duty=100)


def pymalloc_scan() -> Pace:
    """The pymalloc scan: once a minute or on a move, and 10 minutes after finding no pools (or
    running over its budget: a torch process's GBs of anonymous memory)."""
    return Pace(duty=100, every_s=60.0, retry_s=600.0)
