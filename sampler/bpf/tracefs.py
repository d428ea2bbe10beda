"""tracefs: where it is mounted, and the uprobe events a recorder leaves behind.

On kernels without the uprobe PMU, bcc attaches uprobes through named tracefs events,
`allocsampler_<recorder pid>_...` (sampler/bpf/loader.py); a recorder killed with SIGKILL cannot
remove them. The next recorder removes those whose recorder is gone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
EVENT_PREFIX = "allocsampler_"
_OURS = re.compile(r"^[pr]:(?:uprobes/)?(" + EVENT_PREFIX + r"(\d+)_\S*)\s")
MAX_EVENTS_BYTES = 16 << 20          # uprobe_events is read whole: bounded


def root() -> Path | None:
    """The mounted tracefs, None when there is none."""
    return next((Path(b) for b in ROOTS if Path(b, "events").is_dir()), None)


def uprobe_events() -> Path | None:
    base = root()
    return base / "uprobe_events" if base is not None and (base / "uprobe_events").exists() else None


def sweep_stale_events() -> list[str]:
    """Remove the uprobe events of recorders that are no longer running; returns their names.
    Never raises: an event in use or a read-only tracefs leaves things as they are."""
    path = uprobe_events()
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_EVENTS_BYTES).decode(errors="replace")
    except OSError:
        return []
    removed = []
    for line in text.splitlines():
        m = _OURS.match(line)
        if m is None or _alive(int(m.group(2))):
            continue
        try:
            write_command(path, f"-:uprobes/{m.group(1)}")
            removed.append(m.group(1))
        except OSError:
            continue                 # still enabled somewhere, or not ours to remove
    return removed


def write_command(path: Path, line: str) -> None:
    """One command to a tracefs control file (Python's append mode seeks, which tracefs refuses)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
