"""Text a recorded process chose (its comm, exe, cmdline, function and file names) made safe to
print: one function, used by every terminal output, log line and text export; and how a frame
that no symbol names is written, by the recorder's summaries and the reports alike.

A target can name itself or its functions with newlines (forging lines of a log or of collapsed
stacks), escape sequences (rewriting the terminal), bidirectional overrides or surrogate-escaped
bytes. Every character that str.isprintable() rejects is written as a Python escape (\\n, \\x1b,
\\u202e; an undecodable byte as \\xNN), so what is shown is unambiguous and stays on one line.
"""

from __future__ import annotations

from typing import Any

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_CHARS = 4096        # a name longer than this is cut (a cmdline may be 2 MiB)


UNNAMED = "(unnamed)"


def unnamed_frame(module: str | None, offset: int | None) -> str:
    """A native frame no symbol covers: its file and offset, marked so that nobody takes it for
    a function's name (`python3.11+0x1a2b3c (unnamed)`)."""
    where = f"+{int(offset) & ((1 << 64) - 1):#x}" if offset is not None else ""
    return f"{module or '?'}{where} {UNNAMED}"


def printable(value: Any, max_chars: int = MAX_CHARS) -> str:
    """`value` as text with every non-printable character escaped, cut at `max_chars`."""
    s = value if isinstance(value, str) else str(value)
    if len(s) > max_chars:
        s = s[:max_chars] + "..."
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape(c) for c in s)


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    if 0xDC80 <= n <= 0xDCFF:       # an undecodable byte (surrogateescape): the byte itself
        return f"\\x{n - 0xDC00:02x}"
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
